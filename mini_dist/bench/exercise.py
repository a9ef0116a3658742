"""How long a learner waits for `./run.sh check`: a passing check, and the first failing property, timed.

    ./run.sh bench 1 exercise_check          # every exercise's reference, checked: check against plain pytest
    ./run.sh bench 1 exercise_busy           # the same on a busy laptop: one busy loop per core beside it

A learner iterates, so the answer has to come quickly, on the laptop as it is, other programs running: a
passing check within 20 s, and the first failing property printed within 10 s, with both cores busy.

exercise_check: each row copies the reference (the solution) of one exercise into a fresh workspace and times
`check` on it, its properties and its demo, paired with the same properties run by plain pytest without the
grader or the demo: the difference is what grading adds.

exercise_busy (every exercise, once each side: 17 x 4 checks take about 15 minutes): one busy loop per core
runs during every timed call; "passing" times the whole check of the reference (ours) against the same check
with the cores idle (native), and "first FAIL" the time until a fresh, blank copy's first FAIL line is
printed (the check is then stopped), busy against idle. What else ran on the machine is not ours to stop:
read the idle column beside the busy one. On one rank: the check starts ranks of its own.
"""
import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist

from mini_dist import bench
from mini_dist.kit import exercise, launch

LIMIT_S = 20.0
FIRST_FAIL_S = 10.0


def alone(name: str) -> bool:
    if dist.get_world_size() > 1:
        launch.print0(f"{name}: the check starts its own ranks; run it alone: ./run.sh bench 1 {name}")
        return False
    return True


def workspace(module: str, source: str) -> str:
    path = tempfile.mkdtemp(prefix="mini_dist-exercise-")
    with open(os.path.join(path, f"{module}.py"), "w") as f:
        f.write(source)
    return path


def check_time(args, repeats: int = 2) -> list[bench.Result]:
    if not alone("exercise_check"):
        return []
    results = []
    for module in exercise.exercises():  # every one, in the order to do them
        place = workspace(module, exercise.reference(module))
        env, tests = exercise.grading(module, place)

        def graded():
            with contextlib.redirect_stdout(io.StringIO()) as said:
                if exercise.check(module, place) != 0:
                    raise RuntimeError(f"the reference of {module} failed its own check:\n{said.getvalue()}")

        def properties():
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "exercise", "-p", "no:cacheprovider",
                            *tests], cwd=exercise.ROOT, env=env, check=True, capture_output=True)

        results.append(bench.compare(f"check {module}", graded, properties, repeats, None, warmup=0,
                                     note="ours: ./run.sh check; native: its properties by plain pytest",
                                     limit_s=LIMIT_S))
    return results


@contextlib.contextmanager
def busy(loops: int):
    """`loops` processes spinning, each a core's worth of someone else's work."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        yield
    finally:
        for p in spinning:
            p.kill()
            p.wait()


def checked(module: str, place: str, until_fail: bool) -> None:
    """Run the check as a learner does (run.sh's command); with until_fail, stop it at its first FAIL line."""
    job = subprocess.Popen([sys.executable, os.path.join(exercise.ROOT, "mini_dist", "kit", "exercise.py"), "check",
                            module, "--workspace", place], cwd=exercise.ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    said = []
    for line in job.stdout:
        said.append(line)
        if until_fail and line.startswith("FAIL"):
            os.killpg(job.pid, signal.SIGKILL)  # the check, its pytest, the fork server and the ranks
            break
    job.wait()
    if not until_fail and job.returncode != 0:
        raise RuntimeError(f"the reference of {module} failed its own check:\n{''.join(said)}")
    if until_fail and not any(line.startswith("FAIL") for line in said):
        raise RuntimeError(f"a blank {module} printed no FAIL line:\n{''.join(said)}")


def busy_time(args, repeats: int = 1) -> list[bench.Result]:
    if not alone("exercise_busy"):
        return []
    cores = len(os.sched_getaffinity(0))
    results = []
    for module in exercise.exercises():
        for what, source, limit, until_fail in (
                ("passing", exercise.reference(module), LIMIT_S, False),
                ("first FAIL", exercise.blank(exercise.reference(module), module), FIRST_FAIL_S, True)):
            place = workspace(module, source)
            times = {"ours": [], "native": []}
            for i in range(repeats):  # the two sides take turns: busy, idle, idle, busy, ...
                for side in ("ours", "native") if i % 2 == 0 else ("native", "ours"):
                    with busy(cores if side == "ours" else 0):
                        time.sleep(0.5 if side == "ours" else 0)  # the loops running before the learner's enter
                        started = time.perf_counter()
                        checked(module, place, until_fail)
                        times[side].append(time.perf_counter() - started)
            ratio = bench.median([a / b for a, b in zip(times["ours"], times["native"])])
            result = bench.Result(f"check {module}, {what}", bench.median(times["ours"]),
                                  bench.median(times["native"]), ratio, None,
                                  f"ours: {cores} busy loops beside it; native: none", times, limit)
            launch.print0(f"  {result.name}: busy {bench.fmt_seconds(result.ours)}, idle "
                          f"{bench.fmt_seconds(result.native)} (limit {limit:g} s){'' if result.ok else ' MISS'}")
            results.append(result)
    return results


BENCHES = {"exercise_check": check_time, "exercise_busy": busy_time}
