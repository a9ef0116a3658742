"""A learner's first hour: every demo is a command, every mistake one clear line.

In-process (fast): each module's command line answers --help with its flags and exit 0, refuses an unknown flag
with exit 2, and refuses a configuration it cannot run with exit 2 and one line that says what to change,
before any process group exists (WORLD_SIZE comes from the environment, as torchrun sets it). Through
./run.sh (a few real torchrun runs): the rank count is only a number, the planner takes none, torchrun's
40-line report does not bury a usage error, and no OMP_NUM_THREADS warning appears.
"""
import importlib
import os
import re
import sys

import pytest

from harness import command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT_DEMOS = ["kit.debug", "kit.launch", "kit.measure"]  # the kit's modules that teach something of their own
DEMOS = sorted([f[:-3] for f in os.listdir(os.path.join(ROOT, "mini_dist"))
                if f.endswith(".py") and not f.startswith("_") and f != "planner.py"] + KIT_DEMOS + ["questions"])

# A configuration each demo cannot run, as (world size, arguments) and a word the one-line error must contain.
BAD = {
    "activation_checkpoint": (1, ["--layers", "4", "--segments", "5"], "--segments"),
    "all_to_all": (2, ["--seq", "0"], "--seq"),
    "alpha_beta": (4, ["--ranks-per-node", "3"], "ranks-per-node"),
    "buckets": (2, ["--batch", "0"], "--batch"),
    "checkpoint": (2, ["--rows", "0"], "--rows"),
    "checkpoint_plan": (3, ["--rows", "2"], "--rows"),
    "collectives": (2, ["--rows", "0"], "--rows"),
    "comm": (2, ["--seq", "0"], "--seq"),
    "compression": (2, ["--ranks", "1000"], "--ranks"),
    "context_parallel": (5, [], "--seq"),
    "cost_model": (1, ["--ranks", "0"], "--ranks"),
    "gpt_ledger": (1, ["--tp", "3"], "--tp"),
    "rank_ledger": (1, ["--tp", "3"], "--tp"),
    "step_time": (1, ["--serial", "2"], "--serial"),
    "ddp": (2, ["--steps", "0"], "--steps"),
    "expert_parallel": (3, [], "experts"),
    "flat_param": (2, ["--sizes", "4"], "--sizes"),
    "fsdp_state": (2, ["--sizes", "4"], "--sizes"),
    "fsdp": (2, ["--depth", "1"], "depth"),
    "fsdp_ledger": (2, ["--depth", "1"], "--depth"),
    "loss_scaling": (2, ["--steps", "0"], "steps"),
    "manifest": (1, ["--nested", "0"], "--nested"),
    "measure_5d": (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", "3", "--moe", "4", "--ep", "2"], "--zero 3"),
    "mesh": (4, ["--pp", "3"], "pp"),
    "mixed_precision": (1, ["--lr", "0"], "--lr"),
    "moe": (1, ["--k", "9"], "--k"),
    "parallel_gpt": (4, ["--cp", "2", "--moe", "3", "--ep", "2"], "--ep"),
    "parallel_transformer": (5, [], "heads"),
    "pipeline": (2, ["--microbatches", "1"], "--microbatches"),
    "pipeline_actions": (2, ["--microbatches", "0"], "--microbatches"),
    "pipeline_executor": (2, ["--width", "0"], "--width"),
    "pipeline_messages": (2, ["--width", "0"], "--width"),
    "pipeline_bubble": (2, ["--stage-ms", "0"], "--stage-ms"),
    "pipeline_schedules": (2, ["--microbatches", "0"], "--microbatches"),
    "questions": (1, ["99"], "99"),
    "recovery": (2, ["--kill-at", "0"], "--kill-at"),
    "reducer": (2, ["--batch", "0"], "batch"),
    "reshard": (3, ["--width", "4"], "--width"),
    "reshard_zero": (2, ["--steps", "0"], "--steps"),
    "ring_allreduce": (2, ["--numel", "-1"], "--numel"),
    "ring_pipelined": (2, ["--numel", "3"], "--numel"),
    "selective_checkpoint": (1, ["--heads", "3"], "--heads"),
    "sharded_loss_scaling": (2, ["--growth-interval", "0"], "--growth-interval"),
    "sequence_layout": (5, [], "--seq"),
    "sharded_state": (2, ["--steps", "0"], "steps"),
    "tensor_parallel": (3, ["--hidden", "8"], "--hidden"),
    "topology": (4, ["--ranks-per-node", "3"], "ranks-per-node"),
    "tp_layout": (3, ["--hidden", "8"], "--hidden"),
    "tiny_gpt": (3, ["--tp", "3"], "--tp"),
    "train_5d": (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", "3", "--moe", "4", "--ep", "2"], "--zero 3"),
    "ulysses": (3, ["--heads", "8"], "heads"),
    "vocab_parallel": (7, [], "vocab"),
    "zero": (2, ["--steps", "0"], "steps"),
    "zero_optimizer": (2, ["--steps", "0"], "steps"),
    "zero_ledger": (2, ["--widths", "0"], "--widths"),
    "kit.debug": (1, [], "2 or more ranks"),
    "nccl_order": (1, [], "2 or more ranks"),
    "nccl_rule": (1, ["--ranks", "1"], "--ranks"),
    "pipeline_agreement": (1, [], "at least 2 ranks"),
    "pipeline_stages": (4, ["--layers", "3"], "--layers"),
    "kit.measure": (1, ["--width", "0"], "--width"),
}
WITHOUT_BAD_CONFIGURATION = {"kit.launch"}  # it runs on any world size and has no flags to get wrong


def command_line(module, argv, world=1, monkeypatch=None):
    from mini_dist.kit import launch
    m = importlib.import_module(f"mini_dist.{module}")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    # argparse names the program from it
    monkeypatch.setattr(sys, "argv", [f"mini_dist/{module.replace('.', '/')}.py", *argv])
    return launch.main(m.parser(), m.demo, argv)


@pytest.mark.parametrize("module", DEMOS)
def test_every_demo_has_help_that_names_its_flags(module, monkeypatch, capsys):
    assert command_line(module, ["--help"], monkeypatch=monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out and "--trace PATH" in out  # every demo writes a trace
    parser = importlib.import_module(f"mini_dist.{module}").parser()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in out, (module, flag)


@pytest.mark.parametrize("module", DEMOS)
def test_every_demo_refuses_an_unknown_flag(module, monkeypatch, capsys):
    assert command_line(module, ["--frobnicate"], monkeypatch=monkeypatch) == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_every_demo_has_a_configuration_it_refuses_listed_here():
    assert sorted(set(DEMOS) - WITHOUT_BAD_CONFIGURATION) == sorted(m for m in BAD if m in DEMOS)


@pytest.mark.parametrize("module", sorted(BAD))
def test_a_configuration_a_demo_cannot_run_is_one_line_and_exit_2(module, monkeypatch, capsys):
    world, argv, word = BAD[module]
    assert command_line(module, argv, world, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    prog = "./run.sh ask" if module == "questions" else f"{module.split('.')[-1]}.py"
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and word in err[0], err


@pytest.mark.parametrize("module", ["tensor_parallel", "vocab_parallel", "parallel_transformer"])
@pytest.mark.parametrize("flag", ["--batch", "--seq", "--hidden"])
def test_the_tensor_parallel_demos_refuse_a_size_of_0_in_one_line(module, flag, monkeypatch, capsys):
    """flags.token_sizes: the [b, s, h] the three demos share are each at least 1, checked before any group."""
    assert command_line(module, [flag, "0"], 1, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("error: --batch, --seq and --hidden must be at least 1"), err


def run_sh(*args, env=None):
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE",
                                                                  "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR",
                                                                  "MINI_DIST_BACKEND", "MINI_DIST_PARALLEL")}
    # the timeout is only against a real hang: a busy machine may be slow, and no test judges the clock
    environment.update(env or {})
    return command([os.path.join(ROOT, "run.sh"), *args], env=environment)


def test_run_sh_planner_help_is_the_planners_help():
    result = run_sh("demo", "planner", "--help")
    assert result.returncode == 0 and "--params" in result.stdout


def test_run_sh_usage_error_is_one_short_line_not_torchruns_report():
    module, (world, argv, _) = "tensor_parallel", BAD["tensor_parallel"]
    result = run_sh("demo", module, str(world), *argv)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) <= 3 and any(f"{module}.py: error: " in line for line in lines), lines
    assert "ChildFailedError" not in result.stderr


def test_run_sh_unknown_flag_exits_2_and_unknown_module_names_the_modules():
    flag = run_sh("demo", "kit/launch", "2", "--frobnicate")
    assert flag.returncode == 2 and "unrecognized arguments: --frobnicate" in flag.stderr
    assert len(flag.stderr.strip().splitlines()) <= 2
    zero = run_sh("demo", "kit/launch", "0")
    assert zero.returncode == 2 and zero.stderr.strip() == "./run.sh: the rank count must be at least 1, got 0"
    missing = run_sh("demo", "nosuch")
    assert missing.returncode == 2 and "ring_allreduce" in missing.stderr


def test_run_sh_demo_runs_without_torchruns_thread_warning():
    result = run_sh("demo", "kit/launch", "2")
    assert result.returncode == 0 and "SUMMARY|launch|PASS" in result.stdout
    assert "OMP_NUM_THREADS" not in result.stdout + result.stderr


def test_nccl_without_gpus_is_one_line_saying_use_gloo():
    if sys.modules.get("torch") is None:
        import torch  # noqa: F401
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: NCCL can run")
    result = run_sh("demo", "kit/launch", "2", env={"MINI_DIST_BACKEND": "nccl"})
    assert result.returncode == 2 and "gloo" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_demo_past_mini_dist_demo_timeout_is_stopped_and_named():
    """The tour's guard against a hang (600 s there): the demo is stopped, counted failed, and named."""
    result = run_sh("demo", "activation_checkpoint", "1", env={"MINI_DIST_DEMO_TIMEOUT": "1"})
    assert result.returncode == 1, result
    assert result.stderr.strip().splitlines()[-1] == ("./run.sh: mini_dist/activation_checkpoint.py on 1 rank(s) did "
                                                      "not finish within MINI_DIST_DEMO_TIMEOUT=1 s: stopped")


EXIT_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from mini_dist.kit import launch
threads = lambda: [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
def demo(args):
    launch.setup("gloo")
    torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])  # imports torch._dynamo, and torch.distributed.nn with it
    mesh = [launch.new_group([0])]
    mesh.append(mesh)                                        # a group in a reference cycle, as a DeviceMesh keeps one
    dist.all_reduce(torch.ones(2), group=mesh[0])
    print("during", sorted(threads()), flush=True)
    return launch.conclude("exit", True, "", True, "")
launch.main(launch.demo_parser("exit"), demo, [])
print("after", sorted(threads()), flush=True)
"""


def test_no_gloo_worker_thread_outlives_a_demo_so_none_is_alive_while_python_exits(tmp_path):
    """A process group that outlives its demo keeps its gloo worker threads alive as Python exits; one of them
    releasing a collective's tensor then aborts the rank (SIGABRT). Two ways a group outlives
    destroy_process_group: torch.distributed.nn's defaults, when first imported after init (torch.optim
    imports it), and a reference cycle. After launch.main neither may leave a thread."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = command([sys.executable, str(script)], env={**env, "PYTHONPATH": ROOT}, cwd=str(tmp_path))
    assert result.returncode == 0, result
    during = next(line for line in result.stdout.splitlines() if line.startswith("during"))
    after = next(line for line in result.stdout.splitlines() if line.startswith("after"))
    assert "pt_gloo_runloop" in during, during  # the name torch gives the thread: the check below can see it
    assert "pt_gloo_runloop" not in after, after


def test_every_demo_reruns_once_a_demo_whose_rank_a_signal_killed_and_names_it(tmp_path):
    """./run.sh demos (CI's run on the oldest torch, the GPU check): a rank killed by a signal is run once more
    and named on the last line; one killed twice, or a check that fails (exit 1, never rerun), is a failure.
    Three stand-in demos in a copy of run.sh's directory: crash once, crash always, fail a check."""
    (tmp_path / "mini_dist").mkdir()
    (tmp_path / "run.sh").write_text(open(os.path.join(ROOT, "run.sh")).read())
    (tmp_path / "run.sh").chmod(0o755)
    crash_once = "import os, pathlib\nm = pathlib.Path(__file__).with_suffix('.ran')\n" \
                 "if not m.exists():\n    m.touch()\n    os.abort()\nprint('SUMMARY|ok')\n"
    (tmp_path / "mini_dist" / "ring_allreduce.py").write_text(crash_once)
    (tmp_path / "mini_dist" / "comm.py").write_text("import os\nos.abort()\n")
    (tmp_path / "mini_dist" / "ddp.py").write_text("print('FAIL a check')\nraise SystemExit(1)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    result = command([str(tmp_path / "run.sh"), "demos", "1"], env={**env, "MINI_DIST_PYTHON": sys.executable})
    out = result.stdout
    assert result.returncode == 1, result
    assert out.count("=== ring_allreduce: a rank was killed by Signal 6 (SIGABRT): once more ===") == 1, out
    assert out.count("=== comm: a rank was killed by Signal 6 (SIGABRT): once more ===") == 1, out
    assert "ddp: a rank was killed" not in out and "FAIL a check" in out, out
    assert 'Fatal Python error: Aborted' in out and 'File "' in out, out  # PYTHONFAULTHANDLER: where it died
    last, crashed = out.strip().splitlines()[-2:]
    assert re.fullmatch(f"torch {re.escape(importlib.import_module('torch').__version__)}, every demo on at most 1 "
                        r"rank\(s\), \d+ at once: 1 passed, 0 refused, 2 failed: comm ddp; \d+ min \d+ s", last), out
    assert crashed == ("a rank was killed by a signal, output above, in: ring_allreduce (Signal 6 (SIGABRT), then exit "
                       "0) comm (Signal 6 (SIGABRT), then exit 1)"), out


# A stand-in demo that passes only while the other two run beside it: run one after another, it waits in vain.
TOGETHER = """import pathlib, sys, time
here = pathlib.Path(__file__).parent
(here / (pathlib.Path(__file__).stem + ".started")).touch()
for _ in range(240):
    if all((here / f"{name}.started").exists() for name in ("ring_allreduce", "comm", "ddp")):
        break
    time.sleep(0.5)
else:
    print("FAIL: the other demos never started beside this one")
    raise SystemExit(1)
"""
STAND_IN_TESTS = """import pytest
def test_passes():
    pass
@pytest.mark.skip(reason="needs 2 GPUs for 2 NCCL ranks")
def test_skips():
    pass
@pytest.mark.skip(reason="needs 2 GPUs for 2 NCCL ranks")
def test_skips_again():
    pass
def test_fails():
    assert False
"""


def test_the_gpu_check_on_gloo_runs_its_demos_side_by_side_and_ends_with_one_summary(tmp_path):
    """./run.sh gpu's path on the CPU (MINI_DIST_BACKEND=gloo skips the CUDA check), in a copy of run.sh's directory
    with stand-in tests (a pass, two skips, a failure) and three stand-in demos (a pass, a refusal, a failed check),
    each of which waits until all three have started: MINI_DIST_PARALLEL=3 runs them at once, and the output keeps
    the tour's order."""
    (tmp_path / "mini_dist").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "run.sh").write_text(open(os.path.join(ROOT, "run.sh")).read())
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "tests" / "test_stand_in.py").write_text(STAND_IN_TESTS)
    (tmp_path / "mini_dist" / "ring_allreduce.py").write_text(TOGETHER + "print('SUMMARY|ring|PASS')\n")
    (tmp_path / "mini_dist" / "comm.py").write_text(
        TOGETHER + "print('comm.py: error: run on 2 or more ranks', file=sys.stderr)\nraise SystemExit(2)\n")
    (tmp_path / "mini_dist" / "ddp.py").write_text(TOGETHER + "print('FAIL a check')\nraise SystemExit(1)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    result = command([str(tmp_path / "run.sh"), "gpu"], env={**env, "MINI_DIST_PYTHON": sys.executable,
                                                            "MINI_DIST_BACKEND": "gloo", "MINI_DIST_PARALLEL": "3"})
    out = result.stdout
    assert result.returncode == 1, result
    assert "never started beside" not in out, out
    shown = [out.index(f"=== {m} on 1 rank(s) ===") for m in ("ring_allreduce", "comm", "ddp")]
    assert shown == sorted(shown), out
    summary = out[out.index("=== ./run.sh gpu: summary ===\n"):].strip().splitlines()
    torch_version = importlib.import_module("torch").__version__
    assert summary[:-1] == [
        "=== ./run.sh gpu: summary ===",
        f"GPU: none (MINI_DIST_BACKEND=gloo: this check on the CPU) | torch {torch_version}",
        "tests: 1 passed, 2 skipped, 1 failed",
        "  2 skipped: needs 2 GPUs for 2 NCCL ranks",
        "demos on 1 rank: 1 passed, 1 refused (need more ranks: comm), 1 failed: ddp"], out
    assert re.fullmatch(r"took \d+ min \d+ s", summary[-1]), summary


def test_the_gpu_check_without_a_gpu_is_one_line_saying_where_to_run_it():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ./run.sh gpu would run the whole GPU check")
    result = run_sh("gpu")
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.strip().splitlines() == [f"./run.sh gpu: torch {torch.__version__} sees no CUDA GPU here; "
                                                  "run it on a GPU node (MINI_DIST_PYTHON=python3 ./run.sh gpu uses "
                                                  "that node's own torch)"], result.stderr


def test_readme_lists_every_module_with_its_demo_and_line_count():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for module in DEMOS + ["planner"]:
        if module == "questions":
            assert "./run.sh ask" in readme
            continue
        path = module.replace(".", "/")
        lines = sum(1 for _ in open(os.path.join(ROOT, "mini_dist", f"{path}.py")))
        row = next((r for r in readme.splitlines() if r.startswith(f"| `{path}.py` |")), None)
        assert row is not None, f"README's module table has no row for {path}.py"
        assert row.split("|")[2].strip() == str(lines), f"README says {row.split('|')[2].strip()} lines for " \
                                                         f"{path}.py, the file has {lines}"
        assert f"demo {path}" in row, row


def test_every_questions_command_is_a_demo_its_parser_accepts_and_the_readme_asks_every_question():
    import shlex
    from mini_dist import questions
    readme = open(os.path.join(ROOT, "README.md")).read()
    for q in questions.QUESTIONS.values():
        words = shlex.split(q.command)
        assert words[:2] == ["./run.sh", "demo"] and words[2].replace("/", ".") in DEMOS + ["planner"], q.command
        args = words[4:] if len(words) > 3 and words[3].isdigit() else words[3:]
        # SystemExit if not
        importlib.import_module(f"mini_dist.{words[2].replace('/', '.')}").parser().parse_args(args)
        assert "./run.sh ask --markdown" in readme, "README does not say how to print the questions page"
