"""Ring collectives against torch.distributed's own, for drawn shapes, dtypes, ops, world sizes, groups."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist import ring_allreduce as ra

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
OPS = {"sum": ra.SUM, "avg": ra.AVG, "max": ra.MAX, "min": ra.MIN, "product": ra.PRODUCT}


def draw_tensor(seed, shape, dtype, op):
    g = rank_generator(seed)
    if dtype.is_floating_point:
        # PRODUCT over 5 ranks of values near 1 stays finite in fp16; SUM sees mixed magnitudes.
        x = 1 + 0.1 * torch.randn(shape, generator=g) if op == "product" else \
            torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    else:
        lo, hi = (0, 4) if dtype == torch.uint8 or op == "product" else (-50, 50)
        x = torch.randint(lo, hi, shape, generator=g)
    return x.to(dtype).to(device())


def all_reduce_both(seed, shape, dtype, op, ranks, segment_bytes):
    group = subgroup(ranks) if ranks is not None else None
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    x = draw_tensor(seed, shape, dtype, op)
    native = x.clone()
    dist.all_reduce(native, op=OPS[op], group=group)
    old, ra.SEGMENT_BYTES = ra.SEGMENT_BYTES, segment_bytes
    try:
        ring = x.clone()
        returned = ra.ring_all_reduce(ring, OPS[op], group=group)
    finally:
        ra.SEGMENT_BYTES = old
    assert returned is ring  # in place, like dist.all_reduce
    return native.cpu(), ring.cpu()


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple) | st.sampled_from(
    [(1000, 3), (4097,), (2, 0, 5)])
def dtypes_for(op):
    return st.sampled_from(FLOATS if op == "avg" else FLOATS + INTS)


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=12)
@given(world=st.integers(1, 5), shape=shapes, data=st.data(), seed=st.integers(0, 10**6),
       segment_bytes=st.sampled_from([512, 4096, ra.SEGMENT_BYTES]))
def test_ring_all_reduce_is_bit_identical_to_native_for_any_shape_dtype_op_and_world_size(
        op, world, shape, data, seed, segment_bytes):
    # Bit-identical, floats included: the ring sums chunk c in gloo's order x[c-1] + x[c-2] + ... + x[c]
    # over gloo's chunk layout, and fp16/bf16 adds round to the same half value in both.
    dtype = data.draw(dtypes_for(op))
    for native, ring in run(world, all_reduce_both, seed, shape, dtype, op, None, segment_bytes):
        assert ring.dtype == dtype and ring.shape == shape
        assert torch.equal(native, ring), (native - ring).abs().max()


@given(world=st.integers(3, 5), data=st.data(), seed=st.integers(0, 10**6))
def test_ring_all_reduce_on_a_subgroup_equals_native_on_that_subgroup(world, data, seed):
    ranks = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
    results = run(world, all_reduce_both, seed, (37, 5), torch.float32, "sum", sorted(ranks), 64)
    for rank, result in enumerate(results):
        assert (result is None) == (rank not in ranks)
        if result is not None:
            assert torch.equal(*result)


def reduce_scatter_both(seed, block, dtype, op):
    n = dist.get_world_size()
    x = draw_tensor(seed, (n * block,), dtype, op)
    gathered = torch.empty(n * x.numel(), dtype=dtype, device=device())
    dist.all_gather_single(gathered, x)
    native = torch.empty(block, dtype=dtype, device=device())
    dist.reduce_scatter_single(native, x, op=OPS[op])
    ring = ra.ring_reduce_scatter(torch.empty_like(native), x, OPS[op])
    return native.cpu(), ring.cpu(), gathered.view(n, -1).cpu()


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=12)
@given(world=st.integers(1, 5), block=st.integers(0, 300), data=st.data(), seed=st.integers(0, 10**6))
def test_ring_reduce_scatter_equals_native_exactly_or_within_the_summation_order_bound(
        op, world, block, data, seed):
    dtype = data.draw(dtypes_for(op))
    # gloo's reduce-scatter is its all-reduce followed by a slice, so an element is summed in the order
    # of the all-reduce chunk it falls in, while our ring sums block r ending at rank r. Where the two
    # layouts coincide the results are bit-identical; elsewhere only the order of the N terms differs.
    # Each order is within (N-1)u * sum|x| of the exact sum (recursive summation, unit roundoff u), so
    # the two differ by at most 2(N-1)u * sum|x| (+ one rounding of the AVG division).
    for rank, (native, ring, xs) in enumerate(run(world, reduce_scatter_both, seed, block, dtype, op)):
        same_layout = ra.chunk_bounds(world * block, world, xs.element_size())[rank] == (
            rank * block, (rank + 1) * block)
        if same_layout or not dtype.is_floating_point or op in ("max", "min") or world <= 2:
            assert torch.equal(native, ring)
        else:
            u = torch.finfo(dtype).eps / 2
            mine = xs[:, rank * block:(rank + 1) * block].double()
            scale = mine.abs().prod(0) if op == "product" else mine.abs().sum(0)
            if op == "avg":
                scale = scale / world
            bound = (2 * (world - 1) + 2) * u * scale
            assert ((native.double() - ring.double()).abs() <= bound).all()


def all_gather_both(seed, shape, dtype):
    x = draw_tensor(seed, shape, dtype, "sum")
    n = dist.get_world_size()
    native = torch.empty(n * x.numel(), dtype=dtype, device=device())
    dist.all_gather_single(native, x.reshape(-1))  # gloo wants matching chunk shapes; 0-d becomes (1,)
    ring = ra.ring_all_gather(torch.empty_like(native), x)
    return native.cpu(), ring.cpu()


@given(world=st.integers(1, 5), shape=shapes, dtype=st.sampled_from(FLOATS + INTS),
       seed=st.integers(0, 10**6))
def test_ring_all_gather_is_bit_identical_to_native(world, shape, dtype, seed):
    for native, ring in run(world, all_gather_both, seed, shape, dtype):
        assert torch.equal(native, ring)


def ledger_of(numel, dtype, which):
    ra.LEDGER.reset()
    fn = ra.ring_all_reduce if which == "ring" else ra.naive_all_reduce
    fn(torch.ones(numel, dtype=dtype, device=device()))
    return ra.LEDGER.sent, ra.LEDGER.received


@given(world=st.integers(1, 5), numel=st.integers(0, 5000), dtype=st.sampled_from(
    [torch.float32, torch.float16, torch.float64]))
def test_ring_sends_2_n_minus_1_over_n_times_d_and_naive_root_sends_n_minus_1_times_d(world, numel, dtype):
    D = numel * torch.empty(0, dtype=dtype).element_size()
    ring = run(world, ledger_of, numel, dtype, "ring")
    chunks = [(b - a) * D // max(numel, 1) for a, b in ra.chunk_bounds(numel, world, D // max(numel, 1))]
    for rank, (sent, received) in enumerate(ring):
        # reduce-scatter sends every chunk but the rank's own and receives all but its right one's;
        # all-gather sends all but its left neighbour's chunk and receives all but its own
        right = chunks[(rank + 1) % world]
        assert (sent, received) == ((D - chunks[rank]) + (D - chunks[rank - 1]),
                                    (D - right) + (D - chunks[rank])) if world > 1 else (0, 0)
    # Over the ring: exactly 2(N-1)/N * D per rank on average, and per rank when N divides the tensor
    assert sum(s for s, _ in ring) == sum(r for _, r in ring) == 2 * (world - 1) * D
    if numel % (2 * world) == 0 and D <= ra.GLOO_SEGMENT_BYTES:
        assert {s for s, _ in ring} == {2 * (world - 1) * D // world}
    naive = run(world, ledger_of, numel, dtype, "naive")
    assert naive[0] == ((world - 1) * D, (world - 1) * D)
    assert all(sent == received == D for sent, received in naive[1:])


def naive_equals_native(seed, world_shape):
    x = draw_tensor(seed, world_shape, torch.int64, "sum")
    native = x.clone()
    dist.all_reduce(native)
    return torch.equal(native, ra.naive_all_reduce(x.clone()))


@pytest.mark.parametrize("world", [1, 2, 5])
def test_naive_all_reduce_equals_native_on_integers(world):
    assert all(run(world, naive_equals_native, 3, (7, 3)))


def reduce_mismatched(kind):
    r = dist.get_rank()
    if kind == "shape":
        x = torch.zeros(3 + (r == 1))
    elif kind == "dtype":
        x = torch.zeros(3, dtype=torch.float64 if r == 1 else torch.float32)
    elif kind == "device":
        x = torch.zeros(3, device="meta" if r == 1 else "cpu")
    elif kind == "op":
        return ra.ring_all_reduce(torch.zeros(3), op=dist.ReduceOp.BAND if r == 2 else ra.SUM)
    elif kind == "dtype_unsupported":
        return ra.ring_all_reduce(torch.zeros(3, dtype=torch.complex64 if r == 0 else torch.float32))
    elif kind == "avg_int":
        return ra.ring_all_reduce(torch.zeros(3, dtype=torch.int32), op=ra.AVG)
    else:
        return ra.ring_reduce_scatter(torch.empty(2), torch.zeros(5))
    return ra.ring_all_reduce(x)


@pytest.mark.parametrize("kind, message", [
    ("shape", r"ranks disagree: rank 0 has shape \(3,\).*rank 1 has shape \(4,\)"),
    ("dtype", r"rank 1 has shape \(3,\) dtype torch.float64"),
    ("device", r"rank 1 passed a tensor on the wrong device"),
    ("op", r"rank 2 asked for an unsupported op"),
    ("dtype_unsupported", r"rank 0 passed a tensor of an unsupported dtype"),
    ("avg_int", r"AVG of torch.int32 tensors would round"),
    ("sizes", r"input has 5 elements, expected group size 3 x output's 2"),
])
def test_bad_input_fails_on_every_rank_with_a_clear_error_and_no_hang(kind, message):
    with pytest.raises(RankFailure, match=message) as info:
        run(3, reduce_mismatched, kind, timeout=30)
    # every rank raised (none blocked waiting for another): the harness saw three failures, no silence
    assert str(info.value).count("failed: ValueError") == 3
