"""Gradient buckets (mini_dist/buckets.py): which gradients share a bucket (torch's assignment, run over the
parameters in reverse), the views a communication hook sees, and how a timeline measures the share of
communication hidden behind backward."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn

from mini_dist.buckets import Timeline, build_buckets


def test_buckets_for_a_given_cap_hold_the_expected_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))  # cpu: no ranks; weight 64 B, bias 16
    names = {p: n for n, p in model.named_parameters()}

    def membership(cap):
        """The parameters' names, bucket by bucket, for a cap in bytes."""
        return [[names[p] for p in b.params] for b in build_buckets(list(model.parameters()), cap)]
    assert membership(10 ** 6) == [["2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight"]]
    assert membership(100) == [["2.bias", "2.weight", "1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert membership(80) == [["2.bias", "2.weight"], ["1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert membership(1) == [[n] for n in ("2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight")]
    model[1].double()  # a buffer has one dtype: the fp64 layer gets buckets of its own
    assert membership(10 ** 6) == [["2.bias", "2.weight"], ["1.bias", "1.weight"], ["0.bias", "0.weight"]]
    bucket = build_buckets(list(model[0].parameters()), 10 ** 6)[0]
    assert bucket.buffer().numel() == 20 and [v.shape for v in bucket.gradients()] == [(4,), (4, 4)]


@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=12), cap=st.integers(0, 3000),
       first=st.one_of(st.none(), st.integers(0, 3000)))
@pytest.mark.single_process
def test_buckets_match_natives_assignment_run_over_the_parameters_in_reverse(numels, cap, first):
    params = [nn.Parameter(torch.zeros(n)) for n in numels]  # cpu: no ranks, only bucket membership
    index = {p: i for i, p in enumerate(params)}
    mine = [[index[p] for p in b.params] for b in build_buckets(params, cap, first)]
    native, _ = dist._compute_bucket_assignment_by_size(params[::-1], [cap] if first is None else [first, cap])
    assert mine == [[len(params) - 1 - i for i in bucket] for bucket in native]


@pytest.mark.single_process
@given(flights=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=6), end=st.integers(0, 80))
def test_overlap_is_the_share_of_in_flight_time_that_passed_before_backward_ended(flights, end):
    # whole seconds, so the union of the all-reduces' flights can be counted second by second
    start = [s for s, _ in flights]
    finish = [s + d for s, d in flights]
    in_flight = {t for s, f in flights for t in range(s, s + f)}  # second [t, t+1) had an all-reduce in flight
    tl = Timeline(start=start, finish=finish, backward_end=end)
    hidden = len({t for t in in_flight if t < end})
    assert tl.overlap() == (hidden / len(in_flight) if in_flight else 1.0)  # overlapping flights count once
    assert tl.exposed() == max(finish + [end]) - end
    assert len(tl.picture().splitlines()) == 2 + len(flights)  # the time axis, backward, one row per bucket
