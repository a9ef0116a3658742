"""ZeroOptimizer's checkpoints (mini_dist/sharded_state.py): the consolidated state dict, on one rank or
on every rank, and each rank's shard alone, resume training bit for bit as if it never stopped.

Bit for bit because resuming replays the same operations on the same numbers: the same flat gradient,
reduced by the same collective, and the same element-wise update of each element; and every stage gives
identical bits (tests/test_zero.py), so the state saved by one stage may be resumed by another.
"""
import io

import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import run
from mini_dist.sharded_state import (consolidated_state_dict, load_consolidated_state_dict, load_shard_state_dict,
                                     shard_state_dict)
from mini_dist.zero_optimizer import ZeroOptimizer
from mini_dist.zero_ledger import memory_ledger
from test_zero import OPTIMIZERS, Toy, flat, hyperparameters, param_groups, shapes, train


def state_vector(saved) -> torch.Tensor:
    return torch.cat([v.double().flatten().cpu() for s in saved["state"].values() for v in s.values()
                      if isinstance(v, torch.Tensor)] + [torch.zeros(0, dtype=torch.float64)])  # cpu: as .cpu()


def round_trip_worker(shapes, stage, stage_after, opt_name, hp, half, to, broadcast, grouped, t1, t2):
    cls, dtype = OPTIMIZERS[opt_name], torch.bfloat16 if half else torch.float32
    never_stopped = Toy(shapes, dtype)
    straight = ZeroOptimizer(param_groups(never_stopped, grouped, hp["lr"]), cls, stage=stage_after, **hp)
    train(never_stopped, straight, range(t1 + t2))
    first = Toy(shapes, dtype)
    zero = ZeroOptimizer(param_groups(first, grouped, hp["lr"]), cls, stage=stage, **hp)
    train(first, zero, range(t1))
    saved = consolidated_state_dict(zero, to=to)  # to=None: on every rank
    assert (saved is None) == (to is not None and dist.get_rank() != to)
    everywhere = None if saved is None else state_vector(saved)
    src = 0 if to is None else to
    if dist.get_rank() == src:  # through bytes, as a checkpoint file would be
        buffer = io.BytesIO()
        torch.save({"model": first.state_dict(), "optimizer": saved}, buffer)
        saved = buffer.getvalue()
    box = [saved]
    dist.broadcast_object_list(box, src=src)  # every rank reads the model back
    checkpoint = torch.load(io.BytesIO(box[0]), weights_only=True)
    resumed = Toy(shapes, dtype)
    resumed.load_state_dict(checkpoint["model"])
    fresh = ZeroOptimizer(param_groups(resumed, grouped, hp["lr"]), cls, stage=stage_after, **hp)
    if broadcast:  # only rank `src` passes the optimizer state; the others pass None
        mine = checkpoint["optimizer"] if dist.get_rank() == src else None
        load_consolidated_state_dict(fresh, mine, src=src)
    else:
        load_consolidated_state_dict(fresh, checkpoint["optimizer"])
    train(resumed, fresh, range(t1, t1 + t2))
    # the loaded shard must not keep the whole consolidated buffer alive: the same bytes as never stopping
    return (torch.equal(flat(resumed), flat(never_stopped)),
            memory_ledger(resumed.ps, fresh) == memory_ledger(never_stopped.ps, straight), everywhere,
            [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in straight.param_groups])


@settings(max_examples=12)
@given(world=st.integers(1, 5), shapes=shapes, stage=st.integers(0, 2), stage_after=st.integers(0, 2),
       opt=hyperparameters, half=st.booleans(), data=st.data(), broadcast=st.booleans(), grouped=st.booleans(),
       t1=st.integers(1, 3), t2=st.integers(1, 2))
def test_consolidated_state_dict_round_trip_continues_exactly_as_if_never_stopped(
        world, shapes, stage, stage_after, opt, half, data, broadcast, grouped, t1, t2):
    assume(any(len(s) > 0 for s in shapes))  # all-0-dim models: refused by load_consolidated_state_dict (test_zero)
    to = data.draw(st.one_of(st.none(), st.integers(0, world - 1)))  # None: consolidated on every rank
    # Bit for bit: the same operations on the same numbers (and every stage gives identical bits, so the
    # state saved by one stage may be resumed by another)
    results = run(world, round_trip_worker, shapes, stage, stage_after, *opt, half, to, broadcast, grouped, t1, t2)
    for same, same_memory, _, same_settings in results:
        assert same and same_memory and same_settings
    if to is None:  # every rank holds the same, whole state
        assert all(torch.equal(r[2], results[0][2]) for r in results)


def shard_round_trip_worker(shapes, stage, opt_name, hp, half, grouped, t1, t2):
    """Each rank saves only its shard (no communication) and loads it back into a new optimizer."""
    cls, dtype = OPTIMIZERS[opt_name], torch.bfloat16 if half else torch.float32
    never_stopped, first, resumed = Toy(shapes, dtype), Toy(shapes, dtype), Toy(shapes, dtype)
    straight = ZeroOptimizer(param_groups(never_stopped, grouped, hp["lr"]), cls, stage=stage, **hp)
    train(never_stopped, straight, range(t1 + t2))
    zero = ZeroOptimizer(param_groups(first, grouped, hp["lr"]), cls, stage=stage, **hp)
    train(first, zero, range(t1))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "shard": shard_state_dict(zero)}, buffer)
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    fresh = ZeroOptimizer(param_groups(resumed, grouped, hp["lr"]), cls, stage=stage, **hp)
    load_shard_state_dict(fresh, checkpoint["shard"])
    train(resumed, fresh, range(t1, t1 + t2))
    return torch.equal(flat(resumed), flat(never_stopped)), memory_ledger(resumed.ps, fresh) == memory_ledger(
        never_stopped.ps, straight)


@settings(max_examples=8)
@given(world=st.integers(1, 5), shapes=shapes, stage=st.integers(0, 2), opt=hyperparameters, half=st.booleans(),
       grouped=st.booleans(), t1=st.integers(1, 2), t2=st.integers(1, 2))
def test_each_ranks_shard_saved_alone_resumes_exactly_as_if_never_stopped(world, shapes, stage, opt, half,
                                                                           grouped, t1, t2):
    assert all(same and same_memory for same, same_memory in
               run(world, shard_round_trip_worker, shapes, stage, *opt, half, grouped, t1, t2))


def foreign_shard_worker():
    model = Toy([(4, 3), (5,)], torch.float32)
    shard = shard_state_dict(ZeroOptimizer(model.ps, torch.optim.SGD, stage=0, lr=0.1))
    try:
        load_shard_state_dict(ZeroOptimizer(model.ps, torch.optim.SGD, stage=1, lr=0.1), shard)
    except ValueError as e:
        return str(e)


def test_a_shard_of_another_partition_is_refused_naming_both():
    for rank, error in enumerate(run(3, foreign_shard_worker)):  # 17 elements: S = 6, Psi = 18
        assert error.startswith(f"this shard is (rank, K, lo, hi, Psi) = ({rank}, 3, 0, 18, 18), this optimizer's "
                                f"is ({rank}, 3, {6 * rank}, {6 * rank + 6}, 18): load it with the same model")
