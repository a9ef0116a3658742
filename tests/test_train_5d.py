"""5D parallelism (mini_dist/train_5d.py), measured (mini_dist/measure_5d.py): a tiny GPT trained on every
factorisation dp x pp x cp x tp of 1, 2 and 4 ranks, with or without experts cut over ep ranks of dp x cp, DDP,
ZeRO-1, ZeRO-2 or FSDP on the data x context axis, every pipeline schedule, with or without recomputation,
follows the loss curve of one process training the dense model on the same global batch; each rank moves the
bytes of the formulas on each axis, and the ledger (mini_dist/rank_ledger.py) predicts each rank's bytes and
memory by category exactly.

Tolerance: fp64 (eps 2.2e-16), losses ~3. The runs differ only in the order of their sums (TP partial sums,
the dp x cp average, microbatch sums, ring attention's online softmax, experts' rows, ZeRO's flat Adam): a few
ulps per step, measured <= 1.3e-15 over 127 configurations. A wrong gradient (a divisor, a missing reduction,
a wrong sequence chunk) moves a later loss by 1e-6 or more even under Adam, which all but forgives a gradient
scaled as a whole (experts' gradients not divided by ep: 3.7e-6): 1e-13 sits between. The demos' two 8-rank
configurations run here too: about 7 s on 2 cores, the 8-rank pool's start included."""
import contextlib
import dataclasses
import math
from fractions import Fraction

import pytest
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness import RankFailure, refusal, run
from mini_dist import measure_5d, train_5d
from mini_dist.mesh import Mesh, RankGrid
from mini_dist.tiny_gpt import Config, padded_vocab
from mini_dist.pipeline_messages import HEADER_LEN
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.measure_5d import predictions
from mini_dist.train_5d import configuration_error, train_dense

STEPS = 3
LOSS_TOL = 1e-13
_meshes = {}


def factorisations(world):
    """(dp, pp, cp, tp) with dp * pp * cp * tp = world."""
    return [(d, p, c, world // (d * p * c)) for d in range(1, world + 1) for p in range(1, world + 1)
            for c in range(1, world + 1) if world % (d * p * c) == 0]


def mesh_for(grid: RankGrid) -> Mesh:
    """One Mesh per grid, per pool: every rank creates the same groups in the same order, once."""
    if grid not in _meshes:
        _meshes[grid] = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    return _meshes[grid]


def train_on_ranks(grid, cfg, M, schedule, zero, chunks, math_kernel=False):
    mesh = mesh_for(grid)
    with sdpa_kernel(SDPBackend.MATH) if math_kernel else contextlib.nullcontext():
        r = measure_5d.measured_run(cfg, mesh, STEPS, M, schedule, zero, chunks)
        traffic, memory = predictions(r, cfg, mesh, M, schedule, zero)
    return dict(run=r, traffic=traffic, planned=memory, coords=mesh.coords)


def formula_bytes(res, cfg, grid, M, zero):
    """One rank's bytes per step from first principles, e = 8 (fp64), n = b*s/C tokens per microbatch:
    TP payload M*n*e*[(n_T*L + embedding + head)*h + 3*head], n_T = 4 (MLP) or 2 (experts), x1.5 recomputed;
    CP M*6(C-1)*L*n*(h/T)*e (8 recomputed); EP 2 (3) trips of the off-rank rows; PP M activations to the next
    virtual stage and M gradients back, + one 13-int64 header per stage; DP over N = dp*cp ranks with D
    replicated elements: DDP 2(N-1)/N*D*e per rank on average, ZeRO-1/2 3/2 ring passes of (N-1)*ceil(D/N)*e,
    FSDP 3M of them per layer (2M gathers, M reduce-scatters); experts: ZeRO's passes over N/ep ranks."""
    r = res["run"]
    e = 8
    h = cfg.hidden
    T = grid.tp
    P = grid.pp
    C = grid.cp
    E = grid.ep
    layers = [k for c in r.layout for k in c]
    n = r.local_batch // M * cfg.seq // C
    again = 1.5 if cfg.checkpoint else 1
    L = layers.count("block")
    ends = ("embedding" in layers) + ("head" in layers)
    n_T = (2 if cfg.experts else 4) * again
    rows = sum(off for chunk in r.routed for off, _ in chunk)
    stages = [c * P + res["coords"]["pp"] for c in range(len(r.layout))]  # rank r holds stages r, r + P, ...
    S = P * len(stages)
    N = grid.dp * C

    def ring(passes, numel, k):
        """Bytes of `passes` ring passes of k-1 shards of ceil(numel/k) elements."""
        return passes * (k - 1) * math.ceil(numel / k) * e
    D = sum(x[0] for x in r.numels)
    X = sum(x[1] for x in r.numels)
    dp = {0: Fraction(2 * (N - 1) * D * e, N), 1: ring(3, D, N), 2: ring(2, D, N),
          3: sum(ring(3 * M, d, N) for d, _ in r.numels)}[zero]
    return {"dp": dp + (X > 0) * ring((2, 3, 2)[min(zero, 2)], X, N // E),
            "pp": (P > 1) * sum(M * n * h * e * ((j < S - 1) + (j > 0)) + 8 * HEADER_LEN * (j < S - 1)
                                for j in stages),
            "cp": (C > 1) * M * (8 if cfg.checkpoint else 6) * (C - 1) * L * n * (h // T) * e,
            "tp": (T > 1) * M * n * e * ((n_T * L + ends) * h + 3 * ("head" in layers)),
            "ep": (E > 1) * 2 * again * rows * h * e}


def check(grid, M=2, schedule="1f1b", zero=0, chunks=1, experts=0, checkpoint=False, layers=4, seed=0,
          math_kernel=False, **shape):
    cfg = Config(vocab=padded_vocab(grid.tp), layers=layers, batch=grid.dp * M * 2, experts=experts,
                 checkpoint=checkpoint, seed=seed, **shape)
    assert configuration_error(cfg, grid, M, schedule, chunks, zero) is None
    results = run(grid.size, train_on_ranks, grid, cfg, M, schedule, zero, chunks, math_kernel)
    reference = train_dense(cfg, STEPS)  # one process, PyTorch's dense layers, the whole batch
    for res in results:
        assert max(abs(a - b) for a, b in zip(res["run"].losses, reference)) <= LOSS_TOL, (res["coords"], reference)
    for res in results:
        got = dict(res["run"].bytes[-1])
        if zero == 0:  # DDP's ring chunks may be uneven: its formula is the average over the dp x cp group
            group = [o for o in results if (o["coords"]["pp"], o["coords"]["tp"]) == (res["coords"]["pp"],
                                                                                      res["coords"]["tp"])]
            got["dp"] = Fraction(sum(o["run"].bytes[-1]["dp"] for o in group), len(group))
        assert got == formula_bytes(res, cfg, grid, M, zero), res["coords"]
        assert got == res["traffic"], res["coords"]
        assert res["run"].memory == res["planned"], res["coords"]
    return results, reference


# Every factorisation (dp, pp, cp, tp) of 1, 2 and 4 ranks, each with options chosen so that together they
# cover every ZeRO stage, schedule, expert layout and recomputation, and DDP accumulating M > 1 microbatches
# over dp x cp > 1 ranks (where a missing no_sync would reduce M times): (M, schedule, zero, experts, ep, ckpt)
CASES = {
    (1, 1, 1, 1): (2, "1f1b", 0, 4, 1, True),
    (1, 1, 1, 2): (2, "gpipe", 1, 0, 1, True),
    (1, 1, 2, 1): (2, "1f1b", 0, 4, 2, False),
    (1, 2, 1, 1): (4, "zero_bubble", 2, 4, 1, False),
    (2, 1, 1, 1): (2, "interleaved", 3, 4, 1, True),
    (1, 1, 1, 4): (1, "1f1b", 0, 4, 1, False),
    (1, 1, 2, 2): (2, "gpipe", 3, 0, 1, True),
    (1, 1, 4, 1): (2, "1f1b", 1, 4, 4, False),
    (1, 2, 1, 2): (4, "interleaved", 2, 4, 1, False),
    (1, 2, 2, 1): (2, "1f1b", 0, 4, 2, True),
    (1, 4, 1, 1): (4, "zero_bubble", 2, 0, 1, True),
    (2, 1, 1, 2): (4, "gpipe", 0, 0, 1, False),
    (2, 1, 2, 1): (2, "1f1b", 2, 4, 4, True),
    (2, 2, 1, 1): (2, "interleaved", 3, 0, 1, False),
    (4, 1, 1, 1): (2, "1f1b", 0, 4, 2, False),
}


def options(dims):
    M, schedule, zero, experts, ep, checkpoint = CASES[dims]
    return dict(grid=RankGrid(*dims, ep=ep), M=M, schedule=schedule, zero=zero, experts=experts,
                checkpoint=checkpoint, chunks=2 if schedule == "interleaved" else 1)


@pytest.mark.parametrize("dims", CASES, ids=["x".join(map(str, d)) for d in CASES])
def test_every_factorisation_trains_like_one_process_and_moves_the_formula_bytes(dims):
    check(**options(dims))


def test_the_cases_are_every_factorisation_and_cover_every_stage_schedule_expert_layout_and_recomputation():
    assert sorted(CASES) == sorted(dims for world in (1, 2, 4) for dims in factorisations(world))
    cases = [options(dims) for dims in CASES]
    assert {c["zero"] for c in cases} == {0, 1, 2, 3} and {c["schedule"] for c in cases} == set(SCHEDULES)
    assert {c["grid"].ep for c in cases} == {1, 2, 4} and {c["checkpoint"] for c in cases} == {False, True}
    assert {(c["experts"] > 0, c["zero"]) for c in cases} == {(e, z) for e in (False, True) for z in range(4)}
    assert any(c["zero"] == 0 and c["M"] > 1 and c["grid"].dp * c["grid"].cp > 1 for c in cases)


@st.composite
def runs(draw):
    dims = draw(st.sampled_from(factorisations(2) + factorisations(4)))
    experts = draw(st.sampled_from([0, 2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if dims[0] * dims[2] % e == 0 and (e == 1 or experts % e == 0
                                                                                         and experts)]))
    schedule, layers = draw(st.sampled_from(list(SCHEDULES))), draw(st.integers(2, 4))
    case = dict(grid=RankGrid(*dims, ep=ep), M=draw(st.sampled_from([1, 2, 4])), schedule=schedule,
                zero=draw(st.integers(0, 3)), experts=experts, checkpoint=draw(st.booleans()), layers=layers,
                chunks=draw(st.integers(1, (layers + 2) // dims[1])) if schedule == "interleaved" else 1,
                seed=draw(st.integers(0, 2**16)))
    cfg = Config(vocab=padded_vocab(dims[3]), layers=layers, batch=dims[0] * case["M"] * 2, experts=experts)
    assume(configuration_error(cfg, case["grid"], case["M"], schedule, case["chunks"], case["zero"]) is None)
    return case


@settings(max_examples=3)
@given(runs())
def test_any_combination_of_axes_stages_schedules_and_experts_equals_one_process(case):
    check(**case)


@pytest.mark.parametrize("experts", [0, 4])
def test_the_curve_compared_is_a_trained_one(experts):
    # after the first Adam step every weight with a gradient moves by ~lr = 1e-2: a run that never stepped
    # (lr 0, a lost optimizer) would match one process's first loss only, by far more than the tolerance after it
    cfg = Config(vocab=padded_vocab(2), batch=8, experts=experts)
    trained, frozen = train_dense(cfg, STEPS), train_dense(dataclasses.replace(cfg, lr=0.0), STEPS)
    assert frozen[0] == trained[0] and abs(frozen[-1] - trained[-1]) > 1e6 * LOSS_TOL


def test_a_configuration_refused_by_every_rank_leaves_the_pool_in_step():
    cfg = Config(vocab=padded_vocab(1), batch=4, experts=3)
    with pytest.raises(RankFailure, match=r"--ep 2 must divide the experts, --moe 3"):
        run(2, train_on_ranks, RankGrid(dp=2, ep=2), cfg, 2, "1f1b", 0, 1)
    run(2, train_on_ranks, RankGrid(dp=2, ep=2), dataclasses.replace(cfg, experts=2), 2, "1f1b", 0, 1)


def train_disagreeing(grid, cfg, stages):
    """Rank r asks for ZeRO stage stages[r]: the ranks would build different optimizers."""
    return train_on_ranks(grid, cfg, 2, "1f1b", stages[dist.get_rank()], 1)


def test_ranks_that_disagree_on_the_run_are_named_before_any_collective_of_it():
    with pytest.raises(RankFailure, match=r"rank 0 calls train_5d .* 0, 1\) .* rank 1 calls train_5d .* 1, 1\)"):
        run(2, train_disagreeing, RankGrid(dp=2), Config(vocab=padded_vocab(1), batch=4), (0, 1))


@pytest.mark.parametrize("world, argv, says", [
    (8, ["--dp", "2", "--pp", "2", "--cp", "2", "--tp", "2"], "= 16 ranks, but the world has 8"),
    (4, ["--dp", "3", "--tp", "2"], "--dp 3 x --tp 2 = 6 does not divide the world of 4 ranks"),
    (6, ["--cp", "3", "--pp", "1", "--tp", "1"], "--seq 16 must be a multiple of 2 x cp = 6"),
    (4, ["--cp", "4", "--pp", "1", "--tp", "1", "--seq", "12"], "--seq 12 must be a multiple of 2 x cp = 8"),
    (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--moe", "3", "--ep", "2"], "--ep 2 must divide the experts, --moe 3"),
    (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--ep", "2"], "--ep 2 must divide the experts, --moe 0"),
    (4, ["--dp", "1", "--pp", "2", "--tp", "2", "--ep", "2", "--moe", "4"], "--ep 2 must divide dp x cp = 1 x 1"),
    (4, ["--pp", "2", "--tp", "2", "--schedule", "zero_bubble"], "zero_bubble's W reruns part of a block's backward"),
    (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", "3", "--schedule", "zero_bubble"], "--zero 3 (FSDP)"),
    (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", "3", "--moe", "4", "--ep", "2"], "--zero 3 (FSDP)"),
    (2, ["--pp", "2", "--tp", "1", "--layers", "1", "--chunks", "2", "--schedule", "interleaved"],
     "--layers 1 + embedding + head = 3 layers cannot fill 2 stages x 2 chunk(s)")])
def test_a_configuration_that_cannot_run_is_one_line_before_any_process_group(world, argv, says, monkeypatch, capsys):
    err = refusal(train_5d, world, argv, monkeypatch, capsys)
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("grid, experts", [(RankGrid(dp=2, pp=2, tp=2), 0), (RankGrid(dp=2, pp=2, cp=2, ep=2), 4)],
                         ids=["dp2xpp2xtp2", "dp2xpp2xcp2xep2-moe"])
def test_eight_ranks_the_demos_configurations_train_like_one_process(grid, experts):
    check(grid, M=2, experts=experts)


@pytest.mark.parametrize("case", [
    dict(grid=RankGrid(dp=3, ep=3), experts=3, zero=0),  # DDP's ring over 3 ranks: chunks of uneven sizes
    dict(grid=RankGrid(cp=3), seq=12, zero=1, schedule="gpipe", checkpoint=True),
    dict(grid=RankGrid(tp=3), heads=3, hidden=24, zero=2, experts=2)], ids=["dp3xep3-moe", "cp3", "tp3"])
def test_three_ranks_odd_degrees_train_like_one_process(case):
    check(**case)


@pytest.mark.parametrize("dims, schedule", [((1, 2, 1, 2), "1f1b"), ((2, 2, 1, 1), "gpipe")],
                         ids=["pp2xtp2", "dp2xpp2"])
def test_the_math_attention_kernel_cudas_for_fp64_keeps_the_ledgers_peak_exact(dims, schedule):
    """Under SDPA's math kernel (forced here on the CPU) attention keeps its probabilities: a bigger peak of
    saved bytes, still the ledger's, whatever the schedule keeps alive."""
    check(RankGrid(*dims), M=2, schedule=schedule, math_kernel=True)
