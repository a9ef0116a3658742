"""Mixed precision: compute in fp16/bf16, update fp32 master weights, scale the loss so gradients survive.

    format  sign|exponent|mantissa   max        smallest normal   spacing at 1.0
    fp32    1|8|23                   3.4e38     1.2e-38           2^-23
    bf16    1|8|7                    3.4e38     1.2e-38           2^-7
    fp16    1|5|10                   65504      6.1e-5            2^-10

Half precision fails in two different ways (Micikevicius et al., "Mixed Precision Training", 2018):
- overflow: past 65504 fp16 rounds to inf, and inf - inf = NaN: loud, one step is poisoned.
- underflow: below fp16's smallest subnormal (6e-8) a gradient becomes 0: silent, training stalls.
Loss scaling fixes underflow: backpropagate S*loss; the chain rule is linear, so every gradient is S
times larger and lifts out of the underflow zone; divide by S in fp32 before the step. Too large an S
overflows, so the scale is dynamic, and an overflow costs one skipped step:

    inf/NaN found:               skip the step,  S <- S * backoff_factor
    growth_interval clean steps:                 S <- S * growth_factor

With growth_factor * backoff_factor = 1 and steady gradients the scale settles at the overflow edge: it
grows after I clean steps, overflows, backs off, so the skip rate is 1 / (growth_interval + 1).
bf16 keeps fp32's 8 exponent bits (its range): what underflows fp16 is still a bf16 number, so bf16 needs
no loss scaling; it pays with 3 fewer mantissa bits than fp16.

Master weights fix the other loss, precision: SGD adds lr*g to w, and when |lr*g| < spacing(w)/2 the
rounded sum is w again: the update vanishes. fp16's spacing at 1.0 is ~1e-3 (bf16: ~8e-3), so an update
of 1e-4 never lands. The optimizer therefore steps an fp32 copy; the model's half copy is refreshed from
it after each step and tiny updates accumulate in fp32 until they cross a rounding boundary.

Why every rank must agree on the overflow before anyone steps. With plain DDP gradients are all-reduced
first and inf + x = inf, so every replica sees it. But when each rank checks only its own slice (ZeRO-2/3
and FSDP after a reduce-scatter, tensor- and pipeline-parallel shards), an inf in rank 1's slice is
invisible to rank 0:

    rank 0: found_inf = 0 -> steps its shard, keeps S       rank 1: found_inf = 1 -> skips, S <- S/2

The model is now half updated, and next iteration rank 0 backpropagates with S and rank 1 with S/2, so
every gradient sum they share is wrong from then on. One all-reduce(MAX) of a one-element flag before
the step makes the decision global (FSDP's ShardedGradScaler does the same with a SUM).

Demo (bit layouts, overflow vs underflow, the scale trajectory with skipped steps marked and checked
against GradScaler, fp16 with and without master weights against fp32; --bench: cost vs GradScaler):

    torchrun --standalone --nproc_per_node=4 mini_dist/mixed_precision.py [--bench]

Mirrors: torch.amp.GradScaler (bit for bit: scale, skip decision, parameters), and for the cross-rank
flag torch.distributed.fsdp.ShardedGradScaler.
"""
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import launch


FORMATS = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]


def to_float32(x: float) -> float:
    """Round a Python float (a double) to the nearest float32: GradScaler keeps its scale in float32."""
    return torch.tensor(x, dtype=torch.float32).item()


class DynamicLossScaler:
    """scale(loss).backward(); [unscale_(opt); clip]; step(opt); update() -- once per iteration."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 group=None):
        if not (0 < init_scale < math.inf):
            raise ValueError(f"init_scale must be positive and finite, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1 (it raises the scale), got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1) (it lowers the scale), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1 (clean steps before growing), "
                             f"got {growth_interval!r}")
        self._scale = to_float32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.group = growth_interval, group
        self._growth_tracker = 0  # clean steps since the last growth or overflow
        self._found_inf = {}      # id(optimizer) -> this iteration's agreed inf/NaN flag (0-dim tensor)
        self._stepped = set()     # id(optimizer) of those stepped (or skipped) this iteration

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        # A 0-dim float32 tensor, not a Python float: a 0-dim fp16 loss times it is promoted to fp32, as in
        # GradScaler, so the scaled loss reads finite (fp16 * 65536 would read inf; the gradient is S anyway).
        return loss * torch.full((), self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and agree with every rank of the group on inf/NaN."""
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else params[0].device
        # The status is all-reduced before anyone acts on it, so a bad input on one rank makes every rank
        # raise together instead of leaving the others blocked in the next collective.
        status = torch.zeros(2, device=device)  # [inf/NaN found, fp16 gradient found]
        status[1] = float(any(g.dtype == torch.float16 for g in grads))
        for g in grads:  # checked before dividing: GradScaler flags the scaled values, not the quotients
            status[0] = torch.maximum(status[0], g.isfinite().logical_not().any().to(device))
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.group)
        if status[1]:
            raise ValueError("unscale_: fp16 gradients on at least one rank; S*g/S in fp16 underflows "
                             "again. Keep fp32 master weights (MasterWeights) and step those.")
        # The reciprocal in fp64 rounded to fp32, as GradScaler does (fast-math fp32 division can be off).
        inv_scale = torch.tensor(1.0 / self._scale, dtype=torch.float32, device=device)
        with torch.no_grad():
            for g in grads:
                g.mul_(inv_scale.to(g.device))
        self._found_inf[id(optimizer)] = status[0]

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """optimizer.step(), unless some rank found inf/NaN: then every rank skips it."""
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if self._found_inf[id(optimizer)].item() == 0:  # the one host sync: Python decides the branch
            return optimizer.step(*args, **kwargs)
        return None

    def update(self) -> None:
        """Back off after an overflow (any optimizer's), grow after growth_interval clean iterations."""
        if not self._found_inf:
            raise RuntimeError("update() needs unscale_() or step() first in this iteration")
        overflow = any(flag.item() for flag in self._found_inf.values())
        # Products in fp64 rounded to fp32, exactly as torch._amp_update_scale_ computes them.
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
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self) -> dict:  # GradScaler's keys, so either can load the other's checkpoint
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = to_float32(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self._growth_tracker = state["growth_interval"], state["_growth_tracker"]


class MasterWeights:
    """fp32 copies of a half model's parameters: give `.params` to the optimizer.

    loss -> scaler.scale(loss).backward() -> grads_to_master() -> scaler.step(opt) -> scaler.update()
    -> master_to_model()
    """

    def __init__(self, model_params):
        self.model_params = list(model_params)
        self.params = [p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
                       for p in self.model_params]

    def grads_to_master(self) -> None:
        """Widen the (still scaled) half gradients to fp32, where dividing by S cannot underflow."""
        for p, m in zip(self.model_params, self.params):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in zip(self.model_params, self.params):
            p.copy_(m)  # rounds to the nearest half: the model computes with this, fp32 keeps the rest


def regression_problem(seed: int = 0, n: int = 32, d: int = 8):
    """Least squares whose weights sit in [1, 2), where fp16's spacing is 2^-10 (bf16's 2^-7)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g)
    w0 = 1 + torch.rand(d, generator=g)
    y = X @ (w0 + 0.05 * torch.randn(d, generator=g))
    return X, y, w0


def train_regression(dtype, master: bool, steps: int = 400, lr: float = 2e-3, seed: int = 0):
    """SGD in `dtype` (with or without fp32 master weights); returns the fp32 loss after every step."""
    X, y, w0 = (t.to(launch.device()) for t in regression_problem(seed))  # NCCL all-reduces GPU flags only
    w = w0.to(dtype).requires_grad_()
    masters = MasterWeights([w]) if master else None
    opt = torch.optim.SGD(masters.params if master else [w], lr=lr)
    scaler = DynamicLossScaler(init_scale=2.0**10)  # gradients here are ~0.1: no underflow to fight
    losses = [F.mse_loss(X @ w.detach().float(), y).item()]
    for _ in range(steps):
        loss = F.mse_loss(X.to(dtype) @ w, y.to(dtype))
        if master:
            scaler.scale(loss).backward()
            masters.grads_to_master()
            scaler.step(opt)
            scaler.update()
            masters.master_to_model()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(F.mse_loss(X @ w.detach().float(), y).item())
    return losses, w.detach()


def update_to_spacing(dtype, lr: float = 2e-3, seed: int = 0) -> float:
    """max |lr*g| / (spacing(w)/2) at the start: below 1, w - lr*g rounds back to w in `dtype`."""
    X, y, w0 = (t.to(launch.device()) for t in regression_problem(seed))  # where train_regression runs
    w = w0.to(dtype).requires_grad_()
    F.mse_loss(X.to(dtype) @ w, y.to(dtype)).backward()
    spacing = torch.nextafter(w.detach(), torch.full_like(w.detach(), math.inf)) - w.detach()
    return (lr * w.grad.float().abs() / (spacing.float() / 2)).max().item()


# ----- demo -----

def bits(x: float, dtype: torch.dtype) -> str:
    """sign|exponent|mantissa of x stored in dtype."""
    info = torch.finfo(dtype)
    expo = info.bits - 1 - round(-math.log2(info.eps))  # the rest of the bits are the mantissa
    word = torch.tensor([x], dtype=dtype).view({16: torch.int16, 32: torch.int32}[info.bits]).item()
    s = format(word & ((1 << info.bits) - 1), f"0{info.bits}b")  # two's complement -> raw bits
    return f"{s[0]}|{s[1:1 + expo]}|{s[1 + expo:]}"


LOUD = 3.0  # |output gradient| / S on the last rank: it overflows fp16 first, once S * LOUD > 65504


def shard_data(rank: int, world: int, steps: int, device):
    """Rank r's inputs for every step; the last rank's output gradients are the loudest."""
    g = torch.Generator().manual_seed(1009 + rank)
    c = (LOUD if rank == world - 1 else 0.5) * torch.randn(2, 4, generator=g).sign()
    xs = [(torch.rand(2, 8, generator=g) - 0.5) / 2 for _ in range(steps)]  # |x| < 1/4: dW < S*c
    return c.to(device), [x.to(device) for x in xs]


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


def demo() -> int:
    env = launch.setup()
    rank, world, dev = env.rank, env.world_size, env.device
    say = launch.print0
    say("format  max / smallest normal, as sign|exponent|mantissa bits")
    for name, dt in FORMATS:
        info = torch.finfo(dt)
        say(f"{name:5} max {info.max:<12.6g}= {bits(info.max, dt)}\n"
            f"{'':5} min {info.smallest_normal:<12.6g}= {bits(info.smallest_normal, dt)}")
    for what, f, fix in [
            ("overflow  300*300 - 300*300", lambda t: t(300) * t(300) - t(300) * t(300), "lower S, or bf16"),
            ("underflow 1e-4 * 1e-4      ", lambda t: t(1e-4) * t(1e-4), "loss scaling, or bf16"),
            ("spacing   1 + 1e-4         ", lambda t: t(1) + t(1e-4), "fp32 master weights")]:
        say(f"{what}: " + "".join(f"{name} {f(lambda v: torch.tensor(v, dtype=dt)).item():<12.6g}"
                                  for name, dt in FORMATS) + f"fix: {fix}")
    rescued = (torch.tensor(1e-4, dtype=torch.float16) * (1e-4 * 2**16)).float() / 2**16
    say(f"loss scaling at work: 1e-4 * (1e-4 * 2^16) in fp16, / 2^16 in fp32 = {rescued.item():.4g}")

    # Each rank owns a shard of the model (as under ZeRO/FSDP): only the last rank's shard overflows.
    steps, interval, init = 48, 4, 2.0**10
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
    say(f"scale trajectory, {world} ranks, overflow only on rank {world - 1} ('x' = skipped by every rank):")
    say(plot(trace))
    say(f"= one GradScaler over all {world} shards (scales, skipped steps, parameters bit-identical): "
        f"{check_ok}\nwithout the all-reduce, steps skipped per rank: "
        f"{' | '.join(str(s[1]) for s, _ in everyone)}")
    # Lifecycle: S doubles every I clean steps until S * LOUD > 65504, then one skip every I+1 steps.
    edge = math.floor(math.log2(torch.finfo(torch.float16).max / LOUD)) + 1
    first = interval * (edge - round(math.log2(init)))
    predicted = 1 + (steps - 1 - first) // (interval + 1)
    figure_ok = len(skips[0]) == predicted and skips[0][0] == first
    say(f"skipped {len(skips[0])} of {steps}; lifecycle predicts: first overflow at S=2^{edge}, step "
        f"I*log2(2^{edge}/S0) = {first}, then 1 per I+1 = {interval + 1} steps: {predicted}")

    runs = {name: train_regression(dt, m) for name, dt, m in [
        ("fp32", torch.float32, False), ("fp16+master", torch.float16, True),
        ("fp16", torch.float16, False), ("bf16+master", torch.bfloat16, True),
        ("bf16", torch.bfloat16, False)]}
    say(f"SGD lr=2e-3, 400 steps; max |lr*g| / (spacing(w)/2): fp16 {update_to_spacing(torch.float16):.2f}, "
        f"bf16 {update_to_spacing(torch.bfloat16):.2f} (< 1: the update rounds away). loss start -> end:")
    say("   ".join(f"{k} {v[0][0]:.4f}->{v[0][-1]:.5f}" for k, v in runs.items()))
    (f32, _), (m16, _), (n16, _) = runs["fp32"], runs["fp16+master"], runs["fp16"]
    follows = abs(m16[-1] - f32[-1]) <= abs(m16[0] - f32[0]) and n16[-1] == n16[0]
    return launch.conclude("mixed_precision", check_ok,
                           f"= GradScaler bit-exact, {steps} steps, skips agreed",
                           figure_ok and follows,
                           f"skips {len(skips[0])} = lifecycle {predicted}; fp16+master "
                           f"{m16[-1]:.5f} ~ fp32 {f32[-1]:.5f}, fp16 stalled {n16[-1]:.4f}")


def bench() -> int:
    """unscale_ + step + update for 100 tensors of 10^4 values: this module vs GradScaler's fused kernel."""
    env = launch.setup()
    params = [torch.randn(10_000, device=env.device, requires_grad=True) for _ in range(100)]
    times = {}
    for name, scaler in [("mini_dist", DynamicLossScaler()),
                         ("GradScaler", torch.amp.GradScaler(env.device.type))]:
        opt = torch.optim.SGD(params, lr=1e-9)
        for i in range(25):
            if i == 5:
                start = time.perf_counter()
            scaler.scale(sum(p.sum() for p in params)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if env.device.type == "cuda":  # GradScaler's update is a kernel still running: wait for it
            torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 20 * 1e3
    text = "  ".join(f"{k} {v:.2f} ms" for k, v in times.items())
    launch.print0(f"scale+backward+step+update per iteration, {env.world_size} ranks: {text}")
    return launch.conclude("mixed_precision", True, "bench", True, text)


if __name__ == "__main__":
    raise SystemExit(bench() if "--bench" in sys.argv else demo())
