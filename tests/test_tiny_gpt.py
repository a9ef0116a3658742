"""The tiny GPT written once (mini_dist/tiny_gpt.py): on every grid of cp x tp ranks, with or without experts cut
over ep of them, the model built over the mesh has exactly the parameter names of the dense model built from
PyTorch's layers, in the same order, each tensor whole or cut along one dimension into T (or ep) equal parts, and
each rank holds the parameters gpt_ledger counts for it; the batches are windows of the corpus with their
targets one character on. Everything is integer arithmetic or shapes: every assertion is exact."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import run
from mini_dist import gpt_ledger, tiny_gpt
from mini_dist.cost_model import Plan
from mini_dist.mesh import Mesh
from mini_dist.tiny_gpt import CHARS, CORPUS, Config, padded_vocab

_meshes = {}


def parameters_beside_dense(cp, tp, ep, experts):
    """On every rank: the dense model's and the cut model's (name, shape) in order, and what this rank holds
    beside gpt_ledger's count."""
    if (cp, tp, ep) not in _meshes:
        _meshes[(cp, tp, ep)] = Mesh(cp=cp, tp=tp, ep=ep)
    cfg = Config(vocab=padded_vocab(tp), layers=2, experts=experts)
    dense = tiny_gpt.tiny_gpt(cfg, device="meta")  # the module's function, at call time
    mine = tiny_gpt.tiny_gpt(cfg, _meshes[(cp, tp, ep)], torch.device("cpu"))  # cpu: shapes only
    plan = Plan(dp=1, cp=cp, tp=tp, ep=ep)
    ledger = sum(sum(gpt_ledger.layer_numel(gpt_ledger.model_of(cfg), plan, tiny_gpt.kind(layer))) for layer in mine)
    return ([(n, tuple(p.shape)) for n, p in dense.named_parameters()],
            [(n, tuple(p.shape)) for n, p in mine.named_parameters()], sum(p.numel() for p in mine.parameters()),
            ledger)


@pytest.mark.parametrize("cp,tp,ep,experts", [(1, 1, 1, 0), (1, 2, 1, 4), (2, 1, 2, 2), (1, 4, 1, 0), (2, 2, 2, 4),
                                              (4, 1, 4, 4), (3, 1, 1, 0)])
def test_the_cut_model_has_the_dense_names_each_tensor_whole_or_cut_in_equal_parts(cp, tp, ep, experts):
    for dense, mine, held, ledger in run(cp * tp, parameters_beside_dense, cp, tp, ep, experts):
        assert [n for n, _ in mine] == [n for n, _ in dense]
        for (name, whole), (_, part) in zip(dense, mine):
            differ = [d for d in range(len(whole)) if whole[d] != part[d]]
            assert len(part) == len(whole) and len(differ) <= 1, (name, whole, part)
            assert not differ or part[differ[0]] * (ep if ".experts." in name else tp) == whole[differ[0]], \
                (name, whole, part)
        assert held == ledger


@pytest.mark.single_process
@given(step=st.integers(0, 1000), batch=st.integers(1, 8), seq=st.integers(1, len(CORPUS) - 2))
def test_a_batch_is_windows_of_the_corpus_with_targets_one_character_on(step, batch, seq):
    ids, targets = tiny_gpt.get_batch(Config(batch=batch, seq=seq), step)
    assert ids.shape == targets.shape == (batch, seq)
    text = "".join(CHARS[i] for i in ids[:, 0].tolist())
    assert all(c in CORPUS for c in text)
    for row, target in zip(ids.tolist(), targets.tolist()):
        window = "".join(CHARS[i] for i in row + target[-1:])
        assert window in CORPUS and target == row[1:] + target[-1:]


@pytest.mark.single_process
@given(tp=st.integers(1, 64))
def test_the_padded_vocabulary_is_the_least_multiple_of_tp_that_holds_every_character(tp):
    V = padded_vocab(tp)
    assert V % tp == 0 and len(CHARS) <= V < len(CHARS) + tp
