"""The all-to-all with its gradient: Ulysses' sequence-to-heads reshuffle and MoE's token dispatch.

An all-to-all cuts every rank's tensor into T blocks and sends block j to rank j: each rank keeps 1/T of its
D bytes and sends the other (T-1)/T * D. It computes nothing, it only moves numbers: a permutation of the
whole tensor, and the gradient of a permutation is its inverse, the same all-to-all with the roles swapped:

    all_to_all(x, a, b)        forward: cut along dim a, block j to rank j, concatenate what arrives along b
                               backward: cut along b, block j back to rank j, concatenate along a
    all_to_all_rows(x, s, r)   forward: s[j] rows to rank j, r[j] rows from it (uneven: MoE's dispatch)
                               backward: r[j] rows back to rank j, s[j] from it (the reverse trip)

Ulysses (Jacobs et al. 2023) holds every head of a sequence shard, [b, s/T, H], and attention needs every
token of some heads, [b, s, H/T]: all_to_all(x, -1, 1) before attention, all_to_all(out, 1, -1) after
(ulysses.py). A mixture of experts sends each token to the rank of its expert and brings the outputs back
(expert_parallel.py). Each is an autograd function with one job, as Megatron's f and g are in comm.py, which
imports these two so that every layer takes its communication from one place. The collectives themselves are
mini_dist/collectives.py's: counted in COUNTER, agreed on across ranks under MINI_DIST_DEBUG=1.

    torchrun --standalone --nproc_per_node=4 mini_dist/all_to_all.py [--seq 2 --heads 2]

Mirrors DeepSpeed-Ulysses' _SeqAllToAll and Megatron-LM's _AllToAll (core/tensor_parallel/mappings.py).
"""
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.collectives import COUNTER, all_to_all_single, equal_all_to_all, rows_all_to_all
from mini_dist.kit import launch


class AllToAll(torch.autograd.Function):
    """Forward: scatter along scatter_dim, gather along gather_dim. Backward: the same with the dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return equal_all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return equal_all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class AllToAllRows(torch.autograd.Function):
    """Forward: rows to ranks by send_counts (uneven), receiving recv_counts. Backward: the reverse trip."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group, transport):
        ctx.counts = (send_counts, recv_counts)
        ctx.group = group
        ctx.transport = transport
        return rows_all_to_all(x, send_counts, recv_counts, group, transport)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return rows_all_to_all(grad, recv_counts, send_counts, ctx.group, ctx.transport), None, None, None, None


def all_to_all(x, scatter_dim, gather_dim, group=None):
    return AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_to_all_rows(x, send_counts, recv_counts, group=None, transport=None):
    """Rows of x to their ranks (send_counts[j] rows to rank j), with the reverse trip as gradient.
    `transport(out, x, output_splits, input_splits, group)` moves the rows: dist.all_to_all_single by
    default (collectives.all_to_all_single), or a point-to-point version (mini_dist.expert_parallel)."""
    return AllToAllRows.apply(x, tuple(send_counts), tuple(recv_counts), group, transport or all_to_all_single)


# ----------------------------------------------------------------------------- against one process


def everyones(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's t (the same shape on each), in rank order: the one-process view."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


class Trip(NamedTuple):
    """What ulysses_round_trip saw on this rank."""
    before: torch.Tensor  # [2, seq, T*heads]: my tokens, every head, each number 1000 * token + head
    after: torch.Tensor   # [2, T*seq, heads]: every token, my heads
    forward_ok: bool      # after = the one-process permutation
    backward_ok: bool     # the gradient = the inverse permutation of the weights
    nbytes: int           # payload counted, forward and backward


def ulysses_round_trip(seq: int, heads: int, seed: int = 0, group=None) -> Trip:
    """Rank r's tokens [r*seq, (r+1)*seq) of all T*heads heads through all_to_all(x, -1, 1), back-propagated
    with random weights, both checked against the one-process permutation of everyone's tensors."""
    T = dist.get_world_size(group)
    r = dist.get_rank(group)
    token = torch.arange(r * seq, (r + 1) * seq, dtype=torch.float64, device=launch.device()).view(1, seq, 1)
    head = torch.arange(T * heads, dtype=torch.float64, device=launch.device()).view(1, 1, -1)
    x = (1000 * token + head).repeat(2, 1, 1)
    x.requires_grad_()
    COUNTER.reset()
    y = all_to_all(x, -1, 1)
    g = torch.Generator().manual_seed(seed * 100 + r)  # drawn on the CPU: the same numbers on any device
    w = torch.randint(-8, 8, y.shape, generator=g, dtype=torch.float64).to(y.device)
    (y * w).sum().backward()
    xs = everyones(x.detach(), group)
    ws = everyones(w, group)
    arrived = torch.cat([xj.chunk(T, -1)[r] for xj in xs], 1)    # rank j's tokens, my heads, in rank order
    returned = torch.cat([wj.chunk(T, 1)[r] for wj in ws], -1)   # every rank's weights for my tokens
    nbytes = COUNTER.bytes["all_to_all"]
    return Trip(x.detach(), y.detach(), torch.equal(y, arrived), torch.equal(x.grad, returned), nbytes)


def rows_round_trip(group=None) -> bool:
    """Rank r sends (r + j) % 3 rows to rank j (uneven, some none), each row 1000 * r + its index: the rows
    arrive grouped by sender in rank order, and weighting each by itself sends its own value back as gradient."""
    T = dist.get_world_size(group)
    r = dist.get_rank(group)
    sent = [(r + j) % 3 for j in range(T)]
    table = everyones(torch.tensor(sent, device=launch.device()), group)
    received = [int(table[j][r]) for j in range(T)]
    rows = 1000.0 * r + torch.arange(sum(sent), dtype=torch.float64, device=launch.device()).view(-1, 1)
    rows.requires_grad_()
    out = all_to_all_rows(rows, sent, received, group)
    (out * out.detach()).sum().backward()
    senders = torch.cat([torch.full((k, 1), float(j)) for j, k in enumerate(received)]).to(out.device)
    return torch.equal(out.detach() // 1000, senders) and torch.equal(rows.grad, rows.detach())


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--seq", type=int, default=2, help="tokens per rank (the sequence is seq x ranks)")
    p.add_argument("--heads", type=int, default=2, help="heads per rank after the all-to-all (H = heads x ranks)")
    return p


def held(t: torch.Tensor) -> str:
    """Which tokens and heads a tensor of 1000 * token + head holds, in words."""
    tokens = (t // 1000).unique().long().tolist()
    heads = (t % 1000).unique().long().tolist()
    return f"tokens {tokens[0]}-{tokens[-1]} of heads {heads[0]}-{heads[-1]}"


def demo(args) -> int:
    launch.require(min(args.seq, args.heads) >= 1, "--seq and --heads must be at least 1")
    env = launch.setup()
    T = env.world_size
    trip = ulysses_round_trip(args.seq, args.heads)
    pictures = [None] * T
    dist.all_gather_object(pictures, f"{held(trip.before)} -> {held(trip.after)}")
    launch.print0(f"all_to_all(x, -1, 1) on {T} ranks, x = [2, tokens, heads], each number 1000 * token + head:")
    for rank, picture in enumerate(pictures):
        launch.print0(f"  rank {rank}: {picture}")
    D = trip.before.nbytes
    want = 2 * (T - 1) * D // T  # (T-1)/T of the rank's tensor leaves it, forward and again backward
    rows_ok = rows_round_trip()
    launch.print0(f"= the one-process permutation: {trip.forward_ok}; gradient = the inverse one: {trip.backward_ok}; "
                  f"payload counted {trip.nbytes:,} B, 2(T-1)/T * D = {want:,} B\nall_to_all_rows, uneven rows to "
                  f"their ranks and each row's gradient back to it: {rows_ok}")
    return launch.conclude("all_to_all", trip.forward_ok and trip.backward_ok and rows_ok, "= one process's "
                           "permutation, gradient = its inverse", trip.nbytes == want, "payload 2(T-1)/T D, both ways")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
