"""Gradient bucketing, the engine inside DDP: gradients go into a few flat buckets, and each bucket's
all-reduce starts the moment its last gradient lands, while backward goes on computing earlier layers.

    buckets   walk the parameters from last to first; close a bucket once it holds >= bucket_cap bytes
    launch    bucket k goes out once its gradients have all arrived and buckets 0..k-1 have gone out
    hidden    |time an all-reduce was in flight before backward ended|  /  |time one was in flight|

Why buckets: an all-reduce costs a latency plus a time per byte; one per gradient pays the latency per
parameter, one for the whole model cannot start before backward ends. Why reverse order: backward
produces the gradients roughly last layer first. Why strictly in bucket order: every rank must issue the
same collectives in the same order, even when its gradients arrive in another. A blocking all-reduce
(ring_all_reduce) runs on a background thread; a communication hook replaces each bucket's all-reduce.

    torchrun --standalone --nproc_per_node=4 mini_dist/reducer.py [--bucket-cap-mb 0 0.25 1]

Used by mini_dist/ddp.py. Mirrors torch's Reducer (torch/csrc/distributed/c10d/reducer.cpp) and
torch.distributed._compute_bucket_assignment_by_size (Li et al., PyTorch Distributed, VLDB 2020, Sec. 3.2).
"""
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/reducer.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import debug, launch, models, weakly, wire
from mini_dist.ring_pipelined import ring_all_reduce


@dataclass(eq=False)
class Bucket:
    """Neighbouring gradients side by side in one flat buffer: one all-reduce instead of many small ones.
    A communication hook receives it with torch's GradBucket methods: index, buffer, gradients, ..."""
    k: int
    params: list
    flat: torch.Tensor
    views: list            # views[i] is params[i]'s gradient as a slice of flat, shaped like it
    last: bool = False     # the last bucket to be launched in a backward
    pending: int = 0       # gradients still to arrive in this backward
    future: object = None  # the all-reduce in flight: its tensor is the reduced bucket
    done: object = None    # completes once the finish time is recorded (even if the all-reduce failed)

    def index(self) -> int: return self.k
    def buffer(self) -> torch.Tensor: return self.flat
    def gradients(self) -> list: return self.views
    def parameters(self) -> list: return self.params
    def is_last(self) -> bool: return self.last


def build_buckets(params: list, cap_bytes: float, first_cap_bytes: float | None = None) -> list[Bucket]:
    """Walk the parameters backwards; close a bucket once it holds >= its cap (native's rule; the first
    bucket may have a cap of its own), or when the dtype changes (one buffer has one dtype)."""
    groups, size = [], float("inf")
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


class Reducer:
    """Inside every synced backward: copy each gradient (times 1/N) into its bucket as it lands, all-reduce
    full buckets in order, and when autograd is done, wait for them and write the averages into .grad. The
    arguments are DDP's (mini_dist/ddp.py), plus the trainable params in model order and their names."""

    def __init__(self, params: list, names: dict, buckets: list[Bucket], group=None, all_reduce=dist.all_reduce,
                 gradient_as_bucket_view: bool = False, find_unused_parameters: bool = False):
        self.params, self.names, self.buckets, self.group = params, names, buckets, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank()
        self.all_reduce, self.hook, self.hook_state = all_reduce, None, None
        self.gradient_as_bucket_view, self.find_unused_parameters = gradient_as_bucket_view, find_unused_parameters
        self.slot = {p: (b, i) for b in buckets for i, p in enumerate(b.params)}
        self.require_grad_sync = True  # DDP's no_sync() turns it off
        self.used = set()  # parameters that got a gradient since the last sync (native's local_used_map)
        self.arrived = None  # parameters whose gradient arrived in the current synced backward
        self.timeline = Timeline()  # of the last synced backward
        for p in params:
            p.register_post_accumulate_grad_hook(weakly(self._gradient_arrived))

    def register_comm_hook(self, state, hook) -> None:
        if self.hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as in torch's DDP)")
        self.hook, self.hook_state = hook, state

    def _gradient_arrived(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: p.grad is final for this backward; copy it into its bucket."""
        self.used.add(p)
        if not self.require_grad_sync:
            return
        if self.arrived is None:  # the first gradient of this backward
            self.arrived, self.next_bucket = set(), 0
            self.timeline = Timeline(time.perf_counter(), ready=[0.0] * len(self.buckets))
            for b in self.buckets:
                b.pending = len(b.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.arrived.add(p)
        self._fill(p)

    def _fill(self, p: torch.Tensor) -> None:
        """The bucket-ready hook: p's gradient goes into its slot of its bucket (times 1/N); once the bucket
        is full, every bucket that is full goes out, in bucket order (buckets 0..k-1 before bucket k)."""
        # exercise: copy p.grad / N into bucket.views[i]; when bucket.pending hits 0, _launch each full bucket in order
        bucket, i = self.slot[p]
        if p.grad is None:
            bucket.views[i].zero_()
        elif self.hook:  # the hook gets the sum: averaging is its job, as in torch
            bucket.views[i].copy_(p.grad)
        else:  # divide on the way in, as native DDP does: a sum of N gradients then cannot overflow
            torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])
        bucket.pending -= 1
        if bucket.pending == 0:
            self.timeline.ready[bucket.k] = time.perf_counter()
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
        # end exercise

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's all-reduce (or the communication hook) without waiting for it."""
        finish = self.timeline.finish
        self.timeline.start.append(time.perf_counter())
        finish.append(None)
        self.timeline.bytes += bucket.flat.nbytes
        try:
            if self.hook:
                bucket.future = self.hook(self.hook_state, bucket)
            elif self.all_reduce is dist.all_reduce:
                bucket.future = wire.call(dist.all_reduce, bucket.flat, group=self.group, async_op=True).get_future()
            else:
                bucket.future = launch_on_comm_thread(self.all_reduce, bucket.flat, self.group)
        except Exception as e:
            raise self._failed(bucket, e) from e
        bucket.done = bucket.future.then(lambda _, k=bucket.k: finish.__setitem__(k, time.perf_counter()))

    def _failed(self, bucket: Bucket, error: Exception) -> RuntimeError:
        return RuntimeError(f"DistributedDataParallel on rank {self.rank}: the all-reduce of bucket {bucket.k} "
                            f"({', '.join(self.names[p] for p in bucket.params)}) failed: "
                            f"{debug.failed(error, 'its all-reduce') or f'{type(error).__name__}: {error}'}")

    def _backward_done(self) -> None:
        """Autograd callback at the end of backward: flush, wait, write the averages into .grad."""
        self.timeline.backward_end = time.perf_counter()
        missing, self.arrived = [p for p in self.params if p not in self.arrived], None
        for p in missing:  # no gradient in this backward: its no_sync sum, or zeros, keeps ranks in step
            self._fill(p)
        for b in self.buckets:
            b.done.wait()
            try:
                reduced = b.future.wait()
            except Exception as e:
                raise self._failed(b, e) from e
            reduced = reduced[0] if isinstance(reduced, list) else reduced  # a Work's future gives a list
            if reduced.data_ptr() != b.flat.data_ptr():  # a hook may return a new tensor
                b.flat.copy_(reduced)
        used, self.used = [p in self.used for p in self.params], set()
        if self.find_unused_parameters:  # used on any rank: the ranks that did not use it added zeros
            anywhere = torch.tensor(used, dtype=torch.int32, device=self.params[0].device)
            wire.call(dist.all_reduce, anywhere, op=dist.ReduceOp.MAX, group=self.group)
            used = anywhere.tolist()
        elif missing:
            raise RuntimeError(
                f"DistributedDataParallel: parameters {[self.names[p] for p in missing]} got no "
                "gradient in this backward (an unused branch, or an output left out of the loss). "
                "Pass find_unused_parameters=True, or set requires_grad=False on them before wrapping.")
        for p, used_anywhere in zip(self.params, used):
            bucket, i = self.slot[p]
            if not used_anywhere:
                continue  # no rank used it: .grad stays as it was, as in native DDP
            if self.gradient_as_bucket_view:
                p.grad = bucket.views[i]  # backward then accumulates straight into the bucket: no copy in
            elif p.grad is None:
                p.grad = bucket.views[i].clone()
            else:
                p.grad.copy_(bucket.views[i])


_comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini_dist-ddp-comm")


def launch_on_comm_thread(all_reduce, tensor: torch.Tensor, group) -> torch.futures.Future:
    """A blocking all-reduce (ring_all_reduce) made asynchronous on one background thread, first in first
    out: buckets go out in launch order on every rank (several threads could interleave two buckets)."""
    future = torch.futures.Future()

    def work():
        try:
            future.set_result(all_reduce(tensor, group=group))
        except Exception as e:  # hand the failure to whoever waits on the bucket
            future.set_exception(e)
    _comm_thread.submit(work)
    return future


@dataclass
class Timeline:
    """One synced backward as the buckets saw it (time.perf_counter seconds) and the bytes it reduced."""
    backward_start: float = 0.0                 # the first gradient arrived
    ready: list = field(default_factory=list)   # ready[k]: bucket k's last gradient arrived
    start: list = field(default_factory=list)   # start[k]: its all-reduce was launched
    finish: list = field(default_factory=list)  # finish[k]: its all-reduce completed
    backward_end: float = 0.0                   # autograd finished computing gradients
    bytes: int = 0                              # bytes handed to the all-reduce (D when all sync)

    def overlap(self) -> float:
        """Fraction of the time an all-reduce was in flight that passed before backward ended (hidden)."""
        total, hidden, reach = 0.0, 0.0, float("-inf")
        for s, f in sorted(zip(self.start, self.finish)):
            s = max(s, reach)  # time covered by several all-reduces counts once
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
        t0, t1 = self.backward_start, max(self.finish + [self.backward_end])
        col = lambda t: round((t - t0) / (t1 - t0) * (width - 1)) if t1 > t0 else 0
        bar = lambda a, b, c: "[" + f"{' ' * col(a)}{c * max(1, col(b) - col(a))}".ljust(width) + "]"
        rows = [f"{'':11}0 ms{(t1 - t0) * 1e3:{width - 3}.1f} ms",
                f"{'backward':11}{bar(t0, self.backward_end, '=')}"]
        rows += [f"bucket {k:<4}{bar(s, f, '#')}" for k, (s, f) in enumerate(zip(self.start, self.finish))]
        return "\n".join(rows)


# ----------------------------------------------------------------------------- demo

def buckets_hide_communication(cap_mb: float = 0.25, widths=(64, 256, 256, 256, 16), batch: int = 256,
                               ring: bool = False, picture: bool = False) -> tuple[str, bool]:
    """Two backwards of models.mlp(widths), buckets of cap_mb MiB: bucket 0 goes out while backward computes;
    buckets = torch's, .grad = the naive sync's mean. Collective: every rank of the default group, own batch."""
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(100 + dist.get_rank()),
                    dtype=torch.float64).to(launch.device())
    model = models.mlp(widths).to(launch.device())  # seed 0: the same model on every rank
    names = {p: name for name, p in model.named_parameters()}
    params = list(names)
    mean = torch.autograd.grad(model(x).square().mean(), params)  # .grad untouched: no hook fires
    for g in mean:  # the naive sync: one all-reduce per gradient, once backward has ended
        dist.all_reduce(g)
        g /= dist.get_world_size()
    buckets = build_buckets(params, int(cap_mb * 2 ** 20))
    torchs, _ = dist._compute_bucket_assignment_by_size(params[::-1], [int(cap_mb * 2 ** 20)])
    same = [[params[::-1][i] for i in b] for b in torchs] == [b.params for b in buckets]
    reducer = Reducer(params, names, buckets, all_reduce=ring_all_reduce if ring else dist.all_reduce)
    for _ in range(2):  # the first backward warms up, the second is shown
        model.zero_grad()
        model(x).square().mean().backward()
    # fp64: (1/N)x + (1/N)y against (x + y)/N, the same sum rounded otherwise: a few ulps apart
    same &= all((p.grad - g).abs().max() <= 1e-12 * g.abs().max() for p, g in zip(params, mean))
    tl = reducer.timeline
    early = torch.tensor([tl.start[0] - tl.ready[-1]], dtype=torch.float64, device=launch.device())
    dist.all_reduce(early, op=dist.ReduceOp.MAX)  # on every rank: bucket 0 left before the last one filled
    return (f"{len(buckets)} buckets of <= {cap_mb:g} MiB, last layer first ("
            + " | ".join(" ".join(names[p] for p in b.params) for b in buckets) + f"): bucket 0's all-reduce "
            f"started {(tl.backward_end - tl.start[0]) * 1e3:.1f} ms before backward ended, {tl.overlap():.0%} "
            f"of the all-reduce time hidden (rank 0); the naive sync, {len(names)} all-reduces after backward, "
            f"hides 0%; buckets = torch's, gradients = the naive sync's: {same}"
            + (f"\n{tl.picture()}" if picture else "")), same and (len(buckets) == 1 or early.item() < 0)


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[0, 0.25, 1], help="bucket caps, MiB")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256, 256, 256, 16], help="MLP widths")
    p.add_argument("--batch", type=int, default=256, help="samples per rank: more makes backward longer")
    p.add_argument("--ring", action="store_true", help="all-reduce with ring_all_reduce, not gloo/NCCL's")
    return p


def demo(args) -> int:
    w, every = args.widths, True
    launch.require(len(w) >= 2 and min(w) >= 1 and min(args.bucket_cap_mb) >= 0 and args.batch >= 1,
                   "--widths needs two or more sizes >= 1, --bucket-cap-mb caps >= 0, --batch >= 1")
    launch.setup()
    for cap in args.bucket_cap_mb:
        figure, holds = buckets_hide_communication(cap, w, args.batch, args.ring, picture=True)
        launch.print0(f"\n{figure}")
        every &= holds
    return launch.conclude("reducer", every, "buckets = torch's assignment; .grad = the naive sync's mean gradient",
                           every, "bucket 0's all-reduce launched before the last bucket's gradients existed")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
