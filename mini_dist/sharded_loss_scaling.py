"""Loss scaling on a sharded model: every rank agrees on an overflow before any rank steps.

DynamicLossScaler (mini_dist/loss_scaling.py) skips a step whose gradients hold inf or NaN. With plain DDP
the gradients are all-reduced first and inf + x = inf, so every replica sees the overflow. But when each rank
checks only its own slice (ZeRO-2/3 and FSDP after a reduce-scatter, tensor- and pipeline-parallel shards),
an inf in rank 1's slice is invisible to rank 0:

    rank 0: found_inf = 0 -> steps its shard, keeps S       rank 1: found_inf = 1 -> skips, S <- S/2

The model is now half updated, and next iteration rank 0 backpropagates with S and rank 1 with S/2, so
every gradient sum they share is wrong from then on. Naive: each rank decides alone (a group of one rank).
Agreed: one all-reduce(MAX) of every rank's flag before the step makes the decision global:

    skip on every rank  <=>  max over the ranks of found_inf = 1        (one number per rank)

The same number carries one more fact, 2 for fp16 gradients, so that every rank raises the same error
together, naming the ranks that hold them, instead of one rank raising while the others wait in the
all-reduce. The demo gives each rank a shard of a model, only the last rank's gradients overflowing, and
prints the steps each rank skips, agreed and alone:

    torchrun --standalone --nproc_per_node=4 mini_dist/sharded_loss_scaling.py [--steps 48 --growth-interval 4]

Mirrors torch.distributed.fsdp.ShardedGradScaler, which all-reduces its inf flag across its process group.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.loss_scaling import FP16_ADVICE, DynamicLossScaler


class ShardedLossScaler(DynamicLossScaler):
    """DynamicLossScaler whose skip every rank of `group` decides together: torch's ShardedGradScaler."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def agree_on_overflow(self, found_inf: torch.Tensor, fp16: bool) -> bool:
        """Whether any rank of the group found inf/NaN (found_inf: this rank's 0-dim flag): the same on every
        rank. One number per rank goes into one all-reduce(MAX): 1 for inf/NaN, 2 for fp16 gradients, an error
        every rank then raises together. Reading it is the one host sync of an iteration."""
        status = found_inf + 2.0 if fp16 else found_inf
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.group)
        agreed = status.item()
        if agreed >= 2:  # every rank is here: one more all-reduce names the ranks
            raise ValueError(f"unscale_: fp16 gradients on {ranks_where(fp16, found_inf.device, self.group)}; "
                             f"{FP16_ADVICE}")
        return agreed >= 1


def ranks_where(mine: bool, device, group=None) -> str:
    """'rank 3' or 'ranks 0, 3': the global ranks of the group where `mine` holds (every rank of it calls this)."""
    slots = torch.zeros(dist.get_world_size(group), device=device)
    slots[dist.get_rank(group)] = float(mine)
    dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=group)
    ranks = [dist.get_global_rank(group or dist.group.WORLD, r) for r in slots.nonzero().flatten().tolist()]
    word = "ranks" if len(ranks) > 1 else "rank"
    return f"{word} {', '.join(map(str, ranks))}"


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=48, help="training steps")
    p.add_argument("--growth-interval", type=int, default=4, help="clean steps before the scale grows (I)")
    return p


LOUD = 3.0  # |output gradient| / S on the last rank: it overflows fp16 first, once S * LOUD > 65504


def shard_data(rank: int, world: int, steps: int, device):
    """Rank r's output gradient (the last rank's the loudest) and its inputs for every step."""
    g = torch.Generator().manual_seed(1009 + rank)
    loudness = LOUD if rank == world - 1 else 0.5
    c = (loudness * torch.randn(2, 4, generator=g).sign()).to(device)
    xs = [((torch.rand(2, 8, generator=g) - 0.5) / 2).to(device) for _ in range(steps)]  # |x| < 1/4: dW < S*c
    return c, xs


def run_shards(scaler, data, steps):
    """Train one zero-initialised shard per entry of `data` (fp16-autocast linear layers, output gradient
    S*c) with one optimizer; returns (scale used, skipped) per step, and the shards."""
    params = [torch.zeros(4, 8, device=c.device, requires_grad=True) for c, _ in data]
    opt = torch.optim.SGD(params, lr=1e-3)
    trace = []
    for t in range(steps):
        with torch.autocast(params[0].device.type, dtype=torch.float16):
            outs = [F.linear(xs[t], W) for W, (_, xs) in zip(params, data)]
        loss = sum((out.float() * c).sum() for out, (c, _) in zip(outs, data))
        used = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append((used, scaler.get_scale() < used))
    return trace, params


def skipped(trace) -> list[int]:
    """The steps a trace skipped."""
    return [t for t, (_, skip) in enumerate(trace) if skip]


def demo(args) -> int:
    launch.require(args.steps >= 1 and args.growth_interval >= 1, "--steps and --growth-interval must be >= 1")
    env = launch.setup()
    hyper = dict(init_scale=2.0**10, growth_interval=args.growth_interval)
    data = shard_data(env.rank, env.world_size, args.steps, env.device)
    trace, (mine,) = run_shards(ShardedLossScaler(**hyper), [data], args.steps)
    # References: one GradScaler over every shard in one process (what one GPU would do), and torch's own
    everything = [shard_data(r, env.world_size, args.steps, env.device) for r in range(env.world_size)]
    whole, shards = run_shards(torch.amp.GradScaler(env.device.type, **hyper), everything, args.steps)
    sharded, (torchs,) = run_shards(ShardedGradScaler(env.device.type, **hyper), [data], args.steps)
    same = trace == whole == sharded and torch.equal(mine, shards[env.rank]) and torch.equal(mine, torchs)
    # Naive: each rank its own group, so each decides alone
    alone = [launch.new_group([r]) for r in range(env.world_size)][env.rank]
    lonely, _ = run_shards(ShardedLossScaler(**hyper, group=alone), [data], args.steps)
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, (skipped(trace), skipped(lonely), same))
    agreed = all(skips == skipped(trace) and ok for skips, _, ok in everyone)
    alone_skips = [skips for _, skips, _ in everyone]
    # the loudest rank decides for all: agreed, every rank skips where the last rank alone would
    loudest = alone_skips[-1] == skipped(trace)
    apart = env.world_size == 1 or alone_skips[0] != alone_skips[-1]
    launch.print0(f"steps skipped, {env.world_size} ranks, the gradients overflowing only on rank "
                  f"{env.world_size - 1}:\nagreed (one all-reduce of the flag): every rank {skipped(trace)}\n"
                  f"= one GradScaler over all {env.world_size} shards, = ShardedGradScaler (scales, skips, "
                  f"parameters bit-identical): {agreed}\neach rank alone: " + " | ".join(
                      f"rank {r}: {skips}" for r, skips in enumerate(alone_skips)))
    return launch.conclude("sharded_loss_scaling", agreed, "= GradScaler over all shards and ShardedGradScaler",
                           loudest and apart, "every rank skips where the loudest would; alone, the ranks part")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
