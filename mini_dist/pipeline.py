"""Pipeline parallelism: a model cut into stages, microbatches flowing through them, on isend/irecv.

The layers of a sequential model are cut into P consecutive stages, stage s on rank s of the pipeline group,
and the batch into M microbatches. Stage s receives microbatch m's activation from stage s-1, runs its
layers and sends the result on; the last stage computes the loss; activation gradients travel back the
same way, and every stage accumulates its parameters' gradients over the M microbatches. While the pipe
fills and drains, stages wait: with forward + backward taking t per stage and microbatch, a step takes
(M+P-1)*t, of which each stage computes for M*t:

    bubble fraction = (P-1) / (M+P-1)       GPipe, 1F1B;  (P-1)/(vM+P-1) interleaved;  (P-1)/(3M+P-1) ZB-H1

What each rank runs when is a schedule, data built in mini_dist/pipeline_schedules.py (read it first; its
bubble, simulated and measured, is mini_dist/pipeline_bubble.py). One executor runs every schedule: each
action calls the method of its name; a send never blocks (isend), a receive waits for its message (irecv).
Zero bubble splits a backward into B (the input's gradient) and W (the weights'): for W, the forward keeps
each layer's output as the root of a graph of its own, exact for layers like nn.Linear, while a composite
layer (a transformer block) reruns part of its backward in W (torch's stage_backward_weight keeps B's
intermediate gradients instead). The ranks first agree on the schedule and the batch, so that a rank that
built another one is named at once, not after a timeout; with MINI_DIST_DEBUG=1 every message also carries
a header its receiver checks. Data parallelism inside the pipeline: with `no_sync` (DistributedDataParallel's,
one per chunk) every weight-gradient computation but a chunk's last runs under it, so gradients are reduced
once per step, during that last backward, while the stages before this one still drain.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline.py [--microbatches 8 --chunks 2 --width 24]

VERBOSE=1 prints every send and receive of one step. Mirrors torch.distributed.pipelining's PipelineStage
with ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble.
"""
import contextlib
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import debug, launch
from mini_dist.pipeline_schedules import (COMPUTE, FREES, SCHEDULES, Event, Schedule, pipeline_chunks,
                                          route, schedules_for, torch_step)

# ----- agreeing before the first message -----


def agree_on_step(schedule: Schedule, chunks: list, inputs, targets, loss_fn, group=None) -> None:
    """Every rank says what it is about to run: the schedule (name, M, stages, chunks, and a checksum of
    every rank's actions), its chunks, and what only the ends know (the batch on the first stage, targets
    and loss on the last). Every rank finds the same problem and raises the same error, naming ranks,
    instead of waiting for a message that never comes. Each step: four integers per rank, one all-gather
    (all_gather_object is two collectives and a pickle: 5-6 ms of a 45 ms step on 4 ranks and 2 cores,
    measured); only when they show a problem, every rank gathers the whole description, to name it."""
    P, s = dist.get_world_size(group), dist.get_rank(group)
    plan = (schedule.name, schedule.n_microbatches, len(schedule.actions), schedule.n_chunks)
    batch = len(inputs) if s == 0 and inputs is not None else -1
    n_targets = len(targets) if s == P - 1 and targets is not None and loss_fn is not None else -1
    mine = torch.tensor([zlib.crc32(repr((plan, schedule.actions)).encode()), len(chunks), batch, n_targets])
    everyone = torch.zeros(P * 4, dtype=torch.int64, device=launch.device())
    dist.all_gather_into_tensor(everyone, mine.to(launch.device()), group=group)
    everyone = everyone.view(P, 4)
    (crc, _, batch, _), (*_, n_targets) = everyone[0].tolist(), everyone[-1].tolist()
    if ((everyone[:, 0] == crc).all() and (everyone[:, 1] == plan[3]).all() and plan[2] == P and batch >= 0
            and batch == n_targets and plan[1] > 0 and batch % plan[1] == 0):
        return  # the same schedule, the chunks it runs, a batch that cuts into M: nothing to name
    _name_the_disagreement(plan, schedule, chunks, inputs, targets, loss_fn, group)


def _name_the_disagreement(plan, schedule: Schedule, chunks: list, inputs, targets, loss_fn, group) -> None:
    """The whole description of every rank, gathered, to say which ranks differ and how."""
    P, s = dist.get_world_size(group), dist.get_rank(group)
    everyone = [None] * P
    dist.all_gather_object(everyone, dict(
        plan=plan, actions=zlib.crc32(repr(schedule.actions).encode()), chunks=len(chunks),
        inputs=len(inputs) if s == 0 and inputs is not None else None,
        targets=len(targets) if s == P - 1 and targets is not None and loss_fn is not None else None), group=group)

    def who(key, say):  # "rank 0: ...; ranks 1, 2: ..."
        values = {}
        for r, e in enumerate(everyone):
            values.setdefault(e[key], []).append(str(dist.get_global_rank(group, r) if group is not None else r))
        return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {say(v)}" for v, r in values.items())
    name, M, stages, v = everyone[0]["plan"]
    if len({e["plan"] for e in everyone}) > 1:
        raise ValueError("pipeline ranks disagree on the schedule: " + who("plan", lambda p: "{} with M={}, {} "
                         "stages x {} chunk(s)".format(*p)) + ": build it with the same arguments on every rank")
    if len({e["actions"] for e in everyone}) > 1:
        raise ValueError(f"pipeline ranks hold different actions under one name, {name}: "
                         + who("actions", lambda crc: f"checksum {crc}"))
    if stages != P or any(e["chunks"] != v for e in everyone):
        raise ValueError(f"the schedule runs {stages} stages x {v} chunk(s) per rank, but the pipeline group has "
                         f"{P} ranks, holding chunks: {who('chunks', str)}: cut the model with pipeline_chunks(model, "
                         f"group, {v}) on a group of {stages}")
    batch, n_targets = everyone[0]["inputs"], everyone[-1]["targets"]
    if batch is None or n_targets is None:
        raise ValueError("the first stage needs `inputs`, the last stage `targets` and `loss_fn`")
    if batch != n_targets or batch % M:
        raise ValueError(f"a batch of {batch} inputs and {n_targets} targets cannot be cut into {M} equal "
                         f"microbatches: pass as many targets as inputs and choose M dividing {batch}")


# ----- the executor -----

HEADER_LEN = 13  # int64s: message kind, microbatch, virtual stage, dtype, ndim, up to 8 sizes
DTYPES, KINDS = [torch.float32, torch.float64, torch.float16, torch.bfloat16], ("act", "grad")


@dataclass
class StepStats:
    """What one rank measured during one step."""
    events: list = field(default_factory=list)  # Event(op, microbatch, chunk, start_s, end_s) since the start
    peak_live: int = 0   # most microbatches (x chunks) whose activations were kept at once
    bytes_sent: int = 0  # activations forward + their gradients backward + one shape header per stage


class Executor:
    """One rank's state during one step, by (microbatch, chunk): each computation is the method of its name."""

    def __init__(self, chunks, schedule: Schedule, inputs, targets, loss_fn, group, no_sync):
        self.chunks, self.group, self.loss_fn, self.no_sync = chunks, group, loss_fn, no_sync
        self.P, self.rank, self.M = dist.get_world_size(group), dist.get_rank(group), schedule.n_microbatches
        self.S, self.actions = self.P * schedule.n_chunks, schedule.actions[self.rank]
        self.inputs = inputs.chunk(self.M) if self.rank == 0 else None
        self.targets = targets.chunk(self.M) if self.rank == self.P - 1 else None
        self.split = any(a.op == "backward_weight" for a in self.actions)  # zero bubble: B and W apart
        self.last_weights = {a.chunk: a.mb for a in self.actions if a.op in FREES}  # where DDP may sync
        self.x, self.layers, self.dy, self.dx, self.w_grads = {}, {}, {}, {}, {}
        self.shapes, self.announced = {}, set()  # activation shapes received; stages told their shape
        self.local, self.loss = deque(), None  # messages to itself (one rank, several chunks)
        self.pending, self.in_flight, self.stats = [], [], StepStats()

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
        if first or debug.DEBUG:  # the receiver learns the shape; in debug mode it checks every message
            self.announced.add(message[2])
            values = [KINDS.index(message[0]), *message[1:], DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
            self.post_send(torch.tensor(values + [0] * (HEADER_LEN - len(values)), device=launch.device()), peer,
                           counted=first)
        self.post_send(tensor.contiguous(), peer)

    def post_send(self, tensor, peer, counted=True):
        self.stats.bytes_sent += tensor.numel() * tensor.element_size() * counted
        self.pending.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=peer))

    def recv(self, action):
        (m, c), (peer, message) = action[1:], route(action, self.rank, self.P, self.S)
        out = self.layers[m, c][-1][1] if message[0] == "grad" else None  # the gradient of what this rank sent
        expected = (list(out.shape), out.dtype) if out is not None else self.shapes.get(message[::2])
        if peer != self.rank and (expected is None or debug.DEBUG):
            header = self.receive(torch.empty(HEADER_LEN, dtype=torch.int64, device=launch.device()), peer, action)
            kind, mb, j, dtype, ndim, *sizes = header.tolist()
            got = ((KINDS[kind], mb, j), (sizes[:ndim], DTYPES[dtype]))
            if got[0] != message or got[1] != (expected or got[1]):
                raise debug.Disagreement(
                    f"rank {self.global_rank(self.rank)} expects the {message[0]} of microbatch {m} for stage "
                    f"{message[2]}, {(expected or got[1])[0]}, from rank {self.global_rank(peer)}, which sent the "
                    f"{KINDS[kind]} of microbatch {mb} for stage {j}, {sizes[:ndim]}: the ranks run different "
                    f"schedules or models")
            expected = self.shapes[message[::2]] = got[1]  # by (act|grad, stage): only activations are looked up
        tensor = self.local.popleft() if peer == self.rank else self.receive(
            torch.empty(expected[0], dtype=expected[1], device=launch.device()), peer, action)
        if message[0] == "act":
            self.x[m, c] = tensor.requires_grad_()
        else:
            self.dy[m, c] = tensor

    def receive(self, tensor, peer, action):
        """Post the waiting sends with this receive (batch_isend_irecv, as Megatron does: NCCL runs a pair's
        messages in order, and 1F1B's crossing sends and receives would otherwise wait on each other)."""
        works = self.post(dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=peer))
        self.wait(works[-1], peer, f"{action.op} of microbatch {action.mb}")
        return tensor

    def post(self, recv_op=None):
        ops, self.pending = self.pending + [recv_op] * (recv_op is not None), []
        works = dist.batch_isend_irecv(ops) if ops else []
        self.in_flight += [(w, op.tensor, op.group_peer) for w, op in zip(works, ops) if op is not recv_op]
        return works

    def wait(self, work, peer, what):
        debug.wait_for(work, self.global_rank(peer), f"rank {self.global_rank(self.rank)}, {what} with its "
                                                     f"pipeline neighbour")

    def global_rank(self, r):
        return dist.get_global_rank(self.group, r) if self.group is not None else r


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
    for action in run.actions:
        (op, m, c), start = action, time.perf_counter() - t0
        if op in COMPUTE:
            run.post()  # the neighbour should not wait for our compute to get what is already done
            getattr(run, op)(m, c)
        else:
            (run.send if op.startswith("send") else run.recv)(action)
            if trace:
                launch.trace(f"stage {run.stage(c)} {op} microbatch {m}")
        # a buffer goes once sent: holding all M until the end would undo 1F1B's memory saving
        run.in_flight = [sent for sent in run.in_flight if not sent[0].is_completed()]
        run.stats.peak_live = max(run.stats.peak_live, len(run.layers))
        run.stats.events.append(Event(op, m, c, start, time.perf_counter() - t0))
    run.post()
    for work, _, peer in run.in_flight:
        run.wait(work, peer, "a send")
    return run.loss, run.stats


# ----- demo: every schedule against torch.distributed.pipelining and one process -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=8, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    p.add_argument("--width", type=int, default=24, help="features of every activation")
    return p


def against_one_process(model, chunks, name: str, plan: Schedule, x, y, repeats: int = 1, trace=False) -> tuple:
    """Our step of `plan` (`repeats` times, the first traced if asked) and torch's on this rank's `chunks` of
    `model`: each one's largest difference of loss and gradients from one process on the whole batch (x, y),
    and our steps' StepStats."""
    loss_fn = nn.MSELoss()
    full_loss = loss_fn(model(x), y)
    full_loss.backward()
    expected, diffs, stats = {p: p.grad.clone() for p in model.parameters()}, [], []
    ours = [lambda: pipeline_step(chunks, plan, x, y, loss_fn, trace=trace and not stats)] * repeats
    for step in ours + [lambda: (torch_step(chunks, name, plan.n_microbatches, loss_fn)(x, y), None)]:
        model.zero_grad()
        loss, mine = step()
        diffs.append(max([0.0 if loss is None else abs(loss - full_loss).item()] +
                         [(p.grad - expected[p]).abs().max().item() for c in chunks for p in c.parameters()]))
        stats += [mine] * (mine is not None)
    return max(diffs[:-1]), diffs[-1], stats


def demo(args) -> int:
    P, M, w = launch.env_world_size(), args.microbatches, args.width
    launch.require(w >= 1, "--width must be at least 1")
    plans = schedules_for(SCHEDULES, P, M, args.chunks)
    launch.setup()
    launch.print0(f"P={P} M={M}, fp64: largest |difference| of loss and gradients from one process on the whole "
                  f"batch; bytes rank 0 sent\n{'schedule':<16} {'mini_dist':>9} {'torch':>9} {'bytes':>7} "
                  f"{'= M activations each way + one shape header per stage':>10}")
    worst, bytes_ok = 0.0, True
    for name, plan in plans.items():
        torch.manual_seed(0)  # the same model and batch on every rank
        model = nn.Sequential(*[m for _ in range(2 * P * plan.n_chunks) for m in (nn.Linear(w, w), nn.Tanh())])
        model = model.to(launch.device(), torch.float64)
        x, y = (torch.randn(3 * M, w, dtype=torch.float64, device=launch.device()) for _ in "xy")
        ours, theirs, (stats,) = against_one_process(model, pipeline_chunks(model, None, plan.n_chunks), name, plan,
                                                     x, y, trace=launch.VERBOSE and name == next(iter(plans)))
        S, act, sent = P * plan.n_chunks, 3 * w * 8, stats.bytes_sent  # an activation: 3 rows of w fp64 numbers
        formula = (P > 1) * sum((j < S - 1) * (M * act + 8 * HEADER_LEN) + (j > 0) * M * act
                                for j in range(dist.get_rank(), S, P))
        worst, bytes_ok = max(worst, ours, theirs), bytes_ok and sent == formula
        launch.print0(f"{name + f' v={plan.n_chunks}' * (plan.n_chunks > 1):<16} {ours:>9.1e} {theirs:>9.1e} "
                      f"{sent:>7,} = {formula:,}")
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return launch.conclude("pipeline", worst < 1e-12, f"{len(plans)} schedules = torch = full batch (fp64, "
                           f"{worst:.0e})", bytes_ok, "bytes sent = M activations each way + one header per stage")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
