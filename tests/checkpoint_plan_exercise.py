"""The planner's judge (checkpoint_plan.plan): what a wanted box must read (every saved box it shares an element
with, and no other) and where each read goes, and the classic mistakes, recognised by running the learner's plan
on a small grid chosen to tell them apart.

The probe: a [4, 6] tensor saved as four boxes (rows [0, 2) and [2, 4) by columns [0, 3) and [3, 6)). Box A at
(1, 1) of [2, 3] shares elements with all four, each at another offset, so an index taken in the tensor's
coordinates, or the two indices swapped, shows; box B at (2, 0) of [2, 3] is saved box (2, 0) exactly and only
touches the other three (along a row, a column or a corner), so a read of a box that merely touches it, or that
shares its rows but not its columns, shows.
"""
from math import prod

import torch

from grading import mistake
from harness import device
from mini_dist import checkpoint_plan  # looked up at call time: in a check, the learner's copy
from mini_dist.checkpoint_plan import Sharded
from mini_dist.manifest import overlap

# each is made by a wrong solution of tests/bank_checkpoint_plan.py (tests/test_exercise.py holds that)
MISTAKES = {
    "index in the tensor's coordinates": ("plan", "the index into the saved box counts from that box's first "
                                          "element, the destination from the wanted box's: shift the shared box "
                                          "by each box's own offsets (within(box_offsets, lo, lengths))"),
    "the two indices swapped": ("plan", "the first index selects from the saved box (shift by the piece's "
                                "offsets), the destination is a view of the wanted box's data (shift by offsets)"),
    "destination a copy": ("plan", "copying into the destination must fill the wanted box: index data (a view), "
                           "never .clone() or torch.tensor(...) it"),
    "touching boxes read": ("plan", "two boxes that meet at an edge share no element: they overlap only where "
                            "each dim's ranges overlap by at least one index (lo < hi), so read neither"),
    "overlap on dim 0 only": ("plan", "boxes overlap only where they overlap along every dim: a saved box of the "
                              "same rows but other columns holds nothing the wanted box needs"),
    "partly held box not refused": ("plan", "count the elements the saved boxes hold of the wanted box; fewer than "
                                    "data.numel(): raise ValueError saying the box is not all in the checkpoint"),
}

CONTRACT = ("plan returns, for each box a rank wants, one (saved piece, index into the saved box, destination) for "
            "each saved piece sharing at least one element with it, and for no other: the saved box's elements at "
            "index (counted from its first) are the ones the destination, a view of the box's data, must hold; a "
            "box the pieces do not hold all of is refused: ValueError '... the box at [offsets] of [lengths] is "
            "not all in the checkpoint'")

WHOLE = torch.arange(24, dtype=torch.float64).view(4, 6)  # cpu: a probe's values, each its own position
SAVED = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
BOX_A = ((1, 1), (2, 3))
BOX_B = ((2, 0), (2, 3))


def at(offsets, lengths) -> tuple:
    """The box (offsets, lengths) as an index into its tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


def manifest_of(whole: torch.Tensor, boxes: list) -> dict:
    """The part of a manifest the planner reads, each non-empty piece keeping its data beside it (no file)."""
    pieces = [{"name": "w", "offsets": list(o), "lengths": list(n), "data": whole[at(o, n)]}
              for o, n in boxes if prod(n) > 0]  # as checkpoint.save: an empty box writes no piece
    name = str(whole.dtype).removeprefix("torch.")
    return {"tensors": {"w": [list(whole.shape), name]}, "objects": {"step": "7"}, "pieces": pieces}


def planned(manifest: dict, offsets, data: torch.Tensor) -> list:
    """The learner's reads for one wanted box of "w" (and a literal beside it)."""
    shape = tuple(manifest["tensors"]["w"][0])
    return checkpoint_plan.plan(manifest, {"w": Sharded(shape, data.dtype, ((tuple(offsets), data),)), "step": None})


def bounds(index) -> list | None:
    """[(start, stop)] of an index made of slices with steps of 1, else None (another kind: not compared)."""
    if not isinstance(index, tuple) or not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
        return None
    return [(s.start, s.stop) for s in index]


def placed(destination: torch.Tensor, data: torch.Tensor) -> list | None:
    """Where in data a view of it starts (per dim), or None when it is not a view of data."""
    if not isinstance(destination, torch.Tensor) or destination.numel() == 0:
        return None
    if destination.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        return None
    rest = destination.storage_offset() - data.storage_offset()
    where = []
    for stride in data.stride():
        where.append(rest // stride)
        rest %= stride
    return where


def extra_reads(manifest: dict, offsets, lengths, reads) -> str | None:
    """The mistake behind reading saved boxes that share no element with the wanted one, or None."""
    extra = [p for p, _, _ in reads if not overlap(offsets, lengths, p["offsets"], p["lengths"])]
    if not extra:
        return None
    many = len(extra) > 1
    said = (f"the box at {list(offsets)} of {list(lengths)} of a [4, 6] tensor saved as {SAVED} read saved box"
            f"{'es' if many else ''} at {[p['offsets'] for p in extra]}, which share{'' if many else 's'} no "
            f"element with it")
    rows = [p for p in extra if overlap(offsets[:1], lengths[:1], p["offsets"][:1], p["lengths"][:1])]
    if len(rows) == len(extra):
        return mistake(MISTAKES, "overlap on dim 0 only", f"{said}: the same rows, other columns")
    return mistake(MISTAKES, "touching boxes read", f"{said}: they only meet it at an edge or a corner")


def index_mistake(offsets, lengths, reads, data) -> str | None:
    """The mistake behind a read whose index or destination is wrong, or None."""
    for piece, index, destination in reads:
        shared = overlap(offsets, lengths, piece["offsets"], piece["lengths"])
        if shared is None:
            continue
        lo, size = shared
        said = (f"the box at {list(offsets)} of {list(lengths)} and the saved box at {piece['offsets']} share "
                f"the box at {lo} of {size}")
        where = placed(destination, data)
        if where is None and isinstance(destination, torch.Tensor) and destination.numel():
            return mistake(MISTAKES, "destination a copy", f"{said}: your destination is not a view of the wanted "
                           f"box's data, so copying into it leaves the box as it was")
        got = bounds(index)
        right = [(a - o, a - o + n) for a, o, n in zip(lo, piece["offsets"], size)]
        right_where = [a - o for a, o in zip(lo, offsets)]
        if got is None or got == right and where == right_where:
            continue
        swapped = got == [(a - o, a - o + n) for a, o, n in zip(lo, offsets, size)]
        if swapped and where == [a - o for a, o in zip(lo, piece["offsets"])]:
            return mistake(MISTAKES, "the two indices swapped", f"{said}: your index into the saved box is {got}, "
                           f"the shared box counted from the wanted box's first element, and the destination "
                           f"starts at {where} of the wanted box, counted from the saved box's")
        if got != right and got == [(a, a + n) for a, n in zip(lo, size)]:
            return mistake(MISTAKES, "index in the tensor's coordinates", f"{said}: your index into the saved box "
                           f"is {got}, the tensor's own coordinates; counted from the saved box's first element it "
                           f"is {right}")
        if where != right_where and where == list(lo):
            return mistake(MISTAKES, "index in the tensor's coordinates", f"{said}: your destination starts at "
                           f"{where} of the wanted box, the tensor's own coordinates; counted from the box's first "
                           f"element it is {right_where}")
    return None


def plan_mistake() -> str | None:
    """The classic mistake the learner's plan makes, in words, or None (probed on the [4, 6] grid)."""
    manifest = manifest_of(WHOLE.to(device()), SAVED)
    for offsets, lengths in (BOX_B, BOX_A):
        data = torch.zeros(lengths, dtype=torch.float64, device=device())
        try:
            reads = planned(manifest, offsets, data)
        except Exception:
            continue  # this probe says nothing; the property's own message says what was raised
        found = extra_reads(manifest, offsets, lengths, reads) or index_mistake(offsets, lengths, reads, data)
        if found:
            return found
    lost = manifest_of(WHOLE.to(device()), SAVED[:-1])
    try:
        reads = planned(lost, BOX_A[0], torch.zeros(BOX_A[1], dtype=torch.float64, device=device()))
    except Exception:
        return None  # refused (a ValueError whose words the property judges), or raised: no mistake to name here
    return mistake(MISTAKES, "partly held box not refused", f"the box at {list(BOX_A[0])} of {list(BOX_A[1])}, with "
                   f"the saved box at {list(SAVED[-1][0])} lost, was planned as {len(reads)} reads holding "
                   f"{sum(destination_numel(r) for r in reads)} of its {prod(BOX_A[1])} elements, not refused")


def destination_numel(read) -> int:
    try:
        return read[2].numel()
    except (AttributeError, IndexError, TypeError):
        return 0


def filled(manifest: dict, offsets, data: torch.Tensor) -> tuple[list, str | None]:
    """The learner's reads for a wanted box, each copied into place as checkpoint.load does: (reads, what went
    wrong, in words, with the mistake behind it where one is recognised, or None)."""
    try:
        reads = planned(manifest, offsets, data)
    except NotImplementedError as e:
        return [], f"plan raised NotImplementedError: {e}"  # a blank: its own words are the contract
    except Exception as e:
        return [], f"plan raised {type(e).__name__}: {e}\n{plan_mistake() or CONTRACT}"
    for k, read in enumerate(reads):
        try:
            piece, index, destination = read
            destination.copy_(piece["data"][index])
        except Exception as e:
            return reads, (f"read {k} of the box at {list(offsets)} of {list(data.shape)}, {read!r:.300}, cannot be "
                           f"copied as checkpoint.load does (destination.copy_(piece's data[index])): "
                           f"{type(e).__name__}: {e}\n{plan_mistake() or CONTRACT}")
    return reads, None
