"""Topology-aware all-reduces against dist.all_reduce; their byte ledgers against their schedules; every
exchange one batch (NCCL-safe); the simulated slow link; bad input on every rank."""
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist import alpha_beta as ab
from mini_dist import ring_allreduce as ra
from mini_dist import topology as topo
from mini_dist.kit import debug, launch, wire

OPS = {"sum": ra.SUM, "avg": ra.AVG, "max": ra.MAX, "min": ra.MIN, "product": ra.PRODUCT}
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int8]


def draw(seed, shape, dtype, op):
    g = rank_generator(seed)
    if dtype.is_floating_point:  # products of values near 1 stay finite; sums see mixed magnitudes
        x = (1 + 0.1 * torch.randn(shape, generator=g) if op == "product" else  # cpu: moved below
             torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g)))  # cpu: moved below
    else:
        x = torch.randint(-50, 50, shape, generator=g)  # cpu: drawn on the CPU (the same on any device), moved below
    return x.to(dtype).to(device())


def every_algorithm(seed, shape, dtype, op, ranks_per_node, ranks=None):
    group = subgroup(ranks) if ranks is not None else None
    topo.node_groups(ranks_per_node, ranks)  # every rank of the world, as dist.new_group
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    x = draw(seed, shape, dtype, op)
    native = x.clone()
    dist.all_reduce(native, op=OPS[op], group=group)
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, x, group=group)
    ours = {}
    for name, fn in {"hierarchical": lambda t: topo.hierarchical_all_reduce(t, ranks_per_node, OPS[op], group),
                     "recursive doubling": lambda t: topo.recursive_doubling_all_reduce(t, OPS[op], group),
                     "halving-doubling": lambda t: topo.halving_doubling_all_reduce(t, OPS[op], group)}.items():
        t = x.clone()
        assert fn(t) is t  # in place, like dist.all_reduce
        ours[name] = t.cpu()
    return native.cpu(), ours, torch.stack(everyone).double().cpu()


def assert_equal_or_within_order_bound(results, dtype, op, world):
    for native, ours, xs in results:
        for name, got in ours.items():
            assert got.dtype == dtype and got.shape == native.shape
            # Integers (wrap-around included), MAX and MIN do not depend on the order; two addends have
            # one order: bit for bit. Otherwise each side sums N terms with N-1 roundings, in some tree:
            # |fl(sum) - sum| <= gamma_(N-1) sum|x|, gamma_k = ku/(1-ku) (Higham, Thm 4.8), so the two
            # differ by 2 gamma_(N-1) sum|x| at most; a product by 2 gamma_(N-1) prod|x|; AVG adds one
            # rounding of the division on each side: + 2u (1 + gamma) sum|x| / N.
            if not dtype.is_floating_point or op in ("max", "min") or world <= 2:
                assert torch.equal(got, native), (name, (got.double() - native.double()).abs().max())
                continue
            u = torch.finfo(dtype).eps / 2
            gamma = (world - 1) * u / (1 - (world - 1) * u)
            scale = xs.abs().prod(0) if op == "product" else xs.abs().sum(0)
            bound = 2 * gamma * scale + (2 * u * (1 + gamma) * scale if op == "avg" else 0)
            bound = bound / world if op == "avg" else bound
            assert ((got.double() - native.double()).abs() <= bound).all(), name


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple) | st.sampled_from([(1000, 3), (4097,)])


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=10)
@given(world=st.integers(1, 5), shape=shapes, data=st.data(), seed=st.integers(0, 10 ** 6))
def test_every_all_reduce_equals_native_for_any_shape_dtype_world_and_ranks_per_node(op, world, shape, data, seed):
    dtype = data.draw(st.sampled_from(FLOATS if op == "avg" else FLOATS + INTS))
    G = data.draw(st.sampled_from([g for g in range(1, world + 1) if world % g == 0]))
    results = run(world, every_algorithm, seed, shape, dtype, op, G)
    assert_equal_or_within_order_bound(results, dtype, op, world)
    for name in results[0][1]:  # every rank holds the same result, as after dist.all_reduce
        assert all(torch.equal(r[1][name], results[0][1][name]) for r in results)


@settings(max_examples=8)
@given(world=st.integers(3, 5), data=st.data(), seed=st.integers(0, 10 ** 6))
def test_every_all_reduce_on_a_subgroup_equals_native_on_that_subgroup(world, data, seed):
    ranks = sorted(data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)))
    G = data.draw(st.sampled_from([g for g in range(1, len(ranks) + 1) if len(ranks) % g == 0]))
    results = run(world, every_algorithm, seed, (37, 5), torch.float64, "sum", G, ranks)
    assert [r is None for r in results] == [rank not in ranks for rank in range(world)]
    assert_equal_or_within_order_bound([r for r in results if r is not None], torch.float64, "sum", len(ranks))


def strided_inputs(G):
    x = torch.arange(60, dtype=torch.float64, device=device()).view(6, 10) * (dist.get_rank() + 1)
    out = []
    for view in (lambda t: t.t(), lambda t: t[:, ::3], lambda t: t.reshape(-1)[::7]):
        for fn in topo.ALGORITHMS.values():
            base = x.clone()
            fn(view(base), G, None)  # reduces the view in place; the rest of base stays as it was
            out.append(base.cpu())
    return out


def test_non_contiguous_tensors_are_reduced_in_place_and_nothing_else_changes():
    for world, G in [(3, 3), (4, 2)]:
        for rank, results in enumerate(run(world, strided_inputs, G)):
            x = torch.arange(60, dtype=torch.float64).view(6, 10)  # cpu: expected values, the results come back .cpu()
            total = world * (world + 1) / 2
            for i, view in enumerate((lambda t: t.t(), lambda t: t[:, ::3], lambda t: t.reshape(-1)[::7])):
                want = x * (rank + 1)
                view(want).mul_(total / (rank + 1))  # integer-valued: every order of the sum is exact
                for got in results[4 * i:4 * i + 4]:
                    assert torch.equal(got, want)


def ledger(algorithm, numel, G):
    with ab.Links(G) as links:
        topo.ALGORITHMS[algorithm](torch.ones(numel, device=device()), G, None)
    return links.sent


@settings(max_examples=12)
@given(world=st.integers(1, 5), data=st.data(), k=st.integers(1, 40))
def test_bytes_per_link_kind_equal_the_schedule_exactly(world, data, k):
    G = data.draw(st.sampled_from([g for g in range(1, world + 1) if world % g == 0]))
    algorithm = data.draw(st.sampled_from(list(topo.ALGORITHMS)))
    numel = k * 2 * world * (1 << (world.bit_length() - 1))  # equal ring chunks and halving blocks
    sent = run(world, ledger, algorithm, numel, G)
    want = ab.link_bytes(ab.schedule(algorithm, world, G), 4 * numel, G)
    assert {kind: sum(s[kind] for s in sent) for kind in ("intra", "inter")} == want


def batches(algorithm, numel, G):
    """Every batch_isend_irecv one all-reduce posts, as [(send?, group peer, bytes)], and the bytes the ledger
    counted as sent: the two agree when every send went in a batch. Without debug mode's size exchange."""
    seen, real, saved = [], dist.batch_isend_irecv, debug.DEBUG
    dist.batch_isend_irecv = lambda ops: seen.append([(op.op is dist.isend, op.group_peer, op.tensor.nbytes)
                                                      for op in ops]) or real(ops)
    wire.LEDGER.reset()
    debug.DEBUG = False
    try:
        topo.ALGORITHMS[algorithm](torch.ones(numel, device=device()), G, None)
    finally:
        dist.batch_isend_irecv, debug.DEBUG = real, saved
    return seen, wire.LEDGER.sent


@pytest.mark.parametrize("algorithm", ["recursive doubling", "halving-doubling"])
@pytest.mark.parametrize("world", [3, 4, 5])
def test_every_exchange_of_the_doubling_algorithms_is_one_batch_with_one_partner(algorithm, world):
    # NCCL runs a rank's unbatched sends and receives in order on one stream: a pair that both posted a
    # receive (or a send) first would wait forever. Here each exchange is one batch_isend_irecv, with one peer
    for seen, sent in run(world, batches, algorithm, 48, world):
        assert sum(b for ops in seen for is_send, _, b in ops if is_send) == sent > 0  # every byte in a batch
        assert all(len({peer for _, peer, _ in ops}) == 1 and len(ops) <= 2 for ops in seen)
        assert all(sorted(is_send for is_send, _, _ in ops) in ([False, True], [True], [False]) for ops in seen)


def slow_exchange(G, delay_s):
    me = dist.get_rank()
    buf = torch.zeros(1000, device=device())
    with ab.Links(G, delay_s=delay_s) as links:
        start = time.perf_counter()
        wire.send_recv(buf if me == 0 else None, 1, buf if me == 1 else None, 0, None, "test")
        elapsed = time.perf_counter() - start
    return links.sent, elapsed, wire.LEDGER.watchers


@pytest.mark.parametrize("G, kind", [(1, "inter"), (2, "intra")])
def test_the_simulated_link_delays_only_sends_between_nodes_and_counts_their_bytes(G, kind):
    results = run(2, slow_exchange, G, 0.2)
    assert results[0][0] == {"intra": 0, "inter": 0, kind: 4000} and results[1][0] == {"intra": 0, "inter": 0}
    if kind == "inter":
        assert results[0][1] >= 0.2  # the sender waited before the message left
    assert [watchers for _, _, watchers in results] == [[], []]  # the wire's watcher removed again


def refuse(what):
    x = torch.zeros(6, device=device())
    if what == "ranks_per_node":
        return topo.hierarchical_all_reduce(x, 2)
    if what == "avg_int":
        return topo.recursive_doubling_all_reduce(x.long(), ra.AVG)
    return topo.halving_doubling_all_reduce(x, dist.ReduceOp.BAND)


@pytest.mark.parametrize("what, message", [
    ("ranks_per_node", "ranks_per_node=2 does not divide the 3 ranks into equal nodes; use one of [1, 3]"),
    ("avg_int", "AVG of torch.int64 tensors would round; use SUM and divide"),
    ("op", "unsupported op RedOpType.BAND; use SUM, AVG, MAX, MIN or PRODUCT")])
def test_bad_input_is_a_clear_error_on_every_rank_before_any_message(what, message):
    with pytest.raises(RankFailure) as info:
        run(3, refuse, what)
    assert str(info.value).count(message) >= 3  # each rank's line names it (tracebacks may repeat it)


def mismatched_ranks_per_node():
    return topo.hierarchical_all_reduce(torch.zeros(4, device=device()), 1 + (dist.get_rank() == 1))


def test_ranks_that_disagree_on_ranks_per_node_are_named():
    with pytest.raises(RankFailure, match=r"rank 0 calls hierarchical_all_reduce shape \(4,\) dtype torch.float32 "
                                          r"op SUM on \w+ ranks_per_node 1.*rank 1 calls .* ranks_per_node 2"):
        run(2, mismatched_ranks_per_node)


def test_the_demo_refuses_ranks_per_node_that_do_not_divide_the_world_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert launch.main(topo.parser(), topo.demo, ["--ranks-per-node", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(": error: --ranks-per-node 3 does not divide 4 ranks into equal "
                                             "nodes; use one of [1, 2, 4]")
