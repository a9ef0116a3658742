"""Collectives with gradients: the communication of tensor, sequence, context and expert parallelism.

A collective inside a model is part of the computation, so autograd must know its gradient. Each one
here is an explicit autograd function with one job, and its backward is the *conjugate* collective:

    name (function)                    forward                 backward                 used before/after
    f   CopyToParallelRegion           identity                all-reduce               a column-parallel layer
    g   ReduceFromParallelRegion       all-reduce              identity                 a row-parallel layer
    gather_from_tp                     all-gather (dim)        split (keep my slice)    gathered column output
    split_to_tp                        split (keep my slice)   all-gather               a row layer's whole input
    gather_from_sp                     all-gather (seq)        reduce-scatter (seq)     SP, a column layer
    reduce_scatter_to_sp               reduce-scatter (seq)    all-gather (seq)         SP, a row layer
    all_to_all                         all-to-all (a -> b)     all-to-all (b -> a)      Ulysses attention
    all_to_all_rows                    rows to their ranks     rows back to senders     MoE dispatch/combine

Why is the backward of an all-gather a split in one place and a reduce-scatter in another? If every rank
uses the gathered tensor the same way, every rank already holds the whole gradient and keeps its slice.
If each rank feeds it to its own shard of a layer, each holds only a partial sum of the gradient: the
pieces must be summed, and each rank keeps its slice of the sum, which is a reduce-scatter. f and g are
the same pair at the level of a sum: g's output y = sum_i y_i, so dy reaches every y_i unchanged.
An all-to-all only moves blocks between ranks (a permutation), and the gradient of a permutation is its
inverse: the same all-to-all with the roles of the two dims (or of the send and receive counts) swapped.

Every collective goes through `COUNTER` (calls and payload bytes per kind: the whole tensor reduced or
gathered, which is D in the ring formulas; for an all-to-all the bytes this rank sends to other ranks).
A group of one communicates nothing and counts nothing.

With MINI_DIST_DEBUG=1 every collective here is first agreed on (mini_dist/debug.py): a rank passing
another shape is named on every rank, instead of a hang or a silently wrong sum.

Layout is batch-first, [batch, seq, hidden]: the sequence is dim 1 (Megatron keeps [seq, batch, hidden]).
Mirrors Megatron-LM's core/tensor_parallel/mappings.py; nanotron's distributed differentiable primitives.
"""
import math
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/comm.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mini_dist.kit import launch
from mini_dist.kit.debug import Disagreement, agree  # noqa: F401  (every collective here is agreed on)

SEQ = 1  # the sequence dim of [batch, seq, hidden]


class CollectiveCounter:
    """Collectives this rank issued, per kind, and their payload bytes."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes = Counter(), Counter()

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes


COUNTER = CollectiveCounter()


def check_divisible(what: str, n: int, parts: int, fix: str) -> None:
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by the parallel size {parts}: {fix}")


# ----- the raw collectives, along one dim; every one of them is agreed on (debug) and counted -----

def all_reduce(x, group=None, op=dist.ReduceOp.SUM):
    if dist.get_world_size(group) == 1:
        return x
    agree("all_reduce", (tuple(x.shape), x.dtype, op), group)
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd may hold
    COUNTER.record("all_reduce", x.nbytes)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x, dim, group=None):
    T = dist.get_world_size(group)
    if T == 1:
        return x
    agree("all_gather", (tuple(x.shape), x.dtype, dim), group)
    x = x.movedim(dim, 0).contiguous()                  # [n, ...]: the collective concatenates along dim 0
    out = x.new_empty((T * x.shape[0], *x.shape[1:]))   # [T*n, ...]
    COUNTER.record("all_gather", out.nbytes)
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x, dim, group=None):
    T = dist.get_world_size(group)
    if T == 1:
        return x
    check_divisible(f"size along dim {dim}", x.shape[dim], T, "pad it (every rank keeps an equal slice)")
    agree("reduce_scatter", (tuple(x.shape), x.dtype, dim), group)
    x = x.movedim(dim, 0).contiguous()                  # [T*n, ...]
    out = x.new_empty((x.shape[0] // T, *x.shape[1:]))  # [n, ...]: my slice of the sum
    COUNTER.record("reduce_scatter", x.nbytes)
    dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def split(x, dim, group=None):
    """My slice of x along dim (no communication)."""
    T = dist.get_world_size(group)
    check_divisible(f"size along dim {dim}", x.shape[dim], T, "pad it (every rank keeps an equal slice)")
    return x.chunk(T, dim)[dist.get_rank(group)].contiguous()


def all_to_all_single(out, x, output_splits, input_splits, group=None):
    """The default transport of all_to_all_rows: torch's own all-to-all over rows (dim 0)."""
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


def _rows_all_to_all(x, send_counts, recv_counts, group, transport):
    """Rows [sum(send_counts), ...] -> [sum(recv_counts), ...]: the first send_counts[0] rows to rank 0..."""
    me = dist.get_rank(group)
    agree("all_to_all_rows", (tuple(x.shape[1:]), x.dtype), group)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row, even when x has none
    COUNTER.record("all_to_all", (sum(send_counts) - send_counts[me]) * row)
    return transport(out, x.contiguous(), list(recv_counts), list(send_counts), group)


def _equal_all_to_all(x, scatter_dim, gather_dim, group):
    """Cut x into T blocks along scatter_dim, send block j to rank j, concatenate what arrives along
    gather_dim: [.., S/T (gather), .., H (scatter), ..] -> [.., S (gather), .., H/T (scatter), ..]."""
    T = dist.get_world_size(group)
    check_divisible(f"size along dim {scatter_dim}", x.shape[scatter_dim], T,
                    "each rank must receive an equal block")
    agree("all_to_all", (tuple(x.shape), x.dtype, scatter_dim, gather_dim), group)
    blocks = x.movedim(scatter_dim, 0).unflatten(0, (T, -1)).contiguous()  # [T, H/T, ...]: block j -> rank j
    out = torch.empty_like(blocks)                                          # [T, H/T, ...]: block j <- rank j
    COUNTER.record("all_to_all", blocks.nbytes // T * (T - 1))
    dist.all_to_all_single(out, blocks, group=group)
    out = out.flatten(0, 1).movedim(0, scatter_dim)         # the received blocks, still stacked by source
    return torch.cat(out.chunk(T, scatter_dim), gather_dim)  # source j's block is slice j along gather_dim


# ----- the differentiable operators: forward collective, conjugate backward -----

class CopyToParallelRegion(torch.autograd.Function):
    """f: forward identity (every rank needs all of x), backward all-reduce (each holds a partial dx)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: forward all-reduce of partial sums, backward identity (dy reaches every partial sum as is)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromParallelRegion(torch.autograd.Function):
    """Forward all-gather along dim; backward keeps my slice of the (already whole) gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)          # [.., n, ..] -> [.., T*n, ..]

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.group), None, None


class ScatterToParallelRegion(torch.autograd.Function):
    """Forward keeps my slice along dim; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)               # [.., T*n, ..] -> [.., n, ..]

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward all-gather along dim; backward reduce-scatter (each rank holds a partial gradient)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)          # [b, s/T, h] -> [b, s, h]

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward reduce-scatter of partial sums along dim; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)      # [b, s, h] partial -> [b, s/T, h] summed

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class AllToAll(torch.autograd.Function):
    """Forward: scatter along scatter_dim, gather along gather_dim. Backward: the same with the dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        if dist.get_world_size(group) == 1:
            return x
        return _equal_all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_world_size(ctx.group) == 1:
            return grad, None, None, None
        return _equal_all_to_all(grad, ctx.dims[1], ctx.dims[0], ctx.group), None, None, None


class AllToAllRows(torch.autograd.Function):
    """Forward: rows to ranks by send_counts (uneven), receiving recv_counts. Backward: the reverse trip."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, transport):
        ctx.counts, ctx.group, ctx.transport = (send_counts, recv_counts), group, transport
        return _rows_all_to_all(x, send_counts, recv_counts, group, transport)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return _rows_all_to_all(grad, recv_counts, send_counts, ctx.group, ctx.transport), None, None, None, None


def f(x, group=None):
    return CopyToParallelRegion.apply(x, group)


def g(x, group=None):
    return ReduceFromParallelRegion.apply(x, group)


def gather_from_tp(x, group=None, dim=-1):
    return GatherFromParallelRegion.apply(x, dim, group)


def split_to_tp(x, group=None, dim=-1):
    return ScatterToParallelRegion.apply(x, dim, group)


def gather_from_sp(x, group=None, dim=SEQ):
    return GatherFromSequenceParallelRegion.apply(x, dim, group)


def reduce_scatter_to_sp(x, group=None, dim=SEQ):
    return ReduceScatterToSequenceParallelRegion.apply(x, dim, group)


def split_to_sp(x, group=None, dim=SEQ):
    """A replicated input enters the sequence-parallel region: keep my s/T tokens."""
    return ScatterToParallelRegion.apply(x, dim, group)


def all_to_all(x, scatter_dim, gather_dim, group=None):
    return AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_to_all_rows(x, send_counts, recv_counts, group=None, transport=all_to_all_single):
    """Rows of x to their ranks (send_counts[j] rows to rank j), with the reverse trip as gradient.
    `transport(out, x, output_splits, input_splits, group)` moves the rows: dist.all_to_all_single by
    default, or a point-to-point version (mini_dist.expert_parallel)."""
    return AllToAllRows.apply(x, tuple(send_counts), tuple(recv_counts), group, transport)


# ----- demo: every operator against the one-process computation it stands for -----

# name: (the operator, what its input is, what its output is, the one-process meaning). An input or output
# is "replicated" (the same on every rank, counted once), "shard" (rank r holds slice r of one tensor) or
# "own" (each rank's own tensor: a partial sum, or a copy that each rank uses differently).
CASES = {
    "f": (f, "replicated", "own", lambda X, T: [X[0]] * T),
    "g": (g, "own", "replicated", lambda X, T: [sum(X)] * T),
    "gather_from_tp": (gather_from_tp, "shard", "replicated", lambda X, T: [torch.cat(X, -1)] * T),
    "split_to_tp": (split_to_tp, "replicated", "shard", lambda X, T: list(X[0].chunk(T, -1))),
    "gather_from_sp": (gather_from_sp, "shard", "own", lambda X, T: [torch.cat(X, SEQ)] * T),
    "reduce_scatter_to_sp": (reduce_scatter_to_sp, "own", "shard", lambda X, T: list(sum(X).chunk(T, SEQ))),
    "all_to_all": (lambda x, grp: all_to_all(x, -1, SEQ, grp), "shard", "shard",
                   lambda X, T: list(torch.cat(X, SEQ).chunk(T, -1))),
}


def input_shape(name: str, b: int, s: int, h: int, T: int) -> tuple:
    """The full tensor is [b, s, h]; a shard input is its 1/T slice along the dim the operator gathers."""
    given = CASES[name][1]
    return (b, s, h // T) if name == "gather_from_tp" else (b, s // T, h) if given == "shard" else (b, s, h)


def check_operator(name: str, shape, seed: int = 0, group=None) -> tuple[float, int]:
    """Run operator `name` on this rank's input and backpropagate this rank's output weights; then redo it
    in one process on everyone's inputs and weights, with autograd. Returns (largest difference of output or
    input gradient, payload bytes counted). Integer-valued fp64 data: every sum is exact in any order."""
    op, given, made, meaning = CASES[name]
    T, r = dist.get_world_size(group), dist.get_rank(group)
    draw = lambda k, size: torch.randint(-8, 8, size, generator=torch.Generator().manual_seed(seed * 100 + k),  # noqa: E731
                                         dtype=torch.float64, device=launch.device())
    x = draw(0 if given == "replicated" else 1 + r, shape).requires_grad_()
    COUNTER.reset()
    y = op(x, group)
    w = draw(50 if made == "replicated" else 51 + r, y.shape)  # a replicated output: one loss, every rank
    (y * w).sum().backward()
    nbytes = sum(COUNTER.bytes.values())
    xs, ws = [torch.empty_like(x) for _ in range(T)], [torch.empty_like(w) for _ in range(T)]
    dist.all_gather(xs, x.detach(), group=group)
    dist.all_gather(ws, w, group=group)
    X = [xs[0].requires_grad_()] * T if given == "replicated" else [t.requires_grad_() for t in xs]
    Y = meaning(X, T)
    loss = (Y[0] * ws[0]).sum() if made == "replicated" else sum((Yi * Wi).sum() for Yi, Wi in zip(Y, ws))
    loss.backward()
    return max((y - Y[r]).abs().max().item(), (x.grad - X[r].grad).abs().max().item()), nbytes


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2, help="tokens per rank (the full sequence is seq x ranks)")
    p.add_argument("--hidden", type=int, default=3, help="hidden size per rank (the full one is hidden x ranks)")
    p.add_argument("--seed", type=int, default=0)
    return p


def demo(args) -> int:
    launch.require(min(args.batch, args.seq, args.hidden) >= 1, "--batch, --seq and --hidden must be >= 1")
    env = launch.setup()
    T = env.world_size
    b, s, h = args.batch, args.seq * T, args.hidden * T
    launch.print0(f"each operator against its one-process meaning (autograd on everyone's tensors), {T} ranks, "
                  f"full tensor [b, s, h] = [{b}, {s}, {h}]:\n  {'operator':<21}{'input':>10} -> {'output':<11}"
                  f"{'max diff':>9}  payload (formula)")
    worst, sizes_ok, D = 0.0, True, b * s * h * 8
    # what COUNTER records, forward + backward: D for each all-reduce, all-gather and reduce-scatter (the
    # whole tensor); (T-1)/T of the rank's slice for each all-to-all (what leaves the rank)
    payload = {"f": D, "g": D, "gather_from_tp": D, "split_to_tp": D, "gather_from_sp": 2 * D,
               "reduce_scatter_to_sp": 2 * D, "all_to_all": 2 * (T - 1) * D // T ** 2}
    for name, (_, given, made, _) in CASES.items():
        diff, nbytes = check_operator(name, input_shape(name, b, s, h, T), args.seed)
        want = payload[name] if T > 1 else 0
        worst, sizes_ok = max(worst, diff), sizes_ok and nbytes == want
        launch.print0(f"  {name:<21}{given:>10} -> {made:<11}{diff:>9.0e}  {nbytes:>7,} B ({want:,})")
    return launch.conclude("comm", worst == 0.0, "every backward = conjugate collective, exact", sizes_ok,
                           f"payload bytes = formulas for {len(CASES)} operators")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
