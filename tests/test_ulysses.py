"""DeepSpeed-Ulysses (mini_dist/ulysses.py) equals attention over the whole sequence.

The same cases as tests/test_context_parallel.py, with its helpers: every rank holds its part of one whole
q, k, v and output gradient, runs ulysses_attention on it, and compares its part of the output and of dq, dk,
dv with F.scaled_dot_product_attention on the whole sequence, in fp64, within the bound derived there (the
all-to-alls move numbers without changing them, so Ulysses rounds exactly as one-process attention over H/C
heads; the ring's bound, derived for a longer chain of roundings, covers it). Also: the bytes equal
4(C-1)/C^2 |K| forward and backward, the keys' order does not matter without the mask, and a head count
that C does not divide is refused on every rank.
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import run
from mini_dist import sequence_layout as sl
from mini_dist.ulysses import ulysses_attention
from test_context_parallel import (assert_same_clear_errors, assert_within_bound, attention_case, every_case,
                                   unmasked_any_length)


@given(world=st.integers(1, 5), data=st.data(), b=st.integers(1, 2), heads_per_rank=st.integers(1, 2),
       d=st.integers(1, 8), chunk=st.integers(1, 3), seed=st.integers(0, 1000))
def test_ulysses_equals_sdpa_on_the_whole_sequence_outputs_and_gradients(world, data, b, heads_per_rank, d,
                                                                         chunk, seed):
    """A group of any ranks of the world (size C), H = C * heads_per_rank, causal and not, both layouts."""
    ranks = sorted(data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)))
    H = heads_per_rank * len(ranks)
    assert_within_bound(run(world, every_case, {"ulysses": ulysses_attention}, ranks, b, H, chunk, d, seed))


@pytest.mark.parametrize("C", [1, 2, 3, 5])
def test_bytes_sent_are_four_all_to_alls_of_C_minus_1_over_C_squared_of_K_each_way(C):
    b, H, S, d = 2, 2 * C, 4 * C, 3
    K = b * S * H * d * 8  # all of K over the whole sequence, fp64
    for causal in (False, True):
        for _, forward, backward, _ in run(C, attention_case, ulysses_attention, list(range(C)), causal, sl.ZIGZAG,
                                            (b, H, S, d), 0):
            assert (forward, backward) == (4 * (C - 1) * K // C ** 2,) * 2, causal


def test_without_the_mask_ulysses_takes_any_split_of_any_length():
    for C in (2, 3):
        assert max(run(C, unmasked_any_length, ulysses_attention, 3 * C)) < 1e-14


@pytest.mark.parametrize("C", [2, 3, 5])
def test_heads_not_divisible_by_C_and_other_bad_input_raise_the_same_clear_error_on_every_rank(C):
    assert_same_clear_errors(ulysses_attention, C, {"heads": f"{C + 1} heads cannot be split over {C} ranks"})
