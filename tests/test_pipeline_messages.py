"""The messages of a pipeline step without a model (mini_dist/pipeline_messages.py): for every schedule, any number
of stages, microbatches and chunks, every receive gets the message it waits for, posted at once (gloo's path) or
in message_order (NCCL's), with or without a checked header on every message; a stage sends M activations each
way and one header per stage it feeds; and the messages complete under NCCL's in-order rule (replayed by
nccl_order). (A message the receiver did not expect, and a lost neighbour, are named in test_pipeline_executor.py.)"""
import pytest
import torch.distributed as dist
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from harness import run, subgroup
from mini_dist import nccl_order
from mini_dist.kit import debug, launch
from mini_dist.pipeline_messages import bytes_formula, relay
from mini_dist.pipeline_schedules import SCHEDULES


def relayed(name, P, M, v, width, headers, nccl_path):
    """One step's messages of schedule `name` on ranks 0..P-1 of the pool: (bytes sent, every message right)."""
    group = subgroup(range(P)) if P < dist.get_world_size() else None
    if dist.get_rank() >= P:
        return None
    saved = (debug.DEBUG, launch.PRETEND_NCCL)
    debug.DEBUG = headers
    launch.PRETEND_NCCL = nccl_path
    try:
        return relay(SCHEDULES[name](P, M, v), (2, width), group)
    finally:
        debug.DEBUG, launch.PRETEND_NCCL = saved


@settings(max_examples=20)
@example(name="interleaved", P=1, M=4, v=2, width=2, headers=False, nccl_path=False)  # every message stays home
@example(name="zero_bubble", P=2, M=3, v=2, width=3, headers=True, nccl_path=True)  # both kinds share each wire
@given(name=st.sampled_from(sorted(SCHEDULES)), P=st.integers(1, 4), M=st.integers(1, 9), v=st.integers(1, 3),
       width=st.integers(1, 5), headers=st.booleans(), nccl_path=st.booleans())
def test_every_receive_gets_the_message_it_waits_for_and_the_bytes_are_the_formula(name, P, M, v, width, headers,
                                                                                  nccl_path):
    v = v if name in ("interleaved", "zero_bubble") else 1
    assume(v == 1 or M % max(1, M // P) == 0)  # interleaved rounds of about P microbatches must divide M
    results = run(4, relayed, name, P, M, v, width, headers, nccl_path)[:P]
    assert [right for _, right in results] == [True] * P
    assert [sent for sent, _ in results] == bytes_formula(P, M, v, 2 * width * 4)  # fp32; debug headers uncounted


def replayed(name, M, v):
    return nccl_order.check(relay, SCHEDULES[name](dist.get_world_size(), M, v), (2, 3))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("world, M, v", [(2, 3, 2), (5, 7, 3)])
def test_every_schedules_messages_complete_under_nccls_in_order_rule(world, M, v, name):
    v = v if name in ("interleaved", "zero_bubble") else 1
    M = M if v == 1 or M % max(1, M // world) == 0 else world
    assert run(world, replayed, name, M, v) == [[]] * world
