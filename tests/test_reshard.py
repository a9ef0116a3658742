"""Resharding's boxes (mini_dist/reshard.py), without ranks: a flat range of any tensor as contiguous boxes
(what a ZeRO or FSDP slice saves), and a tensor-parallel slice as boxes of the global tensor (q, k and v parts
each in its own place). Saving and loading them at K and K' ranks: tests/test_checkpoint.py.
"""
from math import prod

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import reshard_exercise as judge
from reshard_exercise import MISTAKES  # noqa: F401  (the exercise's, declared beside its judge)
from mini_dist import reshard  # looked up at call time: an exercise swaps in a learner's module

shapes = st.lists(st.integers(1, 5), max_size=4).map(tuple)


# ----- the learner's exercise (./run.sh check reshard): the boxes of a flat range and of a cut tensor

@pytest.mark.exercise(judges=("flat_boxes",))
@pytest.mark.single_process
@given(shape=shapes, start=st.integers(0, 10 ** 4), length=st.integers(0, 10 ** 4))
@example(shape=(3, 4, 5), start=27, length=21)  # partial rows one and two dims down on both sides
@example(shape=(2, 3, 4), start=5, length=2)  # inside one row, and inside one row of that row
@example(shape=(5, 4), start=4, length=12)  # whole rows only
def test_the_boxes_of_a_flat_range_hold_its_elements_in_order_each_contiguous_at_most_2_ndim_minus_1(shape, start,
                                                                                                    length):
    """flat_boxes: the boxes of [a, b) hold its elements in order, each once, each box inside the tensor and
    contiguous, at most 2·ndim - 1 of them

    [a, b) = [start, start + length) brought inside the tensor's prod(shape) elements."""
    n = prod(shape)
    a = start % (n + 1)
    b = a + length % (n - a + 1)
    boxes, error = judge.learners_boxes(shape, a, b)
    said = error or judge.flat_problem(shape, a, b, boxes)
    assert said is None, f"{said}\n{judge.flat_mistake() or judge.FLAT_CONTRACT}"


@pytest.mark.exercise(judges=("dim_shard",))
@pytest.mark.single_process
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data())
def test_a_tensor_parallel_slice_is_boxes_of_the_global_tensor_each_part_in_its_place_viewing_local(shape, data):
    """dim_shard: rank `index` of `count`'s slice of each of `parts` stacked parts is Sharded of the global shape
    whose boxes are views of local, each element where it sits in the global tensor"""
    dim = data.draw(st.integers(0, len(shape) - 1), label="dim")
    count = data.draw(st.integers(1, 4), label="count")
    parts = data.draw(st.integers(1, 3), label="parts")
    index = data.draw(st.integers(0, count - 1), label="index")
    whole = list(shape)
    whole[dim] *= count * parts
    local = judge.stacked(whole, dim, index, count, parts)
    try:
        sharded = reshard.dim_shard(local, dim, index, count, parts)
    except NotImplementedError:
        raise  # a blank: its own words are the contract
    except Exception as e:
        sharded = None
        said = f"dim_shard raised {type(e).__name__}: {e}"
    else:
        said = judge.dim_problem(local, dim, index, count, parts, sharded)
    assert said is None, f"{said}\n{judge.dim_mistake() or judge.DIM_CONTRACT}"


@pytest.mark.single_process
def test_the_boxes_of_a_range_are_the_partial_rows_and_the_whole_rows_between():
    """mini_dist's own decomposition, exactly: the figure reshard.py's docstring draws."""
    assert reshard.flat_boxes((3, 4, 5), 27, 48) == [((1, 1, 2), (1, 1, 3)), ((1, 2, 0), (1, 2, 5)),
                                                      ((2, 0, 0), (1, 1, 5)), ((2, 1, 0), (1, 1, 3))]
    assert reshard.flat_boxes((), 0, 1) == [((), ())] and reshard.flat_boxes((4,), 2, 2) == []
    q = torch.arange(12.0).view(6, 2)  # cpu: indices only
    assert [o for o, _ in reshard.dim_shard(q, 0, 1, 3, parts=3).boxes] == [(2, 0), (8, 0), (14, 0)]
