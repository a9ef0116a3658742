"""The reducer, the engine inside DDP: each bucket's all-reduce starts the moment its last gradient lands,
while backward goes on computing earlier layers; when backward ends, wait, and write the means into .grad.

    ready     a gradient lands (autograd's post-accumulate-grad hook): copy it / N into its bucket's view
    launch    bucket k goes out once its gradients have all arrived and buckets 0..k-1 have gone out
    done      autograd's end-of-backward callback: wait for every bucket, copy the means into .grad
    hidden    |time an all-reduce was in flight before backward ended|  /  |time one was in flight|

The buckets (mini_dist/buckets.py) hold the parameters last layer first, so bucket 0 fills first and
goes out while backward computes the layers below it. Why strictly in bucket order: every rank must issue
the same collectives in the same order, even when its gradients arrive in another. A blocking all-reduce
(ring_all_reduce) runs on a background thread; a communication hook replaces each bucket's all-reduce.

    torchrun --standalone --nproc_per_node=4 mini_dist/reducer.py [--bucket-cap-mb 0 0.25 1]

Used by mini_dist/ddp.py. Mirrors torch's Reducer (torch/csrc/distributed/c10d/reducer.cpp; Li et al.,
PyTorch Distributed, VLDB 2020, Sec. 3.2).
"""
import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.buckets import Bucket, Timeline, build_buckets
from mini_dist.kit import debug, launch, models, trace, weakly, wire
from mini_dist.ring_pipelined import ring_all_reduce


class Reducer:
    """Inside every synced backward: copy each gradient (times 1/N) into its bucket as it lands, all-reduce
    full buckets in order, and when autograd is done, wait for them and write the averages into .grad. The
    arguments are DDP's (mini_dist/ddp.py), plus the trainable params in model order and their names."""

    def __init__(self, params: list, names: dict, buckets: list[Bucket], group=None, all_reduce=dist.all_reduce,
                 gradient_as_bucket_view: bool = False, find_unused_parameters: bool = False):
        self.params = params
        self.names = names
        self.buckets = buckets
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank()
        self.all_reduce = all_reduce
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.hook = None  # register_comm_hook's hook(state, bucket), and its state
        self.hook_state = None
        self.slot = {p: (b, i) for b in buckets for i, p in enumerate(b.params)}  # p's bucket, p's place in it
        self.require_grad_sync = True  # DDP's no_sync() turns it off
        self.used = set()  # parameters that got a gradient since the last sync (native's local_used_map)
        self.arrived = None  # parameters whose gradient arrived in the current synced backward
        self.next_bucket = 0  # the next bucket to launch: they go out in order
        self.records = []  # the synced backward under way as trace records (kit/trace.py), and its start
        self.started = 0
        self.timeline = Timeline()  # of the last synced backward, drawn from its records
        for p in params:
            p.register_post_accumulate_grad_hook(weakly(self._gradient_arrived))

    def register_comm_hook(self, state, hook) -> None:
        if self.hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as in torch's DDP)")
        self.hook = hook
        self.hook_state = state

    def _gradient_arrived(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: p.grad is final for this backward; copy it into its bucket."""
        self.used.add(p)
        if not self.require_grad_sync:
            return
        if self.arrived is None:  # the first gradient of this backward
            self.arrived = set()
            self.next_bucket = 0
            self.records = []
            self.started = trace.now()
            for b in self.buckets:
                b.pending = len(b.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.arrived.add(p)
        self._ready(p)

    def _ready(self, p: torch.Tensor) -> None:
        """p's gradient is final for this backward, or it has none: fill its slot. Bucket k's last arrival is
        when it filled: a mark for the timeline and the trace."""
        bucket = self.slot[p][0]
        if bucket.pending == 1:
            trace.mark(f"bucket {bucket.k} ready", into=self.records, bucket=bucket.k)
        self._fill(p)

    def _fill(self, p: torch.Tensor) -> None:
        """The bucket-ready hook: p's gradient goes into its slot of its bucket (times 1/N); once the bucket
        is full, every bucket that is full goes out, in bucket order (buckets 0..k-1 before bucket k)."""
        # exercise: p's gradient is in its slot (self.slot[p] -> bucket, i: the view bucket.views[i]) such that,
        #   all-reduced, the bucket holds the mean over the N = self.world ranks: divided by N once, on the way in
        #   or after the all-reduce (bucket.future, set by _launch); zeros where p.grad is None (a parameter no
        #   backward reached); the plain gradient when a communication hook is set (self.hook: it averages).
        #   And every bucket that can go has gone to self._launch, exactly once, in bucket order: bucket k once
        #   it is full (bucket.pending: its gradients still to come) and buckets 0..k-1 have gone (every rank
        #   must issue the same all-reduces in the same order; self.next_bucket: the next to go), not later, so
        #   that it travels while backward computes the layers below. Both counts are reset as backward starts.
        bucket, i = self.slot[p]
        if p.grad is None:
            bucket.views[i].zero_()
        elif self.hook:  # the hook gets the sum: averaging is its job, as in torch
            bucket.views[i].copy_(p.grad)
        else:  # divide on the way in, as native DDP does: a sum of N gradients then cannot overflow
            torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])
        bucket.pending -= 1
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
        # end exercise

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's all-reduce (or the communication hook) without waiting for it."""
        records = self.records
        start = trace.now()

        def finished(_) -> None:
            """Once the all-reduce is done (or failed): its flight, for the timeline and the trace."""
            trace.record(trace.FLIGHT, f"all-reduce bucket {bucket.k}", start, trace.now(), into=records,
                         bucket=bucket.k, bytes=bucket.flat.nbytes)
        try:
            if self.hook:
                bucket.future = self.hook(self.hook_state, bucket)
            elif self.all_reduce is dist.all_reduce:
                bucket.future = wire.call(dist.all_reduce, bucket.flat, group=self.group, async_op=True,
                                          book=("all_reduce", bucket.flat.nbytes)).get_future()
            else:
                bucket.future = launch_on_comm_thread(functools.partial(self.all_reduce, bucket.flat, group=self.group))
        except Exception as e:
            raise self._failed(bucket, e) from e
        bucket.done = bucket.future.then(finished)

    def _backward_done(self) -> None:
        """Autograd callback at the end of backward: flush, wait, write the averages into .grad."""
        trace.record(trace.SPAN, "backward (DDP's reducer)", self.started, trace.now(), into=self.records)
        missing = [p for p in self.params if p not in self.arrived]
        self.arrived = None
        for p in missing:  # no gradient in this backward: its no_sync sum, or zeros, keeps ranks in step
            self._ready(p)
        for b in self.buckets:
            b.done.wait()
            try:
                reduced = b.future.wait()
            except Exception as e:
                raise self._failed(b, e) from e
            reduced = reduced[0] if isinstance(reduced, list) else reduced  # a Work's future gives a list
            if reduced.data_ptr() != b.flat.data_ptr():  # a hook may return a new tensor
                b.flat.copy_(reduced)
        self.timeline = Timeline.of(self.records)
        used = [p in self.used for p in self.params]
        self.used = set()
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

    def _failed(self, bucket: Bucket, error: Exception) -> RuntimeError:
        return RuntimeError(f"DistributedDataParallel on rank {self.rank}: the all-reduce of bucket {bucket.k} "
                            f"({', '.join(self.names[p] for p in bucket.params)}) failed: "
                            f"{debug.failed(error, 'its all-reduce') or f'{type(error).__name__}: {error}'}")


_comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini_dist-ddp-comm")


def launch_on_comm_thread(work) -> torch.futures.Future:
    """work(), a blocking all-reduce (ring_all_reduce) or a compression hook's, made asynchronous on one
    background thread, first in first out: buckets go out in launch order on every rank (several threads
    could interleave two buckets). The future holds what work() returns, or what it raised."""
    future = torch.futures.Future()

    def run():
        try:
            future.set_result(work())
        except Exception as e:  # hand the failure to whoever waits on the bucket
            future.set_exception(e)
    _comm_thread.submit(run)
    return future


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[0, 0.25, 1], help="bucket caps, MiB")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256, 256, 256, 16], help="MLP widths")
    p.add_argument("--batch", type=int, default=256, help="samples per rank: more makes backward longer")
    p.add_argument("--ring", action="store_true", help="all-reduce with ring_all_reduce, not gloo/NCCL's")
    return p


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


def demo(args) -> int:
    w = args.widths
    every = True
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
