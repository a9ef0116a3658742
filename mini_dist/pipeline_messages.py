"""Messages between pipeline ranks for any schedule: a header says what comes, NCCL's order says when.

The textbook loops of mini_dist/pipeline.py know every message's shape beforehand and post a step's send and
receive as one batch. An executor of any schedule (mini_dist/pipeline_executor.py) knows neither: its
actions, one at a time, say "send the activation of microbatch m", "receive the gradient of microbatch k".
A `Mailbox` carries them for one rank during one step:

- a send never blocks (isend) and a receive waits for its message (irecv): the only waits are the schedule's;
- a stage learns the shape of the activations it receives from a header ahead of the first (HEADER_LEN
  int64s: what the message is, its dtype and shape); a gradient has the shape of what the stage sent:

      bytes sent by stage s  =  M activations (s < P-1)  +  M activation gradients (s > 0)  +  one header

- under MINI_DIST_DEBUG=1 every message comes after a header that its receiver checks: a message it did not
  expect (another microbatch, another shape) is named at once, with the rank that sent it;
- NCCL runs a rank's sends and receives one at a time, in the order posted, and a send ends only when its
  receive runs: there a send waits for its turn in `message_order` (mini_dist/pipeline_agreement.py), one
  order that all ranks share and that cannot wait in a cycle;
- a message from one of a rank's model chunks to another (interleaved schedules) stays on the rank.

The demo runs the messages of every schedule without a model: each send carries a tensor that names its
microbatch and stage, each receive checks it, and nccl_order replays them under NCCL's rule.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_messages.py [--microbatches 8 --chunks 2]

Mirrors what torch.distributed.pipelining's PipelineStage does around its sends and receives: it infers
the shapes before its first step, and its schedules post each step's operations in batches.
"""
import sys
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import nccl_order
from mini_dist.kit import debug, launch
from mini_dist.kit.wire import DEBUG, LEDGER, irecv, isend, wait
from mini_dist.pipeline import PIPELINE
from mini_dist.pipeline_actions import Schedule, route
from mini_dist.pipeline_agreement import message_order
from mini_dist.pipeline_schedules import SCHEDULES, schedules_for

HEADER_LEN = 13  # int64s: message kind, microbatch, virtual stage, dtype, ndim, up to 8 sizes
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
KINDS = ("act", "grad")


class Mailbox:
    """One rank's pipeline messages during one step of `schedule`: send() and recv() take its send and
    receive actions in the order it runs them; finish() waits for what is still under way."""

    def __init__(self, schedule: Schedule, group=None):
        self.group = group
        self.P = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.S = self.P * schedule.n_chunks  # virtual stages
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.P))  # global
        self.shapes = {}        # (act|grad, virtual stage) -> (shape, dtype), as a header announced it
        self.announced = set()  # the virtual stages this rank has sent a header to
        self.local = deque()    # messages from one of this rank's chunks to another
        self.held = {}          # message -> (peer, tensors, label): sends waiting for their turn
        self.in_flight = []     # sends posted, not yet done
        self.order = deque(message_order(schedule)[self.rank]) if launch.nccl(group) else None

    def send(self, action, tensor) -> None:
        """Send the message of a send action (send_act, send_grad): posted now, or on NCCL in its turn."""
        peer, message = route(action, self.rank, self.P, self.S)
        if peer == self.rank:
            self.local.append(tensor)
            return
        first = message[0] == "act" and message[2] not in self.announced
        tensors = [(tensor.contiguous(), PIPELINE)]
        if first or debug.DEBUG:  # the receiver learns the shape; in debug mode it checks every message
            self.announced.add(message[2])
            tensors.insert(0, (header(message, tensor), PIPELINE if first else DEBUG))  # a debug header: not counted
        self.held[message] = (peer, tensors, self.label(action))
        self.take_turns()

    def recv(self, action, expected=None):
        """The message of a receive action (recv_act, recv_grad), waited for. `expected`: its (shape, dtype) when
        the receiver knows it (a gradient: that of what it sent); else what the first header announced."""
        peer, message = route(action, self.rank, self.P, self.S)
        if peer == self.rank:
            return self.local.popleft()
        expected = expected or self.shapes.get(message[::2])
        self.take_turns(("recv", peer, message))
        if expected is None or debug.DEBUG:
            said = torch.empty(HEADER_LEN, dtype=torch.int64, device=launch.device())
            wait(irecv(said, peer, self.group, self.label(action), PIPELINE if expected is None else DEBUG))
            expected = self.check(said, message, expected, peer)
        tensor = torch.empty(expected[0], dtype=expected[1], device=launch.device())
        wait(irecv(tensor, peer, self.group, self.label(action), PIPELINE))
        return tensor

    def take_turns(self, until=None) -> None:
        """Post the held sends: on gloo at once, on NCCL in their turn in `message_order` (up to receive `until`)."""
        if self.order is not None:
            order = self.order
        else:
            order = deque(("send", peer, message) for message, (peer, _, _) in self.held.items())
        while order and order[0] != until and order[0][2] in self.held:
            peer, tensors, label = self.held.pop(order.popleft()[2])
            self.in_flight += [isend(t, peer, self.group, label, kind) for t, kind in tensors if t.numel()]
        if until and self.order is not None and self.order.popleft() != until:
            raise RuntimeError(f"rank {self.ranks[self.rank]} is out of message_order at {until}")

    def forget_sent(self) -> None:
        """Let go of the sends that are done: holding all M until the end would undo 1F1B's memory saving."""
        self.in_flight = [posted for posted in self.in_flight if not posted[0].is_completed()]

    def finish(self) -> None:
        """At the end of the step: post what is held, and wait for every send."""
        self.take_turns()
        if self.held:  # message_order was computed from another schedule
            raise RuntimeError(f"rank {self.ranks[self.rank]} never reached the turn of {list(self.held)}")
        for posted in self.in_flight:
            wait(posted)

    def check(self, said, message: tuple, expected, peer: int) -> tuple:
        """A header received: the (shape, dtype) it announces if it is the message expected, else the error."""
        kind, mb, j, dtype, ndim, *sizes = said.tolist()
        got = (sizes[:ndim], DTYPES[dtype])
        if (KINDS[kind], mb, j) != message or got != (expected or got):
            raise debug.Disagreement(f"rank {self.ranks[self.rank]} expects the {message[0]} of microbatch "
                                     f"{message[1]} for stage {message[2]}, {(expected or got)[0]}, from rank "
                                     f"{self.ranks[peer]}, which sent the {KINDS[kind]} of microbatch {mb} for "
                                     f"stage {j}, {sizes[:ndim]}: the ranks run different schedules or models")
        self.shapes[message[::2]] = got  # by (act|grad, stage): only activations are looked up
        return got

    def label(self, action) -> str:
        """What a lost neighbour's error and VERBOSE=1 say of one message."""
        return f"rank {self.ranks[self.rank]}, {action.op} of microbatch {action.mb} with its pipeline neighbour"


def header(message: tuple, tensor) -> torch.Tensor:
    """What a message is, (act|grad, microbatch, virtual stage), with its dtype and shape: HEADER_LEN int64s."""
    values = [KINDS.index(message[0]), *message[1:], DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), device=launch.device())


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    p.add_argument("--width", type=int, default=24, help="features of every activation (2 rows a microbatch)")
    return p


def relay(schedule: Schedule, shape: tuple, group=None) -> tuple[int, bool]:
    """The messages of one step of `schedule` without a model: every send carries a tensor that names its
    microbatch m and the virtual stage j that sends it (1000 m + j), every receive checks it. Returns the
    bytes this rank sent and whether every message was the one expected."""
    mail = Mailbox(schedule, group)
    before = LEDGER.bytes[PIPELINE]
    right = True
    for action in schedule.actions[mail.rank]:
        if action.op in ("send_act", "send_grad"):
            stage = action.chunk * mail.P + mail.rank
            mail.send(action, torch.full(shape, 1000.0 * action.mb + stage, device=launch.device()))
        elif action.op in ("recv_act", "recv_grad"):
            kind, mb, stage = route(action, mail.rank, mail.P, mail.S)[1]  # the stage it is for
            sender = stage - 1 if kind == "act" else stage + 1
            known = (list(shape), torch.float32) if kind == "grad" else None
            right = right and bool((mail.recv(action, known) == 1000 * mb + sender).all())
        mail.forget_sent()
    mail.finish()
    return LEDGER.bytes[PIPELINE] - before, right


def bytes_formula(P: int, M: int, v: int, nbytes: int) -> list[int]:
    """What each rank sends: per virtual stage it holds, M activations and a header (but the last), M
    gradients (but the first); nothing on one rank, whose messages stay home."""
    S = P * v
    sent = [0] * P
    for j in range(S if P > 1 else 0):
        if j < S - 1:
            sent[j % P] += M * nbytes + HEADER_LEN * 8
        if j > 0:
            sent[j % P] += M * nbytes
    return sent


def demo(args) -> int:
    P = launch.env_world_size()
    launch.require(args.width >= 1, "--width must be at least 1")
    plans = schedules_for(SCHEDULES, P, args.microbatches, args.chunks)
    launch.setup()
    shape = (2, args.width)
    nbytes = 2 * args.width * 4
    first = header(("act", 0, 1), torch.empty(shape, device=launch.device())).tolist()
    launch.print0(f"P={P}, one step's messages without a model, each {shape[0]} x {shape[1]} fp32 ({nbytes} B), the "
                  f"first activation to stage 1 after the header {first}\n(act, microbatch 0, stage 1, dtype "
                  f"{DTYPES[first[3]]}, {first[4]} dims: {first[5:5 + first[4]]})\n"
                  f"{'schedule':<14} | as expected | under NCCL's rule | bytes sent per rank = the formula")
    arrived = True
    counted = True
    for name, plan in plans.items():
        cycles = nccl_order.check(relay, plan, shape)  # recorded on NCCL's path: posted in message_order
        everyone = [None] * P
        dist.all_gather_object(everyone, relay(plan, shape))  # on gloo's: every send posted at once
        sent = [n for n, _ in everyone]
        right = all(r for _, r in everyone)
        want = bytes_formula(P, plan.n_microbatches, plan.n_chunks, nbytes)
        arrived = arrived and right and not cycles
        counted = counted and sent == want
        said = f"a cycle: {cycles[0]}" if cycles else "completes"
        launch.print0(f"{name:<14} | {'yes' if right else 'NO':<11} | {said:<17} | {sent} "
                      f"{'=' if sent == want else 'NOT'} {want}")
    return launch.conclude("pipeline_messages", arrived, "every schedule's messages arrive as sent, under NCCL's "
                           "rule too", counted, "bytes sent per rank = M activations each way + one header")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
