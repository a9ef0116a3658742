"""The process-group mesh: which rank talks to whom along each axis of DP x PP x CP x TP, and EP.

world = dp * pp * cp * tp ranks sit in a grid with tensor parallelism innermost: counting the ranks,
the tp coordinate turns fastest, then cp, then pp, and dp slowest. For dp = 2, pp = 1, cp = 2, tp = 2:

    rank   0  1  2  3  4  5  6  7
    dp     0  0  0  0  1  1  1  1
    cp     0  0  1  1  0  0  1  1
    tp     0  1  0  1  0  1  0  1

so the tp ranks of one layer are adjacent (one node, the fastest links: tensor parallelism all-reduces
activations in every layer, twice forward and twice backward); the cp ranks that share one sequence come
next (ring attention passes K/V blocks every layer, but only to a neighbour); pipeline stages next (one
activation per microbatch between neighbours, so they may sit across nodes); data-parallel replicas are
outermost (one gradient reduction per step). "TP inside, CP next to it, PP across, DP everywhere."

Each rank belongs to exactly one group per axis: the ranks that differ from it in that coordinate only.
Two more groups come from the data x context product, whose ranks hold the same weights and different
tokens (another batch slice, or another part of the same sequences):

    dp_cp   all dp * cp of them: the gradients of replicated weights are averaged over this group
            (Megatron-LM's data-parallel group "with context parallel"; torchtitan's dp_shard_cp)
    ep      expert parallelism: experts are cut over ep consecutive ranks of dp_cp (f = dp_index*cp +
            cp_index, group f // ep), so EP costs no ranks of its own: it reuses ranks that would hold
            identical experts anyway. torchtitan borrows EP from dp_shard x cp the same way, Megatron-LM
            from its data-parallel ranks: a mixture-of-experts layer then has no replicas to waste.
    edp     expert data parallelism: the dp*cp/ep ranks holding the same experts (same f % ep),
            over which the expert gradients are reduced

Every rank must create every group, in the same order, even the groups it is not in: that is how
torch.distributed agrees on group identities.

Demo (prints the grid, checks every group against torch's DeviceMesh and an all-reduce per group):

    torchrun --standalone --nproc_per_node=8 mini_dist/mesh.py --dp 2 --cp 2 --tp 2 --ep 2

Degrees left out are filled in: tp 2 where the world allows, cp 1, then pp, then dp takes the rest.

Mirrors torch.distributed.device_mesh.init_device_mesh(..., mesh_dim_names=("dp", "pp", "cp", "tp")), with
dp_cp = mesh["dp", "cp"]._flatten() and ep, edp its _unflatten, as torchtitan builds them.
"""
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch

AXES = ("dp", "pp", "cp", "tp")
# group name: the coordinates its members share (so they differ in the others)
SHARED = {"dp": ("pp", "cp", "tp"), "pp": ("dp", "cp", "tp"), "cp": ("dp", "pp", "tp"), "tp": ("dp", "pp", "cp"),
          "dp_cp": ("pp", "tp"), "ep": ("pp", "tp", "ep_replica"), "edp": ("pp", "tp", "ep_index")}
GROUPS = tuple(SHARED)


@dataclass(frozen=True)
class RankGrid:
    """Pure arithmetic of the grid: no processes needed, so it can be printed and tested anywhere."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def rank(self, dp: int, pp: int, cp: int, tp: int) -> int:
        """The rank at these coordinates: tp innermost, then cp, pp, and dp outermost."""
        # exercise: an int, the place (dp, pp, cp, tp) numbered as the docstring draws the grid: tp varying
        #   fastest, then cp, then pp, dp slowest; the size places get the ranks 0 .. size-1, each a different one
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp
        # end exercise

    def coords(self, rank: int) -> dict[str, int]:
        """The inverse of rank(), and the rank's place in expert parallelism: f = dp * cp + cp_index in the
        data x context product, ep_index = f % ep (which experts), ep_replica = f // ep (which copy of them)."""
        # exercise: a dict of six ints: dp, pp, cp, tp, the place that rank() numbers `rank`, and ep_index,
        #   ep_replica, the rank's place in expert parallelism as defined above
        tp = rank % self.tp
        cp = rank // self.tp % self.cp
        pp = rank // (self.tp * self.cp) % self.pp
        dp = rank // (self.tp * self.cp * self.pp)
        f = dp * self.cp + cp  # place in the data x context product
        return {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep_index": f % self.ep, "ep_replica": f // self.ep}
        # end exercise

    def groups(self, name: str) -> list[list[int]]:
        """All groups of one kind (an axis, dp_cp, ep or edp): the ranks that share SHARED[name]."""
        # exercise: a list of groups, each a list of ranks in increasing order (a process group's order): every
        #   rank in exactly one, beside exactly the ranks whose coords() agree with its own on each key of
        #   SHARED[name]
        found = {}
        for r in range(self.size):
            found.setdefault(tuple(self.coords(r)[c] for c in SHARED[name]), []).append(r)
        return list(found.values())
        # end exercise

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def picture(self) -> str:
        """One block per data-parallel replica: pipeline stages as rows, cp groups of tp ranks in a row."""
        lines = []
        for d in range(self.dp):
            lines.append(f"DP replica {d}:")
            for p in range(self.pp):
                cp_groups = []
                for c in range(self.cp):
                    tp_ranks = " ".join(f"r{self.rank(d, p, c, t)}" for t in range(self.tp))
                    cp_groups.append(f"[{tp_ranks}]")
                note = "   (cp ranks side by side, tp ranks in [ ])" if d == p == 0 and self.cp > 1 else ""
                lines.append(f"  PP stage {p:<3} {'  '.join(cp_groups)}{note}")
        if self.ep > 1:
            ep_groups = self.groups("ep")
            shown = " ".join(str(g) for g in ep_groups[:4])
            more = " ..." if len(ep_groups) > 4 else ""
            lines.append(f"EP groups (each holds all experts between them): {shown}{more}")
        return "\n".join(lines)

    def __post_init__(self):
        """Refuse a degree below 1, and an ep that does not divide the data x context product."""
        for axis in AXES + ("ep",):
            if getattr(self, axis) < 1:
                raise ValueError(f"--{axis} must be at least 1, got {getattr(self, axis)}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"--ep {self.ep} must divide dp x cp = {self.dp} x {self.cp} = {self.dp * self.cp}: "
                             f"expert parallelism reuses the ranks of the data x context product")


class Mesh:
    """The process groups of this rank along each axis and for dp_cp, ep and edp, from a RankGrid."""

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1):
        self.grid = RankGrid(dp, pp, cp, tp, ep)
        world = dist.get_world_size()
        if self.grid.size != world:
            raise ValueError(f"dp x pp x cp x tp = {dp} x {pp} x {cp} x {tp} = {self.grid.size} ranks, but the "
                             f"world has {world}; choose degrees whose product is {world}")
        me = dist.get_rank()
        self.coords = self.grid.coords(me)
        self.ranks = {}  # group name -> the ranks of this rank's group of that kind
        self.group = {}  # group name -> that group
        for name in GROUPS:
            for ranks in self.grid.groups(name):  # every rank creates every group, in the same order
                group = launch.new_group(ranks)
                if me in ranks:
                    self.ranks[name] = ranks
                    self.group[name] = group
        self.dp_group = self.group["dp"]
        self.pp_group = self.group["pp"]
        self.cp_group = self.group["cp"]
        self.tp_group = self.group["tp"]
        self.dp_cp_group = self.group["dp_cp"]
        self.ep_group = self.group["ep"]
        self.edp_group = self.group["edp"]
        self.dp_rank = self.coords["dp"]
        self.pp_rank = self.coords["pp"]
        self.cp_rank = self.coords["cp"]
        self.tp_rank = self.coords["tp"]


def grid_for(world: int, dp: int | None = None, pp: int | None = None, cp: int | None = None,
             tp: int | None = None, ep: int = 1, default_pp: int = 1) -> RankGrid:
    """The grid of `world` ranks with the degrees a user gave, the others filled in: tp 2, cp 1, pp
    `default_pp` where what is left divides by them, the last one missing takes the rest. A configuration
    that cannot fill the world raises launch.UsageError saying what to change, before any process group."""
    degrees = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    given = {a: d for a, d in degrees.items() if d is not None}
    for axis, d in {**given, "ep": ep}.items():
        launch.require(d >= 1, f"--{axis} must be at least 1, got {d}")
    fixed = math.prod(given.values())
    named = " x ".join(f"--{a} {d}" for a, d in given.items())
    if len(given) == len(AXES):
        launch.require(fixed == world, f"{named} = {fixed} ranks, but the world has {world}: choose degrees "
                                       f"whose product is {world}")
    asked = f"{named} = {fixed}" if len(given) > 1 else named
    launch.require(world % fixed == 0, f"{asked} does not divide the world of {world} ranks: choose degrees whose "
                                       f"product divides {world}")
    missing = [a for a in ("tp", "cp", "pp", "dp") if a not in given]
    left = world // fixed
    for axis in missing[:-1]:  # the last one missing takes what is left
        want = {"tp": 2, "cp": 1, "pp": default_pp, "dp": 1}[axis]
        degrees[axis] = want if left % want == 0 else 1
        left //= degrees[axis]
    if missing:
        degrees[missing[-1]] = left
    product = degrees["dp"] * degrees["cp"]
    launch.require(product % ep == 0, f"--ep {ep} must divide dp x cp = {degrees['dp']} x {degrees['cp']} = "
                                      f"{product}: expert parallelism reuses the ranks of the data x context product")
    return RankGrid(**degrees, ep=ep)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    for axis in AXES:
        p.add_argument(f"--{axis}", type=int, default=None, help=f"{axis} degree (default: filled in)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree, a divisor of dp x cp")
    return p


def device_mesh_groups(grid: RankGrid, device_type: str) -> dict[str, list[int]]:
    """The same groups from torch's DeviceMesh (the reference): the 4-D mesh, dp x cp flattened, and that
    flattened dim unflattened into (edp, ep), as torchtitan derives its expert mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, tuple(getattr(grid, a) for a in AXES), mesh_dim_names=AXES)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    expert = dp_cp._unflatten(0, (grid.dp * grid.cp // grid.ep, grid.ep), ("edp", "ep"))
    meshes = {**{a: mesh for a in AXES}, "dp_cp": dp_cp, "ep": expert, "edp": expert}
    return {name: dist.get_process_group_ranks(m.get_group(name)) for name, m in meshes.items()}


def demo(args) -> int:
    grid = grid_for(launch.env_world_size(), args.dp, args.pp, args.cp, args.tp, args.ep)
    env = launch.setup()
    mesh = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    launch.print0(grid.picture())
    same = device_mesh_groups(grid, env.device.type) == mesh.ranks

    # One all-reduce per group: the sum of the ranks in my group must be the sum of its members
    sums_ok = True
    for name in GROUPS:
        t = torch.tensor([float(env.rank)], device=env.device)
        dist.all_reduce(t, group=mesh.group[name])
        sums_ok &= t.item() == sum(mesh.ranks[name])
    launch.print0("rank 0: " + ", ".join(f"{name} {mesh.ranks[name]}" for name in GROUPS))
    dims = "x".join(str(getattr(grid, a)) for a in AXES)
    return launch.conclude("mesh", same, "groups equal torch DeviceMesh's", sums_ok,
                           f"{dims} grid (dp x pp x cp x tp), ep {grid.ep}: one all-reduce per group sums its ranks")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
