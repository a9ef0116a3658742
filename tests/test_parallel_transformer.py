"""Tensor-parallel attention and the pre-norm block equal nn.MultiheadAttention and a dense block of PyTorch's
own layers, with and without sequence parallelism, on TP groups of 1-4 inside pools of up to 5 (fp64; the
tolerance and the helpers are those of test_tensor_parallel.py). The collectives per layer are counted at
torch.distributed itself, and the activation memory per rank is measured against its formula.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import device, run
from mini_dist import parallel_transformer as pt
from mini_dist import tensor_parallel as tp
from mini_dist.questions import model as model_questions
from mini_dist.kit.measure import SavedTensors
from test_tensor_parallel import (DATA_COLLECTIVES, F64, TOL, assert_counted, assert_named_on_every_rank,
                                  assert_same_clear_errors, error_messages, forward_backward_counted, provoke,
                                  reassign_every_parameter, run_both, seed_group, seq_shard, tp_group,
                                  worlds_and_sizes)


def module_worker(kind, seed, T, batch, seq, heads_k, head_dim, causal, sp, reassign=False):
    group, index = tp_group(T)
    if group is None:
        return None
    seed_group(seed, index)
    heads, s = heads_k * T, seq * T
    h = heads * head_dim
    kw = dict(sequence_parallel=sp, group=group, device=device(), dtype=F64)
    mask = torch.ones(s, s, dtype=torch.bool, device=device()).triu(1) if causal else None
    ref = None
    if kind == "attention":
        dense = nn.MultiheadAttention(h, heads, batch_first=True, device=device(), dtype=F64)
        parallel = pt.ParallelAttention(h, heads, causal, **kw)

        def ref(x):
            """nn.MultiheadAttention as self-attention: its output alone."""
            return dense(x, x, x, attn_mask=mask, need_weights=False)[0]
    else:
        dense = pt.TransformerBlock(h, heads, causal, device=device(), dtype=F64)
        parallel = pt.ParallelTransformerBlock(h, heads, causal, **kw)
    with torch.no_grad():  # layer norms start at weight 1, bias 0: randomise them so their grads matter
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tp.shard_from_dense(reassign_every_parameter(parallel) if reassign else parallel, dense, group)
    x = torch.randn(batch, s, h, device=device(), dtype=F64)
    shard = (lambda t: seq_shard(t, group)) if sp else (lambda t: t)
    return run_both(dense, parallel, group, x, shard, shard, sp, ref)


@pytest.mark.parametrize("kind", ["attention", "block"])  # vs nn.MultiheadAttention / a block of PyTorch layers
@settings(max_examples=12)
@given(worlds_and_sizes, st.integers(1, 2), st.integers(1, 3), st.integers(1, 2), st.integers(1, 4),
       st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_parallel_attention_and_block_equal_their_dense_pytorch_modules(kind, T_world, batch, seq, heads_k,
                                                                        head_dim, causal, sp, seed):
    T, world = T_world
    errors = [e for e in run(world, module_worker, kind, seed, T, batch, seq, heads_k, head_dim, causal, sp)
              if e is not None]
    assert errors and max(errors) < TOL, errors


def test_fresh_nn_parameters_in_a_sequence_parallel_block_keep_their_layouts():
    # the sharded q/k/v rows must still be all-gathered, the layer norms' and row biases' partial
    # gradients (each rank saw s/T tokens) still summed
    for world, T in [(3, 3), (4, 2)]:
        errors = [e for e in run(world, module_worker, "block", 11, T, 2, 2, 1, 2, True, True, True)
                  if e is not None]
        assert errors and max(errors) < TOL, (world, T, errors)


# ----- collectives, counted at torch.distributed -----

def count_worker(T, layers, sp):
    group, _ = tp_group(T)
    if group is None:
        return None
    b, s, h, heads = 2, 2 * T, 4 * T, T
    block = nn.Sequential(*[pt.ParallelTransformerBlock(h, heads, sequence_parallel=sp, group=group,
                                                        device=device()) for _ in range(layers)])
    return forward_backward_counted(block, torch.randn(b, s // T if sp else s, h, device=device(),
                                                       requires_grad=True))


@settings(max_examples=10)
@given(worlds_and_sizes, st.integers(1, 3), st.booleans())
def test_two_all_reduces_per_layer_each_way_or_their_reduce_scatter_all_gather_halves(T_world, layers, sp):
    T, world = T_world
    if T == 1:
        calls = [{}, {}]
    elif sp:  # backward gathers each column layer's input again instead of storing it (SP paper, 4.2.2)
        calls = [{"all_gather": 2 * layers, "reduce_scatter": 2 * layers},
                 {"all_gather": 4 * layers, "reduce_scatter": 2 * layers}]
    else:
        calls = [{"all_reduce": 2 * layers}] * 2
    D = 2 * (2 * T) * (4 * T) * 4  # every collective of a layer moves one [b, s, h] fp32 activation
    want = [(c, {k: n * D for k, n in c.items()}) for c in calls]
    assert set(DATA_COLLECTIVES) >= {k for c in calls for k in c}
    for result in run(world, count_worker, T, layers, sp):
        if result is not None:
            assert_counted(result, want)


# ----- activation memory -----

def activations_worker(T, b, s_k, heads_k, head_dim):
    """Bytes autograd keeps for backward: one rank alone (a group of one), TP, TP + SP."""
    group, _ = tp_group(T)
    if group is None:
        return None
    alone = [tp_group(1)[0]]
    heads, s = heads_k * T, s_k * T
    h = heads * head_dim
    kept = []
    for g, sp in [(alone[0], False), (group, False), (group, True)]:
        block = pt.ParallelTransformerBlock(h, heads, sequence_parallel=sp, group=g, device=device(), dtype=F64)
        x = torch.randn(b, s // T if sp else s, h, device=device(), dtype=F64, requires_grad=True)
        with SavedTensors(exclude=block.parameters()) as saved:
            block(x)
        kept.append(saved.bytes)
    return kept, (b, s, h, heads)


@settings(max_examples=6)
@given(worlds_and_sizes, st.integers(1, 2), st.integers(1, 3), st.integers(1, 2), st.integers(1, 3))
def test_sequence_parallel_keeps_one_tth_of_the_activations_and_tp_keeps_the_norms_whole(T_world, b, s_k,
                                                                                        heads_k, head_dim):
    T, world = T_world
    for result in run(world, activations_worker, T, b, s_k, heads_k, head_dim):
        if result is None:
            continue
        (one, tp_only, tp_sp), (b, s, h, heads) = result
        whole = 8 * (4 * b * s * h + 4 * b * s)  # layer-norm inputs and outputs, their mean and rstd
        if device().type == "cpu":  # the log-sum-exp term is the CPU attention kernel's
            assert one == whole + 8 * (12 * b * s * h + b * heads * s), (result, whole)
        assert tp_only * T == whole * T + (one - whole), result
        assert tp_sp * T == one, result


# ----- bad input and disagreeing ranks -----

def errors_worker():
    group, _ = tp_group(2)
    return error_messages([lambda: pt.ParallelAttention(9, 3, group=group),
                           lambda: pt.ParallelAttention(10, 4, group=group),
                           lambda: pt.ParallelAttention(8, 2, group=group)(torch.randn(2, 3, 6, device=device()))])


def test_bad_heads_and_shapes_raise_clear_errors_on_every_rank_without_blocking():
    assert_same_clear_errors(run(4, errors_worker), [
        "num_heads=3 is not divisible by the parallel size 2",
        "hidden=10 is not divisible by num_heads=4",
        "ParallelAttention expects inputs [..., 8], got (2, 3, 6)"])


BLOCK_CASES = {  # name: (world, layer on the whole pool, shape on every rank but 1, shape on rank 1, output after)
    "attention": (3, lambda: pt.ParallelAttention(6, 3, dtype=F64), (2, 3, 6), (3, 2, 6), (2, 3, 6)),
    "attention SP": (2, lambda: pt.ParallelAttention(4, 2, sequence_parallel=True, dtype=F64), (1, 2, 4),
                     (1, 3, 4), (1, 2, 4)),
    "block": (4, lambda: pt.ParallelTransformerBlock(8, 4, dtype=F64), (2, 3, 8), (2, 4, 8), (2, 3, 8)),
    "block SP": (5, lambda: pt.ParallelTransformerBlock(5, 5, sequence_parallel=True, dtype=F64), (1, 2, 5),
                 (2, 1, 5), (1, 2, 5)),
}


def block_disagreement_worker(case):
    _, build, good, bad, _ = BLOCK_CASES[case]
    torch.manual_seed(0)
    return provoke(build(), good, bad)


def test_a_rank_whose_input_shape_differs_is_named_on_every_rank_by_attention_and_the_block():
    for case, (world, _, good, bad, after) in BLOCK_CASES.items():
        assert_named_on_every_rank(run(world, block_disagreement_worker, case), "ParallelAttention", good, bad,
                                   after)


# ----- the demo's figures (and questions 11 and 12) hold whatever attention kernel SDPA picks -----

def figures_worker(kernel):
    """all_reduces_per_layer and sequence_parallel_savings on the whole pool, with SDPA left to choose its kernel
    (a flash kernel on the CPU) or held to the math kernel, the one CUDA runs in fp64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    T = dist.get_world_size()
    with sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext():
        block = pt.block_three_ways(2, 2 * T, 4 * T, 2 * T)
    return model_questions.all_reduces_per_layer(block), model_questions.sequence_parallel_savings(block)


@pytest.mark.parametrize("kernel", ["default", "math"])
def test_the_demos_activation_and_collective_figures_hold_with_any_attention_kernel(kernel):
    for world in (1, 3):
        for figure, holds in (f for result in run(world, figures_worker, kernel) for f in result):
            assert holds, (world, kernel, figure)
