"""Dynamic loss scaling, agreed across ranks: fp16 gradients that neither underflow nor poison a step.

fp16 has 5 exponent bits: below its smallest subnormal (6e-8) a gradient becomes 0 (silent: training
stalls), past 65504 it becomes inf, and inf - inf = NaN (loud: one step is poisoned). Loss scaling
(Micikevicius et al., "Mixed Precision Training", 2018) backpropagates S*loss: the chain rule is linear, so
every gradient is S times larger and lifts out of the underflow zone; it is divided by S in fp32 before the
step. Too large an S overflows, so the scale is dynamic, and an overflow costs one skipped step:

    inf/NaN found:               skip the step,  S <- S * backoff_factor
    growth_interval clean steps:                 S <- S * growth_factor

With growth_factor * backoff_factor = 1 and steady gradients the scale settles at the overflow edge: it
grows after I clean steps, overflows, backs off, so the skip rate is 1 / (I + 1), and starting from S0 the
first overflow comes at step I * log2(S_edge / S0). bf16 keeps fp32's 8 exponent bits: it needs no scaling.

Why every rank must agree on the overflow before anyone steps. With plain DDP gradients are all-reduced
first and inf + x = inf, so every replica sees it. But when each rank checks only its own slice (ZeRO-2/3
and FSDP after a reduce-scatter, tensor- and pipeline-parallel shards), an inf in rank 1's slice is
invisible to rank 0:

    rank 0: found_inf = 0 -> steps its shard, keeps S       rank 1: found_inf = 1 -> skips, S <- S/2

The model is now half updated, and next iteration rank 0 backpropagates with S and rank 1 with S/2, so
every gradient sum they share is wrong from then on. Naive: each rank decides alone (a group of one rank).
Agreed: one all-reduce(MAX) of every rank's flag before the step makes the decision global.

On a whiteboard the unscale is two passes over each gradient, an inf/NaN check, then g * 1/S
(`unscale_textbook`); the scaler runs both in one pass, one launch per dtype, with the fused kernel that
GradScaler and Megatron-LM's scaler call (`unscale_and_check`), and reads the agreed flag once per iteration.

    torchrun --standalone --nproc_per_node=4 mini_dist/loss_scaling.py [--steps 48 --growth-interval 4]

Mirrors torch.amp.GradScaler bit for bit (scale, skip decision, parameters), and for the cross-rank flag
torch.distributed.fsdp.ShardedGradScaler. The fp32 master weights fp16 needs: mini_dist/mixed_precision.py.
"""
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch


class DynamicLossScaler:
    """scale(loss).backward(); [unscale_(opt); clip]; step(opt); update() -- once per iteration."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 group=None):
        check_hyper_parameters(init_scale, growth_factor, backoff_factor, growth_interval)
        self._scale = to_float32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.group = growth_interval, group
        self._growth_tracker = 0  # clean steps since the last growth or overflow
        self._found_inf = {}      # id(optimizer) -> this iteration's agreed inf/NaN flag (a bool)
        self._stepped = set()     # id(optimizer) of those stepped (or skipped) this iteration

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        # a 0-dim fp32 tensor, as GradScaler's: an fp16 loss times it is promoted to fp32, so it reads finite
        return loss * torch.full((), self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and agree with every rank of the group on inf/NaN."""
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None
                 and g.numel()]  # each .grad read once: per parameter, Python time adds up
        device = grads[0].device if grads else optimizer.param_groups[0]["params"][0].device
        # The reciprocal in fp64 rounded to fp32, as GradScaler does (fast-math fp32 division can be off);
        # torch.full fills it on the device, where a copy from the host would wait for the device
        inv_scale = torch.full((), 1.0 / self._scale, dtype=torch.float32, device=device)
        with torch.no_grad():
            found_inf = unscale_and_check(grads, inv_scale)
        fp16 = torch.float16 in {g.dtype for g in grads}
        self._found_inf[id(optimizer)] = agree_on_overflow(found_inf, fp16, self.group)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """optimizer.step(), unless some rank found inf/NaN: then every rank skips it."""
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        return None if self._found_inf[id(optimizer)] else optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflow (any optimizer's), grow after growth_interval clean iterations. Each
        new scale is the product in fp64 rounded to fp32 (to_float32), as torch._amp_update_scale_ makes it."""
        overflow = self.end_iteration()
        # exercise: overflow: S *= backoff, tracker = 0; else at the growth_interval-th clean step S *= growth
        if overflow:
            self._scale = to_float32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = to_float32(self._scale * self.growth_factor)
                if math.isfinite(grown):  # never grow past fp32's max into inf
                    self._scale = grown
                self._growth_tracker = 0
        # end exercise

    def end_iteration(self) -> bool:
        """Whether any optimizer's gradients overflowed this iteration; forgets the iteration."""
        if not self._found_inf:
            raise RuntimeError("update() needs unscale_() or step() first in this iteration")
        overflow = any(self._found_inf.values())
        self._found_inf, self._stepped = {}, set()
        return overflow

    def state_dict(self) -> dict:  # GradScaler's keys, so either can load the other's checkpoint
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = to_float32(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self._growth_tracker = state["growth_interval"], state["_growth_tracker"]


def check_hyper_parameters(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    for ok, fix in [(0 < init_scale < math.inf, f"init_scale must be positive and finite, got {init_scale}"),
                    (growth_factor > 1, f"growth_factor must be > 1 (it raises the scale), got {growth_factor}"),
                    (0 < backoff_factor < 1, f"backoff_factor must be in (0, 1) (it lowers it), got {backoff_factor}"),
                    (isinstance(growth_interval, int) and growth_interval >= 1,
                     f"growth_interval must be an int >= 1 (clean steps before growing), got {growth_interval!r}")]:
        if not ok:
            raise ValueError(fix)


def to_float32(x: float) -> float:
    """Round a Python float (a double) to the nearest float32: GradScaler keeps its scale in float32."""
    return torch.tensor(x, dtype=torch.float32).item()  # cpu: a number's rounding, read back at once


# ----- unscaling: the textbook two passes, and one fused pass -----

def unscale_textbook(grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Per gradient, as on a whiteboard: found_inf = 1 if it holds inf or NaN (checked before dividing: GradScaler
    flags the scaled values), then g = g * 1/S. Five launches per gradient on a GPU, and two passes over it."""
    for g in grads:
        found_inf.masked_fill_(~g.isfinite().all(), 1.0)  # on the device: no host sync per gradient
        g.mul_(inv_scale)


def unscale_and_check(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """The same in one pass: a 0-dim fp32 flag on inv_scale's device, 1 if any gradient held inf or NaN.

    torch._amp_foreach_non_finite_check_and_unscale_ (what GradScaler calls, and Megatron-LM's scaler) reads each
    element once, flags it if not finite and writes it times 1/S: one read and one write instead of two reads,
    one launch per dtype on a GPU, and GradScaler's numbers by construction. It takes no complex gradients:
    those go the textbook way."""
    found_inf = torch.zeros((), device=inv_scale.device)
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():
        if dtype.is_complex:
            unscale_textbook(same, inv_scale, found_inf)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
    return found_inf


# ----- every rank agrees on the overflow, and fp16 gradients are named -----

def agree_on_overflow(found_inf: torch.Tensor, fp16: bool, group=None) -> bool:
    """Whether any rank of the group found inf/NaN (found_inf: this rank's 0-dim flag): the same on every rank.

    One number per rank goes into one all-reduce(MAX): 1 for inf/NaN, 2 for fp16 gradients, an error every
    rank then raises together (no rank is left waiting in a collective), naming the ranks that hold them.
    Reading it is the one host sync of an iteration: Python decides the branch, skip or step."""
    K, me = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    status = found_inf + 2.0 if fp16 else found_inf
    if K > 1:
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    agreed = status.item()
    if agreed >= 2:  # every rank is here: one more all-reduce, of a slot per rank, names them
        slots = torch.zeros(K, device=found_inf.device)
        slots[me] = float(fp16)
        if K > 1:
            dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=group)
        half = slots.nonzero().flatten().tolist()
        if dist.is_initialized():
            half = [dist.get_global_rank(group or dist.group.WORLD, r) for r in half]
        raise ValueError(f"unscale_: fp16 gradients on rank{'s' * (len(half) > 1)} "
                         f"{', '.join(map(str, half))}; S*g/S in fp16 underflows again. Keep fp32 master "
                         f"weights (MasterWeights) and step those.")
    return agreed >= 1


# ----- demo: one rank's overflow skips the step on every rank, as one GradScaler over all shards would -----

def overflow_or_underflow() -> tuple[str, bool]:
    """Question 19: fp16's NaN (overflow), its silent 0 (underflow), both fixed by loss scaling or bf16's range,
    and the scaler skipping the step of an inf gradient and halving S (on every rank of the default group)."""
    t = lambda v, dtype=torch.float16: torch.tensor(v, dtype=dtype, device=launch.device())  # noqa: E731
    nan, zero, bf = t(300) * t(300) - t(300) * t(300), t(1e-4) * t(1e-4), t(1e-4, torch.bfloat16)
    rescued, wide = (t(1e-4) * t(1e-4 * 2**16)).float() / 2**16, (bf * bf).float()
    weight, scaler = t([1.0, 1.0], torch.float32).requires_grad_(), DynamicLossScaler(init_scale=2.0**16)
    weight.grad = t([math.inf, 1.0], torch.float32)
    scaler.step(torch.optim.SGD([weight], lr=1.0))
    scaler.update()
    skipped, S = bool((weight == 1).all()), scaler.get_scale()
    return (f"fp16: 300*300 - 300*300 = {nan.item()} (90000 > 65504 rounds to inf, inf - inf = NaN); 1e-4*1e-4 = "
            f"{zero.item():g} (underflow: silent); scaled by 2^16 and unscaled in fp32: {rescued.item():.3g}; bf16 "
            f"with no scaling: {wide.item():.3g}; an inf gradient: step skipped ({skipped}), S 65536 -> {S:g}"), \
        bool(nan.isnan()) and zero.item() == 0 and skipped and S == 2.0**15 and all(
            math.isclose(v.item(), 1e-8, rel_tol=0.01) for v in (rescued, wide))


LOUD = 3.0  # |output gradient| / S on the last rank: it overflows fp16 first, once S * LOUD > 65504


def shard_data(rank: int, world: int, steps: int, device):
    """Rank r's inputs for every step; the last rank's output gradients are the loudest."""
    g = torch.Generator().manual_seed(1009 + rank)
    c = ((LOUD if rank == world - 1 else 0.5) * torch.randn(2, 4, generator=g).sign()).to(device)
    return c, [((torch.rand(2, 8, generator=g) - 0.5) / 2).to(device) for _ in range(steps)]  # |x| < 1/4: dW < S*c


def run_shards(scaler, data, steps):
    """Train one zero-initialised shard per entry of `data` (fp16-autocast linear layers, output gradient
    S*c) with one optimizer; returns (scale used, skipped) per step, and the shards."""
    params = [torch.zeros(4, 8, device=c.device, requires_grad=True) for c, _ in data]
    opt = torch.optim.SGD(params, lr=1e-3)
    trace = []
    for t in range(steps):
        with torch.autocast(params[0].device.type, dtype=torch.float16):
            outs = [F.linear(xs[t], W) for W, (_, xs) in zip(params, data)]
        loss = sum((out.float() * c).sum() for out, (c, _) in zip(outs, data))
        used = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append((used, scaler.get_scale() < used))
    return trace, params


def plot(trace) -> str:
    """log2(scale) per step: '*' a step taken, 'x' a step skipped."""
    levels, marks = [round(math.log2(s)) for s, _ in trace], ["x" if skip else "*" for _, skip in trace]
    return "\n".join(f"  2^{y:<3}|{''.join(m if lv == y else ' ' for lv, m in zip(levels, marks))}".rstrip()
                     for y in range(max(levels), min(levels) - 1, -1))


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=48, help="iterations of the sharded scale trajectory")
    p.add_argument("--growth-interval", type=int, default=4, help="clean steps before the scale grows (I)")
    p.add_argument("--init-exponent", type=int, default=10, help="initial scale S0 = 2^this")
    return p


def demo(args) -> int:
    edge = math.floor(math.log2(torch.finfo(torch.float16).max / LOUD)) + 1  # the first S with S*LOUD > 65504
    launch.require(args.steps >= 1 and args.growth_interval >= 1 and 0 <= args.init_exponent < edge,
                   f"--steps and --growth-interval must be >= 1 and --init-exponent in [0, {edge}): from "
                   f"2^{edge} up the loudest gradient overflows fp16 at once")
    env = launch.setup()
    rank, world, dev, say = env.rank, env.world_size, env.device, launch.print0
    # Each rank owns a shard of the model (as under ZeRO/FSDP): only the last rank's shard overflows.
    steps, interval, init = args.steps, args.growth_interval, 2.0 ** args.init_exponent
    data = shard_data(rank, world, steps, dev)
    trace, (mine,) = run_shards(DynamicLossScaler(init, growth_interval=interval), [data], steps)
    # Reference: one torch.amp.GradScaler over all shards in one process (what a single GPU would do).
    ref, shards = run_shards(torch.amp.GradScaler(dev.type, init, growth_interval=interval),
                             [shard_data(r, world, steps, dev) for r in range(world)], steps)
    # Naive: no agreement (each rank is its own group), so ranks skip on different steps.
    alone = [launch.new_group([r]) for r in range(world)][rank]
    lonely, _ = run_shards(DynamicLossScaler(init, growth_interval=interval, group=alone), [data], steps)
    skips = [[t for t, (_, s) in enumerate(tr) if s] for tr in (trace, lonely)]
    everyone = [None] * world  # per rank: ([agreed skips, naive skips], bit-identical to GradScaler?)
    dist.all_gather_object(everyone, (skips, trace == ref and torch.equal(mine, shards[rank])))
    check_ok = all(s[0] == skips[0] and same for s, same in everyone)
    say(f"scale S per step, {world} ranks, overflow only on rank {world - 1} ('x' = skipped by every rank):\n"
        f"{plot(trace)}\n= one GradScaler over all {world} shards (scales, skipped steps, parameters bit-identical): "
        f"{check_ok}\nwithout agreeing across ranks, steps skipped: "
        f"{' | '.join(f'rank {r}: {s[1]}' for r, (s, _) in enumerate(everyone))}")
    # Lifecycle: S doubles every I clean steps until S * LOUD > 65504, then one skip every I+1 steps.
    first = interval * (edge - args.init_exponent)
    predicted = 0 if steps <= first else 1 + (steps - 1 - first) // (interval + 1)
    figure_ok = len(skips[0]) == predicted and skips[0][:1] == [first][:predicted]
    fp16, holds = overflow_or_underflow()
    say(f"skipped {len(skips[0])} of {steps} steps; lifecycle predicts: first overflow at S=2^{edge}, step "
        f"I*log2(2^{edge}/S0) = {first}, then 1 per I+1 = {interval + 1} steps: {predicted}\n{fp16}")
    return launch.conclude("loss_scaling", check_ok, f"= GradScaler bit-exact, {steps} steps, skips agreed",
                           figure_ok and holds, f"skips {len(skips[0])} = lifecycle {predicted}; fp16 failures shown")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
