"""Ranks that disagree are named (mini_dist/kit/debug.py).

Without the debug mode, an all-reduce of tensors with the same number of elements but another shape runs and
returns a wrong sum: that is the mistake the mode exists for. With it, every rank raises naming the rank, both
shapes and the lines that called (the mini_dist layer and the user's own line). A vanished peer is named by
the kit's wire (tests/test_wire.py, tests/test_dead_rank.py); who failed first is decided from the fates the
ranks wrote in the store (kit/fates.py): the earliest of those that raised, left or vanished, never a rank that
only lost another, a word that arrives late included.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure, device, run
from mini_dist import comm
from mini_dist.kit import debug, fates


def tokens(shape):
    b, t = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")  # cpu: token ids, moved below
    return (10.0 * b + t).unsqueeze(-1).expand(*shape, 4).to(device())


def sum_with_one_rank_transposed(on, bad):
    shape = (3, 2) if dist.get_rank() == bad else (2, 3)
    before, debug.DEBUG = debug.DEBUG, on
    try:
        x = tokens(shape)
        return torch.equal(comm.g(x), dist.get_world_size() * x)
    finally:
        debug.DEBUG = before


def debug_mode():
    return debug.DEBUG


@pytest.mark.parametrize("world", [1, 3])
def test_the_suites_ranks_run_in_debug_mode_though_their_server_imported_debug_without_it(world):
    """The pool's ranks are forked from a server that may import mini_dist.kit.debug (here: harness, preloaded)
    before MINI_DIST_DEBUG=1 is set for the ranks; each rank reads it again."""
    import harness
    assert harness.ENV["MINI_DIST_DEBUG"] == "1" and "MINI_DIST_DEBUG" not in os.environ
    assert run(world, debug_mode) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_without_debug_a_transposed_rank_gives_a_silently_wrong_sum(world):
    results = run(world, sum_with_one_rank_transposed, False, 1)
    assert results[0] is False  # no error anywhere, and rank 0's tokens are summed with other tokens
    assert all(run(world, sum_with_one_rank_transposed, False, -1))  # everyone alike: the right sum


@pytest.mark.parametrize("world", [2, 4])
def test_with_debug_every_rank_names_the_rank_and_the_users_line(world):
    with pytest.raises(RankFailure) as failure:
        run(world, sum_with_one_rank_transposed, True, world - 1)
    text = str(failure.value)
    assert all(f"rank {r} failed: Disagreement" in text for r in range(world))
    assert f"rank {world - 1} calls all_reduce ((3, 2, 4)" in text
    assert "test_debug.py:" in text and "in sum_with_one_rank_transposed" in text  # the caller's own line


# ----- who failed first (mini_dist/kit/fates.py), decided from the fates in the store -----

def decide(records: dict, late=None):
    """Each rank r in `records` writes its fate (kind, seconds ago, text) in the store, rank `late` 0.2 s after
    rank 0 started deciding; rank 0 decides who failed first. The fates are removed again: the pool lives on."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    now = time.time()

    def write():
        kind, ago, text = records[me]
        store.set(f"{fates.FATE}{me}", f"{kind}|{now - ago}|{text}")
    if me in records and me != late:
        write()
    dist.barrier()
    if me == late:
        time.sleep(0.2)
        write()
    found = fates.first_failure() if me == 0 else None
    dist.barrier()
    store.delete_key(f"{fates.FATE}{me}")
    return found


def test_the_first_failure_is_the_earliest_rank_that_raised_left_or_vanished_never_one_that_lost_another():
    found = run(4, decide, {1: ("lost", 9, "2"), 2: ("error", 1, "ValueError: x"), 3: ("left", 2, "")})[0]
    assert found[0] == 3 and found[1].startswith("it left the group"), found
    found = run(4, decide, {1: ("lost", 9, "3"), 2: ("error", 1, "ValueError: x")})[0]
    assert found == (2, "it failed first: ValueError: x; its log has the traceback"), found


def test_an_earlier_failure_whose_word_arrives_late_still_wins():
    found = run(4, decide, {2: ("error", 0, "ValueError: second"), 3: ("error", 3, "ValueError: first")}, late=3)[0]
    assert found[0] == 3 and "first" in found[1], found


def test_with_no_failure_the_rank_another_waited_for_until_the_timeout_is_named_else_none():
    assert run(3, decide, {})[0] is None  # every rank alive, none said it failed: after the grace, no one
    found = run(3, decide, {1: ("lost", 1, "2")})[0]  # rank 1 waited for rank 2 until the timeout
    assert found == (2, "it stopped answering: alive, but rank 1 waited for it until the group's timeout"), found


def word_that_stands():
    """A rank that stopped after losing rank 2, then exited (launch.leave writes 'left' at exit)."""
    fates.record("lost", "2")
    standing = fates.record("left")
    dist.distributed_c10d._get_default_store().delete_key(f"{fates.FATE}{dist.get_rank()}")
    return standing.split("|")[0], standing.split("|")[2]


def test_a_rank_that_lost_a_peer_stays_its_victim_when_it_exits():
    assert run(2, word_that_stands) == [("lost", "2")] * 2
