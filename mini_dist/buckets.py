"""Gradient buckets: which gradients share one all-reduce, and a clock for when each bucket moved.

An all-reduce costs a latency per call plus a time per byte (mini_dist/alpha_beta.py). One all-reduce per
gradient pays the latency once per parameter; one for the whole model cannot start before the last gradient
exists. DDP's answer is buckets: a few flat buffers of about bucket_cap bytes each,

    walk the parameters from last to first; close a bucket once it holds >= bucket_cap bytes,
    or when the dtype changes (one flat buffer holds one dtype)

    all-reduces per step = B buckets (1 <= B <= parameters); bytes all-reduced = D, whatever B

Last to first, because backward produces the gradients roughly last layer first: bucket 0 fills first.
A bucket is one flat tensor with a view per gradient, so one all-reduce moves them all; a communication hook
sees it through torch's GradBucket methods (index, buffer, gradients, parameters, is_last). A Timeline is
one backward as the buckets saw it (ready, sent, done), read from its trace records (kit/trace.py: the same
records a trace file shows), and the share of all-reduce time hidden behind backward. The demo sends the
buckets after backward, one after another (0% hidden): mini_dist/reducer.py sends each one the moment it is
full, while backward goes on.

    torchrun --standalone --nproc_per_node=4 mini_dist/buckets.py [--bucket-cap-mb 0 0.25 1]

Mirrors torch.distributed._compute_bucket_assignment_by_size and c10d's GradBucket (Li et al., PyTorch
Distributed, VLDB 2020, Sec. 3.2).
"""
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, models, trace


@dataclass(eq=False)
class Bucket:
    """Neighbouring gradients side by side in one flat buffer: one all-reduce instead of many small ones.
    The reducer (mini_dist/reducer.py) keeps its state for the backward under way in the last three fields."""
    k: int
    params: list
    flat: torch.Tensor
    views: list            # views[i] is params[i]'s gradient as a slice of flat, shaped like it
    last: bool = False     # the last bucket to be launched in a backward
    pending: int = 0       # gradients still to arrive in this backward
    future: object = None  # the all-reduce in flight: its tensor is the reduced bucket
    done: object = None    # completes once the finish time is recorded (even if the all-reduce failed)

    # torch's GradBucket, what a communication hook calls:
    def index(self) -> int:
        return self.k

    def buffer(self) -> torch.Tensor:
        return self.flat

    def gradients(self) -> list:
        return self.views

    def parameters(self) -> list:
        return self.params

    def is_last(self) -> bool:
        return self.last


def build_buckets(params: list, cap_bytes: float, first_cap_bytes: float | None = None) -> list[Bucket]:
    """Walk the parameters backwards; close a bucket once it holds >= its cap (native's rule; the first
    bucket may have a cap of its own), or when the dtype changes (one buffer has one dtype)."""
    groups = []
    size = float("inf")  # no bucket open yet: the first parameter opens one
    for p in reversed(params):
        cap = first_cap_bytes if len(groups) == 1 and first_cap_bytes is not None else cap_bytes
        if size >= cap or p.dtype != groups[-1][-1].dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    buckets = []
    for k, ps in enumerate(groups):
        flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        views = [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in ps]), ps)]
        buckets.append(Bucket(k, ps, flat, views, last=k == len(groups) - 1))
    return buckets


@dataclass
class Timeline:
    """One synced backward as the buckets saw it (time.perf_counter seconds) and the bytes it reduced."""
    backward_start: float = 0.0                 # the first gradient arrived
    ready: list = field(default_factory=list)   # ready[k]: bucket k's last gradient arrived
    start: list = field(default_factory=list)   # start[k]: its all-reduce was launched
    finish: list = field(default_factory=list)  # finish[k]: its all-reduce completed
    backward_end: float = 0.0                   # autograd finished computing gradients
    bytes: int = 0                              # bytes handed to the all-reduce (D when all sync)

    @classmethod
    def of(cls, records: list) -> "Timeline":
        """From one backward's trace records: its span (none: the sync came after it), each bucket's ready mark,
        each all-reduce's flight; in seconds, as time.perf_counter() tells them."""
        backward = [r for r in records if r.what == trace.SPAN]
        flights = sorted((r for r in records if r.what == trace.FLIGHT), key=lambda r: r.args.get("bucket", 0))
        ready = sorted((r for r in records if r.what == trace.MARK), key=lambda r: r.args["bucket"])
        start = backward[0].start if backward else flights[0].start  # no span: the sync came after backward
        end = backward[0].end if backward else start
        return cls(start / 1e9, [r.start / 1e9 for r in ready], [f.start / 1e9 for f in flights],
                   [f.end / 1e9 for f in flights], end / 1e9, sum(f.args["bytes"] for f in flights))

    def overlap(self) -> float:
        """Fraction of the time an all-reduce was in flight that passed before backward ended (hidden)."""
        total = 0.0
        hidden = 0.0
        reach = float("-inf")  # the latest finish so far: time covered by several all-reduces counts once
        for s, f in sorted(zip(self.start, self.finish)):
            s = max(s, reach)
            if f > s:
                total += f - s
                hidden += max(0.0, min(f, self.backward_end) - s)
                reach = f
        return hidden / total if total else 1.0

    def exposed(self) -> float:
        """Seconds of all-reduce left after backward ended: what the optimizer step waits for."""
        return max(self.finish + [self.backward_end]) - self.backward_end

    def picture(self, width: int = 56) -> str:
        """Backward as a bar of =, each bucket's all-reduce in flight as #: what lies under the = is hidden."""
        t0 = self.backward_start
        t1 = max(self.finish + [self.backward_end])

        def column(t: float) -> int:
            """Where time t falls on the bar."""
            return round((t - t0) / (t1 - t0) * (width - 1)) if t1 > t0 else 0

        def bar(a: float, b: float, mark: str) -> str:
            """[    ####      ]: mark from time a to time b."""
            return "[" + f"{' ' * column(a)}{mark * max(1, column(b) - column(a))}".ljust(width) + "]"
        rows = [f"{'':11}0 ms{(t1 - t0) * 1e3:{width - 3}.1f} ms",
                f"{'backward':11}{bar(t0, self.backward_end, '=')}"]
        rows += [f"bucket {k:<4}{bar(s, f, '#')}" for k, (s, f) in enumerate(zip(self.start, self.finish))]
        return "\n".join(rows)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[0, 0.25, 1], help="bucket caps, MiB")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256, 256, 256, 16], help="MLP widths")
    p.add_argument("--batch", type=int, default=256, help="samples per rank")
    return p


def sync_after_backward(model, buckets: list[Bucket], x: torch.Tensor) -> Timeline:
    """Backward, then bucket after bucket: copy its gradients in, all-reduce it, write the mean back."""
    records = []
    with trace.span("backward", into=records):
        model(x).square().mean().backward()
    for bucket in buckets:
        for p, view in zip(bucket.params, bucket.views):
            view.copy_(p.grad)
        start = trace.now()
        dist.all_reduce(bucket.flat)
        trace.record(trace.FLIGHT, f"all-reduce bucket {bucket.k}", start, trace.now(), into=records,
                     bucket=bucket.k, bytes=bucket.flat.nbytes)
        for p, view in zip(bucket.params, bucket.views):
            torch.div(view, dist.get_world_size(), out=p.grad)
    return Timeline.of(records)


def demo(args) -> int:
    w = args.widths
    launch.require(len(w) >= 2 and min(w) >= 1 and min(args.bucket_cap_mb) >= 0 and args.batch >= 1,
                   "--widths needs two or more sizes >= 1, --bucket-cap-mb caps >= 0, --batch >= 1")
    env = launch.setup()
    g = torch.Generator().manual_seed(100 + env.rank)  # each rank its own batch
    x = torch.randn(args.batch, w[0], generator=g, dtype=torch.float64).to(env.device)
    model = models.mlp(w)  # seed 0: the same model on every rank
    names = {p: name for name, p in model.named_parameters()}
    params = list(names)
    D = sum(p.nbytes for p in params)
    assignment_ok = True
    bytes_ok = True
    for cap in args.bucket_cap_mb:
        buckets = build_buckets(params, cap * 2 ** 20)
        torchs, _ = dist._compute_bucket_assignment_by_size(params[::-1], [int(cap * 2 ** 20)])
        same = [[params[::-1][i] for i in b] for b in torchs] == [b.params for b in buckets]
        for _ in range(2):  # the first pass warms up, the second is shown
            model.zero_grad()
            timeline = sync_after_backward(model, buckets, x)
        assignment_ok &= same
        bytes_ok &= timeline.bytes == D
        in_flight = sum(f - s for s, f in zip(timeline.start, timeline.finish))
        launch.print0(f"\ncap {cap:g} MiB: {len(buckets)} buckets, last layer first ("
                      + " | ".join(" ".join(names[p] for p in b.params) for b in buckets)
                      + f"); = torch's assignment: {same}\n{len(buckets)} all-reduces of {timeline.bytes:,} B in all "
                      f"(D = {D:,} B), {in_flight * 1e3:.1f} ms in flight after backward, "
                      f"{timeline.overlap():.0%} hidden (rank 0):\n{timeline.picture()}")
    return launch.conclude("buckets", assignment_ok, "buckets = torch's assignment, last layer first, every cap",
                           bytes_ok, f"B all-reduces of D = {D:,} B in all, whatever B; after backward: 0% hidden")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
