"""Pipeline stages: the balanced cut of a model is the best of every cut, the naive one is as even as layer
counts go, and a cut that cannot be made is refused saying what to change."""
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mini_dist.pipeline_stages import balanced_split, equal_split, split_model


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


@pytest.mark.single_process
@given(st.integers(1, 40), st.integers(1, 40))
def test_equal_split_gives_every_stage_its_share_of_layers_give_or_take_one(L, P):
    sizes = equal_split(L, P)
    assert len(sizes) == P and sum(sizes) == L and max(sizes) - min(sizes) <= 1


def test_split_model_rejects_impossible_cuts():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())  # cpu: cut, never run
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 pipeline stages"):
        split_model(model, 3)
    with pytest.raises(ValueError, match=r"sizes \[2, 1\] must be 2 positive layer counts summing to 2"):
        split_model(model, 2, [2, 1])
    assert [len(stage) for stage in split_model(model, 2)] == [1, 1]
