"""A rank that dies is the one its survivors name, however it died and wherever (mini_dist/kit/fates.py).

The property: in every module that sends or gathers (the ring, DDP, ZeRO, FSDP, tensor parallel, the pipeline,
ring attention, the expert all-to-all, the checkpoint's save and load), for any world size, any rank, any
operation of the step and any way to end (an exception, sys.exit(0), os._exit(0), SIGKILL, SIGSEGV), every
survivor either finishes or raises an error whose cause is that rank ("lost rank r (it ..."), never a
bystander and never a raw gloo error, within the group's timeout and a few seconds.

The death is injected by a watcher of the wire's LEDGER, which sees every message and collective as it is
about to be posted (kit/wire.py): the victim ends at its k-th. The ranks are a pool of our own, with a short
timeout (a rank that raised stays alive and silent: the others wait for it until then), restarted after each
death. The hypothesis search runs under -m slow (CI); a few fixed cases run every time, and torchrun's summary
and ./run.sh's last line are checked on one run of FSDP (three ranks, rank 2 gone mid-forward).
"""
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

import harness
from harness import ROOT, command, device
from mini_dist import checkpoint, context_parallel, expert_parallel, sequence_layout, tensor_parallel, zero_optimizer
from mini_dist import ring_allreduce, ring_pipelined
from mini_dist.ddp import DistributedDataParallel
from mini_dist.fsdp import FullyShardedDataParallel
from mini_dist.kit import models, wire
from mini_dist.kit.ranks import Pool, RankFailure
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES

TIMEOUT_S = 5  # the ranks' MINI_DIST_TIMEOUT in these runs
FEW_S = 5  # what a survivor may take past it: deciding who failed first, and a busy machine
WAYS = ("raise", "exit", "os._exit", "SIGKILL", "SIGSEGV")
NAMED = re.compile(r"lost rank (\d+) \(it ")  # kit/fates.py's words for the rank that failed first


class Injected(Exception):
    """The error a rank raises when this test makes it fail on its own (no RuntimeError: not a lost peer)."""


# ----- one step of each module, on every rank -----

def ring():
    x = torch.arange(1000.0, device=device())
    ring_allreduce.ring_all_reduce(x)
    ring_pipelined.ring_all_reduce(x)


def ddp():
    model = DistributedDataParallel(models.mlp([8, 16, 16, 4]).to(device()), bucket_cap_mb=0.001)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, dtype=torch.float64, generator=harness.rank_generator(0)).to(device())
    for _ in range(2):
        models.accumulation_step(model, sgd, [(x, x[:, :4])])


def zero_step():
    model = models.mlp([8, 16, 4], torch.float32).to(device())
    adam = zero_optimizer.ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=2, lr=0.01)
    models.random_batch_steps(model, model, adam, 2)


def fsdp():
    model = FullyShardedDataParallel(models.block_stack(8, 16, 3, torch.float64, device()), models.Block)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, dtype=torch.float64, generator=harness.rank_generator(0)).to(device())
    for _ in range(2):
        models.regression_step(model, adam, x, x)


def tp():
    T = dist.get_world_size()
    mlp = tensor_parallel.ParallelMLP(8, 4 * T, device=device(), dtype=torch.float64)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device())
    for _ in range(2):
        mlp(x).square().sum().backward()


def pipeline():
    P = dist.get_world_size()
    torch.manual_seed(0)
    stage = nn.Linear(4, 4).to(device(), torch.float64)
    x = torch.randn(8, 4, dtype=torch.float64, device=device())
    pipeline_step(stage, SCHEDULES["1f1b"](P, 4), x, x, nn.MSELoss())


def ring_attention():
    C = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (sequence_layout.split_sequence(torch.randn(1, 2, 4 * C, 3, dtype=torch.float64, generator=g)
                                                    .to(device())) for _ in range(4))
    context_parallel.ring_attention(q.requires_grad_(), k, v, causal=True).backward(dout)


def experts():
    W = dist.get_world_size()
    moe = expert_parallel.ExpertParallelMoE(8, 16, 2 * W, device=device(), dtype=torch.float64)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=harness.rank_generator(0)).to(device())
    moe(x).square().sum().backward()
    expert_parallel.allreduce_router_grads(moe)


def save_and_load(path):
    r = dist.get_rank()
    W = dist.get_world_size()
    t = torch.arange(24.0, device=device()).view(6, 4)
    checkpoint.save({"w": checkpoint.share(t, r, W), "step": 3}, path)
    into = {"w": checkpoint.share(torch.zeros(6, 4, device=device()), (r + 1) % W, W), "step": 0}
    checkpoint.load(into, path)


MODULES = {"ring": ring, "ddp": ddp, "zero": zero_step, "fsdp": fsdp, "tensor parallel": tp, "pipeline": pipeline,
           "ring attention": ring_attention, "expert all-to-all": experts, "checkpoint": save_and_load}


def end(how: str, died: str) -> None:
    """End this rank the way `how` names, after writing when in the file `died` (the store may go with it)."""
    with open(died, "w") as f:
        f.write(repr(time.time()))
    if how == "raise":
        raise Injected("this rank fails on its own")
    if how == "exit":
        sys.exit(0)
    if how == "os._exit":
        os._exit(0)
    os.kill(os.getpid(), getattr(signal, how))


def step_that_ends(module, args, victim, k, how, died, pause_at=None):
    """MODULES[module](*args) while rank `victim` ends at its k-th message or collective (k = -1: none does;
    pause_at: every other rank pauses 1 s before its pause_at-th). -> ("finished", the operations, None, None),
    or ("raised", the error a user reads, its traceback, seconds since the victim ended)."""
    seen = []

    def injector(event, *_):
        if dist.get_rank() == victim and len(seen) == k:
            end(how, died)
        if dist.get_rank() != victim and len(seen) == pause_at:
            time.sleep(1.0)  # the victim is gone by now: this rank's next message fails as it is posted
        seen.append(event)
    wire.LEDGER.watchers.append(injector)
    try:
        MODULES[module](*args)
    except Exception as e:
        if dist.get_rank() == victim:  # its own error: the pool reports it, as torchrun would its traceback
            raise
        since = time.time() - float(open(died).read()) if os.path.exists(died) else None
        return "raised", f"{type(e).__name__}: {e}", traceback.format_exc(), since
    finally:
        wire.LEDGER.watchers.remove(injector)
    return "finished", seen, None, None


_pools = {}


def pool(world: int, debug: bool) -> Pool:
    if harness.BACKEND == "nccl" and world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs for {world} NCCL ranks")
    if (world, debug) not in _pools:
        env = {"MINI_DIST_TIMEOUT": str(TIMEOUT_S), "MINI_DIST_DEBUG": "1" if debug else "0"}
        _pools[world, debug] = Pool(world, harness.BACKEND, harness.PRELOAD, env, grace_s=TIMEOUT_S + 2 * FEW_S)
    return _pools[world, debug]


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    for p in _pools.values():
        p.close()
    _pools.clear()


def args_for(module):
    return (tempfile.mkdtemp(prefix="test_dead_rank_"),) if module == "checkpoint" else ()


def remove(args) -> None:
    for directory in args:
        shutil.rmtree(directory, ignore_errors=True)


_operations = {}


def operations(module, world, debug) -> list:
    """The messages and collectives each rank's step of `module` posts, in order (a run where no rank ends)."""
    if (module, world, debug) not in _operations:
        args = args_for(module)
        try:
            results = pool(world, debug).run(step_that_ends, module, args, -1, -1, "exit", "")
        finally:
            remove(args)
        assert all(kind == "finished" for kind, *_ in results), results
        _operations[module, world, debug] = [n for _, n, _, _ in results]
    return _operations[module, world, debug]


def survivors_name(module, world, victim, k, how, debug=False, pause_at=None) -> dict:
    """Run the step with rank `victim` ending at its k-th operation; check every survivor either finished or
    named it, and only it, in time. -> {rank: its error} of the survivors that raised."""
    args = args_for(module)
    died = os.path.join(tempfile.mkdtemp(prefix="test_dead_rank_"), "died")
    try:
        with pytest.raises(RankFailure) as info:
            pool(world, debug).run(step_that_ends, module, args, victim, k, how, died, pause_at, timeout=120)
    finally:
        remove(args + (os.path.dirname(died),))
    replies = info.value.replies
    raised = {}
    for rank in range(world):
        if rank == victim:
            continue
        assert rank in replies, f"rank {rank} never answered (hung past the timeout):\n{info.value}"
        status, said, trace, since = replies[rank][1]
        assert replies[rank][0] == "ok" and status in ("finished", "raised"), f"rank {rank}: {replies[rank]}"
        if status == "raised":
            named = NAMED.findall(said)
            assert named and set(named) == {str(victim)}, f"rank {rank} names {named}, not {victim}: {said}\n{trace}"
            assert f"Rank {rank} stopped after losing rank {victim}" in said, said
            assert since is not None and since <= TIMEOUT_S + FEW_S, f"rank {rank} took {since:.1f} s: {said}"
            raised[rank] = (said, trace)
    return raised


# ----- every run: a few fixed cases -----

def test_a_rank_that_vanishes_mid_ring_is_named_by_every_survivor_even_those_that_only_lost_a_bystander():
    """Rank 2 of 4 ends with os._exit mid-ring: rank 1 loses it directly; rank 0 and 3 lose rank 1 or time out
    waiting for a neighbour that raised: each names rank 2."""
    k = len(operations("ring", 4, False)[2]) // 2
    raised = survivors_name("ring", 4, 2, k, "os._exit")
    assert raised, "no survivor raised: the death came too late to test anything"


def test_fsdp_three_ranks_rank_2_gone_in_the_second_units_forward_is_named_by_both_others():
    """The case that named a bystander: rank 1 ended with gloo's raw 'Connection reset by peer', and rank 0
    blamed rank 1, which had only stopped after losing rank 2."""
    ops = operations("fsdp", 3, False)[2]  # building: agree, 4 scatters; forward: 4 all-gathers, one ahead
    k = ops.index("all_gather_single") + 3  # the gather posted as the second block starts its forward
    raised = survivors_name("fsdp", 3, 2, k, "os._exit")
    assert set(raised) == {0, 1}, raised


def test_a_pipeline_neighbour_gone_before_a_message_is_posted_is_named_where_the_post_fails():
    """Rank 1 of 3 ends at its first message, after the step's agreement; the others pause before theirs, so
    gloo finds the pair closed as the message is posted (dist.isend / dist.irecv raise there, before any wait)."""
    raised = survivors_name("pipeline", 3, 1, 1, "os._exit", pause_at=1)
    assert set(raised) == {0, 2}, raised
    assert any(", in _post" in trace or ", in batch" in trace for _, trace in raised.values()), raised


def test_a_rank_that_raises_is_named_by_the_ranks_left_waiting_for_it_after_the_timeout():
    raised = survivors_name("tensor parallel", 3, 0, 1, "raise")
    assert raised and all("it failed first: Injected: this rank fails on its own" in s for s, _ in raised.values())


# ----- under -m slow: every module, any world, rank, operation and way to end -----

@pytest.mark.slow
@pytest.mark.parametrize("module", list(MODULES))
@settings(max_examples=3)
@given(data=st.data())
def test_every_survivor_names_the_rank_that_died_first_however_and_wherever_it_died(module, data):
    world = data.draw(st.integers(2, 5), label="world")
    debug = data.draw(st.booleans(), label="MINI_DIST_DEBUG")
    victim = data.draw(st.integers(0, world - 1), label="victim")
    k = data.draw(st.integers(0, len(operations(module, world, debug)[victim]) - 1), label="k")
    how = data.draw(st.sampled_from(WAYS), label="how")
    survivors_name(module, world, victim, k, how, debug)


# ----- torchrun's summary and ./run.sh's last line -----

LEAVE = os.path.join(ROOT, "tests", "leave_mid_fsdp.py")
ISSUE = ["--leave-at", "2", "--rank", "2", "--unit", "1"]


def torchrun_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "MINI_DIST_TIMEOUT": "20"}


def root_cause(stderr: str) -> str:
    """torchrun's summary, from its 'Root Cause' line on."""
    assert "Root Cause (first observed failure):" in stderr, stderr[-3000:]
    return stderr[stderr.index("Root Cause (first observed failure):"):]


@pytest.mark.parametrize("how", ["os._exit", pytest.param("SIGKILL", marks=pytest.mark.slow),
                                 pytest.param("raise", marks=pytest.mark.slow)])
def test_torchruns_summary_points_at_the_rank_that_died(how):
    """With status 0 torchrun sees no failure in rank 2, so its root cause is a survivor: its error file names
    rank 2. With SIGKILL or an error, rank 2 itself is the root cause (a survivor's file is dated after it)."""
    if harness.BACKEND == "nccl" and torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs for 3 NCCL ranks")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    job = command([torchrun, "--standalone", "--nproc_per_node=3", LEAVE, *ISSUE, "--how", how], env=torchrun_env())
    summary = root_cause(job.stderr)
    assert job.returncode != 0
    if how == "os._exit":
        assert "lost rank 2 (it vanished" in summary and "Rank 2 stopped" not in summary, summary
    else:
        assert re.search(r"rank +: 2 \(local_rank: 2\)", summary), summary
    for line in job.stderr.splitlines():
        assert not NAMED.search(line) or NAMED.search(line).group(1) == "2", line


@pytest.mark.slow
def test_run_shs_last_line_names_the_rank_that_died(tmp_path):
    """./run.sh demo in a copy of its directory, whose mini_dist/fsdp.py ends rank 2 mid-forward."""
    (tmp_path / "mini_dist").mkdir()
    shutil.copy(os.path.join(ROOT, "run.sh"), tmp_path / "run.sh")
    (tmp_path / "mini_dist" / "fsdp.py").write_text(f"import runpy\nrunpy.run_path({LEAVE!r}, run_name='__main__')\n")
    job = command([str(tmp_path / "run.sh"), "demo", "fsdp", "3", *ISSUE, "--how", "os._exit"],
                  env={**torchrun_env(), "MINI_DIST_PYTHON": sys.executable})
    assert job.returncode != 0
    assert job.stderr.strip().splitlines()[-1].startswith("./run.sh: rank 2 failed first"), job.stderr[-3000:]

