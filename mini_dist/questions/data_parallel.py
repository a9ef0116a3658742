"""Data parallelism: the figures that answer questions 1, 3, 23 and 25 (mini_dist/questions/questions.md).

    1. Why average gradients rather than parameters?         gradients_vs_parameters      (ddp.py)
    3. Gradient accumulation, and why the loss is divided     accumulation_divides_the_loss (ddp.py)
    23. What compression saves, and why error feedback        powersgd_with_and_without_error_feedback
                                                              (compression.py)
    25. Why the global batch size matters when adding ranks  global_batch                 (ddp.py)

Question 2 (what buckets buy, how much hides behind backward) is the reducer's demo's own figure:
reducer.buckets_hide_communication. Each function here runs on every rank of the default group and returns
(figure, holds), as `./run.sh ask N` and tests/test_questions.py call it; the training is the concepts' own
(mini DDP, its no_sync, the PowerSGD hook, compression's training run), so a figure cannot drift from them.
"""
import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

from mini_dist import compression
from mini_dist.ddp import DistributedDataParallel
from mini_dist.kit import launch, models, wire
from mini_dist.ring_pipelined import ring_all_reduce


def _everywhere(x: float, op=dist.ReduceOp.MAX) -> float:
    """The largest (or another reduction) of every rank's x: the figure rank 0 prints speaks for all."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=launch.device())
    dist.all_reduce(t, op=op)
    return t.item()


def _batch(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp64 data, the same on every rank for a seed: a global batch each rank takes its rows of."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64).to(launch.device())


def _diff(a: nn.Module, b: nn.Module) -> float:
    """The largest |difference| between two models' parameters."""
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _grad_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest |difference| between two models' gradients."""
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def gradients_vs_parameters() -> tuple[str, bool]:
    """Question 1: averaged gradients = one process on the whole batch; parameters averaged after each rank's
    own Adam step are another step."""
    n = dist.get_world_size()
    r = dist.get_rank()
    x = _batch(4 * n, 8, 0)
    y = _batch(4 * n, 4, 1)
    mine = slice(4 * r, 4 * r + 4)  # 4 rows per rank
    module = models.mlp([8, 16, 4]).to(launch.device())
    alone = copy.deepcopy(module)  # one process on the whole batch
    local = copy.deepcopy(module)  # a lone replica on its own rows, averaged with the others afterwards
    model = DistributedDataParallel(module, bucket_cap_mb=0)
    for m, rows in ((model, mine), (alone, slice(None)), (local, mine)):
        nn.functional.mse_loss(m(x[rows]), y[rows]).backward()
    grads = _everywhere(_grad_diff(model, alone))
    for m in (alone, local):
        torch.optim.Adam(m.parameters(), lr=1e-2).step()
    with torch.no_grad():
        for p in local.parameters():
            dist.all_reduce(p)
            p /= n
    weights = _diff(local, alone)
    figure = (f"gradients averaged over {n} ranks vs one process on the whole batch: max |diff| {grads:.0e}; weights "
              f"averaged after each rank's own Adam step: {weights:.0e} away from the full-batch step")
    apart = weights > 1e-4 if n > 1 else weights == 0  # one rank's own step is the full batch's
    return figure, grads <= 1e-12 and apart


def accumulation_divides_the_loss(K: int = 4, b: int = 2) -> tuple[str, bool]:
    """Question 3: K micro-batches, the loss divided by K, the first K-1 under no_sync: one process's gradient
    on all K*b*N samples, one all-reduce per step."""
    n = dist.get_world_size()
    r = dist.get_rank()
    x = _batch(K * n * b, 8, 0)
    y = _batch(K * n * b, 4, 1)
    module = models.mlp([8, 16, 4]).to(launch.device())
    alone = copy.deepcopy(module)  # one process, the whole batch at once
    undivided = copy.deepcopy(module)  # one process, micro-batch after micro-batch, the loss not divided
    model = DistributedDataParallel(module, all_reduce=ring_all_reduce)
    wire.LEDGER.reset()
    for k in range(K):  # micro-batch k: rows [k*n*b, (k+1)*n*b), rank r's b of them
        rows = slice(k * n * b + r * b, k * n * b + (r + 1) * b)
        everyone = slice(k * n * b, (k + 1) * n * b)
        with model.no_sync() if k < K - 1 else contextlib.nullcontext():
            (nn.functional.mse_loss(model(x[rows]), y[rows]) / K).backward()
        nn.functional.mse_loss(undivided(x[everyone]), y[everyone]).backward()
    nn.functional.mse_loss(alone(x), y).backward()
    diff = _everywhere(_grad_diff(model, alone))
    D = sum(p.numel() * 8 for p in module.parameters())
    sent = _everywhere(wire.LEDGER.sent, dist.ReduceOp.SUM) / n  # ranks' ring chunks can differ; their sum cannot
    too_big = min(p.grad.norm() / q.grad.norm() for p, q in zip(undivided.parameters(), alone.parameters())).item()
    figure = (f"{K} micro-batches x {b} samples x {n} ranks, loss / K: = one process on all {K * n * b} samples to "
              f"{diff:.0e}, and {sent / D:.2f}D sent per rank = one all-reduce (2(N-1)/N D), not {K}; without / K "
              f"the gradient is {too_big:.2f}x too large")
    return figure, diff <= 1e-12 and sent == 2 * (n - 1) / n * D and abs(too_big - K) < 1e-9


def _gradient_noise(batch_sizes: tuple, draws: int = 400) -> dict:
    """Least squares at w = 0 on 4,096 samples (each sample's gradient -2 x y): the mean squared distance of
    a random batch's gradient from the full-data gradient, for each batch size."""
    g = torch.Generator().manual_seed(3)
    data = torch.randn(4096, 8, generator=g, dtype=torch.float64)  # cpu: a statistic of data, no ranks
    targets = data.sum(1) + torch.randn(4096, generator=g, dtype=data.dtype)  # cpu: as data
    per_sample = -2 * data * targets[:, None]
    full = per_sample.mean(0)
    noise = {}
    for b in batch_sizes:
        batches = [torch.randperm(4096, generator=g)[:b] for _ in range(draws)]  # cpu: indices into data, as data
        errors = [(per_sample[rows].mean(0) - full).square().sum() for rows in batches]
        noise[b] = torch.stack(errors).mean().item()
    return noise


def global_batch(B: int = 16) -> tuple[str, bool]:
    """Question 25: a global batch of B split over 1, 2 or N ranks gives one gradient; N ranks of B samples
    each make a global batch of N*B, whose gradient noise is N times smaller."""
    N = dist.get_world_size()
    r = dist.get_rank()
    x = _batch(B, 8, 0)
    y = _batch(B, 4, 1)
    sizes = sorted({1, 2, N} & set(range(1, N + 1)))
    replicas = {}
    for n in sizes:
        group = launch.new_group(range(n))  # every rank creates every group
        if r < n:
            model = DistributedDataParallel(models.mlp([8, 16, 4]).to(launch.device()), group=group)
            rows = slice(r * B // n, (r + 1) * B // n)
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            replicas[n] = model
    same = _everywhere(max(_grad_diff(replicas[n], replicas[1]) for n in replicas) if r == 0 else 0)
    noise = _gradient_noise((B, N * B))
    figure = (f"a global batch of {B} on {' or '.join(map(str, sizes))} ranks: the same gradient to {same:.0e}; {N} "
              f"ranks x {B} samples is a global batch of {N * B}: the gradient's noise (mean squared distance from "
              f"the full-data gradient) falls {noise[B] / noise[N * B]:.1f}x, and an epoch takes {N}x fewer steps")
    return figure, same <= 1e-12 and 0.75 * N < noise[B] / noise[N * B] < 1.25 * N


def powersgd_with_and_without_error_feedback(widths=(32, 32, 32), steps: int = 20) -> tuple[str, bool]:
    """Question 23: bytes all-reduced per step, plain and PowerSGD r = 1, and the test loss after `steps` steps
    with and without error feedback (compression's own training run)."""
    n = dist.get_world_size()
    runs = {"plain": (None, None)}
    for feedback in (True, False):
        name = "PowerSGD r=1 + EF" if feedback else "PowerSGD r=1"
        state = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, use_error_feedback=feedback)
        runs[name] = (compression.powerSGD_hook, state)
    sent = {}
    loss = {}
    for name, (hook, state) in runs.items():
        losses, _, sent[name] = compression.train(list(widths), hook, state, steps, 0.1)
        loss[name] = losses[-1]
    D = 4 * sum(a * b + b for a, b in zip(widths, widths[1:]))
    low = 4 * sum(a + b + b for a, b in zip(widths, widths[1:]))  # r(n + m) + the bias, r = 1
    figure = (f"linear layers of widths {list(widths)} on {n} ranks: bytes all-reduced per step plain "
              f"{sent['plain']:,}, PowerSGD r=1 {sent['PowerSGD r=1']:,} = 4(r(n+m) + bias) per layer "
              f"({D / low:.1f}x fewer{'; one rank sends nothing' if n == 1 else ''}); test loss after {steps} "
              f"steps: " + ", ".join(f"{k} {v:.2e}" for k, v in loss.items()))
    bytes_ok = sent["plain"] == D and sent["PowerSGD r=1"] == sent["PowerSGD r=1 + EF"] == (low if n > 1 else 0)
    return figure, bytes_ok and loss["PowerSGD r=1 + EF"] < loss["PowerSGD r=1"]
