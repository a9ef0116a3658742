"""The multi-rank test harness: one long-lived pool of ranks per world size (mini_dist/kit/ranks.py).

A test calls

    results = run(world_size, fn, *args)      # fn: a module-level function, run on every rank

and receives every rank's return value, or a `RankFailure` that names each rank that raised, died or
hung, with its traceback (the pool restarts after a failure that left ranks out of step).

Backend and device come from the environment: MINI_DIST_BACKEND=nccl gives each rank its own GPU, and a
world larger than the GPUs present is skipped with the number it needs. Tests create tensors on
`device()`, never with `.cuda()`.
"""
import atexit
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mini_dist.kit import launch
from mini_dist.kit.ranks import CALL_TIMEOUT_S, Pool, RankFailure  # noqa: F401  (RankFailure: the tests')

BACKEND = os.environ.get("MINI_DIST_BACKEND", "gloo")
# torch's heavy imports once, in the server every rank forks from; the suite runs with mini_dist's debug mode
# on, so ranks that disagree before a collective are named
PRELOAD = ["torch.distributed.fsdp", "torch.distributed.optim", "torch._dynamo", "harness"]
ENV = {"MINI_DIST_DEBUG": "1"}


_pools: dict[int, Pool] = {}


SINGLE_PROCESS = False  # set by conftest while a test marked single_process runs


def run(world: int, fn, *args, timeout: float = CALL_TIMEOUT_S, **kwargs) -> list:
    """Run fn(*args, **kwargs) on every rank of a live pool of `world` ranks; return all results."""
    if SINGLE_PROCESS:
        raise AssertionError("a test marked single_process starts ranks: remove the mark")
    if BACKEND == "nccl" and world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs for {world} NCCL ranks (NCCL refuses two ranks on one GPU: "
                    f"'Duplicate GPU detected'); {torch.cuda.device_count()} present")
    if world not in _pools:
        _pools[world] = Pool(world, BACKEND, PRELOAD, ENV)
    return _pools[world].run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def close_all() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


# ----- helpers for the functions that run on the ranks -----

def device() -> torch.device:
    """The rank's device: tests create every tensor here (cpu under gloo, cuda:rank under NCCL)."""
    return launch.device()


def rank_generator(seed: int) -> torch.Generator:
    """Each rank draws its own data: identical data on every rank hides averaging and ordering bugs."""
    import torch.distributed as dist
    return torch.Generator().manual_seed(seed * 1009 + dist.get_rank())


_groups: dict[tuple, object] = {}


def subgroup(ranks) -> object:
    """A cached subgroup: every rank of the pool calls this with the same ranks, in the same order."""
    key = tuple(sorted(ranks))
    if key not in _groups:
        _groups[key] = launch.new_group(key)
    return _groups[key]


def refusal(module, world: int, argv: list, monkeypatch, capsys) -> list[str]:
    """What a demo prints to stderr when rank 0 of `world` is given `argv`; it must exit 2, refused before it joins
    any process group (were it accepted, joining a group of absent ranks would fail fast: a 3 s timeout)."""
    import torch.distributed as dist
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MINI_DIST_TIMEOUT", "3")
    assert launch.main(module.parser(), module.demo, argv) == 2 and not dist.is_initialized()
    return capsys.readouterr().err.strip().splitlines()


# ----- commands the tests start: torchrun, run.sh, a learner's check -----

def command(args: list, timeout: float = 900, **kwargs) -> "subprocess.CompletedProcess":
    """subprocess.run(args, capture_output=True, text=True) in a session of its own. The timeout is only
    against a real hang (a busy machine may be slow, and no test judges the clock): past it, the session gets
    SIGTERM (torchrun then stops its ranks, which run in sessions of their own and would keep the pipes open),
    then SIGKILL, and the test fails with the tail of what the command printed."""
    import signal
    import subprocess
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           **kwargs)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        what = "still ran" if job.poll() is None else "had exited, but a process it started still held its output"
        out, err = "", ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(job.pid, sig)
            except ProcessLookupError:
                pass
            try:
                out, err = job.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                err = "(its output stayed open: a process it started, in a session of its own, outlived it)"
        pytest.fail(f"{' '.join(map(str, args))} {what} after {timeout:.0f} s (a hang):\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # nothing it started in its session outlives the test
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, job.returncode, out, err)
