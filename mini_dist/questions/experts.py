"""Figures for the questions about experts (section 8 of the reading order) that are not a demo's own.

    traffic_and_stragglers   question 17: what expert parallelism sends, and why a skewed router makes a straggler

Each function is the measure of its question (mini_dist/questions/questions.md): every rank of the question's
group calls it and gets (figure, holds). The layer, its check against the one-process MoE and its byte formula
are the concept's own (expert_parallel.parallel_like, against_one_process), so a figure here cannot drift.
"""
import torch
import torch.distributed as dist

from mini_dist import comm
from mini_dist.expert_parallel import against_one_process, p2p_all_to_all, parallel_like
from mini_dist.kit import launch
from mini_dist.moe import MoE, skewed_tokens


def traffic_and_stragglers(experts=8, k=2, hidden=8, seed=0) -> tuple[str, bool]:
    """What expert parallelism sends and why a skewed router makes a straggler, on the ranks of the world:
    the layer against one process, its bytes against the formula; then the rows that reach the busiest
    rank when the tokens have no common direction and when they all lean one way. (figure, holds)."""
    W = dist.get_world_size()
    rank = dist.get_rank()
    h = hidden
    dev = launch.device()
    torch.manual_seed(seed)  # the same router and experts on every rank
    dense = MoE(h, 2 * h, experts, k, None, device=dev, dtype=torch.float64)
    xs = [skewed_tokens(16 + 3 * q, h, seed, q) for q in range(W)]
    dys = [skewed_tokens(16 + 3 * q, h, seed + 1, q) for q in range(W)]
    diff, nbytes, want = against_one_process(dense, p2p_all_to_all, xs, dys)
    layer = parallel_like(dense)
    load = {}  # skew -> rows on the busiest rank / the mean
    for skew in (0.0, 4.0):
        with torch.no_grad():
            layer(skewed_tokens(64, h, seed + 2, rank, skew=skew))
        rows = comm.all_gather(torch.tensor([sum(layer.received)], device=dev), 0).double()
        load[skew] = (rows.max() / rows.mean()).item()
    worst = comm.all_reduce(torch.tensor([diff, nbytes != want], dtype=torch.float64, device=dev),
                            op=dist.ReduceOp.MAX)  # over the ranks
    diff, off = worst.tolist()
    if W > 1:
        straggler = load[4.0] > load[0.0]
        why = "that rank computes longest and the return trip waits for it"
    else:  # one rank: the busiest is the mean
        straggler = load == {0.0: 1.0, 4.0: 1.0}
        why = "one rank holds every expert, no rank waits for another"
    figure = (f"E = {experts} experts on {W} ranks, top-{k}: rank {rank} sent {nbytes:,} B of rows by all-to-all, "
              f"forward and back, = 2(rows out + rows in)*h*8 (= one process to {diff:.0e}); rows reaching the "
              f"busiest rank: {load[0.0]:.2f}x the mean for tokens without a common direction, {load[4.0]:.2f}x "
              f"when all lean one way: {why}")
    return figure, diff <= 1e-12 and off == 0 and straggler
