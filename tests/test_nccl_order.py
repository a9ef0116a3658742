"""Real runs on gloo, recorded and replayed under NCCL's in-order rule: every point-to-point pattern is safe.

The rule itself, on traces written by hand, is tests/test_nccl_rule.py's. Here the planted receive-first swap
(which gloo completes) is caught, and the ring collectives and the topology all-reduces complete under NCCL's
rule at world sizes 2 to 4. The other modules that use point-to-point are replayed beside their own properties:
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
