"""Where a learner's code raised, in one line: a property that runs it in this process (no ranks) says the error
and the line of the learner's file it came from, never a bare traceback from inside torch."""
import os
import sys
import traceback


def raised(error: BaseException, module: str) -> str:
    """'TypeError: ... (raised at loss_scaling.py:97 in step: return ...)'; when the error came from inside torch,
    the learner's line that called into it ('from a call at ...')."""
    path = os.path.abspath(getattr(sys.modules.get(f"mini_dist.{module}"), "__file__", "") or "")
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == path]
    said = f"{type(error).__name__}: {' '.join(str(error).split())}"
    if not mine:
        return said
    last = mine[-1]
    how = "raised at" if last is frames[-1] else "from a call at"
    return f"{said} ({how} {module}.py:{last.lineno} in {last.name}: {(last.line or '').strip()})"
