"""Sharded checkpoints: every rank writes its own share, a manifest written last commits them, any world size loads.

A sharded job cannot gather its state on one rank to save it (the consolidated state dict of
mini_dist/sharded_state.py: b*N bytes through one rank): each rank must write its 1/K in parallel, a
crash at any moment must not corrupt what is on disk, and the checkpoint must load on another number of
ranks or in another layout. A rank's state is boxes of global tensors (Sharded: mini_dist/checkpoint_plan.py),
replicated tensors (the same on every rank: written once, by rank 0) and Python literals (in the manifest).

save   every rank writes its boxes' raw bytes to rank_0000r.bin, atomically (old file or whole new one) and
       sends rank 0 a record per box: name, global shape, dtype, offsets, lengths, byte range, crc32. Rank 0
       checks that the boxes hold every element exactly once and writes manifest.json the same way, LAST:
       a checkpoint without a manifest does not exist, so a crash at any moment leaves the last one intact.
load   the manifest is checked field by field (mini_dist/manifest.py: it may come from anywhere); the
       planner intersects every box a rank wants with every saved box; the rank reads only the saved boxes
       that overlap its own (whole, to check their crc32) and, once every rank has read without error,
       copies the overlaps into place: any world size, any layout.

Bytes: a rank writes b·N/K of state, ~150 B of record per box. Every rank sees one file system, as with DCP.

Mirrors torch.distributed.checkpoint (DCP): a box is its ChunkStorageMetadata(offsets, sizes), the manifest
its .metadata (written last, by the coordinator), checkpoint_plan.plan() its LoadPlanner. DCP pickles its
metadata (a load runs whatever code it names) and writes each chunk as a torch.save archive; here the
manifest is JSON and the chunks raw bytes with a crc32.

    torchrun --standalone --nproc_per_node=4 mini_dist/checkpoint.py [--rows 301 --cols 97]
"""
import json
import os
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/checkpoint.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini_dist.checkpoint_plan import Sharded, as_sharded, check_box, check_tiling, dtype_name, even_part, plan
from mini_dist.kit import launch, trace, wire
from mini_dist.manifest import DTYPES, MANIFEST, VERSION, CheckpointError, literal_text, read_manifest


# ----- save: each rank's boxes to its own file, then the manifest, last

def write_atomically(path: str, chunks) -> None:
    """`path` holds `chunks` (bytes-like), one after another; whoever opens it, even after a crash, finds the old
    file or the whole new one."""
    # exercise: when this returns, path holds the chunks one after another. At every moment, and after a crash
    #   (the power lost) at any moment, whoever opens path finds the old file whole or the new one whole: never
    #   a part, never no file. A chunk that raises leaves the old file, and its error goes on to the caller.
    #   Judged under POSIX's crash model: a file's bytes reach the disk only once it is synced (os.fsync); a
    #   rename onto a name (os.replace) is atomic, and may reach the disk before bytes never synced
    with open(path + ".tmp", "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    # end exercise


def write_shard(state: dict, path: str, rank: int) -> dict:
    """This rank's file, and the record of what is where in it (rank 0's records carry the replicated)."""
    file = f"rank_{rank:05d}.bin"
    record = {"tensors": {}, "objects": {}, "pieces": []}
    chunks = []
    start = 0  # where the next box's bytes begin in the file
    for name, value in state.items():
        if isinstance(value, torch.Tensor):  # replicated: written once, by rank 0
            value = as_sharded(value, rank == 0)
        if not isinstance(value, Sharded):
            record["objects"][name] = literal_text(name, value)
            continue
        record["tensors"][name] = [list(value.shape), dtype_name(value.dtype)]
        for offsets, data in value.boxes:
            check_box(name, value, offsets, data)
            raw = data.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # cpu: bytes for a file
            if raw.nbytes:
                record["pieces"].append({"name": name, "file": file, "offsets": list(offsets),
                                         "lengths": list(data.shape), "start": start, "nbytes": raw.nbytes,
                                         "crc32": zlib.crc32(raw)})
                chunks.append(raw)
                start += raw.nbytes
    with trace.span(f"write {file}", trace.STORAGE, bytes=start):  # a slice of a trace (kit/trace.py)
        write_atomically(os.path.join(path, file), chunks)
    record["file"] = (file, start)
    return record


def merge(records: list) -> dict:
    """Rank 0: every rank's records into one manifest, once the ranks agree and their boxes tile each tensor."""
    check_agreement(records)
    first = records[0]
    pieces = [p for r in records for p in r["pieces"]]
    check_tiling(first["tensors"], pieces)
    return {"version": VERSION, "world_size": len(records), "tensors": first["tensors"], "objects": first["objects"],
            "files": dict(r["file"] for r in records), "pieces": pieces}


def save(state: dict, path: str, group=None) -> None:
    """Collective: write `state` as the checkpoint at `path` (a directory); returns once it is on disk.
    If any rank fails, every rank raises the same CheckpointError. A complete checkpoint is never overwritten."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if os.path.exists(os.path.join(path, MANIFEST)):  # every rank sees it: no rank writes before the gather
        raise CheckpointError(f"{path} already holds a complete checkpoint: save to a new path, or delete it")
    try:
        os.makedirs(path, exist_ok=True)
        record = write_shard(state, path, rank)
    except (OSError, ValueError) as e:
        record = f"rank {rank}: {e}"
    records = [None] * world if rank == 0 else None
    verdict = [None]  # rank 0's: why the checkpoint was not saved, or None
    wire.call(dist.gather_object, record, records, group=group, group_dst=0)
    if rank == 0:
        try:
            if failed := [r for r in records if isinstance(r, str)]:
                raise ValueError("; ".join(failed))
            write_atomically(os.path.join(path, MANIFEST), [json.dumps(merge(records)).encode()])
            descriptor = os.open(path, os.O_RDONLY)
            os.fsync(descriptor)  # the renames themselves reach the disk
            os.close(descriptor)
        except (OSError, ValueError) as e:
            verdict = [f"checkpoint {path} not saved: {e}"]
    wire.call(dist.broadcast_object_list, verdict, group=group, group_src=0)  # every rank returns once it exists
    if verdict[0]:
        raise CheckpointError(verdict[0])


# ----- load: what each wanted box overlaps, read and checked, copied once every rank could read

def read_pieces(path: str, manifest: dict, reads: list) -> dict:
    """Each saved piece that `reads` needs, read once, whole, and checked against its crc32. The manifest
    was checked: each piece's bytes lie inside its file as it is on disk."""
    loaded = {}
    for piece, _, _ in reads:
        key = (piece["file"], piece["start"])
        if key in loaded:
            continue
        file = os.path.join(path, piece["file"])
        raw = torch.empty(piece["nbytes"], dtype=torch.uint8)  # cpu: read from a file
        with open(file, "rb") as f:
            f.seek(piece["start"])
            got = f.readinto(memoryview(raw.numpy()))
        if got < piece["nbytes"] or zlib.crc32(raw.numpy()) != piece["crc32"]:
            raise ValueError(f"{file}: bytes [{piece['start']}, {piece['start'] + piece['nbytes']}) of tensor "
                             f"{piece['name']!r} fail their crc32 check: the file was altered after it was saved")
        loaded[key] = raw.view(DTYPES[manifest["tensors"][piece["name"]][1]]).reshape(piece["lengths"])
    return loaded


@torch.no_grad()
def load(state: dict, path: str, group=None) -> dict:
    """Collective: fill `state` from checkpoint `path` at any world size and layout: each Sharded box and
    tensor in place, each other value replaced by the saved one. Nothing changes unless every rank can
    read all it wants; else every rank raises the same CheckpointError. Returns this rank's bytes read
    (whole saved boxes) and wanted."""
    def read():
        manifest = read_manifest(path)
        reads = plan(manifest, state)
        return manifest, reads, read_pieces(path, manifest, reads)
    manifest, reads, loaded = everyone(f"cannot load {path}", read, group)
    for piece, index, destination in reads:
        destination.copy_(loaded[piece["file"], piece["start"]][index])
    for name, value in state.items():
        if not isinstance(value, (torch.Tensor, Sharded)):
            state[name] = manifest["values"][name]
    wanted = sum(destination.nbytes for _, _, destination in reads)
    return {"bytes read": sum(t.nbytes for t in loaded.values()), "bytes wanted": wanted}


# ----- guards: every rank fails together; the ranks agree on what they save

def everyone(what: str, step, group=None):
    """step() on every rank; if it fails on any, every rank raises one CheckpointError naming each failed rank
    (a raw error on one rank would leave the others waiting in their next collective)."""
    try:
        result, problem = step(), None
    except (OSError, ValueError, KeyError, TypeError, CheckpointError) as e:
        result, problem = None, f"rank {dist.get_rank(group)}: {e}"
    problems = [None] * dist.get_world_size(group)
    wire.call(dist.all_gather_object, problems, problem, group=group)
    if any(problems):
        raise CheckpointError(f"{what}: " + "; ".join(p for p in problems if p))
    return result


def check_agreement(records: list) -> None:
    """Rank 0, before the manifest: every rank passed the same names, shapes, dtypes and literals."""
    first = records[0]
    for rank, record in enumerate(records):
        for kind in ("tensors", "objects"):
            if record[kind] != first[kind]:
                name = next(n for n in {**first[kind], **record[kind]} if first[kind].get(n) != record[kind].get(n))
                raise ValueError(f"ranks disagree about {name!r}: rank 0 has {first[kind].get(name)}, rank {rank} "
                                 f"{record[kind].get(name)}; every rank passes the same names, shapes and values")


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--rows", type=int, default=301, help="the saved tensors are [rows, cols], [cols], [3, rows, 5]")
    p.add_argument("--cols", type=int, default=97, help="see --rows")
    return p


def share(t: torch.Tensor, rank: int, world: int) -> Sharded:
    """Rank r of K holds its even part of t's rows (none, when K > n): checkpoint_plan.even_part."""
    lo, hi = even_part(len(t), rank, world)
    return Sharded(tuple(t.shape), t.dtype, (((lo,) + (0,) * (t.dim() - 1), t[lo:hi].clone()),))


def corrupt(path: str, fault: str, world: int) -> None:
    """Flip a byte in the middle of rank 1's file (rank 0's if alone), or cut the file there."""
    file = Path(path, f"rank_{min(1, world - 1):05d}.bin")
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 1
    file.write_bytes(raw if fault == "a flipped byte" else raw[:len(raw) // 2])


def demo(args) -> int:
    import shutil
    import tempfile

    from mini_dist.kit import timing
    launch.require(min(args.rows, args.cols) >= 1, "--rows and --cols must be at least 1")
    env = launch.setup()
    K = env.world_size
    g = torch.Generator().manual_seed(0)  # every rank: the same global tensors
    full = {n: torch.randn(s, generator=g).to(env.device)
            for n, s in [("w", (args.rows, args.cols)), ("b", (args.cols,)), ("e", (3, args.rows, 5))]}
    N = sum(t.numel() for t in full.values())
    state = {n: share(t, env.rank, K) for n, t in full.items()}
    state["step"] = torch.tensor(7, device=env.device)
    state["data"] = {"epoch": 2}
    where = [tempfile.mkdtemp(prefix="mini_dist_checkpoint_") if env.rank == 0 else None]
    dist.broadcast_object_list(where)
    path = os.path.join(where[0], "step_7")
    ms = timing.timed(lambda: save(state, path)) * 1e3  # on the slowest rank
    held = sum(data.nbytes for n in full for _, data in state[n].boxes)
    files = [None] * K  # per rank: (bytes of its share, bytes of its file)
    dist.all_gather_object(files, (held, os.path.getsize(os.path.join(path, f"rank_{env.rank:05d}.bin"))))
    launch.print0(f"3 fp32 tensors of N = {N:,} elements cut by rows over K = {K}, an int64 step, a literal: "
                  f"saved in {ms:.1f} ms")
    for r, (b, size) in enumerate(files):
        launch.print0(f"  rank_{r:05d}.bin {size:>8,} B = its share of 4N {b:>8,} ({b / (4 * N):.3f})"
                      f"{' + 8 (step)' if r == 0 else ''}")
    launch.print0(f"  {MANIFEST}   {os.path.getsize(os.path.join(path, MANIFEST)):>8,} B, written last by rank 0")
    exact = all(size == b + (8 if r == 0 else 0) for r, (b, size) in enumerate(files))
    exact = exact and sum(b for b, _ in files) == 4 * N
    back = {n: share(torch.zeros_like(t), env.rank, K) for n, t in full.items()}
    back["step"] = torch.zeros_like(state["step"])
    back["data"] = None
    ms = timing.timed(lambda: load(back, path)) * 1e3
    equal = bool(back["step"] == 7) and back["data"] == state["data"] and all(
        torch.equal(a, b) for n in full for (_, a), (_, b) in zip(back[n].boxes, state[n].boxes))
    launch.print0(f"loaded in {ms:.1f} ms: {'bit for bit equal' if equal else 'DIFFERENT'} (other world sizes "
                  f"and layouts: mini_dist/reshard.py)")
    refused = 0
    for fault in ("a flipped byte", "a truncated file"):
        if env.rank == 0:
            corrupt(path, fault, K)
        dist.barrier()
        try:
            load({n: share(torch.zeros_like(t), env.rank, K) for n, t in full.items()}, path)
        except CheckpointError as e:
            refused += 1
            launch.print0(f"{fault}: refused on every rank: {str(e)[:150]}...")
    if env.rank == 0:
        shutil.rmtree(where[0])
    return launch.conclude("checkpoint", equal and refused == 2, "saved and loaded bit for bit; corruption refused",
                           exact, f"each rank writes its share of 4N = {4 * N:,} B")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
