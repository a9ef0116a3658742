"""A pipeline schedule as data: each rank's actions, with the sends and receives its computations need.

A schedule says what each rank computes, in order: the forward (F) or backward (B) of microbatch m on one of
its model chunks; with zero bubble the backward is split into B, the input's gradient, and W, the weights'.
As data (as in ShallowSpeed) it can be printed, tested without a process, run by one executor
(mini_dist/pipeline_executor.py) and simulated (mini_dist/pipeline_bubble.py). Its messages follow from its
computations: chunk c of rank r is virtual stage j = c*P + r of S = P*v; stage j receives microbatch m's
activation from stage j-1 before its forward and sends its output to j+1 after it, and the gradients go
the other way. `with_communication` adds them to each rank's computations:

    recv (from j-1) before F of m on stage j, send (to j+1) after it; recv (from j+1) before B, send (to j-1) after

A receive goes just before the computation that needs it, after any message sent earlier on that wire (they
arrive in the order sent, as on NCCL), and a computation that waits for a message nobody sends is refused
when the schedule is built. What a rank keeps: each microbatch's activations, from its forward to its last
backward (`live_microbatches`, the memory each schedule promises).

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_actions.py [--microbatches 4]

Mirrors torch.distributed.pipelining's _Action (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B) and its
_add_send_recv, which adds the communication to a computation-only order in the same way.
"""
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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


# an action as it ran (or as the simulator plays it), start and end in seconds (units) since the step began
class Event(NamedTuple):
    op: str
    mb: int
    chunk: int
    start: float
    end: float


COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
SENDS_GRAD = ("backward", "backward_input")  # a full backward, or B alone, yields the input's gradient
FREES = ("backward", "backward_weight")      # the last use of a microbatch's activations


def live_microbatches(actions) -> int:
    """Most microbatches (x chunks) whose forward ran and whose activations are still kept for a backward."""
    live = 0
    most = 0
    for a in actions:
        if a.op == "forward":
            live += 1
        elif a.op in FREES:
            live -= 1
        most = max(most, live)
    return most


def label(a, chunks: bool) -> str:
    """An action as pictures write it: F3 / B3 / W3 on microbatch 3 (with chunks: F3a on the first, F3b ...)."""
    chunk = "abcdefgh"[a.chunk] if chunks else ""
    return "FBBW"[COMPUTE.index(a.op)] + str(a.mb) + chunk


def messages(op: str, m: int, c: int, rank: int, P: int, S: int) -> tuple:
    """What computation (op, m, chunk c) on `rank` must receive first and what it sends, each None or
    (peer rank, (act|grad, m, the virtual stage the message is for)); S = P*v virtual stages."""
    j = c * P + rank
    if op == "forward":  # the activation comes from the stage before and goes on to the stage after
        kind = "act"
        before = j - 1
        after = j + 1
    elif op in SENDS_GRAD:  # the gradient comes back from the stage after and goes on to the stage before
        kind = "grad"
        before = j + 1
        after = j - 1
    else:
        return None, None
    need = (before % P, (kind, m, j)) if 0 <= before < S else None
    out = (after % P, (kind, m, after)) if 0 <= after < S else None
    return need, out


def route(action: Action, rank: int, P: int, S: int) -> tuple:
    """The peer and the message of a send or receive action."""
    compute = "forward" if action.op.endswith("act") else "backward"
    need, out = messages(compute, action.mb, action.chunk, rank, P, S)
    return out if action.op.startswith("send") else need


def with_communication(name: str, order: list[list[tuple]], n_microbatches: int, n_chunks: int = 1) -> Schedule:
    """Each rank's computations, (op, microbatch, chunk), with the sends and receives added: a receive just
    before the computation that needs it, a send just after the one that produced it."""
    P = len(order)
    S = P * n_chunks
    wires = defaultdict(list)  # (from, to): the messages in the order the sender sends them
    for r, computations in enumerate(order):
        for op, m, c in computations:
            out = messages(op, m, c, r, P, S)[1]
            if out:
                wires[r, out[0]].append(out[1])
    schedule = []
    for r, computations in enumerate(order):
        actions = []
        received = set()
        for op, m, c in computations:
            need, out = messages(op, m, c, r, P, S)
            while need and need[1] not in received:  # what arrives before it, in the order it was sent
                if not wires[need[0], r]:
                    raise ValueError(f"{name}: rank {r} waits for {need[1]}, which rank {need[0]} never sends")
                kind, mb, j = wires[need[0], r].pop(0)
                received.add((kind, mb, j))
                actions.append(Action("recv_" + kind, mb, j // P))
            actions.append(Action(op, m, c))
            if out:
                actions.append(Action("send_" + out[1][0], m, c))
        schedule.append(tuple(actions))
    return Schedule(name, n_microbatches, n_chunks, tuple(schedule))


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=4, help="M, microbatches per step")
    return p


SHORT = {"recv_act": "<a{}", "send_act": "a{}>", "recv_grad": "<g{}", "send_grad": "g{}>"}  # {}: the microbatch


def written(actions) -> str:
    """A rank's actions as the demo prints them: <a0 F0 a0> ... <g0 B0 g0> (receive, compute, send)."""
    return " ".join(label(a, False) if a.op in COMPUTE else SHORT[a.op].format(a.mb) for a in actions)


def messages_by_wire(schedule: Schedule) -> dict:
    """(from rank, to rank) -> (the messages sent on that wire in order, the messages received in order)."""
    P = len(schedule.actions)
    S = P * schedule.n_chunks
    wires = defaultdict(lambda: ([], []))
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            if a.op in SHORT:
                peer, message = route(a, r, P, S)
                sending = a.op.startswith("send")
                wires[(r, peer) if sending else (peer, r)][0 if sending else 1].append(message)
    return dict(wires)


def demo(args) -> int:
    P = launch.env_world_size()
    M = args.microbatches
    launch.require(M >= 1, "--microbatches must be at least 1")
    launch.setup()
    gpipe = [("forward", m, 0) for m in range(M)] + [("backward", m, 0) for m in range(M)]
    schedule = with_communication("gpipe", [gpipe] * P, M)
    launch.print0(f"GPipe's computations on each of P={P} stages, M={M}, with the messages they need (<a receive "
                  f"an activation, a> send one, <g g> a gradient):")
    launch.print0("\n".join(f"rank {r} | {written(actions)}" for r, actions in enumerate(schedule.actions)))
    wires = messages_by_wire(schedule)
    met = all(sent == received for sent, received in wires.values())
    counts = {wire: len(sent) for wire, (sent, _) in sorted(wires.items())}
    neighbours = {(s, t): M for s in range(P) for t in (s - 1, s + 1) if 0 <= t < P}
    kept = [live_microbatches(actions) for actions in schedule.actions]
    launch.print0(f"every send meets its receive, in the order sent: {met}; messages per wire {counts}; "
                  f"microbatches kept at the peak per rank {kept}")
    forgot = [gpipe] * (P - 1) + [[c for c in gpipe if c[1] != M - 1]]  # the last stage forgets microbatch M-1
    try:
        with_communication("a stage forgets a microbatch", forgot, M)
        refused = "not refused"
    except ValueError as e:
        refused = str(e)
    launch.print0(f"the last stage forgets microbatch {M - 1}, refused as it is built: {refused}")
    caught = P == 1 or refused.endswith(f"which rank {P - 1} never sends")
    return launch.conclude("pipeline_actions", met and counts == neighbours and caught, "every send meets its "
                           "receive; a missing one refused", kept == [M] * P, "GPipe keeps M microbatches per rank")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
