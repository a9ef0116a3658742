"""Pipeline schedules as data: which layers each stage holds, and what each rank runs when.

A model's layers are cut into P stages (balanced so that the slowest stage, which sets the pace, is as
fast as it can be), and a schedule says, for every rank, what it does next: the forward (F) or backward
(B) of microbatch m, or a send or receive. Written as data (as in ShallowSpeed), a schedule can be printed
and tested without a single process; mini_dist/pipeline.py runs any of them on ranks, and
mini_dist/pipeline_bubble.py plays them in a simulator. What each one buys, for uniform stage times
(bubble: the share of a step that ranks wait; activations: microbatches x chunks kept on rank r):

    schedule            bubble               activations, at most v*M
    GPipe               (P-1) / (M+P-1)      M                         all forwards, then all backwards
    1F1B                (P-1) / (M+P-1)      min(P-r, M)               one forward, one backward in turn
    interleaved 1F1B    (P-1) / (v*M+P-1)    (v-1)*G + 2(P-1-r) + 1    v model chunks per rank
    zero bubble ZB-H1   (P-1) / (3*M+P-1)    min(P, M)                 B and W apart; F = B = W

GPipe (Huang et al. 2019) is the naive one. 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs each
backward as early as it can: the same bubble, but rank r never holds more than P-r microbatches. Interleaved
1F1B (Narayanan et al. 2021) cuts the model into P*v virtual stages, rank r holding stages r, r+P, ...: a
microbatch goes round the ring of ranks v times, in rounds of G ~ P microbatches, and the fill and drain of a
v times shorter stage are v times shorter, for v times the messages. Zero bubble (Qi et al. 2023) splits a
backward into B, the input's gradient, which the stage before waits for, and W, the weights' gradient,
which nobody waits for: rank r runs its first r W's late, while 1F1B would leave it idle in the drain.
Messages: stage j sends its output to j+1 and its input's gradient to j-1; two ranks match messages in the
order sent (as NCCL does), so a rank first receives what was sent to it before the message it needs.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_schedules.py [--microbatches 8 --chunks 2]

Mirrors torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble, whose orders the demo and the tests compare with ours.
"""
import functools
import itertools
import sys
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


class Event(NamedTuple):
    """One action as it ran (or as the simulator plays it), in seconds (or units) since the step began."""
    op: str
    mb: int
    chunk: int
    start: float
    end: float


COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
SENDS_GRAD = ("backward", "backward_input")  # a full backward, or B alone, yields the input's gradient
FREES = ("backward", "backward_weight")      # the last use of a microbatch's activations


def one_f_one_b_order(forwards: list, backwards: list, warmup: int, w_lag: int | None = None) -> list[tuple]:
    """`warmup` forwards, then one forward and one backward in turn, then the backwards left. With w_lag
    (zero bubble) a backward is B alone, and the W of the k-th backward follows the (k + w_lag)-th B."""
    order = [("forward", *f) for f in forwards[:warmup]]
    for k, b in enumerate(backwards):
        order += [("forward", *forwards[warmup + k])] if warmup + k < len(forwards) else []
        order += [("backward" if w_lag is None else "backward_input", *b)]
        order += [("backward_weight", *backwards[k - w_lag])] if w_lag is not None and k >= w_lag else []
    late = backwards[max(0, len(backwards) - w_lag):] if w_lag is not None else []
    return order + [("backward_weight", *b) for b in late]


def check_sizes(name: str, P: int, M: int, v: int, chunks_allowed: bool = False) -> None:
    if min(P, M, v) < 1:
        raise ValueError(f"{name}: a schedule needs at least one stage, microbatch and chunk (P={P}, M={M}, v={v})")
    if v > 1 and not chunks_allowed:
        raise ValueError(f"{name} runs one model chunk per rank, not {v}: use interleaved for v > 1")


def gpipe_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """GPipe, the naive schedule: all M forwards, then all M backwards (holding M microbatches)."""
    check_sizes("gpipe", n_stages, n_microbatches, n_chunks)
    mbs = [(m, 0) for m in range(n_microbatches)]
    return with_communication("gpipe", [one_f_one_b_order(mbs, mbs, n_microbatches)] * n_stages, n_microbatches)


def one_f_one_b_schedule(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """1F1B: stage s runs P-1-s warm-up forwards, then one forward and one backward in turn, then the
    last backwards. Each backward frees a microbatch, so stage s holds at most P-s of them."""
    check_sizes("1f1b", n_stages, n_microbatches, n_chunks)
    P, M, mbs = n_stages, n_microbatches, [(m, 0) for m in range(n_microbatches)]
    return with_communication("1f1b", [one_f_one_b_order(mbs, mbs, min(P - 1 - s, M)) for s in range(P)], M)


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
    order = [one_f_one_b_order(forwards, backwards, min((v - 1) * G + (2 - zero_bubble) * (P - 1 - r), v * M),
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


# ----- which layers each stage holds -----

def balanced_split(costs: list[int], n_stages: int) -> list[int]:
    """Layers per stage: cut `costs` into n_stages consecutive runs so that the costliest run is as cheap
    as it can be (the slowest stage sets the pace of the whole pipe). Exact, by dynamic programming."""
    prefix = [0, *itertools.accumulate(costs)]

    @functools.cache
    def best(p: int, i: int) -> tuple:  # (cost of the costliest stage, sizes) for layers [0, i) on p stages
        if p == 1:
            return prefix[i], (i,)
        return min((max(best(p - 1, j)[0], prefix[i] - prefix[j]), best(p - 1, j)[1] + (i - j,))
                   for j in range(p - 1, i))
    return list(best(n_stages, len(costs))[1])


def split_model(model: nn.Sequential, n_stages: int, sizes: list[int] | None = None) -> list[nn.Sequential]:
    """Cut a sequential model into n_stages stages that share its layers: sizes[i] layers for stage i if
    given, else balanced by parameter count (+1 per layer, so parameter-free layers are spread too)."""
    layers = list(model)
    if n_stages > len(layers):
        raise ValueError(f"cannot cut {len(layers)} layers into {n_stages} pipeline stages (a stage needs at "
                         f"least one layer): use fewer pipeline ranks or model chunks, or a deeper model")
    if sizes is None:
        sizes = balanced_split([1 + sum(p.numel() for p in layer.parameters()) for layer in layers], n_stages)
    if len(sizes) != n_stages or min(sizes) < 1 or sum(sizes) != len(layers):
        raise ValueError(f"sizes {sizes} must be {n_stages} positive layer counts summing to {len(layers)}")
    bounds = [0, *itertools.accumulate(sizes)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def pipeline_chunks(model: nn.Sequential, group=None, n_chunks: int = 1, sizes=None) -> list[nn.Sequential]:
    """This rank's chunks of `model` cut into P*v virtual stages: stage j lives on rank j % P, so rank r
    holds stages r, r+P, r+2P, ... (v = 1: just stage r)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    return split_model(model, P * n_chunks, sizes)[r::P]


# ----- the reference, and the demo: every schedule as data, beside torch's -----

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble"}


def torch_schedule(chunks: list, name: str, n_microbatches: int, loss_fn=None, group=None):
    """torch.distributed.pipelining's schedule `name` over this rank's chunks (the reference, for demos and
    tests): .step(...) runs it, and the interleaved ones list every rank's computations in .pipeline_order."""
    from torch.distributed import pipelining
    P, r, v = dist.get_world_size(group), dist.get_rank(group), len(chunks)
    stages = [pipelining.PipelineStage(chunk, c * P + r, P * v, launch.device(), group=group)
              for c, chunk in enumerate(chunks)]
    multi = name in ("interleaved", "zero_bubble")
    return getattr(pipelining, TORCH_SCHEDULES[name])(stages if multi else stages[0], n_microbatches, loss_fn)


def torch_step(chunks: list, name: str, n_microbatches: int, loss_fn, group=None):
    """torch's training step on the same chunks: step(inputs, targets) -> the batch loss on the last stage."""
    P, r, schedule = dist.get_world_size(group), dist.get_rank(group), torch_schedule(chunks, name, n_microbatches,
                                                                                       loss_fn, group)

    def step(inputs, targets):
        losses = []
        schedule.step(*[inputs] * (r == 0), **(dict(target=targets, losses=losses) if r == P - 1 else {}))
        return torch.stack(losses).mean() if losses else None
    return step


def torch_order(schedule, rank: int) -> list[tuple]:
    """A torch schedule's computations on `rank` in our words: (op, microbatch, chunk)."""
    ops = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
    return [(ops[a.computation_type.value], a.microbatch_index, a.stage_index // schedule.pp_group_size)
            for a in schedule.pipeline_order[rank] if a is not None]


def label(a, chunks: bool) -> str:
    """F3 / B3 / W3 for a computation on microbatch 3 (with chunks: F3a on the first chunk, F3b on the next)."""
    return "FBBW"[COMPUTE.index(a.op)] + str(a.mb) + "abcdefgh"[a.chunk] * chunks


def computations(actions) -> str:
    """A rank's computations in order: F0 F1 B0 ..."""
    chunks = any(a.chunk for a in actions)
    return " ".join(label(a, chunks) for a in actions if a.op in COMPUTE)


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
    same = all(torch_order(torch_schedule([nn.Identity()] * s.n_chunks, name, M), r) ==
               [a for a in s.actions[r] if a.op in COMPUTE]
               for name, s in built.items() if name in ("interleaved", "zero_bubble") for r in range(P))
    G, live_ok = (M // max(1, M // P) if v > 1 else M), True
    for name, schedule in built.items():
        live = [live_microbatches(a) for a in schedule.actions]
        want = {"gpipe": [M] * P, "1f1b": [min(P - r, M) for r in range(P)], "zero_bubble": [min(P, M)] * P,
                "interleaved": [min((v - 1) * G + 2 * (P - 1 - r) + 1, v * M) for r in range(P)]}[name]
        live_ok &= live == want
        launch.print0(f"\n{name}" + f", v={schedule.n_chunks}" * (schedule.n_chunks > 1) + f", P={P} M={M}: "
                      f"computations in order; activations kept per rank {live} (formula {want})")
        launch.print0("\n".join(f"rank {r} | {computations(a)}" for r, a in enumerate(schedule.actions)))
    return launch.conclude("pipeline_schedules", same, "interleaved and zero bubble orders = torch's pipeline_order",
                           live_ok, "activations kept per rank = each schedule's formula")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
