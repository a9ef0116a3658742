"""The planner (mini_dist/planner.py): figures often quoted, a plan evaluated, the recommendation's method,
bad input in one line, and the answers to questions 21 and 26.

Integer arithmetic is asserted exactly (==); float ratios (bubble, Amdahl) with math.isclose at 1e-12
relative: a handful of float operations, each rounding by at most 2^-53.
"""
import math
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ROOT, command
from mini_dist import planner
from mini_dist.cost_model import GB, Cluster, Model, Plan, amdahl, bubble, gpt_params, model_state_bytes, validate
from mini_dist.planner import candidates, evaluate, recommend

B = 10 ** 9
PRECISION = st.sampled_from(["fp32", "bf16", "fp16"])


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


def test_7b_on_8_gpus_recommends_zero1_with_checkpointing_and_70b_on_256_splits_the_model():
    """The demo's example: DDP needs 112 GB of states; ZeRO-1 fits (42.8 GB) once activations are
    checkpointed (104 GB of them at s = 4096 without). 70B: FSDP fits but moves 6.7 TB per GPU per
    step over InfiniBand (134 s against 69 s of useful compute), so TP inside the node wins. GPT-3
    175B on 1024 GPUs needs PP across nodes on top of TP8."""
    seven = Model(7 * B, 32, 4096, 32, 4096)
    best = recommend(seven, Cluster(8), Plan(dp=8, microbatches=8))
    assert (best.plan.name, round(best.total / GB, 1), best.effective_batch) == ("ZeRO-1 +ckpt", 42.8, 64)
    seventy = Model(70 * B, 80, 8192, 64, 4096)
    fsdp = evaluate(seventy, Plan(dp=256, zero=3, checkpoint=True, microbatches=16), Cluster(256))
    assert fsdp.fits and not fsdp.traffic_hidden
    best = recommend(seventy, Cluster(256), Plan(dp=256, microbatches=16))
    assert best.plan.tp > 1 and best.plan.pp == 1 and best.traffic_hidden  # TP in the node is enough
    gpt3 = Model(gpt_params(96, 12288, 50257, 2048), 96, 12288, 96, 2048)
    best = recommend(gpt3, Cluster(1024), Plan(dp=1024, microbatches=16))
    assert best.plan.tp == 8 and best.plan.pp > 1 and best.traffic_hidden  # a full node of TP is not


MODELS = st.builds(lambda layers, head_dim, heads, seq: Model(gpt_params(layers, head_dim * heads, 1000, seq),
                                                               layers, head_dim * heads, heads, seq),
                   st.sampled_from([1, 2, 4, 6, 8]), st.integers(1, 64), st.sampled_from([1, 2, 4, 8, 12]),
                   st.integers(1, 512))


@settings(max_examples=60)
@given(model=st.one_of(MODELS, st.builds(Model, st.integers(1, 10 ** 9))),
       gpus=st.sampled_from([1, 2, 4, 8, 16, 32]), per_node=st.sampled_from([1, 2, 4, 8]),
       fraction=st.integers(-5, 1), tflops=st.integers(-20, 9), b=st.sampled_from([1, 2, 4]),
       m=st.integers(1, 8), precision=PRECISION)
@pytest.mark.single_process
def test_recommendation_fits_and_splits_the_model_only_when_data_parallelism_cannot(model, gpus, per_node,
                                                                                   fraction, tflops, b, m,
                                                                                   precision):
    """Memory from 1/32 to 2x the unsharded states, compute from 1 MFLOP/s to 512 TFLOP/s (powers of 2),
    so that every branch happens: DP-only, each ZeRO stage, baselines, TP, PP, nothing fits."""
    memory = 16 * model.params * 2.0 ** fraction / GB
    cluster = Cluster(gpus, per_node, memory_gb=memory, tflops=2.0 ** tflops)
    base = Plan(dp=gpus, micro_batch=b, microbatches=m, precision=precision)
    best = recommend(model, cluster, base)
    if best is None:  # then not even the leanest data-parallel plan fits
        lean = replace(base, zero=3, checkpoint=bool(model.layers), micro_batch=1, microbatches=b * m)
        assert not evaluate(model, lean, cluster).fits
        return
    assert best.fits and best.plan.tp <= min(gpus, per_node) and best.effective_batch * best.plan.tp * \
        best.plan.pp == b * m * gpus  # accumulation trades microbatch size for steps: tokens per step kept
    hidden = lambda e: e.fits and e.traffic_hidden
    shaped = bool(model.layers)  # without a shape, activations are unknown: no baselines to try
    data_parallel = [evaluate(model, replace(base, zero=z, checkpoint=c, micro_batch=d,
                                             microbatches=b * m // d), cluster)
                     for z in range(4) for c in (False, True)[:1 + shaped]
                     for d in ((1, 2, 4) if shaped else (b,)) if b % d == 0]
    tried = [evaluate(model, p, cluster) for p in candidates(model, cluster, base)]
    if any(hidden(e) for e in tried):
        assert hidden(best)  # a plan whose traffic hides behind compute wins over one that fits only
    if best.plan.pp > 1:  # PP across nodes only when nothing without it fits with its traffic hidden
        assert not any(hidden(e) for e in tried if e.plan.pp == 1)
    if best.plan.checkpoint and hidden(best):  # recomputing only to fit, never to look compute-bound
        assert not evaluate(model, replace(best.plan, checkpoint=False), cluster).fits
    if best.plan.tp * best.plan.pp > 1:  # TP/PP only when no DP-only plan fits with its traffic hidden
        assert not any(hidden(e) for e in data_parallel)
    if best.plan.tp * best.plan.pp == 1 and hidden(best):  # and the least ZeRO stage that does
        assert not any(hidden(e) for e in data_parallel if e.plan.zero < best.plan.zero)


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


def _cli(*args):
    return command([sys.executable, "-m", "mini_dist.planner", *args], cwd=ROOT)


def test_demo_prints_the_worked_example_and_a_passing_summary_line():
    out = _cli()
    assert out.returncode == 0, out.stderr
    assert "3. simplest that fits" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("SUMMARY|planner|PASS figures often quoted 7/7|PASS ")


def test_cli_has_help_and_says_every_mistake_in_one_line_with_exit_code_2():
    """--help names every flag; an unknown flag, a value of the wrong type, a count it cannot read, an
    incomplete shape and a plan that cannot be are each one line on stderr, nothing on stdout, status 2."""
    help_ = _cli("--help")
    assert help_.returncode == 0 and all(f"--{name}" in help_.stdout for name, *_ in planner.FLAGS)
    for args, message in [(["--params", "7B", "--gpus", "0"], "gpus must be a whole number >= 1, got 0"),
                          (["--params", "7B", "--gpus", "8", "--tp", "3"], "dp x tp x pp x cp = 2 x 3 x 1 x 1"),
                          (["--params=-7B"], "params must be a whole number >= 1"),
                          (["--frobnicate"], "unrecognized arguments: --frobnicate"),
                          (["--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
                          (["--params", "7X"], "'7X' is not a count: write it like 7B"),
                          (["--layers", "4"], "give all of --layers --hidden --heads or none"),
                          (["--params", "7B", "--serial", "2"], "serial fraction must lie in [0, 1]"),
                          (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'")]:
        out = _cli(*args)
        assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, (args, out.stderr)
        assert out.stderr.startswith("python -m mini_dist.planner: error: ") and message in out.stderr, out.stderr


def test_quoted_figures_fail_when_a_formula_is_broken(monkeypatch):
    """The demo's self-check can go red: break the bubble formula and it must notice."""
    assert all(ok for _, ok in planner.quoted_figures())
    monkeypatch.setattr(planner, "bubble", lambda p, m: (p - 1) / m)
    assert not all(ok for _, ok in planner.quoted_figures())


def test_questions_21_and_26_hold_and_say_their_figures():
    """Question 21: 16 B per parameter counted in torch.optim, 112 GB for 7B, 14 GB fully sharded over 8;
    question 26: communication's share of a fixed global batch's step grows from 8 to 256 GPUs."""
    figure, holds = planner.memory_for_7b()
    assert holds and "torch holds 16 B per parameter" in figure and "14 GB per GPU" in figure, figure
    figure, holds = planner.scaling_stops()
    assert holds and "18.6x on 256 GPUs" in figure, figure


def test_question_26_fails_when_communication_stops_growing(monkeypatch):
    """The figure can go red: were communication free, its share of the step would not grow."""
    assert planner.scaling_stops()[1]
    free = lambda model, plan, cluster: SimpleNamespace(compute_s=1 / plan.dp, comm_s=0.0)  # noqa: E731
    monkeypatch.setattr(planner, "evaluate", free)
    assert not planner.scaling_stops()[1]
