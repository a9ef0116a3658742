"""The 1F1B exercise's judge: what one_f_one_b_stage must return (the contract, stage by stage, in words a learner
can act on), and the classic mistakes, recognised from the orders the learner's function gives for every stage.

An order is data, so a mistake is read from it: a warm-up one forward too long shows as P-s+1 forwards before the
first backward; the steady state's backward run before its forward makes the last stage start with a backward;
a cool-down that stops early leaves backwards owed; a warm-up that ignores M < P runs microbatches that do not
exist. (Each is one wrong solution of tests/bank_pipeline_schedules.py; tests/test_exercise.py holds that.)
"""
import traceback

from grading import mistake
from mini_dist import pipeline_schedules  # looked up at call time: in a check, the learner's copy

OPS = ("forward", "backward")
MISTAKES = {
    "warm-up of P - s": ("one_f_one_b_stage", "the warm-up runs P-s-1 forwards, not P-s: the steady state's "
                         "first forward is the (P-s)-th, so the first backward comes after min(P-s, M) forwards"),
    "backward before forward in the steady state": ("one_f_one_b_stage", "each step of the steady state runs "
                                                    "the next forward first, then the oldest backward"),
    "cool-down missing backwards": ("one_f_one_b_stage", "after the last forward, the cool-down runs every "
                                    "backward still owed, the warm-up's microbatches: as many as the warm-up ran"),
    "warm-up ignoring M < P": ("one_f_one_b_stage", "with fewer microbatches than the stages after s (M < P-s-1) "
                               "the warm-up can run only the M forwards there are: min(P-s-1, M)"),
}


def written(order) -> str:
    """F0 F1 B0 ... for a list of (op, microbatch, chunk); anything else as it is."""
    return " ".join(f"{'FB'[OPS.index(a[0])]}{a[1]}" if is_action(a) else repr(a) for a in order)


def is_action(a) -> bool:
    return isinstance(a, tuple) and len(a) == 3 and a[0] in OPS and isinstance(a[1], int) and a[2] == 0


def stage(s: int, P: int, M: int):
    """The learner's order for stage s, as tuples; or the line that says what it raised, and where."""
    try:
        order = pipeline_schedules.one_f_one_b_stage(s, P, M)
        return [tuple(a) if isinstance(a, (list, tuple)) else a for a in order]
    except NotImplementedError as e:  # a blank: its own words say what to write
        return f"one_f_one_b_stage({s}, {P}, {M}) raised NotImplementedError: {e}"
    except Exception as e:  # noqa: BLE001  the learner's error, in one line with the learner's own line
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == pipeline_schedules.__file__]
        at = f" at pipeline_schedules.py:{frames[-1].lineno}: {frames[-1].line}" if frames else ""
        return f"one_f_one_b_stage({s}, {P}, {M}) raised {type(e).__name__}: {e}{at}"


def first_backward(order) -> int:
    """How many computations come before the first backward (its index)."""
    return next((i for i, a in enumerate(order) if a[0] == "backward"), len(order))


def problem(s: int, P: int, M: int, order) -> str | None:
    """The first way stage s's order leaves the contract, in words; None when it keeps it."""
    where = f"stage {s} of P={P}, M={M}"
    if isinstance(order, str):
        return order
    if not isinstance(order, list) or not all(is_action(a) for a in order):
        bad = order if not isinstance(order, list) else next(a for a in order if not is_action(a))
        return f"{where} gave {bad!r}: want a list of (op, microbatch, 0), op 'forward' or 'backward'"
    if sorted(order) != sorted((op, m, 0) for m in range(M) for op in OPS):
        return f"{where} does not run each microbatch's forward and backward once: {written(order)}"
    for op in OPS:
        ran = [m for o, m, _ in order if o == op]
        if ran != sorted(ran):
            return f"{where} runs its {op}s out of microbatch order: {written(order)}"
    done = set()
    for op, m, _ in order:
        if op == "backward" and m not in done:
            return f"{where} runs B{m} before F{m}, a backward before its forward: {written(order)}"
        done.add(m)
    before = first_backward(order)
    if before != min(P - s, M):
        return (f"{where} runs {before} forwards before its first backward, 1F1B runs min(P-s, M) = {min(P - s, M)} "
                f"(a warm-up of P-s-1, then the steady state's first forward): {written(order)}")
    if any(order[i][0] == order[i + 1][0] for i in range(before - 1, 2 * M - before)):
        return f"{where}: after the warm-up, forwards and backwards must alternate: {written(order)}"
    return None


def one_f_one_b_mistake(P: int, M: int) -> str | None:
    """The classic mistake behind the learner's 1F1B, read from its orders for every stage of P."""
    orders = {s: stage(s, P, M) for s in range(P)}
    orders = {s: o for s, o in orders.items() if isinstance(o, list) and all(is_action(a) for a in o)}
    for s, order in orders.items():
        extra = sorted({m for _, m, _ in order if not 0 <= m < M})
        if extra and M < P - s - 1:
            return mistake(MISTAKES, "warm-up ignoring M < P", f"stage {s} of P={P}, M={M} runs microbatches "
                           f"{extra}, which do not exist: {written(order)}")
    for s, order in orders.items():
        if order and order[0][0] == "backward" and s == P - 1:
            return mistake(MISTAKES, "backward before forward in the steady state", f"the last stage (P={P}, "
                           f"M={M}), which has no warm-up, starts with B{order[0][1]}: {written(order)}")
    for s, order in orders.items():
        forwards = sorted(m for op, m, _ in order if op == "forward")
        backwards = {m for op, m, _ in order if op == "backward"}
        if forwards == list(range(M)) and backwards < set(range(M)):
            return mistake(MISTAKES, "cool-down missing backwards", f"stage {s} of P={P}, M={M} never runs "
                           f"backwards {sorted(set(range(M)) - backwards)}: {written(order)}")
    for s, order in orders.items():
        if first_backward(order) == P - s + 1 <= M:
            return mistake(MISTAKES, "warm-up of P - s", f"stage {s} runs {P - s + 1} forwards before its first "
                           f"backward, one more than 1F1B's P-s = {P - s}")
    return None
