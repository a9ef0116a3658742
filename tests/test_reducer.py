"""DDP's reducer (mini_dist/reducer.py): what its bucket-ready hook leaves (the mean gradient, every bucket sent
once, in order, the moment it can: the learner's exercise, judged by tests/reducer_exercise.py), and when each
bucket's all-reduce starts (during backward, bucket 0 before the last bucket has its gradients). Which
gradients share a bucket, and the timeline: tests/test_buckets.py; against native DDP: tests/test_ddp.py."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings, strategies as st

import reducer_exercise
from harness import device, run
from mini_dist import ddp
from mini_dist.ring_pipelined import ring_all_reduce
from reducer_exercise import MISTAKES  # noqa: F401  (the bucket hook's, declared beside its judge)
from test_ddp import F64, Net, trainable_bytes

# ----- the bucket-ready hook, the learner's exercise: judged for any correct way of writing it

nets = st.fixed_dictionaries(dict(
    widths=st.lists(st.integers(1, 5), min_size=3, max_size=5), bias=st.booleans(), frozen=st.booleans(),
    tied=st.booleans(), unused=st.booleans(), cap=st.sampled_from(["one bucket", "several", "one param each"])))


@pytest.mark.exercise(judges=("Reducer._fill",))
@settings(max_examples=10)
@given(world=st.integers(1, 5), spec=nets, hook=st.sampled_from(reducer_exercise.HOOKS),
       collective=st.sampled_from(["native", "ring"]), seed=st.integers(0, 10 ** 6))
@example(world=3, spec=dict(widths=[3, 4, 2], bias=True, frozen=False, tied=False, unused=True, cap="several"),
         hook=None, collective="native", seed=1)
@example(world=2, spec=dict(widths=[3, 4, 2], bias=True, frozen=False, tied=False, unused=False,
                            cap="one param each"), hook="allreduce", collective="native", seed=2)
def test_after_each_synced_backward_every_grad_is_the_mean_over_the_ranks_the_same_on_every_rank(
        world, spec, hook, collective, seed):
    """after backward every .grad is the mean over the ranks (within N+1 roundings), the same bits on every rank

    Two synced backwards of a drawn model (a frozen weight, a tied one, a parameter no forward uses): each
    parameter some rank used holds the mean of the ranks' gradients, within gamma_(N+1) * sum|g_i| / N of the
    exact one, however the division by N is placed; every rank holds the same bits. Under a communication hook
    (torch's allreduce_hook, which divides by N itself) the same mean."""
    seen = run(world, reducer_exercise.synced_backwards, "net", spec, seed, hook, collective)
    wrong = reducer_exercise.judged(seen, hook)
    assert wrong is None, wrong


orders = st.integers(2, 5).flatmap(lambda n: st.permutations(list(range(n))))


@pytest.mark.exercise(judges=("Reducer._fill",))
@settings(max_examples=10)
@given(world=st.integers(1, 3), order=orders, bias=st.booleans(),
       cap=st.sampled_from(["several", "one param each"]), seed=st.integers(0, 10 ** 6))
@example(world=2, order=[0, 1, 2, 3], bias=True, cap="one param each", seed=0)
@example(world=2, order=[2, 0, 3, 1], bias=True, cap="one param each", seed=0)
def test_each_bucket_goes_to_launch_once_in_bucket_order_the_moment_it_and_the_buckets_before_it_are_full(
        world, order, bias, cap, seed):
    """each bucket goes to _launch once, in bucket order, the moment it and the buckets before it are full

    Square layers applied in a drawn order, so gradients arrive in another order than the buckets hold them: a
    bucket goes only after every bucket ahead of it (every rank issues the same all-reduces in the same order),
    and as soon as that holds, from inside the hook, so that it travels while backward goes on."""
    spec = dict(width=3, order=tuple(order), bias=bias, cap=cap)
    seen = run(world, reducer_exercise.synced_backwards, "permuted", spec, seed, None, "native")
    wrong = reducer_exercise.judged(seen, timing=True, values=False)
    assert wrong is None, wrong


# ----- when the all-reduces start, on the timeline


def launch_order(widths, collective):
    model = Net(widths)
    all_reduce = ring_all_reduce if collective == "ring" else dist.all_reduce
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=trainable_bytes(model) / 4 / 2 ** 20,
                                       all_reduce=all_reduce)
    x = torch.randn(3, widths[0], dtype=F64, device=device())
    mini(x).square().sum().backward()
    t = mini.timeline
    return len(mini.buckets), t.start[0] < t.ready[-1], max(t.start) < t.backward_end


@pytest.mark.parametrize("world,collective", [(2, "native"), (3, "ring"), (5, "native")])
def test_all_reduces_start_during_backward_for_multi_bucket_models(world, collective):
    for rank, (n_buckets, first_before_last_ready, during) in enumerate(run(world, launch_order, [8] * 6,
                                                                            collective)):
        assert n_buckets >= 3
        # bucket 0 (the last layers) went out before the first layer's gradients existed
        assert first_before_last_ready, f"rank {rank}: bucket 0's all-reduce started after the last bucket filled"
        assert during, f"rank {rank}: an all-reduce started only after backward ended"
