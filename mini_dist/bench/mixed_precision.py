"""The loss scaler against torch's: unscale_ + inf check + step + update, per iteration.

100 fp32 gradients of 10^4 values, SGD. The scale is 1 (growth far away), so unscaling leaves the
gradients as they are and every iteration does the same work. Two pairs: our DynamicLossScaler against
torch.amp.GradScaler (no communication on either side), and our ShardedLossScaler over every rank against
torch.distributed.fsdp.ShardedGradScaler, each all-reducing its inf flag across the group.
Both sides check and unscale with the same fused kernel (torch._amp_foreach_non_finite_check_and_unscale_),
so what is measured is the rest: ours groups the gradients by dtype, makes its flag and 1/S on the device,
(sharded) agrees across ranks, and reads the flag once (the one host sync); GradScaler keeps its scale on the
device and updates it there. A sample is 10 iterations, so that the runner's barrier before each sample
weighs little on a sub-millisecond iteration: a training loop has no barrier between its iterations.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from mini_dist import bench
from mini_dist.kit import launch
from mini_dist.loss_scaling import DynamicLossScaler
from mini_dist.sharded_loss_scaling import ShardedLossScaler

TENSORS = 100
NUMEL = 10_000
REPEATS = 101
PER_SAMPLE = 10
NOTE = f"{TENSORS} x {NUMEL} fp32, times per {PER_SAMPLE} iterations"


def iteration(scaler, optimizer):
    """One sample: PER_SAMPLE iterations of unscale_, step and update."""
    def run():
        for _ in range(PER_SAMPLE):
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
    return run


def loss_scaling(args) -> list[bench.Result]:
    dev = launch.device()
    world = dist.get_world_size()
    ranks = "1 rank" if world == 1 else f"{world} ranks"
    sides = {}
    for name, scaler in [("ours", DynamicLossScaler(1.0)),
                         ("GradScaler", torch.amp.GradScaler(dev.type, 1.0)),
                         ("ours sharded", ShardedLossScaler(1.0)),
                         ("ShardedGradScaler", ShardedGradScaler(dev.type, 1.0))]:
        params = [torch.zeros(NUMEL, device=dev, requires_grad=True) for _ in range(TENSORS)]
        for p in params:
            p.grad = torch.randn(NUMEL, device=dev)
        scaler.scale(torch.ones((), device=dev))  # GradScaler creates its scale tensor here, lazily
        sides[name] = iteration(scaler, torch.optim.SGD(params, lr=0.0))
    return [bench.compare("loss scaler vs GradScaler", sides["ours"], sides["GradScaler"],
                          REPEATS, 1.1, warmup=3, note=NOTE),
            bench.compare(f"loss scaler, {ranks} vs ShardedGradScaler", sides["ours sharded"],
                          sides["ShardedGradScaler"], REPEATS, 1.1, warmup=3, note=f"inf flag across ranks; {NOTE}")]


BENCHES = {"mixed_precision": loss_scaling}
