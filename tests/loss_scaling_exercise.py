"""The loss-scaling exercise's judge: the scale's update beside torch._amp_update_scale_, and the classic mistakes
of update() and step(), recognised by probes that run the learner's scaler on iterations chosen to tell them apart.

The contract is exact: GradScaler's scale is an fp32 number, each new one the product of Python floats rounded
to fp32, so a correct update equals torch's bit for bit, whatever its code (a counter compared with the
interval, or one taken modulo it).
"""
import math
from functools import lru_cache

import torch

from grading import mistake
from harness import device
from mini_dist import loss_scaling

# each is made by a wrong solution of tests/bank_loss_scaling.py (tests/test_exercise.py holds that)
MISTAKES = {
    "grown on the wrong step": ("DynamicLossScaler.update", "the scale grows at the growth_interval-th clean "
                                "iteration in a row, not one before or after it: count this iteration, then "
                                "compare the count with growth_interval"),
    "growth on every clean step": ("DynamicLossScaler.update", "a clean iteration only counts; the scale grows "
                                   "once growth_interval of them have passed in a row, then the count starts "
                                   "again"),
    "tracker not reset after an overflow": ("DynamicLossScaler.update", "an overflow starts the count of clean "
                                            "iterations again (_growth_tracker 0): the scale grows only after "
                                            "growth_interval clean iterations with no overflow among them"),
    "grown past fp32's max": ("DynamicLossScaler.update", "a grown scale that is inf in fp32 is not kept "
                              "(math.isfinite(to_float32(...))): the scale stays as it was, the count starts "
                              "again"),
    "scale not rounded to fp32": ("DynamicLossScaler.update", "GradScaler keeps its scale in fp32: each new "
                                  "scale is to_float32(scale * factor)"),
    "step taken on an overflow": ("DynamicLossScaler.step", "when self._found_inf[id(optimizer)] says the "
                                  "gradients held inf/NaN, return None without calling optimizer.step()"),
    "not unscaled": ("DynamicLossScaler.step", "call self.unscale_(optimizer) before deciding, unless it ran "
                     "already this iteration: it divides the gradients by S and records whether they held "
                     "inf/NaN in self._found_inf[id(optimizer)]"),
    "unscaled twice": ("DynamicLossScaler.step", "unscale_ may have run already (a caller clipping first): call "
                       "it only when self._found_inf has no entry for id(optimizer)"),
}

CONTRACT = ("update(): an overflow multiplies the scale by backoff_factor and restarts the count of clean "
            "iterations; the growth_interval-th clean iteration in a row multiplies it by growth_factor and "
            "restarts it; a scale that would be inf in fp32 stays; each new scale to_float32(scale * factor). "
            "step(): the gradients unscaled once (unscale_), the optimizer stepped only when they held no inf/NaN")


def to_float32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()  # cpu: a number's rounding


def updates(init, growth, backoff, interval, overflows) -> list[tuple[float, int]]:
    """(scale, _growth_tracker) after each update() of the learner's scaler, one iteration per overflow flag,
    its verdict recorded by unscale_ (a gradient of inf or 1): step() plays no part."""
    scaler = loss_scaling.DynamicLossScaler(init, growth, backoff, interval)
    p = torch.zeros(1, device=device(), requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    trace = []
    for overflow in overflows:
        p.grad = torch.full((1,), math.inf if overflow else 1.0, device=device())
        scaler.unscale_(opt)
        scaler.update()
        trace.append((scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    return trace


def torchs(init, growth, backoff, interval, overflows) -> list[tuple[float, int]]:
    """The same from torch._amp_update_scale_, what GradScaler.update calls."""
    scale = torch.full((1,), init, dtype=torch.float32, device=device())
    tracker = torch.zeros(1, dtype=torch.int32, device=device())
    trace = []
    for overflow in overflows:
        found_inf = torch.full((1,), float(overflow), device=device())
        torch._amp_update_scale_(scale, tracker, found_inf, growth, backoff, interval)
        trace.append((scale.item(), tracker.item()))
    return trace


def spelled(overflows) -> str:
    return ", ".join("overflow" if o else "clean" for o in overflows)


# ----- the mistakes

@lru_cache(maxsize=None)
def update_mistake() -> str | None:
    """The classic mistake the learner's update() makes, in words, or None (the learner's code does not change
    during one check: probed once)."""
    try:
        return timing() or after_overflow() or rounding() or past_max()
    except Exception:  # the learner's update raised on a probe: the property's own message says so
        return None


def grew_after(trace, init) -> list[int]:
    """The clean iterations (counted from 1) after which the scale grew."""
    before = [init] + [s for s, _ in trace]
    return [t + 1 for t, (s, _) in enumerate(trace) if s > before[t]]


def timing() -> str | None:
    trace = updates(2.0 ** 10, 2.0, 0.5, 3, (False,) * 10)
    grew = grew_after(trace, 2.0 ** 10)
    if grew == [3, 6, 9]:
        return None
    said = (f"growth_interval 3, 10 clean iterations from S = 1024: yours grew after clean iterations "
            f"{', '.join(map(str, grew)) or 'none'}; GradScaler's after 3, 6 and 9")
    if grew[:3] == [1, 2, 3]:
        return mistake(MISTAKES, "growth on every clean step", said)
    if grew and grew[0] in (2, 4):
        return mistake(MISTAKES, "grown on the wrong step", f"{said}: one clean iteration "
                       f"{'early' if grew[0] == 2 else 'late'}")
    return None


def after_overflow() -> str | None:
    overflows = (False, False, True, False, False, False)
    trace = updates(2.0 ** 10, 2.0, 0.5, 3, overflows)
    if trace == torchs(2.0 ** 10, 2.0, 0.5, 3, overflows) or trace[2][1] == 0:
        return None
    grew = grew_after(trace[3:], trace[2][0])
    when = (f"it grew after {grew[0]} clean iteration{'s' if grew[0] > 1 else ''} past the overflow"
            if grew else "")
    return mistake(MISTAKES, "tracker not reset after an overflow", f"growth_interval 3, iterations "
                   f"{spelled(overflows)}: _growth_tracker is {trace[2][1]} right after the overflow, "
                   f"not 0" + (f", and {when}" if when else ""))


def past_max() -> str | None:
    grown = updates(2.0 ** 127, 2.0, 0.5, 1, (False,))[0][0]
    if not math.isinf(to_float32(grown)):
        return None
    said = "inf" if math.isinf(grown) else f"{grown:g} (inf in fp32)"
    return mistake(MISTAKES, "grown past fp32's max", f"from S = 2^127, growth_factor 2, growth_interval 1: one "
                   f"clean iteration left your scale {said}; GradScaler's stays 2^127")


def rounding() -> str | None:
    ours = updates(1.0, 1.1, 0.5, 1, (False,))[0][0]
    want = torchs(1.0, 1.1, 0.5, 1, (False,))[0][0]
    if ours == want or to_float32(ours) != want:
        return None
    return mistake(MISTAKES, "scale not rounded to fp32", f"from S = 1, growth_factor 1.1: yours grew to "
                   f"{ours!r}, GradScaler's to {want!r}, the nearest fp32")


def stepped(grad: float, unscaled_first: bool) -> tuple[bool, float, str | None]:
    """The learner's step() at S = 4 on one parameter (0, lr 1) whose gradient is 4 * grad (scaled): whether
    optimizer.step() ran, the parameter after it, and the error step() raised, if any."""
    scaler = loss_scaling.DynamicLossScaler(4.0)
    p = torch.zeros(1, device=device(), requires_grad=True)
    p.grad = torch.full((1,), 4 * grad, device=device())
    opt = torch.optim.SGD([p], lr=1.0)
    ran = []
    opt.register_step_post_hook(lambda *_: ran.append(1))
    error = None
    try:
        if unscaled_first:
            scaler.unscale_(opt)
        scaler.step(opt)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return bool(ran), p.item(), error


@lru_cache(maxsize=None)
def step_mistake() -> str | None:
    """The classic mistake the learner's step() makes, in words, or None."""
    ran, p, error = stepped(2.0, unscaled_first=False)
    if error and error.startswith("KeyError"):
        return mistake(MISTAKES, "not unscaled", f"step() read self._found_inf before unscale_ put this "
                       f"optimizer's verdict there ({error})")
    if ran and p == -8.0:
        return mistake(MISTAKES, "not unscaled", "at S = 4 a scaled gradient of 8 stepped the parameter by 8, "
                       "not by 8/4 = 2")
    ran, p, error = stepped(math.inf, unscaled_first=False)
    if ran:
        return mistake(MISTAKES, "step taken on an overflow", f"a gradient holding inf: your step() ran "
                       f"optimizer.step() and the parameter became {p}")
    ran, p, error = stepped(2.0, unscaled_first=True)
    if error and "already called" in error:
        return mistake(MISTAKES, "unscaled twice", f"the caller ran unscale_(optimizer) (to clip), then your "
                       f"step() called it again: {error}")
    return None
