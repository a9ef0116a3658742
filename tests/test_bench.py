"""The benchmark runner's arithmetic: what a ratio, a quantile and a stall share are (no clock is read here)."""
import contextlib

import pytest
from hypothesis import example, given, strategies as st

from mini_dist import bench
from mini_dist.kit import timing
from mini_dist.bench import collectives

times = st.floats(1e-5, 1.0)


@contextlib.contextmanager
def clock_free():
    """timing.timed returns what the timed function returns: the test decides every 'measured' time."""
    saved, timing.timed = timing.timed, lambda fn, group=None: fn()
    try:
        yield
    finally:
        timing.timed = saved


@pytest.mark.single_process
@given(pairs=st.lists(st.tuples(times, times), min_size=1, max_size=25), target=st.floats(0.5, 2.0))
@example(pairs=[(1.0, 1.0), (3.0, 1.0), (1.0, 3.0)], target=1.0)  # median of ratios 1.0, ratio of medians 1.0
@example(pairs=[(2.0, 1.0), (2.0, 1.0), (1.0, 4.0)], target=1.5)  # median of ratios 2.0, ratio of medians 2.0/1.0
@example(pairs=[(1.0, 2.0), (4.0, 1.0), (4.0, 8.0)], target=1.5)  # median of ratios 0.5, ratio of medians 2.0
def test_a_ratio_is_the_median_of_paired_ratios_and_each_side_keeps_its_samples(pairs, target):
    ours, native = iter([a for a, _ in pairs]), iter([b for _, b in pairs])
    with clock_free():
        r = bench.compare("x", lambda: next(ours), lambda: next(native), len(pairs), target, warmup=0)
    ratios = sorted(a / b for a, b in pairs)
    n = len(ratios)
    assert r.ratio == (ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2)
    assert sorted(r.times["ours"]) == sorted(a for a, _ in pairs)      # every sample, none dropped
    assert sorted(r.times["native"]) == sorted(b for _, b in pairs)
    assert [a / b for a, b in zip(r.times["ours"], r.times["native"])] == [a / b for a, b in pairs]  # in pairs
    assert r.ours == bench.median([a for a, _ in pairs]) and r.native == bench.median([b for _, b in pairs])
    assert r.ok == (r.ratio <= target)


@pytest.mark.single_process
def test_the_sides_take_turns_so_noise_slows_both_alike():
    order = []
    with clock_free():
        bench.paired({"ours": lambda: order.append("o") or 1.0, "native": lambda: order.append("n") or 1.0},
                     repeats=3, warmup=1)
    assert "".join(order) == "onnoonno"  # warm-up pair, then three pairs, each pair in the other order


@pytest.mark.single_process
@given(xs=st.lists(times, min_size=1, max_size=60), q=st.floats(0, 1))
def test_a_quantile_is_a_sample_with_the_right_share_below_it(xs, q):
    v = bench.quantile(xs, q)
    assert v in xs
    assert bench.quantile(xs, 0.0) == min(xs) and bench.quantile(xs, 1.0) == max(xs)
    below = sum(x < v for x in xs)
    assert below <= round(q * (len(xs) - 1)) < below + xs.count(v)  # nearest rank


@pytest.mark.single_process
@given(fast=st.lists(st.floats(1e-4, 2e-3), min_size=10, max_size=40),
       slow=st.lists(st.floats(0.0, 8e-3), max_size=20))
def test_a_stalled_call_is_one_that_lost_stall_s_or_more_against_the_10th_percentile(fast, slow):
    samples = fast + [max(fast) + collectives.STALL_S + 1e-6 + s for s in slow]  # each lost >= STALL_S
    q10, med, share = collectives.split(samples)
    assert q10 == bench.quantile(samples, 0.1) and med == bench.median(samples)
    assert share == sum(t > q10 + collectives.STALL_S for t in samples) / len(samples)
    if round(0.1 * (len(samples) - 1)) < len(fast):  # the 10th percentile is a fast call: the slow ones count
        assert share == len(slow) / len(samples)


@pytest.mark.single_process
def test_the_table_says_its_ratio_is_the_median_of_paired_ratios_and_its_times_units():
    r = bench.Result("x", 1.23e-3, 2.44e-3, 1.11, 1.2)  # 1.23 ms | 2.44 ms | 1.11x: no error, a median of pairs
    text = bench.table([r])
    assert "1.23 ms" in text and "2.44 ms" in text and "1.11x" in text and "<= 1.2x" in text
    assert "median of pairs" in text.splitlines()[0] and "our time / native time in the same pair" in text
