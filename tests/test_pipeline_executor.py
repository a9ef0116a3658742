"""The executor of schedules as data (mini_dist/pipeline_executor.py) on ranks: every schedule trains like
single-process full-batch training and like torch.distributed.pipelining on the same split, sends what the
schedule says, and a message it did not expect, or a neighbour that vanishes, is named. (The textbook loops
are tested in test_pipeline.py, whose one-process helpers these tests share; a schedule's actions in
test_pipeline_actions.py; the schedules as data in test_pipeline_schedules.py; the agreement before a step in
test_pipeline_agreement.py; the messages alone in test_pipeline_messages.py.)"""
import contextlib
import itertools
import os
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from harness import RankFailure, device, refusal, run, subgroup
from mini_dist.kit import debug, launch
from mini_dist.kit.references import torch_step
from mini_dist.pipeline_actions import live_microbatches
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_messages import HEADER_LEN
from mini_dist.pipeline_schedules import SCHEDULES, TORCH_SCHEDULES
from mini_dist.pipeline_stages import pipeline_chunks, split_model
from test_pipeline import assert_equal_up_to_rounding, build_model, draw_batch, full_batch, grads_by_index, make_loss


# ----- the executor, on ranks -----

def torch_runs(name, P, M, v):
    """Whether torch.distributed.pipelining accepts the configuration: its Schedule1F1B refuses M < P, its
    interleaved schedules M that does not split into rounds of about P (ours too, for v > 1)."""
    return {"1f1b": M >= P, "interleaved": M % max(1, M // P) == 0,
            "zero_bubble": M % max(1, M // P) == 0}.get(name, True)


def pipelined(seed, widths, frozen, batch, M, name, v, kind, sizes, ranks, headers=True, nccl_path=False):
    """One step of our pipeline on the ranks `ranks` (the default group if that is all of them), then,
    where torch runs it, the same step by torch.distributed.pipelining; returns what the test process
    needs to redo the step in a single process. `headers`: a checked header with every message (debug mode);
    `nccl_path`: the sends posted in message_order, as on NCCL."""
    group = subgroup(ranks) if len(ranks) < dist.get_world_size() else None
    if dist.get_rank() not in ranks:
        return None
    model = build_model(seed, widths, frozen)
    x, y = draw_batch(seed, widths, batch, kind)
    chunks = pipeline_chunks(model, group, v, sizes)
    P = len(ranks)
    s = dist.get_rank(group)
    saved = (debug.DEBUG, launch.PRETEND_NCCL)
    debug.DEBUG = headers
    launch.PRETEND_NCCL = nccl_path
    try:
        loss, stats = pipeline_step(chunks, SCHEDULES[name](P, M, v), x, y, make_loss(kind), group)
    finally:
        debug.DEBUG, launch.PRETEND_NCCL = saved
    result = dict(stage=s, loss=loss, grads=grads_by_index(model, chunks), x=x.cpu(), y=y.cpu(), stats=stats)
    # Importing torch.distributed.pipelining takes seconds per rank: only the 4-rank pool pays it (its
    # subgroups give every P from 1 to 4)
    if dist.get_world_size() == 4 and torch_runs(name, P, M, v):
        model.zero_grad()
        result["torch_loss"] = torch_step(chunks, TORCH_SCHEDULES[name], M, make_loss(kind), group)(x, y)
        result["torch_grads"] = grads_by_index(model, chunks)
    return result


def check_step(world, ranks, sizes, seed, widths, frozen, mb_size, M, name, v, kind, headers=True, nccl_path=False):
    """Pipelined loss and grads = single-process full-batch training (= torch.distributed.pipelining where
    it ran: returns whether it did), and the executor's measurements = what the schedule says."""
    P = len(ranks)
    results = run(world, pipelined, seed, widths, frozen, M * mb_size, M, name, v, kind, sizes, ranks, headers,
                  nccl_path)
    results = sorted((r for r in results if r is not None), key=lambda r: r["stage"])
    x = results[0]["x"]  # stage 0's inputs and stage P-1's targets are the batch
    y = results[-1]["y"]
    (loss, loss_terms), grads = full_batch(seed, widths, frozen, kind, x, y)
    # Roundings on a term's way: the sum over the batch, and forward and backward through each Linear an
    # inner product as long as its input resp. output width.
    roundings = len(x) + 2 * sum(widths)
    assert_equal_up_to_rounding(results[-1]["loss"], loss, loss_terms, roundings)
    ours = {i: g for r in results for i, g in r["grads"].items()}
    assert sum(len(r["grads"]) for r in results) == len(ours) == len(grads)  # each parameter on one stage
    for i, (g, terms) in grads.items():
        assert_equal_up_to_rounding(ours[i], g, terms, roundings)
    if "torch_loss" in results[-1]:
        assert_equal_up_to_rounding(results[-1]["loss"], results[-1]["torch_loss"], loss_terms, roundings)
        for r in results:
            for i, g in r["torch_grads"].items():
                if M & (M - 1) == 0:  # 1/M exact and the same operations in the same order: bit for bit
                    assert torch.equal(r["grads"][i], g), (name, i)
                assert_equal_up_to_rounding(r["grads"][i], g, grads[i][1], roundings)
    stages = split_model(build_model(seed, widths, frozen).cpu(), P * v, sizes)
    acts = list(itertools.accumulate(stages, lambda a, stage: stage(a), initial=x[:mb_size]))
    schedule = SCHEDULES[name](P, M, v)
    S = P * v
    for r in results:  # what the executor measured, beside what the schedule says
        s = r["stage"]
        actions = schedule.actions[s]
        assert [e[:3] for e in r["stats"].events] == list(actions)
        assert r["stats"].peak_live == live_microbatches(actions)
        sent = 0  # fp64 activations forward (+ a shape header once per stage), their gradients backward
        for j in range(s, S, P) if P > 1 else ():  # one rank: every message stays on it
            if j < S - 1:
                sent += (M * acts[j + 1].numel() + HEADER_LEN) * 8
            if j > 0:
                sent += M * acts[j].numel() * 8
        assert r["stats"].bytes_sent == sent
    return "torch_loss" in results[-1]


@st.composite
def pipelined_steps(draw, worlds, torch_runs_it=False):
    """A pipelined step: its world, pipeline ranks, model, split, batch, M, schedule, chunks and loss."""
    world = draw(worlds)
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    widths = draw(st.lists(st.integers(1, 6), min_size=3, max_size=6))
    n_layers = 2 * len(widths) - 3
    P = draw(st.integers(1, min(world, n_layers)))
    v = draw(st.integers(1, n_layers // P)) if name in ("interleaved", "zero_bubble") else 1
    M = draw(st.integers(1, 8))
    if not torch_runs(name, P, M, v) and (torch_runs_it or v > 1):  # keep M, drop what is refused
        M = P if name == "1f1b" else max(1, M // P) * (M // max(1, M // P))
    cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), min_size=P * v - 1, max_size=P * v - 1)))
    return dict(world=world, ranks=sorted(draw(st.permutations(range(world)))[:P]),  # may be a subgroup
                sizes=None if draw(st.booleans()) else [b - a for a, b in zip([0, *cuts], [*cuts, n_layers])],
                seed=draw(st.integers(0, 2 ** 16)), widths=widths, frozen=draw(st.booleans()),
                mb_size=draw(st.integers(1, 4)), M=M, name=name, v=v,
                kind=draw(st.sampled_from(["mse", "cross_entropy"])),
                headers=draw(st.booleans()), nccl_path=draw(st.booleans()))


@settings(max_examples=15)
@given(pipelined_steps(st.integers(1, 4)))
def test_pipelined_loss_and_grads_equal_full_batch_training_for_every_schedule(step):
    check_step(**step)


@settings(max_examples=12)
@given(pipelined_steps(st.just(4), torch_runs_it=True))
def test_pipelined_loss_and_grads_equal_torch_pipelining_on_the_same_split(step):
    assert check_step(**step)  # True: torch ran it too


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P, M", [(1, 1), (2, 1), (3, 2), (4, 1), (4, 3)])
def test_fewer_microbatches_than_stages_and_a_single_stage_still_train_exactly(P, M, name):
    check_step(4, list(range(P)), None, P * 10 + M, [3, 5, 4, 2], True, 2, M, name, 1, "mse")


def stage_of_two_layers():
    return pipeline_chunks(nn.Sequential(nn.Linear(2, 2), nn.Tanh()).to(device()))


def test_every_rank_rejects_more_stages_than_layers():
    with pytest.raises(RankFailure) as info:
        run(3, stage_of_two_layers)
    for rank in range(3):
        assert f"rank {rank} failed: ValueError: cannot cut 2 layers into 3 pipeline" in str(info.value)


# ----- a message the receiver did not expect, or a neighbour that vanishes, is named -----

class ShrinksAfterTheFirstCall(nn.Module):
    """A stage whose output loses a row from its second microbatch on: the next stage, which learned the
    shape from the first message, would read a wrong-sized buffer."""
    calls = 0

    def forward(self, x):
        self.calls += 1
        return x if self.calls == 1 else x[:-1]


def step_with_one_odd_stage(odd_rank: int, odd_stage: nn.Module, schedule: str, M: int):
    """One pipeline step of Linear(2, 2) stages, on 4 rows, where rank odd_rank runs odd_stage instead."""
    P = dist.get_world_size()
    stage = odd_stage if dist.get_rank() == odd_rank else nn.Linear(2, 2).to(device())
    x = torch.randn(4, 2, device=device())
    y = torch.randn(4, 2, device=device())
    return pipeline_step(stage, SCHEDULES[schedule](P, M), x, y, nn.MSELoss())[0]


def step_with_a_shrinking_first_stage():
    return step_with_one_odd_stage(0, ShrinksAfterTheFirstCall(), "gpipe", 2)


def test_in_debug_mode_a_receiver_names_the_sender_of_a_message_it_did_not_expect():
    with pytest.raises(RankFailure) as info:  # the pools run with MINI_DIST_DEBUG=1
        run(2, step_with_a_shrinking_first_stage)
    assert ("rank 1 failed: Disagreement: rank 1 expects the act of microbatch 1 for stage 1, [2, 2], from "
            "rank 0, which sent the act of microbatch 1 for stage 1, [1, 2]") in str(info.value)


class VanishesOnItsSecondForward(nn.Module):
    calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            os._exit(0)  # a rank that leaves without an error: torchrun would blame a victim
        return x


def step_where_rank_1_vanishes():
    return step_with_one_odd_stage(1, VanishesOnItsSecondForward(), "1f1b", 4)


def test_a_neighbour_that_vanishes_mid_step_is_named_by_the_ranks_waiting_for_it():
    with pytest.raises(RankFailure) as info:
        run(3, step_where_rank_1_vanishes)
    assert "rank 1 failed: died (exit code 0)" in str(info.value)
    for rank in (0, 2):  # each was waiting for rank 1: its forward input, or a gradient
        assert f"rank {rank} failed: PeerLost: rank {rank}, " in str(info.value)
        assert re.search(rf"PeerLost: rank {rank}, \w+ of microbatch \d+ with its pipeline neighbour, "
                         rf"(receiving from|sending to) it: lost rank 1 ", str(info.value))


class CountingNoSync:
    """Stands in for DistributedDataParallel.no_sync: records which computations ran under it."""

    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        yield


def weight_gradients_under_no_sync(name, M, v):
    P = dist.get_world_size()
    torch.manual_seed(0)
    chunks = pipeline_chunks(nn.Sequential(*[nn.Linear(2, 2) for _ in range(P * v)]).to(device()), None, v)
    counters = [CountingNoSync() for _ in chunks]
    x = torch.randn(2 * M, 2, device=device())
    y = torch.randn(2 * M, 2, device=device())
    pipeline_step(chunks, SCHEDULES[name](P, M, v), x, y, nn.MSELoss(), no_sync=counters)
    return [counter.entered for counter in counters]


@pytest.mark.parametrize("name, M, v", [("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved", 2, 2), ("zero_bubble", 5, 1)])
def test_data_parallel_sync_is_skipped_for_all_but_each_chunks_last_weight_gradient(name, M, v):
    # so a DistributedDataParallel around each chunk reduces its gradients once per step, not M times
    assert run(2, weight_gradients_under_no_sync, name, M, v) == [[M - 1] * v] * 2


# ----- NCCL runs a rank's messages in order: every rank posts them in one shared order -----

def under_nccls_rule(name, M, v, headers):
    """One step of schedule `name`, recorded on gloo and replayed under NCCL's in-order rule: the cycles found.
    `headers`: a checked header before every message (MINI_DIST_DEBUG=1), else only before a stage's first."""
    from mini_dist import nccl_order
    P = dist.get_world_size()
    chunks = v if name in ("interleaved", "zero_bubble") else 1
    widths = [3] * (P * chunks + 1)  # 2 * P * chunks - 1 layers: at least one per virtual stage
    model = build_model(0, widths, False)
    x, y = draw_batch(0, widths, 2 * M, "mse")
    saved = debug.DEBUG
    debug.DEBUG = headers
    try:
        return nccl_order.check(pipeline_step, pipeline_chunks(model, None, chunks), SCHEDULES[name](P, M, chunks),
                                x, y, nn.MSELoss())
    finally:
        debug.DEBUG = saved


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("world, M, v, headers", [(2, 3, 2, True), (3, 4, 1, False), (4, 8, 2, False),
                                                  (5, 7, 3, True)])
def test_every_schedule_completes_under_nccls_in_order_rule(world, M, v, headers, name):
    assert run(world, under_nccls_rule, name, M, v, headers) == [[]] * world


@pytest.mark.parametrize("module", ["pipeline", "pipeline_executor"])
@pytest.mark.parametrize("argv, says", [
    (["--microbatches", "3"], "--microbatches must be at least the rank count, 4: torch's Schedule1F1B refuses fewer"),
    (["--width", "0"], "--width must be at least 1")])
def test_a_pipeline_demo_refuses_fewer_microbatches_than_ranks_in_one_line(module, argv, says, monkeypatch, capsys):
    import importlib
    err = refusal(importlib.import_module(f"mini_dist.{module}"), 4, argv, monkeypatch, capsys)
    assert len(err) == 1 and says in err[0], err
