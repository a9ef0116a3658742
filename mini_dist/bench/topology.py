"""Hierarchical all-reduce against the flat ring, on a SIMULATED slow link between nodes.

    ./run.sh bench 4 topology

Both are mini_dist's (gloo's own sends cannot be slowed from Python, so the ring stands in as the
reference): 2 ranks per node, every message between nodes delayed by 300 us + bytes / 100 MB/s
(mini_dist.alpha_beta.Links). The flat ring crosses a node boundary at every one of its 2(N-1) steps with
D/N bytes; the hierarchical all-reduce crosses 2(n-1) times with D/N bytes, and moves the rest inside
nodes. The same pair again without the simulated link shows what the extra steps cost on equal links.
"""
import torch
import torch.distributed as dist

from mini_dist import bench
from mini_dist.alpha_beta import Links, link_bytes, predict, schedule
from mini_dist.kit.launch import device
from mini_dist.ring_pipelined import ring_all_reduce
from mini_dist.topology import hierarchical_all_reduce

G = 2               # ranks per node
DELAY_S = 300e-6    # the simulated link between nodes: latency
BANDWIDTH = 100e6   # and bytes per second


def hierarchical_vs_ring(args, sizes_kib=(64, 1024, 8192), repeats=7) -> list[bench.Result]:
    N = dist.get_world_size()
    if N % G or N == G:
        return []  # one node, or nodes of unequal size: nothing to compare
    results = []
    for slow in (True, False):
        for kib in sizes_kib:
            t = torch.zeros(kib * 256, device=device())
            hierarchical_all_reduce(t, G)  # make the node groups outside the timing
            link = Links(G, delay_s=DELAY_S if slow else 0.0, bandwidth=BANDWIDTH if slow else float("inf"))
            with link:
                r = bench.compare(f"hierarchical vs flat ring, {kib} KiB{', slow link' if slow else ''}",
                                  lambda: hierarchical_all_reduce(t, G), lambda: ring_all_reduce(t), repeats,
                                  target=0.8 if slow and kib >= 1024 else None)
            inter = {a: link_bytes(schedule(a, N, G), t.nbytes, G)["inter"] / N for a in ("hierarchical", "ring")}
            links = {"intra": (0.0, 0.0), "inter": (DELAY_S, 1 / BANDWIDTH)}
            model = {a: predict(schedule(a, N, G), t.nbytes, G, links) for a in ("hierarchical", "ring")}
            delay = (f"simulated delay alone: {model['hierarchical'] * 1e3:.1f} vs {model['ring'] * 1e3:.1f} ms"
                     if slow else "no simulated delay")
            r.note = (f"{N // G} nodes of {G}; inter-node B per rank (mean) {inter['hierarchical']:,.0f} vs "
                      f"{inter['ring']:,.0f}; {delay}")
            results.append(r)
    return results


BENCHES = {"topology": hierarchical_vs_ring}
