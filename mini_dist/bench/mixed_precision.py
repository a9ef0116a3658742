"""The loss scaler against torch's: unscale_ + inf check + step + update, per iteration.

100 fp32 gradients of 10^4 values, SGD. The scale is 1 (growth far away), so unscaling leaves the
gradients as they are and every iteration does the same work. Two pairs: our DynamicLossScaler over a
group of one rank against torch.amp.GradScaler (no communication on either side), and ours over every
rank against torch.distributed.fsdp.ShardedGradScaler, which all-reduces its inf flag across the group.
Both sides check and unscale with the same fused kernel (torch._amp_foreach_non_finite_check_and_unscale_),
so what is measured is the rest: ours groups the gradients by dtype, makes its flag and 1/S on the device,
agrees across ranks and reads the flag once (the one host sync); GradScaler keeps its scale on the device
and updates it there. A sample is 10 iterations, so that the runner's barrier before each sample
weighs little on a sub-millisecond iteration: a training loop has no barrier between its iterations.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from mini_dist import bench
from mini_dist.kit import launch
from mini_dist.loss_scaling import DynamicLossScaler

TENSORS, NUMEL, REPEATS, PER_SAMPLE = 100, 10_000, 101, 10
NOTE = f"{TENSORS} x {NUMEL} fp32, times per {PER_SAMPLE} iterations"


def iteration(scaler, optimizer):
    def run():
        for _ in range(PER_SAMPLE):
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
    return run


def loss_scaling(args) -> list[bench.Result]:
    dev, world = launch.device(), dist.get_world_size()
    alone = [launch.new_group([r]) for r in range(world)][dist.get_rank()]
    sides = {}
    for name, scaler in [("ours alone", DynamicLossScaler(1.0, group=alone)),
                         ("GradScaler", torch.amp.GradScaler(dev.type, 1.0)),
                         ("ours agreed", DynamicLossScaler(1.0)),
                         ("ShardedGradScaler", ShardedGradScaler(dev.type, 1.0))]:
        params = [torch.zeros(NUMEL, device=dev, requires_grad=True) for _ in range(TENSORS)]
        for p in params:
            p.grad = torch.randn(NUMEL, device=dev)
        scaler.scale(torch.ones((), device=dev))  # GradScaler creates its scale tensor here, lazily
        sides[name] = iteration(scaler, torch.optim.SGD(params, lr=0.0))
    return [bench.compare("loss scaler, 1 rank vs GradScaler", sides["ours alone"], sides["GradScaler"],
                          REPEATS, 1.1, warmup=3, note=NOTE),
            bench.compare(f"loss scaler, {world} rank{'s' * (world > 1)} vs ShardedGradScaler", sides["ours agreed"],
                          sides["ShardedGradScaler"], REPEATS, 1.1, warmup=3, note=f"inf flag across ranks; {NOTE}")]


BENCHES = {"mixed_precision": loss_scaling}
