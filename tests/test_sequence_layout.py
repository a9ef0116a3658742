"""Sequence layouts (mini_dist/sequence_layout.py): who holds which tokens, and what the causal mask leaves them.

split_sequence and gather_sequence are inverse, rank r holds exactly the positions of chunks chunk_ids(r),
split's gradient lands back in place, the zigzag split equals torch's context_parallel head-tail sharding,
and the causal pairs per rank equal the docstring's formulas (zigzag: the same on every rank). All exact:
integers and permutations, no rounding.
"""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from harness import device, run
from mini_dist import sequence_layout as sl

F64 = torch.float64


def positions(rank, C, S, layout):
    """Where rank's tokens sit in the sequence: chunk c of the layout holds positions c*L .. (c+1)*L - 1."""
    L = S // (C * len(sl.chunk_ids(0, C, layout)))
    return [p for c in sl.chunk_ids(rank, C, layout) for p in range(c * L, (c + 1) * L)]


def layout_round_trip(S, layout):
    """split then gather gives the sequence back; rank r holds chunks chunk_ids(r); the whole sequence's
    gradient is every rank's part's gradient, in place (rank r weights its part by r + 1)."""
    C, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(S, dtype=F64, device=device()).view(1, 1, S, 1).requires_grad_()
    part = sl.split_sequence(x, layout=layout)
    (part * (r + 1)).sum().backward()
    owner = torch.empty(S, dtype=F64)  # cpu: expected values, compared after .cpu()
    for rank in range(C):
        owner[positions(rank, C, S, layout)] = rank + 1.0
    return (torch.equal(sl.gather_sequence(part, layout=layout), x.detach()),
            part.flatten().long().tolist() == positions(r, C, S, layout),
            torch.equal(x.grad.flatten().cpu(), owner))


@pytest.mark.parametrize("C", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", sl.LAYOUTS)
def test_split_and_gather_sequence_are_inverse_and_rank_r_holds_chunks_r_and_2C_minus_1_minus_r(C, layout):
    for result in run(C, layout_round_trip, 4 * C, layout):
        assert result == (True, True, True)


def torch_head_tail_layout(S):
    """torch's context_parallel shards a buffer with its head-tail load balancer: rank r holds chunks r and 2C-1-r."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    buffer = torch.arange(S, dtype=F64, device=device()).view(1, 1, S, 1)
    ours = sl.split_sequence(buffer.clone())
    with context_parallel(init_device_mesh(device().type, (dist.get_world_size(),)), buffers=[buffer],
                          buffer_seq_dims=[2]):
        return torch.equal(buffer, ours)


@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_zigzag_split_equals_torch_context_parallel_head_tail_sharding(C):
    assert all(run(C, torch_head_tail_layout, 4 * C))


@pytest.mark.single_process
@given(C=st.integers(1, 8), L=st.integers(1, 6))
def test_causal_pairs_per_rank_equal_the_formulas_and_zigzag_gives_every_rank_the_same(C, L):
    S = 2 * C * L
    pairs = {layout: sl.causal_pairs(S, C, layout) for layout in sl.LAYOUTS}
    direct = {layout: [sum(p + 1 for p in positions(r, C, S, layout)) for r in range(C)] for layout in sl.LAYOUTS}
    assert pairs == direct
    assert sum(pairs[sl.ZIGZAG]) == sum(pairs[sl.CONTIGUOUS]) == S * (S + 1) // 2
    assert pairs[sl.ZIGZAG] == [(2 * C - 1) * L * L + L * (L + 1)] * C
    Lc = 2 * L  # contiguous: S/C tokens per rank
    assert pairs[sl.CONTIGUOUS] == [r * Lc * Lc + Lc * (Lc + 1) // 2 for r in range(C)]
