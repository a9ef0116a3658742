"""Sharded checkpoints (mini_dist.checkpoint) against torch.distributed.checkpoint (DCP): save and load
time, and the bytes each writes, for the same state.

    ./run.sh bench 4 checkpoint

The state: 4 fp32 tensors of 1M, 2M, 4M and 1M elements (8M, 32 MiB), each cut by rows over the K ranks as
DTensor's Shard(0) cuts it (chunks of ceil(n/K) rows), so that both sides hold the same bytes per rank.
DCP gets them as DTensors, mini_dist as boxes of the same rows. Each save goes to a directory of its own;
both fsync their files (DCP's FileSystemWriter(sync_files=True) is its default). Loads read the files
just written, from the page cache on both sides: this times the formats and the planners, not the disk.

Where the time goes: both write each rank's bytes into one file of its own and the coordinator a small
metadata file. mini_dist meets once per save (records gathered to rank 0, its verdict broadcast) and once
per load (every rank's errors all-gathered); DCP twice per save (local plans gathered and the global plan
scattered back, then the write results gathered and the metadata's outcome broadcast) and twice per load
(plans, then read results). DCP writes each chunk as a torch.save archive (a zip entry: ~1.6 KB more per
chunk on disk) and pickles its metadata; mini_dist writes raw bytes and a crc32 of each box, computed on
save and checked on load (zlib.crc32 runs at ~3 GB/s on one core here: ~3 ms for a rank's 8 MiB at K = 4).
Target: parity, with slack for a busy machine and for the checksums DCP does not compute: <= 1.5x.
"""
import os
import shutil
import tempfile
from itertools import count

import torch
import torch.distributed as dist

from mini_dist import bench, checkpoint
from mini_dist.checkpoint_plan import Sharded
from mini_dist.kit import launch

SHAPES, REPEATS = [(1024, 1024), (2048, 1024), (4096, 1024), (1024, 1024)], 5


def rows(n: int, rank: int, world: int) -> tuple:
    """DTensor's Shard(0): chunks of ceil(n/K) rows, the last ones short or empty."""
    size = -(-n // world)
    return min(rank * size, n), min((rank + 1) * size, n)


def sizes(path: str) -> dict:
    """{file: bytes} of a checkpoint directory."""
    return {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}


def data(files: dict, meta: str) -> int:
    """The bytes of a checkpoint's files but its metadata file."""
    return sum(v for f, v in files.items() if f != meta)


def checkpoints(args) -> list[bench.Result]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    rank = dist.get_rank()
    world = dist.get_world_size()
    dev = launch.device()
    mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
    g = torch.Generator().manual_seed(0)
    ours = {}          # the state saved, as mini_dist's boxes
    native = {}        # the same, as DTensors
    empty_ours = {}    # zeros that each load fills
    empty_native = {}
    for i, shape in enumerate(SHAPES):
        lo, hi = rows(shape[0], rank, world)
        local = torch.randn(shape, generator=g)[lo:hi].clone().to(dev)  # the same global tensor on every rank
        for mine, theirs, t in ((ours, native, local), (empty_ours, empty_native, torch.zeros_like(local))):
            mine[f"t{i}"] = Sharded(shape, t.dtype, (((lo, 0), t),))
            theirs[f"t{i}"] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                                 stride=(shape[1], 1))
    where = [tempfile.mkdtemp(prefix="mini_dist_bench_checkpoint_") if rank == 0 else None]
    dist.broadcast_object_list(where)
    ids = count()
    last = {}  # side -> the directory it saved to last

    def save(side):
        def run():
            last[side] = os.path.join(where[0], f"{side}_{next(ids)}")
            if side == "ours":
                checkpoint.save(ours, last[side])
            else:
                dcp.save(native, checkpoint_id=last[side])
        return run

    results = [bench.compare("checkpoint save", save("ours"), save("dcp"), REPEATS, 1.5)]
    results.append(bench.compare("checkpoint load", lambda: checkpoint.load(empty_ours, last["ours"]),
                                 lambda: dcp.load(empty_native, checkpoint_id=last["dcp"]), REPEATS, 1.5))
    equal = all(torch.equal(empty_ours[n].boxes[0][1], ours[n].boxes[0][1]) and
                torch.equal(empty_native[n].to_local(), native[n].to_local()) for n in ours)
    mine = sizes(last["ours"])
    theirs = sizes(last["dcp"])
    state = sum(4 * a * b for a, b in SHAPES)
    results[0].note = (f"{state / 2**20:.0f} MiB of state; on disk: mini_dist {data(mine, checkpoint.MANIFEST):,} B "
                       f"+ {mine[checkpoint.MANIFEST]:,} B manifest, DCP {data(theirs, '.metadata'):,} B + "
                       f"{theirs['.metadata']:,} B .metadata")
    if not equal:
        raise RuntimeError("a load gave back other bytes than were saved")
    results[1].note = "both load bit for bit"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0])
    return results


BENCHES = {"checkpoint": checkpoints}
