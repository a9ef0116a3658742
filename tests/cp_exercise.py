"""Ring attention's merge, the context-parallel exercise: what merge must return (attention over both key sets and
its log-sum-exp, for any lse), and the classic mistakes, recognised by probing the learner's merge.

The probe: two one-query partial attentions whose answer is known by hand, out_A = [1, 0] with lse_A = log 2
(weights summing to 2) and out_B = [0, 1] with lse_B = log 3: merged, out = [2/5, 3/5] and lse = log 5. A plain
average gives [1/2, 1/2], a sum [1, 1], the weights swapped [3/5, 2/5]; the right out with another lse is an lse
not updated. Then the same pair with both lse shifted by +-800, or one by +800 and the other by -800, and the
ring's start (lse = -inf: no keys yet): e^lse overflows fp64 past 709.78 and underflows to 0 below -745, so a merge
that exponentiates without subtracting the larger lse first returns inf or nan there.
"""
import math
import traceback

import torch

from grading import mistake
from mini_dist import context_parallel as cp  # looked up at call time: in a check, the learner's copy

F64 = torch.float64
# each is made by a wrong solution of tests/bank_context_parallel.py (tests/test_exercise.py holds that)
MISTAKES = {
    "not rescaled by the log-sum-exp": ("merge", "each partial out is normalised over its own keys only: weigh "
                                        "it by its share of the whole softmax, e^(its lse - the merged lse)"),
    "lse not updated": ("merge", "the merged lse is the log-sum-exp over both key sets (log(e^lse + e^block_lse), "
                        "computed safely): the next block is weighed against it, and backward rebuilds the "
                        "probabilities from it"),
    "max not subtracted": ("merge", "subtract the larger of the two lse before exponentiating, so that every "
                           "exponent is <= 0 and the larger term is e^0 = 1 (torch.logaddexp does it); lse = -inf "
                           "(no keys yet) must give that side weight 0"),
    "weights swapped": ("merge", "out's weight is e^(lse - merged lse), block_out's e^(block_lse - merged lse): "
                        "each partial result weighed by the share of its own keys"),
}


def learners_merge(*given):
    """cp.merge on copies of the given tensors; what it raised said in one line, with the learner's line."""
    try:
        return cp.merge(*(t.clone() for t in given))
    except NotImplementedError as e:  # a blank: its own words say what to write
        raise AssertionError(f"merge raised NotImplementedError: {e}") from None
    except Exception as e:  # noqa: BLE001  the learner's error, said with where it was raised
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == cp.__file__]
        at = f" at context_parallel.py:{frames[-1].lineno} in {frames[-1].name}: {frames[-1].line}" if frames else ""
        raise AssertionError(f"merge raised {type(e).__name__}: {e}{at} (called with out "
                             f"{list(given[0].shape)}, lse {list(given[1].shape)}, block_out {list(given[2].shape)}, "
                             f"block_lse {list(given[3].shape)})") from None


def pair(shift_a: float = 0.0, shift_b: float = 0.0):
    """The probe's two partial attentions, [1, 1, 1, 2] and [1, 1, 1, 1] each, lse shifted by shift_a, shift_b."""
    out_a = torch.tensor([[[[1.0, 0.0]]]], dtype=F64)  # cpu: a one-process probe
    out_b = torch.tensor([[[[0.0, 1.0]]]], dtype=F64)  # cpu: a one-process probe
    lse_a = torch.full((1, 1, 1, 1), math.log(2) + shift_a, dtype=F64)  # cpu: a one-process probe
    lse_b = torch.full((1, 1, 1, 1), math.log(3) + shift_b, dtype=F64)  # cpu: a one-process probe
    return out_a, lse_a, out_b, lse_b


def merged(out_a, lse_a, out_b, lse_b):
    """The learner's merge on copies: (out, lse) as lists of floats, or None where it raised or returned no pair."""
    try:
        out, lse = cp.merge(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
        return out.reshape(-1).tolist(), lse.reshape(-1).tolist()
    except Exception:  # noqa: BLE001  what it raises is the property's line; the probe only names a mistake
        return None


def near(got, want) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want))


def said(values) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def merge_mistake() -> str | None:
    """The classic mistake the learner's merge makes, in words, or None when the probe recognises none."""
    small = merged(*pair())
    if small is None:
        return None
    out, lse = small
    given = "merging out [1, 0] (lse log 2) with block_out [0, 1] (block_lse log 3)"
    for name, wrong, what in (("not rescaled by the log-sum-exp", [0.5, 0.5], "their plain average"),
                              ("not rescaled by the log-sum-exp", [1.0, 1.0], "their sum"),
                              ("weights swapped", [0.6, 0.4], "each weighed by the other's share")):
        if near(out, wrong):
            return mistake(MISTAKES, name, f"{given} gives out {said(out)}, {what}; the keys of the block hold "
                           f"3/5 of the softmax: [0.4, 0.6]")
    if not near(out, [0.4, 0.6]):
        return None
    if not near(lse, [math.log(5)]):
        named = {math.log(2): "lse as it was", math.log(3): "block_lse (or the larger of the two)",
                 math.log(6): "lse + block_lse"}
        which = next((w for v, w in named.items() if near(lse, [v])), f"{lse[0]:.4g}")
        return mistake(MISTAKES, "lse not updated", f"{given} gives the right out but lse = {which}, not "
                       f"log(2 + 3) = log 5")
    for a, b in ((800.0, 800.0), (-800.0, -800.0), (800.0, -800.0), (-800.0, 800.0), (-math.inf, 0.0)):
        out_a, lse_a, out_b, lse_b = pair(a, b)
        if math.isinf(a):
            lse_a.fill_(-math.inf)
            out_a.zero_()  # the ring's start
        want_a = math.exp(lse_a.item() - torch.logaddexp(lse_a, lse_b).item())
        want = [want_a, 1 - want_a] if not math.isinf(a) else [0.0, 1.0]
        got = merged(out_a, lse_a, out_b, lse_b)
        if got is not None and (not near(got[0], want) or not all(math.isfinite(v) for v in got[1])):
            where = ("the ring's start, lse = -inf (no keys yet), and block_lse = log 3" if math.isinf(a) else
                     f"lse = {lse_a.item():.6g} and block_lse = {lse_b.item():.6g}")
            return mistake(MISTAKES, "max not subtracted", f"with {where}, your merge returns out {said(got[0])}, "
                           f"lse {said(got[1])}, where out is {said(want)}: e^x overflows fp64 past 709.78 and is 0 "
                           f"below -745")
    return None
