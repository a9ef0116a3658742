"""A plan's step on a cluster (mini_dist/step_time.py): memory per GPU, seconds of communication and compute,
the bubble and Amdahl's cap, the figures often quoted recomputed, bad input in one line, and question 26's
figure (communication's share of a fixed global batch's step grows with the GPUs), each able to go red.

Integer arithmetic is asserted exactly (==); float ratios (bubble, Amdahl) with math.isclose at 1e-12
relative: a handful of float operations, each rounding by at most 2^-53.
"""
import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_dist import step_time
from mini_dist.cost_model import Cluster, Model, Plan, gpt_params, model_state_bytes
from mini_dist.kit import launch
from mini_dist.step_time import amdahl, bubble, evaluate, validate

B = 10 ** 9
MODELS = st.builds(lambda layers, head_dim, heads, seq: Model(gpt_params(layers, head_dim * heads, 1000, seq),
                                                               layers, head_dim * heads, heads, seq),
                   st.sampled_from([1, 2, 4, 6, 8]), st.integers(1, 64), st.sampled_from([1, 2, 4, 8, 12]),
                   st.integers(1, 512))


# ----------------------------------------------------------------------------- figures often quoted


def test_7b_adam_mixed_precision_needs_112_gb_and_does_not_fit_an_80_gb_gpu():
    assert model_state_bytes(7 * B, 1, 0) == (14 * B, 14 * B, 84 * B)  # 2 + 2 + 12 bytes per parameter
    assert sum(model_state_bytes(7 * B, 1, 0, "fp32", "adam")) == 112 * B  # fp32 Adam: 4 + 4 + 8, also 16
    assert not evaluate(Model(7 * B), Plan(dp=1), Cluster(gpus=1, memory_gb=80)).fits


def test_7b_fully_sharded_over_8_gpus_needs_14_gb_each():
    e = evaluate(Model(7 * B), Plan(dp=8, zero=3), Cluster(gpus=8))
    assert e.total == 14 * B and e.fits  # model states only: no shape given, so no activations


def test_70b_as_tp8_pp4_dp8_on_256_gpus_leaves_2_19b_parameters_per_gpu():
    """The often quoted ~2.2B is 70e9 / (8 x 4) = 2.1875B: TP and PP split the weights, DP copies them."""
    e = evaluate(Model(70 * B), Plan(dp=8, tp=8, pp=4), Cluster(gpus=256))
    assert e.states[0] == 2 * 2_187_500_000  # bf16 weights
    assert round(2_187_500_000 / B, 1) == 2.2


def test_pipeline_bubble_for_4_stages_is_15_8_percent_at_16_microbatches_and_8_6_at_32():
    """The often quoted ~16% and ~9% are (P-1)/(M+P-1) = 3/19 and 3/35, the idle share of the step; the
    other common form (P-1)/M = 18.75% and 9.4% measures the bubble against the compute time."""
    assert math.isclose(bubble(4, 16), 3 / 19, rel_tol=1e-12) and round(bubble(4, 16), 2) == 0.16
    assert math.isclose(bubble(4, 32), 3 / 35, rel_tol=1e-12) and round(bubble(4, 32), 2) == 0.09


def test_five_percent_serial_caps_the_speedup_at_20x_and_never_reaches_it():
    assert math.isclose(amdahl(0.05, 256), 1 / (0.05 + 0.95 / 256), rel_tol=1e-12)  # 18.6x
    assert round(amdahl(0.05, 256), 1) == 18.6
    assert all(amdahl(0.05, n) < 20 for n in (1, 8, 256, 10 ** 6))
    assert math.isclose(amdahl(0.05, 10 ** 15), 20, rel_tol=1e-12)


@pytest.mark.single_process
@given(model=MODELS, gpus=st.sampled_from([1, 2, 4, 8]), b=st.integers(1, 4), m=st.integers(1, 8))
def test_effective_batch_is_micro_batch_x_microbatches_x_dp_and_one_gpu_sends_nothing(model, gpus, b, m):
    e = evaluate(model, Plan(dp=gpus, micro_batch=b, microbatches=m), Cluster(gpus))
    assert e.effective_batch == b * m * gpus
    assert (sum(e.traffic.values()) == 0) == (gpus == 1)


@pytest.mark.parametrize("model,plan,cluster,message", [
    (Model(7 * B), Plan(dp=0), Cluster(0), "gpus must be a whole number >= 1, got 0"),
    (Model(-7), Plan(dp=8), Cluster(8), "params must be a whole number >= 1, got -7"),
    (Model(7 * B, -1, 64, 8), Plan(dp=8), Cluster(8), "layers must be a whole number >= 0"),
    (Model(7 * B, 4, 64, 8), Plan(dp=2, tp=3), Cluster(8), r"dp x tp x pp x cp = 2 x 3 x 1 x 1 must equal the 8 GPUs"),
    (Model(7 * B, 4, 60, 6), Plan(dp=2, tp=4), Cluster(8), "tp = 4 must divide the 6 heads"),
    (Model(7 * B, 6, 64, 8), Plan(dp=2, pp=4), Cluster(8), "pp = 4 must divide the 6 layers"),
    (Model(7 * B, 4, 64, 6), Plan(dp=8), Cluster(8), r"heads \(6\) must divide hidden \(64\)"),
    (Model(7 * B, 4, 64, 0), Plan(dp=8), Cluster(8), "give all of layers, hidden, heads or none"),
    (Model(7 * B), Plan(dp=12), Cluster(12), "12 GPUs are not whole nodes of 8"),
    (Model(7 * B), Plan(dp=8, zero=4), Cluster(8), r"zero stage must be one of \[0, 1, 2, 3\]"),
    (Model(7 * B), Plan(dp=8, precision="fp8"), Cluster(8), "precision must be one of"),
    (Model(7 * B), Plan(dp=8, micro_batch=-2), Cluster(8), "micro_batch must be a whole number >= 1"),
    (Model(7 * B), Plan(dp=8), Cluster(8, memory_gb=0), "memory_gb must be > 0"),
    (Model(7 * B), Plan(dp=8), Cluster(8, inter_gbps=float("nan")), "inter_gbps must be > 0"),
    (Model(7.5e9), Plan(dp=8), Cluster(8), "params must be a whole number"),
])
def test_bad_input_gets_an_error_saying_what_to_change(model, plan, cluster, message):
    with pytest.raises(ValueError, match=message):
        validate(model, plan, cluster)
    with pytest.raises(ValueError, match=message):
        evaluate(model, plan, cluster)


# ----------------------------------------------------------------------------- invariants


@pytest.mark.single_process
@given(p=st.integers(1, 64), m=st.integers(1, 1024))
def test_bubble_shrinks_with_microbatches_and_grows_with_stages(p, m):
    assert 0 <= bubble(p, m) < 1 and (bubble(p, m) == 0) == (p == 1)
    assert bubble(p, m + 1) <= bubble(p, m) <= bubble(p + 1, m)


@pytest.mark.single_process
@given(serial=st.floats(0, 1), n=st.integers(1, 10 ** 6))
def test_amdahl_speedup_is_at_most_the_workers_and_at_most_one_over_serial(serial, n):
    speedup = amdahl(serial, n)
    assert 1 - 1e-12 <= speedup <= n * (1 + 1e-12)  # 1e-12: a few roundings of 2^-53 each
    assert serial == 0 or speedup <= (1 / serial) * (1 + 1e-12)
    assert amdahl(serial, n + 1) >= speedup * (1 - 1e-12)


def test_amdahl_rejects_a_serial_fraction_outside_0_to_1():
    with pytest.raises(ValueError, match=r"serial fraction must lie in \[0, 1\]"):
        amdahl(1.5, 8)


# ----------------------------------------------------------------------------- the demo and question 26


def test_quoted_figures_fail_when_a_formula_is_broken(monkeypatch):
    """The demo's self-check can go red: break the bubble formula and it must notice."""
    assert all(ok for _, ok in step_time.quoted_figures())
    monkeypatch.setattr(step_time, "bubble", lambda p, m: (p - 1) / m)
    assert not all(ok for _, ok in step_time.quoted_figures())


def test_question_26_holds_and_says_its_figure():
    """Communication's share of a fixed global batch's step grows from 8 to 256 GPUs; Amdahl caps 5% at 20x."""
    figure, holds = step_time.scaling_stops()
    assert holds and "18.6x on 256 GPUs" in figure and "(59% communicating)" in figure, figure


def free_communication(model, plan, cluster):
    """An estimate in which compute shrinks as 1/N and communication costs nothing."""
    return SimpleNamespace(compute_s=1 / plan.dp, comm_s=0.0)


def test_question_26_fails_when_communication_stops_growing(monkeypatch):
    """The figure can go red: were communication free, its share of the step would not grow."""
    assert step_time.scaling_stops()[1]
    monkeypatch.setattr(step_time, "evaluate", free_communication)
    assert not step_time.scaling_stops()[1]


def test_the_demo_prints_the_quoted_figures_and_the_scaling_and_passes(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launch.main(step_time.parser(), step_time.demo, ["--gpus", "4", "8", "64"]) == 0
    out = capsys.readouterr().out
    assert "ok 7B, Adam, mixed precision: 112 GB > 80 GB; fully sharded over 8: 14 GB each" in out
    assert "4 GPUs" in out and "64 GPUs" in out and "256 GPUs" not in out
    assert out.strip().splitlines()[-1].startswith("SUMMARY|step_time|PASS figures often quoted 6/6|PASS "), out
