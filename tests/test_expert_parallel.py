"""Expert parallelism equals the same mixture-of-experts layer run in one process.

The one-process `MoE` is checked against the formulas token by token in tests/test_moe.py. Here
`ExpertParallelMoE` runs on expert groups of 1-5 ranks (the whole pool, or consecutive or strided subgroups of
it, as an expert axis carved out of a mesh would be), with uneven token counts (zero included), drops and no
drops, k in {1, 2}, both transports, against the one-process layer called once per rank (each rank is one
routing group): outputs, aux loss, drop counts, input, router and expert gradients, and the byte ledger. The
point-to-point all-to-all must equal dist.all_to_all_single bit for bit. First, dispatch and combine (the
exercise's functions) are each judged on their own against their docstrings' contract (tests/ep_exercise.py).

Tolerance. Every expert sees the same rows on both sides, so outputs are computed by the same operations on
the same numbers; gradients of shared weights are sums over rows (and over ranks, through the router's
all-reduce) taken in another order. Reordering a K-term sum changes it by at most K*eps*sum|terms|; here K is
at most ~100 rows and the terms are O(1), so differences stay far below 1e-13 of the largest value. We allow
TOL = 1000 * eps(fp64) = 2.2e-13 relative to max(1, largest value); a wrong expert, a missing or doubled
gradient, a token dropped on one side only is an O(1) error.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

import ep_exercise
from ep_exercise import MISTAKES  # noqa: F401  (the exercise's, declared beside its judge)
from harness import RankFailure, device, run, subgroup
from mini_dist import comm, nccl_order
from mini_dist import expert_parallel as ep
from mini_dist.moe import MoE

F64 = torch.float64
TOL = 1000 * torch.finfo(F64).eps
CAPACITY_FACTORS = [None, 0.25, 0.5, 1.0, 1.25, 4.0]
TRANSPORTS = {"p2p": ep.p2p_all_to_all, "native": comm.all_to_all_single}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1)).item() if b.numel() else 0.0


# ----- dispatch and combine, the learner's exercise (./run.sh check expert_parallel), each judged on its own
# against its contract: exactly for dispatch (it only moves rows), within a sum's rounding for combine; the
# classic mistakes named (tests/ep_exercise.py)

@st.composite
def specs(draw):
    """A group of 1-5 ranks, 1-3 experts a rank, 1-3 choices a token, 0-8 tokens a rank, drops or none."""
    W = draw(st.integers(1, 5))
    E = W * draw(st.integers(1, 3))
    return ep_exercise.Spec(W, E, draw(st.integers(1, min(3, E))), draw(st.integers(1, 4)),
                            tuple(draw(st.lists(st.integers(0, 8), min_size=W, max_size=W))),
                            draw(st.sampled_from([1.0, 0.7, 0.3])), draw(st.booleans()), draw(st.integers(0, 1000)))


SMALL = [  # run first, in this order: the smallest cases that tell the classic mistakes apart
    ep_exercise.Spec(1, 3, 1, 2, (4,), 1.0, True, 0),            # one rank; no row for its last experts
    ep_exercise.Spec(2, 4, 2, 3, (5, 2), 1.0, False, 1),         # two experts a rank; uneven tokens
    ep_exercise.Spec(3, 6, 2, 2, (0, 6, 3), 0.6, False, 2),      # a rank with no tokens; dropped choices
    ep_exercise.Spec(3, 6, 2, 2, (4, 3, 5), 1.0, True, 3),       # every row to rank 0: ranks 1, 2 receive nothing
]


def with_small_cases(test):
    for spec in reversed(SMALL):
        test = example(spec=spec, transport="p2p")(test)
    return test


@pytest.mark.exercise(judges=("dispatch",))
@with_small_cases
@given(spec=specs(), transport=st.sampled_from(sorted(ep_exercise.TRANSPORTS)))
def test_dispatch_puts_each_kept_row_on_its_experts_rank_in_plan_order(spec, transport):
    """dispatch: every kept (token, choice) row on its expert's rank, by source rank then local expert; got, plan

    Exactly (it only moves rows): plan.token / plan.choice every kept pair once, by expert; plan.sent and
    plan.received the rows to and from each rank; got[q, i] the rows from rank q for local expert i; rows what
    came, rank 0's first, each rank's in its plan's order."""
    said = ep_exercise.dispatch_problem(spec, run(spec.W, ep_exercise.dispatch_worker, spec, transport))
    assert said is None, said


@pytest.mark.exercise(judges=("combine",))
@with_small_cases
@given(spec=specs(), transport=st.sampled_from(sorted(ep_exercise.TRANSPORTS)))
def test_combine_brings_rows_home_and_sums_them_by_weight(spec, transport):
    """combine: y_t = sum of weight[t, j] * output of row (t, j) over t's kept choices; gradients of out, weight

    Given the contract's plan and each row's output on the rank it went to: y within 2 gamma_(k+1) *
    sum|terms| of the exact sum (0 for a token with none kept), weight.grad and out.grad within theirs."""
    said = ep_exercise.combine_problem(spec, run(spec.W, ep_exercise.combine_worker, spec, transport))
    assert said is None, said


# ----- the expert-parallel layer against the one-process layer, on ranks -----

def expert_members(pool, W, strided):
    """Expert groups of W ranks cut from a pool: consecutive, or strided (ranks i, i + n, ...) as an expert
    axis made of a mesh's data-parallel ranks would be. Ranks left over belong to none."""
    n = pool // W
    return [list(range(i, n * W, n)) if strided else list(range(i * W, (i + 1) * W)) for i in range(n)]


def expert_group(W, strided):
    """(group, index) of this rank, (None, None) if it is left over; the whole pool is the default group."""
    if W == dist.get_world_size():
        return None, 0
    members = expert_members(dist.get_world_size(), W, strided)
    groups = [subgroup(m) for m in members]  # every rank creates every group (new_group is collective)
    for index, m in enumerate(members):
        if dist.get_rank() in m:
            return groups[index], index
    return None, None


def tokens(seed, index, q, n, h, skew):
    """Rank q's tokens in group `index`, rebuilt identically on every rank of the group."""
    x = torch.randn(n, h, dtype=F64, generator=torch.Generator().manual_seed(seed * 1009 + index * 101 + q))  # cpu: .to
    return (x.abs() + 0.1 if skew else x).to(device())


def equivalence_worker(seed, W, strided, E, k, cf, h, ffn, counts, transport, skew):
    group, index = expert_group(W, strided)
    if index is None:
        return None
    me = dist.get_rank(group)
    torch.manual_seed(seed * 1009 + index)  # one dense layer per group
    dense = MoE(h, ffn, E, k, cf, device=device(), dtype=F64)
    if skew:  # positive tokens, router rows 10, 9, .. on the first k experts: every token goes there
        with torch.no_grad():
            dense.router.weight.fill_(-10)[:k] = torch.arange(10, 10 - k, -1, dtype=F64, device=device())[:, None]
    xs = [tokens(seed, index, q, n, h, skew) for q, n in enumerate(counts)]
    dys = [tokens(seed + 7, index, q, n, h, False) for q, n in enumerate(counts)]
    moe = ep.shard_from_dense(ep.ExpertParallelMoE(h, ffn, E, k, cf, group, TRANSPORTS[transport], device(), F64),
                              dense, group)
    x = xs[me].clone().requires_grad_()
    comm.COUNTER.reset()
    y = moe(x)
    ((y * dys[me]).sum() + moe.aux_loss).backward()
    nbytes = comm.COUNTER.bytes["all_to_all"]
    ep.allreduce_router_grads(moe, group)
    ref = copy.deepcopy(dense)
    for q, (xq, dy) in enumerate(zip(xs, dys)):  # one process, one call per rank's tokens
        xq = xq.clone().requires_grad_()
        yq = ref(xq)
        ((yq * dy).sum() + ref.aux_loss).backward()
        if q == me:
            errors = {"output y": rel_err(y, yq), "input gradient": rel_err(x.grad, xq.grad),
                      "aux loss": rel_err(moe.aux_loss, ref.aux_loss)}
            dropped = (moe.dropped, ref.dropped)
    blank = copy.deepcopy(dense)
    for p in blank.parameters():
        p.data.zero_()
    gathered = ep.gather_to_dense(moe, blank, group)
    for (name, p), q in zip(gathered.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        errors |= {name: rel_err(p, q), f"{name}.grad": rel_err(p.grad, q.grad)}
    worst = next((name for name, e in errors.items() if e > TOL), max(errors, key=errors.get))  # the first off
    return dict(error=errors[worst], worst=worst, rank=dist.get_rank(), dropped=dropped, sent=moe.sent,
                received=moe.received, bytes=nbytes)


def assert_equal_to_one_process(r):
    assert r["error"] <= TOL, (f"rank {r['rank']}: {r['worst']} differs from the one-process MoE by "
                               f"{r['error']:.1e} (relative) > {TOL:.1e}")
    assert r["dropped"][0] == r["dropped"][1], \
        f"rank {r['rank']}: dropped {r['dropped'][0]} choices, the one-process MoE {r['dropped'][1]}"


@pytest.mark.exercise(judges=("dispatch", "combine"))
@given(data=st.data(), W=st.integers(1, 5), k=st.integers(1, 2), cf=st.sampled_from(CAPACITY_FACTORS),
       h=st.integers(1, 5), ffn=st.integers(1, 5), transport=st.sampled_from(sorted(TRANSPORTS)),
       skew=st.booleans(), seed=st.integers(0, 1000))
def test_expert_parallel_equals_one_process_moe_outputs_aux_drops_and_gradients(data, W, k, cf, h, ffn,
                                                                                transport, skew, seed):
    """Expert-parallel MoE equals the one-process MoE: outputs, aux loss, drops, every gradient, bytes sent."""
    pool = data.draw(st.integers(W, 5), "pool")
    strided = data.draw(st.booleans(), "strided") if pool // W > 1 else False
    E = W * data.draw(st.integers(1, 3), "experts per rank")
    k = min(k, E)
    counts = data.draw(st.lists(st.integers(0, 10), min_size=W, max_size=W), "tokens per rank")
    results = run(pool, equivalence_worker, seed, W, strided, E, k, cf, h, ffn, counts, transport, skew)
    for r in results:
        if r is None:
            continue
        assert_equal_to_one_process(r)
        assert cf is not None or r["dropped"][0] == 0, f"rank {r['rank']}: dropped choices with no capacity"
    # the counts exchange: what rank q of a group received from rank j is what j sent q
    members = expert_members(pool, W, strided)
    for ranks in members:
        for q, rq in enumerate(ranks):
            mine = results[rq]
            theirs = [results[rj]["sent"][q] for rj in ranks]
            assert theirs == mine["received"], f"rank {rq} received {mine['received']} rows; sent to it: {theirs}"
            off_rank = sum(mine["sent"]) - mine["sent"][q] + sum(mine["received"]) - mine["received"][q]
            assert mine["bytes"] == 2 * off_rank * h * 8, f"rank {rq} sent {mine['bytes']} B"  # there and back, twice


@pytest.mark.exercise(judges=("dispatch", "combine"))
def test_a_rank_with_no_tokens_and_ranks_that_send_nothing_to_some_rank():
    """A rank with no tokens, and ranks that send some ranks nothing, still equal the one-process MoE.

    Group of 3: rank 0 holds no token; every token goes to the first experts, all on rank 0, so ranks
    1 and 2 send nothing to each other and receive nothing at all. Capacity C = ceil(0.5 * n * 2 / 6) per
    expert: 2 for rank 1's 7 tokens, 1 for rank 2's 4, so experts 0 and 1 keep 2 * C choices of 2n."""
    results = run(3, equivalence_worker, 5, 3, False, 6, 2, 0.5, 4, 3, [0, 7, 4], "p2p", True)
    assert [r["sent"] for r in results] == [[0, 0, 0], [4, 0, 0], [2, 0, 0]]
    assert [r["received"] for r in results] == [[0, 4, 2], [0, 0, 0], [0, 0, 0]]
    assert [r["dropped"][0] for r in results] == [0, 14 - 4, 8 - 2]
    for r in results:
        assert_equal_to_one_process(r)


@pytest.mark.parametrize("pool", [4, 5])
def test_strided_expert_groups_side_by_side_in_a_larger_pool(pool):
    """Groups {0, 2} and {1, 3} (rank 4 idle in a pool of 5): ranks of a group are not neighbours, so the
    point-to-point peers must be the group's global ranks."""
    results = run(pool, equivalence_worker, 3, 2, True, 4, 2, 1.0, 3, 4, [6, 3], "p2p", False)
    for r in results[:4]:
        assert_equal_to_one_process(r)
    assert results[4:] == [None] * (pool - 4)
    assert run(pool, all_to_all_worker, 3, 2, True, "float64", (2,))[:4] == [True] * 4


# ----- the point-to-point all-to-all -----

DTYPES = {"float64": torch.float64, "float32": torch.float32, "int64": torch.int64, "uint8": torch.uint8}


def all_to_all_worker(seed, W, strided, dtype, trailing):
    group, index = expert_group(W, strided)
    if index is None:
        return None
    me, g = dist.get_rank(group), torch.Generator().manual_seed(seed * 31 + index)
    splits = torch.randint(0, 4, (W, W), generator=g)             # cpu: splits[i, j], rows from i to j (the same
    splits[torch.rand(W, W, generator=g) < 0.3] = 0                # cpu: table on every rank, many zeros)
    send, recv = splits[me].tolist(), splits[:, me].tolist()
    x = torch.randint(0, 200, (sum(send), *trailing), generator=torch.Generator().manual_seed(seed + me)).to(device())
    x = x.to(DTYPES[dtype])
    ours = ep.p2p_all_to_all(x.new_empty((sum(recv), *trailing)), x, recv, send, group)
    native = x.new_empty((sum(recv), *trailing))
    dist.all_to_all_single(native, x, recv, send, group=group)
    same = torch.equal(ours, native)
    if dtype == "float64":  # the reverse trip as gradient, with either transport
        grads = []
        for transport in TRANSPORTS.values():
            xg = x.clone().requires_grad_()
            (comm.all_to_all_rows(xg, send, recv, group, transport) * ours).sum().backward()
            grads.append(xg.grad)
        same = same and torch.equal(*grads)
    return same


@given(data=st.data(), W=st.integers(1, 5), dtype=st.sampled_from(sorted(DTYPES)),
       trailing=st.sampled_from([(), (1,), (3,), (2, 3)]), seed=st.integers(0, 1000))
def test_p2p_all_to_all_equals_all_to_all_single_bit_for_bit_with_uneven_splits(data, W, dtype, trailing, seed):
    pool = data.draw(st.integers(W, 5), "pool")
    strided = data.draw(st.booleans(), "strided") if pool // W > 1 else False
    assert all(same is not False for same in run(pool, all_to_all_worker, seed, W, strided, dtype, trailing))


# ----- bad input -----

def build(E, k, cf=None):
    return ep.ExpertParallelMoE(4, 4, E, k, cf)


@pytest.mark.parametrize("world, E, k, needle", [
    (2, 3, 1, "num_experts=3 is not divisible by the parallel size 2"),
    (3, 4, 1, "num_experts=4 is not divisible by the parallel size 3"),
    (5, 12, 2, "num_experts=12 is not divisible by the parallel size 5"),
    (2, 4, 5, "k=5 experts per token must be between 1 and the number of experts E=4"),
    (1, 2, 0, "k=0 experts per token must be between 1"),
])
def test_bad_configuration_raises_the_same_clear_error_on_every_rank(world, E, k, needle):
    with pytest.raises(RankFailure) as failure:
        run(world, build, E, k)
    text = str(failure.value)
    for rank in range(world):
        assert f"rank {rank} failed: ValueError: {needle}" in text


def wrong_hidden_on(bad_rank):
    moe = ep.ExpertParallelMoE(4, 3, dist.get_world_size(), 1, device=device(), dtype=F64)
    return tuple(moe(torch.ones(2, 5 if dist.get_rank() == bad_rank else 4, dtype=F64, device=device())).shape)


def test_a_rank_whose_tokens_have_another_hidden_size_is_named_on_every_rank():
    with pytest.raises(RankFailure) as failure:
        run(3, wrong_hidden_on, 2)
    text = str(failure.value)
    assert all(f"rank {rank} failed: Disagreement" in text for rank in range(3))
    assert "rank 2 calls ExpertParallelMoE.forward (5," in text
    assert run(3, wrong_hidden_on, -1) == [(2, 4)] * 3  # the pool is usable afterwards


def under_nccl_order(W, counts):
    """The point-to-point all-to-all (uneven splits, empty messages) and the layer's forward and backward,
    recorded on gloo and replayed under NCCL's in-order rule (mini_dist/nccl_order.py)."""
    me = dist.get_rank()
    x = torch.arange(float(sum(counts[me])), device=device())[:, None]
    recv = [counts[q][me] for q in range(W)]
    cycles = nccl_order.check(ep.p2p_all_to_all, x.new_empty((sum(recv), 1)), x, recv, counts[me])
    torch.manual_seed(0)
    moe = ep.ExpertParallelMoE(3, 4, 2 * W, 2, 1.0, device=device(), dtype=F64)
    tokens = torch.randn(5 + me, 3, dtype=F64, generator=torch.Generator().manual_seed(me)).to(device())
    return cycles + nccl_order.check(lambda: moe(tokens).sum().backward())


@pytest.mark.parametrize("W", [2, 3, 4])
def test_expert_all_to_all_and_layer_complete_under_nccls_in_order_rule(W):
    counts = [[(3 * i + j) % 4 for j in range(W)] for i in range(W)]  # rows from i to j; zeros included
    assert run(W, under_nccl_order, W, counts) == [[]] * W
