"""A sharded state as boxes of global tensors, and the planner: which saved bytes each box a rank wants needs.

Every layout cuts the same global tensors its own way (ZeRO and FSDP by flat ranges, tensor parallelism
along a dim, DDP not at all), so a checkpoint keeps no layout: it keeps boxes. A rank's state maps names to

    Sharded(shape, dtype, boxes)  its parts of a global tensor: each box (offsets, data) holds the elements
                                  [offsets, offsets + data.shape) (ZeRO, FSDP and TP slices as boxes:
                                  mini_dist/reshard.py)
    torch.Tensor                  replicated: the same on every rank, one box of the whole
    anything else                 a Python literal (numbers, strings, tuples, lists, dicts)

Saved by K ranks, the boxes of each tensor must hold each of its elements exactly once (check_box,
check_tiling): a gap would load whatever the memory held, an overlap two versions of one element. Loaded by
K' ranks in another layout, each box a rank wants is filled from the saved boxes it shares elements with,
and reads no other. Ten rows saved by K = 4 ranks, wanted by K' = 3:

        row       0 1 2 3 4 5 6 7 8 9
        saved     0 0 1 1 1 2 2 3 3 3     rank 1 wants rows 3-5: rows 3-4 of saved box 1, row 5 of box 2
        wanted    0 0 0 1 1 1 2 2 2 2     (K + K' - 1 = 6 reads in all, fewer where K and K' cut alike)

A rank reads each saved box it overlaps whole (to check its crc32: mini_dist/checkpoint.py), so a box that
cuts across the saved ones reads more: a rank that wants columns of row-saved boxes reads every one of them.

Mirrors torch.distributed.checkpoint's planner: a box is its ChunkStorageMetadata(offsets, sizes);
create_read_items_for_chunk_list intersects a wanted chunk with the saved ones into ReadItems;
_validate_global_plan refuses chunks outside their tensor or overlapping, and chunks that miss elements.

    torchrun --standalone --nproc_per_node=3 mini_dist/checkpoint_plan.py [--rows 10 --cols 4 --saved 4]
"""
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/checkpoint_plan.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_dist.kit import launch
from mini_dist.manifest import DTYPES, overlap, tiling


@dataclass(frozen=True)
class Sharded:
    """This rank's part of a global tensor: boxes (offsets, data) of the elements [offsets, offsets + data.shape)."""
    shape: tuple
    dtype: torch.dtype
    boxes: tuple = ()


def as_sharded(value: torch.Tensor, holds: bool = True) -> Sharded:
    """A whole tensor as one box (held by the rank if `holds`)."""
    return Sharded(tuple(value.shape), value.dtype, (((0,) * value.dim(), value),) if holds else ())


def even_part(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank r of K's part [n*r//K, n*(r+1)//K) of n rows: parts differ by one row at most (empty when K > n)."""
    return n * rank // world, n * (rank + 1) // world


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as a checkpoint names it: float32 for torch.float32."""
    return str(dtype).removeprefix("torch.")


def within(box_offsets, lo, lengths) -> tuple:
    """The index, in a box that starts at box_offsets, of the box (lo, lengths) inside it."""
    return tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, box_offsets, lengths))


def plan(manifest: dict, state: dict) -> list:
    """The planner, no I/O: for every box this rank wants, each saved piece it overlaps, as
    (saved piece, index into the saved box, destination view). Refuses what the checkpoint cannot fill.
    manifest: {"tensors": {name: [shape, dtype]}, "objects": {name: ...}, "pieces": [{name, offsets, lengths}]}."""
    reads = []
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            value = as_sharded(value)
        if not isinstance(value, Sharded):
            if name not in manifest["objects"]:
                raise ValueError(f"the checkpoint has no value {name!r}")
            continue
        saved = manifest["tensors"].get(name)
        if saved != [list(value.shape), dtype_name(value.dtype)]:
            raise ValueError(f"{name!r}: the checkpoint holds {saved or 'no such tensor'}, this rank wants "
                             f"{list(value.shape)} {dtype_name(value.dtype)}")
        for offsets, data in value.boxes:
            # exercise: for this wanted box (offsets, data) of `name`, append to reads one (piece, index,
            #   destination) for each saved piece of `name` that shares at least one element with the box, and
            #   for no other: the saved box's elements at `index` (counted from its own first element) are those
            #   `destination`, a view of data, must hold (checkpoint.load copies destination.copy_(saved[index])).
            #   The saved pieces never share an element (check_tiling). If they do not hold every element of the
            #   box, raise ValueError(f"{name!r}: the box at {list(offsets)} of {list(data.shape)} is not all in
            #   the checkpoint ..."). Tools: overlap (mini_dist/manifest.py), within
            found = 0
            for piece in (p for p in manifest["pieces"] if p["name"] == name):
                shared = overlap(offsets, data.shape, piece["offsets"], piece["lengths"])
                if shared:
                    lo, lengths = shared
                    reads.append((piece, within(piece["offsets"], lo, lengths), data[within(offsets, lo, lengths)]))
                    found += prod(lengths)
            if found != data.numel():
                raise ValueError(f"{name!r}: the box at {list(offsets)} of {list(data.shape)} is not all in "
                                 f"the checkpoint ({found} of {data.numel()} elements)")
            # end exercise
    return reads


# ----- the save's plan, checked: every box inside its tensor, each element in exactly one box

def check_box(name: str, value: Sharded, offsets, data: torch.Tensor) -> None:
    """A box of `value` lies inside it and has its dtype, one a checkpoint can hold."""
    inside = len(offsets) == len(value.shape) and all(
        0 <= o and o + n <= s for o, n, s in zip(offsets, data.shape, value.shape))
    if not inside or data.dtype != value.dtype or dtype_name(value.dtype) not in DTYPES:
        raise ValueError(f"a box of {name!r} at {offsets} of {tuple(data.shape)} {data.dtype} is not "
                         f"inside its {value.shape} {value.dtype} (or not of {', '.join(DTYPES)})")


def check_tiling(tensors: dict, pieces: list) -> None:
    """Each tensor of tensors {name: [shape, dtype]} held by pieces [{name, offsets, lengths}] element by
    element, each element once."""
    for name, (shape, _) in tensors.items():
        held, twice = tiling([(p["offsets"], p["lengths"]) for p in pieces if p["name"] == name])
        if held != prod(shape) or twice:
            raise ValueError(f"the ranks' boxes of {name!r} hold {held} elements of its {prod(shape)}"
                             f"{', some twice' if twice else ''}: each element must be saved by one rank")


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--rows", type=int, default=10, help="the saved tensor is [rows, cols], cut by rows")
    p.add_argument("--cols", type=int, default=4, help="see --rows")
    p.add_argument("--saved", type=int, default=4, help="K, the ranks that saved it (the demo's ranks are K')")
    return p


def row_box(whole: torch.Tensor, rank: int, world: int) -> dict:
    """Rank r of K's even part of the rows of `whole`, as a saved piece (its data kept beside it)."""
    lo, hi = even_part(len(whole), rank, world)
    return {"name": "w", "offsets": [lo, 0], "lengths": [hi - lo, whole.shape[1]], "data": whole[lo:hi]}


def wanted(whole: torch.Tensor, rank: int, world: int, dim: int) -> Sharded:
    """Rank r of K' wants its share of `whole` along dim (0: rows, 1: columns), zeros until loaded."""
    lo, hi = even_part(whole.shape[dim], rank, world)
    offsets = (lo, 0) if dim == 0 else (0, lo)
    return Sharded(tuple(whole.shape), whole.dtype, ((offsets, torch.zeros_like(whole.narrow(dim, lo, hi - lo))),))


def demo(args) -> int:
    K = args.saved
    launch.require(min(args.rows, args.cols, K) >= 1, "--rows, --cols and --saved must be at least 1")
    launch.require(args.rows >= max(K, launch.env_world_size()) and args.cols >= launch.env_world_size(),
                   "--rows must be at least --saved and the ranks, --cols at least the ranks: every box holds some")
    env = launch.setup()
    whole = torch.arange(args.rows * args.cols, dtype=torch.float64, device=env.device).view(args.rows, args.cols)
    pieces = [row_box(whole, r, K) for r in range(K)]
    manifest = {"tensors": {"w": [list(whole.shape), "float64"]}, "objects": {}, "pieces": pieces}
    check_tiling(manifest["tensors"], pieces)
    exact = True
    mine = {}
    for dim, how in ((0, "rows"), (1, "columns")):
        want = wanted(whole, env.rank, env.world_size, dim)
        reads = plan(manifest, {"w": want})
        for piece, index, destination in reads:
            destination.copy_(piece["data"][index])
        offsets, data = want.boxes[0]
        exact = exact and torch.equal(data, whole[within((0, 0), offsets, data.shape)])
        mine[how] = [pieces.index(piece) for piece, _, _ in reads]
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    launch.print0(f"a [{args.rows}, {args.cols}] tensor saved by K = {K} ranks by rows; the saved boxes each "
                  f"of K' = {env.world_size} ranks reads, wanting its rows, then its columns:")
    for rank, reads in enumerate(everyone):
        launch.print0(f"  rank {rank}: rows {reads['rows']}, columns {reads['columns']}")
    by_rows = sum(len(reads["rows"]) for reads in everyone)
    by_columns = sum(len(reads["columns"]) for reads in everyone)
    overlapping = [row_box(whole, 0, 2), {**row_box(whole, 1, 2), "offsets": [len(whole) // 2 - 1, 0]}]
    try:
        check_tiling(manifest["tensors"], overlapping)
        refused = "ACCEPTED"
    except ValueError as e:
        refused = str(e)
    launch.print0(f"two saved boxes that share a row: {refused}")
    bound = K + env.world_size - 1
    figure_ok = by_rows <= bound and by_columns == K * env.world_size
    return launch.conclude("checkpoint_plan", exact and refused != "ACCEPTED", "each wanted box filled from the "
                           "saved ones = the tensor, bit for bit", figure_ok,
                           f"boxes read: by rows {by_rows} <= K + K' - 1 = {bound}, by columns {by_columns} = K K'")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
