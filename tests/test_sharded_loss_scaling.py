"""ShardedLossScaler: an overflow on one rank skips the step on every rank, exactly as one GradScaler over all
the shards would and as torch's ShardedGradScaler does; fp16 gradients make every rank raise together, naming
the ranks that hold them.

Every comparison is exact (torch.equal / ==), no tolerance, for the reason tests/test_loss_scaling.py gives.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import harness
from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist.sharded_loss_scaling import ShardedLossScaler
from test_loss_scaling import count_steps


def sharded_run(seed, steps, injected, hyper, members, loud=30.0, alone=False):
    """Each member rank trains its own shard with ShardedLossScaler, and with torch's ShardedGradScaler; the
    reference is one GradScaler over all the shards in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    singletons = [subgroup([r]) for r in range(world)] if alone else None
    group = singletons[rank] if alone else (subgroup(members) if len(members) < world else None)
    if rank not in members:
        return None
    dev, g = device(), rank_generator(seed)
    own = [(torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g),  # cpu: all-gathered as objects,
            loud * torch.randn(2, 3, generator=g)) for _ in range(steps)]  # cpu: moved to dev in train()
    for t, r in injected.items():
        if r == rank and t < steps:
            own[t][1][0, t % 4] = math.inf
    everyone = [None] * len(members)
    dist.all_gather_object(everyone, own, group=subgroup(members) if len(members) < world else None)

    def train(scaler, shard_data):
        shards = [d[0][0].to(dev, copy=True).requires_grad_() for d in shard_data]
        opt = torch.optim.SGD(shards, lr=1e-2)
        calls, trace = count_steps(opt), []
        for t in range(steps):
            loss = 0
            for W, d in zip(shards, shard_data):
                with torch.autocast(dev.type, dtype=torch.float16):
                    y = F.linear(d[t][1].to(dev), W)
                loss = loss + (y.float() * d[t][2].to(dev)).sum()
            before = len(calls)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            trace.append((scaler.get_scale(), len(calls) == before))
        return trace, [W.detach().cpu() for W in shards]

    mine, (mine_shard,) = train(ShardedLossScaler(**hyper, group=group), [own])
    ref, ref_shards = train(torch.amp.GradScaler(dev.type, **hyper), everyone)
    torchs, (torchs_shard,) = train(ShardedGradScaler(dev.type, **hyper, process_group=group or dist.group.WORLD),
                                    [own])
    same = torch.equal(mine_shard, ref_shards[members.index(rank)]) and torch.equal(mine_shard, torchs_shard)
    return mine, ref, same, torchs


@given(world=st.integers(1, 5), seed=st.integers(0, 2**16), steps=st.integers(3, 10),
       injected=st.dictionaries(st.integers(0, 9), st.integers(0, 4), max_size=3),
       interval=st.integers(1, 3), init_scale=st.sampled_from([2.0**8, 2.0**12]),
       drop=st.sets(st.integers(0, 4), max_size=2))
@settings(max_examples=15)
def test_overflow_on_one_rank_makes_every_rank_skip_exactly_like_one_grad_scaler_over_all_shards(
        world, seed, steps, injected, interval, init_scale, drop):
    members = [r for r in range(world) if r not in drop] or [0]
    hyper = dict(init_scale=init_scale, growth_interval=interval)
    results = run(world, sharded_run, seed, steps, injected, hyper, members)
    ref = results[members[0]][1]
    for r in members:
        mine, _, same_shard, torchs = results[r]
        assert mine == ref, f"rank {r}: (scale, skipped) per step differ from one GradScaler over all shards"
        assert mine == torchs, f"rank {r}: (scale, skipped) per step differ from ShardedGradScaler's"
        assert same_shard, f"rank {r}: its shard differs from the same shard under GradScaler or ShardedGradScaler"
    skipped = {t for t, (_, s) in enumerate(ref) if s}
    overflowed = {t for t, r in injected.items() if r in members and t < steps}
    assert overflowed <= skipped, "a step with an inf on one rank was not skipped by every rank"


@pytest.mark.parametrize("world", [1, 2, 5])
def test_with_no_overflow_anywhere_every_rank_steps_every_time(world):
    results = run(world, sharded_run, 7, 6, {}, dict(init_scale=2.0**8), list(range(world)), loud=1.0)
    for mine, ref, same_shard, torchs in results:
        assert mine == ref == torchs and same_shard
        assert [skipped for _, skipped in mine] == [False] * 6


@pytest.mark.parametrize("world", [2, 3])
def test_without_a_shared_group_only_the_overflowing_rank_skips(world):
    """The negative control: the all-reduce over the group is what makes the skip collective."""
    results = run(world, sharded_run, 3, 4, {2: world - 1}, dict(init_scale=2.0**8),
                  list(range(world)), alone=True)
    skipped = [[t for t, (_, s) in enumerate(mine) if s] for mine, _, _, _ in results]
    assert skipped[world - 1] == [2] and all(s == [] for s in skipped[:-1])


def fp16_grads_on(bad_ranks, members):
    group = subgroup(members) if len(members) < dist.get_world_size() else None
    if dist.get_rank() not in members:
        return None
    dtype = torch.float16 if dist.get_rank() in bad_ranks else torch.float32
    p = torch.zeros(3, device=device(), dtype=dtype, requires_grad=True)
    p.grad = torch.ones_like(p)
    ShardedLossScaler(group=group).unscale_(torch.optim.SGD([p], lr=1.0))


@pytest.mark.parametrize("world,members,bad,named", [
    (3, (0, 1, 2), (1,), "rank 1;"), (4, (0, 1, 2, 3), (0, 3), "ranks 0, 3;"),
    (4, (1, 2, 3), (3,), "rank 3;")])  # a subgroup: rank 3 is its group rank 2, named by its global rank
def test_fp16_gradients_make_every_rank_raise_the_same_error_naming_the_ranks_that_hold_them(
        world, members, bad, named):
    run(world, fp16_grads_on, (), members)
    pids = [p.pid for p in harness._pools[world].procs]
    with pytest.raises(RankFailure, match=f"fp16 gradients on {named} S\\*g/S in fp16 underflows") as info:
        run(world, fp16_grads_on, bad, members)
    assert all(f"rank {r} failed: ValueError" in str(info.value) for r in members)
    if len(members) == world:  # the same error on every rank: the harness keeps the pool, nobody blocked
        assert [p.pid for p in harness._pools[world].procs] == pids
