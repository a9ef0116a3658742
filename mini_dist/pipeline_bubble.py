"""The pipeline bubble, predicted and measured: every schedule simulated, then run on ranks that sleep.

While a pipeline fills and drains, ranks wait. With P stages, M microbatches and every stage taking F
for a forward, B for its input's gradient and W for its weights' gradient, the simulator below plays a
schedule exactly as mini_dist/pipeline_executor.py runs it (a send never blocks, a receive waits for its message)
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
above the measured one (what jitter adds is then plain to see), and the bubble measured over several
steps (median and spread) beside the simulated one and the formula. Only what is deterministic decides its
exit status: the simulated bubble against the formula, the activations each rank kept; a wall clock on a
shared machine is shown, never judged.

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
from mini_dist.kit import launch, references, weakly
from mini_dist.kit.timing import median, quantile
from mini_dist.pipeline_actions import COMPUTE, Event, Schedule, label, live_microbatches, route
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES, TORCH_SCHEDULES, schedules_for
from mini_dist.pipeline_stages import pipeline_chunks

BEFORE = {"backward": "forward", "backward_input": "forward", "backward_weight": "backward_input"}


def bubble_formula(name: str, P: int, M: int, v: int = 1) -> float:
    """The papers' bubble fraction for uniform stage times (F = B = W for zero bubble), M >= P."""
    shorter = {"interleaved": v, "zero_bubble": 3}.get(name, 1)  # how many times shorter the fill and drain
    return (P - 1) / (shorter * M + P - 1)


def simulate(schedule: Schedule, F: float = 1, B: float = 1, W: float = 1) -> list[list[Event]]:
    """Play a schedule as the executor runs it: a send never blocks (isend), a receive waits for its
    message, messages between two ranks arrive in the order sent; a forward takes F, B the input's
    gradient, W the weights' gradient, a full backward B + W. Returns each rank's events. Raises
    RuntimeError on a deadlock (no rank can move), a receive that would get another message, a backward
    before its forward or a W before its B, and a message never read."""
    P = len(schedule.actions)
    S = P * schedule.n_chunks
    cost = {"forward": F, "backward": B + W, "backward_input": B, "backward_weight": W}
    timeline = [[] for _ in range(P)]
    clock = [0] * P  # each rank's time
    pc = [0] * P     # each rank's next action
    done = set()     # (rank, op, microbatch, chunk) computed
    wires = defaultdict(deque)  # (from, to) -> [(message, time sent)] in the order sent
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pc[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pc[r]]
                start = clock[r]
                if a.op in cost:
                    if a.op in BEFORE and (r, BEFORE[a.op], a.mb, a.chunk) not in done:
                        raise RuntimeError(f"rank {r} runs {a} before its {BEFORE[a.op]}")
                    clock[r] += cost[a.op]
                    done.add((r, a.op, a.mb, a.chunk))
                elif a.op.startswith("send"):
                    peer, message = route(a, r, P, S)
                    wires[r, peer].append((message, start))
                else:
                    peer, message = route(a, r, P, S)
                    if not wires[peer, r]:
                        break  # its message is not sent yet: the next rank's turn
                    got, at = wires[peer, r].popleft()
                    if got != message:
                        raise RuntimeError(f"rank {r} {a.op} expects {message} but rank {peer} sent {got} first")
                    clock[r] = max(clock[r], at)
                timeline[r].append(Event(a.op, a.mb, a.chunk, start, clock[r]))
                pc[r] += 1
                moved = True
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


def timeline_picture(timeline: list[list[Event]], unit: float = 1, letters: bool = False) -> str:
    """Ranks as rows, time as columns of `unit`: F3 / B3 / W3 where a rank computes microbatch 3 at the
    column's middle (with chunks: F3a on the first, F3b on the second), . where it waits. With `letters`, a
    column is one character: F, B or W (lowercase on a rank's second chunk and after)."""
    compute = [[e for e in rank if e.op in COMPUTE] for rank in timeline]
    chunks = max(e.chunk for rank in compute for e in rank) > 0
    end = max(e.end for rank in compute for e in rank)
    cell = 1 if letters else cell_width(timeline)

    def text(e) -> str:
        """What a column shows of event e."""
        if not letters:
            return label(e, chunks)
        letter = label(e, False)[0]
        return letter.lower() if e.chunk else letter
    rows = []
    for r, events in enumerate(compute):
        cells = (next((text(e) for e in events if e.start <= (k + 0.5) * unit < e.end), ".")
                 for k in range(math.ceil(end / unit - 1e-9)))
        rows.append(f"rank {r} |" + "".join(c.ljust(cell) for c in cells).rstrip())
    return "\n".join(rows)


def cell_width(timeline: list[list[Event]]) -> int:
    """Characters per column of a labelled picture: the longest label (F12b) and a space."""
    mb = max(e.mb for rank in timeline for e in rank)
    chunk = max(e.chunk for rank in timeline for e in rank)
    return 2 + len(str(mb)) + (1 if chunk > 0 else 0)


def fitting_columns(timelines: list, unit: float, width: int = 100) -> tuple[float, bool]:
    """(time per column, letters?) that fit the longest of these timelines in `width` characters: labels
    at `unit` if they fit, else one letter per column, at `unit` or more."""
    end = max(e.end for tl in timelines for rank in tl for e in rank)
    if math.ceil(end / unit - 1e-9) * max(map(cell_width, timelines)) <= width - 8:  # 8: "rank r |"
        return unit, False
    return max(unit, end / (width - 8)), True


# ----- measured: stages that sleep for their compute -----

class SimulatedCompute(nn.Module):
    """A layer that sleeps t in forward, t for its input's gradient (B) and t for its weight's (W), and
    computes x * weight (weight = 1), so that the step it is part of is still checked to the last bit."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones((), dtype=torch.float64))  # cpu: until model.to
        self.weight.register_hook(weakly(self.compute))  # W

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(weakly(self.compute))  # B
        self.compute(x)
        return x * self.weight

    def compute(self, t) -> None:
        if t.is_cuda:  # a kernel starts once its input has arrived; on a GPU, irecv().wait() did not block
            torch.cuda.synchronize(t.device)
        time.sleep(self.seconds)


def measure(name: str, P: int, M: int, v: int, seconds: float, steps: int, trace: bool, width: int = 16):
    """`steps` of our steps of schedule `name` on sleeping stages and one of torch's: the largest difference
    of their loss and gradients from one process (fp64), and for each of our steps every rank's StepStats."""
    torch.manual_seed(0)  # the same model and batch on every rank
    model = nn.Sequential(*[m for _ in range(P * v) for m in (
        nn.Linear(width, width), nn.Tanh(), SimulatedCompute(seconds))]).to(launch.device(), torch.float64)
    x = torch.randn(4 * M, width, dtype=torch.float64, device=launch.device())
    y = torch.randn(4 * M, width, dtype=torch.float64, device=launch.device())
    chunks = pipeline_chunks(model, None, v, [3] * P * v)
    plan = SCHEDULES[name](P, M, v)

    def ours(loss_fn, first):
        return pipeline_step(chunks, plan, x, y, loss_fn, trace=trace and first)

    def theirs(loss_fn):
        return references.torch_step(chunks, TORCH_SCHEDULES[name], M, loss_fn)(x, y)
    mine, torchs, stats = references.against_one_process(model, chunks, x, y, ours, theirs, steps)
    every = [[None] * P for _ in stats]
    for step, gathered in zip(stats, every):
        dist.all_gather_object(gathered, step)
    return max(mine, torchs), every


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--microbatches", type=int, default=4, help="M, microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank of the interleaved schedule")
    p.add_argument("--stage-ms", type=float, default=20, help="F = B = W of a whole stage, in ms")
    p.add_argument("--steps", type=int, default=5, help="measured steps per schedule (their median is shown)")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    return p


def pictures(name: str, plan: Schedule, ideal: list, measured: list, unit: float) -> str:
    """The ideal timeline above the measured one, rank by rank, in columns that fit the screen."""
    unit, letters = fitting_columns([ideal, measured], unit)
    rows = zip(*(timeline_picture(timeline, unit, letters).split("\n") for timeline in (ideal, measured)))
    chunks = f" v={plan.n_chunks}" if plan.n_chunks > 1 else ""
    legend = " (F, B, W; lowercase: a later chunk)" if letters else ""
    return (f"\n{name}{chunks}, P={len(plan.actions)} M={plan.n_microbatches}, a column = {unit * 1e3:.1f} ms{legend}; "
            f"each rank: ideal (simulated) over measured (the median step):\n"
            + "\n".join(f"{a}\n{'':7}|{b[8:]}" for a, b in rows))


def demo(args) -> int:
    P = launch.env_world_size()
    M = args.microbatches
    t = args.stage_ms / 1e3
    n = args.steps
    launch.require(t > 0 and n >= 1, "--stage-ms must be positive and --steps at least 1")
    plans = schedules_for(args.schedules, P, M, args.chunks)
    launch.setup()
    worst = 0.0
    rows = []
    figure_ok = True
    for name, plan in plans.items():
        v = plan.n_chunks
        diff, steps = measure(name, P, M, v, t / v, n, trace=launch.VERBOSE and name == next(iter(plans)))
        bubbles = [bubble_fraction([s.events for s in ranks]) for ranks in steps]
        middle = sorted(range(n), key=bubbles.__getitem__)[n // 2]  # the step of median bubble, pictured
        ideal = simulate(plan, t / v, t / v, t / v)
        worst = max(worst, diff)
        live = [live_microbatches(a) for a in plan.actions]
        simulated = bubble_fraction(ideal)
        formula = bubble_formula(name, P, M, v)
        # deterministic: the simulated bubble is the papers' (above it for M < P with chunks), every step kept
        # the activations the schedule says; the wall clock of a shared machine is shown, never judged
        if M >= P or name in ("gpipe", "1f1b"):
            figure_ok = figure_ok and abs(simulated - formula) < 1e-9
        else:
            figure_ok = figure_ok and simulated >= formula
        figure_ok = figure_ok and all([s.peak_live for s in ranks] == live for ranks in steps)
        launch.print0(pictures(name, plan, ideal, [s.events for s in steps[middle]], t / v))
        shown = name if v == 1 else f"{name} v={v}"
        rows.append(f"{shown:<16} | {median(bubbles):>6.3f} ({quantile(bubbles, 0.1):.3f}-"
                    f"{quantile(bubbles, 0.9):.3f}) | {simulated:>9.3f} | {formula:>7.3f} | {live}")
    launch.print0(f"\nbubble: the share of P x (step time) that ranks wait. Measured: wall clock of sleeping stages, "
                  f"median of {n} steps (10-90%)\non a shared machine, shown, not checked. Peak: activations kept at "
                  f"once on each rank, in microbatches (x chunks)\n{'schedule':<16} | {'measured (10-90%)':>20} | "
                  f"{'simulated':>9} | {'formula':>7} | peak per rank\n" + "\n".join(rows) + "\n")
    # fp64 rounding differences are ~1e-16; a lost microbatch or a wrong 1/M would be >= 1e-3
    return launch.conclude("pipeline_bubble", worst < 1e-12, f"{len(plans)} schedules = torch = full batch (fp64, "
                           f"{worst:.0e})", figure_ok, "simulated bubble = the formula; activations kept as scheduled")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
