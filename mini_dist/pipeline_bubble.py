"""The pipeline bubble, predicted and measured: every schedule simulated, then run on ranks that sleep.

While a pipeline fills and drains, ranks wait. With P stages, M microbatches and every stage taking F
for a forward, B for its input's gradient and W for its weights' gradient, the simulator below plays a
schedule exactly as mini_dist/pipeline.py runs it (a send never blocks, a receive waits for its message)
and finds the share of the step that ranks spend waiting, which for M >= P is what the papers say:

    GPipe, 1F1B         (P-1)(F+B+W) / (M(F+B+W) + (P-1)(F+B+W))  =  (P-1) / (M+P-1)
    interleaved 1F1B    (P-1) / (v*M+P-1)         the fill and drain of a chunk v times shorter
    zero bubble ZB-H1   (P-1)(F+B-W) / (M(F+B+W) + (P-1)(F+B-W))  =  (P-1) / (3M+P-1) for F = B = W

(ZB-H1's form holds for W <= F, B: each rank's deferred W's fill the drain, only F+B-W per hop is left.)
With M < P a microbatch comes back round the ring of an interleaved schedule before there is work, and
the bubble grows above the formula; GPipe and 1F1B keep theirs.

Measured: 4 ranks on 2 shared CPU cores cannot run 4 matmuls side by side, but they can sleep side by side,
as 4 devices compute, so each stage here sleeps F in forward, B for the input's gradient and W for its
weight's, and the executor's own clock gives each rank's timeline. The demo prints the ideal timeline
above the measured one (what jitter adds is then plain to see) and the bubble of each beside the formula.

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_bubble.py [--microbatches 4 --chunks 2]
"""
import math
import sys
import time
from collections import defaultdict, deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.pipeline import against_one_process
from mini_dist.pipeline_schedules import (COMPUTE, SCHEDULES, Event, Schedule, label, live_microbatches,
                                          pipeline_chunks, route, schedules_for)


def bubble_formula(name: str, P: int, M: int, v: int = 1) -> float:
    """The papers' bubble fraction for uniform stage times (F = B = W for zero bubble), M >= P."""
    return (P - 1) / ({"interleaved": v, "zero_bubble": 3}.get(name, 1) * M + P - 1)


def simulate(schedule: Schedule, F: float = 1, B: float = 1, W: float = 1) -> list[list[Event]]:
    """Play a schedule as the executor runs it: a send never blocks (isend), a receive waits for its
    message, messages between two ranks arrive in the order sent; a forward takes F, B the input's
    gradient, W the weights' gradient, a full backward B + W. Returns each rank's events. Raises
    RuntimeError on a deadlock (no rank can move), a receive that would get another message, a backward
    before its forward or a W before its B, and a message never read."""
    P = len(schedule.actions)
    S, cost = P * schedule.n_chunks, {"forward": F, "backward": B + W, "backward_input": B, "backward_weight": W}
    before = {"backward": "forward", "backward_input": "forward", "backward_weight": "backward_input"}
    timeline, clock, pc, done = [[] for _ in range(P)], [0] * P, [0] * P, set()
    wires = defaultdict(deque)  # (from, to) -> [(message, time sent)] in the order sent
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pc[r] < len(schedule.actions[r]):
                a, start = schedule.actions[r][pc[r]], clock[r]
                if a.op in cost:
                    if a.op in before and (r, before[a.op], a.mb, a.chunk) not in done:
                        raise RuntimeError(f"rank {r} runs {a} before its {before[a.op]}")
                    clock[r] += cost[a.op]
                    done.add((r, a.op, a.mb, a.chunk))
                elif a.op.startswith("send"):
                    peer, message = route(a, r, P, S)
                    wires[r, peer].append((message, start))
                else:
                    peer, message = route(a, r, P, S)
                    if not wires[peer, r]:
                        break
                    got, at = wires[peer, r].popleft()
                    if got != message:
                        raise RuntimeError(f"rank {r} {a.op} expects {message} but rank {peer} sent {got} first")
                    clock[r] = max(clock[r], at)
                timeline[r].append(Event(a.op, a.mb, a.chunk, start, clock[r]))
                pc[r], moved = pc[r] + 1, True
    stuck = [f"rank {r} at {schedule.actions[r][pc[r]]}" for r in range(P) if pc[r] < len(schedule.actions[r])]
    if stuck:
        raise RuntimeError("deadlock: " + ", ".join(stuck))
    unread = [f"{src}->{dst}: {[m for m, _ in wire]}" for (src, dst), wire in wires.items() if wire]
    if unread:
        raise RuntimeError("sent but never received: " + ", ".join(unread))
    return timeline


def bubble_fraction(timeline: list[list[Event]]) -> float:
    """The share of P x (step time) that ranks spend not computing (waiting, sending, idle)."""
    events = [e for rank in timeline for e in rank]
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events if e.op in COMPUTE)
    return (len(timeline) * span - busy) / (len(timeline) * span)


def timeline_picture(timeline: list[list[Event]], unit: float = 1) -> str:
    """Ranks as rows, time as columns of `unit`: F3 / B3 / W3 where a rank computes microbatch 3 (with
    chunks: F3a on the first, F3b on the second), . where it waits."""
    compute = [[e for e in rank if e.op in COMPUTE] for rank in timeline]
    chunks = max(e.chunk for rank in compute for e in rank) > 0
    columns = math.ceil(max(e.end for rank in compute for e in rank) / unit - 1e-9)
    width = 1 + max(len(label(e, chunks)) for rank in compute for e in rank)
    rows = []
    for r, events in enumerate(compute):
        cells = (next((label(e, chunks) for e in events if e.start <= (k + 0.5) * unit < e.end), ".")
                 for k in range(columns))
        rows.append(f"rank {r} |" + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)


# ----- measured: stages that sleep for their compute -----

class SimulatedCompute(nn.Module):
    """A layer that sleeps t in forward, t for its input's gradient (B) and t for its weight's (W), and
    computes x * weight (weight = 1), so that the step it is part of is still checked to the last bit."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.weight = seconds, nn.Parameter(torch.ones((), dtype=torch.float64))
        self.weight.register_hook(self.compute)  # W

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(self.compute)  # B
        return self.compute(x) or x * self.weight

    def compute(self, t):
        if t.is_cuda:  # a kernel starts once its input has arrived; on a GPU, irecv().wait() did not block
            torch.cuda.synchronize(t.device)
        time.sleep(self.seconds)


def measure(name: str, P: int, M: int, v: int, seconds: float, trace: bool, width: int = 16):
    """Three of our steps of schedule `name` on sleeping stages and one of torch's: the largest difference
    of their loss and gradients from one process (fp64), and every rank's StepStats of our fastest step."""
    torch.manual_seed(0)  # the same model and batch on every rank
    model = nn.Sequential(*[m for _ in range(P * v) for m in (nn.Linear(width, width), nn.Tanh(),
                                                              SimulatedCompute(seconds))])
    model = model.to(launch.device(), torch.float64)
    x, y = (torch.randn(4 * M, width, dtype=torch.float64, device=launch.device()) for _ in "xy")
    chunks = pipeline_chunks(model, None, v, [3] * P * v)
    ours, theirs, steps = against_one_process(model, chunks, name, SCHEDULES[name](P, M, v), x, y, 3, trace)
    every = [[None] * P for _ in steps]
    for mine, gathered in zip(steps, every):
        dist.all_gather_object(gathered, mine)
    return max(ours, theirs), min(every, key=lambda ranks: bubble_fraction([s.events for s in ranks]))


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=4, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    p.add_argument("--stage-ms", type=float, default=20, help="F = B = W of a whole stage, in ms")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    return p


def demo(args) -> int:
    P, M, t = launch.env_world_size(), args.microbatches, args.stage_ms / 1e3
    launch.require(t > 0, "--stage-ms must be positive")
    plans = schedules_for(args.schedules, P, M, args.chunks)
    launch.setup()
    worst, rows, figure_ok = 0.0, [], True
    for name, plan in plans.items():
        v = plan.n_chunks
        diff, stats = measure(name, P, M, v, t / v, trace=launch.VERBOSE and name == next(iter(plans)))
        ideal, measured = simulate(plan, *[t / v] * 3), [s.events for s in stats]
        worst, live = max(worst, diff), [live_microbatches(a) for a in plan.actions]
        # a message costs a few ms on a loaded CPU host: 0.05 of the step leaves room for that alone
        figure_ok &= abs(bubble_fraction(measured) - bubble_fraction(ideal)) < 0.05
        figure_ok &= [s.peak_live for s in stats] == live
        pictures = zip(*(timeline_picture(tl, t / v).split("\n") for tl in (ideal, measured)))
        launch.print0(f"\n{name}" + f" v={v}" * (v > 1) + f", P={P} M={M} (a column = {t / v * 1e3:.0f} ms), "
                      "ideal (simulated) over measured:\n" + "\n".join(f"{a}\n{'':7}|{b[8:]}" for a, b in pictures))
        rows.append(f"{name:<12} {bubble_fraction(measured):>9.3f} {bubble_fraction(ideal):>10.3f} "
                    f"{bubble_formula(name, P, M, v):>8.3f} {str(live):>15}")
    launch.print0(f"\n{'schedule':<12} {'measured':>9} {'simulated':>10} {'formula':>8} {'live per rank':>15}\n"
                  + "\n".join(rows))
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return launch.conclude("pipeline_bubble", worst < 1e-12, f"{len(plans)} schedules = torch = full batch (fp64, "
                           f"{worst:.0e})", figure_ok, "measured bubble within 0.05 of the simulated; live as scheduled")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
