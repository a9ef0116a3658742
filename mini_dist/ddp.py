"""Data parallelism: every rank holds the whole model, runs its own slice of the batch, and averages the
gradients with an all-reduce, so every replica takes the same optimizer step.

The average is exactly the whole batch's gradient (local batch B, N ranks, K accumulation steps, loss / K):

    grad = (1/N) * sum over ranks r of grad_r  =  the gradient of the full batch of B x N x K samples

An all-reduce of the D gradient bytes sends 2(N-1)/N * D bytes per rank (ring: reduce-scatter, then
all-gather) however it is scheduled; what a DDP implementation decides is *when* those bytes move.

`NaiveDataParallel` waits for backward to end, then all-reduces the gradients one by one: 0% hidden.
`DistributedDataParallel` (mirrors torch.nn.parallel.DistributedDataParallel) packs gradients into buckets
of ~bucket_cap_mb in reverse parameter order, the order backward produces them (mini_dist/buckets.py); the
moment a bucket's last gradient lands, its all-reduce starts while backward computes earlier layers
(mini_dist/reducer.py). `timeline` records when each bucket was ready, sent and done, and the share hidden
(`overlap()`); `register_comm_hook(state, hook)` replaces each bucket's all-reduce, with torch's signature.
A training loop is the one-process loop with the model wrapped, each rank reading its own batches:

    model = DistributedDataParallel(model)   # every rank starts from rank 0's weights
    for x, y in my_batches:                  # this rank's slice of each global batch
        loss_fn(model(x), y).backward()      # the gradients are averaged over the ranks during backward
        optimizer.step()                     # the same step on every rank: the replicas stay equal
        optimizer.zero_grad()

Accumulating K micro-batches per step: each loss / K, the first K-1 backwards inside `with model.no_sync():`
(they only add into .grad), so the ranks communicate once per step (kit/models.py's accumulation_step).

    torchrun --standalone --nproc_per_node=4 mini_dist/ddp.py [--bucket-cap-mb 0.25] [--steps 4] ...
"""
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.buckets import Timeline, build_buckets
from mini_dist.kit import launch, models, trace, wire
from mini_dist.reducer import Reducer
from mini_dist.ring_pipelined import ring_all_reduce

DEFAULT_CAP_MB = 25  # torch's defaults (bucket_cap_mb=None): 25 MiB buckets,
DEFAULT_FIRST_CAP_MB = 1  # but the first (the last layers' gradients) closes at 1 MiB, so it goes out early


class NaiveDataParallel(nn.Module):
    """The baseline: after backward, sync_gradients() all-reduces every gradient, one by one, and averages.
    Every trainable parameter joins every all-reduce (a missing gradient counts as zeros), so the ranks
    always issue the same collectives; unlike native DDP, a parameter no rank used gets a zero gradient."""

    def __init__(self, module: nn.Module, group=None, all_reduce=dist.all_reduce):
        super().__init__()
        self.module = module
        self.group = group
        self.all_reduce = all_reduce
        self.timeline = Timeline()  # of the last sync: it starts when backward has ended, so 0% hidden
        broadcast_from_rank0(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        start = trace.now()
        sent = 0
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.all_reduce is dist.all_reduce:  # torch's: through the wire, counted and named, as the reducer's
                wire.call(dist.all_reduce, p.grad, group=self.group, book=("all_reduce", p.grad.nbytes))
            else:
                self.all_reduce(p.grad, group=self.group)
            p.grad.div_(dist.get_world_size(self.group))
            sent += p.grad.nbytes
        records = []  # the trace's record of the sync (kit/trace.py), and the Timeline drawn from it
        trace.record(trace.FLIGHT, "all-reduce, gradient by gradient", start, trace.now(), into=records, bytes=sent)
        self.timeline = Timeline.of(records)


class DistributedDataParallel(nn.Module):
    """Bucketed data parallelism whose all-reduces overlap backward; mirrors torch's DDP.

    bucket_cap_mb: None is torch's default (first bucket 1 MiB, then 25 MiB); 0, or a cap below the
    smallest gradient, gives one parameter per bucket; one above the model's size (or inf), one bucket.
    all_reduce: dist.all_reduce (async_op=True) or a blocking in-place function with its signature (e.g.
    ring_all_reduce, run on the communication thread). A parameter without a gradient in a backward is
    an error naming it, unless find_unused_parameters=True: then, as in native DDP, it counts as zeros on
    the ranks that did not use it, and its .grad stays untouched if no rank did. Native DDP does more: it
    re-buckets after the first step in the order gradients really arrived; it finds unused parameters in
    the autograd graph after forward (we notice them when backward ends, so buckets behind one go out
    late); it re-broadcasts buffers before every forward (we do so once, at construction).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, group=None,
                 all_reduce=dist.all_reduce, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False):
        super().__init__()
        if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb must be >= 0 (0: one parameter per bucket) or None (torch's "
                             f"default, {DEFAULT_CAP_MB} MiB), got {bucket_cap_mb}")
        self.module = module
        self.group = group
        broadcast_from_rank0(module, group)
        self.names = {p: name for name, p in module.named_parameters()}  # tied weights: listed once
        self.params = [p for p in self.names if p.requires_grad]  # frozen ones never get gradients
        if not self.params:
            raise ValueError("the module has no parameter that requires grad: nothing to synchronize")
        if bucket_cap_mb is None:
            self.buckets = build_buckets(self.params, DEFAULT_CAP_MB * 2 ** 20, DEFAULT_FIRST_CAP_MB * 2 ** 20)
        else:
            self.buckets = build_buckets(self.params, bucket_cap_mb * 2 ** 20)
        self.reducer = Reducer(self.params, self.names, self.buckets, group, all_reduce, gradient_as_bucket_view,
                               find_unused_parameters)  # it syncs every backward from now on

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def timeline(self) -> Timeline:
        """The last synced backward: when each bucket was ready, sent and done; bytes; overlap()."""
        return self.reducer.timeline

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only accumulates gradients locally; the next backward outside syncs the sum."""
        before = self.reducer.require_grad_sync
        self.reducer.require_grad_sync = False
        try:
            yield
        finally:
            self.reducer.require_grad_sync = before

    def register_comm_hook(self, state, hook) -> None:
        """hook(state, bucket) -> torch.futures.Future[Tensor] replaces each bucket's all-reduce, as in
        torch: bucket.buffer() holds this rank's summed gradients (not divided by N: averaging is the
        hook's job), and the future's tensor is the reduced bucket that lands in .grad."""
        self.reducer.register_comm_hook(state, hook)


def broadcast_from_rank0(module: nn.Module, group=None) -> None:
    """Every replica starts from group rank 0's parameters and buffers, after check_same_model."""
    check_same_model(module, group)
    for t in (*module.parameters(), *module.buffers()):
        wire.call(dist.broadcast, t.detach(), group=group, group_src=0)


def check_same_model(module: nn.Module, group=None) -> None:
    """The ranks compare what they hold (names, shapes, dtypes) before the broadcast: a broadcast between
    different models would hang or corrupt. A difference is one error, on every rank, naming both sides."""
    mine = [(name, tuple(t.shape), t.dtype) for name, t in (*module.named_parameters(), *module.named_buffers())]
    everyone = [None] * dist.get_world_size(group)
    wire.call(dist.all_gather_object, everyone, mine, group=group)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == first:
            continue
        at = 0  # the first entry where they differ
        while at < min(len(first), len(theirs)) and first[at] == theirs[at]:
            at += 1
        raise ValueError(f"rank {rank} of the group holds another model than rank 0: rank 0 has "
                         f"{_describe(first, at)} where rank {rank} has {_describe(theirs, at)}; build the "
                         f"same model on every rank before wrapping it")


def _describe(held: list, i: int) -> str:
    """Entry i of a rank's list of (name, shape, dtype), in words."""
    if i >= len(held):
        return "nothing more"
    name, shape, dtype = held[i]
    return f"{name} of shape {shape} in {dtype}"


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (Adam, fp64)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="bucket cap, MiB (0: one per parameter)")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--local-batch", type=int, default=16, help="samples per micro-batch per rank")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256, 256, 256, 16], help="MLP layer widths")
    return p


def demo(args) -> int:
    from torch.nn.parallel import DistributedDataParallel as NativeDDP
    launch.require(min(args.steps, args.accumulation, args.local_batch, *args.widths) >= 1 and
                   len(args.widths) >= 2 and args.bucket_cap_mb >= 0, "--steps, --accumulation, --local-batch "
                   "and --widths (two or more) must be >= 1, --bucket-cap-mb >= 0")
    env = launch.setup()
    n = env.world_size
    w = args.widths
    cap = args.bucket_cap_mb

    def replica():
        """The MLP, initialized differently on every rank: the broadcast from rank 0 must make them equal."""
        return models.mlp(w, seed=env.rank).to(env.device)
    replicas = {"native": NativeDDP(replica()), "naive": NaiveDataParallel(replica()),
                "bucketed": DistributedDataParallel(replica(), bucket_cap_mb=cap),
                "ring": DistributedDataParallel(replica(), bucket_cap_mb=cap, all_reduce=ring_all_reduce)}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in replicas.items()}
    g = torch.Generator().manual_seed(1000 + env.rank)  # each rank its own data
    seen = {name: [] for name in replicas}  # per step: (step time, all-reduce after backward, hidden, sent)
    for step in range(args.steps):
        x = torch.randn(args.accumulation, args.local_batch, w[0], generator=g, dtype=torch.float64).to(env.device)
        y = torch.randn(args.accumulation, args.local_batch, w[-1], generator=g, dtype=torch.float64).to(env.device)
        micro_batches = list(zip(x, y))
        for name in sorted(replicas, reverse=step % 2 == 1):  # take turns: noise slows every side alike
            wire.LEDGER.reset()
            start = time.perf_counter()
            models.accumulation_step(replicas[name], optimizers[name], micro_batches)
            tl = getattr(replicas[name], "timeline", Timeline())  # native DDP keeps none
            seen[name].append((time.perf_counter() - start, tl.exposed(), tl.overlap(), wire.LEDGER.sent))
    native = replicas["native"]
    diff = {name: max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(m.parameters(), native.parameters()))
            for name, m in replicas.items() if name != "native"}
    mini = replicas["bucketed"]
    launch.print0(f"{args.steps} Adam steps, fp64, batch {args.local_batch} per rank x {n} ranks x "
                  f"{args.accumulation} micro-batches; max relative diff from native DDP: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()))
    launch.print0(f"{len(mini.buckets)} buckets (cap {cap:g} MiB, reverse parameter order): "
                  + " | ".join(" ".join(mini.names[p] for p in b.params) for b in mini.buckets))
    D = sum(p.numel() * p.element_size() for p in mini.params)
    sent = torch.tensor([s[-1] for s in seen["ring"]], device=env.device)
    dist.all_reduce(sent)  # the ranks' ring chunks can differ by an element; their sum cannot
    launch.print0(f"bytes per step, per rank: {mini.timeline.bytes:,} B handed to all-reduce = D (each gradient "
                  f"once, {args.accumulation} micro-batches or not); the ring sent {sent[-1] / n:,.0f} B (mean "
                  f"over ranks) = 2(N-1)/N*D = {2 * (n - 1) / n * D:,.0f} B")
    launch.print0(f"\n{'rank 0, medians of %d steps' % args.steps:<40} step time  all-reduce after backward  hidden")
    for name, what in [("naive", "one all-reduce per gradient"), ("bucketed", "buckets during backward"),
                       ("native", "torch's DDP")]:
        step_ms = statistics.median(s[0] for s in seen[name]) * 1e3
        after_ms = statistics.median(s[1] for s in seen[name]) * 1e3
        hidden = statistics.median(s[2] for s in seen[name])
        shown = f"{100 * hidden:15.0f}%" if n > 1 else f"{'-':>16}"  # one rank sends nothing to hide
        after = f"  {after_ms:14.1f} ms {shown}" if name != "native" else ""
        launch.print0(f"{f'{name} ({what})':<40} {step_ms:6.1f} ms{after}")
    launch.print0(f"rank 0's last bucketed backward:\n{mini.timeline.picture()}")
    worst = max(diff.values())  # fp64: the same sums in another order stay ~1e-15 apart
    bytes_ok = mini.timeline.bytes == D and bool((sent == 2 * (n - 1) * D).all())
    hidden = statistics.median(s[2] for s in seen["bucketed"])
    figure = f"{100 * hidden:.0f}% hidden, naive 0%" if n > 1 else "1 rank: no bytes to hide"
    return launch.conclude("ddp", worst <= 1e-12, f"max rel diff vs native DDP {worst:.1e}", bytes_ok,
                           f"ring sent 2(N-1)/N*D per rank, once per {args.accumulation} micro-batches; {figure}")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
