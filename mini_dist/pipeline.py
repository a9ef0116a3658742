"""Pipeline parallelism: a model cut into stages, microbatches flowing through them, on isend/irecv.

A sequential model is cut into P stages (mini_dist/pipeline_stages.py), stage s on rank s, the batch into
M microbatches. Stage s receives microbatch m's activation from stage s-1, runs its layers and sends the
result on; the last computes the loss; gradients travel back the same way, and every stage accumulates its
parameters' gradients over the M microbatches. Only neighbours talk, M messages each way per step:

    bytes sent by stage s  =  M activations (s < P-1)  +  M activation gradients (s > 0)  +  one shape header

What each rank runs when is a schedule, data built in mini_dist/pipeline_schedules.py (read it first); the
share of a step ranks wait while the pipe fills and drains, (P-1)/(M+P-1) for GPipe and 1F1B, is
mini_dist/pipeline_bubble.py. One executor runs every schedule: each action calls the method of its name;
a send never blocks (isend), a receive waits for its message (irecv). NCCL runs a rank's messages one at a
time, in the order posted: there every rank posts them in one order all ranks share (`message_order`, in
mini_dist/pipeline_agreement.py), which cannot wait in a cycle. For zero bubble's split backward, the
forward cuts the graph at each layer's output: B keeps those outputs' gradients, W starts from them.
The ranks first agree on the step (mini_dist/pipeline_agreement.py). Inside data parallelism, a chunk's
weight gradients are reduced once per step (DDP's `no_sync` but for its last microbatch). VERBOSE=1 prints
every send and receive; MINI_DIST_DEBUG=1 sends a header its receiver checks with every message.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline.py [--microbatches 8 --chunks 2 --width 24]

Mirrors torch.distributed.pipelining's PipelineStage with its four schedules.
"""
import contextlib
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import debug, launch, references
from mini_dist.kit.wire import DEBUG, LEDGER, irecv, isend, wait
from mini_dist.pipeline_agreement import agree_on_step, message_order
from mini_dist.pipeline_schedules import (COMPUTE, FREES, SCHEDULES, Event, Schedule, route, schedules_for,
                                          torch_schedule)
from mini_dist.pipeline_stages import pipeline_chunks

# ----- the executor -----

HEADER_LEN = 13  # int64s: message kind, microbatch, virtual stage, dtype, ndim, up to 8 sizes
DTYPES, KINDS = [torch.float32, torch.float64, torch.float16, torch.bfloat16], ("act", "grad")


def pipeline_step(stage, schedule: Schedule, inputs=None, targets=None, loss_fn=None, group=None, no_sync=None,
                  trace: bool = launch.VERBOSE):
    """Run one training step of `schedule` on this rank's `stage` (a module, or the list of its v chunks).
    The first stage passes the whole batch `inputs`, the last `targets` and `loss_fn(output, target)` (a
    mean over its microbatch). Gradients accumulate into .grad as those of loss_fn on the whole batch.
    Returns (the batch loss on the last stage, else None; StepStats). `no_sync`: one context manager
    factory per chunk (DistributedDataParallel.no_sync), entered by every weight-gradient computation of
    that chunk but its last. Any schedule `simulate` accepts runs here without deadlock."""
    chunks = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    agree_on_step(schedule, chunks, inputs, targets, loss_fn, group)
    run, t0 = Executor(chunks, schedule, inputs, targets, loss_fn, group, no_sync), time.perf_counter()
    counted = LEDGER.bytes["pipeline"]
    for action in run.actions:
        (op, m, c), start = action, time.perf_counter() - t0
        if op in COMPUTE:
            getattr(run, op)(m, c)
        else:
            (run.send if op.startswith("send") else run.recv)(action)
            if trace:
                launch.trace(f"stage {run.stage(c)} {op} microbatch {m}")
        # a buffer goes once sent: holding all M until the end would undo 1F1B's memory saving
        run.in_flight = [posted for posted in run.in_flight if not posted[0].is_completed()]
        run.stats.peak_live = max(run.stats.peak_live, len(run.layers))
        run.stats.events.append(Event(op, m, c, start, time.perf_counter() - t0))
    run.take_turns()
    if run.held:  # message_order was computed from another schedule
        raise RuntimeError(f"rank {run.ranks[run.rank]} never reached the turn of {list(run.held)}")
    for posted in run.in_flight:
        wait(posted)
    run.stats.bytes_sent = LEDGER.bytes["pipeline"] - counted  # the kit's wire counted every message
    return run.loss, run.stats


@dataclass
class StepStats:  # what one rank measured during one step
    events: list = field(default_factory=list)  # Event(op, microbatch, chunk, start_s, end_s) since the start
    peak_live: int = 0   # most microbatches (x chunks) whose activations were kept at once
    bytes_sent: int = 0  # activations forward + their gradients backward + one shape header per stage


class Executor:
    """One rank's state during one step, by (microbatch, chunk): each computation is the method of its name."""

    def __init__(self, chunks, schedule: Schedule, inputs, targets, loss_fn, group, no_sync):
        self.chunks, self.group, self.loss_fn, self.no_sync = chunks, group, loss_fn, no_sync
        self.P, self.rank, self.M = dist.get_world_size(group), dist.get_rank(group), schedule.n_microbatches
        self.S, self.actions = self.P * schedule.n_chunks, schedule.actions[self.rank]
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.P))  # global
        self.inputs = inputs.chunk(self.M) if self.rank == 0 else None
        self.targets = targets.chunk(self.M) if self.rank == self.P - 1 else None
        self.split = any(a.op == "backward_weight" for a in self.actions)  # zero bubble: B and W apart
        self.last_weights = {a.chunk: a.mb for a in self.actions if a.op in FREES}  # where DDP may sync
        self.x, self.layers, self.dy, self.dx, self.w_grads = {}, {}, {}, {}, {}
        self.shapes, self.announced = {}, set()  # activation shapes received; stages told their shape
        self.local, self.loss = deque(), None  # messages to itself (one rank, several chunks)
        self.held, self.in_flight, self.stats = {}, [], StepStats()  # sends not yet posted; posted, not done
        self.order = deque(message_order(schedule)[self.rank]) if launch.nccl(group) else None

    def stage(self, c: int) -> int:
        return c * self.P + self.rank

    def forward(self, m, c):
        x, chunk, segments = self.inputs[m] if self.stage(c) == 0 else self.x.pop((m, c)), self.chunks[c], []
        for layer in list(chunk) if self.split and isinstance(chunk, nn.Sequential) else [chunk]:
            if segments:  # W needs each layer's output gradient: cut the graph there, (input, output) each
                x = segments[-1][1].detach().requires_grad_(segments[-1][1].requires_grad)
            segments.append((x, layer(x)))
        if self.stage(c) == self.S - 1:  # the mean of M microbatch means is the batch mean
            segments[-1] = (x, self.loss_fn(segments[-1][1], self.targets[m]) / self.M)
            self.loss = segments[-1][1].detach() + (0 if self.loss is None else self.loss)
        self.layers[m, c] = segments

    def backward(self, m, c):
        """B and W at once: one autograd pass from the output's gradient (the loss on the last stage)."""
        (x, y), = self.layers.pop((m, c))
        with self.sync(m, c):
            if y.requires_grad:  # else nothing before it needs a gradient (a frozen first stage)
                torch.autograd.backward(y, self.dy.pop((m, c), None))
        if self.stage(c) > 0:
            self.dx[m, c] = x.grad if x.grad is not None else torch.zeros_like(x)

    def backward_input(self, m, c):
        """B: the input's gradient only, layer by layer from the last; keeps each output's gradient for W."""
        segments, dy, grads = self.layers[m, c], self.dy.pop((m, c), None), []
        for x, y in reversed(segments):
            grads.append(dy)
            dy = torch.autograd.grad(y, x, dy, retain_graph=True)[0] if x.requires_grad and y.requires_grad else None
        self.w_grads[m, c] = grads[::-1]
        if self.stage(c) > 0:
            self.dx[m, c] = dy if dy is not None else torch.zeros_like(segments[0][0])

    def backward_weight(self, m, c):
        """W: the weights' gradients from the layer outputs' gradients that B kept; frees the activations."""
        roots = [(y, g) for (_, y), g in zip(self.layers.pop((m, c)), self.w_grads.pop((m, c))) if y.requires_grad]
        params = [p for p in self.chunks[c].parameters() if p.requires_grad]
        with self.sync(m, c):
            if roots and params:
                torch.autograd.backward(*zip(*roots), inputs=params)

    def sync(self, m, c):
        """Data parallelism: only a chunk's last weight-gradient computation may reduce the gradients."""
        return contextlib.nullcontext() if self.no_sync is None or self.last_weights[c] == m else self.no_sync[c]()

    def send(self, action):
        m, c = action.mb, action.chunk
        tensor = self.layers[m, c][-1][1].detach() if action.op == "send_act" else self.dx.pop((m, c))
        peer, message = route(action, self.rank, self.P, self.S)
        if peer == self.rank:  # one rank holding several chunks: the message stays here
            return self.local.append(tensor)
        first = message[0] == "act" and message[2] not in self.announced
        tensors = [(tensor.contiguous(), "pipeline")]
        if first or debug.DEBUG:  # the receiver learns the shape; in debug mode it checks every message
            self.announced.add(message[2])
            values = [KINDS.index(message[0]), *message[1:], DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
            header = torch.tensor(values + [0] * (HEADER_LEN - len(values)), device=launch.device())
            tensors.insert(0, (header, "pipeline" if first else DEBUG))  # a debug header: not counted
        self.held[message] = peer, tensors, self.label(action.op, m)
        self.take_turns()

    def take_turns(self, until=None):
        """Post the held sends: on gloo at once, on NCCL in their turn in `message_order` (up to receive `until`)."""
        order = self.order if self.order is not None else deque(("send", p, m) for m, (p, _, _) in self.held.items())
        while order and order[0] != until and order[0][2] in self.held:
            peer, tensors, label = self.held.pop(order.popleft()[2])
            self.in_flight += [isend(t, peer, self.group, label, kind) for t, kind in tensors if t.numel()]
        if until and self.order is not None and self.order.popleft() != until:
            raise RuntimeError(f"rank {self.ranks[self.rank]} is out of message_order at {until}")

    def recv(self, action):
        (m, c), (peer, message) = action[1:], route(action, self.rank, self.P, self.S)
        out = self.layers[m, c][-1][1] if message[0] == "grad" else None  # the gradient of what this rank sent
        expected = (list(out.shape), out.dtype) if out is not None else self.shapes.get(message[::2])
        if peer != self.rank:
            self.take_turns(("recv", peer, message))
        if peer != self.rank and (expected is None or debug.DEBUG):
            kind, mb, j, dtype, ndim, *sizes = self.receive(
                torch.empty(HEADER_LEN, dtype=torch.int64, device=launch.device()), peer, action,
                "pipeline" if expected is None else DEBUG).tolist()
            got = ((KINDS[kind], mb, j), (sizes[:ndim], DTYPES[dtype]))
            if got[0] != message or got[1] != (expected or got[1]):
                raise debug.Disagreement(f"rank {self.ranks[self.rank]} expects the {message[0]} of microbatch "
                                         f"{m} for stage {message[2]}, {(expected or got[1])[0]}, from rank "
                                         f"{self.ranks[peer]}, which sent the {KINDS[kind]} of microbatch {mb} "
                                         f"for stage {j}, {sizes[:ndim]}: the ranks run different schedules or models")
            expected = self.shapes[message[::2]] = got[1]  # by (act|grad, stage): only activations are looked up
        tensor = self.local.popleft() if peer == self.rank else self.receive(
            torch.empty(expected[0], dtype=expected[1], device=launch.device()), peer, action, "pipeline")
        if message[0] == "act":
            self.x[m, c] = tensor.requires_grad_()
        else:
            self.dy[m, c] = tensor

    def receive(self, tensor, peer, action, kind):
        wait(irecv(tensor, peer, self.group, self.label(action.op, action.mb), kind))
        return tensor

    def label(self, op, m) -> str:
        """What a lost neighbour's error and VERBOSE=1 say of one message."""
        return f"rank {self.ranks[self.rank]}, {op} of microbatch {m} with its pipeline neighbour"


# ----- the reference: torch.distributed.pipelining (one process on the whole batch: kit/references.py) -----

def torch_step(chunks: list, name: str, n_microbatches: int, loss_fn, group=None):
    """torch's training step on the same chunks: step(inputs, targets) -> the batch loss on the last stage."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    schedule = torch_schedule(chunks, name, n_microbatches, loss_fn, group)

    def step(inputs, targets):
        losses = []
        schedule.step(*[inputs] * (r == 0), **(dict(target=targets, losses=losses) if r == P - 1 else {}))
        return torch.stack(losses).mean() if losses else None
    return step


def what_flows_between_stages(n_microbatches: int = 8, width: int = 8, group=None) -> tuple[str, bool]:
    """One 1F1B step on every rank of `group`: the bytes each stage sent beside the formula, and whether every
    message goes to a neighbour. Returns (figure, holds), the same on every rank."""
    P, M = dist.get_world_size(group), n_microbatches
    model, x, y = toy_pipeline(P, width, 2 * M)
    plan = SCHEDULES["1f1b"](P, M)
    _, stats = pipeline_step(pipeline_chunks(model, group), plan, x, y, nn.MSELoss(), group, trace=False)
    act = 2 * width * 8  # a microbatch's activation: 2 rows of `width` fp64 numbers
    want = [(s < P - 1) * (M * act + 8 * HEADER_LEN) + (s > 0) * M * act for s in range(P)]
    sent = [None] * P
    dist.all_gather_object(sent, stats.bytes_sent, group=group)
    neighbours = all(abs(route(a, s, P, P)[0] - s) == 1 for s, actions in enumerate(plan.actions)
                     for a in actions if a.op not in COMPUTE)
    short = {"recv_act": "recv x", "send_act": "send x", "recv_grad": "recv dx", "send_grad": "send dx", "forward": "F"}
    start = " ".join(short.get(a.op, "B") + str(a.mb) for a in plan.actions[min(1, P - 1)][:9])
    return (f"1F1B, P = {P}, M = {M}: bytes sent per stage {sent} = M activations forward (not the last stage) + M "
            f"gradients back (not the first) + one shape header; every message to a neighbour: {neighbours}; "
            f"stage {min(1, P - 1)} begins: {start} ..."), sent == want and neighbours


def toy_pipeline(n_blocks: int, width: int, batch: int) -> tuple:
    """Linear + Tanh blocks in fp64 and a batch (x, y): the same on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(n_blocks) for m in (nn.Linear(width, width), nn.Tanh())]).to(
        launch.device(), torch.float64)
    return model, *(torch.randn(batch, width, dtype=torch.float64, device=launch.device()) for _ in "xy")


# ----- demo: every schedule against torch.distributed.pipelining and one process -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    p.add_argument("--width", type=int, default=24, help="features of every activation")
    return p


def demo(args) -> int:
    P, M, w = launch.env_world_size(), args.microbatches, args.width
    launch.require(w >= 1, "--width must be at least 1")
    plans = schedules_for(SCHEDULES, P, M, args.chunks)
    launch.setup()
    launch.print0(f"P={P} M={M}, fp64, one step: the largest |difference| of loss and gradients from one process on "
                  f"the whole batch\n{'schedule':<16} | {'mini_dist':>9} | {'torch':>9}")
    worst = 0.0
    for name, plan in plans.items():
        model, x, y = toy_pipeline(2 * P * plan.n_chunks, w, 3 * M)
        chunks = pipeline_chunks(model, None, plan.n_chunks)
        trace = launch.VERBOSE and name == next(iter(plans))
        ours, theirs, _ = references.against_one_process(
            model, chunks, x, y, lambda loss, first: pipeline_step(chunks, plan, x, y, loss, trace=trace and first),
            lambda loss: torch_step(chunks, name, plan.n_microbatches, loss)(x, y))
        worst = max(worst, ours, theirs)
        launch.print0(f"{name + f' v={plan.n_chunks}' * (plan.n_chunks > 1):<16} | {ours:>9.1e} | {theirs:>9.1e}")
    flows, flows_ok = what_flows_between_stages(M, w)
    launch.print0(f"\nwhat flows between stages: {flows}")
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return launch.conclude("pipeline", worst < 1e-12, f"{len(plans)} schedules = torch = full batch (fp64, "
                           f"{worst:.0e})", flows_ok, "bytes sent per stage = M activations each way + one header; "
                           "only neighbours talk")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
