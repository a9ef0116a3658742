"""A schedule's actions (mini_dist/pipeline_actions.py), checked without processes: the sends and receives added
to any schedule's computations meet, message for message, in the order sent; a receive comes just before the
computation that needs it and a send just after the one that produced it; a computation that waits for a message
nobody sends is refused when the schedule is built; and live_microbatches counts what a rank keeps."""
import pytest
from hypothesis import example, given

from mini_dist.pipeline_actions import Action, live_microbatches, messages_by_wire, with_communication
from mini_dist.pipeline_schedules import SCHEDULES
from test_pipeline_schedules import schedules


@pytest.mark.single_process
@example(SCHEDULES["zero_bubble"](2, 3, 2))  # 2 ranks, 2 chunks: activations and gradients share each wire,
@example(SCHEDULES["interleaved"](2, 4, 2))  # and a rank receives some messages before it needs them
@given(schedules())
def test_every_send_meets_a_receive_of_the_same_message_in_the_order_sent(schedule):
    for (src, dst), (sent, received) in messages_by_wire(schedule).items():
        assert sent == received, (src, dst)
        assert src != dst or len(schedule.actions) == 1  # a rank talks to itself only when it is the only one
    first = schedule.actions[0]
    last = schedule.actions[-1]
    assert not [a for a in first if a.op in ("recv_act", "send_grad") and a.chunk == 0]  # stage 0 has no stage before
    assert not [a for a in last if a.op in ("send_act", "recv_grad") and a.chunk == schedule.n_chunks - 1]


@pytest.mark.single_process
def test_a_receive_comes_just_before_the_computation_that_needs_it_and_a_send_just_after():
    gpipe = [("forward", 0, 0), ("forward", 1, 0), ("backward", 0, 0), ("backward", 1, 0)]
    middle = with_communication("gpipe", [gpipe] * 3, 2).actions[1]
    assert [tuple(a) for a in middle] == [
        ("recv_act", 0, 0), ("forward", 0, 0), ("send_act", 0, 0), ("recv_act", 1, 0), ("forward", 1, 0),
        ("send_act", 1, 0), ("recv_grad", 0, 0), ("backward", 0, 0), ("send_grad", 0, 0), ("recv_grad", 1, 0),
        ("backward", 1, 0), ("send_grad", 1, 0)]


@pytest.mark.single_process
def test_a_computation_waiting_for_a_message_nobody_sends_is_refused_when_the_schedule_is_built():
    with pytest.raises(ValueError, match=r"rank 1 waits for \('act', 0, 1\), which rank 0 never sends"):
        with_communication("hand-made", [[], [("forward", 0, 0)]], 1)


@pytest.mark.single_process
def test_a_microbatch_is_kept_from_its_forward_to_its_last_backward():
    one_f_one_b = [Action("forward", 0), Action("forward", 1), Action("backward", 0), Action("forward", 2),
                   Action("backward", 1), Action("backward", 2)]
    assert live_microbatches(one_f_one_b) == 2
    split = [Action("forward", 0), Action("backward_input", 0), Action("forward", 1), Action("backward_weight", 0)]
    assert live_microbatches(split) == 2  # B alone keeps the activations for W
