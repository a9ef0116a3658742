"""Topology: which all-reduce wins depends on the message size and on which links carry the bytes.

Ranks inside a node talk over fast links (NVLink), nodes over a network about ten times slower. Take N ranks
in n nodes of G ranks each (N = nG, node = rank // G) and D bytes to all-reduce. The alpha-beta model
(mini_dist/alpha_beta.py) prices a message of b bytes at alpha + b * beta, a step at its slowest message:

    algorithm            steps             bytes sent per rank    bytes per rank on a slow link
    ring                 2(N-1)            2(N-1)/N D             2(N-1)/N D (a rank at a node boundary)
    hierarchical         2(G-1) + 2(n-1)   2(N-1)/N D             2(n-1)/n D/G
    recursive doubling   log2 N            log2 N * D             D per step that leaves the node
    halving-doubling     2 log2 N          2(N-1)/N D             as hierarchical, nearest partners first

The ring is bandwidth-optimal but pays 2(N-1) latencies, and every step waits for a slow link. The
hierarchical all-reduce (reduce-scatter inside each node, all-reduce of the 1/G shard across nodes,
all-gather inside the node; NCCL's trees and Horovod's hierarchical mode) sends the same bytes with fewer
latencies, and only 1/G of them between nodes. Recursive doubling (log2 N exchanges of the whole vector)
takes the fewest steps and wins for small messages; Rabenseifner's halving-doubling (Thakur, Rabenseifner
& Gropp 2005) takes 2 log2 N steps with the ring's bytes. N not a power of two: the first 2r ranks fold in
pairs, N = p + r, the odd rank of a pair carries both, and gets the result back at the end (+2 steps of D).

The demo runs them on alpha_beta's `Links`, which sort the bytes of every send by link kind and put a
SIMULATED slow link between nodes (there is no second machine here): it checks the bytes against the
schedules, fits alpha and beta with ping-pongs, predicts every algorithm at every size, and measures them:

    torchrun --standalone --nproc_per_node=4 mini_dist/topology.py [--ranks-per-node 2] [--slow-link-us 300]
Mirrors what dist.all_reduce does inside NCCL (ring or tree by size) and gloo (ring, halving-doubling).
"""
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/topology.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.alpha_beta import Links, crossovers, fitted_links, link_bytes, predict, real_rank, schedule, winners
from mini_dist.kit import launch
from mini_dist.kit.debug import check_collective
from mini_dist.kit.timing import median, timed
from mini_dist.kit.wire import send_recv
from mini_dist.ring_allreduce import AVG, SUM, reduce_into
from mini_dist.ring_pipelined import ring_all_gather, ring_all_reduce, ring_reduce_scatter

# ----------------------------------------------------------------------------- hierarchical: the ring, twice

_groups: dict = {}  # (global ranks of the group, G) -> {rank: (its node's group, its inter-node group)}


def node_groups(ranks_per_node: int, ranks=None) -> tuple | None:
    """Make the node groups (G consecutive ranks) and inter-node groups (the rank with the same local index
    on every node) of the group of global `ranks` (None: the world). Like dist.new_group, every rank of
    the world calls it, members or not; the world's own are made on first use. Returns mine (or None)."""
    ranks = tuple(range(dist.get_world_size()) if ranks is None else ranks)
    G = ranks_per_node
    N = len(ranks)
    if (ranks, G) not in _groups:
        if G < 1 or N % G:
            raise ValueError(f"ranks_per_node={G} does not divide the {N} ranks into equal nodes; "
                             f"use one of {[g for g in range(1, N + 1) if N % g == 0]}")
        nodes = [launch.new_group(ranks[i:i + G]) for i in range(0, N, G)]
        crosses = [launch.new_group(ranks[j::G]) for j in range(G)]
        _groups[ranks, G] = {rank: (nodes[i // G], crosses[i % G]) for i, rank in enumerate(ranks)}
    return _groups[ranks, G].get(dist.get_rank())


def hierarchical_all_reduce(tensor: torch.Tensor, ranks_per_node: int, op=SUM, group=None) -> torch.Tensor:
    """In place, like dist.all_reduce: reduce-scatter in the node, all-reduce the shard across nodes, gather."""
    check_collective(tensor, op, group, "hierarchical_all_reduce", f" ranks_per_node {ranks_per_node}")
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    if ranks is not None and (ranks, ranks_per_node) not in _groups:
        raise ValueError(f"hierarchical_all_reduce on a subgroup: first call topology.node_groups"
                         f"({ranks_per_node}, {list(ranks)}) on every rank of the world (as dist.new_group)")
    intra, inter = node_groups(ranks_per_node, ranks)
    G = ranks_per_node
    numel = tensor.numel()
    reduce_op = SUM if op == AVG else op                 # AVG: summed here, divided once in _finish
    S = -(-numel // G)                                   # each rank of a node owns S elements
    flat = tensor.reshape(-1).contiguous()               # [numel], the tensor itself when contiguous
    padded = flat if numel == G * S else torch.cat([flat, flat.new_zeros(G * S - numel)])  # [G*S]
    shard = padded.new_empty(S)                          # [S]: my 1/G
    ring_reduce_scatter(shard, padded, reduce_op, group=intra)  # fast links: (G-1)/G of the tensor
    ring_all_reduce(shard, reduce_op, group=inter)              # slow links: only the 1/G shard
    ring_all_gather(padded, shard, group=intra)                 # fast links again
    return _finish(tensor, padded[:numel], op, group)


def _finish(tensor, flat, op, group) -> torch.Tensor:
    """AVG divides once, at the end; a non-contiguous tensor (reduced in a copy) gets the result back."""
    if op == AVG:
        flat.div_(dist.get_world_size(group))
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


# ----------------------------------------------------------------------------- doubling: log2 N steps
# (each exchange with a partner is one send_recv: one batch_isend_irecv, which NCCL cannot order apart)

def _fold(flat, op, group, name):
    """N = p + r with p a power of two: rank 2i hands its vector to rank 2i+1 for i < r. Returns
    (my rank among the p that go on, or None if I wait; p; r). Virtual rank v is real rank real_rank(v, r)."""
    N = dist.get_world_size(group)
    me = dist.get_rank(group)
    p = 1 << (N.bit_length() - 1)
    r = N - p
    if me < 2 * r and me % 2 == 0:
        send_recv(flat, me + 1, None, me + 1, group, name)
        return None, p, r
    if me < 2 * r:
        incoming = torch.empty_like(flat)
        send_recv(None, me - 1, incoming, me - 1, group, name)
        reduce_into(flat, incoming, op)
        return me // 2, p, r
    return me - r, p, r


def _unfold(flat, v, r, group, name) -> None:
    """The fold undone: rank 2i+1 hands the result back to rank 2i, which waited, for i < r."""
    me = dist.get_rank(group)
    if me < 2 * r:
        send_recv(flat if v is not None else None, me ^ 1, flat if v is None else None, me ^ 1, group, name)


def recursive_doubling_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place: at step k swap the whole vector with the rank that differs in bit k, and reduce."""
    name = "recursive_doubling_all_reduce"
    check_collective(tensor, op, group, name)
    flat = tensor.reshape(-1).contiguous()  # the tensor itself when contiguous: in place, like dist.all_reduce
    v, p, r = _fold(flat, op, group, name)
    if v is not None:
        incoming = torch.empty_like(flat)
        mask = 1
        while mask < p:
            partner = real_rank(v ^ mask, r)
            send_recv(flat, partner, incoming, partner, group, name)
            reduce_into(flat, incoming, op)  # my partner computes theirs + mine: the same value
            mask <<= 1
    _unfold(flat, v, r, group, name)
    return _finish(tensor, flat, op, group)


def halving_doubling_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place: reduce-scatter by recursive halving (keep half, send half, each step), then all-gather by
    recursive doubling. Nearest partners first, so the largest halves stay inside a node."""
    name = "halving_doubling_all_reduce"
    check_collective(tensor, op, group, name)
    flat = tensor.reshape(-1).contiguous()  # the tensor itself when contiguous: in place, like dist.all_reduce
    v, p, r = _fold(flat, op, group, name)
    if v is not None:
        edges = [i * flat.numel() // p for i in range(p + 1)]  # p blocks; [lo, hi) is a range of blocks

        def part(lo, hi):
            """Blocks lo .. hi-1 of my vector, a view."""
            return flat[edges[lo]:edges[hi]]
        masks = [1 << k for k in range(p.bit_length() - 1)]
        lo = 0  # the blocks I reduce: all p at first, half as many after each step
        hi = p
        for mask in masks:
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if v & mask == 0 else ((mid, hi), (lo, mid))
            incoming = torch.empty_like(part(*keep))
            partner = real_rank(v ^ mask, r)
            send_recv(part(*give), partner, incoming, partner, group, name)
            reduce_into(part(*keep), incoming, op)
            lo, hi = keep
        for mask in reversed(masks):  # my partner holds the other half of the range we split
            other = (hi, 2 * hi - lo) if v & mask == 0 else (2 * lo - hi, lo)
            partner = real_rank(v ^ mask, r)
            send_recv(part(lo, hi), partner, part(*other), partner, group, name)
            lo, hi = min(lo, other[0]), max(hi, other[1])
    _unfold(flat, v, r, group, name)
    return _finish(tensor, flat, op, group)


ALGORITHMS = {"ring": lambda t, G, group: ring_all_reduce(t, group=group),
              "hierarchical": lambda t, G, group: hierarchical_all_reduce(t, G, group=group),
              "recursive doubling": lambda t, G, group: recursive_doubling_all_reduce(t, group=group),
              "halving-doubling": lambda t, G, group: halving_doubling_all_reduce(t, group=group)}


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--ranks-per-node", type=int, default=2, help="G: consecutive ranks that share a node")
    p.add_argument("--slow-link-us", type=float, default=300.0, help="SIMULATED inter-node latency, us (0: none)")
    p.add_argument("--slow-link-mbps", type=float, default=100.0, help="SIMULATED inter-node MB/s (0: no cap)")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[1, 8, 64, 512, 4096], help="message sizes, KiB")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm and size (median)")
    return p


def demo(args) -> int:
    N = launch.env_world_size()
    G = args.ranks_per_node
    launch.require_nodes(N, G)
    launch.require(min(args.sizes_kib) >= 1 and args.repeats >= 1 and min(args.slow_link_us, args.slow_link_mbps)
                   >= 0, "--sizes-kib and --repeats must be >= 1, the slow link >= 0")
    env = launch.setup()
    say = launch.print0
    x = torch.randn(10_007, dtype=torch.float64, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    native = x.clone()
    total = x.abs()
    dist.all_reduce(native)
    dist.all_reduce(total)
    bound = 2 * (N - 1) * 2.0 ** -53 / (1 - (N - 1) * 2.0 ** -53) * total  # two orders, gamma_{N-1} sum|x| each
    errors = {a: ((fn(x.clone(), G, None) - native).abs() / bound.clamp_min(1e-300)).max().item()
              for a, fn in ALGORITHMS.items()}
    say(f"{N} ranks in {N // G} nodes of {G}; vs dist.all_reduce (fp64), max |diff| / bound 2 gamma_(N-1) sum|x|: "
        + ", ".join(f"{a} {e:.2f}" for a, e in errors.items()))

    numel = 2 * N * (1 << (N.bit_length() - 1)) * 3 ** 7  # even ring chunks and halving blocks
    D = 4 * numel
    ledger_ok = True
    say(f"\nbytes sent, total over all ranks, for D = {D:,} B per rank, measured (schedule):"
        f"{'inside nodes':>14}{'between nodes':>28}")
    for a, fn in ALGORITHMS.items():
        with Links(G) as links:
            fn(torch.ones(numel, device=env.device), G, None)
        sent = torch.tensor(list(links.sent.values()), device=env.device)
        dist.all_reduce(sent)
        want = link_bytes(schedule(a, N, G), D, G)
        ledger_ok &= sent.tolist() == list(want.values())
        say(f"  {a:<20}" + "".join(f"{f'{b:,} ({w:,})':>34}" for b, w in zip(sent.tolist(), want.values())))

    links = fitted_links(args.slow_link_us, args.slow_link_mbps)
    say(f"\nfitted by ping-pong between ranks 0 and 1: alpha = {links['intra'][0] * 1e6:.1f} us, beta = "
        f"{links['intra'][1] * 1e9:.3f} ns/B; SIMULATED inter-node link: +{args.slow_link_us:g} us per message, "
        f"{args.slow_link_mbps:g} MB/s")
    kib = [k * 1024 for k in args.sizes_kib]
    model = {a: [predict(schedule(a, N, G), b, G, links) for b in kib] for a in ALGORITHMS}
    measured = {a: [] for a in ALGORITHMS}
    with Links(G, delay_s=args.slow_link_us * 1e-6, bandwidth=args.slow_link_mbps * 1e6 or math.inf):
        for b in kib:
            t = torch.zeros(b // 4, device=env.device)
            for a, fn in ALGORITHMS.items():
                measured[a].append(median([timed(lambda: fn(t, G, None)) for _ in range(args.repeats)]))
    best = winners(model)
    seen = winners(measured)
    say(f"\nms per all-reduce of D bytes per rank, model / measured (slowest rank, median of {args.repeats})\n"
        f"{'D':>9}" + "".join(f"{a:>21}" for a in ALGORITHMS) + "   fastest: model / measured")
    for i, k in enumerate(args.sizes_kib):
        say(f"{k:>5,} KiB" + "".join(f"{model[a][i] * 1e3:>11.2f} /{measured[a][i] * 1e3:>7.2f}" for a in ALGORITHMS)
            + f"   {best[i]} / {seen[i]}")
    say(f"crossover in the model: {'; '.join(crossovers(best, kib, N, G, links)) or 'none in this range'}")
    differ = [f"{args.sizes_kib[i]:,} KiB ({best[i]} / {seen[i]})" for i in range(len(kib)) if best[i] != seen[i]]
    say(f"model and clock disagree on the fastest at {', '.join(differ)}: the alpha-beta model prices only "
        f"latency and bytes on the wire; it leaves out the additions, Python's microseconds per step, and {N} "
        f"ranks sharing this machine's cores, and a median of {args.repeats} wall-clock runs on a shared machine "
        f"is noisy. No check rests on the clock." if differ else "model and clock agree on the fastest at every size")
    say("\nthe busiest rank's bytes on the slow link, and the model for 1 GB on 2 nodes of 8 GPUs: ./run.sh ask 22")
    worst = max(errors.values())
    return launch.conclude("topology", worst <= 1.0, f"4 all-reduces = dist.all_reduce within the order bound "
                           f"({worst:.2f} of it)", ledger_ok, "intra/inter bytes = schedules exactly")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
