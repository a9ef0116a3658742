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
hold partial gradients: `allreduce_sequence_parallel_grads` sums them before the optimizer step.

Each module records which slice of its parameters a rank holds (`tp_layout`, by name; not on the Parameter,
so a fresh nn.Parameter assigned to `.weight` keeps it): `shard_from_dense` and `gather_to_dense` use it to
move weights between a dense PyTorch module and its parallel twin.

Demo (the MLP both ways against nn.Sequential: max difference, collectives and bytes per rank):

    torchrun --standalone --nproc_per_node=4 mini_dist/tensor_parallel.py [--batch 2 --seq 24 --hidden 96]

Mirrors: Megatron-LM's core/tensor_parallel/layers.py (ColumnParallelLinear, RowParallelLinear); PyTorch's
torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel, SequenceParallel) does it on DTensor.
"""
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.comm import (COUNTER, SEQ, agree, all_gather, all_reduce, check_divisible, f, g,
                            gather_from_tp, reduce_scatter, reduce_scatter_to_sp, split, split_to_tp)


def column_parallel_linear(x, weight, bias, group=None, sequence_parallel=False, gather_output=False):
    """Y_i = X A_i + b_i: every rank needs all of X (f; under SP its input is gathered along the sequence)."""
    if sequence_parallel:
        y = _SequenceGatherLinear.apply(x, weight, bias, group)  # [b, s/T, in] -> [b, s, out/T]
    else:
        y = F.linear(f(x, group), weight, bias)                  # [.., in] -> [.., out/T]
    return gather_from_tp(y, group) if gather_output else y      # [.., out/T] -> [.., out]


def row_parallel_linear(x, weight, bias, group=None, sequence_parallel=False, input_is_parallel=True):
    """Y = sum_i X_i A_i + b: one all-reduce (g; under SP a reduce-scatter along the sequence)."""
    if not input_is_parallel:
        x = split_to_tp(x, group)                                # [.., in] -> [.., in/T]
    partial = F.linear(x, weight)                                # [.., in/T] -> [.., out]: rank i's X_i A_i
    y = reduce_scatter_to_sp(partial, group) if sequence_parallel else g(partial, group)
    return y if bias is None else y + bias  # after the sum, so the bias is added once, not T times


# ----- the layers, and where their parameters live -----

@dataclass(frozen=True)
class Layout:
    """Where a parameter lives on the TP group. dim: cut along it, rank i holding slice i (None: whole on
    every rank); parts: a stacked [W_q; W_k; W_v] is cut into its parts first, each rank holding a slice of
    each; partial_grad: whole, but each rank's gradient covers only its s/T tokens (sequence parallelism)."""
    dim: int | None = None
    parts: int = 1
    partial_grad: bool = False


def layouts(module: nn.Module) -> dict[str, Layout]:
    """{parameter name in module: Layout} from every submodule's `tp_layout`; a name absent is whole."""
    return {prefix + "." * bool(prefix) + name: layout for prefix, m in module.named_modules()
            for name, layout in getattr(m, "tp_layout", {}).items()}


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


class ColumnParallelLinear(nn.Module):
    """nn.Linear with the output features cut: rank i holds rows i*out/T.. of the weight and bias."""

    def __init__(self, in_features, out_features, bias=True, gather_output=False, sequence_parallel=False,
                 group=None, device=None, dtype=None):
        super().__init__()
        T = tp_size(group)
        check_divisible("out_features", out_features, T, "pick a size that is a multiple of T")
        self.in_features, self.group = in_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = parameter((out_features // T, in_features), in_features ** -0.5, device, dtype)
        self.bias = parameter((out_features // T,), in_features ** -0.5, device, dtype) if bias else None
        self.tp_layout = {"weight": Layout(0), "bias": Layout(0)}

    def forward(self, x):
        check_input(self, x, self.in_features, self.sequence_parallel)
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                      self.gather_output)


class RowParallelLinear(nn.Module):
    """nn.Linear with the input features cut: rank i holds columns i*in/T.. of the weight; the bias is
    whole on every rank and added after the all-reduce."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, sequence_parallel=False,
                 group=None, device=None, dtype=None):
        super().__init__()
        T = tp_size(group)
        check_divisible("in_features", in_features, T, "pick a size that is a multiple of T")
        self.in_features, self.local_in, self.group = in_features, in_features // T, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = parameter((out_features, in_features // T), in_features ** -0.5, device, dtype)
        self.bias = parameter((out_features,), in_features ** -0.5, device, dtype) if bias else None
        self.tp_layout = {"weight": Layout(1), "bias": Layout(partial_grad=sequence_parallel)}

    def forward(self, x):
        check_input(self, x, self.local_in if self.input_is_parallel else self.in_features)
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                   self.input_is_parallel)


def naive_parallel_mlp(hidden, ffn_hidden=None, group=None, device=None, dtype=None) -> nn.Sequential:
    """The naive cut: both linears column-parallel, each output all-gathered so that the next layer sees
    all of it. Parameter names are those of nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)."""
    kw = dict(gather_output=True, group=group, device=device, dtype=dtype)
    ffn_hidden = ffn_hidden or 4 * hidden
    return nn.Sequential(ColumnParallelLinear(hidden, ffn_hidden, **kw), nn.GELU(),   # gather [b, s, 4h]
                         ColumnParallelLinear(ffn_hidden, hidden, **kw))              # gather [b, s, h]


class ParallelMLP(nn.Sequential):
    """Megatron's cut: column-parallel -> GeLU -> row-parallel, one g forward and one f backward for two
    matmuls. Parameter names are those of nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)."""

    def __init__(self, hidden, ffn_hidden=None, sequence_parallel=False, group=None, device=None, dtype=None):
        kw = dict(sequence_parallel=sequence_parallel, group=group, device=device, dtype=dtype)
        ffn_hidden = ffn_hidden or 4 * hidden
        super().__init__(ColumnParallelLinear(hidden, ffn_hidden, **kw), nn.GELU(),   # [b, s, 4h/T], no talk
                         RowParallelLinear(ffn_hidden, hidden, **kw))                 # g: [b, s, h]


# ----- sequence parallelism: the all-reduce as reduce-scatter + all-gather -----

class _SequenceGatherLinear(torch.autograd.Function):
    """F.linear(gather_from_sp(x)), except that backward gathers x AGAIN rather than keeping the whole
    sequence (the SP paper's trick: only the 1/T shard stays in memory), then reduce-scatters grad x."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather(x, SEQ, group), weight, bias)  # [b, s/T, in] -> [b, s, in] -> [b, s, out/T]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = all_gather(x, SEQ, ctx.group).flatten(0, -2)      # [b*s, in], gathered again
        grad_x = reduce_scatter(grad @ weight, SEQ, ctx.group)   # sum the partial grads, keep my tokens
        grad_2d = grad.flatten(0, -2)                            # [b*s, out/T]
        return grad_x, grad_2d.T @ whole, grad_2d.sum(0) if ctx.has_bias else None, None


def allreduce_sequence_parallel_grads(module, group=None) -> None:
    """Under SP, layer norms and row-parallel biases see only s/T tokens per rank: sum their gradients over
    the group (one all-reduce for all of them) before the optimizer step."""
    named = dict(module.named_parameters())
    params = [named[n] for n, layout in layouts(module).items()
              if layout.partial_grad and n in named and named[n].grad is not None]
    if params:
        flat = all_reduce(torch.cat([p.grad.flatten() for p in params]), group)
        for p, grad in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(grad.view_as(p))


# ----- from dense to parallel and back -----

def _along(t, layout: Layout, collective, group):
    """split (my slice of a whole tensor) or all_gather (the whole from the slices) along the layout's dim;
    a stacked [q; k; v] is taken part by part, so that each rank holds a slice of each."""
    if layout.dim is None:
        return t
    d = layout.dim
    return collective(t.unflatten(d, (layout.parts, -1)), d + 1, group).flatten(d, d + 1)


def _pairs(parallel, dense):
    """(parallel parameter, its layout, the dense parameter of the same name), for every parameter."""
    full, where = dict(dense.named_parameters()), layouts(parallel)
    for name, p in parallel.named_parameters():
        if name not in full:
            raise ValueError(f"the dense module has no parameter {name!r}: build the parallel module "
                             f"with the same layout as {type(dense).__name__}")
        yield p, where.get(name, Layout()), full[name]


@torch.no_grad()
def shard_from_dense(parallel, dense, group=None):
    """Copy this rank's shard of every parameter of `dense` (same names) into `parallel`; return it."""
    for p, layout, full in _pairs(parallel, dense):
        local = _along(full, layout, split, group)
        if local.shape != p.shape:
            raise ValueError(f"shard of shape {tuple(local.shape)} does not fit a parameter of shape "
                             f"{tuple(p.shape)}: were both modules built with the same sizes?")
        p.copy_(local)
    return parallel


@torch.no_grad()
def gather_to_dense(parallel, dense, group=None):
    """The inverse: all-gather every shard, and its gradient when there is one, into `dense`."""
    for p, layout, full in _pairs(parallel, dense):
        whole = _along(p, layout, all_gather, group)
        if whole.shape != full.shape:
            raise ValueError(f"gathered shape {tuple(whole.shape)} does not fit the dense parameter of shape "
                             f"{tuple(full.shape)}: were both modules built with the same sizes?")
        full.copy_(whole)
        full.grad = None if p.grad is None else _along(p.grad, layout, all_gather, group).clone()
    return dense


# ----- demo -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--batch", type=int, default=2, help="b, sequences per batch")
    p.add_argument("--seq", type=int, default=24, help="s, tokens per sequence")
    p.add_argument("--hidden", type=int, default=96, help="h; the MLP is h -> 4h -> h")
    return p


def _counted(step, T):
    """step()'s result and what it issued: ({kind: calls}, payload bytes, bytes a ring sends per rank)."""
    COUNTER.reset()
    result = step()
    ring = {"all_gather": (T - 1) / T, "all_reduce": 2 * (T - 1) / T}  # sent per rank / payload
    return result, (dict(COUNTER.calls), sum(COUNTER.bytes.values()),
                    sum(ring[k] * n for k, n in COUNTER.bytes.items()))


def demo(args) -> int:
    T = launch.env_world_size()
    b, s, h = args.batch, args.seq, args.hidden
    launch.require(min(b, s, h) >= 1, "--batch, --seq and --hidden must be at least 1")
    launch.require(h % T == 0, f"--hidden {h} cannot be cut into {T} equal slices: pick a multiple of {T}")
    env = launch.setup()
    dev, f64 = env.device, torch.float64
    dense = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(dev, f64)
    x = torch.randn(b, s, h, device=dev, dtype=f64, requires_grad=True)  # setup() seeds every rank alike
    dy = torch.randn(b, s, h, device=dev, dtype=f64)
    dense(x).backward(dy)
    D = b * s * h * 8  # bytes of one [b, s, h] fp64 activation: the formulas of the docstring
    want = {"naive": (({"all_gather": 2}, 5 * D), ({"all_reduce": 2}, 5 * D)),
            "Megatron": (({"all_reduce": 1}, D), ({"all_reduce": 1}, D))}
    launch.print0(f"MLP {h} -> {4 * h} -> {h}, b={b} s={s} fp64, T={T}; D = b*s*h*8 B = {D / 1024:.0f} KiB\n"
                  f"{'':9}{'forward':>18}{'backward':>18}{'sent/rank':>12}  formula (ring)")
    worst, counted_ok, sent = 0.0, True, {}
    for name, build, k in [("naive", naive_parallel_mlp, 15), ("Megatron", ParallelMLP, 4)]:
        mlp = shard_from_dense(build(h, device=dev, dtype=f64), dense)
        xin = x.detach().requires_grad_()
        out, fwd = _counted(lambda: mlp(xin), T)
        _, bwd = _counted(lambda: out.backward(dy), T)
        sent[name] = fwd[2] + bwd[2]
        pairs = [(out, dense(x)), (xin.grad, x.grad)]
        pairs += [(p.grad, q.grad) for p, q in zip(gather_to_dense(mlp, copy.deepcopy(dense)).parameters(),
                                                   dense.parameters())]
        worst = max([worst] + [(a - c).abs().max().item() for a, c in pairs])
        counted_ok &= (fwd[:2], bwd[:2]) == (want[name] if T > 1 else (({}, 0), ({}, 0)))
        talk = [" + ".join(f"{n} {kind}" for kind, n in c[0].items()) + f" {c[1] / D:g}D" if c[0] else "-"
                for c in (fwd, bwd)]
        launch.print0(f"{name:9}{talk[0]:>18}{talk[1]:>18}{sent[name] / 1024:>8.0f} KiB  "
                      f"{k}(T-1)/T*D = {k * (T - 1) / T * D / 1024:.0f} KiB")
    launch.print0(f"max |parallel - dense| (output, grad x, weight grads) = {worst:.1e}")
    figure = (f"Megatron sends 1/{sent['naive'] / sent['Megatron']:.2f} of naive (4 vs 15 (T-1)/T*D)"
              if T > 1 else "one rank: nothing to send")
    return launch.conclude("tensor_parallel", worst < 1e-12, f"MLP = dense PyTorch ({worst:.0e})", counted_ok,
                           figure)


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
