"""Ring collectives against torch.distributed's own, for drawn shapes, dtypes, ops, world sizes, groups: the
library's (mini_dist/ring_pipelined.py: the pipelined stream on gloo, with drawn segment sizes) and the textbook's
(mini_dist/ring_allreduce.py), whose steps are the learner's exercise."""
import contextlib
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import ring_exercise
from grading import optional
from ring_exercise import MISTAKES  # noqa: F401  (the ring exercise's, declared beside its judge)
from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist import ring_allreduce as ra
from mini_dist import ring_pipelined as rp
from mini_dist.kit import debug, launch

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
OPS = {"sum": ra.SUM, "avg": ra.AVG, "max": ra.MAX, "min": ra.MIN, "product": ra.PRODUCT}


def draw_tensor(seed, shape, dtype, op):
    g = rank_generator(seed)
    if dtype.is_floating_point:
        # PRODUCT over 5 ranks of values near 1 stays finite in fp16; SUM sees mixed magnitudes.
        x = (1 + 0.1 * torch.randn(shape, generator=g) if op == "product" else  # cpu: moved below
             torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g)))  # cpu: moved below
    else:
        lo, hi = (0, 4) if dtype == torch.uint8 or op == "product" else (-50, 50)
        x = torch.randint(lo, hi, shape, generator=g)  # cpu: drawn on the CPU (the same on any device), moved below
    return x.to(dtype).to(device())


@contextlib.contextmanager
def pipelined(segment_bytes, in_flight):
    """The ring with segments of segment_bytes and in_flight receives posted ahead in the reduce-scatter
    (and in the exchange at N = 2)."""
    saved = rp.SEGMENT_BYTES, rp.IN_FLIGHT, rp.EXCHANGE_AHEAD
    rp.SEGMENT_BYTES, rp.IN_FLIGHT, rp.EXCHANGE_AHEAD = segment_bytes, in_flight, in_flight
    try:
        yield
    finally:
        rp.SEGMENT_BYTES, rp.IN_FLIGHT, rp.EXCHANGE_AHEAD = saved


# 512 and 4096 B cut the drawn tensors into several segments per chunk; 1 and 3 receives ahead shift which
# scratch slot a segment lands in
pipelines = st.tuples(st.sampled_from([512, 4096, rp.SEGMENT_BYTES]), st.sampled_from([1, 2, 3]))


def all_reduce_both(seed, shape, dtype, op, ranks, pipeline, transposed=False):
    group = subgroup(ranks) if ranks is not None else None
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    x = draw_tensor(seed, shape, dtype, op)
    x = x.t() if transposed and x.dim() == 2 else x  # a strided view: reduced through a contiguous copy
    # gloo reduces a strided tensor in memory order, the ring in index order: compare in index order
    native = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(native, op=OPS[op], group=group)
    ring = x.clone()
    with pipelined(*pipeline):
        returned = rp.ring_all_reduce(ring, OPS[op], group=group)
    assert returned is ring  # in place, like dist.all_reduce
    return native.cpu(), ring.cpu()


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple) | st.sampled_from(
    [(1000, 3), (4097,), (2, 0, 5)])


def dtypes_for(op):
    return st.sampled_from(FLOATS if op == "avg" else FLOATS + INTS)


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=12)
@given(world=st.integers(1, 5), shape=shapes, data=st.data(), seed=st.integers(0, 10**6), pipeline=pipelines,
       transposed=st.booleans())
def test_ring_all_reduce_is_bit_identical_to_native_for_any_shape_dtype_op_and_world_size(
        op, world, shape, data, seed, pipeline, transposed):
    # Bit-identical, floats included: the ring sums chunk c in gloo's order x[c-1] + x[c-2] + ... + x[c]
    # over gloo's chunk layout, and fp16/bf16 adds round to the same half value in both.
    dtype = data.draw(dtypes_for(op))
    for native, ring in run(world, all_reduce_both, seed, shape, dtype, op, None, pipeline, transposed):
        assert ring.dtype == dtype and ring.shape == native.shape
        assert torch.equal(native, ring), (native - ring).abs().max()


@given(world=st.integers(3, 5), data=st.data(), seed=st.integers(0, 10**6))
def test_ring_all_reduce_on_a_subgroup_equals_native_on_that_subgroup(world, data, seed):
    ranks = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
    results = run(world, all_reduce_both, seed, (37, 5), torch.float32, "sum", sorted(ranks), (64, 2))
    for rank, result in enumerate(results):
        assert (result is None) == (rank not in ranks)
        if result is not None:
            assert torch.equal(*result)


def reduce_scatter_both(seed, block, dtype, op, pipeline):
    n = dist.get_world_size()
    x = draw_tensor(seed, (n * block,), dtype, op)
    gathered = torch.empty(n * x.numel(), dtype=dtype, device=device())
    dist.all_gather_single(gathered, x)
    native = torch.empty(block, dtype=dtype, device=device())
    dist.reduce_scatter_single(native, x, op=OPS[op])
    given = x.clone()
    with pipelined(*pipeline):
        ring = rp.ring_reduce_scatter(torch.empty_like(native), x, OPS[op])
    assert torch.equal(x, given)  # the input is left as it was, as by the native reduce-scatter
    return native.cpu(), ring.cpu(), gathered.view(n, -1).cpu()


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=12)
@given(world=st.integers(1, 5), block=st.integers(0, 300), data=st.data(), seed=st.integers(0, 10**6),
       pipeline=pipelines)
def test_ring_reduce_scatter_equals_native_exactly_or_within_the_summation_order_bound(
        op, world, block, data, seed, pipeline):
    dtype = data.draw(dtypes_for(op))
    # gloo's reduce-scatter is its all-reduce followed by a slice, so an element is summed in the order
    # of the all-reduce chunk it falls in, while our ring sums block r ending at rank r. Where the two
    # layouts coincide the results are bit-identical; elsewhere only the order of the N terms differs.
    # Each order is within (N-1)u * sum|x| of the exact sum (recursive summation, unit roundoff u), so
    # the two differ by at most 2(N-1)u * sum|x| (+ one rounding of the AVG division).
    for rank, (native, ring, xs) in enumerate(run(world, reduce_scatter_both, seed, block, dtype, op, pipeline)):
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


def all_gather_both(seed, shape, dtype, pipeline):
    x = draw_tensor(seed, shape, dtype, "sum")
    n = dist.get_world_size()
    native = torch.empty(n * x.numel(), dtype=dtype, device=device())
    dist.all_gather_single(native, x.reshape(-1))  # gloo wants matching chunk shapes; 0-d becomes (1,)
    with pipelined(*pipeline):
        ring = rp.ring_all_gather(torch.empty_like(native), x)
    return native.cpu(), ring.cpu()


@given(world=st.integers(1, 5), shape=shapes, dtype=st.sampled_from(FLOATS + INTS),
       seed=st.integers(0, 10**6), pipeline=pipelines)
def test_ring_all_gather_is_bit_identical_to_native(world, shape, dtype, seed, pipeline):
    for native, ring in run(world, all_gather_both, seed, shape, dtype, pipeline):
        assert torch.equal(native, ring)


# ----- the textbook ring, the learner's exercise: what the steps must leave, within the bound of the arithmetic
# (tests/ring_exercise.py), judged for any order of the sums; mini_dist's own, gloo's order bit for bit, is a
# claim of its own (grading.optional): exact in this suite, a note when a learner's ring is graded

GLOO_ORDER = ("gloo sums chunk c as x[c-1] + x[c-2] + ... + x[c] (its ring sends to the left, rank c finishing "
              "chunk c): send to the left to match it")


def first_difference(rank, native, ours) -> str:
    """Where ours differs from torch.distributed's result, in one line (rank, element, both values)."""
    if ours.shape != native.shape or ours.dtype != native.dtype:
        return f"rank {rank}: got {tuple(ours.shape)} {ours.dtype}, dist: {tuple(native.shape)} {native.dtype}"
    i = (ours.reshape(-1) != native.reshape(-1)).nonzero()[0].item()
    return f"rank {rank} element {i}: got {ours.reshape(-1)[i].item()}, dist gives {native.reshape(-1)[i].item()}"


def textbook_both(seed, shape, dtype, op, which):
    """dist's collective and the textbook ring's on this rank's drawn tensor: (native, ours, input rows)."""
    n, r = dist.get_world_size(), dist.get_rank()
    x = draw_tensor(seed, shape, dtype, op)
    if which == "all_reduce":
        native, ours = x.clone(), x.clone()
        dist.all_reduce(native, op=OPS[op])
        assert ra.ring_all_reduce(ours, OPS[op]) is ours
    elif which == "reduce_scatter":  # x is [n * block]: reduce, keep block r
        native = torch.empty(x.numel() // n, dtype=dtype, device=device())
        dist.reduce_scatter_single(native, x, op=OPS[op])
        chunks = list(x.clone().chunk(n)) if native.numel() else [native.clone()] * n
        ra.textbook_reduce_scatter_steps(chunks, OPS[op])
        ours = chunks[r] / n if op == "avg" else chunks[r]
    else:
        native, out = (torch.empty(n * x.numel(), dtype=dtype, device=device()) for _ in "ab")
        dist.all_gather_single(native, x.reshape(-1))
        chunks = list(out.chunk(n)) if x.numel() else [out] * n
        chunks[r].copy_(x.reshape(-1))
        ra.textbook_all_gather_steps(chunks)
        ours = out
    everyone = torch.empty(n * x.numel(), dtype=dtype, device=device())
    dist.all_gather_single(everyone, x.reshape(-1))
    return native.cpu(), ours.cpu(), everyone.view(n, -1).cpu()


def judged(results, which, op, dtype, blocks) -> str | None:
    """The first way the results leave the contract, with the mistake behind it where the probe recognises one.
    blocks(rank, xs): the inputs (rows: ranks) that rank's result reduces."""
    world = len(results)
    for rank, (native, ours, xs) in enumerate(results):
        mine = blocks(rank, xs)
        want = ring_exercise.exact(mine, op)
        wrong = ring_exercise.outside(rank, ours, want, native, mine, op, dtype)
        if wrong:
            found = ring_exercise.ring_mistake(world, which) or ring_exercise.op_mistake(ours, want, mine, op, dtype)
            return wrong + (f"\n{found}" if found else "")
    return ring_exercise.disagreement([ours for _, ours, _ in results]) if which == "all_reduce" else None


@pytest.mark.exercise(judges=("textbook_reduce_scatter_steps", "textbook_all_gather_steps"))
@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=10)
@given(world=st.integers(1, 5), shape=shapes, data=st.data(), seed=st.integers(0, 10**6))
def test_textbook_ring_all_reduce_leaves_every_rank_the_reduction_of_every_ranks_tensor(op, world, shape, data, seed):
    """ring_all_reduce (the textbook ring): every rank holds the same result, op over all ranks (floats: within
    N-1 roundings)

    Exact for integers, max and min; a float sum within gamma_(N-1) * sum|x_i| of the exact one, whatever order
    the ring adds in (tests/ring_exercise.py); every rank the same bits."""
    dtype = data.draw(dtypes_for(op))
    results = ring_exercise.ran("all_reduce", world, textbook_both, seed, shape, dtype, op, "all_reduce")
    wrong = judged(results, "all_reduce", op, dtype, lambda rank, xs: xs)
    assert wrong is None, wrong
    for rank, (native, ours, _) in enumerate(results):  # gloo's chunks, sent to the left: gloo's sums exactly
        same = torch.equal(native, ours)
        optional(same, "bit-identical to gloo", "" if same else first_difference(rank, native, ours), GLOO_ORDER)


def gloo_reduce_scatter_difference(rank, native, ours, xs, block, op, dtype) -> str | None:
    """gloo reduce-scatters by all-reducing and keeping block r: exact where its all-reduce layout puts block r in
    chunk r; elsewhere its order of the N terms differs from the ring's, each within (N-1)u * sum|x| of the
    exact sum, so the two within 2(N-1)u * sum|x| (+ one rounding of AVG's division)."""
    world = len(xs)
    same_layout = ra.chunk_bounds(world * block, world, xs.element_size())[rank] == (rank * block, (rank + 1) * block)
    if same_layout or not dtype.is_floating_point or op in ("max", "min") or world <= 2:
        return None if torch.equal(native, ours) else first_difference(rank, native, ours)
    u = torch.finfo(dtype).eps / 2
    mine = xs[:, rank * block:(rank + 1) * block].double()
    scale = (mine.abs().prod(0) if op == "product" else mine.abs().sum(0)) / (world if op == "avg" else 1)
    off = (native.double() - ours.double()).abs() > (2 * (world - 1) + 2) * u * scale
    return first_difference(rank, native, ours) + " beyond the summation-order bound" if off.any() else None


@pytest.mark.exercise(judges=("textbook_reduce_scatter_steps",))
@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=10)
@given(world=st.integers(1, 5), block=st.integers(0, 300), data=st.data(), seed=st.integers(0, 10**6))
def test_textbook_reduce_scatter_steps_leave_rank_r_block_r_of_the_reduction(op, world, block, data, seed):
    """textbook_reduce_scatter_steps: chunks[r] on rank r is block r, op over all ranks (floats: within N-1 roundings)

    Exact for integers, max and min; a float sum within gamma_(N-1) * sum|x_i| of the exact one, whatever order
    the ring adds in (tests/ring_exercise.py)."""
    dtype = data.draw(dtypes_for(op))
    results = ring_exercise.ran("reduce_scatter", world, textbook_both, seed, (world * block,), dtype, op,
                                "reduce_scatter")
    wrong = judged(results, "reduce_scatter", op, dtype, lambda rank, xs: xs[:, rank * block:(rank + 1) * block])
    assert wrong is None, wrong
    for rank, (native, ours, xs) in enumerate(results):
        differs = gloo_reduce_scatter_difference(rank, native, ours, xs, block, op, dtype)
        optional(differs is None, "gloo's sums where its chunks are these blocks", differs or "", GLOO_ORDER)


@pytest.mark.exercise(judges=("textbook_all_gather_steps",))
@given(world=st.integers(1, 5), shape=shapes, dtype=st.sampled_from(FLOATS + INTS), seed=st.integers(0, 10**6))
def test_textbook_all_gather_steps_give_every_rank_every_block_in_rank_order(world, shape, dtype, seed):
    """textbook_all_gather_steps: every rank holds every rank's block, in rank order, copied exactly"""
    results = ring_exercise.ran("all_gather", world, textbook_both, seed, shape, dtype, "sum", "all_gather")
    for rank, (native, ours, _) in enumerate(results):
        found = None if torch.equal(native, ours) else ring_exercise.ring_mistake(world, "all_gather")
        assert torch.equal(native, ours), first_difference(rank, native, ours) + (f"\n{found}" if found else "")


def ledger_of(numel, dtype, which):
    ra.LEDGER.reset()
    fn = {"ring": rp.ring_all_reduce, "textbook": ra.ring_all_reduce, "naive": ra.naive_all_reduce}[which]
    fn(torch.ones(numel, dtype=dtype, device=device()))
    return ra.LEDGER.sent, ra.LEDGER.received


@given(world=st.integers(1, 5), numel=st.integers(0, 5000), dtype=st.sampled_from(
    [torch.float32, torch.float16, torch.float64]))
def test_ring_sends_2_n_minus_1_over_n_times_d_and_naive_root_sends_n_minus_1_times_d(world, numel, dtype):
    D = numel * dtype.itemsize
    ring = run(world, ledger_of, numel, dtype, "ring")
    assert run(world, ledger_of, numel, dtype, "textbook") == ring  # the same steps, the same bytes
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


def batches(world_numel, as_nccl):
    """One ring all-reduce (as_nccl: taking NCCL's paths, as launch.PRETEND_NCCL makes it; there is no device
    here): every batch_isend_irecv it posted, as [(send?, group peer, numel)], the result, gloo's. Without
    debug mode's size exchange before each step (tests/test_exercise.py pins that one)."""
    seen, saved = [], (dist.batch_isend_irecv, launch.PRETEND_NCCL, debug.DEBUG)
    dist.batch_isend_irecv = lambda ops: seen.append([(op.op is dist.isend, op.group_peer, op.tensor.numel())
                                                      for op in ops]) or saved[0](ops)
    launch.PRETEND_NCCL, debug.DEBUG = as_nccl, False
    x = torch.randn(world_numel, generator=rank_generator(1)).to(device())
    try:
        rp.ring_all_reduce(y := x.clone())
    finally:
        dist.batch_isend_irecv, launch.PRETEND_NCCL, debug.DEBUG = saved
    native = x.clone()
    dist.all_reduce(native)
    return seen, y, native


@pytest.mark.parametrize("world", [2, 3, 4])
def test_under_nccl_every_step_is_one_batch_of_a_send_left_and_a_receive_from_the_right(world):
    # NCCL runs a rank's unbatched sends and receives in order on one stream: a ring whose ranks all send
    # first waits forever. Under NCCL each of the 2(N-1) steps is one batch_isend_irecv, and gloo's sums stay
    for rank, (seen, y, native) in enumerate(run(world, batches, 1000, True)):
        assert torch.equal(y, native) and len(seen) == 2 * (world - 1)
        assert all([(s, p) for s, p, _ in ops] == [(True, (rank - 1) % world), (False, (rank + 1) % world)]
                   for ops in seen)
    assert all(seen == [] for seen, _, _ in run(world, batches, 1000, False))  # gloo: the pipelined stream


def naive_equals_native(seed, world_shape):
    x = draw_tensor(seed, world_shape, torch.int64, "sum")
    native = x.clone()
    dist.all_reduce(native)
    return torch.equal(native, ra.naive_all_reduce(x.clone()))


@pytest.mark.parametrize("world", [1, 2, 5])
def test_naive_all_reduce_equals_native_on_integers(world):
    assert all(run(world, naive_equals_native, 3, (7, 3)))


def reduce_mismatched(kind, module):
    r = dist.get_rank()
    ring = {"pipelined": rp, "textbook": ra}[module]
    if kind == "shape":
        x = torch.zeros(3 + (r == 1), device=device())
    elif kind == "dtype":
        x = torch.zeros(3, dtype=torch.float64 if r == 1 else torch.float32, device=device())
    elif kind == "device":
        x = torch.zeros(3, device="meta" if r == 1 else device())
    elif kind == "op":
        return ring.ring_all_reduce(torch.zeros(3, device=device()), op=dist.ReduceOp.BAND if r == 2 else ra.SUM)
    elif kind == "dtype_unsupported":
        return ring.ring_all_reduce(torch.zeros(3, dtype=torch.complex64 if r == 0 else torch.float32, device=device()))
    elif kind == "gather":
        return ring.ring_all_gather(torch.empty(3 * (2 + (r == 2)), device=device()),
                                  torch.zeros(2 + (r == 2), device=device()))
    elif kind == "avg_int":
        return ring.ring_all_reduce(torch.zeros(3, dtype=torch.int32, device=device()), op=ra.AVG)
    elif kind == "complex_everywhere":
        return ring.ring_all_reduce(torch.zeros(3, dtype=torch.complex64, device=device()))
    else:
        return ring.ring_reduce_scatter(torch.empty(2, device=device()), torch.zeros(5, device=device()))
    return ring.ring_all_reduce(x)


@pytest.mark.parametrize("kind, message", [
    ("shape", r"rank 0 calls ring_all_reduce shape \(3,\).*rank 1 calls ring_all_reduce shape \(4,\)"),
    ("dtype", r"rank 1 calls ring_all_reduce shape \(3,\) dtype torch.float64"),
    ("device", r"rank 1 calls ring_all_reduce shape \(3,\) dtype torch.float32 op SUM on meta"),
    ("op", r"rank 2 calls ring_all_reduce shape \(3,\) dtype torch.float32 op RedOpType.BAND"),
    ("dtype_unsupported", r"rank 0 calls ring_all_reduce shape \(3,\) dtype torch.complex64"),
    ("gather", r"rank 2 calls ring_all_gather shape \(3,\)"),
    ("avg_int", r"AVG of torch.int32 tensors would round"),
    ("complex_everywhere", r"unsupported dtype torch.complex64"),
    ("sizes", r"input has 5 elements, expected group size 3 x output's 2"),
])
@pytest.mark.parametrize("module", ["pipelined", "textbook"])
def test_bad_input_fails_on_every_rank_with_a_clear_error_and_no_hang(kind, message, module):
    # the pools run with MINI_DIST_DEBUG=1: ranks that disagree are caught before any ring step and named
    with pytest.raises(RankFailure, match=message) as info:
        run(3, reduce_mismatched, kind, module, timeout=30)
    # every rank raised the same error (none blocked waiting for another): three failures, no silence
    failures = re.findall(r"rank \d failed: (\w+): ", str(info.value))
    assert len(failures) == 3 and len(set(failures)) == 1, str(info.value)


def collectives_issued(on):
    """Collectives (not sends and receives) one ring all-reduce issues, with the debug mode on or off."""
    issued = []
    saved = debug.DEBUG, {name: getattr(dist, name) for name in COLLECTIVES}
    debug.DEBUG = on
    for name, fn in saved[1].items():
        setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: issued.append(_name) or _fn(*a, **k))
    try:
        rp.ring_all_reduce(torch.ones(10, device=device()))
    finally:
        debug.DEBUG = saved[0]
        for name, fn in saved[1].items():
            setattr(dist, name, fn)
    return issued


COLLECTIVES = ["all_gather_object", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce",
               "broadcast", "broadcast_object_list", "barrier"]


def test_the_agreement_check_costs_a_collective_only_in_debug_mode():
    # off (the library's default) a ring all-reduce is its 2(N-1) steps of sends and receives, nothing else
    assert run(3, collectives_issued, False) == [[], [], []]
    assert run(3, collectives_issued, True) == [["all_gather_object"]] * 3


def die_during_all_reduce(dead):
    if dist.get_rank() == dead:  # agrees on the call, sends its first piece of the ring, then vanishes
        isend = dist.isend

        def send_then_vanish(*args, **kwargs):
            isend(*args, **kwargs).wait()
            os._exit(0)
        dist.isend = send_then_vanish
    with pipelined(2048, 2):  # 4000 B: two pieces at N = 2, so the peer still waits for the second one
        rp.ring_all_reduce(torch.ones(1000, device=device()))


@pytest.mark.parametrize("world, dead", [(3, 2), (4, 1), (2, 0)])
def test_a_rank_that_vanishes_mid_ring_is_named_by_its_neighbour_fast_and_the_pool_recovers(world, dead):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(world, die_during_all_reduce, dead, timeout=60)
    assert time.monotonic() - start < 15  # the ranks' own timeout is 30 s: the error came from the lost link
    # the rank that receives from it (its left neighbour) is the first to know; a rank it was not talking to
    # is left waiting (under torchrun it fails next, when the ranks that raised exit and close their links)
    # (at N = 2 the peer is both neighbours: its piece may arrive before our send to it is found dead)
    doing = "(receiving from|sending to)" if world == 2 else "receiving from"
    assert re.search(rf"rank {(dead - 1) % world} failed: PeerLost: ring_all_reduce, {doing} it: lost rank "
                     rf"{dead} .*look for the first error in rank {dead}'s log", str(info.value))
    assert all(torch.equal(*pair) for pair in run(world, all_reduce_both, 0, (5,), torch.float32, "sum", None, (64, 2)))
