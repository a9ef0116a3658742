"""Pipeline schedules as data, checked without processes: the textbook 1F1B runs P-s-1 warm-up forwards and
keeps P-s microbatches; for any P, v and M every computation runs once and in order, the simulator finds no
deadlock, and the activations kept are what each schedule promises; then, on ranks, every order is what a step
of torch's schedule runs (the textbook 1F1B's, stage by stage, its Schedule1F1B's). (The sends and receives a
schedule adds are checked in test_pipeline_actions.py.)"""
import pytest
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pp_exercise
from harness import run, subgroup
from mini_dist import pipeline_schedules  # looked up at call time: an exercise swaps in a learner's module
from mini_dist.pipeline_actions import COMPUTE, Action, Schedule, live_microbatches
from mini_dist.pipeline_bubble import simulate
from mini_dist.pipeline_schedules import SCHEDULES, torch_ran
from pp_exercise import MISTAKES, problem, written  # noqa: F401  (MISTAKES: the exercise's, beside its judge)


def first_difference(ours: list, theirs: list) -> str:
    """Where two orders part: the index, and what each runs there."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    here = written(ours[i:i + 1]) or "nothing"
    there = written(theirs[i:i + 1]) or "nothing"
    return f"computation {i} is {here} where torch's runs {there} (ours: {written(ours)}; torch: {written(theirs)})"


# ----- the textbook 1F1B, the learner's exercise (./run.sh check pipeline_schedules): the contract stage by stage,
# in one process (quick), then torch's own order on ranks; the classic mistakes named (tests/pp_exercise.py)

@pytest.mark.exercise(judges=("one_f_one_b_stage",))
@pytest.mark.single_process
@example(4, 8)
@example(5, 2)  # M < P-s-1 on stages 0 and 1: a warm-up of P-s-1 would run forwards of microbatches that do not exist
@given(st.integers(1, 8), st.integers(1, 16))
def test_textbook_1f1b_warms_up_with_P_minus_s_minus_1_forwards_and_keeps_at_most_P_minus_s(P, M):
    """one_f_one_b_stage: each F and B once, in order; min(P-s, M) forwards before the first B, then F and B in turn

    Every stage s of P, any M (M < P too): each microbatch's forward once and its backward once after it, each op
    in microbatch order, min(P-s, M) forwards before the first backward (the most activations 1F1B holds), then a
    forward and a backward in turn while forwards are left."""
    for s in range(P):
        wrong = problem(s, P, M, pp_exercise.stage(s, P, M))
        found = pp_exercise.one_f_one_b_mistake(P, M) if wrong else None
        assert wrong is None, wrong + (f"\n{found}" if found else "")


@pytest.mark.single_process
@given(st.integers(1, 8), st.integers(1, 16))
def test_gpipe_and_1f1b_are_the_generic_loops_with_a_warmup_of_M_and_of_P_minus_s_minus_1(P, M):
    # interleaved and zero bubble reuse warmup_steady_cooldown: on one chunk it is the textbook's loops
    mbs = [(m, 0) for m in range(M)]
    loops = pipeline_schedules.warmup_steady_cooldown
    for s in range(P):
        assert pipeline_schedules.gpipe_stage(s, P, M) == loops(mbs, mbs, M)
        assert pipeline_schedules.one_f_one_b_stage(s, P, M) == loops(mbs, mbs, min(P - s - 1, M))


@st.composite
def schedules(draw, min_P=1):
    """Any schedule that builds: P stages, M microbatches (M < P and M not a multiple of P included),
    v chunks where the schedule takes them."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    P = draw(st.integers(min_P, 6))
    M = draw(st.integers(1, 13))
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
    S = P * v
    timeline = simulate(schedule, F, B, W)
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
@given(schedules())
def test_activations_kept_are_M_for_gpipe_P_minus_s_for_1f1b_and_the_warmup_for_the_others(schedule):
    P = len(schedule.actions)
    M = schedule.n_microbatches
    v = schedule.n_chunks
    name = schedule.name
    G = M // max(1, M // P) if v > 1 else M  # microbatches per round
    for r, actions in enumerate(schedule.actions):
        want = {"gpipe": M, "1f1b": min(P - r, M),
                "interleaved": min((v - 1) * G + 2 * (P - 1 - r) + 1, v * M),  # warm-up forwards + 1
                "zero_bubble": min((v - 1) * G + P, v * M)}[name]  # ... + the r W's each rank defers
        assert live_microbatches(actions) == want, f"{name} P={P} M={M} v={v}: rank {r} keeps the wrong count"


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


# ----- on ranks: our orders are torch.distributed.pipelining's -----

def orders_of_torch(P, M, v, name):
    """This rank's computations as one step of torch's schedule runs them (ranks P and above: None)."""
    group = subgroup(range(P)) if P < dist.get_world_size() else None
    return torch_ran(name, M, v, group) if dist.get_rank() < P else None


@pytest.mark.exercise(judges=("one_f_one_b_stage",))
@settings(max_examples=10)
@example(4, 4)  # P = 4, M = 8
@given(st.integers(2, 4), st.integers(0, 8))
def test_textbook_1f1b_is_torch_schedule_1f1b_on_every_stage(P, extra):
    """one_f_one_b_stage: every stage's order is the one a step of torch's Schedule1F1B runs (M >= P: torch's limit)"""
    M = P + extra  # torch's Schedule1F1B refuses M < P
    # Importing torch.distributed.pipelining takes seconds per rank: only the 4-rank pool pays it
    theirs = run(4, orders_of_torch, P, M, 1, "1f1b")
    for s in range(P):
        ours = pp_exercise.stage(s, P, M)
        found = pp_exercise.one_f_one_b_mistake(P, M) if ours != theirs[s] else None
        assert ours == theirs[s], (ours if isinstance(ours, str) else f"1F1B stage {s} of P={P}, M={M}: "
                                   f"{first_difference(ours, theirs[s])}") + (f"\n{found}" if found else "")


@settings(max_examples=12)
@given(st.integers(2, 4), st.integers(1, 12), st.integers(1, 3), st.sampled_from(sorted(SCHEDULES)))
def test_every_schedules_order_is_what_a_step_of_torchs_schedule_runs(P, M, v, name):
    n = max(1, M // P)
    v = v if name in ("interleaved", "zero_bubble") else 1
    if M % n:  # torch refuses these (for any v); ours refuses them with v > 1 only
        M = n * (M // n)
    if name == "1f1b" and M < P:  # torch's Schedule1F1B refuses it
        M = P
    ours = pipeline_schedules.SCHEDULES[name](P, M, v)
    theirs = run(4, orders_of_torch, P, M, v, name)
    for r in range(P):
        assert compute_actions(ours, r) == theirs[r], f"{name} P={P} M={M} v={v}, rank {r}"
