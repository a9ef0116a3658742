"""The tiny GPT cut by data x context x tensor parallelism, with or without experts cut by expert parallelism
(mini_dist/parallel_gpt.py): one forward + backward on every factorisation dp x cp x tp of 1, 2 and 4 ranks
gives the dense model's loss and every one of its gradients (PyTorch's own layers in one process, the whole
batch), each axis moves the bytes of the docstring's formulas, and the parameters, gradients and saved
activations of each rank are the ledger's (mini_dist/gpt_ledger.py), also where attention runs the math kernel
(CUDA's for fp64, forced here on the CPU), which keeps the attention probabilities for backward.

Tolerance: fp64 (eps 2.2e-16) on a loss ~3 and gradients <= ~1: the cut model differs from the dense one only in
the order of its sums (row-parallel partial sums over h/tp terms, the dp x cp average, ring attention's online
softmax, experts' rows in another order), a few ulps; measured <= 4.4e-16 over 80 runs. A wrong divisor, a
missing all-reduce or a wrong sequence chunk moves a gradient by as much as the gradient itself: 1e-12 sits
far below that and far above the rounding."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from grading import mistake
from harness import device, refusal, run
from mini_dist import parallel_gpt
from mini_dist.mesh import Mesh, RankGrid
from mini_dist.parallel_gpt import configuration_error
from mini_dist.tiny_gpt import Config, dense_model, get_batch, padded_vocab, tiny_gpt
from mini_dist.vocab_parallel import vocab_parallel_cross_entropy

TOL = 1e-12
_meshes = {}


def mesh_for(grid: RankGrid) -> Mesh:
    """One Mesh per grid, per pool: every rank creates the same groups in the same order, once."""
    if grid not in _meshes:
        _meshes[grid] = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    return _meshes[grid]


def on_ranks(grid, cfg, math_kernel=False):
    with sdpa_kernel(SDPBackend.MATH) if math_kernel else contextlib.nullcontext():
        worst, traffic, memory = parallel_gpt.step_against_dense(cfg, mesh_for(grid))  # the module's, at call time
    return worst, traffic, memory, dist.get_rank()


def factorisations(world):
    """(dp, cp, tp) with dp * cp * tp = world."""
    return [(d, c, world // (d * c)) for d in range(1, world + 1) for c in range(1, world + 1) if world % (d * c) == 0]


def check(dp, cp, tp, ep=1, experts=0, checkpoint=False, seed=0, seq=16, math_kernel=False, **shape):
    grid = RankGrid(dp=dp, cp=cp, tp=tp, ep=ep)
    cfg = Config(vocab=padded_vocab(tp), layers=2, seq=seq, batch=2 * dp, experts=experts, checkpoint=checkpoint,
                 seed=seed, **shape)
    assert configuration_error(cfg, grid) is None
    results = run(grid.size, on_ranks, grid, cfg, math_kernel)
    for worst, (sent, formula), (held, planned), rank in results:
        assert worst <= TOL, f"rank {rank}: the loss or a gradient differs from the dense GPT's by {worst:.1e}"
        assert sent == formula, rank
        assert held == planned, rank
    return results


# ----- the learner's exercise (./run.sh check parallel_gpt): average_gradients, judged rank by rank

MISTAKES = {  # each is made by a wrong solution of tests/bank_parallel_gpt.py (tests/test_exercise.py holds that)
    "a sum where an average was meant": ("average_gradients", "each rank's loss is the mean over its own tokens, so "
                                         "the sum over the N = dp x cp ranks that hold the same weights is N times "
                                         "the mean over all of them: divide by N"),
    "the context-parallel ranks left out": ("average_gradients", "a cp rank holds the same weights as its dp "
                                            "replicas and saw other tokens (another part of the same sequences): "
                                            "the average runs over all dp x cp of them"),
    "expert gradients summed with other experts'": ("average_gradients", "the ranks of an EP group hold different "
                                                    "experts (a parameter with ep_dim): reduce an expert's gradient "
                                                    "only over the ranks that hold the same experts"),
    "expert gradients averaged over their replicas only": ("average_gradients", "the all-to-all already brought "
                                                           "each expert the tokens of its whole EP group: summed "
                                                           "over its replicas it holds the tokens of all dp x cp "
                                                           "ranks, so it too is divided by dp x cp"),
    "expert gradients left unreduced": ("average_gradients", "an expert's replicas (the same experts on the other "
                                        "EP groups) saw other tokens: sum over them too, then divide by dp x cp"),
}
# grids whose mistakes differ: dp alone, cp alone, experts with replicas (two EP groups of dp x cp), experts
# beside TP, and an odd world whose experts have no replica; batch 2 x dp. The grid with replicas comes before
# those without: there an expert left unreduced and one divided by its replicas' count leave different figures
GRADIENT_CASES = [dict(dp=1, cp=1, tp=1), dict(dp=2, cp=1, tp=1), dict(dp=1, cp=2, tp=1),
                  dict(dp=2, cp=2, tp=1, ep=2, experts=4), dict(dp=2, cp=1, tp=2, ep=2, experts=2),
                  dict(dp=1, cp=3, tp=1, ep=3, experts=3, seq=12)]


def reduced(grads: dict, groups: dict, divisors: dict) -> dict:
    """Each gradient summed over its group (None: left as it is), then divided: what a solution leaves."""
    out = {}
    for name, g in grads.items():
        g = g.clone()
        if groups[name] is not None:
            dist.all_reduce(g, group=groups[name])
        out[name] = g / divisors[name]
    return out


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def classic_mistakes(grads: dict, experts: set, mesh: Mesh) -> list[tuple[str, str, dict]]:
    """(mistake, what it leaves, the gradients it leaves) for each classic mistake, on this rank. Every rank
    computes every one, the same collectives in the same order."""
    g = mesh.grid
    n = g.dp * g.cp
    edp = n // g.ep
    right = {p: mesh.edp_group if p in experts else mesh.dp_cp_group for p in grads}
    by_n = dict.fromkeys(grads, n)

    def for_experts(base: dict, value) -> dict:
        """base, with `value` for every expert's gradient."""
        return {p: value if p in experts else base[p] for p in base}

    def for_the_rest(base: dict, value) -> dict:
        """base, with `value` for every gradient but the experts'."""
        return {p: base[p] if p in experts else value for p in base}
    return [
        ("a sum where an average was meant", f"your gradients are the sums over the {n} ranks that hold the same "
         f"weights, never divided: {n} times the dense model's", reduced(grads, right, dict.fromkeys(grads, 1))),
        ("the context-parallel ranks left out", f"your gradients are averaged over the {plural(g.dp, 'dp rank')} "
         f"only, not over the {plural(g.cp, 'cp rank')} beside them",
         reduced(grads, for_the_rest(right, mesh.dp_group), for_the_rest(by_n, g.dp))),
        ("the context-parallel ranks left out", f"your gradients are summed over dp x cp = {n} ranks but divided by "
         f"dp = {g.dp}: {g.cp} times the dense model's", reduced(grads, right, for_the_rest(by_n, g.dp))),
        ("expert gradients summed with other experts'", f"your expert gradients are averaged over the dp x cp group, "
         f"whose {n} ranks hold {g.ep} different sets of experts",
         reduced(grads, for_experts(right, mesh.dp_cp_group), by_n)),
        ("expert gradients summed with other experts'", f"your expert gradients are summed over the EP group, "
         f"whose {g.ep} ranks hold different experts", reduced(grads, for_experts(right, mesh.ep_group), by_n)),
        ("expert gradients averaged over their replicas only", f"your expert gradients are summed over their "
         f"{plural(edp, 'replica')} and divided by {edp}, not by dp x cp = {n}: {g.ep} times the dense model's",
         reduced(grads, right, for_experts(by_n, edp))),
        ("expert gradients left unreduced", f"your expert gradients are divided by {n} but never summed over their "
         f"{plural(edp, 'replica')}", reduced(grads, for_experts(right, None), by_n)),
        ("expert gradients left unreduced", "your expert gradients are as backward left them",
         reduced(grads, for_experts(right, None), for_experts(by_n, 1))),
    ]


def first_difference(got: dict, want: dict) -> tuple | None:
    """(parameter, element, got, want, difference) where got and want first differ by more than TOL, else None."""
    for name, w in want.items():
        mine = got[name]
        if mine is None or mine.shape != w.shape:
            return name, None, None if mine is None else tuple(mine.shape), tuple(w.shape), None
        diff = (mine.double() - w).abs().flatten()
        if not diff.max() <= TOL:  # NaN too
            at = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
            return name, at, mine.flatten()[at].item(), w.flatten()[at].item(), diff[at].item()
    return None


def matches(got: dict, theirs: dict, want: dict) -> bool:
    """got is what a mistake leaves, on every gradient where that mistake changes anything (and it changes one)."""
    changed = [p for p in want if first_difference({p: theirs[p]}, {p: want[p]})]
    return bool(changed) and all(got[p] is not None and not first_difference({p: got[p]}, {p: theirs[p]})
                                 for p in changed)


def gradients_against_dense(grid: RankGrid, cfg: Config):
    """On a rank: one forward + backward of its shard on its tokens, the module's average_gradients, and its
    gradients beside its shard of the dense model's gradient of the whole batch (the dense model's weights set
    to their gradients, then sharded as the weights are). Returns (rank, the first difference or None, the
    classic mistakes whose gradients the rank holds)."""
    mesh = mesh_for(grid)
    model = parallel_gpt.parallel_model(cfg, mesh)
    ids, targets = parallel_gpt.local_batch(cfg, mesh, 0)
    vocab_parallel_cross_entropy(model(ids), targets, mesh.tp_group).mean().backward()
    params = dict(model.named_parameters())
    grads = {name: p.grad.detach().clone() for name, p in params.items()}
    experts = {name for name, p in params.items() if hasattr(p, "ep_dim")}
    dense = dense_model(cfg, device())
    ids, targets = get_batch(cfg, 0)
    F.cross_entropy(dense(ids).flatten(0, 1), targets.flatten()).backward()
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(p.grad)
    want = dict(parallel_gpt.shard_from_dense(tiny_gpt(cfg, mesh, device()), dense, mesh).named_parameters())
    want = {name: w.detach() for name, w in want.items()}
    parallel_gpt.average_gradients(model, mesh)  # the module's, at call time
    got = {name: None if p.grad is None else p.grad.detach() for name, p in params.items()}
    made = [(name, said) for name, said, theirs in classic_mistakes(grads, experts, mesh) if matches(got, theirs, want)]
    return dist.get_rank(), first_difference(got, want), made


def grid_case(case: dict) -> str:
    return " x ".join(f"{a} {case.get(a, 1)}" for a in ("dp", "cp", "tp")) + (
        f", {case['experts']} experts over ep {case['ep']}" if case.get("experts") else ", an MLP")


@pytest.mark.exercise(judges=("average_gradients",))
@pytest.mark.parametrize("case", GRADIENT_CASES, ids=[grid_case(c) for c in GRADIENT_CASES])
def test_averaged_gradients_are_each_ranks_shard_of_the_dense_models_gradient(case):
    """average_gradients: each rank's gradients = its shard of the dense model's gradient of the whole batch's mean
    loss, within 1e-12 (fp64)

    The cut model differs from the dense one only in the order of its sums (a few ulps, measured <= 4.4e-16): a
    wrong divisor or group moves a gradient by as much as the gradient itself."""
    shape = {k: v for k, v in case.items() if k not in ("dp", "cp", "tp", "ep")}
    grid = RankGrid(dp=case["dp"], cp=case["cp"], tp=case["tp"], ep=case.get("ep", 1))
    cfg = Config(vocab=padded_vocab(grid.tp), layers=2, batch=2 * grid.dp, **{"seq": 16, **shape})
    assert configuration_error(cfg, grid) is None
    for rank, differ, made in run(grid.size, gradients_against_dense, grid, cfg):
        if differ is None:
            continue
        name, at, got, want, by = differ
        where = f"{grid_case(case)}: rank {rank}'s {name}.grad"
        if at is None:
            said = f"{where} is {'missing (None)' if got is None else f'of shape {got}'}, want shape {want}"
        else:
            said = (f"{where}, element {at}: {got!r}, want {want!r} (its shard of the dense model's gradient), off by "
                    f"{by:.1e}, more than 1e-12")
        found = [mistake(MISTAKES, m, evidence) for m, evidence in made[:1]]
        assert False, "\n".join([said, *found])


CASES = [(d, c, t) for world in (1, 2, 4) for d, c, t in factorisations(world)]


@pytest.mark.parametrize("dp,cp,tp", CASES, ids=[f"dp{d}xcp{c}xtp{t}" for d, c, t in CASES])
def test_every_factorisation_equals_the_dense_gpt_and_moves_the_formula_bytes(dp, cp, tp):
    # experts on every other case, spread over the largest expert group dp x cp allows; recomputation on a third
    i = CASES.index((dp, cp, tp))
    ep = max(e for e in (1, 2, 4) if dp * cp % e == 0) if i % 2 else 1
    check(dp, cp, tp, ep=ep, experts=4 if i % 2 else 0, checkpoint=i % 3 == 1)


@pytest.mark.parametrize("case", [dict(dp=1, cp=3, tp=1, ep=3, experts=3, seq=12),
                                  dict(dp=3, cp=1, tp=1, checkpoint=True), dict(dp=1, cp=1, tp=3, heads=3, hidden=24)],
                         ids=["cp3xep3-moe", "dp3", "tp3"])
def test_three_ranks_odd_degrees_equal_the_dense_gpt(case):
    check(**case)


@settings(max_examples=3)
@given(case=st.sampled_from([(d, c, t) for world in (2, 4) for d, c, t in factorisations(world)]),
       experts=st.sampled_from([0, 2, 4]), checkpoint=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_experts_recomputation_and_any_seed_equal_the_dense_gpt(case, experts, checkpoint, seed, data):
    dp, cp, tp = case
    ep = data.draw(st.sampled_from([e for e in (1, 2, 4) if dp * cp % e == 0 and (experts or e == 1)
                                    and experts % e == 0]))
    check(dp, cp, tp, ep, experts, checkpoint, seed, seq=4 * cp * 2)


@pytest.mark.parametrize("grid, cfg, says", [
    (RankGrid(cp=3), Config(), "--seq 16 must be a multiple of 2 x cp = 6"),
    (RankGrid(cp=2, ep=2), Config(experts=3), "--ep 2 must divide the experts, --moe 3"),
    (RankGrid(dp=2, ep=2), Config(), "--ep 2 must divide the experts, --moe 0"),
    (RankGrid(tp=3), Config(), "--heads 4 must divide --hidden 32 and be a multiple of --tp 3"),
    (RankGrid(dp=3), Config(batch=8), "the global batch of 8 sequences must split into dp = 3"),
    (RankGrid(), Config(experts=1), "top-2 routing needs at least 2 experts")])
def test_a_model_that_cannot_be_cut_is_named_with_what_to_change(grid, cfg, says):
    assert configuration_error(cfg, grid).startswith(says)


@pytest.mark.parametrize("world, argv, says", [
    (4, ["--cp", "3"], "--cp 3 x --tp 2 = 6 ranks, but the world has 4"),
    (4, ["--cp", "2", "--tp", "1"], "--cp 2 x --tp 1 = 2 ranks, but the world has 4"),
    (4, ["--tp", "0"], "--cp 4 x --tp 0 = 0 ranks, but the world has 4"),
    (2, ["--cp", "2", "--seq", "6"], "--seq 6 must be a multiple of 2 x cp = 4"),
    (4, ["--cp", "2", "--moe", "3", "--ep", "2"], "--ep 2 must divide the experts, --moe 3"),
    (4, ["--tp", "4", "--moe", "4", "--ep", "2"], "--ep 2 must divide dp x cp = 1 x 1 = 1")])
def test_the_demo_refuses_a_configuration_in_one_line_before_any_process_group(world, argv, says, monkeypatch,
                                                                              capsys):
    err = refusal(parallel_gpt, world, argv, monkeypatch, capsys)
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("dp,cp,tp,experts", [(1, 1, 2, 0), (2, 1, 1, 4), (1, 2, 2, 0)])
def test_the_math_attention_kernel_keeps_the_probabilities_and_the_ledger_counts_them(dp, cp, tp, experts):
    """CUDA runs fp64 attention on SDPA's math kernel, which keeps the H/T s x s probabilities where the CPU's
    flash kernel keeps one log-sum-exp per row: forced here, the saved bytes grow by exactly e*Hn(s-1)/T per
    block, and the ledger follows; ring attention (cp > 1) keeps the same bytes under either."""
    fused, math = (check(dp, cp, tp, experts=experts, ep=dp, math_kernel=m) for m in (False, True))
    n, s, H, e, L = 2 * 16 // cp, 16 // cp, 4, 8, 2
    for (_, _, (held, _), _), (_, _, (held_math, _), _) in zip(fused, math):
        grown = held_math["activations"] - held["activations"]
        assert grown == (cp == 1) * L * e * H * n * (s - 1) // tp, grown
