"""Timing a distributed call so that a busy, shared machine says as little as possible about the result.

- every rank meets at a barrier before a timed call, and a call lasts as long as its slowest rank (one
  all-reduce of MAX of the ranks' times), because a collective is as slow as its slowest rank;
- device work is waited for (torch.cuda.synchronize) before the clock stops;
- two sides take turns (ours, native, native, ours, ...), so noise slows both alike;
- we report medians and quantiles, never a single run, and never judge a wall-clock figure in a test.
"""
import time

import torch
import torch.distributed as dist

from mini_dist.kit.launch import device


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank): quantile(xs, 0.1) is the time a call takes when nothing else
    on the machine got in its way; the median adds the usual interference."""
    xs = sorted(xs)
    return xs[round(q * (len(xs) - 1))]


def timed(fn, group=None) -> float:
    """Seconds fn() takes on the slowest rank of the group, after a barrier, device work included."""
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    if device().type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def paired(sides: dict, repeats: int, warmup: int = 1, group=None) -> dict[str, list[float]]:
    """{name: fn} -> {name: seconds per repeat}: the sides take turns, in an order that alternates."""
    names, times = list(sides), {name: [] for name in sides}
    for i in range(warmup + repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            t = timed(sides[name], group)
            if i >= warmup:
                times[name].append(t)
    return times


def spread(xs: list[float]) -> str:
    """A wall-clock figure with its noise: the median and the 10-90% range, in milliseconds."""
    return f"{median(xs) * 1e3:.2f} ms (10-90%: {quantile(xs, 0.1) * 1e3:.2f}-{quantile(xs, 0.9) * 1e3:.2f})"
