"""Data parallelism against torch: mini DDP vs DistributedDataParallel, ZeroOptimizer vs ZeroRedundancyOptimizer.

    ./run.sh bench 4 ddp zero        (and ./run.sh bench 2 ddp zero)

ddp: one training step (forward, backward with the gradient sync, SGD) of a 10.5M-parameter fp32 MLP,
local batch 32, mini DDP with torch's default buckets against native DDP (target 1.15x); the naive
version (one all-reduce per gradient after backward) beside it, measured, no target.

zero: one Adam step of a 2.1M-parameter fp32 MLP, local batch 8: ZeroOptimizer stages 1 and 2 (native
collectives) against native DDP + ZeroRedundancyOptimizer (target 1.1x). On this model communication is
most of the step, so the collectives chosen decide the ratio; the bench prints what each one costs on
this machine for the flat gradient (D = 4 Psi bytes), which is why ZeroOptimizer reduce-scatters with
SUM (after dividing on the way in) and all-gathers with K broadcasts.

A ratio is the median of the per-step ratios ours/native of paired steps, not the ratio of the two
medians printed beside it (those come from different steps).
"""
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from mini_dist import bench
from mini_dist.ddp import DistributedDataParallel, NaiveDataParallel
from mini_dist.kit import launch
from mini_dist.kit.models import accumulation_step, mlp, random_batch_steps
from mini_dist.zero_optimizer import ZeroOptimizer

NOTE = "ratio: median of {} paired step ratios"


def ddp(args, repeats: int = 20) -> list[bench.Result]:
    dev = launch.device()
    model = mlp([1024] * 11, dtype=torch.float32).to(dev)
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = [tuple(torch.randn(32, 1024, generator=g).to(dev) for _ in "xy")]
    replicas = {"native": NativeDDP(model), "mini": DistributedDataParallel(mlp([1024] * 11, torch.float32).to(dev)),
                "naive": NaiveDataParallel(mlp([1024] * 11, torch.float32).to(dev))}
    steps = {name: partial(accumulation_step, m, torch.optim.SGD(m.parameters(), lr=1e-3), batch)
             for name, m in replicas.items()}
    results = [bench.compare(f"ddp step, {name}", steps[name], steps["native"], repeats, target,
                             warmup=2, note=NOTE.format(repeats)) for name, target in (("mini", 1.15), ("naive", None))]
    mini = replicas["mini"]
    launch.print0(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M fp32 parameters, local batch 32; mini: "
                  f"{len(mini.buckets)} buckets, {100 * mini.timeline.overlap():.0f}% of its all-reduce time "
                  f"hidden behind backward in the last step; naive: 0%")
    return results


def collective_costs(numel: int, repeats: int = 7) -> str:
    """What each way to reduce-scatter and all-gather a flat vector of `numel` fp32 costs here (medians)."""
    k = dist.get_world_size()
    S = -(-numel // k)
    flat = torch.randn(k * S, device=launch.device())
    shard = torch.empty(S, device=launch.device())

    def broadcasts():
        """Shard r from rank r to every rank, K broadcasts in flight at once."""
        works = [dist.broadcast(flat[r * S:(r + 1) * S], group_src=r, async_op=True) for r in range(k)]
        for w in works:
            w.wait()

    def reduces():
        """Shard r summed onto rank r, K reduces in flight at once."""
        works = [dist.reduce(flat[r * S:(r + 1) * S], group_dst=r, async_op=True) for r in range(k)]
        for w in works:
            w.wait()
    ways = {"all_reduce (DDP, ZeroRedundancyOptimizer)": lambda: dist.all_reduce(flat),
            "reduce_scatter_single, SUM": lambda: dist.reduce_scatter_single(shard, flat),
            "reduce_scatter_single, AVG": lambda: dist.reduce_scatter_single(shard, flat, op=dist.ReduceOp.AVG),
            "K reduces of S": reduces,
            "all_gather_single": lambda: dist.all_gather_single(flat, shard),
            "K broadcasts of S (ZeroRedundancyOptimizer)": broadcasts}
    times = bench.paired(ways, repeats)
    return "\n".join(f"  {name:<44} {bench.median(t) * 1e3:7.1f} ms" for name, t in times.items())


def zero(args, repeats: int = 61) -> list[bench.Result]:
    widths = (512, 1024, 1024, 512)

    def built(stage):  # the same model on every rank: ZeroOptimizer on the bare model, or native DDP + ZeRO
        model = mlp(widths, torch.float32).to(launch.device())
        if stage is not None:
            return model, model, ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage, lr=1e-2)
        ddp = NativeDDP(model)
        return model, ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-2)
    runs = {stage: built(stage) for stage in (1, 2)}
    native = built(None)
    steps = {name: partial(random_batch_steps, *run, 1) for name, run in [*runs.items(), ("native", native)]}
    results = [bench.compare(f"zero step, stage {stage}", steps[stage], steps["native"], repeats, 1.1,
                             warmup=2, note=NOTE.format(repeats)) for stage in (1, 2)]
    numel = runs[1][2].partition.numel
    launch.print0(f"{numel / 1e6:.1f}M fp32 parameters, Adam, local batch 8. Collectives on the flat gradient "
                  f"({4 * numel / 2**20:.1f} MiB), medians of interleaved runs:\n{collective_costs(numel)}")
    return results


BENCHES = {"ddp": ddp, "zero": zero}
