"""DDP's bucket-ready hook, the learner's exercise (Reducer._fill): what synced backwards must leave, within the
bound of their arithmetic, and the classic mistakes, recognised from what the learner's _fill did.

The contract. After a synced backward every parameter some rank used has as .grad the mean over the N ranks of
its gradient, the same bits on every rank (an all-reduce hands every rank the same result); every bucket went to
_launch exactly once, in bucket order, the moment it and the buckets before it were full.

The bound. The mean of N fp64 terms, however it is formed (each term times a rounded 1/N then summed, as native
DDP does; each divided by N then summed, as torch's allreduce_hook does; summed then divided once), is within
gamma_(N+1) * sum|g_i| / N of the exact mean, gamma_k = k*u / (1 - k*u), u = 2^-53 (Higham, Accuracy and
Stability of Numerical Algorithms, 2002, sec. 4.2): N-1 additions and at most two roundings per term. The
reference mean is computed in fp64 too: its own gamma_N is added.

What _fill did is watched, not guessed: a hook on every parameter, registered before DDP's (autograd runs a
tensor's hooks in the order they were registered), notes each gradient as it arrives and how many buckets had
gone by then; _launch and _backward_done, wrapped on the reducer, note each launch (the bucket, how many
gradients had arrived, whether backward had ended). Each rank reports what it saw, errors included, so that
a launch out of order is named rather than the error it causes later.
"""
import os
import traceback
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from grading import mistake
from harness import device, rank_generator
from mini_dist import ddp
from mini_dist.ring_pipelined import ring_all_reduce
from ring_exercise import gamma
from test_ddp import F64, Net, trainable_bytes

# each is made by a wrong solution of tests/bank_reducer.py (tests/test_exercise.py holds that)
MISTAKES = {
    "a sum for an average": ("Reducer._fill", "the all-reduce sums the buckets over the ranks: put p.grad / N in "
                             "the slot (or divide the reduced bucket by N) so that the sum is the mean"),
    "divided twice": ("Reducer._fill", "divide by N once: on the way in or after the all-reduce, not both; and "
                      "not at all under a communication hook (self.hook), which averages itself"),
    "launched out of order": ("Reducer._fill", "bucket k may go only after buckets 0..k-1 (self.next_bucket), "
                              "whatever order its gradients arrive in: every rank must issue the same all-reduces "
                              "in the same order"),
    "launched before it is full": ("Reducer._fill", "a bucket goes once all its gradients are in (bucket.pending "
                                   "reaches 0): its all-reduce reads the bucket as it is at launch"),
    "launched twice": ("Reducer._fill", "each bucket goes to _launch once a backward: step self.next_bucket past "
                       "it as it goes"),
    "launched only when backward ends": ("Reducer._fill", "launch each bucket from _fill the moment it and the "
                                         "buckets before it are full, so that its all-reduce travels while "
                                         "backward computes the layers below"),
    "no gradient, no zeros": ("Reducer._fill", "a parameter no backward reached is filled when backward ends with "
                              "p.grad None: its slot must hold zeros, so that every rank adds the same terms"),
}
HOOKS = (None, "allreduce")  # no communication hook, or torch's own allreduce_hook (which divides by N)


class Permuted(nn.Module):
    """Square layers applied in a drawn order: their gradients arrive in another order than the buckets hold
    them (the parameters in reverse), so a bucket may be full before the ones ahead of it."""

    def __init__(self, width, order, bias):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=bias, dtype=F64, device=device()) for _ in order)
        self.order = order

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


def model_of(kind: str, spec: dict) -> nn.Module:
    if kind == "permuted":
        return Permuted(spec["width"], spec["order"], spec["bias"])
    return Net(spec["widths"], spec["bias"], spec["frozen"], spec["tied"], spec["unused"])


def arrived(order: list, launches: list, i: int, p: torch.Tensor) -> None:
    """Runs before DDP's hook on parameter i: its gradient arrived; how many buckets had gone by then."""
    order.append((i, len(launches)))


def where_raised(e: BaseException, file: str = "reducer.py") -> str:
    """The last line of the module's file the error passed through (the learner's copy in a check)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.basename(f.filename) == file]
    return f" (at {file}:{frames[-1].lineno} in {frames[-1].name}: {frames[-1].line})" if frames else ""


def synced_backwards(kind: str, spec: dict, seed: int, hook, collective: str, backwards: int = 2) -> dict:
    """On a rank: mini DDP over a drawn model, `backwards` synced backwards, each watched. Per backward: this
    rank's .grad (flat, None where unset), every rank's own gradient (autograd.grad: no hook fires), when
    each gradient arrived and each bucket went, and the error backward raised, if any."""
    torch.manual_seed(seed)  # the same model on every rank
    model = model_of(kind, spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = {p: n for n, p in model.named_parameters()}
    order = []  # (parameter index, buckets gone before its _fill) per arriving gradient
    launches = []  # (bucket, gradients arrived, backward ended) per launch
    ended = []  # [buckets gone when _backward_done began]
    for i, p in enumerate(trainable):
        p.register_post_accumulate_grad_hook(partial(arrived, order, launches, i))
    cap = {"one bucket": trainable_bytes(model), "several": trainable_bytes(model) // 3,
           "one param each": 1}[spec["cap"]] / 2 ** 20
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=cap, find_unused_parameters=kind == "net" and
                                       spec["unused"], all_reduce=ring_all_reduce if collective == "ring"
                                       else dist.all_reduce)
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        mini.register_comm_hook(None, default_hooks.allreduce_hook)
    reducer = mini.reducer
    index = {p: i for i, p in enumerate(trainable)}
    real_launch = reducer._launch
    real_done = reducer._backward_done

    def launch(bucket):
        """_launch, watched: which bucket, after how many gradients, before or after backward ended, and the
        parameters whose slot did not hold their gradient yet (neither g, nor g / N, nor zeros for none)."""
        unready = [index[p] for p, view in zip(bucket.params, bucket.views) if not holds(view, local[index[p]])]
        launches.append((bucket.k, len(order), bool(ended), unready))
        return real_launch(bucket)

    def done():
        """_backward_done, watched: how many buckets had gone when backward ended."""
        ended.append(len(launches))
        return real_done()
    local = []  # this rank's own gradients in the backward under way
    reducer._launch = launch
    reducer._backward_done = done
    steps = []
    for b in range(backwards):
        x = torch.randn(3, model_of_width(kind, spec), generator=rank_generator(seed + b), dtype=F64).to(device())
        local[:] = torch.autograd.grad(model(x).square().sum(), trainable, allow_unused=True)
        mine = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(trainable, local)])
        everyone = torch.empty(dist.get_world_size() * mine.numel(), dtype=F64, device=device())
        dist.all_gather_single(everyone, mine)
        used = torch.tensor([g is not None for g in local], dtype=torch.int32, device=device())
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        model.zero_grad(set_to_none=True)
        order.clear()
        launches.clear()
        ended.clear()
        error = None
        try:
            mini(x).square().sum().backward()
        except Exception as e:  # what the learner's _fill led to; judged beside what it did
            said = str(e).splitlines()[0] if str(e) else ""
            blank = isinstance(e, NotImplementedError) and said.startswith("reducer: write ")  # it says where
            error = f"{type(e).__name__}: {said}{'' if blank else where_raised(e)}"
        grads = [None if p.grad is None else p.grad.detach().reshape(-1).clone().cpu() for p in trainable]
        steps.append({"grads": grads, "everyone": everyone.view(dist.get_world_size(), -1).cpu(),
                      "used": used.tolist(), "order": order[:], "launches": launches[:], "ended": ended[:],
                      "error": error})
        if error:  # the reducer is mid-backward now: no further backward means anything
            break
    return {"steps": steps, "buckets": [[index[p] for p in bucket.params] for bucket in mini.buckets],
            "names": [names[p] for p in trainable], "numels": [p.numel() for p in trainable]}


def holds(view: torch.Tensor, g) -> bool:
    """The slot holds a gradient as the contract allows: g (divided later, or by a hook), g / N however rounded
    (two roundings: 1/N, then the product), or zeros where there is none."""
    if g is None:
        return not view.any()
    n = dist.get_world_size()
    return torch.equal(view, g) or bool(((view * n - g).abs() <= 4 * n * 2.0 ** -53 * g.abs()).all())


def model_of_width(kind: str, spec: dict) -> int:
    return spec["width"] if kind == "permuted" else spec["widths"][0]


# ----- the launches

def full_prefix(buckets: list, arrived_so_far: set) -> int:
    """How many buckets, from bucket 0 on, are full when these gradients have arrived."""
    k = 0
    while k < len(buckets) and all(i in arrived_so_far for i in buckets[k]):
        k += 1
    return k


def launch_mistake(seen: dict, step: dict, timing: bool) -> str | None:
    """What this rank's launches got wrong in one backward: a line saying which part of the contract broke, then
    the mistake by name where one is recognised (else what happened). timing: also whether each bucket went the
    moment it could. None when the launches keep the contract."""
    buckets = seen["buckets"]
    names = seen["names"]
    ks = [k for k, _, _, _ in step["launches"]]
    arrivals = [i for i, _ in step["order"]]
    once = "each bucket goes to _launch exactly once a backward, in bucket order"
    twice = next((k for k in ks if ks.count(k) > 1), None)
    if twice is not None:
        return once + "\n" + mistake(MISTAKES, "launched twice", f"bucket {twice} went to _launch {ks.count(twice)} "
                                      f"times (launch order {', '.join(map(str, ks))}): its all-reduce ran on a "
                                      f"bucket already reduced")
    if ks != list(range(len(ks))):
        first = next(j for j, k in enumerate(ks) if k != j)
        return once + "\n" + mistake(MISTAKES, "launched out of order", f"buckets went to _launch in the order "
                                      f"{', '.join(map(str, ks))}: bucket {ks[first]} before bucket {first}")
    for k, count, after_end, unready in step["launches"]:
        missing = [names[i] for i in buckets[k] if i not in arrivals[:count] and not after_end]
        unwritten = [names[i] for i in unready if names[i] not in missing]
        if missing or unwritten:
            said = (f"without {', '.join(missing)}" if missing else
                    f"before the gradient of {', '.join(unwritten)} was in its slot")
            lost = missing + unwritten
            return ("a bucket goes to _launch once it is full" + "\n" +
                    mistake(MISTAKES, "launched before it is full", f"bucket {k} went to _launch after {count} "
                            f"gradient{'s' if count != 1 else ''} had arrived, {said}: "
                            f"{'that gradient is' if len(lost) == 1 else 'those gradients are'} missing from its "
                            f"all-reduce"))
    if step["error"] is None and len(ks) < len(buckets):
        return (f"{once}\nbucket {len(ks)} never went to _launch ({len(ks)} of buckets 0..{len(buckets) - 1} "
                f"went): bucket.pending tells when a bucket is full")
    if not timing or step["error"] is not None:
        return None
    late = []  # (bucket, the gradient after which it could go, the gradient after which it went)
    for k, count, _, _ in step["launches"]:
        could = next((t for t in range(len(arrivals) + 1) if full_prefix(buckets, set(arrivals[:t])) > k), count)
        if count > could:
            late.append((k, could, count))
    if not late:
        return None
    k, could, went = late[0]
    clause = "each bucket goes to _launch the moment it and the buckets before it are full"
    if all(went == len(arrivals) for _, _, went in late):
        return clause + "\n" + mistake(MISTAKES, "launched only when backward ends", f"no bucket went before the "
                                        f"last of the {len(arrivals)} gradients arrived, though bucket {k} (and the "
                                        f"ones before it) was full after gradient {could}: nothing travelled while "
                                        f"backward computed")
    return (f"{clause}\nbucket {k} could go once {could} of the {len(arrivals)} gradients had arrived, but went "
            f"after {went}")


def no_zeros(seen: dict, step: dict) -> str | None:
    """A learner's _fill that raised on a parameter without a gradient, filled as backward ended."""
    if step["error"] and "NoneType" in step["error"] and step["ended"]:
        came = {j for j, _ in step["order"]}
        unused = [name for i, name in enumerate(seen["names"]) if i not in came]
        return ("a parameter without a gradient fills its slot with zeros" + "\n" +
                mistake(MISTAKES, "no gradient, no zeros", f"as backward ended, _fill(p) for "
                        f"{', '.join(unused) or 'a parameter'} (no gradient in this backward: p.grad is None) raised "
                        f"{step['error']}"))
    return None


# ----- the values

def allowed(xs: torch.Tensor) -> torch.Tensor:
    """How far a correct mean of the rows of xs ([N, numel], fp64) may land from the fp64 reference, per element."""
    n = len(xs)
    return ((gamma(n + 1, F64) + gamma(n, F64)) * xs.abs().sum(0) / n
            + torch.finfo(F64).smallest_normal * 2.0 ** -53)


def value_mistake(ours: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, n: int, hook) -> str | None:
    """N times too large or too small, read from every compared element of the failing parameter."""
    if n < 2 or not (want.abs() > bound).any():
        return None
    if ((ours - n * want).abs() <= n * bound).all():
        return mistake(MISTAKES, "a sum for an average", f"every rank's .grad is {n} (N) times the mean: the sum "
                       f"over the ranks")
    if ((ours * n - want).abs() <= n * bound).all():
        why = ("a communication hook is set (torch's allreduce_hook), and it divides by N itself" if hook else
               "the gradient was divided by N twice")
        return mistake(MISTAKES, "divided twice", f"every rank's .grad is the mean / {n} (N): {why}")
    return None


def value_failure(seen_by_rank: list, b: int, hook) -> str | None:
    """Where the .grads of backward b leave the contract: the first element beyond the bound, or two ranks
    whose .grads differ."""
    first = seen_by_rank[0]
    numels = first["numels"]
    offsets = [sum(numels[:j]) for j in range(len(numels))]
    for rank, seen in enumerate(seen_by_rank):
        step = seen["steps"][b]
        everyone = step["everyone"]
        n = len(everyone)
        for j, (name, grad) in enumerate(zip(seen["names"], step["grads"])):
            if not step["used"][j]:
                continue  # no rank used it: .grad stays as it was, as in native DDP
            xs = everyone[:, offsets[j]:offsets[j] + numels[j]]
            want = xs.sum(0) / n
            if grad is None or grad.shape != want.shape:
                return f"rank {rank}, backward {b + 1}: {name}.grad is {None if grad is None else tuple(grad.shape)}," \
                       f" want the mean over the ranks, {numels[j]} elements"
            bound = allowed(xs)
            off = ((grad - want).abs() > bound) | grad.isnan()
            if off.any():
                e = off.nonzero()[0].item()
                said = (f"rank {rank}, backward {b + 1}: {name} element {e}: got {grad[e].item():.17g}, want the mean "
                        f"over the {n} ranks {want[e].item():.17g} ± {bound[e].item():.2g} (a mean of N fp64 terms, "
                        f"divided before or after the sum: |err| <= gamma_(N+1) * sum|g_i| / N)")
                found = value_mistake(grad, want, bound, n, hook)
                return said + (f"\n{found}" if found else "")
    for rank, seen in enumerate(seen_by_rank[1:], 1):
        for name, ours, theirs in zip(first["names"], seen["steps"][b]["grads"], first["steps"][b]["grads"]):
            if ours is not None and theirs is not None and not torch.equal(ours, theirs):
                e = (ours != theirs).nonzero()[0].item()
                return (f"backward {b + 1}: rank {rank} and rank 0 differ at {name} element {e}: "
                        f"{ours[e].item():.17g} vs {theirs[e].item():.17g}: every rank must end with the same bits "
                        f"(the all-reduce hands every rank the same bucket)")
    return None


def judged(seen_by_rank: list, hook=None, timing: bool = False, values: bool = True) -> str | None:
    """The first way the watched backwards leave the contract, in words; None when they keep it."""
    for b in range(max(len(seen["steps"]) for seen in seen_by_rank)):
        for rank, seen in enumerate(seen_by_rank):
            if b >= len(seen["steps"]):
                continue
            step = seen["steps"][b]
            found = launch_mistake(seen, step, timing) or no_zeros(seen, step)
            if found:
                return f"rank {rank}, backward {b + 1}: {found}"
            if step["error"]:
                return f"rank {rank}, backward {b + 1}: backward raised {step['error']}"
        if values:
            found = value_failure(seen_by_rank, b, hook)
            if found:
                return found
    return None
