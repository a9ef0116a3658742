"""Ranks that disagree are named (mini_dist/kit/debug.py).

Without the debug mode, an all-reduce of tensors with the same number of elements but another shape runs and
returns a wrong sum: that is the mistake the mode exists for. With it, every rank raises naming the rank, both
shapes and the lines that called (the mini_dist layer and the user's own line). A vanished peer is named by
the kit's wire (tests/test_wire.py, tests/test_ring_allreduce.py, tests/test_pipeline_executor.py).
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
