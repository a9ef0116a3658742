"""The alpha-beta model (mini_dist/alpha_beta.py): schedules against their closed forms, the slow link in the
model, the fit against synthetic timings. No ranks: every property here is arithmetic."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from mini_dist import alpha_beta as ab


@pytest.mark.single_process
@settings(max_examples=40)
@given(n=st.integers(1, 6), G=st.integers(1, 6), D=st.integers(0, 10 ** 6).map(lambda d: d * 720))
def test_schedules_send_the_bytes_of_the_closed_forms(n, G, D):
    N = n * G
    p = 1 << (N.bit_length() - 1)
    r = N - p
    ledger = lambda a: ab.link_bytes(ab.schedule(a, N, G), D * p, G)  # noqa: E731 (D*p: blocks divide)
    total = lambda a: sum(ledger(a).values())  # noqa: E731
    # ring: 2(N-1)/N * D per rank, all of it over a slow link on the n ranks at a node boundary (n > 1)
    assert ledger("ring") == {"intra": (N - n * (n > 1)) * 2 * (N - 1) * D * p // N,
                              "inter": n * (n > 1) * 2 * (N - 1) * D * p // N}
    # hierarchical: the same 2(N-1)/N * D per rank, of which only 2(n-1)/n * D/G between nodes
    assert ledger("hierarchical") == {"intra": N * 2 * (G - 1) * D * p // G, "inter": N * 2 * (n - 1) * D * p // N}
    # halving-doubling sends the ring's bytes (p ranks) plus the fold; recursive doubling log2(p) * D each
    fold = 2 * r * D * p
    assert total("halving-doubling") == p * 2 * (p - 1) * D + fold
    assert total("recursive doubling") == p * (p.bit_length() - 1) * D * p + fold


@settings(max_examples=40)
@given(N=st.integers(1, 9), alpha=st.floats(1e-7, 1e-3), beta=st.floats(1e-12, 1e-8),
       D=st.floats(0, 1e9))
@pytest.mark.single_process
def test_on_uniform_links_the_model_is_steps_times_alpha_plus_bytes_times_beta(N, alpha, beta, D):
    p = 1 << (N.bit_length() - 1)
    r, log = N - p, p.bit_length() - 1
    fold_steps, fold_bytes = (2, 2 * D) if r else (0, 0)
    closed = {"ring": (2 * (N - 1), 2 * (N - 1) / N * D),
              "recursive doubling": (log + fold_steps, log * D + fold_bytes),
              "halving-doubling": (2 * log + fold_steps, 2 * (p - 1) / p * D + fold_bytes)}
    for G in (g for g in range(1, N + 1) if N % g == 0):
        n = N // G
        closed["hierarchical"] = (2 * (G - 1) + 2 * (n - 1), 2 * (N - 1) / N * D)
        for name, (steps, nbytes) in closed.items():
            got = ab.predict(ab.schedule(name, N, G), D, G, {"intra": (alpha, beta), "inter": (alpha, beta)})
            assert math.isclose(got, steps * alpha + nbytes * beta, rel_tol=1e-12, abs_tol=1e-300), name


def test_the_slow_link_makes_only_the_inter_node_steps_slower_in_the_model():
    # 4 ranks, 2 per node: recursive doubling has 1 step inside the node and 1 across; the ring 6 across
    fast, slow = (1e-6, 1e-9), (1e-4, 1e-8)
    links = {"intra": fast, "inter": slow}
    assert math.isclose(ab.predict(ab.schedule("recursive doubling", 4, 2), 1000, 2, links),
                        fast[0] + 1000 * fast[1] + slow[0] + 1000 * slow[1])
    assert math.isclose(ab.predict(ab.schedule("ring", 4, 2), 1000, 2, links), 6 * (slow[0] + 250 * slow[1]))
    # the crossover recursive doubling -> halving-doubling on uniform links: 2a + 2Db = 4a + 1.5Db, D = 4a/b
    uniform = {"intra": fast, "inter": fast}
    at = ab.crossover("recursive doubling", "halving-doubling", 1.0, 1e9, 4, 2, uniform)
    assert math.isclose(at, 4 * fast[0] / fast[1], rel_tol=1e-9)


@given(alpha=st.floats(1e-7, 1e-2), beta=st.floats(1e-12, 1e-7),
       sizes=st.lists(st.integers(1, 1 << 26), min_size=2, max_size=8, unique=True))
@pytest.mark.single_process
def test_the_fit_recovers_alpha_and_beta_from_synthetic_timings(alpha, beta, sizes):
    times = [alpha + s * beta for s in sizes]
    got_alpha, got_beta = ab.fit_alpha_beta(sizes, times)
    # The data are exact up to one rounding each (u = 2^-53 of the largest time y); the fit's centred sums
    # add n roundings. A perturbation e_i of y_i moves beta by sum (x_i - mean) e_i / sum (x_i - mean)^2,
    # and alpha = mean(y) - beta * mean(x) by that times mean(x) plus mean(e): 4nu y bounds every e_i.
    n, u, mx = len(sizes), 2.0 ** -53, sum(sizes) / len(sizes)
    e = 4 * n * u * max(times)
    beta_bound = e * sum(abs(x - mx) for x in sizes) / sum((x - mx) ** 2 for x in sizes)
    assert abs(got_beta - beta) <= beta_bound
    assert abs(got_alpha - alpha) <= e + beta_bound * mx
