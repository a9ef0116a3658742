"""The tiny GPT's ledger, layer by layer (mini_dist/gpt_ledger.py), in one process: its formulas are the
docstring's, a layer's parameters are those of PyTorch's own dense layers, and attention keeps its
probabilities exactly where SDPA picks the math kernel. The ranks' measured bytes and memory are checked against
the ledger in tests/test_parallel_gpt.py (and, with the rest of a 5D step, mini_dist/rank_ledger.py's, in
tests/test_train_5d.py). All integer arithmetic: every assertion is exact."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from mini_dist import gpt_ledger
from mini_dist.cost_model import Model, Plan
from mini_dist.kit import launch
from mini_dist.tiny_gpt import Config


@given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([1, 2]),
       experts=st.sampled_from([0, 4]), checkpoint=st.booleans(), b=st.integers(1, 3), M=st.integers(1, 3),
       rows=st.integers(0, 500), blocks=st.integers(0, 4), ends=st.tuples(st.booleans(), st.booleans()))
@pytest.mark.single_process
def test_the_ledgers_bytes_are_the_docstrings_formulas(tp, cp, ep, experts, checkpoint, b, M, rows, blocks, ends):
    # the docstring, per microbatch: TP [n_T*L + embedding + head]*b(s/C)h*e + 3b(s/C)*e with n_T = 4 (MLP) or
    # 2 (experts), x1.5 recomputed; CP 6 (8 recomputed) hops of (C-1) b(s/C)(h/T)*e per block; EP 2 (3) trips
    # of the off-rank rows, h*e each. The ranks' measured bytes are checked against the ledger elsewhere.
    cfg, e = Config(experts=experts, checkpoint=checkpoint), 8
    h, n, again = cfg.hidden, b * cfg.seq // cp, 1.5 if checkpoint else 1
    plan = Plan(dp=1, tp=tp, cp=cp, ep=ep, checkpoint=checkpoint, micro_batch=b, microbatches=M, precision="fp64")
    n_T = (2 if experts else 4) * again
    want = {"tp": (tp > 1) * M * ((n_T * blocks + ends[0] + ends[1]) * n * h * e + 3 * n * e * ends[1]),
            "cp": (cp > 1) * M * (8 if checkpoint else 6) * (cp - 1) * blocks * n * (h // tp) * e,
            "ep": (ep > 1 and experts > 0) * 2 * again * rows * h * e}
    assert gpt_ledger.step_traffic(gpt_ledger.model_of(cfg), plan, blocks, *ends, rows) == want


@settings(max_examples=25)
@given(heads=st.integers(1, 4), head_dim=st.integers(1, 6), vocab=st.integers(1, 40), seq=st.integers(1, 20),
       experts=st.sampled_from([0, 2, 3]), kind=st.sampled_from(["embedding", "block", "head"]))
@pytest.mark.single_process
def test_a_layers_parameters_are_those_of_pytorchs_dense_layers(heads, head_dim, vocab, seq, experts, kind):
    model = Model(0, 1, heads * head_dim, heads, seq, vocab, experts, min(2, max(experts, 1)))
    assert sum(gpt_ledger.layer_numel(model, Plan(dp=1), kind)) == gpt_ledger.dense_numel(model, kind)


@pytest.mark.single_process
def test_attention_keeps_its_probabilities_where_sdpa_runs_the_math_kernel():
    model, plan = gpt_ledger.model_of(Config()), Plan(dp=1, micro_batch=2, precision="fp64")
    assert not gpt_ledger.attention_keeps_scores(model, plan, "cpu")  # fp64 on the CPU: the flash kernel
    with sdpa_kernel(SDPBackend.MATH):  # CUDA's only fp64 kernel
        assert gpt_ledger.attention_keeps_scores(model, plan, "cpu")
        assert not gpt_ledger.attention_keeps_scores(model, Plan(dp=1, cp=2, precision="fp64"), "cpu")  # ring
    layers, e, n, H, s = ["block"], 8, 2 * 16, 4, 16
    grown = gpt_ledger.activation_bytes(model, plan, layers, scores=True) - gpt_ledger.activation_bytes(model, plan,
                                                                                                       layers)
    assert grown == e * H * n * (s - 1)


def test_the_demo_prints_each_layers_ledger_and_passes(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launch.main(gpt_ledger.parser(), gpt_ledger.demo, ["--cp", "2", "--moe", "4", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "block 37,888 = 37,888" in out and out.strip().splitlines()[-1].startswith("SUMMARY|gpt_ledger|PASS")
    block = next(line for line in out.splitlines() if line.strip().startswith("block "))
    # per block, fp64, n = 2*16/2 = 16 tokens, h = 32, T = 2: TP 2 all-reduces of n*h*e (attention's g forward
    # and f backward: TP does not cut experts); CP 6 hops of n*(h/T)*e; EP 2 trips (there and back) of the
    # balanced off-rank rows, 2 * n*top_k/2 of them, h*e each
    assert block.split("|")[1].split() == ["tp", "8,192", "cp", "12,288", "ep", "16,384"], block
