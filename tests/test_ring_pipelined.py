"""The pipelined ring's own promises: what travels at N = 2, the reused receive scratch, and the demo's shapes.
Its results against dist.all_reduce are pinned in tests/test_ring_allreduce.py (ring_all_reduce and its kin)."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import device, rank_generator, run
from mini_dist import ring_pipelined as rp


def scratch_after(sizes):
    """The receive scratch after ring all-reduces of these sizes (fp32, then fp64): (numel, data_ptr)."""
    rp._SCRATCH.clear()
    seen = []
    for dtype in (torch.float32, torch.float64):
        for numel in sizes:
            x = torch.ones(numel, dtype=dtype, device=device())
            rp.ring_all_reduce(x)
            assert torch.equal(x, torch.full_like(x, dist.get_world_size()))
            assert len(rp._SCRATCH) == len({key[0] for key in rp._SCRATCH})  # one buffer per dtype, not per size
            seen.append({str(k[0]): (b.numel(), b.data_ptr()) for k, b in rp._SCRATCH.items()})
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_the_receive_scratch_is_one_buffer_per_dtype_reused_by_every_call_and_bounded(world):
    # a fresh MiB is 256 page faults when the data lands in it: the ring keeps its scratch between calls,
    # one buffer per dtype and device, never above IN_FLIGHT segments (EXCHANGE_AHEAD at N = 2) however
    # large the tensor
    sizes = [300, 1 << 20, 5 << 20, 1 << 20, 300]  # 1.2 KB, 4 MiB, 20 MiB, 4 MiB again, 1.2 KB again
    for seen in run(world, scratch_after, sizes):
        fp32, fp64 = seen[len(sizes) - 1], seen[-1]
        assert set(fp32) == {"torch.float32"} and set(fp64) == {"torch.float32", "torch.float64"}
        assert fp64["torch.float32"] == fp32["torch.float32"]  # fp64 calls left the fp32 buffer alone
        for key, elem in (("torch.float32", 4), ("torch.float64", 8)):
            steps = [s[key] for s in seen if key in s]
            for (n0, ptr0), (n1, ptr1) in zip(steps, steps[1:]):
                assert n1 >= n0 and (n1 > n0 or ptr1 == ptr0)  # new memory only to grow, never per call
            assert steps[-1] == steps[len(sizes) - 3]  # after the largest call: the same memory
            ahead = rp.EXCHANGE_AHEAD if world == 2 else rp.IN_FLIGHT
            assert rp.SEGMENT_BYTES < steps[-1][0] * elem <= ahead * rp.SEGMENT_BYTES


def what_travels(numel):
    """One ring all-reduce on two ranks: (the input, the pieces sent as they were sent, the sizes received,
    the result, gloo's)."""
    sent, received, saved = [], [], (dist.isend, dist.irecv)
    dist.isend = lambda piece, **k: sent.append(piece.clone()) or saved[0](piece, **k)
    dist.irecv = lambda piece, **k: received.append(piece.numel()) or saved[1](piece, **k)
    x = torch.randn(numel, generator=rank_generator(1)).to(device())
    try:
        rp.ring_all_reduce(y := x.clone())
    finally:
        dist.isend, dist.irecv = saved
    native = x.clone()
    dist.all_reduce(native)
    return x, sent, received, y, native


@pytest.mark.parametrize("numel", [1, 1000, 3 * (1 << 18) + 5])  # 4 B, 4 kB, 3 MiB + 20 B: 4 segments
def test_at_two_ranks_the_two_phases_fuse_into_one_exchange_of_the_whole_tensor(numel):
    # Both neighbours are the same rank: each sends its own tensor, untouched, once, in segments of at most
    # SEGMENT_BYTES, receives the peer's in the same segments and reduces it (one step, not reduce-scatter
    # then all-gather): the same D bytes, and still gloo's sums (two operands commute exactly)
    for x, sent, received, y, native in run(2, what_travels, numel):
        sizes = [p.numel() for p in sent]
        assert torch.equal(torch.cat(sent), x) and sizes == received and torch.equal(y, native)
        assert max(sizes) * 4 <= rp.SEGMENT_BYTES and len(sizes) == -(-numel * 4 // rp.SEGMENT_BYTES)


def both_shapes(numel, segment_bytes, in_flight):
    """The demo's all-reduce (N equal chunks) in the given shape, on integer data: (ours, dist's)."""
    x = torch.randint(-9, 10, (numel,), generator=rank_generator(numel)).float().to(device())
    saved = rp.SEGMENT_BYTES, rp.IN_FLIGHT, rp.EXCHANGE_AHEAD
    rp.SEGMENT_BYTES, rp.IN_FLIGHT, rp.EXCHANGE_AHEAD = segment_bytes, in_flight, in_flight
    try:
        ours = rp.all_reduce(x.clone())
    finally:
        rp.SEGMENT_BYTES, rp.IN_FLIGHT, rp.EXCHANGE_AHEAD = saved
    dist.all_reduce(x)
    return torch.equal(ours, x)


@settings(max_examples=8)
@given(world=st.integers(1, 4), k=st.integers(0, 700), segment_bytes=st.sampled_from([64, 1000, 1 << 62]),
       in_flight=st.integers(1, 3))
def test_the_demos_all_reduce_is_exact_on_integer_data_in_any_shape(world, k, segment_bytes, in_flight):
    assert all(run(world, both_shapes, world * k, segment_bytes, in_flight))
