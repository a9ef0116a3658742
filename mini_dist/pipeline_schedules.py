"""Pipeline schedules: what each rank computes when, GPipe, 1F1B, interleaved 1F1B and zero bubble.

mini_dist/pipeline.py writes GPipe and 1F1B as loops; here they are data (mini_dist/pipeline_actions.py:
each rank's computations, the sends and receives added), and so are the schedules that are harder to write
as loops. For uniform stage times (bubble: the share of a step that ranks wait; activations: microbatches x
chunks kept on rank r at once):

    schedule            bubble               activations, at most v*M
    GPipe               (P-1) / (M+P-1)      M                         all forwards, then all backwards
    1F1B                (P-1) / (M+P-1)      min(P-r, M)               one forward, one backward in turn
    interleaved 1F1B    (P-1) / (v*M+P-1)    (v-1)*G + 2(P-1-r) + 1    v model chunks per rank
    zero bubble ZB-H1   (P-1) / (3*M+P-1)    min(P, M)                 B and W apart; F = B = W

GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021) come first, each stage's order
as the textbook's loops run it; the others reuse 1F1B's three loops over (microbatch, chunk) pairs.
Interleaved 1F1B (Narayanan et al. 2021) gives rank r virtual stages r, r+P, ... of P*v: a microbatch goes
round the ranks v times, in rounds of G ~ P microbatches, and the fill and drain are v times shorter, for v
times the messages. Zero bubble (Qi et al. 2023) splits a backward into B, the input's gradient, which the
stage before waits for, and W, the weights', which nobody waits for: rank r runs its first r W's late,
when 1F1B would idle.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_schedules.py [--microbatches 8 --chunks 2]

Mirrors torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble: the demo and the tests compare our orders with what a step of theirs runs.
"""
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, references
from mini_dist.pipeline_actions import COMPUTE, Schedule, label, live_microbatches, with_communication


# ----- GPipe and 1F1B: each stage's computations, (op, microbatch, chunk), as pipeline.py's loops run them -----

def gpipe_stage(s: int, P: int, M: int) -> list[tuple]:
    """GPipe, the naive schedule: every stage runs all M forwards, then all M backwards, so it keeps the
    activations of all M microbatches until its first backward."""
    forwards = [("forward", m, 0) for m in range(M)]
    backwards = [("backward", m, 0) for m in range(M)]
    return forwards + backwards


def one_f_one_b_stage(s: int, P: int, M: int) -> list[tuple]:
    """1F1B on stage s of P, M microbatches. Warm-up: forwards only, filling the pipe for the stages after
    it; steady state: one forward, one backward, while forwards are left; cool-down: the backwards left.
    A backward frees its microbatch, so stage s keeps at most P-s of them (GPipe: all M)."""
    # exercise: return stage s's computations in the order 1F1B runs them, [(op, microbatch, 0)], op "forward" or
    #   "backward": each microbatch's forward once and its backward once, after it, each op in microbatch order;
    #   at most min(P-s, M) microbatches held at once (a forward holds one until its backward), as many as that
    #   before the first backward (the stages after s need them to start), then a forward and a backward in turn
    #   while forwards are left. Any P, M >= 1 (M < P too). It is the order torch's Schedule1F1B runs.
    order = []
    warmup = min(P - s - 1, M)
    for m in range(warmup):  # warm-up: fill the pipe
        order.append(("forward", m, 0))
    for k in range(M - warmup):  # steady state: microbatch warmup + k goes in, microbatch k comes out
        order.append(("forward", warmup + k, 0))
        order.append(("backward", k, 0))
    for m in range(M - warmup, M):  # cool-down: drain the pipe
        order.append(("backward", m, 0))
    return order
    # end exercise


# ----- the schedules: each rank's computations, the messages added (mini_dist/pipeline_actions.py) -----

def check_sizes(name: str, P: int, M: int, v: int, chunks_allowed: bool = False) -> None:
    if min(P, M, v) < 1:
        raise ValueError(f"{name}: a schedule needs at least one stage, microbatch and chunk (P={P}, M={M}, v={v})")
    if v > 1 and not chunks_allowed:
        raise ValueError(f"{name} runs one model chunk per rank, not {v}: use interleaved for v > 1")


def gpipe_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    check_sizes("gpipe", n_stages, n_microbatches, n_chunks)
    order = [gpipe_stage(s, n_stages, n_microbatches) for s in range(n_stages)]
    return with_communication("gpipe", order, n_microbatches)


def one_f_one_b_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    check_sizes("1f1b", n_stages, n_microbatches, n_chunks)
    order = [one_f_one_b_stage(s, n_stages, n_microbatches) for s in range(n_stages)]
    return with_communication("1f1b", order, n_microbatches)


# ----- the same three loops over (microbatch, chunk) pairs: interleaved and zero bubble -----

def warmup_steady_cooldown(forwards: list, backwards: list, warmup: int, w_lag: int | None = None) -> list[tuple]:
    """1F1B's loops over any lists of (microbatch, chunk): `warmup` forwards, then one forward and one
    backward in turn, then the backwards left. With w_lag (zero bubble) a backward is B alone, and the W of
    the k-th backward follows the (k + w_lag)-th B. (With v = 1 and 1F1B's warm-up: one_f_one_b_stage.)"""
    order = [("forward", *f) for f in forwards[:warmup]]
    for k, b in enumerate(backwards):
        if warmup + k < len(forwards):
            order.append(("forward", *forwards[warmup + k]))
        order.append(("backward" if w_lag is None else "backward_input", *b))
        if w_lag is not None and k >= w_lag:
            order.append(("backward_weight", *backwards[k - w_lag]))
    if w_lag is not None:  # the W's still deferred
        order += [("backward_weight", *b) for b in backwards[max(0, len(backwards) - w_lag):]]
    return order


def depth_first(name: str, P: int, M: int, v: int, zero_bubble: bool) -> Schedule:
    """Microbatches go through a rank's chunks in rounds of G ~ P (Megatron: exactly P; torch lets a round
    grow up to 2P-1, so M must split into equal rounds): the round's G forwards on chunk 0, the same G on
    chunk 1, ..., then the next round; backwards through the chunks in reverse. Warm-up: enough forwards that
    the first backward finds work (2 per hop, as 1F1B's; 1 for zero bubble, whose W's fill the gaps)."""
    check_sizes(name, P, M, v, chunks_allowed=True)
    n = max(1, M // P) if v > 1 else 1  # rounds; one chunk: no rounds to keep
    if M % n:
        raise ValueError(f"{name} runs microbatches in {n} equal rounds of about P={P}: M={M} does not split "
                         f"(torch.distributed.pipelining refuses it too); choose M < {2 * P} or a multiple of {n}")
    G = M // n
    forwards = [(m, c) for k in range(n) for c in range(v) for m in range(k * G, (k + 1) * G)]
    backwards = [(m, c) for k in range(n) for c in reversed(range(v)) for m in range(k * G, (k + 1) * G)]
    per_hop = 1 if zero_bubble else 2
    order = []
    for r in range(P):
        warmup = min((v - 1) * G + per_hop * (P - 1 - r), v * M)
        order.append(warmup_steady_cooldown(forwards, backwards, warmup, r if zero_bubble else None))
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
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble"}  # the reference each one mirrors


def schedules_for(names, P: int, M: int, v: int) -> dict:
    """The schedules a demo runs (v chunks for the interleaved one), or its configuration refused in one line."""
    launch.require(M >= 1 and v >= 1, "--microbatches and --chunks must be at least 1")
    try:
        return {name: SCHEDULES[name](P, M, v if name == "interleaved" else 1) for name in names}
    except ValueError as e:
        raise launch.UsageError(e) from e


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    return p


def torch_ran(name: str, n_microbatches: int, n_chunks: int = 1, group=None) -> list[tuple]:
    """What one step of torch's schedule `name` computes on this rank, in order. (Not its pipeline_order, a
    plan for printing, whose Schedule1F1B starts the last stage at F1.)"""
    log = []
    x = torch.randn(n_microbatches, 2, device=launch.device())
    chunks = [nn.Linear(2, 2).to(launch.device()) for _ in range(n_chunks)]
    references.torch_step(chunks, TORCH_SCHEDULES[name], n_microbatches, nn.MSELoss(), group, log)(x, x)
    return log


def computations(actions, width: int = 92) -> str:
    """A rank's computations in order, F0 F1 B0 ..., in lines of at most `width` characters."""
    labels = [label(a, any(b.chunk for b in actions)) for a in actions if a.op in COMPUTE]
    return "\n       | ".join(textwrap.wrap(" ".join(labels), width))


def demo(args) -> int:
    P = launch.env_world_size()
    M = args.microbatches
    v = args.chunks
    built = schedules_for(SCHEDULES, P, M, v)
    launch.setup()
    G = M // max(1, M // P) if v > 1 else M  # microbatches a round
    formulas = {"gpipe": [M] * P, "1f1b": [min(P - r, M) for r in range(P)], "zero_bubble": [min(P, M)] * P,
                "interleaved": [min((v - 1) * G + 2 * (P - 1 - r) + 1, v * M) for r in range(P)]}
    same = True
    live_ok = True
    for name, schedule in built.items():
        live = [live_microbatches(a) for a in schedule.actions]
        ours = [tuple(a) for a in schedule.actions[dist.get_rank()] if a.op in COMPUTE]
        runs = name != "1f1b" or M >= P  # torch's Schedule1F1B refuses M < P
        equal = torch.tensor([int(not runs or torch_ran(name, M, schedule.n_chunks) == ours)], device=launch.device())
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)  # every rank's computations, as one step of torch's runs them
        same = same and bool(equal)
        live_ok = live_ok and live == formulas[name]
        against = f"{'=' if equal else 'NOT'} what torch's {TORCH_SCHEDULES[name]} runs" if runs else "torch's refuses"
        chunks = f", v={v}" if schedule.n_chunks > 1 else ""
        launch.print0(f"\n{name}{chunks}, P={P} M={M}: computations ({against})")
        launch.print0("\n".join(f"rank {r} | {computations(a)}" for r, a in enumerate(schedule.actions)))
        launch.print0(f"activations kept at the peak, in microbatches (x chunks), per rank: {live}, formula "
                      f"{formulas[name]}")
    return launch.conclude("pipeline_schedules", same, "every rank's order = what torch's schedule runs",
                           live_ok, "activations kept per rank = each schedule's formula")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
