"""The planner's overlap read: the exercise's bank (kit/exercise.py); MISTAKES: tests/checkpoint_plan_exercise.py."""
HINTS = {
    "plan": [
        "Take the saved pieces of this tensor one by one and ask: do the wanted box and this piece share an element? "
        "Only where their ranges [o, o + n) overlap along every dim. Where they do, the box they share is what this "
        "piece gives the wanted box.",
        "overlap(offsets, data.shape, piece['offsets'], piece['lengths']) is that shared box (lo, lengths), or None. "
        "It is indexed twice: from the saved box's first element (subtract the piece's offsets) and from the wanted "
        "box's (subtract offsets); within(box_offsets, lo, lengths) does the subtraction.",
        "reads.append((piece, within(piece['offsets'], lo, lengths), data[within(offsets, lo, lengths)])) and add "
        "prod(lengths) to a count; after the pieces, raise the ValueError if the count is not data.numel().",
    ],
}

REFERENCE = """
    found = 0
    for piece in (p for p in manifest["pieces"] if p["name"] == name):
        shared = overlap(offsets, data.shape, piece["offsets"], piece["lengths"])
        if shared:
            lo, lengths = shared
            reads.append((piece, {saved}, {destination}))
            found += prod(lengths)
    if found != data.numel():
        raise ValueError(f"{{name!r}}: the box at {{list(offsets)}} of {{list(data.shape)}} is not all in "
                         f"the checkpoint ({{found}} of {{data.numel()}} elements)")
"""


def reference(saved="within(piece['offsets'], lo, lengths)", destination="data[within(offsets, lo, lengths)]"):
    """The reference's body with one of its two indices written otherwise."""
    return REFERENCE.format(saved=saved, destination=destination)


def ranges(overlaps: str) -> str:
    """A body that computes the shared box by hand, with `overlaps` as its test of whether a piece is read."""
    return f"""
        found = 0
        for piece in manifest["pieces"]:
            if piece["name"] != name:
                continue
            o = piece["offsets"]
            n = piece["lengths"]
            lo = [max(a, b) for a, b in zip(offsets, o)]
            hi = [min(a + m, b + k) for a, m, b, k in zip(offsets, data.shape, o, n)]
            if {overlaps}:
                lengths = [max(h - l, 0) for l, h in zip(lo, hi)]
                reads.append((piece, within(o, lo, lengths), data[within(offsets, lo, lengths)]))
                found += prod(lengths)
        if found != data.numel():
            raise ValueError(f"{{name!r}}: the box at {{list(offsets)}} of {{list(data.shape)}} is not all in "
                             f"the checkpoint")
    """


RIGHT = {
    "overlap and within, the elements counted": {"plan": reference()},
    "the ranges intersected by hand, the destination narrowed dim by dim, the elements held marked in a mask": {
        "plan": """
            held = torch.zeros(tuple(data.shape), dtype=torch.bool)  # cpu: a mark per element of the box
            for piece in manifest["pieces"]:
                if piece["name"] != name:
                    continue
                start = [max(a, b) for a, b in zip(offsets, piece["offsets"])]
                stop = [min(a + m, b + k) for a, m, b, k in zip(offsets, data.shape, piece["offsets"],
                                                                 piece["lengths"])]
                if any(e <= s for s, e in zip(start, stop)):
                    continue
                index = tuple(slice(s - b, e - b) for s, e, b in zip(start, stop, piece["offsets"]))
                destination = data
                for d, (s, e) in enumerate(zip(start, stop)):
                    destination = destination.narrow(d, s - offsets[d], e - s)
                reads.append((piece, index, destination))
                held[tuple(slice(s - a, e - a) for s, e, a in zip(start, stop, offsets))] = True
            if not bool(held.all()):
                raise ValueError(f"{name!r}: the box at {list(offsets)} of {list(data.shape)} is not all in the "
                                 f"checkpoint ({int(held.sum())} of {data.numel()} elements)")
        """,
    },
    "the shared box's ranges tested strictly (lo < hi on every dim)": {
        "plan": ranges("all(l < h for l, h in zip(lo, hi))"),
    },
}

WRONG = {
    "the saved box indexed by the shared box's global offsets": ("index in the tensor's coordinates", {
        "plan": reference(saved="tuple(slice(a, a + n) for a, n in zip(lo, lengths))"),
    }),
    "each index shifted by the other box's offsets": ("the two indices swapped", {
        "plan": reference(saved="within(offsets, lo, lengths)",
                          destination="data[within(piece['offsets'], lo, lengths)]"),
    }),
    "the destination cloned out of the wanted box": ("destination a copy", {
        "plan": reference(destination="data[within(offsets, lo, lengths)].clone()"),
    }),
    "boxes that meet at an edge taken as overlapping (lo <= hi)": ("touching boxes read", {
        "plan": ranges("all(l <= h for l, h in zip(lo, hi))"),
    }),
    "a piece read whenever its rows overlap the box's": ("overlap on dim 0 only", {
        "plan": ranges("lo[0] < hi[0]"),
    }),
    "every overlapping piece read, the box never checked for what is missing": ("partly held box not refused", {
        "plan": """
            for piece in (p for p in manifest["pieces"] if p["name"] == name):
                shared = overlap(offsets, data.shape, piece["offsets"], piece["lengths"])
                if shared:
                    lo, lengths = shared
                    reads.append((piece, within(piece["offsets"], lo, lengths), data[within(offsets, lo, lengths)]))
        """,
    }),
}
