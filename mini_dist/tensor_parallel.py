"""Tensor parallelism (Megatron-LM): split every weight matrix of a layer across T ranks, not the batch.

A linear layer Y = X A can be cut two ways. Column-parallel: A = [A_1 .. A_T] by output columns; rank i
computes Y_i = X A_i with no communication, but needs all of X. Row-parallel: A cut by input rows and X
by its last dim; rank i computes the partial sum X_i A_i, and Y = sum_i X_i A_i takes one all-reduce. An
MLP is column -> GeLU -> row: GeLU is elementwise, so it runs on each rank's columns and two matmuls cost
ONE all-reduce. Attention is cut by heads: Q, K, V column-parallel (each rank owns whole heads), output
projection row-parallel. Megatron names the two conjugate operators that do all the talking

    f: forward identity, backward all-reduce        g: forward all-reduce, backward identity

so a transformer layer (attention + MLP) holds 1/T of the weights per rank and communicates

    2 all-reduces forward + 2 backward, each of b*s*h elements (a ring sends 2(T-1)/T of that per rank).

Sequence parallelism (Korthikanti et al. 2022) cuts each all-reduce in its halves: reduce-scatter along the
sequence after a row-parallel layer, all-gather before a column-parallel one. Same bytes on the wire, but
layer norms and residuals (and dropout, in a real model) see s/T tokens; backward all-gathers each column
layer's input once more instead of keeping it, so every stored activation is 1/T of dense.
The vocabulary (embedding, cross-entropy) is split with the same operators: see vocab_parallel.py.

Layout is batch-first, [batch, seq, hidden], like nn.MultiheadAttention(batch_first=True).

Demo (a transformer block both ways: max diff, bytes per rank, collectives and bytes per layer):

    torchrun --standalone --nproc_per_node=4 mini_dist/tensor_parallel.py [--bench]

Mirrors: Megatron-LM's core/tensor_parallel (ColumnParallelLinear, RowParallelLinear); PyTorch's
torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel, SequenceParallel) does the same on DTensor.
"""
import copy
import sys
import time
from collections import Counter, namedtuple
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import launch  # noqa: E402

SEQ = 1  # the sequence dim of [batch, seq, hidden] (Megatron keeps [seq, batch, hidden] to gather dim 0)


class CollectiveCounter:
    """Collectives this rank issued, per kind, and their payload bytes: the whole tensor reduced or
    gathered (D in the ring formulas: all-reduce sends 2(T-1)/T*D per rank, all-gather and
    reduce-scatter (T-1)/T*D each). A group of one communicates nothing and counts nothing."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes = Counter(), Counter()

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()


COUNTER = CollectiveCounter()


def tp_size(group=None) -> int:
    if dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in this tensor-parallel group: build the layer "
                         "only on the ranks of the group you pass")
    return dist.get_world_size(group)


# ----- the raw collectives, along one dim (a sum needs none); every one of them goes through COUNTER -----

def _all_reduce(x, dim, group, op=dist.ReduceOp.SUM):
    if dist.get_world_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd may hold
    COUNTER.record("all_reduce", x)
    dist.all_reduce(x, op=op, group=group)
    return x


def _check_even(x, dim, T):
    if x.shape[dim] % T:
        raise ValueError(f"size {x.shape[dim]} along dim {dim} is not divisible by the tensor-parallel size "
                         f"{T}: pad it (sequence parallelism gives every rank s/T tokens)")


def _all_gather(x, dim, group):
    T = dist.get_world_size(group)
    if T == 1:
        return x
    x = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = x.new_empty((T * x.shape[0], *x.shape[1:]))
    COUNTER.record("all_gather", out)
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x, dim, group):
    T = dist.get_world_size(group)
    if T == 1:
        return x
    _check_even(x, dim, T)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // T, *x.shape[1:]))
    COUNTER.record("reduce_scatter", x)
    dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def _split(x, dim, group):
    _check_even(x, dim, dist.get_world_size(group))
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


def _identity(x, dim, group):
    return x


class _Conjugate(torch.autograd.Function):
    """One communication step with one job: `fwd` in forward, its conjugate `bwd` on the gradient."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, dim, group):
        ctx.bwd, ctx.dim, ctx.group = bwd, dim, group
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.dim, ctx.group), None, None, None, None


def _operator(fwd, bwd, dim):
    def op(x, group=None):
        return _Conjugate.apply(x, fwd, bwd, dim, group)
    return op


# Megatron's f and g, and their cousins, as (forward, backward, dim). A gather's backward is a split when
# the gathered tensor is used the same way on every rank (its gradient is already whole), and a
# reduce-scatter when it feeds a column-parallel layer (each rank holds a partial sum of the gradient).
f = _operator(_identity, _all_reduce, -1)                      # before a column-parallel layer
g = _operator(_all_reduce, _identity, -1)                      # after a row-parallel layer
gather_from_tp = _operator(_all_gather, _split, -1)            # ColumnParallelLinear(gather_output=True)
split_to_tp = _operator(_split, _all_gather, -1)               # RowParallelLinear(input_is_parallel=False)
gather_from_sp = _operator(_all_gather, _reduce_scatter, SEQ)  # SP, before a column layer (SP paper's g)
reduce_scatter_to_sp = _operator(_reduce_scatter, _all_gather, SEQ)  # SP, after a row layer (g-bar)
split_to_sp = _operator(_split, _all_gather, SEQ)              # a replicated input enters the SP region


class _SequenceGatherLinear(torch.autograd.Function):
    """F.linear(gather_from_sp(x)), except that backward gathers x AGAIN rather than keeping the full
    sequence (the SP paper's trick: only the 1/T shard stays in memory), then reduce-scatters grad x."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_all_gather(x, SEQ, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = _all_gather(x, SEQ, ctx.group).flatten(0, -2)
        grad_x = _reduce_scatter(grad @ weight, SEQ, ctx.group)  # sum the partial grads, keep my tokens
        grad_2d = grad.flatten(0, -2)
        return grad_x, grad_2d.T @ total, grad_2d.sum(0) if ctx.has_bias else None, None


def column_parallel_linear(x, weight, bias, group=None, sequence_parallel=False, gather_output=False):
    if sequence_parallel:
        y = _SequenceGatherLinear.apply(x, weight, bias, group)
    else:
        y = F.linear(f(x, group), weight, bias)
    return gather_from_tp(y, group) if gather_output else y


def row_parallel_linear(x, weight, bias, group=None, sequence_parallel=False, input_is_parallel=True):
    if not input_is_parallel:
        x = split_to_tp(x, group)
    partial = F.linear(x, weight)  # rank i holds X_i A_i; the sum over ranks is Y
    y = reduce_scatter_to_sp(partial, group) if sequence_parallel else g(partial, group)
    return y if bias is None else y + bias  # after the reduction, so the bias is added once, not T times


# ----- layers -----

def _check_divisible(what: str, n: int, T: int, fix: str) -> None:
    if n % T:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {T}: {fix}")


def _check_input(x, features: int, layer: nn.Module, sequence_parallel: bool) -> None:
    if x.dim() < 2 or x.shape[-1] != features:
        raise ValueError(f"{type(layer).__name__} expects inputs [..., {features}], got {tuple(x.shape)}")
    if sequence_parallel and x.dim() != 3:
        raise ValueError(f"sequence parallel needs [batch, seq/T, hidden] inputs, got {tuple(x.shape)}")


def _param(shape, tp_dim=None, tp_parts=1, sequence_parallel=False, bound=None, **kw):
    """A parameter tagged with how it is sharded: along tp_dim (a stacked [q; k; v] first cut into
    tp_parts), or replicated (tp_dim None). Replicated ones that see only a sequence shard under SP are
    tagged so allreduce_sequence_parallel_grads can sum their partial gradients."""
    p = nn.Parameter(torch.empty(shape, **kw))
    if bound:
        nn.init.uniform_(p, -bound, bound)
    else:
        nn.init.normal_(p)
    p.tp_dim, p.tp_parts, p.sequence_parallel = tp_dim, tp_parts, sequence_parallel
    return p


class ColumnParallelLinear(nn.Module):
    """nn.Linear with the output features split: rank i holds rows i*out/T.. of the weight and bias."""

    def __init__(self, in_features, out_features, bias=True, gather_output=False, sequence_parallel=False,
                 group=None, device=None, dtype=None):
        super().__init__()
        T = tp_size(group)
        _check_divisible("out_features", out_features, T, "pick a size that is a multiple of T")
        kw = dict(bound=in_features ** -0.5, device=device, dtype=dtype)  # nn.Linear's init range
        self.in_features, self.group = in_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = _param((out_features // T, in_features), 0, **kw)
        self.bias = _param((out_features // T,), 0, **kw) if bias else None

    def forward(self, x):
        _check_input(x, self.in_features, self, self.sequence_parallel)
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                      self.gather_output)


class RowParallelLinear(nn.Module):
    """nn.Linear with the input features split: rank i holds columns i*in/T.. of the weight; the bias is
    whole on every rank and added after the all-reduce."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, sequence_parallel=False,
                 group=None, device=None, dtype=None):
        super().__init__()
        T = tp_size(group)
        _check_divisible("in_features", in_features, T, "pick a size that is a multiple of T")
        kw = dict(bound=in_features ** -0.5, device=device, dtype=dtype)
        self.in_features, self.local_in, self.group = in_features, in_features // T, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = _param((out_features, in_features // T), 1, **kw)
        self.bias = _param((out_features,), sequence_parallel=sequence_parallel, **kw) if bias else None

    def forward(self, x):
        _check_input(x, self.local_in if self.input_is_parallel else self.in_features, self, False)
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                   self.input_is_parallel)


class ParallelMLP(nn.Sequential):
    """column-parallel -> GeLU -> row-parallel: one g forward, one f backward, for two matmuls. Its
    parameter names are those of nn.Sequential(nn.Linear, nn.GELU(), nn.Linear)."""

    def __init__(self, hidden, ffn_hidden=None, sequence_parallel=False, group=None, device=None, dtype=None):
        kw = dict(sequence_parallel=sequence_parallel, group=group, device=device, dtype=dtype)
        ffn_hidden = ffn_hidden or 4 * hidden
        super().__init__(ColumnParallelLinear(hidden, ffn_hidden, **kw), nn.GELU(),
                         RowParallelLinear(ffn_hidden, hidden, **kw))


class ParallelAttention(nn.Module):
    """Multi-head self-attention, each rank owning num_heads/T whole heads: its Q, K, V rows are column
    shards, attention runs locally, and the output projection is row-parallel. Parameter names are those
    of nn.MultiheadAttention (in_proj_weight = [W_q; W_k; W_v], out_proj)."""

    def __init__(self, hidden, num_heads, causal=False, sequence_parallel=False, group=None, device=None,
                 dtype=None):
        super().__init__()
        T = tp_size(group)
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        _check_divisible("num_heads", num_heads, T, "each rank must own whole heads: pick num_heads a "
                                                    "multiple of T, or a T that divides num_heads")
        kw = dict(device=device, dtype=dtype)
        self.hidden, self.local_heads, self.head_dim = hidden, num_heads // T, hidden // num_heads
        self.causal, self.sequence_parallel, self.group = causal, sequence_parallel, group
        self.in_proj_weight = _param((3 * hidden // T, hidden), 0, 3, bound=hidden ** -0.5, **kw)
        self.in_proj_bias = _param((3 * hidden // T,), 0, 3, bound=hidden ** -0.5, **kw)
        self.out_proj = RowParallelLinear(hidden, hidden, sequence_parallel=sequence_parallel, group=group,
                                          **kw)

    def forward(self, x):
        _check_input(x, self.hidden, self, self.sequence_parallel)
        qkv = column_parallel_linear(x, self.in_proj_weight, self.in_proj_bias, self.group,
                                     self.sequence_parallel)  # [b, s, 3 * local heads * head_dim]
        q, k, v = (t.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2) for t in qkv.chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # my heads only, no talking
        return self.out_proj(out.transpose(1, 2).flatten(2))


class TransformerBlock(nn.Module):
    """The dense reference, from PyTorch's own layers: pre-norm GPT block x + attn(ln1(x)) + mlp(ln2(.))."""

    def __init__(self, hidden, num_heads, causal=True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.causal = causal
        self.ln1 = nn.LayerNorm(hidden, **kw)
        self.attn = nn.MultiheadAttention(hidden, num_heads, batch_first=True, **kw)
        self.ln2 = nn.LayerNorm(hidden, **kw)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden, **kw), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden, **kw))

    def forward(self, x):
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        a = self.ln1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ParallelTransformerBlock(nn.Module):
    """TransformerBlock with attention and MLP tensor-parallel: 2 collectives forward, 2 backward (with
    SP: its input and output are [b, s/T, h] shards, layer norms and residuals work on s/T tokens)."""

    def __init__(self, hidden, num_heads, causal=True, sequence_parallel=False, group=None, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, group=group, device=device, dtype=dtype)
        self.ln1 = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.attn = ParallelAttention(hidden, num_heads, causal, **kw)
        self.ln2 = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.mlp = ParallelMLP(hidden, 4 * hidden, **kw)
        for p in [*self.ln1.parameters(), *self.ln2.parameters()]:
            p.sequence_parallel = sequence_parallel

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def allreduce_sequence_parallel_grads(module, group=None) -> None:
    """Under SP, layer norms and row-parallel biases see only s/T tokens per rank: sum their gradients
    over the group (one all-reduce for all of them) before the optimizer step."""
    params = [p for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if params:
        flat = _all_reduce(torch.cat([p.grad.flatten() for p in params]), -1, group)
        for p, grad in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(grad.view_as(p))


# ----- from dense to parallel and back -----

def shard(full, dim, parts=1, group=None):
    """This rank's slice of a full tensor along dim (a stacked [q; k; v] is cut into `parts` first)."""
    return _split(full.unflatten(dim, (parts, -1)), dim + 1, group).flatten(dim, dim + 1)


def gather(local, dim, parts=1, group=None):
    """The full tensor from every rank's slice: the inverse of shard (one all-gather)."""
    return _all_gather(local.unflatten(dim, (parts, -1)), dim + 1, group).flatten(dim, dim + 1)


def _pairs(parallel, dense):
    full = dict(dense.named_parameters())
    for name, p in parallel.named_parameters():
        if name not in full:
            raise ValueError(f"the dense module has no parameter {name!r}: build the parallel module "
                             f"with the same layout as {type(dense).__name__}")
        yield p, full[name]


@torch.no_grad()
def shard_from_dense(parallel, dense, group=None):
    """Copy this rank's shard of every parameter of `dense` (same names) into `parallel`; return it."""
    for p, full in _pairs(parallel, dense):
        dim = getattr(p, "tp_dim", None)  # layer norms are plain, replicated nn parameters
        local = full if dim is None else shard(full, dim, p.tp_parts, group)
        if local.shape != p.shape:
            raise ValueError(f"shard of shape {tuple(local.shape)} does not fit a parameter of shape "
                             f"{tuple(p.shape)}: were both modules built with the same sizes?")
        p.copy_(local)
    return parallel


@torch.no_grad()
def gather_to_dense(parallel, dense, group=None):
    """The inverse: all-gather every shard, and its gradient when there is one, into `dense`."""
    for p, full in _pairs(parallel, dense):
        dim = getattr(p, "tp_dim", None)
        whole = (lambda t: t) if dim is None else (lambda t: gather(t, dim, p.tp_parts, group))
        full.copy_(whole(p))
        full.grad = None if p.grad is None else whole(p.grad).clone()
    return dense


# ----- demo and bench -----

def saved_activation_bytes(module, x, grad) -> int:
    """Bytes autograd keeps from forward for backward, parameters excluded: the activation memory."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.data_ptr(), t.shape, t.stride()] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    out.backward(grad)
    return sum(saved.values())


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _my_part(sp):
    """This rank's part of a full [b, s, h] tensor: its s/T tokens under sequence parallelism, else all."""
    return (lambda t: t.chunk(dist.get_world_size(), SEQ)[dist.get_rank()]) if sp else (lambda t: t)


Layer = namedtuple("Layer", "fwd bwd params acts diff", defaults=[0.0])  # fwd, bwd: ({kind: calls}, bytes)


def _one_layer(block, dense, x, dy, sp, group):
    """Forward and backward of `block` on this rank's part of x (`dense` has run on all of x): what it
    communicates and keeps per rank, and its largest difference from dense (output, grad x, weight grads)."""
    mine = _my_part(sp)
    xin = mine(x.detach()).requires_grad_()
    COUNTER.reset()
    out = block(xin)
    fwd = dict(COUNTER.calls), sum(COUNTER.bytes.values())
    COUNTER.reset()
    out.backward(mine(dy))
    bwd = dict(COUNTER.calls), sum(COUNTER.bytes.values())
    allreduce_sequence_parallel_grads(block, group)
    gathered = gather_to_dense(block, copy.deepcopy(dense), group)
    pairs = [(out, mine(dense(x))), (xin.grad, mine(x.grad))]
    pairs += [(p.grad, q.grad) for p, q in zip(gathered.parameters(), dense.parameters())]
    diff = max((a - b).abs().max().item() for a, b in pairs)  # before a second backward adds to the grads
    return Layer(fwd, bwd, _nbytes(block.parameters()), saved_activation_bytes(block, xin, mine(dy)), diff)


def _row(name, layer, one) -> str:
    """One line of the demo's table: collectives each way, then bytes per rank and their share of T=1."""
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    talk = [" + ".join(f"{n} {short[k]}" for k, n in sorted(c.items())) + f" {nb / 1024:.0f} KiB" if c else "-"
            for c, nb in (layer.fwd, layer.bwd)]
    kept = [f"{v:,} 1/{ref / v:.2f}" if v else "less"
            for v, ref in ((layer.params, one.params), (layer.acts, one.acts))]
    return f"{name:9} {talk[0]:>20} {talk[1]:>20} {kept[0]:>17} {kept[1]:>17}"


def demo() -> int:
    env = launch.setup()
    T, rank, dev, f64 = env.world_size, env.rank, env.device, torch.float64
    b, s, h, heads = 2, 24, 96, 12  # 12 heads and 24 tokens split evenly for T = 1, 2, 3, 4
    alone = [launch.new_group([r]) for r in range(T)][rank]  # a group of one: the same layers, undivided
    if heads % T or s % T:
        launch.print0(f"the demo splits {heads} heads and {s} tokens: run it on 1, 2, 3 or 4 ranks")
        return launch.conclude("tensor_parallel", False, f"T={T} does not divide the demo", False, "")
    dense = TransformerBlock(h, heads, causal=True, device=dev, dtype=f64)
    x = torch.randn(b, s, h, device=dev, dtype=f64, requires_grad=True)
    dy = torch.randn(b, s, h, device=dev, dtype=f64)
    dense(x).backward(dy)
    one, tp, tp_sp = [
        _one_layer(shard_from_dense(ParallelTransformerBlock(h, heads, True, sp, group, dev, f64), dense, group),
                   dense, x, dy, sp, group) for group, sp in [(alone, False), (None, False), (None, True)]]
    worst = max(one.diff, tp.diff, tp_sp.diff)
    # The formulas. Every collective carries one [b, s, h] activation, D bytes: f and g are one all-reduce
    # per sublayer each way; SP does their reduce-scatter and all-gather halves, and its backward gathers
    # each column layer's input again. Layer norms and row biases stay whole, all else is cut T ways. SP
    # keeps 1/T of every activation; plain TP keeps layer-norm inputs and outputs whole, so only "less".
    D, total = b * s * h * 8, _nbytes(dense.parameters())
    whole = _nbytes([*dense.ln1.parameters(), *dense.ln2.parameters(), dense.attn.out_proj.bias,
                     dense.mlp[2].bias])
    talk = lambda **calls: (calls, D * sum(calls.values())) if T > 1 else ({}, 0)  # noqa: E731
    want_tp = Layer(talk(all_reduce=2), talk(all_reduce=2), whole + (total - whole) // T, None)
    want_sp = Layer(talk(all_gather=2, reduce_scatter=2), talk(all_gather=4, reduce_scatter=2), want_tp.params,
                    one.acts // T)
    figure_ok = (one.params == total and tp[:3] == want_tp[:3] and tp.acts <= one.acts
                 and tp_sp[:3] == want_sp[:3] and tp_sp.acts * T == one.acts)
    launch.print0(f"transformer block b={b} s={s} h={h} heads={heads} causal fp64, T={T}: "
                  f"max |parallel - dense| (output, grad x, all weight grads) = {worst:.1e}")
    launch.print0(f"{'per layer':9} {'forward':>20} {'backward':>20} {'params/rank':>17} {'activations/rank':>17}")
    for name, layer in [("T=1", one), ("TP", tp), ("formula", want_tp), ("TP+SP", tp_sp), ("formula", want_sp)]:
        launch.print0(_row(name, layer, one))
    launch.print0(f"D = b*s*h*8 B = {D / 1024:.0f} KiB per collective: a ring sends 2(T-1)/T*D per AR, (T-1)/T*D "
                  f"per AG or RS; both rows send {4 * (T - 1) / T * D / 1024:.0f} KiB/rank forward")
    if "--bench" in sys.argv:
        bench()
    return launch.conclude("tensor_parallel", worst < 1e-12, f"block = dense PyTorch ({worst:.0e})", figure_ok,
                           f"{sum(tp.fwd[0].values())}+{sum(tp.bwd[0].values())} AR/layer, "
                           f"SP activations 1/{one.acts / tp_sp.acts:.2f}")


def bench(b=4, s=192, h=384, steps=10) -> None:
    """ms per forward + backward of one MLP: dense on one rank, ours, torch.distributed.tensor.parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(launch.device().type, (dist.get_world_size(),))
    dense = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(launch.device())
    x = torch.randn(b, s, h, device=launch.device())
    reference, variants = dense(x).detach(), [("dense, one rank", dense, False)]
    for sp in (False, True):
        layout = Shard(SEQ) if sp else None  # None: DTensor's defaults, the whole sequence on every rank
        ours = shard_from_dense(ParallelMLP(h, sequence_parallel=sp, device=x.device), dense)
        variants += [(f"mini_dist TP{'+SP' * sp}", ours, sp),
                     (f"native TP{'+SP' * sp}", parallelize_module(copy.deepcopy(dense), mesh, {
                         "0": ColwiseParallel(input_layouts=layout), "2": RowwiseParallel(output_layouts=layout)}), sp)]
    launch.print0(f"\nbench: MLP h={h} ffn={4 * h}, b={b} s={s} fp32, T={dist.get_world_size()}, "
                  "forward + backward")
    for name, module, sp in variants:
        mine = _my_part(sp)
        out = module(mine(x))  # warm-up, and a check that every variant computes the same MLP
        out.sum().backward()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            module(mine(x)).sum().backward()
        if x.is_cuda:  # backward's kernels may still run: wait for them
            torch.cuda.synchronize()
        dist.barrier()
        launch.print0(f"  {name:<16} {(time.perf_counter() - start) / steps * 1e3:8.2f} ms   "
                      f"(max |out - dense| {(out - mine(reference)).abs().max():.0e})")


if __name__ == "__main__":
    raise SystemExit(demo())
