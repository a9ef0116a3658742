"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): cut every weight matrix of a layer across T ranks.

A linear layer Y = X A (A: [in, out]) can be cut two ways:

    column-parallel   A = [A_1 | .. | A_T]   rank i computes Y_i = X A_i    needs all of X; no communication
    row-parallel      A = [A_1; ..; A_T]     rank i computes X_i A_i        Y = sum_i X_i A_i: one all-reduce

Megatron's two conjugate operators (mini_dist/comm.py) do all the talking:

    f: forward identity, backward all-reduce    before a column layer (each rank holds a partial dX)
    g: forward all-reduce, backward identity    after a row layer (the sum of the partial products)

An MLP h -> 4h -> h on activations of D = b*s*h elements, what each step moves:

    naive:    both layers column-parallel, outputs gathered   forward all-gather 4D + D, backward all-reduce D + 4D
    Megatron: column -> GeLU -> row                           forward all-reduce D,      backward all-reduce D

GeLU is elementwise, so it runs on each rank's own 4h/T columns and the row layer takes them as they are.
A ring sends (T-1)/T of the payload per all-gather and 2(T-1)/T per all-reduce: per rank and step the
naive MLP sends 15(T-1)/T*D, Megatron's 4(T-1)/T*D (and naive computes GeLU on all 4h columns, T times).

sequence_parallel=True (Korthikanti et al. 2022; its lesson is in parallel_transformer.py) does each all-reduce
as its halves: a row layer reduce-scatters its output along the sequence, a column layer all-gathers its input
(again in backward, rather than keep it). Whole parameters that see s/T tokens (a row bias, layer norms) then
hold partial gradients, which tp_layout.allreduce_sequence_parallel_grads sums before the optimizer step. Which
slice of each parameter a rank holds, and the move between a dense module and its parallel twin: tp_layout.py.

Demo (the MLP both ways against nn.Sequential: max difference, collectives and bytes per rank):

    torchrun --standalone --nproc_per_node=4 mini_dist/tensor_parallel.py [--batch 2 --seq 24 --hidden 96]

Mirrors: Megatron-LM's core/tensor_parallel/layers.py (ColumnParallelLinear, RowParallelLinear); PyTorch's
torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel, SequenceParallel) does it on DTensor.
"""
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import flags, launch
from mini_dist.comm import (COUNTER, SEQ, agree, all_gather, check_divisible, f, g, gather_from_tp, reduce_scatter,
                            reduce_scatter_to_sp, split_to_tp)
from mini_dist.tp_layout import Layout, gather_to_dense, shard_from_dense


# ----- the idea: Megatron's MLP, column-parallel -> GeLU -> row-parallel (shapes for the MLP's h -> 4h -> h) -----

def column_parallel_linear(x, weight, bias, group=None):
    """Y_i = X A_i + b_i with my block of columns (weight: my [4h/T, h] rows of nn.Linear's [out, in]).
    Every rank needs all of X, and backward leaves each rank a partial dX: f sums them."""
    # exercise: return my out/T features of x W^T + b; x.grad all of dL/dx, alike on every rank. Use f/g, F.linear
    x = f(x, group)                      # (b, s, h), the same on every rank
    return F.linear(x, weight, bias)     # (b, s, h) @ (h, 4h/T) + (4h/T) -> (b, s, 4h/T)
    # end exercise


def row_parallel_linear(x, weight, bias, group=None):
    """Y = sum_i X_i A_i + b with my block of rows (weight: my [h, 4h/T] columns of nn.Linear's [out, in]):
    each rank's product is a partial sum, g all-reduces them; the bias is whole on every rank."""
    # exercise: return all of x W^T + b, [.., out], the same bits on every rank, from my in/T features of x and my
    #   columns of W; bias.grad all of dL/db (the bias counted once). Use f/g (comm's), F.linear
    partial = F.linear(x, weight)        # (b, s, 4h/T) @ (4h/T, h) -> (b, s, h): my X_i A_i
    y = g(partial, group)                # (b, s, h): sum_i X_i A_i, on every rank
    return y if bias is None else y + bias
    # end exercise


def naive_parallel_mlp(hidden, ffn_hidden=None, group=None, device=None, dtype=None) -> nn.Sequential:
    """The naive cut: both linears column-parallel, each output all-gathered so that the next layer sees
    all of it. Parameter names are those of nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)."""
    kw = dict(gather_output=True, group=group, device=device, dtype=dtype)
    ffn_hidden = ffn_hidden or 4 * hidden
    return nn.Sequential(ColumnParallelLinear(hidden, ffn_hidden, **kw), nn.GELU(),   # all-gather (b, s, 4h)
                         ColumnParallelLinear(ffn_hidden, hidden, **kw))              # all-gather (b, s, h)


class ParallelMLP(nn.Sequential):
    """Megatron's cut: column-parallel -> GeLU -> row-parallel, one f and one g for two matmuls; GeLU is
    elementwise, so it needs no one else's columns. Over the naive cut it buys 4(T-1)/T*D sent per rank for
    15(T-1)/T*D, and GeLU on 4h/T columns, not all 4h. Parameter names are those of the dense nn.Sequential."""

    def __init__(self, hidden, ffn_hidden=None, sequence_parallel=False, group=None, device=None, dtype=None):
        kw = dict(sequence_parallel=sequence_parallel, group=group, device=device, dtype=dtype)
        ffn_hidden = ffn_hidden or 4 * hidden
        super().__init__(ColumnParallelLinear(hidden, ffn_hidden, **kw), nn.GELU(),   # (b, s, 4h/T), no talk
                         RowParallelLinear(ffn_hidden, hidden, **kw))                 # g: (b, s, h)


# ----- the layers: nn.Linear's interface, my slice of its parameters -----

class ColumnParallelLinear(nn.Module):
    """nn.Linear with the output features cut: rank i holds rows i*out/T.. of the weight and bias."""

    def __init__(self, in_features, out_features, bias=True, gather_output=False, sequence_parallel=False,
                 group=None, device=None, dtype=None):
        super().__init__()
        T = tp_size(group)
        check_divisible("out_features", out_features, T, "pick a size that is a multiple of T")
        self.in_features = in_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.group = group
        self.weight = parameter((out_features // T, in_features), in_features ** -0.5, device, dtype)
        self.bias = parameter((out_features // T,), in_features ** -0.5, device, dtype) if bias else None
        self.tp_layout = {"weight": Layout(0), "bias": Layout(0)}

    def forward(self, x):
        check_input(self, x, self.in_features, self.sequence_parallel)
        linear = SequenceParallelColumnLinear.apply if self.sequence_parallel else column_parallel_linear
        y = linear(x, self.weight, self.bias, self.group)                 # (.., out/T)
        return gather_from_tp(y, self.group) if self.gather_output else y  # the naive way: (.., out)


class RowParallelLinear(nn.Module):
    """nn.Linear with the input features cut: rank i holds columns i*in/T.. of the weight; the bias is
    whole on every rank and added after the all-reduce."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, sequence_parallel=False,
                 group=None, device=None, dtype=None):
        super().__init__()
        T = tp_size(group)
        check_divisible("in_features", in_features, T, "pick a size that is a multiple of T")
        self.in_features = in_features
        self.local_in = in_features // T
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.group = group
        self.weight = parameter((out_features, in_features // T), in_features ** -0.5, device, dtype)
        self.bias = parameter((out_features,), in_features ** -0.5, device, dtype) if bias else None
        self.tp_layout = {"weight": Layout(1), "bias": Layout(partial_grad=sequence_parallel)}

    def forward(self, x):
        check_input(self, x, self.local_in if self.input_is_parallel else self.in_features)
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group)                                 # (.., in) -> (.., in/T)
        linear = sequence_parallel_row_linear if self.sequence_parallel else row_parallel_linear
        return linear(x, self.weight, self.bias, self.group)


# ----- sequence parallelism: each all-reduce as its reduce-scatter and all-gather halves -----

class SequenceParallelColumnLinear(torch.autograd.Function):
    """column_parallel_linear on my s/T tokens: F.linear(gather_from_sp(x)), except that backward gathers x
    AGAIN rather than keep the whole sequence (the SP paper's trick: only the 1/T shard stays in memory)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        ctx.has_bias = bias is not None
        return F.linear(all_gather(x, SEQ, group), weight, bias)  # (b, s/T, in) -> (b, s, in) -> (b, s, out/T)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = all_gather(x, SEQ, ctx.group).flatten(0, -2)      # (b*s, in), gathered again
        grad_x = reduce_scatter(grad @ weight, SEQ, ctx.group)   # sum the partial grads, keep my tokens
        grad_2d = grad.flatten(0, -2)                            # (b*s, out/T)
        grad_weight = grad_2d.T @ whole                          # (out/T, b*s) @ (b*s, in) -> (out/T, in)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def sequence_parallel_row_linear(x, weight, bias, group=None):
    """row_parallel_linear keeping my s/T tokens of the sum: a reduce-scatter along the sequence (for g)."""
    y = reduce_scatter_to_sp(F.linear(x, weight), group)  # (b, s, 4h/T) @ (4h/T, h) -> (b, s, h) -> (b, s/T, h)
    return y if bias is None else y + bias


# ----- the guards -----

def tp_size(group=None) -> int:
    if dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in this tensor-parallel group: build the layer "
                         "only on the ranks of the group you pass")
    return dist.get_world_size(group)


def parameter(shape, bound=None, device=None, dtype=None) -> nn.Parameter:
    """Uniform in [-bound, bound] (nn.Linear's range with bound = in_features**-0.5), else N(0, 1) (nn.Embedding)."""
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    return nn.init.uniform_(p, -bound, bound) if bound else nn.init.normal_(p)


def check_input(layer: nn.Module, x, features: int, sequence_parallel: bool = False) -> None:
    """Refuse an input this layer cannot take. MINI_DIST_DEBUG=1: first, every rank of the group compares
    shapes, so a rank that feeds another shape is named on every rank before any collective of the layer."""
    agree(type(layer).__name__, (tuple(x.shape), x.dtype), layer.group)
    if x.dim() < 2 or x.shape[-1] != features:
        raise ValueError(f"{type(layer).__name__} expects inputs [..., {features}], got {tuple(x.shape)}")
    if sequence_parallel and x.dim() != 3:
        raise ValueError(f"sequence parallel needs [batch, seq/T, hidden] inputs, got {tuple(x.shape)}")


# ----------------------------------------------------------------------------- demo

def parser():
    return flags.tokens(launch.demo_parser(__doc__), hidden=96, hidden_help="h; the MLP is h -> 4h -> h")


RING_SENDS = {"all_gather": 1, "all_reduce": 2}  # payloads of (T-1)/T that a ring sends per rank, per collective


def _tally(T):
    """What COUNTER counted since its reset, then reset: ({kind: calls}, payload B, B a ring sends per rank)."""
    ring = sum(RING_SENDS[kind] * (T - 1) / T * nbytes for kind, nbytes in COUNTER.bytes.items())
    counted = (dict(COUNTER.calls), sum(COUNTER.bytes.values()), ring)
    COUNTER.reset()
    return counted


def mlp_step_counted(build, b, s, h, group=None):
    """The dense MLP h -> 4h -> h and build(h), its parallel twin, forward and backward on the same fp64 [b, s, h]
    data: _tally() of forward, then of backward, then max |parallel - dense| over the output, grad x and the
    weight grads."""
    dev = launch.device()
    torch.manual_seed(b * s * h)  # every rank: the same dense MLP and the same data
    dense = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(dev, torch.float64)
    x, dy = torch.randn(2, b, s, h, device=dev, dtype=torch.float64)
    dense(x.requires_grad_()).backward(dy)
    mlp = shard_from_dense(build(h, group=group, device=dev, dtype=torch.float64), dense, group)
    xin = x.detach().requires_grad_()
    COUNTER.reset()
    out = mlp(xin)
    fwd = _tally(dist.get_world_size(group))
    out.backward(dy)
    bwd = _tally(dist.get_world_size(group))
    gathered = gather_to_dense(mlp, copy.deepcopy(dense), group)
    pairs = [(out, dense(x)), (xin.grad, x.grad)]
    pairs += [(p.grad, q.grad) for p, q in zip(gathered.parameters(), dense.parameters())]
    return fwd, bwd, max((a - c).abs().max().item() for a, c in pairs)


def demo(args) -> int:
    T = launch.env_world_size()
    b, s, h = flags.token_sizes(args)
    launch.require(h % T == 0, f"--hidden {h} cannot be cut into {T} equal slices: pick a multiple of {T}")
    launch.setup()
    D = b * s * h * 8  # bytes of one [b, s, h] fp64 activation: the formulas of the docstring
    want = {"naive": (({"all_gather": 2}, 5 * D), ({"all_reduce": 2}, 5 * D)),
            "Megatron": (({"all_reduce": 1}, D), ({"all_reduce": 1}, D))}
    launch.print0(f"MLP {h} -> {4 * h} -> {h}, b={b} s={s} fp64, T={T}; D = b*s*h*8 = {D:,} B, one activation\n"
                  f"{'per rank':9}{'forward: calls, payload':>26}  {'backward: calls, payload':>26}"
                  f"{'a ring sends, B':>17}   formula, B")
    worst = 0.0
    counted_ok = True
    sent = {}
    for name, build, k in [("naive", naive_parallel_mlp, 15), ("Megatron", ParallelMLP, 4)]:
        fwd, bwd, diff = mlp_step_counted(build, b, s, h)
        sent[name] = fwd[2] + bwd[2]
        worst = max(worst, diff)
        counted_ok &= (fwd[:2], bwd[:2]) == (want[name] if T > 1 else (({}, 0), ({}, 0)))
        talk = [" + ".join(f"{n} {kind}" for kind, n in c[0].items()) + f", {c[1] // D}D" if c[0] else "-"
                for c in (fwd, bwd)]
        launch.print0(f"{name:9}{talk[0]:>26}  {talk[1]:>26}{sent[name]:>17,.0f}   "
                      f"{k}(T-1)/T*D = {k * (T - 1) / T * D:,.0f}")
    launch.print0(f"max |parallel - dense| (output, grad x, weight grads) = {worst:.1e}")
    figure = (f"Megatron sends 1/{sent['naive'] / sent['Megatron']:.2f} of naive's bytes per rank (4 vs 15 "
              f"(T-1)/T*D)" if T > 1 else "one rank: nothing to send")
    return launch.conclude("tensor_parallel", worst < 1e-12, f"MLP = dense PyTorch ({worst:.0e})", counted_ok,
                           figure)


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
