"""How FSDP stores a unit: its parameters as one flat vector, cut in K equal shards, seen back per parameter.

    flat    = [p_0 | p_1 | ... | p_n-1 | 0 padding]     K*S elements, S = ceil(numel / K)
    shard r = flat[r*S : (r+1)*S]                       the only part rank r stores and updates

Padding keeps the shards equal, which all-gather and reduce-scatter need. Parameter i occupies
[o_i, o_i + n_i) of flat, so rank r holds the intersection of that range with its shard: a contiguous
slice, possibly empty, possibly split between ranks. The same numbers are seen three ways:

    the shard                   what rank r stores, all-gathers from and reduce-scatters into
    one slice per parameter     an nn.Parameter that is a 1-D view of the shard, named as in the module,
                                with its own .grad: what the optimizer steps (FSDP1's use_orig_params=True)
    the full vector             gathered for compute: each module attribute becomes a view of it

State dicts come in the same two kinds as PyTorch's (StateDictType.FULL_STATE_DICT, SHARDED_STATE_DICT):
full tensors gathered onto one rank or every rank; or each rank's slices with their place in the full
parameter (Slice(shape, start, stop)), no communication, for a checkpoint that every rank writes. The
optimizer is built on the slices, so optimizer.state_dict() on each rank is that rank's shard of the
optimizer state: save and load it beside sharded_state_dict() with the same world size and wrap.

Used by mini_dist/fsdp.py, which decides when to gather and free, one unit at a time; ZeRO
(mini_dist/zero.py) cuts the whole model the same way (`Partition`). Mirrors
torch.distributed.fsdp._flat_param.FlatParameter (FSDP1).

Demo (each rank's slices of a small model, the padding, and both state dicts back to the model's tensors):

    torchrun --standalone --nproc_per_node=4 mini_dist/flat_param.py [--sizes 5 3 2]
"""
import sys
from collections import namedtuple
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/flat_param.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, wire

Slice = namedtuple("Slice", "shape start stop")  # a rank's elements [start, stop) of a flattened parameter


class FlatParameter:
    """One unit's parameters as one vector of K*S elements; rank r owns elements [r*S, (r+1)*S)."""

    def __init__(self, name, names, params, slots, rank, world, param_dtype=None):
        self.name, self.names, self.slots = name, names, slots  # slots: (module, attr, index of param)
        self.shapes, self.numels = [p.shape for p in params], [p.numel() for p in params]
        self.numel, self.world, self.param_dtype = sum(self.numels), world, param_dtype
        S = self.shard_numel = -(-self.numel // world)
        dtype, device, trainable = params[0].dtype, params[0].device, params[0].requires_grad
        self.shard = torch.zeros(S, dtype=dtype, device=device)
        self.full = torch.empty(world * S, dtype=param_dtype or dtype, device=device)  # in param_dtype
        self.full.requires_grad_(trainable).untyped_storage().resize_(0)  # allocated only when gathered
        self.work = None  # (async all-gather, its input) while a gather is in flight
        starts = [0, *accumulate(self.numels)]
        # parameter i's part of my shard, clamped to it: [a, b) in shard coordinates
        self.ranges = [tuple(min(max(x - rank * S, 0), S) for x in ends) for ends in zip(starts, starts[1:])]
        self.slices = [Slice(shape, a + rank * S - o, b + rank * S - o) if b > a else Slice(shape, 0, 0)
                       for shape, o, (a, b) in zip(self.shapes, starts, self.ranges)]
        self.params = [nn.Parameter(view, trainable) for view in self.pieces(self.shard)]  # share its storage

    def pieces(self, shard_sized: torch.Tensor) -> list:
        """Each parameter's slice of a shard-sized vector: the shard itself, or a gradient shard."""
        return [shard_sized[a:b] for a, b in self.ranges]

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def attach_views(self) -> None:
        """Point each module attribute at its slice of the gathered vector (with autograd, if enabled)."""
        views = self.full[:self.numel].split(self.numels)
        for module, attr, i in self.slots:
            setattr(module, attr, views[i].view(self.shapes[i]))


# ----- ZeRO's layout of the whole model (mini_dist/zero.py): the same cut, named per rank

@dataclass(frozen=True)
class Partition:
    """Where each parameter sits in the flat vector, and which slice [lo, hi) of it each rank owns."""
    names: tuple
    shapes: tuple
    world_size: int

    @property
    def spans(self) -> list:
        ends = list(accumulate(s.numel() for s in self.shapes))
        return [(end - s.numel(), end) for end, s in zip(ends, self.shapes)]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def shard_size(self) -> int:
        return -(-self.numel // self.world_size)  # S = ceil(N / K)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_size  # Psi: at most K-1 zeros of padding at the end

    def shard(self, rank: int) -> tuple:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list:
        """(name, start, stop) of every parameter slice that falls into rank's shard."""
        lo, hi = self.shard(rank)
        return [(n, max(lo, a) - a, min(hi, b) - a) for n, (a, b) in zip(self.names, self.spans)
                if a < hi and b > lo]

    def __str__(self) -> str:
        pad = self.padded_numel - self.numel
        lines = [f"partition of N = {self.numel:,} elements over K = {self.world_size} ranks: "
                 f"shard S = {self.shard_size:,}, padding {pad}"]
        for r in range(self.world_size):
            lo, hi = self.shard(r)
            tail = f" + {min(pad, hi - lo)} padding" if hi > self.numel else ""
            parts = " ".join(f"{n}[{a}:{b}]" for n, a, b in self.pieces(r))
            lines.append(f"  rank {r}: [{lo:,}, {hi:,}) {parts}{tail}")
        return "\n".join(lines)


def flatten_into_buffer(params: list, partition: Partition) -> torch.Tensor:
    """One padded flat vector; each parameter becomes a view of it: writing the vector updates the model."""
    flat = torch.zeros(partition.padded_numel, dtype=params[0].dtype, device=params[0].device)
    for p, (a, b) in zip(params, partition.spans):
        flat[a:b].copy_(p.detach().reshape(-1))
        p.data = flat[a:b].view_as(p)
    return flat


def pick_units(root: nn.Module, wrap, param_dtype) -> list:
    """wrap: None (each child of root), module classes, submodules, or a dict from those to a unit's own
    param_dtype. Returns [(root, dtype), *(unit, its dtype) in module order]: the order of forward."""
    wrap = list(root.children()) if wrap is None else [wrap] if isinstance(wrap, (type, nn.Module)) else wrap
    policy = wrap if isinstance(wrap, dict) else dict.fromkeys(wrap, param_dtype)
    for dtype in (param_dtype, *policy.values()):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype (torch.bfloat16), not {dtype}")
    modules = {id(k): v for k, v in policy.items() if not isinstance(k, type)}
    classes = [(k, v) for k, v in policy.items() if isinstance(k, type)]
    units = [(root, modules.pop(id(root), param_dtype))]
    for m in root.modules():
        matches = [v for c, v in classes if isinstance(m, c)]
        if m is not root and (id(m) in modules or matches):
            units.append((m, modules.pop(id(m)) if id(m) in modules else matches[0]))
    if modules:
        raise ValueError("wrap names a module that is not inside the wrapped module: pass its submodules "
                         "(or their classes)")
    return units


def flatten_units(root: nn.Module, units: list, rank: int, world: int):
    """Each parameter goes to the innermost unit around it; each unit with parameters becomes a
    FlatParameter and its module attributes are emptied. -> (FlatParameters, their modules, the values)"""
    names = {id(p): n for n, p in root.named_parameters()}
    module_names = {id(m): n or "root" for n, m in root.named_modules()}
    found = {id(m): [] for m, _ in units}

    def visit(m, unit):
        unit = m if id(m) in found else unit
        found[id(unit)].extend((m, attr, p) for attr, p in m._parameters.items() if p is not None)
        for child in m.children():
            visit(child, unit)
    visit(root, root)
    flats, modules, initial, owner = [], [], {}, {}
    for m, dtype in units:
        params = list({id(p): p for _, _, p in found[id(m)]}.values())  # tied parameters once
        for p in params:
            if owner.setdefault(id(p), m) is not m:
                raise ValueError(f"parameter {names[id(p)]} is shared by units {module_names[id(m)]} and "
                                 f"{module_names[id(owner[id(p)])]}: wrap a module holding both users")
        if not params:
            continue
        if len({(p.dtype, p.requires_grad, p.device) for p in params}) > 1:
            raise ValueError(f"unit {module_names[id(m)]} mixes parameter dtypes, devices or frozen and "
                             f"trainable parameters: one flat parameter needs one kind; wrap them apart")
        index = {id(p): i for i, p in enumerate(params)}
        flats.append(FlatParameter(module_names[id(m)], [names[id(p)] for p in params], params,
                                   [(sub, attr, index[id(p)]) for sub, attr, p in found[id(m)]],
                                   rank, world, dtype))
        modules.append(m)
        initial.update({names[id(p)]: p.detach() for p in params})
        for sub, attr, _ in found[id(m)]:
            del sub._parameters[attr]  # the module keeps no full copy: only views, set before compute
    return flats, modules, initial


# ----- state dicts

def full_state_dict(units: list, to: int | None = 0, group=None) -> dict:
    """Collective: every parameter at full size on group rank `to` ({} on the others), or on every rank
    with to=None (an all-gather instead of a gather)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if to is not None and not 0 <= to < world:
        raise ValueError(f"to={to} is not a rank of the group (0..{world - 1}), nor None (every rank)")
    state = {}
    for u in units:
        flat = u.shard.new_empty(world * u.shard_numel)
        if to is None:
            wire.call(dist.all_gather_single, flat, u.shard, group=group)
        else:
            wire.call(dist.gather, u.shard, list(flat.chunk(world)) if rank == to else None, group=group, group_dst=to)
        if to is None or rank == to:  # clones: a view would make torch.save write the whole unit each time
            views = flat[:u.numel].split(u.numels)
            state.update((n, t.view(s).clone()) for n, t, s in zip(u.names, views, u.shapes))
    return state


def load_full_state_dict(units: list, state: dict | None, group=None) -> None:
    """Collective: group rank 0's full state dict (the others may pass None) -> every rank's shard."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    wrong = [f"{n} (want shape {tuple(s)})" for u in units for n, s in zip(u.names, u.shapes)
             if n not in state or tuple(state[n].shape) != tuple(s)] if rank == 0 else []
    agree(units, wrong, "state dict lacks or misshapes: {}", group)
    for u in units:
        pieces = None
        if rank == 0:
            flat = torch.cat([state[n].to(u.shard).reshape(-1) for n in u.names])
            pieces = list(torch.cat([flat, flat.new_zeros(world * u.shard_numel - u.numel)]).chunk(world))
        wire.call(dist.scatter, u.shard, pieces, group=group, group_src=0)


def sharded_state_dict(units: list) -> dict:
    """This rank's slices, no communication: {name: (1-D tensor, Slice(shape, start, stop))}."""
    return {n: (p.detach(), s) for u in units for n, p, s in zip(u.names, u.params, u.slices)}


@torch.no_grad()
def load_sharded_state_dict(units: list, state: dict, group=None) -> None:
    """Collective: each rank loads its own sharded_state_dict()."""
    wrong = [n for u in units for n, s in zip(u.names, u.slices) if n not in state
             or tuple(state[n][1]) != tuple(s) or state[n][0].shape != (s.stop - s.start,)]
    agree(units, wrong, "sharded state dict does not fit this sharding ({}): load it with the world size "
                        "and wrap it was saved with, or go through full_state_dict()", group)
    for u in units:
        for n, p in zip(u.names, u.params):
            p.copy_(state[n][0])


def agree(units: list, wrong: list, problem: str, group=None) -> None:
    """Before a load moves any data, every rank learns every rank's units and complaints and raises the
    same error, naming ranks: a mismatch would otherwise pair the collectives up wrong and hang."""
    everyone = [None] * dist.get_world_size(group)
    mine = [(u.name, u.numel, str(u.shard.dtype)) for u in units]
    wire.call(dist.all_gather_object, everyone, (mine, wrong[:3]), group=group)
    bad = [r for r, (theirs, _) in enumerate(everyone) if theirs != everyone[0][0]]
    if bad:
        raise ValueError(f"ranks {bad} built other units than rank 0 ({everyone[0][0]} vs {everyone[bad[0]][0]}): "
                         f"every rank must build the same module, same wrap")
    if any(w for _, w in everyone):
        raise ValueError(problem.format("; ".join(f"rank {r}: {', '.join(w)}" for r, (_, w) in enumerate(everyone)
                                                  if w)))


# ----- demo: who holds what, and the way back to whole tensors -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[5, 3, 2], help="widths of a Linear stack (one unit)")
    return p


def demo(args) -> int:
    launch.require(len(args.sizes) >= 2 and min(args.sizes) >= 1, "--sizes needs two or more widths >= 1")
    env = launch.setup()
    torch.manual_seed(0)  # every rank builds the same model
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(args.sizes, args.sizes[1:])]).to(env.device)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    units, _, initial = flatten_units(model, pick_units(model, (), None), env.rank, env.world_size)
    load_full_state_dict(units, initial)
    u = units[0]
    launch.print0(f"one unit of {u.numel} elements over K = {env.world_size} ranks: S = ceil({u.numel}/K) = "
                  f"{u.shard_numel}, padding {env.world_size * u.shard_numel - u.numel}")
    mine = sharded_state_dict(units)
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, {n: (t.cpu(), s) for n, (t, s) in mine.items()})
    for r, theirs in enumerate(everyone):
        launch.print0(f"  rank {r}: " + ", ".join(f"{n}[{s.start}:{s.stop}]" for n, (_, s) in theirs.items()
                                                  if s.stop > s.start))
    tiled = {n: torch.cat([theirs[n][0] for theirs in everyone]).view(shape) for n, shape in
             ((n, t.shape) for n, t in original.items())}
    full = full_state_dict(units, to=None)
    exact = all(torch.equal(full[n], t) and torch.equal(tiled[n], t.cpu()) for n, t in original.items())
    launch.print0(f"slices of every rank put end to end, and the full state dict gathered on every rank: "
                  f"{'equal' if exact else 'NOT equal'} to the model's tensors")
    stored = torch.tensor([u.shard.numel()], device=env.device)
    dist.all_reduce(stored)
    return launch.conclude("flat_param", exact, "sharded and full state dicts = the model's tensors",
                           stored.item() == env.world_size * u.shard_numel,
                           f"K shards of S: {env.world_size} x {u.shard_numel} elements stored")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
