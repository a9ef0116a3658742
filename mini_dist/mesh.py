"""The process-group mesh: which rank talks to whom along each axis of DP x PP x TP.

world = dp * pp * tp ranks sit in a grid with tensor parallelism innermost:

    rank = (dp_index * pp + pp_index) * tp + tp_index

so the tp ranks of one layer are adjacent (rank 0..tp-1: one node, joined by the fastest links, because
tensor parallelism all-reduces activations in every layer, twice forward and twice backward); pipeline
stages come next (neighbours exchange only one activation per microbatch, so they may sit across
nodes); data-parallel replicas are outermost (one gradient reduction per step, overlapped with
backward). "TP inside, PP across, DP everywhere."

Each rank belongs to exactly one group per axis: its TP group (same dp, pp), its PP group (same dp, tp)
and its DP group (same pp, tp). Every rank must create every group, in the same order, even the groups
it is not in: that is how torch.distributed agrees on group identities.

Demo (prints the grid, checks the groups against torch's DeviceMesh and an all-reduce per axis):

    torchrun --standalone --nproc_per_node=4 mini_dist/mesh.py --dp 2 --pp 1 --tp 2

Mirrors: torch.distributed.device_mesh.init_device_mesh(..., mesh_dim_names=("dp", "pp", "tp")).
"""
import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.launch import conclude, new_group, print0, setup

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class RankGrid:
    """Pure arithmetic of the grid: no processes needed, so it can be printed and tested anywhere."""
    dp: int
    pp: int
    tp: int

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"--{axis} must be at least 1, got {getattr(self, axis)}")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along `axis`: ranks that differ only in that coordinate."""
        others = [a for a in AXES if a != axis]
        result = []
        for i in range(getattr(self, others[0])):
            for j in range(getattr(self, others[1])):
                fixed = {others[0]: i, others[1]: j}
                result.append([self.rank(**fixed, **{axis: k}) for k in range(getattr(self, axis))])
        return result

    def picture(self) -> str:
        """One block per data-parallel replica: pipeline stages as rows, tensor-parallel ranks as columns."""
        lines = []
        for d in range(self.dp):
            lines.append(f"DP replica {d}:" + "".join(f"  tp{t:<3}" for t in range(self.tp)))
            for p in range(self.pp):
                lines.append(f"  PP stage {p:<3}" + "".join(f"  r{self.rank(d, p, t):<4}"
                                                          for t in range(self.tp)))
        return "\n".join(lines)


class Mesh:
    """The process groups of this rank along each axis, built from a RankGrid."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1):
        self.grid = RankGrid(dp, pp, tp)
        world = dist.get_world_size()
        if self.grid.size != world:
            raise ValueError(f"dp x pp x tp = {dp} x {pp} x {tp} = {self.grid.size} ranks, but the world "
                             f"has {world}; choose degrees whose product is {world}")
        me = dist.get_rank()
        self.coords = self.grid.coords(me)
        self.ranks, self.group = {}, {}
        for axis in AXES:
            for ranks in self.grid.groups(axis):  # every rank creates every group, in the same order
                group = new_group(ranks)
                if me in ranks:
                    self.ranks[axis], self.group[axis] = ranks, group
        self.dp_group, self.pp_group, self.tp_group = (self.group[a] for a in AXES)
        self.dp_rank, self.pp_rank, self.tp_rank = (self.coords[a] for a in AXES)


def demo() -> int:
    parser = argparse.ArgumentParser()
    for axis in AXES:
        parser.add_argument(f"--{axis}", type=int, default=None)
    args = parser.parse_args()
    env = setup()
    tp = args.tp or (2 if env.world_size % 2 == 0 else 1)
    pp = args.pp or 1
    dp = args.dp or env.world_size // (tp * pp)
    mesh = Mesh(dp, pp, tp)
    print0(mesh.grid.picture())

    from torch.distributed.device_mesh import init_device_mesh  # the reference: torch's own mesh
    reference = init_device_mesh(env.device.type, (dp, pp, tp), mesh_dim_names=AXES)
    same = all(dist.get_process_group_ranks(reference.get_group(axis)) == mesh.ranks[axis]
               for axis in AXES)

    # One all-reduce per axis: the sum of the ranks in my group must be the sum of the grid's ranks
    sums_ok = True
    for axis in AXES:
        t = torch.tensor([float(env.rank)], device=env.device)
        dist.all_reduce(t, group=mesh.group[axis])
        sums_ok &= t.item() == sum(mesh.ranks[axis])
    print0("rank 0: " + ", ".join(f"{axis} group {mesh.ranks[axis]}" for axis in AXES))
    return conclude("mesh", same, "groups equal torch DeviceMesh's", sums_ok,
                    f"{dp}x{pp}x{tp} grid, one all-reduce per axis sums its group's ranks")


if __name__ == "__main__":
    raise SystemExit(demo())
