"""ZeRO-1's step, the learner's exercise (zero1_step): what one step must leave, exactly, and the classic mistakes,
recognised from what the learner's step did.

The contract. On every rank zero1_step returns the mean gradient, whole (K*S elements: the sum over the K ranks
of grad, which each rank passes already divided by K), and leaves flat the same on every rank: shard q (the q-th
of the K equal slices of flat) moved by exactly one step_shard call, made on rank q, with a view of flat's shard
q and the mean gradient's shard q; no other element changed.

Exact, whatever the order: the probe's flat and gradients are small integers in fp64 and its step_shard
subtracts the gradient, so every sum and every step is exact in any order and any correct step lands on the
same bits.

What the step did is watched: step_shard notes what it was handed (a view of flat or not, where, how many
elements, which gradient), and the module's own collectives (COLLECTIVES[collectives]) note when they ran.
"""
import torch
import torch.distributed as dist

from grading import mistake
from harness import device
from mini_dist import zero
from reducer_exercise import where_raised

# each is made by a wrong solution of tests/bank_zero.py (tests/test_exercise.py holds that)
MISTAKES = {
    "gradient not averaged": ("zero1_step", "grad is this rank's gradient alone (divided by K): sum it over the "
                              "ranks (an all-reduce) before any rank steps, and the sum is the mean"),
    "divided twice": ("zero1_step", "grad arrives divided by K already: the all-reduce's sum is the mean, divide "
                      "nothing more"),
    "every element stepped": ("zero1_step", "step_shard gets this rank's shard alone, S = flat.numel() // K "
                              "elements: ZeRO-1's saving is that each rank keeps optimizer state for 1/K of the "
                              "model"),
    "the wrong shard": ("zero1_step", "rank r owns shard r, the r-th of the K equal slices of flat: step that one"),
    "the gradient of another shard": ("zero1_step", "step_shard's gradient must be the same slice of the mean "
                                      "gradient as the slice of flat it steps"),
    "stepped a copy": ("zero1_step", "step_shard must get a view of flat (a slice is one; .clone(), torch.cat or "
                       ".contiguous() on a non-contiguous tensor make copies): the step lands in flat only "
                       "through the view"),
    "not gathered after the step": ("zero1_step", "each rank stepped only its own shard: once it has, all-gather "
                                    "flat so that every rank holds every stepped shard"),
}


def probe(S: int, collectives: str, seed: int) -> dict:
    """On a rank: the learner's zero1_step on K*S integers, each rank's gradient known to every rank. What it
    returned, flat afterwards, each step_shard call, and the order in which it stepped and gathered."""
    K = dist.get_world_size()
    r = dist.get_rank()
    g = torch.Generator().manual_seed(seed)  # the same numbers on every rank
    flat0 = torch.randint(-50, 50, (K * S,), generator=g).double()  # cpu: what the judge compares; moved below
    grads = torch.randint(-20, 20, (K, K * S), generator=g).double()  # cpu: row q, rank q's grad (already / K)
    flat = flat0.clone().to(device())  # a copy on the cpu too: the step must not touch what the judge compares
    grad = grads[r].clone().to(device())
    events = []
    calls = []

    def step_shard(own: torch.Tensor, own_grad: torch.Tensor) -> None:
        """SGD with lr 1, exact on integers; notes where own lies in flat (None: not a view of it)."""
        view = (own.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and own.dim() == 1
                and (own.numel() <= 1 or own.stride(0) == 1))
        calls.append({"at": own.storage_offset() - flat.storage_offset() if view else None, "numel": own.numel(),
                      "grad": own_grad.detach().reshape(-1).double().cpu().clone()})
        events.append("step")
        own.sub_(own_grad.to(own.dtype))

    c = zero.COLLECTIVES[collectives]
    real = (c.all_reduce, c.all_gather, c.reduce_scatter)

    def noted(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return call
    c.all_reduce = noted("all-reduce", real[0])
    c.all_gather = noted("all-gather", real[1])
    c.reduce_scatter = noted("reduce-scatter", real[2])
    error = None
    returned = None
    try:
        out = zero.zero1_step(flat, grad, step_shard, None, collectives)
        returned = out.detach().reshape(-1).double().cpu().clone() if isinstance(out, torch.Tensor) else repr(out)
    except Exception as e:  # judged beside what the step did
        said = str(e).splitlines()[0] if str(e) else ""
        blank = isinstance(e, NotImplementedError) and said.startswith("zero: write ")  # it says where
        error = f"{type(e).__name__}: {said}{'' if blank else where_raised(e, 'zero.py')}"
    finally:
        c.all_reduce, c.all_gather, c.reduce_scatter = real
    return {"flat0": flat0, "grads": grads, "flat": flat.cpu(), "returned": returned, "calls": calls,
            "events": events, "error": error}


def first_off(got: torch.Tensor, want: torch.Tensor) -> str:
    e = (got != want).nonzero()[0].item()
    return f"element {e}: got {got[e].item():g}, want {want[e].item():g}"


def step_mistake(r: int, seen: dict) -> str | None:
    """What rank r's step_shard calls got wrong: the contract's words, then the mistake where one is recognised."""
    grads = seen["grads"]
    K, n = grads.shape
    S = n // K
    mean = grads.sum(0)
    calls = seen["calls"]
    clause = (f"rank {r}: step_shard is called once, with a view of flat's shard {r} (elements [{r * S}, "
              f"{(r + 1) * S}) of {n}) and the mean gradient's shard {r}")
    if len(calls) != 1:
        return f"{clause}; it was called {len(calls)} times"
    call = calls[0]
    if call["numel"] == n and K > 1:
        return clause + "\n" + mistake(MISTAKES, "every element stepped", f"step_shard got all {n} elements of "
                                       f"flat on rank {r}")
    if call["numel"] != S:
        return f"{clause}; it got {call['numel']} elements, want S = {S}"
    if call["at"] is None:
        return clause + "\n" + mistake(MISTAKES, "stepped a copy", f"rank {r}'s step_shard got {S} elements that "
                                       f"are not a slice of flat: the step never reached flat")
    if call["at"] != r * S:
        return clause + "\n" + mistake(MISTAKES, "the wrong shard", f"rank {r} stepped elements [{call['at']}, "
                                       f"{call['at'] + S}) of flat, shard {call['at'] / S:g}")
    got = call["grad"]
    want = mean[r * S:(r + 1) * S]
    if got.shape != want.shape:
        return f"{clause}; its gradient has {got.numel()} elements, want S = {S}"
    if torch.equal(got, want):
        return None
    said = f"{clause}; its gradient, {first_off(got, want)}"
    if K > 1 and torch.equal(got, grads[r, r * S:(r + 1) * S]) and not torch.equal(got, want):
        return said + "\n" + mistake(MISTAKES, "gradient not averaged", f"rank {r} stepped with its own gradient "
                                     f"(grad as it was passed), not the sum over the {K} ranks")
    if K > 1 and torch.equal(got * K, want):
        return said + "\n" + mistake(MISTAKES, "divided twice", f"rank {r} stepped with the mean / {K} (K)")
    other = next((q for q in range(K) if q != r and torch.equal(got, mean[q * S:(q + 1) * S])), None)
    if other is not None:
        return said + "\n" + mistake(MISTAKES, "the gradient of another shard", f"rank {r} stepped shard {r} "
                                     f"with the mean gradient of shard {other}")
    return said


def judged(seen_by_rank: list) -> str | None:
    """The first way the step leaves the contract, in words; None when it keeps it."""
    for r, seen in enumerate(seen_by_rank):
        if seen["error"]:
            return f"rank {r}: zero1_step raised {seen['error']}"
    for r, seen in enumerate(seen_by_rank):
        found = step_mistake(r, seen)
        if found:
            return found
    for r, seen in enumerate(seen_by_rank):
        mean = seen["grads"].sum(0)
        got = seen["returned"]
        clause = f"rank {r}: zero1_step returns the mean gradient, whole ({mean.numel()} elements)"
        if not isinstance(got, torch.Tensor):
            return f"{clause}; it returned {got}"
        if got.shape != mean.shape:
            return f"{clause}; it returned {got.numel()} elements"
        if not torch.equal(got, mean):
            return f"{clause}; {first_off(got, mean)}"
    for r, seen in enumerate(seen_by_rank):
        K = len(seen["grads"])
        S = seen["flat0"].numel() // K
        want = seen["flat0"] - seen["grads"].sum(0)
        got = seen["flat"]
        if torch.equal(got, want):
            continue
        said = (f"rank {r}: flat ends the same on every rank, every shard q stepped once by rank q; flat's "
                f"{first_off(got, want)}")
        mine = slice(r * S, (r + 1) * S)
        only_mine = torch.equal(got[mine], want[mine]) and all(
            torch.equal(got[q * S:(q + 1) * S], seen["flat0"][q * S:(q + 1) * S]) for q in range(K) if q != r)
        if K > 1 and only_mine:
            events = seen["events"]
            when = ("an all-gather ran before the step, when no shard had moved yet" if "all-gather" in events
                    and events.index("all-gather") < events.index("step") else "no all-gather of flat ran after it")
            return said + "\n" + mistake(MISTAKES, "not gathered after the step", f"rank {r}'s flat holds its own "
                                         f"stepped shard and the other {K - 1} as they were: {when}")
        return said
    return None
