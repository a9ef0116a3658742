"""Pipeline schedules as data: what each rank runs when.

With a model cut into P stages (mini_dist/pipeline_stages.py), a schedule says what each rank does next:
the forward (F) or backward (B) of microbatch m, or a send or receive. As data (as in ShallowSpeed), it
can be printed and tested without a process; mini_dist/pipeline.py runs it on ranks, and
mini_dist/pipeline_bubble.py simulates it. For uniform stage times (bubble: the share of a step that ranks
wait; activations: microbatches x chunks kept on rank r at once):

    schedule            bubble               activations, at most v*M
    GPipe               (P-1) / (M+P-1)      M                         all forwards, then all backwards
    1F1B                (P-1) / (M+P-1)      min(P-r, M)               one forward, one backward in turn
    interleaved 1F1B    (P-1) / (v*M+P-1)    (v-1)*G + 2(P-1-r) + 1    v model chunks per rank
    zero bubble ZB-H1   (P-1) / (3*M+P-1)    min(P, M)                 B and W apart; F = B = W

GPipe (Huang et al. 2019) is the naive one; 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs each
backward as early as it can: the same bubble, but rank r keeps at most P-r microbatches. Both come first,
as loops on a whiteboard; the others reuse 1F1B's loops over (microbatch, chunk) pairs. Interleaved 1F1B
(Narayanan et al. 2021) gives rank r virtual stages r, r+P, ... of P*v: a microbatch goes round the ranks v
times, in rounds of G ~ P microbatches, and the fill and drain are v times shorter, for v times the
messages. Zero bubble (Qi et al. 2023) splits a backward into B, the input's gradient, which the stage
before waits for, and W, the weights', which nobody waits for: rank r runs its first r W's late, when 1F1B
would idle. Stage j sends its output to j+1 and its input's gradient to j-1, in the order sent (as NCCL).

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_schedules.py [--microbatches 8 --chunks 2]

Mirrors torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble: the demo and the tests compare our orders with what a step of theirs runs.
"""
import itertools
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch


# ----- the textbook schedules: each stage's computations, (op, microbatch, chunk), in order -----

def gpipe_stage(s: int, P: int, M: int) -> list[tuple]:
    """GPipe, the naive schedule: every stage runs all M forwards, then all M backwards, so it keeps the
    activations of all M microbatches until its first backward."""
    return [("forward", m, 0) for m in range(M)] + [("backward", m, 0) for m in range(M)]


def one_f_one_b_stage(s: int, P: int, M: int) -> list[tuple]:
    """1F1B on stage s of P, M microbatches. Warm-up: P-s-1 forwards, as many as the stages after it
    need to start (the last stage none); steady state: one forward, one backward, while forwards are left;
    cool-down: the backwards left. A backward frees its microbatch, so stage s keeps at most P-s of them."""
    # exercise: warm-up: min(P-s-1, M) forwards; steady state: F(warm-up + k), B(k); cool-down: the B's left
    order, warmup = [], min(P - s - 1, M)
    for m in range(warmup):  # warm-up: fill the pipe
        order.append(("forward", m, 0))
    for k in range(M - warmup):  # steady state: microbatch warmup + k goes in, microbatch k comes out
        order.append(("forward", warmup + k, 0))
        order.append(("backward", k, 0))
    for m in range(M - warmup, M):  # cool-down: drain the pipe
        order.append(("backward", m, 0))
    return order
    # end exercise


# ----- schedules as data: every rank's actions, the messages added -----

class Action(NamedTuple):
    op: str         # forward, backward, backward_input (B), backward_weight (W); send/recv_act, send/recv_grad
    mb: int         # the microbatch it works on
    chunk: int = 0  # which of this rank's model chunks: virtual stage chunk * P + rank


@dataclass(frozen=True)
class Schedule:
    name: str
    n_microbatches: int
    n_chunks: int   # v model chunks per rank
    actions: tuple  # actions[r]: rank r's actions, in the order it runs them


# an action as it ran (or as the simulator plays it), start and end in seconds (units) since the step began
Event = NamedTuple("Event", [("op", str), ("mb", int), ("chunk", int), ("start", float), ("end", float)])
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
SENDS_GRAD = ("backward", "backward_input")  # a full backward, or B alone, yields the input's gradient
FREES = ("backward", "backward_weight")      # the last use of a microbatch's activations


def check_sizes(name: str, P: int, M: int, v: int, chunks_allowed: bool = False) -> None:
    if min(P, M, v) < 1:
        raise ValueError(f"{name}: a schedule needs at least one stage, microbatch and chunk (P={P}, M={M}, v={v})")
    if v > 1 and not chunks_allowed:
        raise ValueError(f"{name} runs one model chunk per rank, not {v}: use interleaved for v > 1")


def gpipe_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    check_sizes("gpipe", n_stages, n_microbatches, n_chunks)
    return with_communication("gpipe", [gpipe_stage(s, n_stages, n_microbatches) for s in range(n_stages)],
                              n_microbatches)


def one_f_one_b_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    check_sizes("1f1b", n_stages, n_microbatches, n_chunks)
    return with_communication("1f1b", [one_f_one_b_stage(s, n_stages, n_microbatches) for s in range(n_stages)],
                              n_microbatches)


# ----- the same three loops over (microbatch, chunk) pairs: interleaved and zero bubble -----

def warmup_steady_cooldown(forwards: list, backwards: list, warmup: int, w_lag: int | None = None) -> list[tuple]:
    """1F1B's loops over any lists of (microbatch, chunk): `warmup` forwards, then one forward and one
    backward in turn, then the backwards left. With w_lag (zero bubble) a backward is B alone, and the W of
    the k-th backward follows the (k + w_lag)-th B. (With v = 1 and warmup P-1-s, it is one_f_one_b_stage.)"""
    order = [("forward", *f) for f in forwards[:warmup]]
    for k, b in enumerate(backwards):
        order += [("forward", *forwards[warmup + k])] if warmup + k < len(forwards) else []
        order += [("backward" if w_lag is None else "backward_input", *b)]
        order += [("backward_weight", *backwards[k - w_lag])] if w_lag is not None and k >= w_lag else []
    late = backwards[max(0, len(backwards) - w_lag):] if w_lag is not None else []
    return order + [("backward_weight", *b) for b in late]


def depth_first(name: str, P: int, M: int, v: int, zero_bubble: bool) -> Schedule:
    """Microbatches go through a rank's chunks in rounds of G ~ P (Megatron: exactly P; torch lets a round
    grow up to 2P-1, so M must split into equal rounds): the round's G forwards on chunk 0, the same G on
    chunk 1, ..., then the next round; backwards through the chunks in reverse. Warm-up: enough forwards that
    the first backward finds work (2 per hop, as 1F1B's; 1 for zero bubble, whose W's fill the gaps)."""
    check_sizes(name, P, M, v, chunks_allowed=True)
    n = max(1, M // P) if v > 1 else 1  # one chunk: no rounds to keep
    if M % n:
        raise ValueError(f"{name} runs microbatches in {n} equal rounds of about P={P}: M={M} does not split "
                         f"(torch.distributed.pipelining refuses it too); choose M < {2 * P} or a multiple of {n}")
    G = M // n
    forwards = [(m, c) for k in range(n) for c in range(v) for m in range(k * G, (k + 1) * G)]
    backwards = [(m, c) for k in range(n) for c in reversed(range(v)) for m in range(k * G, (k + 1) * G)]
    order = [warmup_steady_cooldown(forwards, backwards, min((v - 1) * G + (2 - zero_bubble) * (P - 1 - r), v * M),
                                    r if zero_bubble else None) for r in range(P)]
    return with_communication(name, order, M, v)


def interleaved_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B: v chunks per rank, the fill and drain v times shorter, v times the messages."""
    return depth_first("interleaved", n_stages, n_microbatches, n_chunks, zero_bubble=False)


def zero_bubble_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """Zero bubble: 1F1B with each backward split into B and W, rank r deferring its first r W's. One chunk
    per rank is ZB-H1 (Qi et al. 2023); v > 1 interleaves it as torch's ScheduleInterleavedZeroBubble."""
    return depth_first("zero_bubble", n_stages, n_microbatches, n_chunks, zero_bubble=True)


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "interleaved": interleaved_schedule,
             "zero_bubble": zero_bubble_schedule}


def live_microbatches(actions) -> int:
    """Most microbatches (x chunks) whose forward ran and whose activations are still kept for a backward."""
    return max(itertools.accumulate((a.op == "forward") - (a.op in FREES) for a in actions))


# ----- the messages a schedule adds -----

def messages(op: str, m: int, c: int, rank: int, P: int, S: int) -> tuple:
    """What computation (op, m, chunk c) on `rank` must receive first and what it sends, each None or
    (peer rank, (act|grad, m, the virtual stage the message is for)); S = P*v virtual stages."""
    j = c * P + rank
    if op not in ("forward", *SENDS_GRAD):
        return None, None
    kind, before, after = ("act", j - 1, j + 1) if op == "forward" else ("grad", j + 1, j - 1)
    return ((before % P, (kind, m, j)) if 0 <= before < S else None,
            (after % P, (kind, m, after)) if 0 <= after < S else None)


def route(action: Action, rank: int, P: int, S: int) -> tuple:
    """The peer and the message of a send or receive action."""
    compute = "forward" if action.op.endswith("act") else "backward"
    return messages(compute, action.mb, action.chunk, rank, P, S)[action.op.startswith("send")]


def with_communication(name: str, order: list[list[tuple]], n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """Each rank's computations, (op, microbatch, chunk), with the sends and receives added."""
    P, S = len(order), len(order) * n_chunks
    wires = defaultdict(list)  # (from, to): the messages in the order the sender sends them
    for r, computations in enumerate(order):
        for op, m, c in computations:
            if out := messages(op, m, c, r, P, S)[1]:
                wires[r, out[0]].append(out[1])
    schedule = []
    for r, computations in enumerate(order):
        actions, received = [], set()
        for op, m, c in computations:
            need, out = messages(op, m, c, r, P, S)
            src, message = need or (None, None)
            while message and message not in received:
                if not wires[src, r]:
                    raise ValueError(f"{name}: rank {r} waits for {message}, which rank {src} never sends")
                kind, mb, j = wires[src, r].pop(0)
                received.add((kind, mb, j))
                actions.append(Action("recv_" + kind, mb, j // P))
            actions.append(Action(op, m, c))
            if out:
                actions.append(Action("send_" + out[1][0], m, c))
        schedule.append(tuple(actions))
    return Schedule(name, n_microbatches, n_chunks, tuple(schedule))


# ----- the reference, and the demo: every schedule as data, beside torch's -----

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble"}


def torch_schedule(chunks: list, name: str, n_microbatches: int, loss_fn=None, group=None, log=None):
    """torch.distributed.pipelining's schedule `name` over this rank's chunks, the reference: .step(...)
    runs it (mini_dist/pipeline.py); with a list `log`, each computation it runs here is appended to it."""
    from torch.distributed import pipelining
    P, r, v = dist.get_world_size(group), dist.get_rank(group), len(chunks)
    stages = [pipelining.PipelineStage(chunk, c * P + r, P * v, launch.device(), group=group)
              for c, chunk in enumerate(chunks)]
    for c, stage in enumerate(stages if log is not None else ()):
        for method, op in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                           ("backward_weight_one_chunk", "backward_weight")):
            setattr(stage, method, logged(getattr(stage, method), op, c, log))
    multi = name in ("interleaved", "zero_bubble")
    return getattr(pipelining, TORCH_SCHEDULES[name])(stages if multi else stages[0], n_microbatches, loss_fn)


def logged(method, op: str, chunk: int, log: list):
    def run(mb, *args, **kwargs):  # (op, microbatch, chunk); B alone is backward_one_chunk(full_backward=False)
        log.append((op if kwargs.get("full_backward", True) else "backward_input", mb, chunk))
        return method(mb, *args, **kwargs)
    return run


def torch_ran(name: str, n_microbatches: int, n_chunks: int = 1, group=None) -> list[tuple]:
    """What one step of torch's schedule `name` computes on this rank, in order. (Not its pipeline_order, a
    plan for printing, whose Schedule1F1B starts the last stage at F1.)"""
    P, r, log = dist.get_world_size(group), dist.get_rank(group), []
    x = torch.randn(n_microbatches, 2, device=launch.device())
    chunks = [nn.Linear(2, 2).to(launch.device()) for _ in range(n_chunks)]
    schedule = torch_schedule(chunks, name, n_microbatches, nn.MSELoss(), group, log)
    schedule.step(*[x] * (r == 0), **({"target": x} if r == P - 1 else {}))
    return log


def label(a, chunks: bool) -> str:  # F3 / B3 / W3 on microbatch 3 (with chunks: F3a on the first, F3b ...)
    return "FBBW"[COMPUTE.index(a.op)] + str(a.mb) + "abcdefgh"[a.chunk] * chunks


def computations(actions, width: int = 92) -> str:
    """A rank's computations in order, F0 F1 B0 ..., in lines of at most `width` characters."""
    labels = [label(a, any(b.chunk for b in actions)) for a in actions if a.op in COMPUTE]
    return "\n       | ".join(textwrap.wrap(" ".join(labels), width))


def schedules_for(names, P: int, M: int, v: int) -> dict:
    """The schedules a demo runs (v chunks for the interleaved one), or its configuration refused in one line."""
    launch.require(M >= 1 and v >= 1, "--microbatches and --chunks must be at least 1")
    try:
        return {name: SCHEDULES[name](P, M, v if name == "interleaved" else 1) for name in names}
    except ValueError as e:
        raise launch.UsageError(e) from e


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    return p


def demo(args) -> int:
    P, M, v = launch.env_world_size(), args.microbatches, args.chunks
    built = schedules_for(SCHEDULES, P, M, v)
    launch.setup()
    G, same, live_ok = (M // max(1, M // P) if v > 1 else M), True, True
    for name, schedule in built.items():
        live = [live_microbatches(a) for a in schedule.actions]
        want = {"gpipe": [M] * P, "1f1b": [min(P - r, M) for r in range(P)], "zero_bubble": [min(P, M)] * P,
                "interleaved": [min((v - 1) * G + 2 * (P - 1 - r) + 1, v * M) for r in range(P)]}[name]
        ours, runs = [tuple(a) for a in schedule.actions[dist.get_rank()] if a.op in COMPUTE], name != "1f1b" or M >= P
        equal = torch.tensor([int(not runs or torch_ran(name, M, schedule.n_chunks) == ours)], device=launch.device())
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)  # every rank's computations, as one step of torch's runs them
        same, live_ok = same and bool(equal), live_ok and live == want
        against = f"{'=' if equal else 'NOT'} what torch's {TORCH_SCHEDULES[name]} runs" if runs else \
            "torch's refuses M < P"
        launch.print0(f"\n{name}" + f", v={v}" * (schedule.n_chunks > 1) + f", P={P} M={M}: computations ({against})")
        launch.print0("\n".join(f"rank {r} | {computations(a)}" for r, a in enumerate(schedule.actions)))
        launch.print0(f"activations kept at the peak, in microbatches (x chunks), per rank: {live}, formula {want}")
    return launch.conclude("pipeline_schedules", same, "every rank's order = what torch's schedule runs",
                           live_ok, "activations kept per rank = each schedule's formula")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
