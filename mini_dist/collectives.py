"""Collectives along one dim of a tensor, each agreed on across ranks (debug mode) and counted.

torch's collectives work on whole flat buffers: all_gather_single concatenates along dim 0, reduce_scatter_single
splits along dim 0. A layer wants them along any dim (the hidden dim of a column-parallel output, the sequence
dim under sequence parallelism), so each function here moves that dim to the front, calls the collective, and
moves it back. With T ranks and a tensor of D bytes:

    all_reduce(x)            every rank gets the sum                    counted: D
    all_gather(x, dim)       every rank gets the T slices, concatenated counted: T * D (the whole output)
    reduce_scatter(x, dim)   rank r gets slice r of the sum             counted: D (the whole input)
    split(x, dim)            rank r keeps slice r                       no communication
    equal_all_to_all(x, a, b) block j along a to rank j, concatenated along b   counted: (T-1)/T * D
    rows_all_to_all(x, s, r)  s[j] rows to rank j, r[j] from it (uneven)      counted: the rows that leave

COUNTER (the kit's one ledger, kit/wire.py's LEDGER, which also counts every message) records calls and payload
bytes per kind, the figure the ring formulas call D; a group of one communicates nothing and counts nothing.
Under MINI_DIST_DEBUG=1 each is first agreed on (kit/debug.py).
mini_dist/comm.py wraps them in autograd functions, each backward the conjugate collective (the all-to-alls:
mini_dist/all_to_all.py). The demo checks each against its one-process meaning and COUNTER against the formulas:

    torchrun --standalone --nproc_per_node=4 mini_dist/collectives.py [--rows 2]

Mirrors torch.distributed's all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single.
"""
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.kit.debug import agree
from mini_dist.kit.wire import LEDGER, collective

COUNTER = LEDGER  # .calls[kind], .bytes[kind]: collectives issued and their payload, beside every message


def check_divisible(what: str, n: int, parts: int, fix: str) -> None:
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by the parallel size {parts}: {fix}")


def all_reduce(x, group=None, op=dist.ReduceOp.SUM):
    if dist.get_world_size(group) == 1:
        return x
    agree("all_reduce", (tuple(x.shape), x.dtype, op), group)
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor autograd may hold
    with collective("all_reduce", x.nbytes, group):
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x, dim, group=None):
    T = dist.get_world_size(group)
    if T == 1:
        return x
    agree("all_gather", (tuple(x.shape), x.dtype, dim), group)
    x = x.movedim(dim, 0).contiguous()                  # [n, ...]: the collective concatenates along dim 0
    out = x.new_empty((T * x.shape[0], *x.shape[1:]))   # [T*n, ...]
    with collective("all_gather", out.nbytes, group):
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
    with collective("reduce_scatter", x.nbytes, group):
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


def rows_all_to_all(x, send_counts, recv_counts, group, transport):
    """Rows [sum(send_counts), ...] -> [sum(recv_counts), ...]: the first send_counts[0] rows to rank 0..."""
    me = dist.get_rank(group)
    agree("all_to_all_rows", (tuple(x.shape[1:]), x.dtype), group)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row, even when x has none
    with collective("all_to_all", (sum(send_counts) - send_counts[me]) * row, group):
        return transport(out, x.contiguous(), list(recv_counts), list(send_counts), group)


def equal_all_to_all(x, scatter_dim, gather_dim, group=None):
    """Cut x into T blocks along scatter_dim, send block j to rank j, concatenate what arrives along
    gather_dim: [.., S/T (gather), .., H (scatter), ..] -> [.., S (gather), .., H/T (scatter), ..]."""
    T = dist.get_world_size(group)
    if T == 1:
        return x
    check_divisible(f"size along dim {scatter_dim}", x.shape[scatter_dim], T,
                    "each rank must receive an equal block")
    agree("all_to_all", (tuple(x.shape), x.dtype, scatter_dim, gather_dim), group)
    blocks = x.movedim(scatter_dim, 0).unflatten(0, (T, -1)).contiguous()  # [T, H/T, ...]: block j -> rank j
    out = torch.empty_like(blocks)                                          # [T, H/T, ...]: block j <- rank j
    with collective("all_to_all", blocks.nbytes // T * (T - 1), group):
        dist.all_to_all_single(out, blocks, group=group)
    out = out.flatten(0, 1).movedim(0, scatter_dim)         # the received blocks, still stacked by source
    return torch.cat(out.chunk(T, scatter_dim), gather_dim)  # source j's block is slice j along gather_dim


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--rows", type=int, default=2, help="rows per rank and block: each rank holds [T*rows, 3] fp64")
    return p


def demo(args) -> int:
    launch.require(args.rows >= 1, f"--rows must be at least 1, got {args.rows}")
    env = launch.setup()
    T = env.world_size
    r = env.rank
    g = torch.Generator().manual_seed(r)
    x = torch.randint(-8, 8, (T * args.rows, 3), generator=g, dtype=torch.float64).to(env.device)  # exact sums
    everyone = [torch.empty_like(x) for _ in range(T)]
    dist.all_gather(everyone, x)
    total = sum(everyone)
    COUNTER.reset()
    cases = {"all_reduce": (all_reduce(x), total),
             "all_gather dim 0": (all_gather(x, 0), torch.cat(everyone, 0)),
             "all_gather dim 1": (all_gather(x, 1), torch.cat(everyone, 1)),
             "reduce_scatter dim 0": (reduce_scatter(x, 0), total.chunk(T, 0)[r]),
             "split dim 0": (split(x, 0), x.chunk(T, 0)[r]),
             "equal_all_to_all 0 -> 1": (equal_all_to_all(x, 0, 1), torch.cat([e.chunk(T, 0)[r] for e in everyone], 1))}
    same = all(torch.equal(ours, want) for ours, want in cases.values())
    launch.print0(f"on {T} ranks, x = [{T * args.rows}, 3] fp64 per rank: " + ", ".join(
        f"{k} {'=' if torch.equal(*v) else 'DIFFERENT'}" for k, v in cases.items()))
    D = x.nbytes
    want = {"all_reduce": D, "all_gather": 2 * T * D, "reduce_scatter": D, "all_to_all": (T - 1) * D // T}
    want = {k: v for k, v in want.items() if T > 1}
    launch.print0(f"COUNTER, bytes this rank counted (formula), D = {D:,} B: " + ", ".join(
        f"{k} {COUNTER.bytes[k]:,} ({v:,})" for k, v in want.items()))
    return launch.conclude("collectives", same, "each = its one-process meaning, exactly", dict(COUNTER.bytes) == want,
                           "COUNTER's bytes = formulas")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
