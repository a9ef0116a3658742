"""Pipeline parallelism for every schedule: the textbook's loops, as an executor of schedules written as data.

mini_dist/pipeline.py writes GPipe and 1F1B as loops. Interleaved 1F1B, zero bubble or any other order is
easier to write as data: mini_dist/pipeline_schedules.py gives each rank its actions in order (forward,
backward, send, receive, of microbatch m on model chunk c), and this executor runs them, each action the
method of its name. Its step equals the textbook's, one process on the whole batch, and torch's:

    bytes sent by stage s  =  M activations (s < P-1)  +  M activation gradients (s > 0)  +  one shape header

What the textbook's loops take as given, it does itself: its messages go through a Mailbox
(mini_dist/pipeline_messages.py: shapes learned from a header, a send that never blocks, NCCL's order), and
the ranks first agree on the step (mini_dist/pipeline_agreement.py). It also runs zero bubble's split
backward: the forward cuts the graph at each layer's output, B keeps those outputs' gradients and W starts
from them. Inside data parallelism, a chunk's weight gradients are reduced once per step (DDP's `no_sync`
for every backward of the chunk but its last). VERBOSE=1 prints every send and receive.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_executor.py [--microbatches 8 --chunks 2]

Mirrors torch.distributed.pipelining's PipelineStage with its four schedules.
"""
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import flags, launch, references
from mini_dist.kit import trace as tracing
from mini_dist.kit.models import mlp
from mini_dist.kit.wire import LEDGER
from mini_dist.pipeline import PIPELINE
from mini_dist.pipeline_actions import COMPUTE, FREES, Action, Event, Schedule, live_microbatches
from mini_dist.pipeline_agreement import agree_on_step
from mini_dist.pipeline_messages import Mailbox
from mini_dist.pipeline_schedules import SCHEDULES, TORCH_SCHEDULES, schedules_for
from mini_dist.pipeline_stages import pipeline_chunks


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
    run = Executor(chunks, schedule, inputs, targets, loss_fn, group, no_sync)
    t0 = time.perf_counter()
    counted = LEDGER.bytes[PIPELINE]
    for action in run.actions:  # every action of the step runs here, one at a time
        start = time.perf_counter() - t0
        with tracing.span(f"{action.op} {action.mb}", tracing.COMPUTE if action.op in COMPUTE else tracing.COMM,
                          mb=action.mb, chunk=action.chunk):  # a slice of the trace, when one records (kit/trace.py)
            getattr(run, action.op)(action.mb, action.chunk)
        if trace and action.op not in COMPUTE:
            launch.trace(f"stage {run.stage(action.chunk)} {action.op} microbatch {action.mb}")
        run.mail.forget_sent()
        run.stats.peak_live = max(run.stats.peak_live, len(run.layers))
        run.stats.events.append(Event(*action, start, time.perf_counter() - t0))
    run.mail.finish()
    run.stats.bytes_sent = LEDGER.bytes[PIPELINE] - counted  # the kit's wire counted every message
    return run.loss, run.stats


@dataclass
class StepStats:  # what one rank measured during one step
    events: list = field(default_factory=list)  # Event(op, microbatch, chunk, start_s, end_s) since the start
    peak_live: int = 0   # most microbatches (x chunks) whose activations were kept at once
    bytes_sent: int = 0  # activations forward + their gradients backward + one shape header per stage


class Executor:
    """One rank's state during one step, by (microbatch, chunk): each computation is the method of its name."""

    def __init__(self, chunks, schedule: Schedule, inputs, targets, loss_fn, group, no_sync):
        self.chunks = chunks
        self.group = group
        self.loss_fn = loss_fn
        self.no_sync = no_sync
        self.P = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.M = schedule.n_microbatches
        self.S = self.P * schedule.n_chunks  # virtual stages
        self.actions = schedule.actions[self.rank]
        self.inputs = inputs.chunk(self.M) if self.rank == 0 else None
        self.targets = targets.chunk(self.M) if self.rank == self.P - 1 else None
        self.split = any(a.op == "backward_weight" for a in self.actions)  # zero bubble: B and W apart
        self.last_weights = {a.chunk: a.mb for a in self.actions if a.op in FREES}  # where DDP may sync
        self.x = {}        # by (microbatch, chunk): the input received
        self.layers = {}   # [(input, output) of each layer], from the forward to the last backward
        self.dy = {}       # the gradient received for the output
        self.dx = {}       # the input's gradient, to send
        self.w_grads = {}  # zero bubble: B's gradients of each layer's output, for W
        self.loss = None
        self.mail = Mailbox(schedule, group)
        self.stats = StepStats()

    def stage(self, c: int) -> int:
        return c * self.P + self.rank

    def forward(self, m, c):
        x = self.inputs[m] if self.stage(c) == 0 else self.x.pop((m, c))
        chunk = self.chunks[c]
        segments = []  # (input, output) of each layer; one segment, the chunk, unless B and W run apart
        for layer in list(chunk) if self.split and isinstance(chunk, nn.Sequential) else [chunk]:
            if segments:  # W needs each layer's output gradient: cut the graph there
                x = segments[-1][1].detach().requires_grad_(segments[-1][1].requires_grad)
            segments.append((x, layer(x)))
        if self.stage(c) == self.S - 1:  # the mean of M microbatch means is the batch mean
            loss = self.loss_fn(segments[-1][1], self.targets[m]) / self.M
            segments[-1] = (x, loss)
            self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
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
        segments = self.layers[m, c]
        dy = self.dy.pop((m, c), None)
        grads = []
        for x, y in reversed(segments):
            grads.append(dy)
            dy = torch.autograd.grad(y, x, dy, retain_graph=True)[0] if x.requires_grad and y.requires_grad else None
        self.w_grads[m, c] = grads[::-1]
        if self.stage(c) > 0:
            self.dx[m, c] = dy if dy is not None else torch.zeros_like(segments[0][0])

    def backward_weight(self, m, c):
        """W: the weights' gradients from the layer outputs' gradients that B kept; frees the activations."""
        outputs = [y for _, y in self.layers.pop((m, c))]
        roots = [(y, g) for y, g in zip(outputs, self.w_grads.pop((m, c))) if y.requires_grad]
        params = [p for p in self.chunks[c].parameters() if p.requires_grad]
        with self.sync(m, c):
            if roots and params:
                torch.autograd.backward([y for y, _ in roots], [g for _, g in roots], inputs=params)

    def sync(self, m, c):
        """Data parallelism: only a chunk's last weight-gradient computation may reduce the gradients."""
        if self.no_sync is None or self.last_weights[c] == m:
            return contextlib.nullcontext()
        return self.no_sync[c]()

    def send_act(self, m, c):
        self.mail.send(Action("send_act", m, c), self.layers[m, c][-1][1].detach())

    def send_grad(self, m, c):
        self.mail.send(Action("send_grad", m, c), self.dx.pop((m, c)))

    def recv_act(self, m, c):
        self.x[m, c] = self.mail.recv(Action("recv_act", m, c)).requires_grad_()

    def recv_grad(self, m, c):
        """The gradient of what this chunk sent: of its shape and dtype."""
        out = self.layers[m, c][-1][1]
        self.dy[m, c] = self.mail.recv(Action("recv_grad", m, c), (list(out.shape), out.dtype))


# ----------------------------------------------------------------------------- demo

def parser():
    p = flags.pipeline(launch.demo_parser(__doc__))
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    return p


def against_references(name: str, plan: Schedule, width: int) -> tuple:
    """One step of `plan` on P*v chunks of fp64 Linear layers: the largest |difference| of loss and gradients
    from one process on the whole batch, ours and torch's, and the activations each rank kept at the peak."""
    P = dist.get_world_size()
    M = plan.n_microbatches
    model = mlp([width] * (2 * P * plan.n_chunks + 1))  # 2 Linear layers a chunk
    x = torch.randn(3 * M, width, dtype=torch.float64, device=launch.device())  # inputs, and targets
    chunks = pipeline_chunks(model, None, plan.n_chunks)
    trace = launch.VERBOSE and name == "gpipe"

    def ours(loss_fn, first):
        return pipeline_step(chunks, plan, x, x, loss_fn, trace=trace and first)

    def theirs(loss_fn):
        return references.torch_step(chunks, TORCH_SCHEDULES[name], M, loss_fn)(x, x)
    mine, torchs, stats = references.against_one_process(model, chunks, x, x, ours, theirs)
    kept = [None] * P
    dist.all_gather_object(kept, stats[0].peak_live)
    return mine, torchs, kept


def demo(args) -> int:
    P = flags.pipeline_ranks(args)
    M = args.microbatches
    plans = schedules_for(SCHEDULES, P, M, args.chunks)
    launch.setup()
    launch.print0(f"P={P} M={M}, fp64, one step: the largest |difference| of loss and gradients from one process on "
                  f"the whole batch; activations kept at the peak per rank, in microbatches (x chunks)\n"
                  f"{'schedule':<16} | {'mini_dist':>9} | {'torch':>9} | kept = the schedule's")
    worst = 0.0
    kept_ok = True
    for name, plan in plans.items():
        ours, theirs, kept = against_references(name, plan, args.width)
        want = [live_microbatches(actions) for actions in plan.actions]
        worst = max(worst, ours, theirs)
        kept_ok = kept_ok and kept == want
        shown = name if plan.n_chunks == 1 else f"{name} v={plan.n_chunks}"
        launch.print0(f"{shown:<16} | {ours:>9.1e} | {theirs:>9.1e} | {kept} {'=' if kept == want else 'NOT'} {want}")
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return launch.conclude("pipeline_executor", worst < 1e-12, f"{len(plans)} schedules = torch = full batch (fp64, "
                           f"{worst:.0e})", kept_ok, "activations kept per rank = what each schedule keeps")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
