"""Communication: the figures that answer questions 4, 5, 6 and 22 (mini_dist/questions/questions.md).

    4. What each rank holds after all-reduce, RS, AG          what_each_rank_holds   (ring_allreduce.py)
    5. What a ring all-reduce costs per rank as N grows       ring_bytes_per_rank    (ring_allreduce.py)
    6. All-reduce = reduce-scatter + all-gather?              all_reduce_is_reduce_scatter_plus_all_gather
                                                              (ring_allreduce.py)
    22. The hierarchical all-reduce and a slow link           slow_link_bytes        (topology.py, alpha_beta.py)

Each runs on every rank of its group and returns (figure, holds), as `./run.sh ask N` and tests/test_questions.py
call it. The collectives are the concepts' own (the textbook ring's, topology's all-reduces and Links), the bytes
the wire's LEDGER counted, the times alpha_beta's model of the same schedules, so a figure cannot drift from them.
"""
import torch
import torch.distributed as dist

from mini_dist.alpha_beta import predict, schedule
from mini_dist.kit import launch
from mini_dist.kit.wire import LEDGER
from mini_dist.ring_allreduce import (MAX, SUM, naive_all_reduce, ring_all_gather, ring_all_reduce,
                                      ring_reduce_scatter)
from mini_dist.topology import ALGORITHMS, Links


def _total(x: float, op=SUM, group=None) -> float:
    """The sum (or another reduction) over the group's ranks of every rank's x."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=launch.device())
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def _shown(t: torch.Tensor) -> str:
    """A small tensor as a list: [1, 2, 3]."""
    return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"


def what_each_rank_holds(group=None) -> tuple[str, bool]:
    """Question 4: rank r holds (r+1) x [1..N]; what all-reduce, reduce-scatter, all-gather leave on each rank."""
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    dev = launch.device()
    x = torch.arange(1.0, n + 1, device=dev) * (r + 1)
    native = x.clone()
    dist.all_reduce(native, group=group)
    summed = ring_all_reduce(x.clone(), group=group)
    block = ring_reduce_scatter(torch.empty(1, device=dev), x.clone(), group=group)
    gathered = ring_all_gather(torch.empty(n, device=dev), block, group=group)
    ok = torch.equal(summed, native) and torch.equal(block, native[r:r + 1]) and torch.equal(gathered, native)
    blocks = ", ".join(_shown(t) for t in gathered.chunk(n))
    figure = (f"rank r holds (r+1) x {_shown(x / (r + 1))}; all-reduce: {_shown(summed)} on every rank; "
              f"reduce-scatter: rank r keeps block r of that sum ({blocks}); all-gather of those blocks: "
              f"{_shown(gathered)} on every rank; all = torch.distributed's")
    return figure, _total(not ok, group=group) == 0


def _sent(all_reduce, numel: int, size: int) -> tuple[float, float]:
    """(mean, largest) bytes one of the world's first `size` ranks sent in one all_reduce of numel fp32. Every
    rank of the world calls it (it makes the group); the others sit this one out and count nothing."""
    group = launch.new_group(range(size))
    LEDGER.reset()
    if dist.get_rank() < size:
        all_reduce(torch.ones(numel, device=launch.device()), group=group)
    return _total(LEDGER.sent) / size, _total(LEDGER.sent, MAX)


def ring_bytes_per_rank(numel: int = 1 << 16) -> tuple[str, bool]:
    """Question 5 (every rank of the world): bytes the ring sends per rank on 2 ranks and on all of them, and
    what the naive all-reduce's root sends, for numel fp32."""
    N = dist.get_world_size()
    D = 4 * numel
    ring = {}
    for size in sorted({min(2, N), N}):
        mean, _ = _sent(ring_all_reduce, numel, size)
        ring[size] = mean / D
    _, largest = _sent(naive_all_reduce, numel, N)
    root = largest / D  # rank 0, the root, sends the most
    per_size = ", ".join(f"{v:.2f}D per rank on {s} ranks" for s, v in ring.items())
    figure = (f"D = {D:,} B: the ring sends {per_size} (2(N-1)/N D, never above 2D); the naive all-reduce's root "
              f"(rank 0) sends {root:.2f}D on {N} ranks ((N-1)D)")
    return figure, all(v == 2 * (s - 1) / s for s, v in ring.items()) and root == N - 1


def all_reduce_is_reduce_scatter_plus_all_gather(group=None) -> tuple[str, bool]:
    """Question 6: one ring all-reduce against a ring reduce-scatter then all-gather: bytes and result."""
    n = dist.get_world_size(group)
    dev = launch.device()
    x = torch.randn(n * 4096, generator=torch.Generator().manual_seed(dist.get_rank(group))).to(dev)
    D = x.nbytes
    LEDGER.reset()
    whole = ring_all_reduce(x.clone(), group=group)
    one = _total(LEDGER.sent, group=group)
    LEDGER.reset()
    block = ring_reduce_scatter(torch.empty(4096, device=dev), x, group=group)
    halves = ring_all_gather(torch.empty_like(x), block, group=group)
    two = _total(LEDGER.sent, group=group)
    same = _total(not torch.equal(whole, halves), group=group) == 0
    figure = (f"D = {D:,} B fp32 on {n} ranks: all-reduce sent {one / n / D:.2f}D per rank, reduce-scatter + "
              f"all-gather {two / n / D:.2f}D; results bit-identical: {same}")
    return figure, same and one == two == 2 * (n - 1) * D


def slow_link_bytes(ranks_per_node: int = 2, numel: int = 1 << 14) -> tuple[str, bool]:
    """Question 22 (every rank of the world): bytes the busiest rank sends over the slow link in the ring and
    in the hierarchical all-reduce, and the model's times for 1 GB over 2 nodes of 8 GPUs."""
    N = dist.get_world_size()
    G = ranks_per_node
    n = N // G
    D = 4 * numel
    sent = []
    for name in ("ring", "hierarchical"):
        with Links(G) as links:
            ALGORITHMS[name](torch.ones(numel, device=launch.device()), G, None)
        sent += [links.sent["inter"], sum(links.sent.values())]
    busiest = torch.tensor(sent, dtype=torch.float64, device=launch.device())
    dist.all_reduce(busiest, op=MAX)
    ring_inter, ring_all, inter, every = (busiest / D).tolist()
    cluster = {"intra": (5e-6, 1 / 450e9), "inter": (10e-6, 1 / 50e9)}  # cost_model.Cluster's NVLink, InfiniBand
    ms = {a: 1e3 * predict(schedule(a, 16, 8), 1e9, 8, cluster) for a in ("ring", "hierarchical")}
    figure = (f"{n} nodes x {G} ranks, D = {D:,} B: every rank sends {ring_all:.2f}D either way, but the busiest "
              f"sends {ring_inter:.2f}D over the slow link in the ring, {inter:.2f}D hierarchically (1/G); "
              f"alpha-beta model, 1 GB over 2 nodes of 8 GPUs (450 GB/s inside, 50 between): ring "
              f"{ms['ring']:,.1f} ms, hierarchical {ms['hierarchical']:,.1f} ms")
    holds = (ring_inter == 2 * (N - 1) / N and inter == 2 * (n - 1) / n / G and ring_all == every
             and ms["hierarchical"] < ms["ring"])
    return figure, holds
