"""FSDP's hooks around a unit, the learner's exercise (_pre_forward, _post_forward, _pre_backward): what one step
must do to each unit, and the classic mistakes, recognised from what the learner's hooks did.

The contract. Each unit's module computes its forward on the whole parameters (gathered, the views attached);
after its forward the module holds this rank's slices again, and the unit is freed when resharding and when no
backward can come (a forward without grad); before its backward _pre_backward runs and the unit is whole again
(gathered, the views attached), in the order the backward runs, the reverse of the order the units finished
forward. Whether the values are right is judged against fully_shard by the other properties.

What the hooks did is watched, not guessed: a forward pre-hook on each unit's module, registered after FSDP's
(so it runs after _pre_forward), notes what the module is about to compute with; _pre_backward, wrapped on the
instance, notes when it ran and what it left; the unit's ledger says what was gathered, when, and freed.
"""
from functools import partial

import torch

from grading import mistake
from harness import device, rank_generator
from mini_dist import fsdp
from mini_dist.kit import models
from reducer_exercise import where_raised

F64 = torch.float64

# each is made by a wrong solution of tests/bank_fsdp.py (tests/test_exercise.py holds that)
MISTAKES = {
    "forward without the gather": ("FullyShardedDataParallel._pre_forward", "the unit's whole vector must be "
                                   "gathered before the module computes: self._before_compute(unit, phase, order) "
                                   "gathers it (and prefetches the next unit in order)"),
    "views not attached": ("FullyShardedDataParallel._pre_forward", "between computations the module holds 1-D "
                           "slices; unit.attach_views() makes each attribute its view of the gathered vector, in "
                           "the parameter's shape"),
    "not freed after forward": ("FullyShardedDataParallel._post_forward", "with reshard_after_forward, free the "
                                "unit once its forward is done (self._free(unit, 'forward')): its backward gathers "
                                "it again, and only one unit at a time is whole"),
    "kept after a forward without grad": ("FullyShardedDataParallel._post_forward", "free the unit also when no "
                                          "backward can come (torch.is_grad_enabled() is False: evaluation), "
                                          "whatever reshard_after_forward says: nothing will free it later"),
    "backward never announced": ("FullyShardedDataParallel._post_forward", "autograd must call _pre_backward(unit) "
                                 "before the unit's backward: hook the unit's outputs that require grad "
                                 "(torch.autograd.graph.register_multi_grad_hook, or a hook on each output)"),
    "backward without the second gather": ("FullyShardedDataParallel._pre_backward", "backward needs the weights "
                                           "(dL/dx = dL/dy W) that forward freed: gather the unit again "
                                           "(self._before_compute(unit, 'backward', order)) and attach its views"),
    "backward in forward order": ("FullyShardedDataParallel._pre_backward", "backward runs the units in the "
                                  "reverse of the order they finished forward (self._finished, reversed): "
                                  "prefetching in forward order gathers a unit whose backward is already done"),
}


def whole(unit) -> bool:
    """The unit's module attributes are views of the gathered vector, in their shapes."""
    return unit.gathered and all(getattr(m, a).shape == unit.shapes[i] and getattr(m, a) is not unit.params[i]
                                 for m, a, i in unit.slots)


def slices(unit) -> bool:
    """The unit's module holds this rank's slices, as registered parameters."""
    return all(m._parameters.get(a) is unit.params[i] for m, a, i in unit.slots)


def probe(width: int, hidden: int, depth: int, reshard: bool, prefetch: bool, seed: int) -> dict:
    """On a rank: one step of a Linear -> Blocks -> Linear stack (a unit per Block, the root's Linears), then a
    forward without grad, the learner's hooks watched."""
    ours = fsdp.FullyShardedDataParallel(models.block_stack(width, hidden, depth, F64, device()), wrap=models.Block,
                                         reshard_after_forward=reshard, prefetch=prefetch)
    computed = []  # (unit, gathered, views attached) as each unit's module starts its forward
    announced = []  # (unit, gathered and views attached after _pre_backward)

    def about_to_compute(unit, module, args):
        """Runs after _pre_forward: what the module is about to compute with."""
        computed.append((unit.name, unit.gathered, whole(unit)))
    for unit in ours.units:
        module = ours.module if unit.name == "root" else ours.module.get_submodule(unit.name)
        module.register_forward_pre_hook(partial(about_to_compute, unit))
    real = ours._pre_backward

    def pre_backward(unit):
        """_pre_backward, watched: that it ran, and what it left (or left when it raised)."""
        entry = [unit.name, False]
        announced.append(entry)
        try:
            return real(unit)
        finally:
            entry[1] = whole(unit)
    ours._pre_backward = pre_backward
    g = rank_generator(seed)
    x = torch.randn(2, width, generator=g, dtype=F64).to(device())
    y = torch.randn(2, width, generator=g, dtype=F64).to(device())
    seen = {"units": [u.name for u in ours.units], "reshard": reshard, "prefetch": prefetch, "error": None,
            "after_forward": None, "eval": None}
    ours.ledger.reset()
    phase = "forward"
    try:
        out = ours(x)
        seen["after_forward"] = [(u.name, u.gathered, slices(u)) for u in ours.units]
        phase = "backward"
        ((out - y) ** 2).mean().backward()
    except Exception as e:  # judged beside what the hooks did
        said = str(e).splitlines()[0] if str(e) else ""
        blank = isinstance(e, NotImplementedError) and said.startswith("fsdp: write ")  # it says where
        seen["error"] = f"{phase}: {type(e).__name__}: {said}{'' if blank else where_raised(e, 'fsdp.py')}"
    seen.update(computed=computed[:], announced=announced[:], events=[e[:3] for e in ours.ledger.events])
    if seen["error"] is None:
        ours.ledger.reset()
        with torch.no_grad():
            ours(x)
        seen["eval"] = ([u.name for u in ours.units if u.gathered], ours.ledger.count("all-gather"))
    return seen


def forward_mistake(seen: dict) -> str | None:
    gathers = [u for phase, u, what in seen["events"] if phase == "forward" and what == "all-gather"]
    if (seen["error"] or "").startswith("forward") and not gathers:
        return (f"unit {seen['units'][0]!r} computes its forward on its whole parameters\n" +
                mistake(MISTAKES, "forward without the gather", f"forward raised with no unit gathered: "
                        f"{seen['error']}"))
    for name, gathered, attached in seen["computed"]:
        clause = f"unit {name!r} computes its forward on its whole parameters"
        if not gathered:
            return clause + "\n" + mistake(MISTAKES, "forward without the gather", f"unit {name!r} began its "
                                           f"forward with nothing gathered (its full vector has no storage)")
        if not attached:
            return clause + "\n" + mistake(MISTAKES, "views not attached", f"unit {name!r} was gathered, but its "
                                           f"module began its forward holding this rank's 1-D slices")
    return None


def after_forward_mistake(seen: dict) -> str | None:
    for name, gathered, held in seen["after_forward"] or []:
        if gathered and seen["reshard"]:
            return (f"with reshard_after_forward, each unit is freed once its forward is done\n" +
                    mistake(MISTAKES, "not freed after forward", f"after forward, unit {name!r} was still "
                            f"gathered"))
        if not held:
            return (f"after its forward a unit's module holds this rank's slices again (unit.attach_shards()); "
                    f"unit {name!r}'s module still held the gathered views")
    return None


def backward_mistake(seen: dict) -> str | None:
    events = seen["events"]
    scattered = [u for phase, u, what in events if what == "reduce-scatter"]
    announced = [u for u, _ in seen["announced"]]
    clause = "_pre_backward(unit) runs before each unit's backward, and leaves the unit whole"
    if not announced and (scattered or (seen["error"] or "").startswith("backward")):
        return clause + "\n" + mistake(MISTAKES, "backward never announced", "backward began and _pre_backward "
                                       "never ran for any unit")
    for name, left_whole in seen["announced"]:
        if not left_whole:
            return clause + "\n" + mistake(MISTAKES, "backward without the second gather", f"after "
                                           f"_pre_backward({name!r}) the unit was not whole again"
                                           + (" (freed after forward)" if seen["reshard"] else ""))
    done = set()
    for phase, unit, what in events:
        if phase != "backward":
            continue
        if what == "all-gather" and unit in done:
            return ("in backward a unit is gathered before its own backward, never after it\n" +
                    mistake(MISTAKES, "backward in forward order", f"unit {unit!r} was gathered again in backward "
                            f"after its gradient was reduce-scattered (its backward was done)"))
        if what == "reduce-scatter":
            done.add(unit)
    return None


def eval_mistake(seen: dict) -> str | None:
    if seen["eval"] is None:
        return None
    kept, gathers = seen["eval"]
    clause = "a forward without grad gathers each unit once and leaves none gathered"
    if kept:
        return clause + "\n" + mistake(MISTAKES, "kept after a forward without grad", f"after a forward under "
                                       f"torch.no_grad() with reshard_after_forward={seen['reshard']}, "
                                       f"{', '.join(map(repr, kept))} stayed gathered")
    if gathers != len(seen["units"]):
        return f"{clause}; it made {gathers} all-gathers for {len(seen['units'])} units"
    return None


def judged(seen_by_rank: list) -> str | None:
    """The first way a rank's step leaves the contract, in words; None when it keeps it."""
    for rank, seen in enumerate(seen_by_rank):
        if "NotImplementedError: fsdp: write " in (seen["error"] or ""):  # a blank: its own words say what to do
            return f"rank {rank}: {seen['error'].split(': ', 1)[1]}"
    for rank, seen in enumerate(seen_by_rank):
        flags = f"reshard_after_forward={seen['reshard']}, prefetch={seen['prefetch']}"
        found = (forward_mistake(seen) or after_forward_mistake(seen) or backward_mistake(seen)
                 or (f"the step raised in {seen['error']}" if seen["error"] else None) or eval_mistake(seen))
        if found:
            return f"rank {rank} ({flags}): {found}"
    return None
