"""Each rank of a 5D step (mini_dist/rank_ledger.py), in one process: data parallelism's bytes are the
docstring's formulas for every ZeRO stage, a pipeline schedule's peak keeps the microbatches it should, and the
demo prints every rank's ledger. The ranks' measured bytes and memory are checked against this ledger in
tests/test_train_5d.py. All integer arithmetic: every assertion is exact."""
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_dist import rank_ledger
from mini_dist.cost_model import Model, Plan
from mini_dist.gpt_ledger import layer_numel
from mini_dist.kit import launch
from mini_dist.pipeline_schedules import SCHEDULES


@given(dp=st.integers(1, 4), cp=st.integers(1, 3), zero=st.integers(0, 3), experts=st.sampled_from([0, 2, 4]),
       M=st.integers(1, 3), blocks=st.integers(0, 3), ends=st.tuples(st.booleans(), st.booleans()),
       data=st.data())
@pytest.mark.single_process
def test_data_parallel_bytes_are_the_docstrings_formulas(dp, cp, zero, experts, M, blocks, ends, data):
    # the docstring, over N = dp*cp ranks, S = ceil(D/N): DDP 2(N-1)/N * D*e, ZeRO-1 3(N-1) * S*e, ZeRO-2
    # 2(N-1) * S*e, FSDP 3M(N-1) * S_u*e per layer; experts: the same stage's passes over N/ep ranks
    N = dp * cp
    ep = data.draw(st.sampled_from([e for e in (1, 2, 4) if N % e == 0 and (e == 1 or experts % e == 0 and experts)]))
    model = Model(0, blocks, 8, 2, 4, 6, experts, 2)
    plan = Plan(dp=dp, cp=cp, ep=ep, zero=zero, microbatches=M, precision="fp64")
    layers = ["embedding"] * ends[0] + ["block"] * blocks + ["head"] * ends[1]
    numels = [layer_numel(model, plan, kind) for kind in layers]
    D = sum(d for d, _ in numels)
    X = sum(x for _, x in numels)
    e = 8
    ring = {0: Fraction(2 * (N - 1) * D * e, N), 1: 3 * (N - 1) * math.ceil(D / N) * e,
            2: 2 * (N - 1) * math.ceil(D / N) * e, 3: sum(3 * M * (N - 1) * math.ceil(d / N) * e for d, _ in numels)}
    passes = (2, 3, 2)[min(zero, 2)]
    want = ring[zero] + (passes * (N // ep - 1) * math.ceil(X / (N // ep)) * e if X else 0)
    assert rank_ledger.dp_traffic(model, plan, layers) == want


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", [(1, 3), (2, 2), (4, 2), (4, 8)])
def test_the_peak_keeps_every_microbatch_under_gpipe_and_p_minus_stage_under_1f1b(name, P, M):
    """GPipe runs all M forwards first; 1F1B lets stage s run at most P - s forwards ahead of its backwards
    (Narayanan et al. 2021): the first stage keeps min(M, P) microbatches alive."""
    for stage, actions in enumerate(SCHEDULES[name](P, M).actions):
        kept = M if name == "gpipe" else min(M, P - stage)
        assert rank_ledger.peak_activations(actions, ten) == 10 * kept
        assert rank_ledger.peak_activations(actions, ten, three) == 10 * kept + 3  # in flight


def ten(chunk: int, microbatch: int) -> int:
    """10 bytes kept by every forward."""
    return 10


def three(chunk: int) -> int:
    """3 bytes held while a forward runs."""
    return 3


def test_the_demo_prints_every_ranks_ledger_and_passes(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launch.main(rank_ledger.parser(), rank_ledger.demo, ["--cp", "2", "--moe", "4", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("   ") and line.split()[0].isdigit()]
    assert [row[:2] for row in rows] == [[str(p), str(f)] for p in range(2) for f in range(4)], out
    assert "per pp rank: [2, 1] (GPipe keeps all M, 1F1B min(M, P - stage): [2, 1])" in out, out
    assert out.strip().splitlines()[-1].startswith("SUMMARY|rank_ledger|PASS 1f1b's peak keeps [2, 1]"), out
