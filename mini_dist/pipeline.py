"""Pipeline parallelism, the textbook step: GPipe, then 1F1B, as loops with every message written out.

A sequential model is cut into P stages (mini_dist/pipeline_stages.py), stage s on rank s of the group, and
the batch into M equal microbatches. Stage s receives microbatch m's activation from stage s-1, runs its
layers and sends the result to stage s+1; the last stage computes the loss. Backward runs the other way:
stage s receives the gradient of what it sent, runs its backward and sends its input's gradient to s-1.
Each microbatch's loss is divided by M and the parameters' gradients add up over the M microbatches, so the
step equals one process on the whole batch. Only neighbours talk, M messages each way:

    bytes sent by stage s  =  M activations (s < P-1)  +  M activation gradients (s > 0)

GPipe (Huang et al. 2019) runs all M forwards, then all M backwards: every stage keeps the activations of
all M microbatches. 1F1B (PipeDream-Flush, Narayanan et al. 2021) starts each backward as early as it can: a
warm-up of P-s-1 forwards, a steady state of one forward and one backward in turn, a cool-down of the
backwards left; stage s keeps at most P-s microbatches. Both leave ranks idle for (P-1)/(M+P-1) of the step
while the pipe fills and drains (mini_dist/pipeline_bubble.py).

In 1F1B's steady state a stage sends an activation on while its neighbour sends a gradient back: each posts its
send with the receive that follows as one batch, since two sends that each wait for the other's receive never
end (on NCCL, which runs a rank's operations in the order posted, not even when posted without waiting:
mini_dist/nccl_order.py replays it). Every message goes through the kit's wire: counted in its ledger as
"pipeline", printed under VERBOSE=1, a neighbour that is lost named. A stage must know the shape of the
activation it receives (Megatron-LM passes it as tensor_shape). The same two steps, and interleaved and
zero-bubble ones, written as data instead of loops: mini_dist/pipeline_schedules.py, run by
mini_dist/pipeline_executor.py.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline.py [--microbatches 8 --width 24]

Mirrors torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B (the demo and the tests compare them),
and Megatron-LM's forward_backward_pipelining_without_interleaving, whose message names it borrows.
"""
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import flags, launch, references
from mini_dist.kit.trace import span
from mini_dist.kit.models import mlp
from mini_dist.kit.wire import LEDGER, send_recv
from mini_dist.pipeline_stages import pipeline_chunks

PIPELINE = "pipeline"  # the ledger's kind for activations and their gradients


class Stage:
    """This rank's stage during one step: its layers, the microbatches it starts (the first stage) or turns
    into a loss (the last), and its messages to the stage before and the stage after."""

    def __init__(self, layers: nn.Module, inputs, targets, loss_fn, n_microbatches: int, shape, dtype, group=None):
        P = dist.get_world_size(group)
        self.s = dist.get_rank(group)
        self.before = self.s - 1 if self.s > 0 else None     # None: the first stage, which reads the batch
        self.after = self.s + 1 if self.s < P - 1 else None  # None: the last stage, which computes the loss
        self.layers = layers
        self.M = n_microbatches
        self.inputs = inputs.chunk(self.M) if self.before is None else None
        self.targets = targets.chunk(self.M) if self.after is None else None
        self.loss_fn = loss_fn
        self.shape = shape  # of one microbatch's activation from the stage before, and its dtype
        self.dtype = dtype
        self.group = group
        self.loss = None    # on the last stage: the batch loss, added up microbatch by microbatch

    def forward(self, x, m: int):
        with span(f"forward {m}", mb=m):  # a slice of the trace, when one records (kit/trace.py)
            y = self.layers(x)
            if self.after is None:  # the mean of M microbatch means is the batch mean
                y = self.loss_fn(y, self.targets[m]) / self.M
                self.loss = y.detach() if self.loss is None else self.loss + y.detach()
        return y

    def backward(self, x, y, dy, k: int):
        """From the gradient of microbatch k's output y (None on the last stage, where y is the loss) to the
        input's; the parameters' gradients add up in their .grad."""
        with span(f"backward {k}", mb=k):
            torch.autograd.backward(y, dy)
        return x.grad

    # The messages, named as in Megatron-LM. Each is one call of the wire's send_recv: its send and its
    # receive posted as ONE batch, then waited for. The first stage has no stage before it, the last none after.

    def recv_forward(self, m: int):
        """Microbatch m's input: the batch's on the first stage, else the activation from the stage before."""
        if self.before is None:
            return self.inputs[m]
        x = torch.empty(self.shape, dtype=self.dtype, device=launch.device())
        send_recv(None, None, x, self.before, self.group, self.label(f"activation {m}"), PIPELINE)
        return x.requires_grad_()  # its gradient is what this stage sends back

    def send_forward(self, y, m: int) -> None:
        if self.after is not None:
            send_recv(y.detach(), self.after, None, None, self.group, self.label(f"activation {m}"), PIPELINE)

    def recv_backward(self, y, k: int):
        """The gradient of microbatch k's output y from the stage after (None on the last stage: y is the loss)."""
        if self.after is None:
            return None
        dy = torch.empty_like(y)
        send_recv(None, None, dy, self.after, self.group, self.label(f"gradient {k}"), PIPELINE)
        return dy

    def send_backward(self, dx, k: int) -> None:
        if self.before is not None:
            send_recv(dx, self.before, None, None, self.group, self.label(f"gradient {k}"), PIPELINE)

    def send_forward_recv_backward(self, y, m: int, y_k, k: int):
        """Send microbatch m's activation y on and receive the gradient of microbatch k's output y_k back."""
        if self.after is None:
            return None
        dy = torch.empty_like(y_k)
        what = self.label(f"activation {m} on, gradient {k} back")
        send_recv(y.detach(), self.after, dy, self.after, self.group, what, PIPELINE)
        return dy

    def send_backward_recv_forward(self, dx, k: int, m: int):
        """Send microbatch k's input gradient dx back and receive microbatch m's input."""
        if self.before is None:
            return self.inputs[m]
        x = torch.empty(self.shape, dtype=self.dtype, device=launch.device())
        what = self.label(f"gradient {k} back, activation {m} in")
        send_recv(dx, self.before, x, self.before, self.group, what, PIPELINE)
        return x.requires_grad_()

    def label(self, what: str) -> str:
        """What VERBOSE=1 prints of a message, and an error about it says."""
        return f"pipeline stage {self.s}, {what}"


def gpipe_step(layers: nn.Module, inputs, targets, loss_fn, n_microbatches: int, shape, dtype, group=None):
    """One GPipe training step of this rank's stage `layers`: all M forwards, then all M backwards. The first
    stage passes the batch `inputs`, the last `targets` and loss_fn(output, target) (a mean over a
    microbatch); a stage after the first passes the `shape` and `dtype` of one microbatch's activation as it
    arrives. The parameters' .grad add up the gradient of the batch loss, which the last stage returns
    (the others: None)."""
    stage = Stage(layers, inputs, targets, loss_fn, n_microbatches, shape, dtype, group)
    kept = []  # (input, output) of each microbatch until its backward: all M of them at once
    for m in range(stage.M):  # all forwards
        x = stage.recv_forward(m)
        y = stage.forward(x, m)
        stage.send_forward(y, m)
        kept.append((x, y))
    for k in range(stage.M):  # all backwards, in the same order
        x, y = kept.pop(0)
        dy = stage.recv_backward(y, k)
        dx = stage.backward(x, y, dy, k)
        stage.send_backward(dx, k)
    return stage.loss


def one_f_one_b_step(layers: nn.Module, inputs, targets, loss_fn, n_microbatches: int, shape, dtype, group=None):
    """One 1F1B training step: the same arguments, the same result as gpipe_step, in another order."""
    stage = Stage(layers, inputs, targets, loss_fn, n_microbatches, shape, dtype, group)
    M = stage.M
    P = dist.get_world_size(group)
    warmup = min(P - stage.s - 1, M)  # the forwards that the stages after this one need before their first backward
    kept = []  # (input, output) of each microbatch between its forward and its backward: at most P-s
    for m in range(warmup):  # warm-up: fill the pipe
        x = stage.recv_forward(m)
        y = stage.forward(x, m)
        stage.send_forward(y, m)
        kept.append((x, y))
    if warmup < M:
        x = stage.recv_forward(warmup)
    for k in range(M - warmup):  # steady state: microbatch m = warmup + k goes in, microbatch k comes out
        m = warmup + k
        y = stage.forward(x, m)
        kept.append((x, y))
        x_k, y_k = kept.pop(0)
        # One batch, not "send, then receive": here stage s sends activation m to s+1 while s+1, done with
        # microbatch k's backward, sends its gradient to s, and a send ends only when its receive runs. Waited
        # for one after the other, each send waits for a receive that its peer posts only after its own send:
        # a hang, on gloo too. Posting the send without waiting is not enough on NCCL, which runs a rank's
        # sends and receives one at a time, in the order posted. A batch goes through as one unit
        # (tests/test_pipeline.py replays both under NCCL's rule).
        dy = stage.send_forward_recv_backward(y, m, y_k, k)
        dx = stage.backward(x_k, y_k, dy, k)
        if m + 1 < M:
            x = stage.send_backward_recv_forward(dx, k, m + 1)
        else:
            stage.send_backward(dx, k)
    for k in range(M - warmup, M):  # cool-down: drain the pipe
        x, y = kept.pop(0)
        dy = stage.recv_backward(y, k)
        dx = stage.backward(x, y, dy, k)
        stage.send_backward(dx, k)
    return stage.loss


# torch.distributed.pipelining's schedule that runs each step: the demo and the tests compare them
STEPS = {"GPipe": (gpipe_step, "ScheduleGPipe"), "1F1B": (one_f_one_b_step, "Schedule1F1B")}


# ----------------------------------------------------------------------------- demo

def parser():
    return flags.pipeline(launch.demo_parser(__doc__))


def what_flows_between_stages(n_microbatches: int = 8, width: int = 8, group=None) -> tuple[str, bool]:
    """One textbook 1F1B step on every rank of `group`, a microbatch 2 rows of `width` fp64 numbers: the bytes
    each stage sent beside the formula, the messages from stage to stage. (figure, holds), alike on every rank."""
    P = dist.get_world_size(group)
    M = n_microbatches
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(P))
    x = torch.randn(2 * M, width, dtype=torch.float64, device=launch.device())
    sends = Counter()  # stage -> messages this stage sent it

    def count(event, peer, *_):  # the wire calls it with every message it counts
        if event == "send":
            sends[ranks.index(peer)] += 1
    before = LEDGER.sent_by[PIPELINE]
    LEDGER.watchers.append(count)
    try:
        stage = pipeline_chunks(mlp([width] * (P + 1)), group)[0]  # P Linear layers, one a stage
        one_f_one_b_step(stage, x, x, nn.MSELoss(), M, (2, width), torch.float64, group)
    finally:
        LEDGER.watchers.remove(count)
    everyone = [None] * P
    dist.all_gather_object(everyone, (LEDGER.sent_by[PIPELINE] - before, sends), group=group)
    sent = [n for n, _ in everyone]
    pairs = {(s, t): n for s, (_, to) in enumerate(everyone) for t, n in sorted(to.items())}
    neighbours = {(s, t): M for s in range(P) for t in (s - 1, s + 1) if 0 <= t < P}
    act = 2 * width * 8  # bytes of a microbatch's activation, and of its gradient
    want = [act * sum(n for (s, _), n in neighbours.items() if s == r) for r in range(P)]
    said = ", ".join(f"{s}->{t} {n}" for (s, t), n in pairs.items())
    return (f"1F1B, P = {P}, M = {M}: bytes sent per stage {sent} = M activations forward (not the last stage) + "
            f"M gradients back (not the first); messages from stage to stage: {said or 'none'}"), \
        sent == want and pairs == neighbours


def against_references(step, schedule: str, P: int, M: int, width: int) -> tuple[float, float]:
    """One textbook step on P stages of fp64 Linear layers: the largest |difference| of its loss and gradients
    from one process on the whole batch, and that of torch's `schedule` on the same stages."""
    model = mlp([width] * (P + 1))
    x = torch.randn(3 * M, width, dtype=torch.float64, device=launch.device())  # inputs, and targets
    chunks = pipeline_chunks(model)

    def ours(loss_fn, first):
        return step(chunks[0], x, x, loss_fn, M, (3, width), torch.float64), None

    def theirs(loss_fn):
        return references.torch_step(chunks, schedule, M, loss_fn)(x, x)
    mine, torchs, _ = references.against_one_process(model, chunks, x, x, ours, theirs)
    return mine, torchs


def demo(args) -> int:
    P = flags.pipeline_ranks(args)
    M = args.microbatches
    launch.setup()
    launch.print0(f"P={P} M={M}, fp64, one step: the largest |difference| of loss and gradients from one process on "
                  f"the whole batch\n{'step':<6} | {'mini_dist':>9} | torch's")
    worst = 0.0
    for name, (step, schedule) in STEPS.items():
        ours, theirs = against_references(step, schedule, P, M, args.width)
        worst = max(worst, ours, theirs)
        launch.print0(f"{name:<6} | {ours:>9.1e} | {theirs:.1e} ({schedule})")
    flows, flows_ok = what_flows_between_stages(M, args.width)
    launch.print0(f"\nwhat flows between stages: {flows}")
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return launch.conclude("pipeline", worst < 1e-12, f"GPipe and 1F1B = torch = full batch (fp64, {worst:.0e})",
                           flows_ok, "bytes sent per stage = M activations each way; only neighbours talk")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
