"""NCCL's in-order rule (mini_dist/nccl_rule.py), replayed on traces written by hand: no process to wait on.

The receive-first pair and the send-first ring are cycles and are named; batched, or with one side sending
first, they complete; ranks that reach collectives in another order hang; a send without its receive is
refused. The demo's written patterns hang exactly where its docstring says. Real runs, recorded on gloo and
replayed, are tests/test_nccl_order.py's.
"""
import pytest
from hypothesis import given, settings, strategies as st

from mini_dist import nccl_rule
from mini_dist.nccl_rule import Op, Unit, replay


def p2p(kind, peer, world):
    return Unit("p2p", tuple(range(world)), "test", [Op(kind, peer, tuple(range(world)), 4, "test")])


def batch(world, *ops):
    return Unit("batch", tuple(range(world)), "test", [Op(k, p, tuple(range(world)), 4, "test") for k, p in ops])


def coll(name, world):
    return Unit(name, tuple(range(world)), "test")


@pytest.mark.single_process
def test_receive_before_send_on_both_ranks_is_a_cycle_naming_both_ranks():
    traces = [[p2p("recv", 1, 2), p2p("send", 1, 2)], [p2p("recv", 0, 2), p2p("send", 0, 2)]]
    cycle = replay(traces)
    assert len(cycle) == 2 and cycle[0].startswith("rank 0 is in irecv from rank 1")
    assert "waiting for rank 1" in cycle[0]
    assert cycle[1].startswith("rank 1 is in irecv from rank 0"), cycle


@pytest.mark.single_process
def test_one_side_sending_first_or_a_batch_completes():
    assert replay([[p2p("send", 1, 2), p2p("recv", 1, 2)], [p2p("recv", 0, 2), p2p("send", 0, 2)]]) == []
    assert replay([[batch(2, ("recv", 1), ("send", 1))], [batch(2, ("recv", 0), ("send", 0))]]) == []


@pytest.mark.single_process
@settings(max_examples=50)
@given(n=st.integers(2, 6), steps=st.integers(1, 4))
def test_a_ring_of_unbatched_sends_first_hangs_and_the_batched_ring_completes(n, steps):
    unbatched = [[u for _ in range(steps) for u in (p2p("send", (r - 1) % n, n), p2p("recv", (r + 1) % n, n))]
                 for r in range(n)]
    cycle = replay(unbatched)
    assert len(cycle) == n, cycle  # every rank waits for its left neighbour's receive
    batched = [[batch(n, ("send", (r - 1) % n), ("recv", (r + 1) % n)) for _ in range(steps)] for r in range(n)]
    assert replay(batched) == []


@pytest.mark.single_process
def test_collectives_reached_in_another_order_hang_and_a_missing_receive_is_refused():
    world = 2
    a = [coll("all_reduce", world), p2p("send", 1, world)]
    b = [p2p("recv", 0, world), coll("all_reduce", world)]
    assert replay([a, b]) != []  # rank 1 waits in its receive for a send queued behind rank 0's all-reduce
    assert replay([[coll("all_reduce", world), p2p("send", 1, world)],
                   [coll("all_reduce", world), p2p("recv", 0, world)]]) == []
    with pytest.raises(ValueError, match="1 sends from rank 0 to rank 1 but 0 receives"):
        replay([[p2p("send", 1, world)], []])


@pytest.mark.single_process
@pytest.mark.parametrize("n", [2, 3, 5])
def test_of_the_demos_written_patterns_only_the_receive_first_swap_and_the_send_first_ring_hang(n):
    cycles = {name: replay(units) for name, units in nccl_rule.traces(n).items()}
    assert [name for name, cycle in cycles.items() if cycle] == ["swap, irecv before isend",
                                                                 f"ring of {n}, isend left first"]
    assert len(cycles["swap, irecv before isend"]) == 2 and len(cycles[f"ring of {n}, isend left first"]) == n
    assert cycles["swap, irecv before isend"][0] == ("rank 0 is in irecv from rank 1 (1st), waiting for rank 1, "
                                                     "which is in irecv from rank 0 (1st)")
