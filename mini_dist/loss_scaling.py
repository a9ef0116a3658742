"""Dynamic loss scaling: fp16 gradients that neither underflow nor poison a step.

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

On a whiteboard the unscale is two passes over each gradient, an inf/NaN check, then g * 1/S
(`unscale_textbook`); the scaler runs both in one pass, one launch per dtype, with the fused kernel that
GradScaler and Megatron-LM's scaler call (`unscale_and_check`), and reads the flag once per iteration.

When each rank holds only a slice of the gradients (ZeRO, FSDP, tensor and pipeline parallelism), every rank
must agree on the overflow before any rank steps: mini_dist/sharded_loss_scaling.py. The demo trains one
fp16 layer whose gradients overflow once S is large enough, and prints the scale per step beside GradScaler's:

    torchrun --standalone --nproc_per_node=1 mini_dist/loss_scaling.py [--steps 48 --growth-interval 4]

Mirrors torch.amp.GradScaler bit for bit (scale, skip decision, parameters). The fp32 master weights fp16
needs: mini_dist/mixed_precision.py.
"""
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch

FP16_ADVICE = "S*g/S in fp16 underflows again. Keep fp32 master weights (MasterWeights) and step those."


class DynamicLossScaler:
    """scale(loss).backward(); [unscale_(opt); clip]; step(opt); update() -- once per iteration."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        check_hyper_parameters(init_scale, growth_factor, backoff_factor, growth_interval)
        self._scale = to_float32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0  # clean steps since the last growth or overflow
        self._found_inf = {}      # id(optimizer) -> this iteration's inf/NaN flag (a bool)
        self._stepped = set()     # id(optimizer) of those stepped (or skipped) this iteration

    def update(self) -> None:
        """Back off after an overflow (any optimizer's), grow after growth_interval clean iterations. Each
        new scale is the product in fp64 rounded to fp32 (to_float32), as torch._amp_update_scale_ makes it."""
        overflow = self.end_iteration()
        # exercise: the scale and _growth_tracker end as torch._amp_update_scale_ leaves them. _growth_tracker:
        #   the clean iterations (no overflow) since the last overflow or growth. An overflow multiplies the scale
        #   by backoff_factor; the growth_interval-th clean iteration in a row multiplies it by growth_factor and
        #   starts the count again; a grown scale that is inf in fp32 is not kept (the count starts again all the
        #   same). A new scale is to_float32(scale * factor): Python floats rounded to fp32, as GradScaler keeps it.
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

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        # a 0-dim fp32 tensor, as GradScaler's: an fp16 loss times it is promoted to fp32, so it reads finite
        return loss * torch.full((), self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and find whether any holds inf/NaN."""
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
        self._found_inf[id(optimizer)] = self.agree_on_overflow(found_inf, fp16)

    def agree_on_overflow(self, found_inf: torch.Tensor, fp16: bool) -> bool:
        """Whether the gradients held inf/NaN (found_inf: a 0-dim flag). Reading it is the one host sync of an
        iteration: Python decides the branch, skip or step. One process decides alone; a sharded model's
        ranks decide together (ShardedLossScaler, mini_dist/sharded_loss_scaling.py)."""
        if fp16:
            raise ValueError(f"unscale_: fp16 gradients; {FP16_ADVICE}")
        return bool(found_inf.item())

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """optimizer.step(), unless the gradients held inf/NaN: then the step is skipped."""
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        self._stepped.add(id(optimizer))
        # exercise: the optimizer stepped (optimizer.step(*args, **kwargs), its result returned) only when this
        #   iteration's gradients, divided by the scale, held no inf/NaN; else nothing changes and None is returned.
        #   self.unscale_(optimizer) divides them and records whether they held inf/NaN in
        #   self._found_inf[id(optimizer)]; the caller may have called it already this iteration (to clip), and it
        #   refuses a second call.
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        return None if self._found_inf[id(optimizer)] else optimizer.step(*args, **kwargs)
        # end exercise

    def get_scale(self) -> float:
        return self._scale

    def end_iteration(self) -> bool:
        """Whether any optimizer's gradients overflowed this iteration; forgets the iteration."""
        if not self._found_inf:
            raise RuntimeError("update() needs unscale_() or step() first in this iteration")
        overflow = any(self._found_inf.values())
        self._found_inf = {}
        self._stepped = set()
        return overflow

    def state_dict(self) -> dict:  # GradScaler's keys, so either can load the other's checkpoint
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = to_float32(state["scale"])
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
        self._growth_tracker = state["_growth_tracker"]


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


# ----- guards, and the scale's fp32 rounding -----

def check_hyper_parameters(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    """Refuse, saying what to change, a scale or factor that would stop the scale from moving as it should."""
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


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=48, help="training steps")
    p.add_argument("--growth-interval", type=int, default=4, help="clean steps before the scale grows (I)")
    p.add_argument("--init-exponent", type=int, default=10, help="initial scale S0 = 2^this")
    return p


LOUD = 3.0  # |output gradient| / S: it overflows fp16 once S * LOUD > 65504


def train(scaler, steps: int) -> tuple[list, torch.Tensor]:
    """A zero-initialised linear layer under fp16 autocast whose output gradient is S * LOUD * sign, trained with
    `scaler`: (scale used, skipped) per step, and the weights."""
    g = torch.Generator().manual_seed(1009)
    c = (LOUD * torch.randn(2, 4, generator=g).sign()).to(launch.device())
    W = torch.zeros(4, 8, device=launch.device(), requires_grad=True)
    opt = torch.optim.SGD([W], lr=1e-3)
    trace = []
    for _ in range(steps):
        x = ((torch.rand(2, 8, generator=g) - 0.5) / 2).to(launch.device())  # |x| < 1/4: dW < S * LOUD
        with torch.autocast(launch.device().type, dtype=torch.float16):
            out = F.linear(x, W)
        used = scaler.get_scale()
        scaler.scale((out.float() * c).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append((used, scaler.get_scale() < used))
    return trace, W.detach()


def plot(trace) -> str:
    """log2(scale) per step: '*' a step taken, 'x' a step skipped."""
    levels = [round(math.log2(scale)) for scale, _ in trace]
    marks = ["x" if skipped else "*" for _, skipped in trace]
    rows = [f"  2^{y:<3}|{''.join(m if level == y else ' ' for level, m in zip(levels, marks))}".rstrip()
            for y in range(max(levels), min(levels) - 1, -1)]
    return "\n".join(rows)


def demo(args) -> int:
    edge = math.floor(math.log2(torch.finfo(torch.float16).max / LOUD)) + 1  # the first S with S*LOUD > 65504
    launch.require(args.steps >= 1 and args.growth_interval >= 1 and 0 <= args.init_exponent < edge,
                   f"--steps and --growth-interval must be >= 1 and --init-exponent in [0, {edge}): from "
                   f"2^{edge} up the gradient overflows fp16 at once")
    env = launch.setup()
    steps = args.steps
    interval = args.growth_interval
    init = 2.0 ** args.init_exponent
    trace, weights = train(DynamicLossScaler(init, growth_interval=interval), steps)
    ref, ref_weights = train(torch.amp.GradScaler(env.device.type, init, growth_interval=interval), steps)
    same = trace == ref and torch.equal(weights, ref_weights)
    skips = [t for t, (_, skipped) in enumerate(trace) if skipped]
    # The lifecycle: S doubles every I clean steps until S * LOUD > 65504, then one skip every I + 1 steps
    first = interval * (edge - args.init_exponent)
    predicted = 0 if steps <= first else 1 + (steps - 1 - first) // (interval + 1)
    follows = len(skips) == predicted and (predicted == 0 or skips[0] == first)
    launch.print0(f"scale S per step ('x' = inf in the fp16 gradients, step skipped):\n{plot(trace)}\n"
                  f"= torch.amp.GradScaler (scales, skipped steps, weights bit-identical): {same}\n"
                  f"skipped {len(skips)} of {steps} steps; lifecycle predicts: first overflow at S=2^{edge}, step "
                  f"I*log2(2^{edge}/S0) = {first}, then 1 per I+1 = {interval + 1} steps: {predicted}")
    return launch.conclude("loss_scaling", same, f"= GradScaler bit-exact, {steps} steps", follows,
                           f"skips {len(skips)} = lifecycle {predicted}")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
