"""Topology: which all-reduce wins depends on the message size and on which links carry the bytes.

Ranks inside a node talk over fast links (NVLink), nodes over a network about ten times slower. Take N ranks
in n nodes of G ranks each (N = nG, node = rank // G) and D bytes to all-reduce. The alpha-beta model
(Hockney 1994) prices a message of b bytes on a link at alpha + b * beta; a step lasts as long as its
slowest message, and an algorithm is a schedule of steps:

    algorithm            steps             bytes sent per rank    bytes per rank on a slow link
    ring                 2(N-1)            2(N-1)/N D             2(N-1)/N D (a rank at a node boundary)
    hierarchical         2(G-1) + 2(n-1)   2(N-1)/N D             2(n-1)/n D/G
    recursive doubling   log2 N            log2 N * D             D per step that leaves the node
    halving-doubling     2 log2 N          2(N-1)/N D             as hierarchical, nearest partners first

    T(schedule, D) = sum over steps of  max over the step's messages of  (alpha_link + bytes * beta_link)

The ring is bandwidth-optimal but pays 2(N-1) latencies, and every step waits for a slow link. The
hierarchical all-reduce (reduce-scatter inside each node, all-reduce of the 1/G shard across nodes,
all-gather inside the node; NCCL's trees and Horovod's hierarchical mode) sends the same bytes with fewer
latencies, and only 1/G of them between nodes. Recursive doubling (log2 N exchanges of the whole vector)
takes the fewest steps and wins for small messages; Rabenseifner's halving-doubling (Thakur, Rabenseifner
& Gropp 2005) takes 2 log2 N steps with the ring's bytes. N not a power of two: the first 2r ranks fold in
pairs, N = p + r, the odd rank of a pair carries both, and gets the result back at the end (+2 steps of D).

`Links` counts the bytes of every send per link kind and can put a SIMULATED slow link between nodes (a
sleep before each inter-node send: there is no second machine here). The demo fits alpha and beta with
ping-pongs, predicts every algorithm at every size, and measures them:

    torchrun --standalone --nproc_per_node=4 mini_dist/topology.py [--ranks-per-node 2] [--slow-link-us 300]

Mirrors what dist.all_reduce does inside NCCL (ring or tree by size) and gloo (ring, halving-doubling).
"""
import math
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/topology.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import launch
from mini_dist.kit.timing import median, timed
from mini_dist.ring_allreduce import reduce_into, ring_all_gather, ring_all_reduce, ring_reduce_scatter

SUM, AVG, MAX, MIN, PRODUCT = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                               dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)


class Links:
    """with Links(G, group) as links: ...  ->  links.sent = {"intra": bytes, "inter": bytes} this rank sent.

    Every dist.isend inside the block (the ring's too) is counted by the kind of link it crosses. With
    delay_s or bandwidth, a send between nodes first waits delay_s + bytes / bandwidth: a SIMULATED slow link."""

    def __init__(self, ranks_per_node: int, group=None, delay_s: float = 0.0, bandwidth: float = math.inf):
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        self.node = {rank: i // ranks_per_node for i, rank in enumerate(ranks)}
        self.delay_s, self.bandwidth, self.sent = delay_s, bandwidth, {"intra": 0, "inter": 0}

    def __enter__(self):
        self.real, me = dist.isend, dist.get_rank()

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            peer = dst if dst is not None else group_dst if group is None else dist.get_global_rank(group, group_dst)
            kind = "intra" if self.node[peer] == self.node[me] else "inter"
            self.sent[kind] += tensor.nbytes
            if kind == "inter" and (self.delay_s or self.bandwidth < math.inf):
                time.sleep(self.delay_s + tensor.nbytes / self.bandwidth)
            return self.real(tensor, dst, group, tag, group_dst=group_dst)
        dist.isend = isend
        return self

    def __exit__(self, *exc):
        dist.isend = self.real


def _check(tensor, op, group, name: str, ranks_per_node: int = 1) -> None:
    comm.agree(name, f"shape {tuple(tensor.shape)} dtype {tensor.dtype} op {op} ranks_per_node {ranks_per_node}",
               group)
    if op not in (SUM, AVG, MAX, MIN, PRODUCT):
        raise ValueError(f"{name}: unsupported op {op}; use SUM, AVG, MAX, MIN or PRODUCT")
    if op == AVG and not tensor.is_floating_point():
        raise ValueError(f"{name}: AVG of {tensor.dtype} tensors would round; use SUM and divide")


# ----------------------------------------------------------------------------- hierarchical: the ring, twice

_groups: dict = {}  # (global ranks of the group, G) -> {rank: (its node's group, its inter-node group)}


def node_groups(ranks_per_node: int, ranks=None) -> tuple | None:
    """Make the node groups (G consecutive ranks) and inter-node groups (the rank with the same local index
    on every node) of the group of global `ranks` (None: the world). Like dist.new_group, every rank of
    the world calls it, members or not; the world's own are made on first use. Returns mine (or None)."""
    ranks = tuple(range(dist.get_world_size()) if ranks is None else ranks)
    G, N = ranks_per_node, len(ranks)
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
    _check(tensor, op, group, "hierarchical_all_reduce", ranks_per_node)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    if ranks is not None and (ranks, ranks_per_node) not in _groups:
        raise ValueError(f"hierarchical_all_reduce on a subgroup: first call topology.node_groups"
                         f"({ranks_per_node}, {list(ranks)}) on every rank of the world (as dist.new_group)")
    intra, inter = node_groups(ranks_per_node, ranks)
    G, numel, reduce_op = ranks_per_node, tensor.numel(), SUM if op == AVG else op
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

def _exchange(send, recv, peer: int, group) -> None:
    """Send to group rank `peer` while receiving from it: both posted before either waits."""
    works = [] if recv is None or not recv.numel() else [dist.irecv(recv, group=group, group_src=peer)]
    works += [] if send is None or not send.numel() else [dist.isend(send, group=group, group_dst=peer)]
    for work in works:
        work.wait()


def _fold(flat, op, group):
    """N = p + r with p a power of two: rank 2i hands its vector to rank 2i+1 for i < r. Returns
    (my rank among the p that go on, or None if I wait; p; r). Virtual rank v is real rank _real(v, r)."""
    N, me = dist.get_world_size(group), dist.get_rank(group)
    p = 1 << (N.bit_length() - 1)
    r = N - p
    if me < 2 * r and me % 2 == 0:
        _exchange(flat, None, me + 1, group)
        return None, p, r
    if me < 2 * r:
        incoming = torch.empty_like(flat)
        _exchange(None, incoming, me - 1, group)
        reduce_into(flat, incoming, op)
        return me // 2, p, r
    return me - r, p, r


def _real(v: int, r: int) -> int:
    return 2 * v + 1 if v < r else v + r


def _unfold(flat, v, r, group) -> None:
    me = dist.get_rank(group)
    if me < 2 * r:
        _exchange(flat if v is not None else None, flat if v is None else None, me ^ 1, group)


def recursive_doubling_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place: at step k swap the whole vector with the rank that differs in bit k, and reduce."""
    _check(tensor, op, group, "recursive_doubling_all_reduce")
    flat = tensor.reshape(-1).contiguous()  # the tensor itself when contiguous: in place, like dist.all_reduce
    v, p, r = _fold(flat, op, group)
    if v is not None:
        incoming, mask = torch.empty_like(flat), 1
        while mask < p:
            _exchange(flat, incoming, _real(v ^ mask, r), group)
            reduce_into(flat, incoming, op)  # my partner computes theirs + mine: the same value
            mask <<= 1
    _unfold(flat, v, r, group)
    return _finish(tensor, flat, op, group)


def halving_doubling_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place: reduce-scatter by recursive halving (keep half, send half, each step), then all-gather by
    recursive doubling. Nearest partners first, so the largest halves stay inside a node."""
    _check(tensor, op, group, "halving_doubling_all_reduce")
    flat = tensor.reshape(-1).contiguous()  # the tensor itself when contiguous: in place, like dist.all_reduce
    v, p, r = _fold(flat, op, group)
    if v is not None:
        edges = [i * flat.numel() // p for i in range(p + 1)]  # p blocks; [lo, hi) is a range of blocks
        part = lambda lo, hi: flat[edges[lo]:edges[hi]]        # noqa: E731
        lo, hi, masks = 0, p, [1 << k for k in range(p.bit_length() - 1)]
        for mask in masks:
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if v & mask == 0 else ((mid, hi), (lo, mid))
            incoming = torch.empty_like(part(*keep))
            _exchange(part(*give), incoming, _real(v ^ mask, r), group)
            reduce_into(part(*keep), incoming, op)
            lo, hi = keep
        for mask in reversed(masks):  # my partner holds the other half of the range we split
            other = (hi, 2 * hi - lo) if v & mask == 0 else (2 * lo - hi, lo)
            _exchange(part(lo, hi), part(*other), _real(v ^ mask, r), group)
            lo, hi = min(lo, other[0]), max(hi, other[1])
    _unfold(flat, v, r, group)
    return _finish(tensor, flat, op, group)


# ----------------------------------------------------------------------------- schedules and the cost model

def schedule(algorithm: str, N: int, G: int) -> list[list[tuple[int, int, Fraction]]]:
    """Each step: the messages (sender, receiver, fraction of D) that travel at once. Exact when D splits
    evenly; the same list gives the byte ledger (link_bytes) and the alpha-beta time (predict)."""
    n, p = N // G, 1 << (N.bit_length() - 1)
    r = N - p
    if algorithm == "ring":
        return [[(q, (q - 1) % N, Fraction(1, N)) for q in range(N)]] * (2 * (N - 1))
    if algorithm == "hierarchical":
        inside = [[(q, q // G * G + (q - 1) % G, Fraction(1, G)) for q in range(N)]] * (G - 1)
        return inside + [[(q, (q - G) % N, Fraction(1, N)) for q in range(N)]] * (2 * (n - 1)) + inside
    masks = [1 << k for k in range(p.bit_length() - 1)]
    pair = lambda mask, f: [(_real(v, r), _real(v ^ mask, r), f) for v in range(p)]  # noqa: E731
    if algorithm == "recursive doubling":
        middle = [pair(m, Fraction(1)) for m in masks]
    else:
        middle = [pair(m, Fraction(1, 2 * m)) for m in masks] + [pair(m, Fraction(1, 2 * m)) for m in masks[::-1]]
    fold = [[(2 * i, 2 * i + 1, Fraction(1)) for i in range(r)]]
    unfold = [[(2 * i + 1, 2 * i, Fraction(1)) for i in range(r)]]
    return (fold if r else []) + middle + (unfold if r else [])


ALGORITHMS = {"ring": lambda t, G, group: ring_all_reduce(t, group=group),
              "hierarchical": lambda t, G, group: hierarchical_all_reduce(t, G, group=group),
              "recursive doubling": lambda t, G, group: recursive_doubling_all_reduce(t, group=group),
              "halving-doubling": lambda t, G, group: halving_doubling_all_reduce(t, group=group)}


def link_kind(src: int, dst: int, G: int) -> str:
    return "intra" if src // G == dst // G else "inter"


def link_bytes(steps, nbytes: int, G: int) -> dict[str, int]:
    """The ledger a schedule predicts: bytes over all ranks, per link kind."""
    total = {"intra": Fraction(0), "inter": Fraction(0)}
    for step in steps:
        for src, dst, f in step:
            total[link_kind(src, dst, G)] += f * nbytes
    return {kind: int(b) if b.denominator == 1 else float(b) for kind, b in total.items()}


def predict(steps, nbytes: float, G: int, links: dict) -> float:
    """alpha-beta seconds: each step lasts as long as its slowest message; links[kind] = (alpha, beta)."""
    cost = lambda s, d, f: links[link_kind(s, d, G)][0] + float(f) * nbytes * links[link_kind(s, d, G)][1]  # noqa: E731
    return sum(max(cost(*message) for message in step) for step in steps if step)


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """Least squares for seconds = alpha + bytes * beta."""
    mx, my = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    beta = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sum((x - mx) ** 2 for x in sizes)
    return my - beta * mx, beta


def ping_pong(nbytes: int, repeats: int = 9, group=None) -> float:
    """One-way seconds of an nbytes message between group ranks 0 and 1: half the median round trip."""
    me, buf, times = dist.get_rank(group), torch.zeros(nbytes, dtype=torch.uint8, device=launch.device()), []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        if me < 2:
            for sender in (0, 1):
                _exchange(buf if me == sender else None, buf if me != sender else None, 1 - me, group)
        times.append(time.perf_counter() - start)
    result = torch.tensor([median(times) / 2], dtype=torch.float64, device=launch.device())
    dist.broadcast(result, group=group, group_src=0)
    return result.item()


def winners(times: dict[str, list[float]]) -> list[str]:
    """The fastest algorithm at each size; among ties (to 9 digits) the first listed."""
    return [min(times, key=lambda a: float(f"{times[a][i]:.9g}")) for i in range(len(next(iter(times.values()))))]


def crossover(a: str, b: str, lo: float, hi: float, N: int, G: int, links: dict) -> float:
    """The size in [lo, hi] where the model prices a and b the same (bisection on a log scale)."""
    gap = lambda D: predict(schedule(a, N, G), D, G, links) - predict(schedule(b, N, G), D, G, links)  # noqa: E731
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if (gap(mid) > 0) == (gap(lo) > 0) else (lo, mid)
    return lo


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--ranks-per-node", type=int, default=2, help="G: consecutive ranks that share a node")
    p.add_argument("--slow-link-us", type=float, default=300.0,
                   help="SIMULATED extra latency of every inter-node message, microseconds (0: none)")
    p.add_argument("--slow-link-mbps", type=float, default=100.0,
                   help="SIMULATED inter-node bandwidth cap, MB/s, on top of the real link (0: no cap)")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[1, 8, 64, 512, 4096], help="message sizes")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm and size (median)")
    return p


def demo(args) -> int:
    N, G = launch.env_world_size(), args.ranks_per_node
    launch.require(G >= 1 and N % G == 0, f"--ranks-per-node {G} does not divide {N} ranks into equal nodes; "
                   f"use one of {[g for g in range(1, N + 1) if N % g == 0]}")
    launch.require(min(args.sizes_kib) >= 1 and args.repeats >= 1 and min(args.slow_link_us, args.slow_link_mbps)
                   >= 0, "--sizes-kib and --repeats must be >= 1, the slow link >= 0")
    env = launch.setup()
    x = torch.randn(10_007, dtype=torch.float64, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    native, total = x.clone(), x.abs()
    dist.all_reduce(native)
    dist.all_reduce(total)
    bound = 2 * (N - 1) * 2.0 ** -53 / (1 - (N - 1) * 2.0 ** -53) * total  # two orders, gamma_{N-1} sum|x| each
    errors = {a: ((fn(x.clone(), G, None) - native).abs() / bound.clamp_min(1e-300)).max().item()
              for a, fn in ALGORITHMS.items()}
    say = launch.print0
    say(f"{N} ranks in {N // G} nodes of {G}; vs dist.all_reduce (fp64), max |diff| / bound 2 gamma_(N-1) sum|x|: "
        + ", ".join(f"{a} {e:.2f}" for a, e in errors.items()))

    numel = 2 * N * (1 << (N.bit_length() - 1)) * 3 ** 7  # even ring chunks and halving blocks
    D, ledger_ok = 4 * numel, True
    say(f"\nbytes over all ranks for D = {D:,} B, measured (schedule):   inside nodes           between nodes")
    for a, fn in ALGORITHMS.items():
        with Links(G) as links:
            fn(torch.ones(numel, device=env.device), G, None)
        sent = torch.tensor(list(links.sent.values()), device=env.device)
        dist.all_reduce(sent)
        want = link_bytes(schedule(a, N, G), D, G)
        ledger_ok &= sent.tolist() == list(want.values())
        say(f"  {a:<20}" + "".join(f"{f'{b:,} ({w:,})':>28}" for b, w in zip(sent.tolist(), want.values())))

    sizes = [1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22]
    alpha, beta = fit_alpha_beta(sizes, [ping_pong(b) for b in sizes]) if N > 1 else (0.0, 0.0)
    slow = (args.slow_link_us * 1e-6, 1e-6 / args.slow_link_mbps if args.slow_link_mbps else 0.0)
    links = {"intra": (alpha, beta), "inter": (alpha + slow[0], beta + slow[1])}
    say(f"\nfitted by ping-pong between ranks 0 and 1: alpha = {alpha * 1e6:.1f} us, beta = {beta * 1e9:.3f} ns/B; "
        f"SIMULATED inter-node link: +{args.slow_link_us:g} us per message, {args.slow_link_mbps:g} MB/s")
    kib = [k * 1024 for k in args.sizes_kib]
    model = {a: [predict(schedule(a, N, G), b, G, links) for b in kib] for a in ALGORITHMS}
    measured = {a: [] for a in ALGORITHMS}
    with Links(G, delay_s=slow[0], bandwidth=1 / slow[1] if slow[1] else math.inf):
        for b in kib:
            t = torch.zeros(b // 4, device=env.device)
            for a, fn in ALGORITHMS.items():
                measured[a].append(median([timed(lambda: fn(t, G, None)) for _ in range(args.repeats)]))
    best, seen = winners(model), winners(measured)
    say(f"\nms, model / measured (slowest rank, median of {args.repeats})\n{'size':>9}"
        + "".join(f"{a:>21}" for a in ALGORITHMS) + "   fastest: model / measured")
    for i, k in enumerate(args.sizes_kib):
        say(f"{k:>5} KiB" + "".join(f"{model[a][i] * 1e3:>11.2f} /{measured[a][i] * 1e3:>7.2f}" for a in ALGORITHMS)
            + f"   {best[i]} / {seen[i]}")
    at = [f"{best[i]} -> {best[i + 1]} at {crossover(best[i], best[i + 1], kib[i], kib[i + 1], N, G, links) / 1024:.0f}"
          f" KiB" for i in range(len(kib) - 1) if best[i] != best[i + 1]]
    between = [f"{seen[i]} -> {seen[i + 1]} between {args.sizes_kib[i]} and {args.sizes_kib[i + 1]} KiB"
               for i in range(len(kib) - 1) if seen[i] != seen[i + 1]]
    say(f"crossover, model: {'; '.join(at) or 'none'}; measured: {'; '.join(between) or 'none'}")
    worst = max(errors.values())
    return launch.conclude("topology", worst <= 1.0, f"4 all-reduces = dist.all_reduce within the order bound "
                           f"({worst:.2f} of it)", ledger_ok, "intra/inter bytes = schedules exactly")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
