"""Pipeline parallelism: a model cut into P stages, microbatches flowing through them, GPipe and 1F1B.

The layers of a sequential model are cut into P consecutive stages, stage s on rank s of the pipeline
group, and the batch into M microbatches. Stage s receives microbatch m's activation from stage s-1, runs
its layers and sends the result on; the last stage computes the loss; activation gradients travel back
the same way, and every stage accumulates its parameters' gradients over the M microbatches. While the
pipe fills and drains, stages wait: if one microbatch's forward + backward takes t on every stage, a step
takes (M+P-1)*t, of which each stage computes for M*t, so

    bubble fraction = (P-1) / (M+P-1)        (more microbatches, smaller bubble)

GPipe (Huang et al. 2019) runs all M forwards, then all M backwards: a stage holds M microbatches'
activations. 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs each backward as early as it can: the same
bubble, but stage s never holds more than P-s microbatches, however large M grows.

A schedule is data (as in ShallowSpeed): per stage, an ordered list of actions. It can be printed,
simulated and tested without processes; `pipeline_step` runs it with isend/irecv. VERBOSE=1 prints every
send and receive as it happens.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline.py [--bench]

Mirrors torch.distributed.pipelining: PipelineStage with ScheduleGPipe / Schedule1F1B.
"""
import functools
import itertools
import math
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.launch import VERBOSE, conclude, device, print0, setup

# ----- cutting a model into stages -----


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
                         f"least one layer): use at most {len(layers)} pipeline ranks, or a deeper model")
    if sizes is None:
        sizes = balanced_split([1 + sum(p.numel() for p in layer.parameters()) for layer in layers], n_stages)
    if len(sizes) != n_stages or min(sizes) < 1 or sum(sizes) != len(layers):
        raise ValueError(f"sizes {sizes} must be {n_stages} positive layer counts summing to {len(layers)}")
    bounds = [0, *itertools.accumulate(sizes)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def pipeline_stage(model: nn.Sequential, group=None, sizes: list[int] | None = None) -> nn.Sequential:
    """This rank's stage of `model`: stage i lives on rank i of the pipeline group."""
    return split_model(model, dist.get_world_size(group), sizes)[dist.get_rank(group)]


# ----- schedules as data -----

class Action(NamedTuple):
    op: str  # recv_act, forward, send_act, recv_grad, backward, send_grad
    mb: int  # the microbatch it works on


def _with_communication(order: list[list[tuple[str, int]]]) -> list[list[Action]]:
    """Turn each stage's order of computations, ("F", m) and ("B", m), into actions with their messages."""
    if not order or not order[0]:
        raise ValueError("a pipeline schedule needs at least one stage and one microbatch")
    schedule = []
    for s, computations in enumerate(order):
        prev, nxt = s > 0, s < len(order) - 1  # is there a stage before / after this one?
        actions = []
        for kind, m in computations:
            if kind == "F":  # the input comes from the previous stage, the output goes to the next
                actions += [Action("recv_act", m)] * prev + [Action("forward", m)]
                actions += [Action("send_act", m)] * nxt
            else:  # the output's gradient comes from the next stage, the input's goes to the previous
                actions += [Action("recv_grad", m)] * nxt + [Action("backward", m)]
                actions += [Action("send_grad", m)] * prev
        schedule.append(actions)
    return schedule


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs all M forwards, then all M backwards (holding M microbatches' activations)."""
    order = [("F", m) for m in range(n_microbatches)] + [("B", m) for m in range(n_microbatches)]
    return _with_communication([order] * n_stages)


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[Action]]:
    """1F1B: stage s runs P-1-s warm-up forwards, then alternates one forward and one backward, then
    drains the last backwards. Each backward frees a microbatch, so stage s holds at most P-s of them."""
    P, M, order = n_stages, n_microbatches, []
    for s in range(P):
        warmup = min(P - 1 - s, M)
        steady = [c for i in range(M - warmup) for c in (("F", warmup + i), ("B", i))]
        order.append([("F", m) for m in range(warmup)] + steady + [("B", m) for m in range(M - warmup, M)])
    return _with_communication(order)


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def simulate(schedule: list[list[Action]], t_forward: float = 1, t_backward: float = 2) -> list[list[tuple]]:
    """Play a schedule as the executor runs it: a send never blocks (isend), a receive waits for its
    message, messages between two stages arrive in the order sent; forward and backward take t_forward
    and t_backward. Returns each stage's timeline of (op, mb, start, end). Raises RuntimeError on a
    deadlock (no stage can move), a receive that would get the wrong microbatch, or a message never read."""
    P = len(schedule)
    timeline, clock, pc = [[] for _ in range(P)], [0] * P, [0] * P
    wires = defaultdict(deque)  # (src, dst) -> [(microbatch, time sent)] in the order sent
    moved = True
    while moved:
        moved = False
        for s in range(P):
            while pc[s] < len(schedule[s]):
                op, m = schedule[s][pc[s]]
                start = clock[s]
                if op in ("send_act", "send_grad"):
                    wires[s, s + 1 if op == "send_act" else s - 1].append((m, start))
                elif op in ("forward", "backward"):
                    clock[s] += t_forward if op == "forward" else t_backward
                else:
                    src = s - 1 if op == "recv_act" else s + 1
                    if not wires[src, s]:
                        break
                    sent, at = wires[src, s].popleft()
                    if sent != m:
                        raise RuntimeError(f"stage {s} {op} {m} would receive microbatch {sent} "
                                           f"from stage {src}")
                    clock[s] = max(clock[s], at)
                timeline[s].append((op, m, start, clock[s]))
                pc[s], moved = pc[s] + 1, True
    stuck = [f"stage {s} at {schedule[s][pc[s]]}" for s in range(P) if pc[s] < len(schedule[s])]
    if stuck:
        raise RuntimeError("deadlock: " + ", ".join(stuck))
    unread = [f"{src}->{dst}: {list(wire)}" for (src, dst), wire in wires.items() if wire]
    if unread:
        raise RuntimeError("sent but never received: " + ", ".join(unread))
    return timeline


def bubble_fraction(timeline: list[list[tuple]]) -> float:
    """The share of P x (step time) that stages spend not computing (waiting, sending, idle)."""
    events = [e for stage in timeline for e in stage]
    span = max(e[3] for e in events) - min(e[2] for e in events)
    busy = sum(end - start for op, _, start, end in events if op in ("forward", "backward"))
    return (len(timeline) * span - busy) / (len(timeline) * span)


def live_microbatches(actions: list[Action]) -> int:
    """Most microbatches whose forward ran and backward did not yet: whose activations a stage holds."""
    return max(itertools.accumulate((op == "forward") - (op == "backward") for op, _ in actions))


def timeline_picture(timeline: list[list[tuple]], unit: float = 1) -> str:
    """Stages as rows, time as columns of `unit`: F3 / B3 where a stage computes microbatch 3, . idle."""
    compute = [[e for e in stage if e[0] in ("forward", "backward")] for stage in timeline]
    columns = math.ceil(max(e[3] for stage in compute for e in stage) / unit - 1e-9)
    width = 2 + max(len(str(e[1])) for stage in compute for e in stage)
    rows = []
    for s, events in enumerate(compute):
        cells = (next((f"{op[0].upper()}{m}" for op, m, a, b in events if a <= (k + 0.5) * unit < b), ".")
                 for k in range(columns))
        rows.append(f"stage {s} |" + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)


# ----- the executor -----

HEADER_LEN = 10  # int64s: dtype code, ndim, up to 8 sizes
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@dataclass
class StepStats:
    """What one stage measured during one step."""
    events: list = field(default_factory=list)  # (op, microbatch, start_s, end_s) since the step began
    peak_live: int = 0   # most microbatches whose activations were held at once
    bytes_sent: int = 0  # activations forward + activation gradients backward + one shape header


def pipeline_step(stage: nn.Module, schedule: list[list[Action]], inputs=None, targets=None, loss_fn=None,
                  group=None):
    """Run one training step of `schedule` on this rank's `stage` (any module, one tensor to one tensor).

    The first stage passes the whole batch `inputs`, the last `targets` and `loss_fn(output, target)` (a
    mean over its microbatch). Gradients accumulate into .grad as those of loss_fn on the whole batch.
    Returns (the batch loss on the last stage, else None; StepStats). Sends are left in flight, so a
    stage blocks only on receives: any schedule `simulate` accepts runs here without deadlock. A send is
    posted together with the receive that follows it (batch_isend_irecv, as Megatron does): NCCL runs a
    pair's sends and receives in order, and 1F1B's crossing "send act / recv grad" on one side and
    "send grad / recv act" on the other would otherwise wait on each other there."""
    P, s = dist.get_world_size(group), dist.get_rank(group)
    if len(schedule) != P:
        raise ValueError(f"the schedule has {len(schedule)} stages but the pipeline group {P} ranks")
    first, last, dev = s == 0, s == P - 1, device()
    M = sum(op == "forward" for op, _ in schedule[s])
    # Only the first stage sees the inputs and only the last the targets, yet every rank must reject a bad
    # batch alike before anyone waits for a neighbour: one small all-reduce shares what each one knows.
    known = torch.tensor([len(inputs) if first and inputs is not None else 0,
                          len(targets) if last and targets is not None else 0,
                          (first and inputs is None) or (last and (targets is None or loss_fn is None))],
                         device=dev)
    dist.all_reduce(known, op=dist.ReduceOp.MAX, group=group)
    batch, n_targets, missing = known.tolist()
    if missing:
        raise ValueError("the first stage needs `inputs`, the last stage `targets` and `loss_fn`")
    if batch != n_targets or batch % M:
        raise ValueError(f"a batch of {batch} inputs and {n_targets} targets cannot be cut into {M} equal "
                         f"microbatches: pass as many targets as inputs and choose M dividing {batch}")
    x_in = dict(enumerate(inputs.chunk(M))) if first else {}
    y_target = targets.chunk(M) if last else None
    out, grad_out, in_flight, loss, shape, shape_sent, stats = {}, {}, [], None, None, False, StepStats()
    pending = []  # sends not posted yet: they go out with the next receive, or before the next compute

    def send(tensor, peer):  # peer, like s, is a rank of the pipeline group: stage i is its rank i
        tensor = tensor.contiguous()
        stats.bytes_sent += tensor.numel() * tensor.element_size()
        pending.append(dist.P2POp(dist.isend, tensor, group=group, group_peer=peer))

    def post(recv_op=None):
        ops = pending + ([recv_op] if recv_op else [])
        works = dist.batch_isend_irecv(ops) if ops else []
        in_flight.extend((w, op.tensor) for w, op in zip(works, pending))  # buffers kept until sent
        pending.clear()
        return works[-1] if recv_op else None

    def recv(tensor, peer):
        post(dist.P2POp(dist.irecv, tensor, group=group, group_peer=peer)).wait()
        return tensor

    t0 = time.perf_counter()
    for op, m in schedule[s]:
        start = time.perf_counter() - t0
        if op in ("forward", "backward"):
            post()  # the neighbour should not wait for our compute to get what is already done
        if op == "recv_act":
            if shape is None:  # all microbatches have one shape: it travels once, in a header
                header = recv(torch.empty(HEADER_LEN, dtype=torch.int64, device=dev), s - 1)
                code, ndim, *sizes = header.tolist()
                shape = (sizes[:ndim], _DTYPES[code])
            x_in[m] = recv(torch.empty(shape[0], dtype=shape[1], device=dev), s - 1).requires_grad_()
        elif op == "forward":
            out[m] = stage(x_in[m])
            if last:  # the mean of M microbatch means is the batch mean
                out[m] = loss_fn(out[m], y_target[m]) / M
                loss = out[m].detach() if loss is None else loss + out[m].detach()
        elif op == "send_act":
            if not shape_sent:
                shape_sent, header = True, [_DTYPES.index(out[m].dtype), out[m].dim(), *out[m].shape]
                send(torch.tensor(header + [0] * (HEADER_LEN - len(header)), device=dev), s + 1)
            send(out[m].detach(), s + 1)
        elif op == "recv_grad":
            grad_out[m] = recv(torch.empty_like(out[m]), s + 1)
        elif op == "backward":
            y = out.pop(m)
            if y.requires_grad:  # else nothing before it needs a gradient (a frozen first stage)
                torch.autograd.backward(y, grad_out.pop(m, None))
        elif op == "send_grad":
            x = x_in.pop(m)
            send(x.grad if x.grad is not None else torch.zeros_like(x), s - 1)
        if VERBOSE and op.startswith(("send", "recv")):
            print(f"[rank {dist.get_rank()}] stage {s} {op} microbatch {m}", flush=True)
        # a buffer goes once sent: holding all M until the end would undo 1F1B's memory saving
        in_flight = [(work, t) for work, t in in_flight if not work.is_completed()]
        stats.peak_live = max(stats.peak_live, len(out))
        stats.events.append((op, m, start, time.perf_counter() - t0))
    post()
    for work, _ in in_flight:
        work.wait()
    return loss, stats


# ----- demo: the check against torch.distributed.pipelining, then bubble and memory measured -----

def torch_pipelining(stage, name, n_microbatches, loss_fn, group=None):
    """The reference, torch.distributed.pipelining, on the same stage (demo and tests only):
    returns step(inputs, targets) -> the batch loss on the last stage, else None."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    P, s = dist.get_world_size(group), dist.get_rank(group)
    reference = PipelineStage(stage, s, P, device(), group=group)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](reference, n_microbatches, loss_fn)

    def step(inputs, targets):
        losses = []
        schedule.step(*[inputs] * (s == 0), **(dict(target=targets, losses=losses) if s == P - 1 else {}))
        return torch.stack(losses).mean() if losses else None
    return step


class SimulatedCompute(nn.Module):
    """Stands in for compute: 4 ranks on 2 shared cores cannot run 4 matmuls side by side, but they can
    sleep side by side, as 4 devices compute (forward t, backward 2t, as in practice)."""
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        self.compute(x, self.seconds)
        x = x.clone()
        x.register_hook(lambda grad: self.compute(grad, 2 * self.seconds))
        return x

    @staticmethod
    def compute(t, seconds):
        if t.is_cuda:  # a kernel starts once its input has arrived; on a GPU, irecv().wait() did not block
            torch.cuda.synchronize(t.device)
        time.sleep(seconds)


def against_torch(model: nn.Sequential, x, y, steps: int = 0):
    """Ours and torch.distributed.pipelining, both schedules, M = 2P (torch's 1F1B refuses M < P), on this
    rank's stage of `model`: the max |difference| of loss and grads from one process on the full batch,
    and {(schedule, executor): ms per step} over `steps` more steps (the checked one is their warm-up)."""
    P, M, loss_fn = dist.get_world_size(), 2 * dist.get_world_size(), nn.MSELoss()
    full_loss = loss_fn(model(x), y)
    full_loss.backward()
    stage = pipeline_stage(model)
    expected, worst, times = [p.grad.clone() for p in stage.parameters()], 0.0, {}
    for name, build in SCHEDULES.items():
        for who, step in (("mini_dist", lambda a, b: pipeline_step(stage, build(P, M), a, b, loss_fn)[0]),
                          ("torch.distributed.pipelining", torch_pipelining(stage, name, M, loss_fn))):
            stage.zero_grad()
            loss = step(x, y)
            worst = max([worst, 0.0 if loss is None else abs(loss - full_loss).item()] +
                        [(p.grad - e).abs().max().item() for p, e in zip(stage.parameters(), expected)])
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            if x.is_cuda:  # the steps' kernels run after the host has moved on: wait for them
                torch.cuda.synchronize()
            dist.barrier()
            times[name, who] = (time.perf_counter() - start) / max(steps, 1) * 1e3
    return worst, times


def measure(P: int, M: int, name: str, seconds: float, width: int = 64):
    """One step on sleeping stages: every stage's timeline, stage 0's peak of live microbatches, and
    whether every stage held and sent what it should (GPipe M, 1F1B min(M, P-s); a batch each way)."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh(), SimulatedCompute(seconds))
                            for _ in range(P)]).to(device())
    x, y = (torch.randn(4 * M, width).to(device()) for _ in "xy")
    _, stats = pipeline_step(pipeline_stage(model), SCHEDULES[name](P, M), x, y, nn.MSELoss())
    every = [None] * P
    dist.all_gather_object(every, stats)
    batch = x.numel() * x.element_size()  # forward to s+1 (with one header), backward to s-1
    ok = all(st.peak_live == (M if name == "gpipe" else min(M, P - s))
             and st.bytes_sent == (batch + 8 * HEADER_LEN) * (s < P - 1) + batch * (s > 0)
             for s, st in enumerate(every))
    return [st.events for st in every], every[0].peak_live, ok


def demo() -> int:
    P, t = setup().world_size, 0.03
    torch.manual_seed(0)  # the same model and batch on every rank
    widths = [8, 32, 16, 24, 16, 32, 8, 4]
    model = nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())])
    x, y = (torch.randn(48, w, dtype=torch.float64).to(device()) for w in (8, 4))
    worst = against_torch(model.to(device(), torch.float64), x, y)[0]
    print0(f"loss and grads, fp64: pipelined GPipe and 1F1B = torch.distributed.pipelining = one process on "
           f"the full batch, max diff {worst:.1e}")
    figure_ok, rows = True, []
    for M in (2, 4, 8):
        formula, row = (P - 1) / (M + P - 1), f"{M:>3}"
        for name in SCHEDULES:
            # the best of three steps, as timeit takes the best: other processes on a shared host (and the
            # first messages, which open the connections) only add time
            runs = [measure(P, M, name, t) for _ in range(3)]
            timeline, live, _ = min(runs, key=lambda run: bubble_fraction(run[0]))
            # the formula ignores messages: on a loaded CPU host a hop costs a few ms against 30 ms stages
            figure_ok &= all(run[2] for run in runs) and abs(bubble_fraction(timeline) - formula) < 0.05
            row += f" {bubble_fraction(timeline):>7.3f} {f'({live})':>6}"
            if M == 8:
                print0(f"{name}, P={P} M={M}, measured (a column = one forward, {t * 1e3:.0f} ms):\n"
                       f"{timeline_picture(timeline, unit=t)}")
        rows.append(f"{row} {formula:>14.3f}")
    print0("measured bubble beside the formula; (live): stage 0's peak of microbatches held\n"
           f"{'M':>3} {'GPipe':>7} (live) {'1F1B':>7} (live) {'(P-1)/(M+P-1)':>14}\n" + "\n".join(rows))
    if "--bench" in sys.argv:  # real compute: ours vs torch on the same split, timed in one run
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(2 * P)])
        x, y = (torch.randn(256, 1024).to(device()) for _ in "xy")
        times = against_torch(model.to(device()), x, y, steps=5)[1]
        for name in SCHEDULES:
            print0(f"bench {name:>5} P={P} M={2 * P}: " + ", ".join(
                f"{who} {ms:.0f} ms/step" for (n, who), ms in times.items() if n == name))
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return conclude("pipeline", worst < 1e-12, f"= torch pipelining = full batch (fp64, {worst:.0e})",
                    figure_ok, "bubble within 0.05 of (P-1)/(M+P-1); live mb GPipe M, 1F1B min(M,P-s); bytes")


if __name__ == "__main__":
    raise SystemExit(demo())
