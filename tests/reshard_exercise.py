"""The resharding exercise's judge: flat_boxes (the boxes of a flat range) and dim_shard (the boxes of a
tensor-parallel slice), each judged by what its boxes hold, and the classic mistakes, recognised from the boxes
the learner's code returned on small probes.

A box (offsets, lengths) of a row-major tensor is contiguous when its lengths are 1 up to some dim k, anything
at k, and whole after k: then it holds the flat elements [flat(offsets), flat(offsets) + prod(lengths)). The
boxes of [a, b) must hold, in order, exactly those elements; the fewest such boxes number at most 2·ndim - 1
(a partial box per dim on each side, one in the middle), and a tensor of any shape can be cut that way.
"""
from math import prod

import torch

from grading import mistake
from harness import device
from mini_dist import reshard  # looked up at call time: in a check, the learner's copy

# each is made by a wrong solution of tests/bank_reshard.py (tests/test_exercise.py holds that)
MISTAKES = {
    "box end off by one": ("flat_boxes", "a box holds one row (or element) too many or too few at its end: the "
                           "range is [a, b), b itself not in it, and the whole rows between are those that start "
                           "at or after a and end at or before b"),
    "partial first row taken whole": ("flat_boxes", "when a is not at the start of a row, that row's elements "
                                      "before a are not in the range: its part from a on is boxes of its own, "
                                      "the whole rows begin at the next row"),
    "a range within one row": ("flat_boxes", "when a and b fall in the same row there are no whole rows and no "
                               "separate first and last row: the range is that one row's elements [a, b), cut "
                               "one dim down"),
    "partial row not cut one dim down": ("flat_boxes", "every box has one offset and one length per dim of the "
                                         "tensor: a partial row of a 3-dim tensor is itself whole and partial "
                                         "rows of the dim below, boxes of the same kind one dim down"),
    "whole rows one box per row": ("flat_boxes", "the whole rows between the first and last partial ones are one "
                                   "box (offsets (i, 0, ...), lengths (j - i, *shape[1:])): at most 2·ndim - 1 "
                                   "boxes in all"),
    "the rank's rows as one block": ("dim_shard", "local stacks this rank's slice of each part ([q_r; k_r; v_r]): "
                                     "each part's slice sits in its own part of the global tensor, one box per "
                                     "part"),
    "box data a copy": ("dim_shard", "a box's data must be a view of local (narrow, chunk, slicing), so that "
                        "loading into the boxes fills local"),
    "global shape not the whole tensor's": ("dim_shard", "Sharded's shape is the global tensor's: local's shape "
                                            "with dim `count` times as long"),
}

FLAT_CONTRACT = ("flat_boxes(shape, a, b): boxes (offsets, lengths), one offset and length per dim, inside the "
                 "tensor, each contiguous in row-major order, together holding the elements [a, b) in order, each "
                 "once; at most 2·ndim - 1 of them hold elements (1 for a 0-dim tensor)")
DIM_CONTRACT = ("dim_shard(local, dim, index, count, parts): Sharded of the global shape (dim `count` times "
                "local's), local's dtype, and boxes that are views of local holding exactly its elements, each "
                "where it sits in the global tensor: part j's slice `index` of `count`")


def flat(shape, offsets) -> int:
    return sum(o * prod(shape[d + 1:]) for d, o in enumerate(offsets))


def contiguous(shape, lengths) -> bool:
    k = next((d for d, n in enumerate(lengths) if n != 1), len(lengths) - 1)
    return all(lengths[d] == shape[d] for d in range(k + 1, len(shape)))


def flat_problem(shape, a: int, b: int, boxes, bounded: bool = True) -> str | None:
    """What is wrong with `boxes` as flat_boxes(shape, a, b), in words (where they first go wrong), or None.
    bounded=False: however many boxes hold elements."""
    shape = tuple(shape)
    said = f"flat_boxes({shape}, {a}, {b}) returned {boxes!r:.400}"
    try:
        boxes = [(tuple(o), tuple(n)) for o, n in boxes]
    except (TypeError, ValueError):
        return f"{said}: not a list of (offsets, lengths)"
    at = a  # the next element the boxes must hold
    held = 0
    for k, (o, n) in enumerate(boxes):
        if len(o) != len(shape) or len(n) != len(shape):
            return f"{said}: box {k} {(o, n)} has {len(o)} offsets and {len(n)} lengths for a {len(shape)}-dim tensor"
        if not all(0 <= x and 0 <= m and x + m <= s for x, m, s in zip(o, n, shape)):
            return f"{said}: box {k} {(o, n)} is not inside the tensor"
        if prod(n) == 0:
            continue
        if not contiguous(shape, n):
            return f"{said}: box {k} {(o, n)} is not contiguous in row-major order"
        start = flat(shape, o)
        if start != at:
            return (f"{said}: box {k} {(o, n)} holds elements [{start}, {start + prod(n)}), but the next element "
                    f"of the range is {at}" + (" (the range is empty)" if a == b else ""))
        at = start + prod(n)
        held += 1
    if at != b:
        return f"{said}: the boxes end at element {at}, the range at {b}"
    most = max(1, 2 * len(shape) - 1)
    if bounded and held > most:
        return f"{said}: {held} boxes hold elements; a range of a {len(shape)}-dim tensor takes at most {most}"
    return None


def learners_boxes(shape, a, b):
    """The learner's flat_boxes(shape, a, b), or the error it raised, in words."""
    try:
        return list(reshard.flat_boxes(tuple(shape), a, b)), None
    except NotImplementedError:
        raise  # a blank: its own words are the contract
    except Exception as e:
        return None, f"flat_boxes({tuple(shape)}, {a}, {b}) raised {type(e).__name__}: {e}"


def shrunk_or_grown(shape, a, b, boxes) -> str | None:
    """The box which, one row (or element) shorter or longer at its end, makes the boxes right, in words."""
    for k, (o, n) in enumerate(boxes):
        if len(n) != len(shape) or not prod(n):
            continue
        d = next((d for d, m in enumerate(n) if m != 1), len(n) - 1)
        for step, what in ((-1, "too many"), (1, "too few")):
            fixed = list(boxes)
            fixed[k] = (o, tuple(m + step if e == d else m for e, m in enumerate(n)))
            if flat_problem(shape, a, b, fixed) is None:
                return f"box {k} {(tuple(o), tuple(n))} holds one {'row' if d < len(n) - 1 else 'element'} {what}"
    return None


PROBES = [((3, 4, 5), 27, 48), ((4, 6), 3, 22), ((5, 4), 4, 16), ((3, 4), 5, 7), ((2, 3, 4), 5, 7),
          ((6, 2), 2, 12)]


def flat_mistake() -> str | None:
    """The classic mistake the learner's flat_boxes makes, in words, or None."""
    wrong = []
    for shape, a, b in PROBES:
        boxes, error = learners_boxes(shape, a, b)
        if error is None and flat_problem(shape, a, b, boxes):
            wrong.append((shape, a, b, boxes))
    if not wrong:
        return None
    for shape, a, b, boxes in wrong:
        said = f"flat_boxes({shape}, {a}, {b}) returned {boxes}"
        if any(len(o) != len(shape) or len(n) != len(shape) for o, n in boxes):
            return mistake(MISTAKES, "partial row not cut one dim down", f"{said}: a box without one offset and "
                           f"one length per dim")
        rows = [(o, n) for o, n in boxes if prod(n) and tuple(n) == (1, *shape[1:])]
        if len(rows) > 1 and flat_problem(shape, a, b, boxes, bounded=False) is None:
            return mistake(MISTAKES, "whole rows one box per row", f"{said}: {len(rows)} boxes of one whole row "
                           f"each")
        off = shrunk_or_grown(shape, a, b, boxes)
        if off:
            return mistake(MISTAKES, "box end off by one", f"{said}: {off}")
        row = prod(shape[1:])
        if a % row and flat_problem(shape, a - a % row, b, boxes) is None:
            return mistake(MISTAKES, "partial first row taken whole", f"{said}: they hold [{a - a % row}, {b}), "
                           f"the whole of row {a // row}")
    one_row = [(shape, a, b) for shape, a, b, _ in wrong if a // prod(shape[1:]) == (b - 1) // prod(shape[1:])]
    if one_row and len(one_row) == len(wrong):
        shape, a, b = one_row[0]
        return mistake(MISTAKES, "a range within one row", f"a range inside row {a // prod(shape[1:])}: "
                       f"{flat_problem(shape, a, b, learners_boxes(shape, a, b)[0])}")
    return None


# ----- dim_shard

def stacked(global_shape, dim: int, index: int, count: int, parts: int) -> torch.Tensor:
    """What rank `index` of `count` holds of a global tensor of `global_shape` whose element values are their
    flat positions: slice `index` of each of the `parts` parts along dim, stacked in part order."""
    whole = torch.arange(prod(global_shape), dtype=torch.float64, device=device()).view(global_shape)
    per = global_shape[dim] // parts // count
    return torch.cat([whole.narrow(dim, (j * count + index) * per, per) for j in range(parts)], dim)


def dim_problem(local, dim, index, count, parts, sharded) -> str | None:
    """What is wrong with the learner's dim_shard(local, ...) on values that are their flat positions, or None."""
    said = f"dim_shard(local of {list(local.shape)}, dim={dim}, index={index}, count={count}, parts={parts})"
    want = list(local.shape)
    want[dim] *= count
    shape = getattr(sharded, "shape", None)
    if shape is None or list(shape) != want:
        return f"{said}: global shape {shape}, want {want} (local's with dim {dim} x {count})"
    if getattr(sharded, "dtype", None) != local.dtype:
        return f"{said}: dtype {getattr(sharded, 'dtype', None)}, want local's {local.dtype}"
    whole = torch.arange(prod(want), dtype=torch.float64, device=device()).view(want)
    base = local.untyped_storage().data_ptr()
    for k, (offsets, data) in enumerate(sharded.boxes):
        if len(offsets) != local.dim() or not all(0 <= o and o + n <= s for o, n, s in
                                                    zip(offsets, data.shape, want)):
            return f"{said}: box {k} at {list(offsets)} of {list(data.shape)} is not inside the global {want}"
        if data.numel() == 0:
            continue
        if data.untyped_storage().data_ptr() != base:
            return (f"{said}: box {k} at {list(offsets)} is not a view of local: loading into it leaves local as it "
                    f"was")
        expected = whole[tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))]
        if not torch.equal(data, expected):
            first = tuple((data != expected).nonzero()[0].tolist())
            return (f"{said}: box {k} at {list(offsets)} of {list(data.shape)} holds, at global "
                    f"{[o + f for o, f in zip(offsets, first)]}, the element of global position "
                    f"{int(data[first].item())}, not {int(expected[first].item())}")
    held = torch.cat([d.reshape(-1) for _, d in sharded.boxes] + [local.new_zeros(0)]).sort().values
    if not torch.equal(held, local.reshape(-1).sort().values):
        return (f"{said}: the boxes hold {held.numel()} elements, local {local.numel()}: together they must hold "
                f"each of local's elements once")
    return None


def dim_mistake() -> str | None:
    """The classic mistake the learner's dim_shard makes, in words, or None (probed on q, k, v parts)."""
    dim = 0
    index = 1
    count = 3
    parts = 2
    local = stacked((12, 2), dim, index, count, parts)
    try:
        sharded = reshard.dim_shard(local, dim, index, count, parts)
        if not dim_problem(local, dim, index, count, parts, sharded):
            return None
        said = f"dim_shard(local of {list(local.shape)}, dim=0, index=1, count=3, parts=2)"
        if list(sharded.shape) != [12, 2]:
            return mistake(MISTAKES, "global shape not the whole tensor's", f"{said}: shape {list(sharded.shape)}, "
                           f"the global tensor's is [12, 2]")
        starts = sorted(o[0] for o, d in sharded.boxes if d.numel())
        if any(d.numel() and d.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
               for _, d in sharded.boxes):
            return mistake(MISTAKES, "box data a copy", f"{said}: a box's data is not a view of local")
        if starts in ([4], [4, 6]):
            return mistake(MISTAKES, "the rank's rows as one block", f"{said}: boxes start at global rows {starts}; "
                           f"rank 1 of 3 holds rows 2-3 of part 0 (global rows 0-5) and rows 2-3 of part 1 "
                           f"(global rows 6-11), at global rows [2, 8]")
    except Exception:
        return None  # the property's own message says what was raised
    return None
