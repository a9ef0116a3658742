"""The tour passes on a busy laptop: every demo exits 0 while a busy loop runs on every core.

A demo's exit status may depend only on what is deterministic (equality with PyTorch, bytes, memory,
schedules against formulas); a wall-clock figure is printed with its noise and never judged. This runs the
whole tour (`./run.sh`) with one busy-loop process per core competing for the CPU, and requires every demo
to exit 0. Slow (several minutes): CI runs it with -m slow.
"""
import multiprocessing
import os

import pytest

from harness import command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup's CPU quota where one is set (a
    container may see every core of its host and get two of them)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def spin(stop):
    while not stop.is_set():
        pass


@pytest.mark.slow
def test_every_demo_of_the_tour_exits_0_on_a_loaded_machine():
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(usable_cores())]
    for hog in hogs:
        hog.start()
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                                "MASTER_ADDR", "OMP_NUM_THREADS")}
        # the tour takes about 8 minutes so on 2 cores; the timeout is only against a hang, which it names
        result = command([os.path.join(ROOT, "run.sh")], timeout=1800, env=env, cwd=ROOT)
    finally:
        stop.set()
        for hog in hogs:
            hog.join()
    failed = [line for line in result.stdout.splitlines() if line.startswith("demos that exited non-zero")]
    assert result.returncode == 0 and not failed, (failed, result.stdout[-3000:], result.stderr[-3000:])
    assert "=== summary ===" in result.stdout and " of " in result.stdout  # progress, then the table
