"""FSDP against torch's fully_shard: step time (paired, interleaved medians) and peak memory per rank.

The model is fsdp.py's demo model (kit/models.py's block_stack) at a size where parameters dominate: 8
Blocks of width 512 (hidden 2048), 17.3M fp32 parameters, batch 16, Adam. Peak memory is what one step
holds above its start: on CUDA the allocator's peak, on the CPU glibc's heap sampled by a thread
(mini_dist/kit/measure.py): a lower bound.
"""
from functools import partial

import torch

from mini_dist import bench
from mini_dist.fsdp import FullyShardedDataParallel
from mini_dist.kit import launch, measure
from mini_dist.kit.models import Block, block_stack, fully_shard_blocks, regression_step

WIDTH = 512
DEPTH = 8
BATCH = 16
REPEATS = 7


def fsdp(args) -> list[bench.Result]:
    dev = launch.device()
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    x, y = (torch.randn(BATCH, WIDTH, generator=g).to(dev) for _ in range(2))

    def stack():
        return block_stack(WIDTH, 4 * WIDTH, DEPTH, torch.float32, dev)
    models = {"prefetch": FullyShardedDataParallel(stack(), Block),
              "naive": FullyShardedDataParallel(stack(), Block, prefetch=False),
              "fully_shard": fully_shard_blocks(stack())}
    steps = {name: partial(regression_step, m, torch.optim.Adam(m.parameters(), lr=1e-4), x, y)
             for name, m in models.items()}
    results = [bench.compare(f"fsdp step, {name}", steps[name], steps["fully_shard"], REPEATS, target)
               for name, target in (("prefetch", 1.15), ("naive", None))]
    peak = {name: measure.peak_bytes(step, dev) / 2**20 for name, step in steps.items()}
    for r, name in zip(results, ("prefetch", "naive")):
        r.note = (f"peak {peak[name]:.1f} MiB (gathered {models[name].ledger.peak / 2**20:.1f}) vs "
                  f"fully_shard {peak['fully_shard']:.1f} MiB")
    launch.print0(f"{sum(u.numel for u in models['naive'].units) / 1e6:.1f}M parameters, peak: "
                  f"{'allocator' if dev.type == 'cuda' else 'glibc heap, sampled'}, above the step's start")
    return results


BENCHES = {"fsdp": fsdp}
