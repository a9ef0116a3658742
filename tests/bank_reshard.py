"""Resharding's boxes: the exercise's bank (kit/exercise.py); MISTAKES: tests/reshard_exercise.py."""
from mini_dist.kit.exercise import planted

HINTS = {
    "flat_boxes": [
        "See the tensor as rows along dim 0, each row a tensor of shape[1:]. The rows [a, b) covers whole (they "
        "start at or after a and end at or before b) are one box; what is left is a piece of one row at each end.",
        "With n = prod(shape[1:]) elements per row, the whole rows are [ceil(a/n), b // n). The piece of a row "
        "before them, and the one after, are each a flat range of a tensor of shape[1:]: the same question one dim "
        "down (call flat_boxes on shape[1:]); prefix each box's offsets with the row and its lengths with 1.",
        "Three cases to get right: a >= b gives []; shape == () gives [((), ())]; and when a and b fall in one row "
        "(ceil(a/n) > b // n) there are no whole rows, only that row's [a - r*n, b - r*n) one dim down, r = a // n.",
    ],
    "dim_shard": [
        "Draw the global tensor along dim: part 0's count slices, then part 1's, and so on. Where does slice "
        "`index` of part j start, counted along dim? And where are part j's rows in local?",
        "With m = local.shape[dim] // parts (this rank's rows of one part), each part is count * m rows along dim: "
        "part j's slice `index` starts at (j*count + index)*m; in local it is local.narrow(dim, j*m, m), a view.",
        "The global shape is local's with dim multiplied by count; one box per part, its offsets 0 on every dim but "
        "dim: Sharded(tuple(shape), local.dtype, tuple(boxes)).",
    ],
}

FLAT = """
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    n = prod(shape[1:])
    i = -(-a // n)
    j = b // n
    if i > j:
        return [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - j * n, b - j * n)]
    head = [((i - 1, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - (i - 1) * n, n)]
    {body}
    return head + body + [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], 0, b - j * n)]
"""
WHOLE_ROWS = "body = [((i, *[0] * (len(shape) - 1)), (j - i, *shape[1:]))] if j > i else []"


def flat(body: str = WHOLE_ROWS, first_row: str = "i = -(-a // n)", one_row: bool = True) -> str:
    """The reference's flat_boxes with its whole rows, its first whole row or its one-row case written otherwise."""
    code = FLAT.replace("{body}", body).replace("i = -(-a // n)", first_row)
    if not one_row:
        code = code.replace("    if i > j:\n        return [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], "
                            "a - j * n, b - j * n)]\n", "")
    return code


DIM = """
    m = local.shape[dim] // parts
    shape = list(local.shape)
    {shape}
    boxes = []
    for j in range(parts):
        offsets = [0] * local.dim()
        offsets[dim] = {start}
        boxes.append((tuple(offsets), {view}))
    return Sharded(tuple(shape), local.dtype, tuple(boxes))
"""


def dim(shape="shape[dim] *= count", start="(j * count + index) * m", view="local.narrow(dim, j * m, m)") -> str:
    """The reference's dim_shard with its global shape, a box's start or its data written otherwise."""
    return DIM.replace("{shape}", shape).replace("{start}", start).replace("{view}", view)


RIGHT = {
    "the largest contiguous box from where the range goes on, until b; parts as split() views": {
        "flat_boxes": """
            if a >= b:
                return []
            if not shape:
                return [((), ())]
            strides = [prod(shape[d + 1:]) for d in range(len(shape))]
            boxes = []
            while a < b:  # the outermost dim whose whole step starts at a and ends by b
                d = next(d for d in range(len(shape)) if a % strides[d] == 0 and a + strides[d] <= b)
                offsets = tuple(a // strides[k] % shape[k] for k in range(len(shape)))
                count = min(shape[d] - offsets[d], (b - a) // strides[d])
                boxes.append((offsets, (1,) * d + (count,) + tuple(shape[d + 1:])))
                a += count * strides[d]
            return boxes
        """,
        "dim_shard": """
            rows = local.shape[dim] // parts
            shape = tuple(n * count if d == dim else n for d, n in enumerate(local.shape))
            boxes = []
            for j, piece in enumerate(local.split(rows, dim)):
                start = j * rows * count + index * rows
                boxes.append((tuple(start if d == dim else 0 for d in range(local.dim())), piece))
            return Sharded(shape, local.dtype, tuple(boxes))
        """,
    },
    "the rows by divmod, a partial row only where there is one; parts as chunk() views": {
        "flat_boxes": """
            if a >= b:
                return []
            if not shape:
                return [((), ())]
            row = prod(shape[1:])
            first, skip = divmod(a, row)
            last, rest = divmod(b, row)
            if first == last:
                return [((first, *o), (1, *n)) for o, n in flat_boxes(shape[1:], skip, rest)]
            boxes = []
            if skip:
                boxes += [((first, *o), (1, *n)) for o, n in flat_boxes(shape[1:], skip, row)]
                first += 1
            if last > first:
                boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
            return boxes + [((last, *o), (1, *n)) for o, n in flat_boxes(shape[1:], 0, rest)]
        """,
        "dim_shard": """
            m = local.shape[dim] // parts
            shape = list(local.shape)
            shape[dim] = m * parts * count
            boxes = tuple((tuple((j * count + index) * m if d == dim else 0 for d in range(local.dim())), part)
                          for j, part in enumerate(local.chunk(parts, dim)))
            return Sharded(tuple(shape), local.dtype, boxes)
        """,
    },
}

WRONG = {
    "the whole rows taken as [i, j], one row too many": ("box end off by one", {
        "flat_boxes": flat(body="body = [((i, *[0] * (len(shape) - 1)), (j - i + 1, *shape[1:]))] if j > i else []"),
        "dim_shard": dim(),
    }),
    "the first whole row rounded down (a // n), so the row a starts in is taken whole": (
        "partial first row taken whole", {"flat_boxes": flat(first_row="i = a // n"), "dim_shard": dim()}),
    "no case for a and b in the same row": ("a range within one row", {
        "flat_boxes": flat(one_row=False),
        "dim_shard": dim(),
    }),
    "a partial row as one box of (row, column) whatever the tensor's dims": ("partial row not cut one dim down", {
        "flat_boxes": planted(flat(), {
            "return [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - j * n, b - j * n)]":
                "return [((j, a - j * n), (1, b - a))]",
            "head = [((i - 1, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - (i - 1) * n, n)]":
                "head = [((i - 1, a - (i - 1) * n), (1, i * n - a))] if a < i * n else []",
            "return head + body + [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], 0, b - j * n)]":
                "return head + body + ([((j, 0), (1, b - j * n))] if b > j * n else [])"}),
        "dim_shard": dim(),
    }),
    "each whole row a box of its own": ("whole rows one box per row", {
        "flat_boxes": flat(body="body = [((r, *[0] * (len(shape) - 1)), (1, *shape[1:])) for r in range(i, j)]"),
        "dim_shard": dim(),
    }),
    "this rank's parts placed one after another, as if local were one slice": ("the rank's rows as one block", {
        "flat_boxes": flat(),
        "dim_shard": dim(start="index * local.shape[dim] + j * m"),
    }),
    "each part's rows cloned out of local": ("box data a copy", {
        "flat_boxes": flat(),
        "dim_shard": dim(view="local.narrow(dim, j * m, m).clone()"),
    }),
    "the global shape left as local's": ("global shape not the whole tensor's", {
        "flat_boxes": flat(),
        "dim_shard": dim(shape=""),
    }),
}
