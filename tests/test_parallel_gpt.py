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
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness import run
from mini_dist import parallel_gpt
from mini_dist.kit import launch
from mini_dist.mesh import Mesh, RankGrid
from mini_dist.parallel_gpt import configuration_error
from mini_dist.tiny_gpt import Config, padded_vocab

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


CASES = [(d, c, t) for world in (1, 2, 4) for d, c, t in factorisations(world)]


@pytest.mark.exercise
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
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MINI_DIST_TIMEOUT", "3")  # were it accepted, joining a group of absent ranks fails fast
    assert launch.main(parallel_gpt.parser(), parallel_gpt.demo, argv) == 2 and not dist.is_initialized()
    err = capsys.readouterr().err.strip().splitlines()
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
