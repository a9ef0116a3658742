"""The bubble, predicted: the simulator plays a schedule as the executor runs it, finds the papers' bubble for
uniform stage times (exactly, where the papers give a formula), and reports a schedule that cannot run; its
timeline prints as a picture. (The executor's measured timelines are checked in test_pipeline_executor.py.)"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_dist.pipeline_actions import Action, Schedule
from mini_dist.pipeline_bubble import bubble_formula, bubble_fraction, fitting_columns, simulate, timeline_picture
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.questions.pipelines import gpipe_vs_1f1b, interleaved_and_zero_bubble
from test_pipeline_schedules import schedules


@pytest.mark.single_process
@settings(max_examples=60)
@given(schedules(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_the_simulated_bubble_is_the_papers_formula_for_uniform_stage_times(schedule, F, B, W):
    # Integer durations: the simulated bubble is one correctly rounded division of a rational, as is the
    # formula, so they agree exactly where they are the same rational.
    P = len(schedule.actions)
    M = schedule.n_microbatches
    v = schedule.n_chunks
    name = schedule.name
    simulated = bubble_fraction(simulate(schedule, F, B, W))
    formula = bubble_formula(name, P, M, v)
    if name == "zero_bubble":
        if v > 1 or W > min(F, B):
            return  # the papers give no closed form here; the simulator still plays it (tests above)
        # ZB-H1 leaves (P-1)(F+B-W) of idle time per rank where 1F1B leaves (P-1)(F+B+W)
        uniform = formula
        formula = (P - 1) * (F + B - W) / (M * (F + B + W) + (P - 1) * (F + B - W))
        assert F != B or B != W or formula == uniform
    if M >= P or name in ("gpipe", "1f1b"):
        assert simulated == formula
    else:  # fewer microbatches than ranks: a microbatch may come back round the ring before there is work
        assert simulated >= formula


def test_the_simulation_reports_a_deadlock_a_mismatch_a_lost_message_and_a_backward_too_early():
    def schedule(actions):
        return Schedule("hand-made", 1, 1, tuple(tuple(a) for a in actions))
    waits_for_grad_first = [[Action("recv_grad", 0), Action("forward", 0), Action("send_act", 0)],
                            [Action("recv_act", 0), Action("forward", 0), Action("backward", 0),
                             Action("send_grad", 0)]]
    with pytest.raises(RuntimeError, match=r"deadlock: rank 0 at Action\(op='recv_grad', mb=0, chunk=0\)"):
        simulate(schedule(waits_for_grad_first))
    swapped = [list(a) for a in SCHEDULES["gpipe"](2, 2).actions]
    swapped[1][0], swapped[1][3] = swapped[1][3], swapped[1][0]  # rank 1 receives microbatch 1 first
    with pytest.raises(RuntimeError, match=r"rank 1 recv_act expects \('act', 1, 1\) but rank 0 sent \('act', 0, 1\)"):
        simulate(schedule(swapped))
    with pytest.raises(RuntimeError, match="sent but never received: 0->1"):
        simulate(schedule([[Action("forward", 0), Action("send_act", 0)], [Action("forward", 0)]]))
    with pytest.raises(RuntimeError, match="rank 0 runs Action.op='backward'.* before its forward"):
        simulate(schedule([[Action("backward", 0), Action("forward", 0)]]))


def test_a_timeline_prints_ranks_as_rows_and_time_as_columns():
    assert timeline_picture(simulate(SCHEDULES["gpipe"](2, 2), 1, 1, 0)) == ("rank 0 |F0 F1 .  .  B0 B1\n"
                                                                            "rank 1 |.  F0 F1 B0 B1 .")
    assert timeline_picture(simulate(SCHEDULES["zero_bubble"](2, 2))) == ("rank 0 |F0 F1 .  B0 W0 B1 W1\n"
                                                                         "rank 1 |.  F0 B0 F1 B1 W0 W1")
    assert timeline_picture(simulate(SCHEDULES["interleaved"](2, 2, 2))).split("\n")[0].startswith(
        "rank 0 |F0a F1a F0b F1b")


@pytest.mark.single_process
@given(schedules(), st.integers(40, 160))
def test_a_timeline_fitted_to_a_width_keeps_every_rank_within_it(schedule, width):
    timeline = simulate(schedule)
    unit, letters = fitting_columns([timeline], 1, width)
    rows = timeline_picture(timeline, unit, letters).split("\n")
    assert len(rows) == len(schedule.actions) and max(map(len, rows)) <= width, (unit, letters, rows)
    assert letters or unit == 1  # labels only at the unit asked for


def test_a_fitted_timeline_shows_one_letter_per_column_where_labels_would_not_fit():
    timeline = simulate(SCHEDULES["gpipe"](2, 2), 1, 1, 0)
    assert fitting_columns([timeline], 1, 30) == (1, False)
    assert fitting_columns([timeline], 1, 20) == (1, True)
    assert timeline_picture(timeline, 1, letters=True) == "rank 0 |FF..BB\nrank 1 |.FFBB."


@pytest.mark.single_process
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 3))
def test_the_bubble_questions_hold_their_figures_for_any_sizes(P, M, v):
    assert gpipe_vs_1f1b(P, M)[1]
    if M % max(1, M // P) == 0:  # interleaved rounds of about P microbatches must divide M
        assert interleaved_and_zero_bubble(P, M, v)[1]


@pytest.mark.single_process
def test_a_dropped_simulated_layer_is_freed_though_its_weight_and_input_keep_its_hooks():
    """Its sleeps hang on tensor hooks, which live in C++ where Python's garbage collector cannot see a cycle:
    held strongly, every layer of every measured step would stay alive."""
    import gc
    import weakref
    import torch
    from mini_dist.pipeline_bubble import SimulatedCompute
    layer = SimulatedCompute(0.0)
    x = torch.full((), 3.0, dtype=torch.float64, requires_grad=True)  # cpu: no ranks
    layer(x).backward()
    freed = weakref.ref(layer)
    del layer
    gc.collect()
    assert freed() is None and x.grad.item() == 1.0
