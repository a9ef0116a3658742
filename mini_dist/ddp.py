"""Data parallelism: every rank holds the whole model, runs its own slice of the batch, and averages the
gradients with an all-reduce, so every replica takes the same optimizer step:

    grad = (1/N) * sum over ranks r of grad_r  =  the gradient of the full batch of B x N x K samples

(local batch B, N ranks, K accumulation steps with the loss divided by K): exact, not an approximation.
An all-reduce of the D gradient bytes sends 2(N-1)/N * D bytes per rank (ring: reduce-scatter, then
all-gather) however it is scheduled; what a DDP implementation decides is *when* those bytes move.

`NaiveDataParallel` waits for backward to finish, then all-reduces the gradients one by one: all the
communication after all the computation. `DistributedDataParallel` (mirrors
torch.nn.parallel.DistributedDataParallel) packs gradients into buckets of ~bucket_cap_mb in reverse
parameter order, the order backward produces them; the moment a bucket's last gradient lands, its
all-reduce starts while backward goes on computing earlier layers. `ddp.timeline` records when each
bucket was ready, sent and done, and how much of the communication backward hid (`overlap()`).

    torchrun --standalone --nproc_per_node=4 mini_dist/ddp.py            # vs native DDP, bytes, overlap
    torchrun --standalone --nproc_per_node=4 mini_dist/ddp.py --bench    # step time vs native DDP, ~10M
"""
import contextlib
import copy
import functools
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/ddp.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.launch import conclude, device, print0, setup
from mini_dist.ring_allreduce import LEDGER, ring_all_reduce


def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Every replica starts from group rank 0's parameters and buffers (shapes checked on all ranks first)."""
    tensors = list(module.parameters()) + list(module.buffers())
    shapes = zlib.crc32(repr([(t.dtype, t.shape) for t in tensors]).encode())
    seen = torch.tensor([shapes, -shapes], device=device())  # NCCL reduces only GPU tensors
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)  # max and -min: equal iff all agree
    if seen[0] != -seen[1]:
        raise ValueError("ranks hold models with different parameter/buffer shapes or dtypes; "
                         "build the same model on every rank before wrapping it")
    for t in tensors:
        dist.broadcast(t.detach(), dist.get_global_rank(group or dist.group.WORLD, 0), group=group)


class NaiveDataParallel(nn.Module):
    """The baseline: after backward, sync_gradients() all-reduces every gradient, one by one, and averages.

    Every trainable parameter joins every all-reduce (a missing gradient counts as zeros), so the ranks
    always issue the same collectives; unlike native DDP, a parameter no rank used gets a zero gradient.
    """

    def __init__(self, module: nn.Module, group=None, all_reduce=dist.all_reduce):
        super().__init__()
        self.module, self.group, self.all_reduce = module, group, all_reduce
        broadcast_from_rank0(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        for p in (p for p in self.module.parameters() if p.requires_grad):
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            self.all_reduce(p.grad, group=self.group)
            p.grad.div_(dist.get_world_size(self.group))


@dataclass(eq=False)
class Bucket:
    """Neighbouring gradients side by side in one flat buffer: one all-reduce instead of many small ones."""
    params: list
    buffer: torch.Tensor
    views: list            # views[i] is params[i]'s gradient as a slice of buffer, shaped like it
    pending: int = 0       # gradients still to arrive in this backward
    future: object = None  # the all-reduce in flight


def build_buckets(params: list, cap_bytes: int) -> list[Bucket]:
    """Walk the parameters backwards; close a bucket once it holds >= cap_bytes (native's rule), or when
    the dtype changes (one buffer has one dtype)."""
    groups, size = [], cap_bytes
    for p in reversed(params):
        if size >= cap_bytes or p.dtype != groups[-1][-1].dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    buckets = []
    for ps in groups:
        buffer = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        views = [v.view_as(p) for v, p in zip(buffer.split([p.numel() for p in ps]), ps)]
        buckets.append(Bucket(ps, buffer, views))
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

    def overlap(self) -> float:
        """Fraction of the time an all-reduce was in flight that passed before backward ended (hidden)."""
        total = hidden = 0.0
        reach = float("-inf")
        for s, f in sorted(zip(self.start, self.finish)):
            s = max(s, reach)  # time covered by several all-reduces counts once
            if f > s:
                total += f - s
                hidden += max(0.0, min(f, self.backward_end) - s)
                reach = f
        return hidden / total if total else 1.0


_comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini_dist-ddp-comm")


def launch_on_comm_thread(all_reduce, tensor: torch.Tensor, group) -> torch.futures.Future:
    """A blocking all-reduce (ring_all_reduce) made asynchronous on one background thread, so backward
    goes on meanwhile. One thread, first in first out: buckets go out in launch order, the same order on
    every rank, as matching collectives need (several threads could interleave two buckets' sends)."""
    future = torch.futures.Future()

    def work():
        try:
            future.set_result(all_reduce(tensor, group=group))
        except Exception as e:  # hand the failure to whoever waits on the bucket
            future.set_exception(e)
    _comm_thread.submit(work)
    return future


class DistributedDataParallel(nn.Module):
    """Bucketed data parallelism whose all-reduces overlap backward; mirrors torch's DDP.

    all_reduce: dist.all_reduce (launched with async_op=True) or any in-place function with its
    signature, e.g. ring_all_reduce, run on the communication thread. A parameter that gets no gradient
    in a backward raises an error naming it unless find_unused_parameters=True; then, as in native DDP,
    it counts as zeros on the ranks that did not use it, and its .grad stays untouched if no rank did.
    Where native DDP does more: its first bucket is 1 MiB and it re-buckets after the first step in the
    order gradients really arrived; it finds unused parameters by searching the autograd graph after
    forward (we notice them when backward ends, so buckets behind one go out late); it re-broadcasts
    buffers before every forward (we do so once, at construction).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None,
                 all_reduce=dist.all_reduce, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module, self.group, self.world = module, group, dist.get_world_size(group)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.launch = functools.partial(launch_on_comm_thread, all_reduce) if all_reduce is not \
            dist.all_reduce else lambda t, g: dist.all_reduce(t, group=g, async_op=True).get_future()
        broadcast_from_rank0(module, group)
        self.names = {p: name for name, p in module.named_parameters()}  # tied weights: listed once
        self.params = [p for p in self.names if p.requires_grad]  # frozen ones never get gradients
        if not self.params:
            raise ValueError("the module has no parameter that requires grad: nothing to synchronize")
        self.buckets = build_buckets(self.params, int(bucket_cap_mb * 1024 * 1024))
        self.slot = {p: (k, i) for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)}
        self.require_grad_sync = True
        self.used = set()  # parameters that got a gradient since the last sync (native's local_used_map)
        self.arrived = None  # parameters whose gradient arrived in the current synced backward
        self.timeline = Timeline()  # of the last synced backward
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_arrived)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only accumulates gradients locally; the next backward outside syncs the sum."""
        before, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = before

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
        k, i = self.slot[p]
        bucket = self.buckets[k]
        if p.grad is None:
            bucket.views[i].zero_()
        else:  # divide on the way in, as native DDP does: a sum of N gradients then cannot overflow
            torch.mul(p.grad, 1.0 / self.world, out=bucket.views[i])
        bucket.pending -= 1
        if bucket.pending == 0:
            self.timeline.ready[k] = time.perf_counter()
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch strictly in bucket order: every rank must issue the same collectives in the same order,
        even when its gradients arrive in another order."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            k, bucket = self.next_bucket, self.buckets[self.next_bucket]
            self.timeline.start.append(time.perf_counter())
            self.timeline.finish.append(None)
            self.timeline.bytes += bucket.buffer.numel() * bucket.buffer.element_size()
            bucket.future = self.launch(bucket.buffer, self.group).then(functools.partial(self._finished, k))
            self.next_bucket += 1

    def _finished(self, k: int, future: torch.futures.Future):
        self.timeline.finish[k] = time.perf_counter()
        return future.value()  # re-raises a failed all-reduce into the waiting backward

    def _backward_done(self) -> None:
        """Autograd callback at the end of backward: flush, wait, write the averages into .grad."""
        self.timeline.backward_end = time.perf_counter()
        missing = [p for p in self.params if p not in self.arrived]
        for p in missing:  # no gradient in this backward: its no_sync sum, or zeros, keeps ranks in step
            self._fill(p)
        for b in self.buckets:
            b.future.wait()
        used_anywhere = set(self.params)
        if self.find_unused_parameters:
            used = torch.tensor([p in self.used for p in self.params], dtype=torch.int32,
                                device=self.params[0].device)
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
            used_anywhere = {p for p, u in zip(self.params, used.tolist()) if u}
        self.arrived, self.used = None, set()
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"DistributedDataParallel: parameters {[self.names[p] for p in missing]} got no "
                "gradient in this backward (an unused branch, or an output left out of the loss). "
                "Pass find_unused_parameters=True, or set requires_grad=False on them before wrapping.")
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p not in used_anywhere:
                    continue  # no rank used it: .grad stays as it was, as in native DDP
                if self.gradient_as_bucket_view:
                    p.grad = view  # backward then accumulates straight into the bucket: no copy in
                elif p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)


# ----------------------------------------------------------------------------- demo


def mlp(widths: list[int], dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b, dtype=dtype), nn.Tanh())]
    return nn.Sequential(*layers[:-1])


def train_step(ddp, optimizer, micro_batches) -> None:
    """One optimizer step over K micro-batches: the first K-1 under no_sync, the loss divided by K so
    the accumulated gradient is the mean over all of them."""
    for k, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
            (nn.functional.mse_loss(ddp(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def picture(tl: Timeline, width: int = 56) -> str:
    """Backward as a bar of =, each bucket's all-reduce in flight as #: what lies under the bar was hidden."""
    t0, t1 = tl.backward_start, max(tl.finish + [tl.backward_end])
    col = lambda t: round((t - t0) / (t1 - t0) * (width - 1)) if t1 > t0 else 0
    bar = lambda a, b, c: "[" + f"{' ' * col(a)}{c * max(1, col(b) - col(a))}".ljust(width) + "]"
    rows = [f"{'':11}0 ms{(t1 - t0) * 1e3:{width - 3}.1f} ms",
            f"{'backward':11}{bar(t0, tl.backward_end, '=')}"]
    rows += [f"bucket {k:<4}{bar(s, f, '#')}" for k, (s, f) in enumerate(zip(tl.start, tl.finish))]
    return "\n".join(rows)


def demo(steps: int = 4, accumulation: int = 2, local_batch: int = 16) -> int:
    from torch.nn.parallel import DistributedDataParallel as NativeDDP
    env, cap = setup(), 0.25
    n = env.world_size
    model = mlp([64, 256, 256, 256, 16], seed=env.rank).to(env.device)  # different per rank: broadcast fixes it
    native = NativeDDP(copy.deepcopy(model))
    mini = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap)
    ring = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap, all_reduce=ring_all_reduce)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (native, mini, ring)]
    g = torch.Generator().manual_seed(1000 + env.rank)  # each rank its own data
    overlaps, sent = [], []
    for _ in range(steps):
        batch = list(zip(*(torch.randn(accumulation, local_batch, w, generator=g, dtype=torch.float64)
                           .to(env.device) for w in (64, 16))))
        for replica, optimizer in zip((native, mini, ring), optimizers):
            LEDGER.reset()
            train_step(replica, optimizer, batch)
        sent.append(LEDGER.sent)  # what the ring replica's step put on the wire
        overlaps.append(mini.timeline.overlap())
    diff = {name: max(((a - b).abs().max() / b.abs().max()).item()
                      for a, b in zip(m.parameters(), native.parameters()))
            for name, m in [("mini", mini), ("ring", ring)]}
    print0(f"mini DDP vs native DDP, {steps} Adam steps in fp64 on {n} ranks, effective batch {local_batch} "
           f"local x {n} ranks x {accumulation} accumulation steps = {local_batch * n * accumulation}:\n"
           f"max relative parameter difference {diff['mini']:.1e} with dist.all_reduce, {diff['ring']:.1e} "
           f"with ring_all_reduce")
    print0(f"{len(mini.buckets)} buckets (cap {cap} MiB, reverse parameter order): "
           + " | ".join(" ".join(mini.names[p] for p in b.params) for b in mini.buckets))
    D = sum(p.numel() * p.element_size() for p in mini.params)
    sent = torch.tensor(sent, device=env.device)
    dist.all_reduce(sent)  # the ranks' ring chunks can differ by an element; their sum cannot
    print0(f"bytes per step: handed to all-reduce {mini.timeline.bytes} = D (each gradient once); ring "
           f"sent {sent[-1] / n:.0f} per rank (mean) vs 2(N-1)/N*D = {2 * (n - 1) / n * D:.0f}")
    print0(f"overlap: {100 * sum(overlaps) / steps:.0f}% of all-reduce time hidden behind backward (mean "
           f"of {steps} steps); rank 0's last step:\n{picture(mini.timeline)}")
    worst = max(diff.values())  # fp64: the same sums in another order stay ~1e-15 apart
    bytes_ok = mini.timeline.bytes == D and bool((sent == 2 * (n - 1) * D).all())
    return conclude("ddp", worst <= 1e-12, f"max rel diff vs native DDP {worst:.1e}", bytes_ok,
                    f"ring sent {sent[-1] / n:.0f} B/rank = 2(N-1)/N*D")


def bench(steps: int = 20, local_batch: int = 32) -> int:
    """Step time of mini vs native DDP on a ~10M-parameter fp32 MLP. They take turns step by step and we
    keep the median of the paired ratios: a shared, busy machine slows both sides of a pair alike."""
    from torch.nn.parallel import DistributedDataParallel as NativeDDP
    env = setup()
    model = mlp([1024] * 11, dtype=torch.float32).to(env.device)
    replicas = {"native DDP": NativeDDP(copy.deepcopy(model)), "mini": DistributedDataParallel(model)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in replicas.items()}
    g = torch.Generator().manual_seed(env.rank)
    batch = [tuple(torch.randn(local_batch, 1024, generator=g).to(env.device) for _ in "xy")]
    times, overlaps = {name: [] for name in replicas}, []
    for step in range(steps + 2):  # the first two are warm-up
        for name in sorted(replicas, reverse=step % 2 == 1):
            dist.barrier()
            start = time.perf_counter()
            train_step(replicas[name], optimizers[name], batch)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
        overlaps.append(replicas["mini"].timeline.overlap())
    median = lambda xs: sorted(xs[2:])[steps // 2]
    ratio = median([a / b for a, b in zip(times["mini"], times["native DDP"])])
    print0(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {env.world_size} ranks, "
           f"local batch {local_batch}, medians of {steps} steps: mini {median(times['mini']) * 1e3:.0f} ms "
           f"({len(replicas['mini'].buckets)} buckets, overlap {100 * median(overlaps):.0f}%), native DDP "
           f"{median(times['native DDP']) * 1e3:.0f} ms; paired ratio {ratio:.2f}x (target <= 1.15x)")
    return conclude("ddp", True, "bench", ratio <= 1.15, f"step time {ratio:.2f}x native DDP")


if __name__ == "__main__":
    raise SystemExit(bench() if "--bench" in sys.argv else demo())
