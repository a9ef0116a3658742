"""Where a learner's code raised, in one line: a property that runs it in this process (no ranks) says the error
and the line of the learner's file it came from, never a bare traceback from inside torch."""
import os
import sys
import traceback

from mini_dist.kit.exercise import reference, regions


def raised(error: BaseException, module: str) -> str:
    """'KeyError: 3 (raised at loss_scaling.py:97 in step: ...)'. From inside torch: the learner's line that called
    into it; from a function of the module that is not an exercise: also the exercise's line that called it."""
    path = os.path.abspath(getattr(sys.modules.get(f"mini_dist.{module}"), "__file__", "") or "")
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == path]
    said = f"{type(error).__name__}: {' '.join(str(error).split())}"
    if not mine:
        return said
    written = {r.function.split(".")[-1] for r in regions(reference(module))}
    callers = [f for f in mine if f.name in written]
    last = mine[-1]
    said += f" ({'raised at' if last is frames[-1] else 'from a call at'} {at(module, last)}"
    if callers and callers[-1] is not last:
        said += f", called from {at(module, callers[-1])}"
    return said + ")"


def at(module: str, frame) -> str:
    return f"{module}.py:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
