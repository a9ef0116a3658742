"""How long a learner waits for `./run.sh check`: the grading of a correct exercise, timed.

    ./run.sh bench 1 exercise_check

A learner iterates, so the answer has to come quickly: a passing exercise within 20 s on a 2-core laptop.
Each row copies the reference (the solution) of one exercise into a fresh workspace and times `check` on
it, its properties and its demo (2 ranks), paired with the same properties run by plain pytest without the
grader or the demo: the difference is what grading adds. On one rank: the check starts ranks of its own.
"""
import contextlib
import io
import os
import subprocess
import sys
import tempfile

import torch.distributed as dist

from mini_dist import bench
from mini_dist.kit import exercise, launch

LIMIT_S = 20.0


def check_time(args, repeats: int = 2) -> list[bench.Result]:
    if dist.get_world_size() > 1:
        launch.print0("exercise_check: the check starts its own ranks; run it alone: ./run.sh bench 1 exercise_check")
        return []
    results = []
    for module in exercise.exercises():  # every one, in the order to do them
        workspace = tempfile.mkdtemp(prefix="mini_dist-exercise-")
        with open(os.path.join(workspace, f"{module}.py"), "w") as f:
            f.write(exercise.reference(module))
        env, tests = exercise.grading(module, workspace)

        def graded():
            with contextlib.redirect_stdout(io.StringIO()) as said:
                if exercise.check(module, workspace) != 0:
                    raise RuntimeError(f"the reference of {module} failed its own check:\n{said.getvalue()}")

        def properties():
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "exercise", "-p", "no:cacheprovider",
                            *tests], cwd=exercise.ROOT, env=env, check=True, capture_output=True)

        results.append(bench.compare(f"check {module}", graded, properties, repeats, None, warmup=0,
                                     note="ours: ./run.sh check; native: its properties by plain pytest",
                                     limit_s=LIMIT_S))
    return results


BENCHES = {"exercise_check": check_time}
