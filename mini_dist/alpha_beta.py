"""The alpha-beta model: price an all-reduce before running it, from two numbers per link.

A message of b bytes on a link costs alpha + b * beta (Hockney 1994): alpha the latency every message pays,
beta the seconds per byte. An algorithm is a schedule, a list of steps, each step the messages that travel
at once (sender, receiver, fraction of the D bytes); a step lasts as long as its slowest message:

    T(schedule, D) = sum over steps of  max over the step's messages of  (alpha_link + f * D * beta_link)

With N ranks in n nodes of G (node = rank // G), a link is "intra" (inside a node) or "inter" (between
nodes), each with its own alpha and beta. The same schedules give the bytes each kind of link carries
(link_bytes), which mini_dist/topology.py checks against what its all-reduces really send. Few steps win
for small D (alpha dominates), few bytes for large D (beta dominates); `crossover` finds the size between.
alpha and beta are fitted here by least squares on ping-pongs between ranks 0 and 1.

`Links` is the model's other side, measured: it sorts the bytes of every message the wire sends by the kind
of link it crosses, and can put a SIMULATED slow link between nodes (before each inter-node send, a sleep of
alpha + bytes * beta: there is no second machine here). topology.py runs its all-reduces on it.

    torchrun --standalone --nproc_per_node=4 mini_dist/alpha_beta.py [--ranks-per-node 2] [--slow-link-us 300]

Mirrors the tuning tables inside NCCL (ring or tree by size) and the model of Thakur, Rabenseifner & Gropp 2005.
"""
import math
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.kit.timing import median
from mini_dist.kit.wire import LEDGER

ALGORITHMS = ["ring", "hierarchical", "recursive doubling", "halving-doubling"]


def real_rank(v: int, r: int) -> int:
    """N = p + r with p a power of two: the first 2r ranks fold in pairs, the odd one of a pair goes on.
    Virtual rank v (of the p that go on) is this real rank."""
    return 2 * v + 1 if v < r else v + r


def schedule(algorithm: str, N: int, G: int) -> list[list[tuple[int, int, Fraction]]]:
    """Each step: the messages (sender, receiver, fraction of D) that travel at once. Exact when D splits
    evenly; the same list gives the byte ledger (link_bytes) and the alpha-beta time (predict)."""
    n = N // G                      # nodes
    p = 1 << (N.bit_length() - 1)   # the largest power of two <= N
    r = N - p
    if algorithm == "ring":
        return [[(q, (q - 1) % N, Fraction(1, N)) for q in range(N)]] * (2 * (N - 1))
    if algorithm == "hierarchical":
        inside = [[(q, q // G * G + (q - 1) % G, Fraction(1, G)) for q in range(N)]] * (G - 1)
        return inside + [[(q, (q - G) % N, Fraction(1, N)) for q in range(N)]] * (2 * (n - 1)) + inside
    masks = [1 << k for k in range(p.bit_length() - 1)]
    if algorithm == "recursive doubling":
        middle = [partners(m, Fraction(1), p, r) for m in masks]
    else:
        halving = [partners(m, Fraction(1, 2 * m), p, r) for m in masks]
        middle = halving + halving[::-1]
    fold = [[(2 * i, 2 * i + 1, Fraction(1)) for i in range(r)]]
    unfold = [[(2 * i + 1, 2 * i, Fraction(1)) for i in range(r)]]
    return (fold if r else []) + middle + (unfold if r else [])


def partners(mask: int, f: Fraction, p: int, r: int) -> list[tuple[int, int, Fraction]]:
    """One step of the doubling algorithms: each of the p ranks that go on sends f of D to the one whose
    virtual rank differs from its own in the bit `mask`."""
    return [(real_rank(v, r), real_rank(v ^ mask, r), f) for v in range(p)]


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
    slowest = [max(message_seconds(src, dst, f, nbytes, G, links) for src, dst, f in step) for step in steps if step]
    return sum(slowest)


def message_seconds(src: int, dst: int, f: Fraction, nbytes: float, G: int, links: dict) -> float:
    """alpha + b * beta for the f * nbytes that src sends dst, on the link between them."""
    alpha, beta = links[link_kind(src, dst, G)]
    return alpha + float(f) * nbytes * beta


def crossover(a: str, b: str, lo: float, hi: float, N: int, G: int, links: dict) -> float:
    """The size in [lo, hi] where the model prices a and b the same (bisection on a log scale)."""
    def a_slower(D):
        """Whether the model prices a above b for D bytes."""
        return predict(schedule(a, N, G), D, G, links) > predict(schedule(b, N, G), D, G, links)
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if a_slower(mid) == a_slower(lo):
            lo = mid
        else:
            hi = mid
    return lo


def crossovers(best: list[str], sizes: list[int], N: int, G: int, links: dict) -> list[str]:
    """Where the fastest algorithm changes between consecutive sizes, and at which size, as lines."""
    lines = []
    for i in range(len(sizes) - 1):
        if best[i] != best[i + 1]:
            at = crossover(best[i], best[i + 1], sizes[i], sizes[i + 1], N, G, links)
            lines.append(f"{best[i]} -> {best[i + 1]} at {at / 1024:,.0f} KiB")
    return lines


def winners(times: dict[str, list[float]]) -> list[str]:
    """The fastest algorithm at each size; among ties (to 9 digits) the first listed."""
    return [min(times, key=lambda a: float(f"{times[a][i]:.9g}")) for i in range(len(next(iter(times.values()))))]


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """Least squares for seconds = alpha + bytes * beta."""
    mx = sum(sizes) / len(sizes)
    my = sum(seconds) / len(seconds)
    beta = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sum((x - mx) ** 2 for x in sizes)
    return my - beta * mx, beta


def ping_pong(nbytes: int, repeats: int = 9, group=None) -> float:
    """One-way seconds of an nbytes message between group ranks 0 and 1: half the median round trip.
    Blocking sends and receives in matching order (0 sends first, 1 receives first): safe under NCCL too."""
    me = dist.get_rank(group)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=launch.device())
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        for sender in (0, 1) if me < 2 else ():
            if me == sender:
                dist.send(buf, group=group, group_dst=1 - me)
            else:
                dist.recv(buf, group=group, group_src=1 - me)
        times.append(time.perf_counter() - start)
    result = torch.tensor([median(times) / 2], dtype=torch.float64, device=launch.device())
    dist.broadcast(result, group=group, group_src=0)
    return result.item()


def fitted_links(slow_us: float, slow_mbps: float, group=None) -> dict:
    """{"intra": (alpha, beta)} fitted by ping-pong on this machine; "inter": the same plus a SIMULATED
    slow link (slow_us more per message, a slow_mbps cap; 0: none)."""
    sizes = [1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22]
    alpha = 0.0  # one rank: no link to fit
    beta = 0.0
    if dist.get_world_size(group) > 1:
        alpha, beta = fit_alpha_beta(sizes, [ping_pong(b, group=group) for b in sizes])
    slow_beta = 1e-6 / slow_mbps if slow_mbps else 0.0
    return {"intra": (alpha, beta), "inter": (alpha + slow_us * 1e-6, beta + slow_beta)}


class Links:
    """with Links(G, group) as links: ...  ->  links.sent = {"intra": bytes, "inter": bytes} this rank sent.

    Every message sent inside the block (the kit's wire: the rings, topology's all-reduces) is sorted by the
    link it crosses as it is posted: a watcher of the wire's LEDGER. With delay_s or bandwidth, a send between
    nodes first waits delay_s + bytes / bandwidth: a SIMULATED slow link, alpha and 1 / beta."""

    def __init__(self, ranks_per_node: int, group=None, delay_s: float = 0.0, bandwidth: float = math.inf):
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        self.node = {rank: i // ranks_per_node for i, rank in enumerate(ranks)}
        self.delay_s = delay_s
        self.bandwidth = bandwidth
        self.sent = {"intra": 0, "inter": 0}

    def before_send(self, event: str, peer, group, nbytes: int, kind, label) -> None:
        if event == "send":
            link = "intra" if self.node[peer] == self.node[dist.get_rank()] else "inter"
            self.sent[link] += nbytes
            if link == "inter" and (self.delay_s or self.bandwidth < math.inf):
                time.sleep(self.delay_s + nbytes / self.bandwidth)

    def __enter__(self):
        LEDGER.watchers.append(self.before_send)
        return self

    def __exit__(self, *exc):
        LEDGER.watchers.remove(self.before_send)


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--ranks-per-node", type=int, default=2, help="G: consecutive ranks that share a node")
    p.add_argument("--slow-link-us", type=float, default=300.0,
                   help="SIMULATED extra latency of every inter-node message, microseconds (0: none)")
    p.add_argument("--slow-link-mbps", type=float, default=100.0,
                   help="SIMULATED inter-node bandwidth cap, MB/s, on top of the real link (0: no cap)")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[1, 8, 64, 512, 4096], help="message sizes")
    return p


def demo(args) -> int:
    N = launch.env_world_size()
    G = args.ranks_per_node
    launch.require_nodes(N, G)
    launch.require(min(args.sizes_kib) >= 1 and min(args.slow_link_us, args.slow_link_mbps) >= 0,
                   "--sizes-kib must be >= 1, the slow link >= 0")
    launch.setup()
    links = fitted_links(args.slow_link_us, args.slow_link_mbps)
    alpha, beta = links["intra"]
    kib = [k * 1024 for k in args.sizes_kib]
    launch.print0(f"fitted by ping-pong between ranks 0 and 1: alpha = {alpha * 1e6:.1f} us, beta = "
                  f"{beta * 1e9:.3f} ns/B; SIMULATED inter-node link: +{args.slow_link_us:g} us per message, "
                  f"{args.slow_link_mbps:g} MB/s\n\npredicted ms for one all-reduce of D bytes per rank, {N} ranks "
                  f"in {N // G} nodes of {G}\n{'D':>9}" + "".join(f"{a:>20}" for a in ALGORITHMS) + "   fastest")
    model = {a: [predict(schedule(a, N, G), b, G, links) for b in kib] for a in ALGORITHMS}
    best = winners(model)
    for i, k in enumerate(args.sizes_kib):
        launch.print0(f"{k:>5,} KiB" + "".join(f"{model[a][i] * 1e3:>20.3f}" for a in ALGORITHMS) + f"   {best[i]}")
    launch.print0(f"crossover: {'; '.join(crossovers(best, kib, N, G, links)) or 'none in this range'}")
    # the schedules' own check: ring and hierarchical move 2(N-1)/N * D per rank, whatever the links
    same = all(sum(link_bytes(schedule(a, N, G), N * 1024, G).values()) == 2 * (N - 1) * N * 1024
               for a in ("ring", "hierarchical"))
    return launch.conclude("alpha_beta", same, "ring and hierarchical schedules move 2(N-1)/N D per rank", True,
                           f"fitted alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/B")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
