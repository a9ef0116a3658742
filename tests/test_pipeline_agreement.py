"""Pipeline ranks agree before the first message: every rank raises the same error at once, naming the ranks
that built another schedule, hold other chunks, or pass a batch that cannot be cut into M, and none hangs."""
import dataclasses
import re
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

from harness import RankFailure, device, run
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_agreement import in_action_order, message_order, under_nccls_rule
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import pipeline_chunks


def step_on_a_batch(batch, n_microbatches, first_has_inputs=True, n_targets=None):
    """Inputs only on the first stage, targets only on the last: the middle must still reject alike."""
    P = dist.get_world_size()
    s = dist.get_rank()
    stage = pipeline_chunks(nn.Sequential(*[nn.Linear(2, 2) for _ in range(P)]).to(device()))[0]
    x = torch.randn(batch, 2, device=device())
    y = torch.randn(n_targets or batch, 2, device=device())
    return pipeline_step(stage, SCHEDULES["gpipe"](P, n_microbatches), x if s == 0 and first_has_inputs else None,
                         y if s == P - 1 else None, nn.MSELoss())[0]


@pytest.mark.parametrize("args, error", [((10, 4), "a batch of 10 inputs and 10 targets cannot be cut into 4 "
                                                    "equal microbatches"),
                                         ((12, 4, False), "the first stage needs `inputs`"),
                                         ((12, 4, True, 8), "a batch of 12 inputs and 8 targets cannot be cut")])
def test_every_rank_rejects_a_bad_batch_alike_and_none_hangs(args, error):
    with pytest.raises(RankFailure) as info:
        run(3, step_on_a_batch, *args)
    for rank in range(3):
        assert f"rank {rank} failed: ValueError: {error}" in str(info.value)
    assert run(3, step_on_a_batch, 12, 4)[2] is not None  # the pool stayed in step


def step_with(schedule_of_rank, batch=4):
    """One step where each rank builds its schedule with schedule_of_rank(rank) -> (name, M)."""
    P = dist.get_world_size()
    s = dist.get_rank()
    stage = pipeline_chunks(nn.Sequential(*[nn.Linear(2, 2) for _ in range(P)]).to(device()))[0]
    x = torch.randn(batch, 2, device=device())
    y = torch.randn(batch, 2, device=device())
    name, M = schedule_of_rank(s)
    return pipeline_step(stage, SCHEDULES[name](P, M), x, y, nn.MSELoss())[0]


def rank_0_builds_for_two_microbatches(rank):
    return "1f1b", 2 if rank == 0 else 4


def rank_2_builds_gpipe(rank):
    return ("gpipe" if rank == 2 else "1f1b"), 4


def everyone_builds_1f1b(rank):
    return "1f1b", 4


@pytest.mark.parametrize("schedule_of_rank, named", [
    (rank_0_builds_for_two_microbatches, "rank 0: 1f1b with M=2, 4 stages x 1 chunk(s); ranks 1, 2, 3: 1f1b "
                                         "with M=4, 4 stages x 1 chunk(s)"),
    (rank_2_builds_gpipe, "ranks 0, 1, 3: 1f1b with M=4, 4 stages x 1 chunk(s); rank 2: gpipe with M=4")])
def test_ranks_that_built_different_schedules_all_raise_at_once_naming_them(schedule_of_rank, named):
    # Without the agreement, rank 0 of the first case waits for a message its neighbours never send, until
    # the process group's timeout (30 s in the pools, 120 s by default) names nobody.
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(4, step_with, schedule_of_rank)
    assert time.monotonic() - start < 10
    for rank in range(4):
        assert f"rank {rank} failed: ValueError: pipeline ranks disagree on the schedule: {named}" in str(info.value)
    assert run(4, step_with, everyone_builds_1f1b)[3] is not None  # the pool stayed in step


def step_where(rank_differs, how):
    """One 1f1b step (M = 4) in which rank `rank_differs` holds two chunks, or a schedule with two actions
    swapped, or every rank runs a schedule built for one stage fewer."""
    P = dist.get_world_size()
    s = dist.get_rank()
    layers = nn.Sequential(*[nn.Linear(2, 2) for _ in range(2 * P)]).to(device())
    chunks = pipeline_chunks(layers, None, 2 if how == "chunks" and s == rank_differs else 1)
    plan = SCHEDULES["1f1b"](P - (how == "stages"), 4)
    if how == "actions" and s == rank_differs:  # the same name, M, stages and chunks: only the checksum differs
        mine = list(plan.actions[s])
        mine[0], mine[1] = mine[1], mine[0]
        plan = dataclasses.replace(plan, actions=plan.actions[:s] + (tuple(mine),) + plan.actions[s + 1:])
    x = torch.randn(4, 2, device=device())
    y = torch.randn(4, 2, device=device())
    return pipeline_step(chunks, plan, x, y, nn.MSELoss())[0]


@pytest.mark.parametrize("how, said", [
    ("chunks", "the schedule runs 3 stages x 1 chunk(s) per rank, but the pipeline group has 3 ranks, holding "
               "chunks: ranks 0, 2: 1; rank 1: 2"),
    ("stages", "the schedule runs 2 stages x 1 chunk(s) per rank, but the pipeline group has 3 ranks"),
    ("actions", "pipeline ranks hold different actions under one name, 1f1b: ranks 0, 2: checksum")])
def test_ranks_with_other_chunks_actions_or_stages_all_raise_at_once_naming_them(how, said):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(3, step_where, 1, how)
    assert time.monotonic() - start < 10
    for rank in range(3):
        assert f"rank {rank} failed: ValueError: {said}" in str(info.value)
    assert run(3, step_where, 1, "nothing")[2] is not None  # the pool stayed in step


# ----- the order of messages under NCCL: one order all ranks share -----

@pytest.mark.single_process
@given(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 5), st.integers(1, 9), st.integers(1, 3))
def test_message_order_completes_under_nccls_rule_and_keeps_every_ranks_actions_in_order(name, P, M, v):
    try:
        schedule = SCHEDULES[name](P, M, v if name in ("interleaved", "zero_bubble") else 1)
    except ValueError:  # M that does not split into the interleaved rounds: refused, as torch refuses it
        assume(False)
    order = message_order(schedule)
    assert under_nccls_rule(order) == []
    for mine, theirs in zip(order, in_action_order(schedule)):
        assert sorted(mine) == sorted(theirs)  # every message to or from another rank, once
        assert [m for m in mine if m[0] == "recv"] == [m for m in theirs if m[0] == "recv"]
        for send in (m for m in theirs if m[0] == "send"):  # posted only once the receives before it are in
            before = theirs.index(send)
            assert {m for m in theirs[:before] if m[0] == "recv"} <= set(mine[:mine.index(send)])


@pytest.mark.single_process
@pytest.mark.parametrize("P, M", [(2, 2), (3, 6), (5, 7)])
def test_1f1b_posted_in_each_ranks_action_order_crosses_under_nccls_rule(P, M):
    """The lesson message_order exists for: stage s sends an activation while s+1 sends a gradient back."""
    cycle = under_nccls_rule(in_action_order(SCHEDULES["1f1b"](P, M)))
    crossing = re.match(r"rank (\d) is in isend to rank (\d) \(act .* which is in isend to rank \1 \(grad", cycle[0])
    assert crossing and int(crossing[2]) == int(crossing[1]) + 1
