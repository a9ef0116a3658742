"""NCCL's in-order rule, replayed on the CPU: every point-to-point pattern of mini_dist is deadlock-free.

First the replay itself, on traces written by hand (single process): the receive-first pair and the
send-first ring are cycles and are named; batched, they complete; ranks that reach collectives in another
order hang. Then real runs on gloo, recorded and replayed: the planted receive-first swap (which gloo
completes) is caught, and the ring collectives and the topology all-reduces complete under NCCL's rule at
world sizes 2 to 4. The other modules that use point-to-point are replayed beside their own properties:
ring attention (test_context_parallel.py), the expert all-to-all (test_expert_parallel.py), the textbook
GPipe and 1F1B steps (test_pipeline.py, where 1F1B's steady state as two calls, send then receive, is a
cycle), every pipeline schedule run by the executor (test_pipeline_executor.py) and its messages alone
(test_pipeline_messages.py).
"""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from harness import device, rank_generator, run
from mini_dist import nccl_order
from mini_dist.nccl_order import Op, Unit, replay


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


# ----- real runs on gloo, recorded and replayed

def planted(batched):
    return nccl_order.check(nccl_order.receive_first, device(), batched)


def test_the_planted_receive_first_swap_runs_on_gloo_and_is_caught():
    cycles = run(2, planted, False)
    assert cycles[0] and "rank 0 is in irecv from rank 1 (nccl_order.py" in cycles[0][0], cycles[0]
    assert run(2, planted, True) == [[], []]


def ring_collectives(numel, seed):
    from mini_dist import ring_allreduce, ring_pipelined as ring  # the library's: the textbook's steps under NCCL
    n = dist.get_world_size()
    x = torch.randn(numel, generator=rank_generator(seed)).to(device())
    out = torch.empty(n * numel, device=device())
    cycles = nccl_order.check(ring.ring_all_reduce, x.clone())
    cycles += nccl_order.check(ring.ring_all_gather, out, x)
    cycles += nccl_order.check(ring.ring_reduce_scatter, torch.empty(numel, device=device()), out)
    cycles += nccl_order.check(ring_allreduce.naive_all_reduce, x.clone())
    return cycles


@settings(max_examples=6)
@given(world=st.integers(2, 4), numel=st.integers(0, 300_000), seed=st.integers(0, 9))
def test_the_ring_collectives_complete_under_ncclsrule(world, numel, seed):
    assert run(world, ring_collectives, numel, seed) == [[]] * world


def topology_all_reduces(numel, ranks_per_node):
    from mini_dist import topology as topo
    x = torch.randn(numel, generator=rank_generator(numel)).to(device())
    cycles = []
    for name in ("hierarchical", "recursive_doubling", "halving_doubling"):
        fn = {"hierarchical": lambda t: topo.hierarchical_all_reduce(t, ranks_per_node),
              "recursive_doubling": topo.recursive_doubling_all_reduce,
              "halving_doubling": topo.halving_doubling_all_reduce}[name]
        cycles += [f"{name}: {line}" for line in nccl_order.check(fn, x.clone())]
    return cycles


@pytest.mark.parametrize("world,ranks_per_node", [(2, 1), (3, 1), (4, 2)])
def test_the_topology_all_reduces_complete_under_nccls_rule(world, ranks_per_node):
    assert run(world, topology_all_reduces, 1000, ranks_per_node) == [[]] * world
