"""Data parallelism: every rank holds the whole model, runs its own slice of the batch, and averages the
gradients with an all-reduce, so every replica takes the same optimizer step.

The average is exactly the whole batch's gradient (local batch B, N ranks, K accumulation steps, loss / K):

    grad = (1/N) * sum over ranks r of grad_r  =  the gradient of the full batch of B x N x K samples

An all-reduce of the D gradient bytes sends 2(N-1)/N * D bytes per rank (ring: reduce-scatter, then
all-gather) however it is scheduled; what a DDP implementation decides is *when* those bytes move.

`NaiveDataParallel` waits for backward to end, then all-reduces the gradients one by one: 0% hidden.
`DistributedDataParallel` (mirrors torch.nn.parallel.DistributedDataParallel) packs gradients into buckets
of ~bucket_cap_mb in reverse parameter order, the order backward produces them; the moment a bucket's last
gradient lands, its all-reduce starts while backward computes earlier layers (mini_dist/reducer.py).
`timeline` records when each bucket was ready, sent and done, and the share hidden (`overlap()`);
`register_comm_hook(state, hook)` replaces each bucket's all-reduce, with torch's signature.

    torchrun --standalone --nproc_per_node=4 mini_dist/ddp.py [--bucket-cap-mb 0.25] [--steps 4] ...
"""
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/ddp.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, models, wire
from mini_dist.reducer import Reducer, Timeline, build_buckets
from mini_dist.ring_pipelined import ring_all_reduce

DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB = 25, 1  # torch's defaults (bucket_cap_mb=None)


class NaiveDataParallel(nn.Module):
    """The baseline: after backward, sync_gradients() all-reduces every gradient, one by one, and averages.
    Every trainable parameter joins every all-reduce (a missing gradient counts as zeros), so the ranks
    always issue the same collectives; unlike native DDP, a parameter no rank used gets a zero gradient."""

    def __init__(self, module: nn.Module, group=None, all_reduce=dist.all_reduce):
        super().__init__()
        self.module, self.group, self.all_reduce = module, group, all_reduce
        self.timeline = Timeline()  # of the last sync: it starts when backward has ended, so 0% hidden
        broadcast_from_rank0(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        start = time.perf_counter()
        self.timeline = Timeline(backward_end=start, start=[start])
        for p in (p for p in self.module.parameters() if p.requires_grad):
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            self.all_reduce(p.grad, group=self.group)
            p.grad.div_(dist.get_world_size(self.group))
            self.timeline.bytes += p.grad.nbytes
        self.timeline.finish = [time.perf_counter()]


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
        self.module, self.group = module, group
        broadcast_from_rank0(module, group)
        self.names = {p: name for name, p in module.named_parameters()}  # tied weights: listed once
        self.params = [p for p in self.names if p.requires_grad]  # frozen ones never get gradients
        if not self.params:
            raise ValueError("the module has no parameter that requires grad: nothing to synchronize")
        cap, first = (DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB) if bucket_cap_mb is None else (bucket_cap_mb, None)
        self.buckets = build_buckets(self.params, cap * 2 ** 20, first and first * 2 ** 20)
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
        before, self.reducer.require_grad_sync = self.reducer.require_grad_sync, False
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
    """Every replica starts from group rank 0's parameters and buffers. The ranks first compare what
    they hold (names, shapes, dtypes): a broadcast between different models would hang or corrupt."""
    mine = [(name, tuple(t.shape), t.dtype) for name, t in (*module.named_parameters(), *module.named_buffers())]
    everyone = [None] * dist.get_world_size(group)
    wire.call(dist.all_gather_object, everyone, mine, group=group)
    describe = lambda t: "nothing more" if t is None else f"{t[0]} of shape {t[1]} in {t[2]}"
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            ours, other = next((a, b) for a, b in zip([*everyone[0], None], [*theirs, None]) if a != b)
            raise ValueError(f"rank {rank} of the group holds another model than rank 0: rank 0 has "
                             f"{describe(ours)} where rank {rank} has {describe(other)}; build the same "
                             f"model on every rank before wrapping it")
    for t in (*module.parameters(), *module.buffers()):
        wire.call(dist.broadcast, t.detach(), group=group, group_src=0)


# ----------------------------------------------------------------------------- what the demo measures


def _everywhere(x: float, op=dist.ReduceOp.MAX) -> float:
    """The largest (or another reduction) of every rank's x: the figure rank 0 prints speaks for all."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=launch.device())
    dist.all_reduce(t, op=op)
    return t.item()


def _batch(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp64 data, the same on every rank for a seed: a global batch each rank takes its rows of."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64).to(launch.device())


def _diff(a: nn.Module, b: nn.Module, grads: bool = False) -> float:
    """The largest |difference| between two models' parameters, or between their gradients."""
    pick = (lambda p: p.grad) if grads else (lambda p: p)
    return max((pick(p) - pick(q)).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def gradients_vs_parameters() -> tuple[str, bool]:
    """Averaged gradients = one process on the whole batch; parameters averaged after each rank's own Adam
    step are another step. Collective: every rank of the default group."""
    n, r = dist.get_world_size(), dist.get_rank()
    x, y, mine = _batch(4 * n, 8, 0), _batch(4 * n, 4, 1), slice(4 * r, 4 * r + 4)  # 4 rows per rank
    module = models.mlp([8, 16, 4]).to(launch.device())
    alone, local = copy.deepcopy(module), copy.deepcopy(module)  # one process on the whole batch; a lone replica
    model = DistributedDataParallel(module, bucket_cap_mb=0)
    for m, rows in ((model, mine), (alone, slice(None)), (local, mine)):
        nn.functional.mse_loss(m(x[rows]), y[rows]).backward()
    grads = _everywhere(_diff(model, alone, grads=True))
    for m in (alone, local):
        torch.optim.Adam(m.parameters(), lr=1e-2).step()
    with torch.no_grad():
        for p in local.parameters():
            dist.all_reduce(p)
            p /= n
    weights = _diff(local, alone)
    return (f"gradients averaged over {n} ranks vs one process on the whole batch: max |diff| {grads:.0e}; weights "
            f"averaged after each rank's own Adam step: {weights:.0e} away from the full-batch step"), \
        grads <= 1e-12 and weights > 1e-4


def accumulation_divides_the_loss(K: int = 4, b: int = 2) -> tuple[str, bool]:
    """K micro-batches, the loss divided by K, the first K-1 under no_sync: one process's gradient on all
    K*b*N samples, one all-reduce per step. Collective: every rank of the default group."""
    n, r = dist.get_world_size(), dist.get_rank()
    x, y = _batch(K * n * b, 8, 0), _batch(K * n * b, 4, 1)
    module = models.mlp([8, 16, 4]).to(launch.device())
    alone, undivided = copy.deepcopy(module), copy.deepcopy(module)
    model = DistributedDataParallel(module, all_reduce=ring_all_reduce)
    wire.LEDGER.reset()
    for k in range(K):  # micro-batch k: rows [k*n*b, (k+1)*n*b), rank r's b of them
        rows, everyone = slice(k * n * b + r * b, k * n * b + (r + 1) * b), slice(k * n * b, (k + 1) * n * b)
        with model.no_sync() if k < K - 1 else contextlib.nullcontext():
            (nn.functional.mse_loss(model(x[rows]), y[rows]) / K).backward()
        nn.functional.mse_loss(undivided(x[everyone]), y[everyone]).backward()  # one process, not divided
    nn.functional.mse_loss(alone(x), y).backward()
    diff, D = _everywhere(_diff(model, alone, grads=True)), sum(p.numel() * 8 for p in module.parameters())
    sent = _everywhere(wire.LEDGER.sent, dist.ReduceOp.SUM) / n  # ranks' ring chunks can differ; their sum cannot
    too_big = min(p.grad.norm() / q.grad.norm() for p, q in zip(undivided.parameters(), alone.parameters())).item()
    return (f"{K} micro-batches x {b} samples x {n} ranks, loss / K: = one process on all {K * n * b} samples to "
            f"{diff:.0e}, and {sent / D:.2f}D sent per rank = one all-reduce (2(N-1)/N D), not {K}; without / K the "
            f"gradient is {too_big:.2f}x too large"), \
        diff <= 1e-12 and sent == 2 * (n - 1) / n * D and abs(too_big - K) < 1e-9


def global_batch(B: int = 16) -> tuple[str, bool]:
    """A global batch of B split over 1, 2 or N ranks gives one gradient; N ranks of B samples each make a
    global batch of N*B, whose gradient noise is N times smaller. Collective: every rank of the default group."""
    N, r, replicas = dist.get_world_size(), dist.get_rank(), {}
    x, y = _batch(B, 8, 0), _batch(B, 4, 1)
    for n in (sizes := sorted({1, 2, N} & set(range(1, N + 1)))):
        group = launch.new_group(range(n))
        if r < n:
            model = DistributedDataParallel(models.mlp([8, 16, 4]).to(launch.device()), group=group)
            rows = slice(r * B // n, (r + 1) * B // n)
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            replicas[n] = model
    same = _everywhere(max(_diff(replicas[n], replicas[1], grads=True) for n in replicas) if r == 0 else 0)
    g = torch.Generator().manual_seed(3)  # least squares at w = 0: each sample's gradient, -2 x y
    data = torch.randn(4096, 8, generator=g, dtype=torch.float64)  # cpu: a statistic of data, no ranks
    per_sample = -2 * data * (data.sum(1) + torch.randn(4096, generator=g, dtype=data.dtype))[:, None]  # cpu: as data
    draw = lambda b: per_sample[torch.randperm(4096, generator=g)[:b]].mean(0)  # cpu: a batch of b, as data
    noise = {b: torch.stack([(draw(b) - per_sample.mean(0)).square().sum() for _ in range(400)]).mean().item()
             for b in (B, N * B)}
    return (f"a global batch of {B} on {' or '.join(map(str, sizes))} ranks: the same gradient to {same:.0e}; {N} "
            f"ranks x {B} samples is a global batch of {N * B}: the gradient's noise (mean squared distance from the "
            f"full-data gradient) falls {noise[B] / noise[N * B]:.1f}x, and an epoch takes {N}x fewer steps"), \
        same <= 1e-12 and 0.75 * N < noise[B] / noise[N * B] < 1.25 * N


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
    env, w, cap, print0 = launch.setup(), args.widths, args.bucket_cap_mb, launch.print0
    model = lambda: models.mlp(w, seed=env.rank).to(env.device)  # different per rank: the broadcast must fix it
    replicas = {"native": NativeDDP(model()), "naive": NaiveDataParallel(model()),
                "bucketed": DistributedDataParallel(model(), bucket_cap_mb=cap),
                "ring": DistributedDataParallel(model(), bucket_cap_mb=cap, all_reduce=ring_all_reduce)}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in replicas.items()}
    g = torch.Generator().manual_seed(1000 + env.rank)  # each rank its own data
    seen = {name: [] for name in replicas}  # per step: (step time, all-reduce after backward, hidden, sent)
    for step in range(args.steps):
        batch = list(zip(*(torch.randn(args.accumulation, args.local_batch, width, generator=g,
                                       dtype=torch.float64).to(env.device) for width in (w[0], w[-1]))))
        for name in sorted(replicas, reverse=step % 2 == 1):  # take turns: noise slows every side alike
            wire.LEDGER.reset()
            start = time.perf_counter()
            models.accumulation_step(replicas[name], optimizers[name], batch)
            tl = getattr(replicas[name], "timeline", Timeline())  # native DDP keeps none
            seen[name].append((time.perf_counter() - start, tl.exposed(), tl.overlap(), wire.LEDGER.sent))
    diff = {name: max(((a - b).abs().max() / b.abs().max()).item()
                      for a, b in zip(m.parameters(), replicas["native"].parameters()))
            for name, m in replicas.items() if name != "native"}
    n, mini = env.world_size, replicas["bucketed"]
    print0(f"{args.steps} Adam steps, fp64, batch {args.local_batch} per rank x {n} ranks x {args.accumulation} "
           f"micro-batches; max relative difference from native DDP: "
           + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()))
    print0(f"{len(mini.buckets)} buckets (cap {cap:g} MiB, reverse parameter order): "
           + " | ".join(" ".join(mini.names[p] for p in b.params) for b in mini.buckets))
    D = sum(p.numel() * p.element_size() for p in mini.params)
    sent = torch.tensor([s[-1] for s in seen["ring"]], device=env.device)
    dist.all_reduce(sent)  # the ranks' ring chunks can differ by an element; their sum cannot
    print0(f"bytes per step, per rank: {mini.timeline.bytes:,} B handed to all-reduce = D (each gradient once); "
           f"the ring sent {sent[-1] / n:,.0f} B (mean over ranks) = 2(N-1)/N*D = {2 * (n - 1) / n * D:,.0f} B")
    median = lambda name, i: statistics.median(s[i] for s in seen[name])
    print0(f"\n{'rank 0, medians of %d steps' % args.steps:<40} step time  all-reduce after backward  hidden")
    for name, what in [("naive", "one all-reduce per gradient"), ("bucketed", "buckets during backward"),
                       ("native", "torch's DDP")]:
        print0(f"{f'{name} ({what})':<40} {median(name, 0) * 1e3:6.1f} ms" + (
            f"  {median(name, 1) * 1e3:14.1f} ms {100 * median(name, 2):15.0f}%" if name != "native" else ""))
    print0(f"rank 0's last bucketed backward:\n{mini.timeline.picture()}")
    worst = max(diff.values())  # fp64: the same sums in another order stay ~1e-15 apart
    bytes_ok = mini.timeline.bytes == D and bool((sent == 2 * (n - 1) * D).all())
    for question in (gradients_vs_parameters, accumulation_divides_the_loss, global_batch):
        figure, holds = question()
        print0(f"\n{question.__name__}: {figure}")
        bytes_ok &= holds
    return launch.conclude("ddp", worst <= 1e-12, f"max rel diff vs native DDP {worst:.1e}", bytes_ok,
                           f"ring sent 2(N-1)/N*D per rank; {100 * median('bucketed', 2):.0f}% hidden, naive 0%; "
                           f"gradients averaged = the full batch's")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
