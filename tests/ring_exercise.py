"""The ring exercise's judge: what the textbook ring's steps must leave (the contract, within the bound of its
arithmetic), and the classic mistakes, recognised from what the learner's steps did.

The bound: summing N terms in any order, each addition rounding once (unit roundoff u = eps/2 of the dtype),
the result is within gamma_(N-1) * sum|x_i| of the exact sum, gamma_k = k*u / (1 - k*u) (Higham, Accuracy and
Stability of Numerical Algorithms, 2002, sec. 4.2); a product of N factors within gamma_(N-1) * prod|x_i|; an
average, summed then divided once, within gamma_N * sum|x_i| / N. Integers (wrapping), max and min are exact
in any order. The exact value is computed in float64, whose own rounding is added to the bound.

The mistakes are read from a probe, not from the failing example: the learner's steps run once more on
one-element int64 chunks where rank r's chunk c starts as 4^(r*N + c), so every chunk afterwards spells out
which (rank, block) pieces were added into it, and how often (a base-4 digit each); the ring sent the wrong way
or one block off is then recognised by simulating the ring each family of indices describes.
"""
from collections import Counter
from functools import lru_cache

import torch

from grading import mistake
from harness import RankFailure, device, run

# each is made by a wrong solution of tests/bank_ring_allreduce.py (tests/test_exercise.py holds that)
MISTAKES = {
    "one step off": ("textbook_reduce_scatter_steps", "after N-1 steps rank r must hold block r: the ring "
                     "ends one block too early or too late, so shift which chunk the first step sends"),
    "turned the wrong way": ("textbook_reduce_scatter_steps", "the chunk indices must count the way the ring "
                             "turns, so that a rank adds what arrives into the chunk its neighbour sent"),
    "added into the wrong chunk": ("textbook_reduce_scatter_steps", "what arrives is the chunk your neighbour "
                                   "sent: add it into that same chunk of yours"),
    "not reduced in place": ("textbook_reduce_scatter_steps", "the steps must leave the sums in chunks "
                             "itself: reduce_into(chunks[i], incoming, op) adds in place, mine = mine + incoming "
                             "makes a new tensor"),
    "op ignored": ("textbook_reduce_scatter_steps", "combine with reduce_into(mine, incoming, op): it applies op "
                   "(sum, product, max, min)"),
    "divided twice": ("textbook_reduce_scatter_steps", "for AVG the steps only add; ring_all_reduce "
                      "divides by N once, after the all-gather"),
    "all-gather incomplete": ("textbook_all_gather_steps", "N-1 steps, each passing on the chunk received at "
                              "the step before, bring every chunk to every rank"),
}


# ----- the contract

def unit_roundoff_power(dtype) -> int:
    return {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]


def gamma(k: int, dtype) -> float:
    u = 2.0 ** -unit_roundoff_power(dtype)
    return k * u / (1 - k * u)


def exact(xs: torch.Tensor, op: str) -> torch.Tensor:
    """op over the ranks (dim 0 of xs, [N, ...]), in float64."""
    X = xs.double()
    return {"sum": X.sum(0), "avg": X.sum(0) / len(X), "product": X.prod(0), "max": X.max(0).values,
            "min": X.min(0).values}[op] if len(X) else X.sum(0)


def bound(xs: torch.Tensor, op: str, dtype) -> tuple[torch.Tensor | None, str]:
    """How far a correct ring may land from the exact value, per element, and why (None: it must be exact)."""
    n = len(xs)
    if not dtype.is_floating_point or op in ("max", "min"):
        return None, f"{dtype}, op {op}: exact in any order"
    X = xs.double().abs()
    terms = X.prod(0) if op == "product" else X.sum(0)
    k = n if op == "avg" else n - 1
    allowed = (gamma(k, dtype) + gamma(n, torch.float64)) * terms / (n if op == "avg" else 1)
    if op == "avg":  # the division may land below the smallest normal number: half a subnormal's spacing more
        allowed = allowed + torch.finfo(dtype).smallest_normal * 2.0 ** -unit_roundoff_power(dtype)
    what = {"sum": "sum|x_i|", "avg": "sum|x_i| / N", "product": "prod|x_i|"}[op]
    return allowed, (f"op {op} of {n} {dtype} terms: |err| <= gamma_{k} * {what}, gamma_k = k*u/(1-k*u), "
                     f"u = 2^-{unit_roundoff_power(dtype)}")


def outside(rank: int, ours: torch.Tensor, want: torch.Tensor, native: torch.Tensor, xs: torch.Tensor, op: str,
            dtype) -> str | None:
    """Where this rank's result leaves the contract: the first element beyond the bound (exact: unequal)."""
    if ours.shape != native.shape or ours.dtype != native.dtype:
        return f"rank {rank}: got {tuple(ours.shape)} {ours.dtype}, want {tuple(native.shape)} {native.dtype}"
    allowed, why = bound(xs, op, dtype)
    got = ours.reshape(-1)
    target = native.reshape(-1) if allowed is None else want.reshape(-1)
    off = got != target if allowed is None else ((got.double() - target).abs() > allowed.reshape(-1)) | got.isnan()
    if not off.any():
        return None
    i = off.nonzero()[0].item()
    limit = "" if allowed is None else f" ± {allowed.reshape(-1)[i].item():.3g}"
    return f"rank {rank} element {i}: got {got[i].item():.8g}, want {target[i].item():.8g}{limit} ({why})"


def disagreement(results: list) -> str | None:
    """The all-reduce promises every rank the same bits: the all-gather copies each finished chunk."""
    first = results[0]
    for rank, ours in enumerate(results[1:], 1):
        if ours.shape == first.shape and not torch.equal(ours, first):
            i = (ours != first).reshape(-1).nonzero()[0].item()
            return (f"rank {rank} and rank 0 differ at element {i}: {ours.reshape(-1)[i].item():.8g} vs "
                    f"{first.reshape(-1)[i].item():.8g}: every rank must end with the same bits (the all-gather "
                    f"copies each finished chunk)")
    return None


# ----- the mistakes

def probe_steps(module_name: str):
    """On a rank: the learner's steps on one-element int64 chunks that name their pieces (rank r's chunk c starts as
    4^(r*N + c)): the chunks after the reduce-scatter steps, the first neighbour a step sent to, and after the
    all-gather steps (rank c's chunk starting as 1000 + c, the others as -1) what each chunk holds."""
    import importlib

    import torch.distributed as dist
    ra = importlib.import_module(module_name)
    r = dist.get_rank()
    n = dist.get_world_size()
    chunks = [torch.tensor([4 ** (r * n + c)], dtype=torch.int64, device=device()) for c in range(n)]
    sent_to = []
    real = ra.send_recv

    def watched(send, dst, recv, src, *args, **kwargs):
        sent_to.append(dst)
        return real(send, dst, recv, src, *args, **kwargs)
    ra.send_recv = watched
    try:
        ra.textbook_reduce_scatter_steps(chunks, ra.SUM)
    finally:
        ra.send_recv = real
    gathered = [torch.tensor([1000 + c if c == r else -1], dtype=torch.int64, device=device()) for c in range(n)]
    ra.textbook_all_gather_steps(gathered)
    return [int(c.item()) for c in chunks], sent_to[:1], [int(g.item()) for g in gathered]


def ran(which: str, world: int, fn, *args) -> list:
    """run(world, fn, *args); when the learner's steps raised or hung instead, the mistake the probe recognises
    is added to the failure (an index that mixes chunks of different lengths fails inside torch's add)."""
    try:
        return run(world, fn, *args)
    except RankFailure as e:
        found = ring_mistake(world, which)
        if found:
            raise RankFailure(f"{e}\n{found}") from None
        raise


@lru_cache(maxsize=None)
def probed(world: int):
    """probe_steps on `world` ranks, once per check (the learner's code does not change during one)."""
    try:
        return run(world, probe_steps, "mini_dist.ring_allreduce")
    except RankFailure:
        return None


def pieces(value: int, n: int) -> Counter | None:
    """(rank, block) -> how often it was added, read from a probe's chunk; None when it cannot be read."""
    if value < 0 or value >= 4 ** (n * n):
        return None
    return Counter({(k // n, k % n): (value >> 2 * k) & 3 for k in range(n * n) if (value >> 2 * k) & 3})


def described(held: Counter, n: int) -> str:
    by_block = {}
    for (rank, block), times in sorted(held.items()):
        by_block.setdefault(block, []).append(f"{rank}" + (f" ({times} times)" if times > 1 else ""))
    return " + ".join(f"block {b} of " + ("every rank" if len(ranks) == n and "(" not in "".join(ranks)
                                          else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}")
                      for b, ranks in by_block.items())


def simulated(n: int, to: int, sigma: int, a: int, b: int) -> list[list[Counter]]:
    """The chunks after a ring whose rank r, at step s, sends chunk (r + a + sigma*s) % n to rank r + to and adds
    what arrives from rank r - to into its chunk (r + b + sigma*s) % n."""
    held = [[Counter({(r, c): 1}) for c in range(n)] for r in range(n)]
    for s in range(n - 1):
        sent = [held[r][(r + a + sigma * s) % n].copy() for r in range(n)]
        for r in range(n):
            held[r][(r + b + sigma * s) % n] += sent[(r - to) % n]
    return held


def ring_mistake(world: int, which: str) -> str | None:
    """The classic mistake the learner's steps make, in words, or None when the probe recognises none."""
    for n in dict.fromkeys([4, world]):
        result = probed(n) if n > 1 else None
        if result is None:
            continue
        tables = [[pieces(v, n) for v in held] for held, _, _ in result]
        if which != "all_gather" and any(tables[r][r] != Counter({(i, r): 1 for i in range(n)}) for r in range(n)):
            return reduce_scatter_mistake(n, tables, [to for _, to, _ in result])
        gathered = [g for _, _, g in result]
        if which != "reduce_scatter" and any(g != [1000 + c for c in range(n)] for g in gathered):
            r = next(r for r, g in enumerate(gathered) if g != [1000 + c for c in range(n)])
            seen = ", ".join("nothing" if v == -1 else f"rank {v - 1000}'s" if 1000 <= v < 1000 + n else str(v)
                             for v in gathered[r])
            if any(-1 in g for g in gathered):
                return mistake(MISTAKES, "all-gather incomplete", f"after your all-gather steps on {n} ranks "
                               f"(rank c's chunk marked c), rank {r}'s chunks hold: {seen}")
            return (f"after your all-gather steps on {n} ranks (rank c's chunk marked c), rank {r}'s chunks hold: "
                    f"{seen}; chunks[c] must end with rank c's")
    return None


def reduce_scatter_mistake(n: int, tables: list, sent_to: list) -> str:
    r = next(r for r in range(n) if tables[r][r] != Counter({(i, r): 1 for i in range(n)}))
    mine = tables[r][r]
    said = f"on {n} ranks, rank {r}'s chunks[{r}] ends with {described(mine, n) if mine else 'what no sum gives'}"
    if all(tables[q][c] == Counter({(q, c): 1}) for q in range(n) for c in range(n)):
        return mistake(MISTAKES, "not reduced in place", f"on {n} ranks, every chunk of every rank ends as it "
                       f"started")
    directions = {(to[0] - q) % n for q, to in enumerate(sent_to) if to}
    turns = [1, n - 1] if len(directions) != 1 else [next(iter(directions))]
    for to in turns:
        natural = 1 if to == n - 1 else -1  # sending to r-1, step s sends chunk r+1+s; to r+1, chunk r-1-s
        for sigma in (natural, -natural):
            for a in range(n):
                for b in range(n):
                    if simulated(n, to, sigma, a, b) != tables:
                        continue
                    way = "left (to r-1)" if to == n - 1 else "right (to r+1)"
                    if sigma != natural and n > 2:
                        return mistake(MISTAKES, "turned the wrong way", f"{said}: your ring sends to the {way} "
                                       f"while its chunk indices count the other way round")
                    if (b - a + to) % n:
                        return mistake(MISTAKES, "added into the wrong chunk", f"{said}: at step 0 rank {r} adds "
                                       f"what rank {(r - to) % n} sent (its chunks[{(r - to + a) % n}]) into its "
                                       f"chunks[{(r + b) % n}]")
                    k = (b - 2 * sigma) % n
                    holder = (r + k) % n
                    return mistake(MISTAKES, "one step off", f"on {n} ranks, rank {r} ends with block {holder}'s "
                                   f"reduction (in chunks[{holder}]), not block {r}'s: your ring is "
                                   f"{min(k, n - k)} step{'s' if min(k, n - k) > 1 else ''} off")
    return said + ": the pieces a step sends and the chunk it adds them into do not follow the ring"


def op_mistake(ours: torch.Tensor, want: torch.Tensor, xs: torch.Tensor, op: str, dtype) -> str | None:
    """Arithmetic mistakes, read from the failing example: another op applied, or N times off for AVG."""
    if not dtype.is_floating_point or not ours.numel() or len(xs) < 2:
        return None
    n = len(xs)
    got = ours.double().reshape(-1)
    want = want.reshape(-1)
    summed = exact(xs, "sum").reshape(-1)
    summed_bound = bound(xs, "sum", dtype)[0].reshape(-1)
    if op in ("max", "min", "product") and ((got - summed).abs() <= summed_bound).all():
        return mistake(MISTAKES, "op ignored", f"op {op}, but every rank's result is the sum over the ranks")
    allowed, _ = bound(xs, op, dtype)
    if op == "avg" and ((got * n - want).abs() <= allowed.reshape(-1) * n).all() and (want != 0).any():
        return mistake(MISTAKES, "divided twice", f"the average came out {n} (N) times too small")
    return None
