"""The planner (mini_dist/planner.py): the recommendation follows the method (the simplest plan that fits with
its traffic hidden, model splits only when data parallelism cannot), the worked example, bad input in one
line, and the answer to question 21. A plan's costs and the figures often quoted are tested with
mini_dist/step_time.py (tests/test_step_time.py).
"""
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ROOT, command
from mini_dist import planner
from mini_dist.cost_model import GB, Cluster, Model, Plan, gpt_params
from mini_dist.planner import candidates, recommend
from mini_dist.questions import everything
from mini_dist.step_time import evaluate
from test_step_time import MODELS

B = 10 ** 9
PRECISION = st.sampled_from(["fp32", "bf16", "fp16"])


# ----------------------------------------------------------------------------- the method


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


def hidden(e) -> bool:
    """The plan fits and its traffic could hide behind its compute."""
    return e.fits and e.traffic_hidden


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


def _cli(*args):
    return command([sys.executable, "-m", "mini_dist.planner", *args], cwd=ROOT)


def test_demo_prints_the_worked_example_and_a_passing_summary_line():
    out = _cli()
    assert out.returncode == 0, out.stderr
    assert "3. simplest that fits" in out.stdout
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("SUMMARY|planner|PASS 7B on 8 x 80 GB: ZeRO-1 +ckpt fits"), summary
    assert "|PASS its states 38.5 GB/GPU = 4N + 12N/K = 38.5 GB" in summary, summary


def in_process(args, capsys):
    """The planner's command line run in this process: (exit status, stdout, stderr)."""
    try:
        code = planner.demo(args)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_has_help_and_says_every_mistake_in_one_line_with_exit_code_2(capsys):
    """--help names every flag; an unknown flag, a value of the wrong type, a count it cannot read, an
    incomplete shape and a plan that cannot be are each one line on stderr, nothing on stdout, status 2 (the
    first as `python -m` runs it, the others in this process: the same parser and the same exit)."""
    help_ = _cli("--help")
    flags = [flag for action in planner.parser()._actions for flag in action.option_strings]
    assert help_.returncode == 0 and len(flags) == 23 and all(flag in help_.stdout for flag in flags)
    out = _cli("--frobnicate")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr == "python -m mini_dist.planner: error: unrecognized arguments: --frobnicate\n", out.stderr
    for args, message in [(["--params", "7B", "--gpus", "0"], "gpus must be a whole number >= 1, got 0"),
                          (["--params", "7B", "--gpus", "8", "--tp", "3"], "dp x tp x pp x cp = 2 x 3 x 1 x 1"),
                          (["--params=-7B"], "params must be a whole number >= 1"),
                          (["--frobnicate"], "unrecognized arguments: --frobnicate"),
                          (["--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
                          (["--params", "7X"], "'7X' is not a count: write it like 7B"),
                          (["--layers", "4"], "give all of --layers --hidden --heads or none"),
                          (["--params", "7B", "--serial", "2"], "serial fraction must lie in [0, 1]"),
                          (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'")]:
        code, stdout, stderr = in_process(args, capsys)
        assert code == 2 and stdout == "" and stderr.count("\n") == 1, (args, stderr)
        assert stderr.startswith("python -m mini_dist.planner: error: ") and message in stderr, stderr


def test_question_21_holds_and_says_its_figure():
    """16 B per parameter counted in torch.optim, 112 GB for 7B, 14 GB fully sharded over 8, the planner's pick."""
    figure, holds = everything.memory_for_7b()
    assert holds and "torch holds 16 B per parameter" in figure and "14 GB per GPU" in figure, figure
    assert "the planner's pick for 8 x 80 GB, seq 4096: ZeRO-1 +ckpt, 42.8 GB per GPU" in figure, figure
