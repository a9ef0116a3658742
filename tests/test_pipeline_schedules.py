"""Pipeline schedules as data, checked without processes: for any P, v and M every computation runs once and
in order, every send meets its receive, the simulator finds no deadlock, and the activations kept are what
each schedule promises; the cut of a model into stages is the best one; then, on ranks, our orders are
torch's."""
import itertools

import pytest
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from harness import run, subgroup
from mini_dist.pipeline_bubble import simulate
from mini_dist.pipeline_schedules import (COMPUTE, SCHEDULES, Action, Schedule, balanced_split, live_microbatches, route, split_model,
                                          torch_order, torch_schedule, with_communication)


@st.composite
def schedules(draw, min_P=1):
    """Any schedule that builds: P stages, M microbatches (M < P and M not a multiple of P included),
    v chunks where the schedule takes them."""
    name, P, M = draw(st.sampled_from(sorted(SCHEDULES))), draw(st.integers(min_P, 6)), draw(st.integers(1, 13))
    v = draw(st.integers(1, 3)) if name in ("interleaved", "zero_bubble") else 1
    if v > 1 and M % max(1, M // P):  # rounds of about P microbatches must divide M (torch refuses it too)
        M = max(1, M // P) * (M // max(1, M // P))
    return SCHEDULES[name](P, M, v)


def compute_actions(schedule: Schedule, rank: int) -> list[Action]:
    return [a for a in schedule.actions[rank] if a.op in COMPUTE]


@pytest.mark.single_process
@given(schedules())
def test_each_microbatch_runs_forward_then_B_then_W_once_on_every_virtual_stage(schedule):
    M, v = schedule.n_microbatches, schedule.n_chunks
    split = any(a.op == "backward_weight" for actions in schedule.actions for a in actions)
    for r in range(len(schedule.actions)):
        done = compute_actions(schedule, r)
        for m in range(M):
            for c in range(v):
                ops = [a.op for a in done if (a.mb, a.chunk) == (m, c)]
                assert ops == (["forward", "backward_input", "backward_weight"] if split else ["forward", "backward"])


@pytest.mark.single_process
@given(schedules(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_the_simulation_never_deadlocks_and_runs_each_stage_after_its_neighbour(schedule, F, B, W):
    P, v = len(schedule.actions), schedule.n_chunks
    S, timeline = P * v, simulate(schedule, F, B, W)
    start, end = {}, {}
    for r, events in enumerate(timeline):
        for e in events:
            start[e.op, e.mb, e.chunk * P + r], end[e.op, e.mb, e.chunk * P + r] = e.start, e.end
    backward = "backward_input" if ("backward_input", 0, 0) in start else "backward"
    for m in range(schedule.n_microbatches):
        for j in range(1, S):  # a stage starts microbatch m once the stage before has finished it
            assert start["forward", m, j] >= end["forward", m, j - 1]
            assert start[backward, m, j - 1] >= end[backward, m, j]  # and its backward the other way
        assert start[backward, m, S - 1] >= end["forward", m, S - 1]


@pytest.mark.single_process
@example(SCHEDULES["zero_bubble"](2, 3, 2))  # 2 ranks, 2 chunks: activations and gradients share each wire,
@example(SCHEDULES["interleaved"](2, 4, 2))  # and a rank receives some messages before it needs them
@given(schedules())
def test_every_send_meets_a_receive_of_the_same_message_in_the_order_sent(schedule):
    P = len(schedule.actions)
    S, wires = P * schedule.n_chunks, {}
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            if a.op.startswith(("send", "recv")):
                peer, message = route(a, r, P, S)
                wire = (r, peer) if a.op.startswith("send") else (peer, r)
                wires.setdefault(wire, {"send": [], "recv": []})[a.op[:4]].append(message)
    for (src, dst), messages in wires.items():
        assert messages["send"] == messages["recv"], (src, dst)
    first, last = schedule.actions[0], schedule.actions[-1]
    assert not [a for a in first if a.op in ("recv_act", "send_grad") and a.chunk == 0]  # stage 0 has no stage before
    assert not [a for a in last if a.op in ("send_act", "recv_grad") and a.chunk == schedule.n_chunks - 1]


@pytest.mark.single_process
@given(schedules())
def test_activations_kept_are_M_for_gpipe_P_minus_s_for_1f1b_and_the_warmup_for_the_others(schedule):
    P, M, v, name = len(schedule.actions), schedule.n_microbatches, schedule.n_chunks, schedule.name
    G = M // max(1, M // P) if v > 1 else M  # microbatches per round
    for r, actions in enumerate(schedule.actions):
        want = {"gpipe": M, "1f1b": min(P - r, M),
                "interleaved": min((v - 1) * G + 2 * (P - 1 - r) + 1, v * M),  # warm-up forwards + 1
                "zero_bubble": min((v - 1) * G + P, v * M)}[name]  # ... + the r W's each rank defers
        assert live_microbatches(actions) == want


def test_schedules_refuse_what_they_cannot_run_and_say_what_to_change():
    for name in SCHEDULES:
        with pytest.raises(ValueError, match="at least one stage, microbatch and chunk"):
            SCHEDULES[name](2, 0)
    for name in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match=f"{name} runs one model chunk per rank, not 2: use interleaved"):
            SCHEDULES[name](2, 4, 2)
    with pytest.raises(ValueError, match=r"M=9 does not split .*torch.distributed.pipelining refuses it too"):
        SCHEDULES["interleaved"](4, 9, 2)
    assert SCHEDULES["zero_bubble"](4, 9).n_microbatches == 9  # one chunk: no rounds (torch still refuses M=9)


@pytest.mark.single_process
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.data())
def test_balanced_split_minimises_the_costliest_stage(costs, data):
    P = data.draw(st.integers(1, len(costs)))
    sizes = balanced_split(costs, P)
    assert len(sizes) == P and min(sizes) >= 1 and sum(sizes) == len(costs)

    def costliest(cuts):
        bounds = [0, *cuts, len(costs)]
        return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    brute_force = min(costliest(cuts) for cuts in itertools.combinations(range(1, len(costs)), P - 1))
    assert costliest(list(itertools.accumulate(sizes))[:-1]) == brute_force


def test_split_model_rejects_impossible_cuts():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 pipeline stages"):
        split_model(model, 3)
    with pytest.raises(ValueError, match=r"sizes \[2, 1\] must be 2 positive layer counts summing to 2"):
        split_model(model, 2, [2, 1])
    assert [len(stage) for stage in split_model(model, 2)] == [1, 1]



def test_a_computation_waiting_for_a_message_nobody_sends_is_refused_when_the_schedule_is_built():
    with pytest.raises(ValueError, match=r"rank 1 waits for \('act', 0, 1\), which rank 0 never sends"):
        with_communication("hand-made", [[], [("forward", 0, 0)]], 1)


# ----- on ranks: our orders are torch.distributed.pipelining's -----

def orders_of_torch(P, M, v, name):
    """Every rank's computations as torch's schedule lists them (each rank computes all of them)."""
    group = subgroup(range(P)) if P < dist.get_world_size() else None
    if dist.get_rank() >= P:
        return None
    schedule = torch_schedule([nn.Identity()] * v, name, M, None, group)
    return [torch_order(schedule, r) for r in range(P)]


@settings(max_examples=12)
@given(st.integers(2, 4), st.integers(1, 12), st.integers(1, 3), st.sampled_from(["interleaved", "zero_bubble"]))
def test_interleaved_and_zero_bubble_orders_equal_torch_pipeline_order(P, M, v, name):
    n = max(1, M // P)
    if M % n:  # torch refuses these (for any v); ours refuses them with v > 1 only
        M = n * (M // n)
    ours = SCHEDULES[name](P, M, v)
    # Importing torch.distributed.pipelining takes seconds per rank: only the 4-rank pool pays it
    theirs = run(4, orders_of_torch, P, M, v, name)[0]
    assert [compute_actions(ours, r) for r in range(P)] == theirs
