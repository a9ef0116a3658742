"""The harness itself: results from every rank, failures named by rank, and recovery after them."""
import os
import time

import pytest
import torch
import torch.distributed as dist

import harness
from harness import RankFailure, device, rank_generator, run


def rank_and_sum(value):
    t = torch.tensor([float(dist.get_rank() + value)], device=device())
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"bad on purpose at {bad_rank}")
    dist.all_reduce(torch.ones(1, device=device()))  # the others block here, waiting for the rank that raised
    return "unreachable for a world > 1"


def die_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(7)
    dist.all_reduce(torch.ones(1, device=device()))


def hang_on(bad_rank):
    if dist.get_rank() == bad_rank:
        dist.recv(torch.empty(1, device=device()), src=(bad_rank + 1) % dist.get_world_size())  # nobody ever sends
    return "done"


def everyone_rejects():
    raise ValueError("same bad input on every rank")


def draw(seed):
    return torch.randn(3, generator=rank_generator(seed)).tolist()  # cpu: numbers handed back to the test


@pytest.mark.parametrize("world", [1, 2, 3])
def test_run_returns_every_ranks_result_in_rank_order(world):
    results = run(world, rank_and_sum, 1)
    expected = sum(r + 1 for r in range(world))
    assert results == [(r, float(expected)) for r in range(world)]


def test_a_raising_rank_is_named_fast_and_the_pool_recovers():
    with pytest.raises(RankFailure, match=r"rank 1 failed: ValueError: bad on purpose at 1") as info:
        run(3, raise_on, 1, timeout=60)
    assert "rank 0: no answer" in str(info.value)
    assert run(3, rank_and_sum, 0)[0] == (0, 3.0)


def test_a_dying_rank_is_named_and_the_pool_recovers():
    with pytest.raises(RankFailure, match=r"rank 2 failed: died \(exit code 7\)"):
        run(3, die_on, 2, timeout=60)
    assert run(3, rank_and_sum, 0)[2] == (2, 3.0)


def test_a_hanging_rank_is_named_when_the_call_times_out_and_the_pool_recovers():
    with pytest.raises(RankFailure, match=r"rank 1: no answer") as info:
        run(2, hang_on, 1, timeout=3)
    assert "rank 0" not in str(info.value)  # rank 0 answered; only the silent rank is named
    assert run(2, rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]


def test_an_error_raised_by_every_rank_keeps_the_pool():
    run(2, rank_and_sum, 0)
    pids_before = [p.pid for p in harness._pools[2].procs]
    with pytest.raises(RankFailure, match="same bad input on every rank"):
        run(2, everyone_rejects)
    assert [p.pid for p in harness._pools[2].procs] == pids_before


def everyone_times_out():
    raise RuntimeError("[unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation to complete")


def test_a_timeout_on_every_rank_restarts_the_pool_whose_links_it_broke():
    # gloo closes the pairs of a rank that timed out: a group kept after it fails every later call
    run(2, rank_and_sum, 0)
    pids_before = [p.pid for p in harness._pools[2].procs]
    with pytest.raises(RankFailure, match="Timed out waiting"):
        run(2, everyone_times_out)
    assert [p.pid for p in harness._pools[2].procs] != pids_before
    assert run(2, rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]


def test_each_rank_draws_different_data():
    a, b = run(2, draw, 5)
    assert a != b


def test_a_parametrized_propertys_own_example_count_is_scaled_once_not_once_per_parameter():
    from types import SimpleNamespace

    from hypothesis import given, settings as hsettings, strategies as st

    from conftest import scale_own_settings

    @hsettings(max_examples=12)
    @given(st.integers())
    def prop(x):
        pass

    scale_own_settings([SimpleNamespace(obj=prop) for _ in range(5)], 8)  # 5 parametrized items, one function
    assert prop._hypothesis_internal_use_settings.max_examples == 96


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R running, S sleeping, Z zombie), or "gone"."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.single_process
def test_a_command_past_its_timeout_fails_the_test_and_leaves_nothing_running(tmp_path):
    """harness.command: a hang ends the test with what the command printed, and every process it started in
    its session is gone (a child still holding the pipes would make the test wait forever)."""
    pidfile = tmp_path / "child"
    with pytest.raises(pytest.fail.Exception, match=r"still ran after 1 s \(a hang\):\nstarted"):
        harness.command(["bash", "-c", f"echo started; sleep 60 & echo $! > {pidfile}; wait"], timeout=1)
    child = int(pidfile.read_text())
    # killpg returns once the signal is sent; the child may still be exiting (state R) for a moment. One that
    # survived would sleep on (state S) for its 60 s, so waiting up to 5 s for it to finish cannot hide it.
    deadline = time.monotonic() + 5
    state = process_state(child)
    while state not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
        state = process_state(child)
    assert state in ("gone", "Z"), state  # gone, or a zombie its new parent has not reaped yet: not running
    assert harness.command(["bash", "-c", "echo done"]).stdout == "done\n"
