"""Selective checkpointing: the matmul outputs kept, the rest recomputed; gradients bit-identical to no
checkpointing and to torch's create_selective_checkpoint_contexts, saved bytes equal to the formula.

No tolerance, for the reason test_activation_checkpoint.py gives. The MLP layer (Linear -> GeLU -> dropout)
keeps, selectively checkpointed, its input and the Linear's output: L * 2e * n*w bytes (the 1-byte dropout
mask is recomputed). torch keeps the selective outputs outside autograd's saved tensors, so its byte count
is not compared.
"""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import checkpoint as tc
from torch.utils.flop_counter import FlopCounterMode

from harness import device
from mini_dist import selective_checkpoint as sc
from mini_dist.activation_checkpoint import checkpoint
from mini_dist.kit.activations import TransformerLayer
from mini_dist.kit.measure import SavedTensors, profile_step
from test_activation_checkpoint import CASES, demo, each, identical, inputs, mlp, step


def torchs(m, x):
    context = functools.partial(tc.create_selective_checkpoint_contexts, sc.MATMULS)
    return each(functools.partial(tc.checkpoint, use_reentrant=False, context_fn=context))(m, x)


@pytest.mark.single_process
@given(**CASES)
def test_gradients_are_bit_identical_to_no_checkpointing_and_to_torch_and_saved_bytes_equal_the_formula(
        depth, width, n, dtype_dropout, x_grad, tied, seed, data):
    dtype, p = dtype_dropout
    model = mlp(depth, width, p, dtype, tied and depth >= 2, seed)
    x = inputs(n, width, dtype, seed, x_grad)
    plain, theirs = step(lambda m, y: m(y), model, x, seed), step(torchs, model, x, seed)
    mine = step(each(sc.selective_checkpoint), model, x, seed)
    for other in (plain, theirs):
        assert torch.equal(mine[0], other[0]) and identical(mine[2], other[2])
        assert all(torch.equal(a, b) for a, b in zip(mine[3], other[3]))
    assert mine[1] == depth * 2 * x.element_size() * n * width


@pytest.mark.single_process
@settings(max_examples=10)
@given(depth=st.integers(2, 5), seed=st.integers(0, 99))
def test_peak_activation_bytes_alive_in_backward_equal_torchs_selective_checkpoint(depth, seed):
    model, x, peaks = mlp(depth, 6, 0.3, torch.float32, False, seed), inputs(3, 6, torch.float32, seed), []
    for run_model in (each(sc.selective_checkpoint), torchs):
        torch.manual_seed(seed)
        peaks.append(max(profile_step(lambda: run_model(model, x), lambda out: out.sum().backward())["backward"]))
    assert peaks[0] == peaks[1]


def test_a_selective_segment_runs_forward_twice_but_replays_the_kept_matmuls_instead_of_recomputing_them():
    calls, ops = [], []
    model = mlp(3, 4, 0.0, torch.float64, False, 0)
    model[1].register_forward_pre_hook(lambda *_: calls.append(1))
    x = inputs(2, 4, torch.float64, 0)
    for run_model, forwards in [(lambda m, y: m(y), 1), (each(sc.selective_checkpoint), 2)]:
        calls.clear()
        with FlopCounterMode(display=False) as flops:
            run_model(model, x).sum().backward()
        ops.append(flops.get_total_flops())
        assert len(calls) == forwards
    assert ops[1] == ops[0]  # the only FLOPs (the Linears') are kept, not recomputed


def test_a_policy_that_keeps_nothing_is_full_checkpointing():
    model, x = mlp(3, 4, 0.3, torch.float32, False, 4), inputs(2, 4, torch.float32, 4)
    nothing = functools.partial(sc.selective_checkpoint, policy=lambda op: False)
    full, none_kept = step(each(checkpoint), model, x, 4), step(each(nothing), model, x, 4)
    assert full[1] == none_kept[1] == 3 * x.numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(full[3], none_kept[3]))


def test_the_transformer_layer_keeps_ten_times_its_input_selectively():
    b, s, h, a = 2, 6, 8, 2
    layer, x = TransformerLayer(h, a, 0.1).to(device()), torch.randn(b, s, h).to(device())
    with SavedTensors(exclude=layer.parameters()) as saved:
        sc.selective_checkpoint(layer, x)
    assert saved.bytes == 10 * 4 * s * b * h  # input + qkv 3 + proj 1 + fc1 4 + fc2 1


def test_demo_command_checks_itself_and_refuses_heads_that_do_not_divide_hidden(monkeypatch, capsys):
    assert demo(["--layers", "3", "--seq", "8", "--hidden", "8", "--heads", "2"], monkeypatch, sc) == 0
    out = capsys.readouterr().out
    assert "SUMMARY|selective_checkpoint|PASS" in out and "|PASS" in out.split("SUMMARY")[1], out
    assert demo(["--heads", "3"], monkeypatch, sc) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--heads" in err, err
