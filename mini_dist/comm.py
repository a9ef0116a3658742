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

Why is the backward of an all-gather a split in one place and a reduce-scatter in another? If every rank
uses the gathered tensor the same way, every rank already holds the whole gradient and keeps its slice.
If each rank feeds it to its own shard of a layer, each holds only a partial sum of the gradient: the
pieces must be summed, and each rank keeps its slice of the sum, which is a reduce-scatter. f and g are
the same pair at the level of a sum: g's output y = sum_i y_i, so dy reaches every y_i unchanged.

The collectives themselves, along any dim, are mini_dist/collectives.py's: each counted in `COUNTER`
(calls and payload bytes per kind) and, with MINI_DIST_DEBUG=1, first agreed on across ranks (kit/debug.py):
a rank passing another shape is named on every rank, not a hang or a silently wrong sum. The all-to-alls of
Ulysses and MoE, whose backward is the reverse trip, are mini_dist/all_to_all.py's; every layer imports its
communication from here, those two included.

    torchrun --standalone --nproc_per_node=4 mini_dist/comm.py [--batch 2 --seq 2 --hidden 3]

Layout is batch-first, [batch, seq, hidden]: the sequence is dim 1 (Megatron keeps [seq, batch, hidden]).
Mirrors Megatron-LM's core/tensor_parallel/mappings.py; nanotron's distributed differentiable primitives.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.all_to_all import all_to_all, all_to_all_rows  # noqa: F401  (the layers import these from here)
from mini_dist.collectives import (COUNTER, all_gather, all_reduce,  # noqa: F401
                                   all_to_all_single, check_divisible, reduce_scatter, split)
from mini_dist.kit import launch
from mini_dist.kit.debug import Disagreement, agree  # noqa: F401  (the layers import these from here)

SEQ = 1  # the sequence dim of [batch, seq, hidden]


# ----- the differentiable operators: forward collective, conjugate backward -----

class CopyToParallelRegion(torch.autograd.Function):
    """f: forward identity (every rank needs all of x), backward all-reduce (each holds a partial dx)."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise: return x as it is (f's forward is the identity: every rank needs all of x), and keep on ctx
        #   what backward needs (it is given only ctx and the gradient).
        ctx.group = group
        return x
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        # exercise: return (dx, None): dx = dL/dx on every rank, L the sum of every rank's loss, grad this rank's
        #   own dL/dy (y = x everywhere, each rank's loss using its y its own way); None: group takes no gradient.
        #   Communicate with all_reduce(tensor, group) (a new tensor) or torch.distributed.all_reduce on a copy.
        return all_reduce(grad, ctx.group), None
        # end exercise


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: forward all-reduce of partial sums, backward identity (dy reaches every partial sum as is)."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise: return y, the sum over the group's ranks of every rank's x (each holds a partial result), the
        #   same on every rank, as a new tensor (x is autograd's: never change it in place). Communicate with
        #   all_reduce(tensor, group) or torch.distributed.all_reduce on a copy.
        return all_reduce(x, group)
        # end exercise

    @staticmethod
    def backward(ctx, grad):
        # exercise: return (dx, None): dx = dL/dx for this rank's x, given grad = dL/dy, y the sum of every rank's
        #   x (every rank computed its loss from that same y); None: group takes no gradient.
        return grad, None
        # end exercise


class Conjugate(torch.autograd.Function):
    """A layout change along `dim`: forward_op moves the tensor, backward_op, its conjugate, moves the gradient
    (the table above). Both are collectives.py's (tensor, dim, group) -> tensor."""

    @staticmethod
    def forward(ctx, x, dim, group, forward_op, backward_op):
        ctx.dim = dim
        ctx.group = group
        ctx.backward_op = backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


def f(x, group=None):
    return CopyToParallelRegion.apply(x, group)


def g(x, group=None):
    return ReduceFromParallelRegion.apply(x, group)


def gather_from_tp(x, group=None, dim=-1):
    """[.., n, ..] -> [.., T*n, ..]; every rank uses the whole the same way, so its gradient is whole: keep my slice."""
    return Conjugate.apply(x, dim, group, all_gather, split)


def split_to_tp(x, group=None, dim=-1):
    """[.., T*n, ..] -> [.., n, ..], my slice; the slices' gradients are gathered back into a whole one."""
    return Conjugate.apply(x, dim, group, split, all_gather)


def gather_from_sp(x, group=None, dim=SEQ):
    """[b, s/T, h] -> [b, s, h]; each rank feeds its own shard of a layer, so its gradient is a partial sum."""
    return Conjugate.apply(x, dim, group, all_gather, reduce_scatter)


def reduce_scatter_to_sp(x, group=None, dim=SEQ):
    """[b, s, h] partial sums -> [b, s/T, h] summed; the summed slices' gradients are gathered back."""
    return Conjugate.apply(x, dim, group, reduce_scatter, all_gather)


def split_to_sp(x, group=None, dim=SEQ):
    """A replicated input enters the sequence-parallel region: keep my s/T tokens."""
    return Conjugate.apply(x, dim, group, split, all_gather)


# ----------------------------------------------------------------------------- what each means in one process

# name: (the operator, what its input is, what its output is, the one-process meaning: every rank's output from
# everyone's inputs X). An input or output is "replicated" (the same on every rank, counted once), "shard" (rank
# r holds slice r of one tensor) or "own" (each rank's own: a partial sum, or a copy each rank uses its way).
CASES = {
    "f": (f, "replicated", "own", lambda X, T: [X[0]] * T),
    "g": (g, "own", "replicated", lambda X, T: [sum(X)] * T),
    "gather_from_tp": (gather_from_tp, "shard", "replicated", lambda X, T: [torch.cat(X, -1)] * T),
    "split_to_tp": (split_to_tp, "replicated", "shard", lambda X, T: list(X[0].chunk(T, -1))),
    "gather_from_sp": (gather_from_sp, "shard", "own", lambda X, T: [torch.cat(X, SEQ)] * T),
    "reduce_scatter_to_sp": (reduce_scatter_to_sp, "own", "shard", lambda X, T: list(sum(X).chunk(T, SEQ))),
}


def input_shape(name: str, b: int, s: int, h: int, T: int) -> tuple:
    """The full tensor is [b, s, h]; a shard input is its 1/T slice along the dim the operator gathers."""
    given = CASES[name][1]
    return (b, s, h // T) if name == "gather_from_tp" else (b, s // T, h) if given == "shard" else (b, s, h)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2, help="tokens per rank (the full sequence is seq x ranks)")
    p.add_argument("--hidden", type=int, default=3, help="hidden size per rank (the full one is hidden x ranks)")
    p.add_argument("--seed", type=int, default=0)
    return p


def drawn(seed: int, size) -> torch.Tensor:
    """Small integers in fp64, drawn on the CPU (the same numbers on any device): every sum exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, size, generator=g, dtype=torch.float64).to(launch.device())


def check_operator(name: str, shape, seed: int = 0, group=None) -> tuple[float, int]:
    """Run operator `name` on this rank's input and backpropagate this rank's output weights; then redo it
    in one process on everyone's inputs and weights, with autograd. Returns (largest difference of output or
    input gradient, payload bytes counted). Integer-valued fp64 data: every sum is exact in any order."""
    op, given, made, meaning = CASES[name]
    T = dist.get_world_size(group)
    r = dist.get_rank(group)
    x = drawn(seed * 100 + (0 if given == "replicated" else 1 + r), shape).requires_grad_()
    COUNTER.reset()
    y = op(x, group)
    w = drawn(seed * 100 + (50 if made == "replicated" else 51 + r), y.shape)  # replicated: one loss, every rank
    (y * w).sum().backward()
    nbytes = sum(COUNTER.bytes.values())
    xs = [torch.empty_like(x) for _ in range(T)]
    ws = [torch.empty_like(w) for _ in range(T)]
    dist.all_gather(xs, x.detach(), group=group)
    dist.all_gather(ws, w, group=group)
    X = [xs[0].requires_grad_()] * T if given == "replicated" else [t.requires_grad_() for t in xs]
    Y = meaning(X, T)
    loss = (Y[0] * ws[0]).sum() if made == "replicated" else sum((Yi * Wi).sum() for Yi, Wi in zip(Y, ws))
    loss.backward()
    return max((y - Y[r]).abs().max().item(), (x.grad - X[r].grad).abs().max().item()), nbytes


def demo(args) -> int:
    launch.require(min(args.batch, args.seq, args.hidden) >= 1, "--batch, --seq and --hidden must be >= 1")
    env = launch.setup()
    T = env.world_size
    b = args.batch
    s = args.seq * T
    h = args.hidden * T
    launch.print0(f"each operator against its one-process meaning (autograd on everyone's tensors), {T} ranks, "
                  f"full tensor [b, s, h] = [{b}, {s}, {h}]:\n  {'operator':<21}{'input':>10} -> {'output':<11}"
                  f"{'max diff':>9}  payload on this rank, B (formula)")
    D = b * s * h * 8
    worst = 0.0
    sizes_ok = True
    # what COUNTER records, forward + backward: D (the whole tensor) for each all-reduce, gather, reduce-scatter
    payload = {"f": D, "g": D, "gather_from_tp": D, "split_to_tp": D, "gather_from_sp": 2 * D,
               "reduce_scatter_to_sp": 2 * D}
    for name, (_, given, made, _) in CASES.items():
        diff, nbytes = check_operator(name, input_shape(name, b, s, h, T), args.seed)
        want = payload[name] if T > 1 else 0
        worst = max(worst, diff)
        sizes_ok = sizes_ok and nbytes == want
        launch.print0(f"  {name:<21}{given:>10} -> {made:<11}{diff:>9.0e}  {nbytes:>7,} B ({want:,})")
    return launch.conclude("comm", worst == 0.0, "every backward = conjugate collective, exact", sizes_ok,
                           f"payload bytes = formulas for {len(CASES)} operators")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
