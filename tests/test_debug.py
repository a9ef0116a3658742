"""Ranks that disagree or vanish are named (mini_dist/debug.py).

Without the debug mode, an all-reduce of tensors with the same number of elements but another shape runs and
returns a wrong sum: that is the mistake the mode exists for. With it, every rank raises naming the rank, both
shapes and the lines that called (the mini_dist layer and the user's own line). The ring and the pipeline
name a vanished peer (tests/test_ring_allreduce.py, tests/test_pipeline.py); here `wait_for` itself.
"""
import os

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure, device, run
from mini_dist import comm
from mini_dist.kit import debug


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


class FailingWork:
    def __init__(self, error="Connection reset by peer\n(gloo details)"):
        self.error = error

    def wait(self):
        raise RuntimeError(self.error)


def test_wait_for_names_the_peer_and_where_to_look():
    with pytest.raises(debug.PeerLost, match=r"ring step 3: lost rank 7 \(Connection reset by peer\); "
                                             r"look for the first error in rank 7's log"):
        debug.wait_for(FailingWork(), 7, "ring step 3")


def test_a_peer_that_stays_silent_until_the_timeout_is_named_as_a_wait_not_a_loss():
    with pytest.raises(debug.PeerLost, match=r"ring step 3: waited for rank 7 until the group's timeout \(\[x.cc:78\] "
                                             r"Timed out waiting 10000ms for recv operation to complete\): rank 7 "
                                             r"never posted the matching operation; is it waiting for this rank\?"):
        debug.wait_for(FailingWork("[x.cc:78] Timed out waiting 10000ms for recv operation to complete"), 7,
                       "ring step 3")
