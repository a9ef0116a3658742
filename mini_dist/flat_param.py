"""How FSDP stores a unit: ZeRO's flat layout (mini_dist/zero.py) for one unit's parameters, seen back per parameter.

    flat    = [p_0 | p_1 | ... | p_n-1 | 0 padding]     K*S elements, S = ceil(numel / K): a zero.Partition
    shard r = flat[r*S : (r+1)*S]                       the only part rank r stores and updates

Parameter i occupies [o_i, o_i + n_i) of flat, so rank r holds the intersection of that range with its
shard: a contiguous slice, possibly empty, possibly split between ranks. The same numbers are seen three ways:

    the shard                   what rank r stores, all-gathers from and reduce-scatters into
    one slice per parameter     an nn.Parameter that is a 1-D view of the shard, with its own .grad: what
                                the optimizer steps, and what the module holds under the parameter's name
                                between computations (attach_shards; FSDP1's use_orig_params=True)
    the full vector             gathered for compute: each module attribute becomes a view of it
                                (attach_views), a plain tensor of the parameter's shape

A unit is a module (by default each child of the wrapped one; the root takes what is left); each parameter
belongs to the innermost unit around it. Parameters left out of sharding (torch's ignored_params) stay
whole in their modules, untouched here.

Used by mini_dist/fsdp.py, which decides when to gather and free, one unit at a time (what it did and the bytes
gathered: kit/measure.UnitLedger; fsdp_ledger.py reads them); whole tensors again (state dicts):
mini_dist/fsdp_state.py. Mirrors torch.distributed.fsdp._flat_param.FlatParameter (FSDP1).

Demo (each rank's slices of a small model, the padding, the module's own parameters before and after a gather):

    torchrun --standalone --nproc_per_node=4 mini_dist/flat_param.py [--sizes 5 3 2]
"""
import sys
from collections import namedtuple
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

if not __package__:  # run as `torchrun mini_dist/flat_param.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.zero import Partition

Slice = namedtuple("Slice", "shape start stop")  # a rank's elements [start, stop) of a flattened parameter


class FlatParameter:
    """One unit's parameters as one vector of K*S elements; rank r owns elements [r*S, (r+1)*S), filled
    here from this rank's own values of the parameters."""

    def __init__(self, name, names, params, slots, rank, world, param_dtype=None):
        self.name = name      # the unit's module name ("root": the wrapped module)
        self.names = names    # its parameters' names in the wrapped module, a tied parameter once
        self.slots = slots    # (module, attribute, index into params): every place a parameter is used
        self.partition = Partition(tuple(names), tuple(p.shape for p in params), world)
        self.shapes = self.partition.shapes
        self.numels = [p.numel() for p in params]
        self.numel = self.partition.numel
        self.shard_numel = self.partition.shard_size  # S
        self.param_dtype = param_dtype  # None: compute in the parameters' own dtype
        trainable = params[0].requires_grad
        self.shard = torch.zeros(self.shard_numel, dtype=params[0].dtype, device=params[0].device)
        self.full = torch.empty(world * self.shard_numel, dtype=param_dtype or params[0].dtype,
                                device=params[0].device)
        self.full.requires_grad_(trainable).untyped_storage().resize_(0)  # allocated only when gathered
        self.work = None  # (async all-gather, its input) while a gather is in flight
        lo, _ = self.partition.shard(rank)
        owned = self.partition.owned(rank)
        self.ranges = [(a - lo, b - lo) for a, b in owned]  # parameter i's part of my shard, in the shard
        self.slices = [Slice(shape, a - o, b - o) if b > a else Slice(shape, 0, 0)  # ... and in the parameter
                       for shape, (o, _), (a, b) in zip(self.shapes, self.partition.spans, owned)]
        for p, piece, s in zip(params, self.pieces(self.shard), self.slices):
            piece.copy_(p.detach().reshape(-1)[s.start:s.stop])
        self.params = [nn.Parameter(view, trainable) for view in self.pieces(self.shard)]  # share its storage

    def pieces(self, shard_sized: torch.Tensor) -> list:
        """Each parameter's slice of a shard-sized vector: the shard itself, or a gradient shard."""
        return [shard_sized[a:b] for a, b in self.ranges]

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def attach_views(self) -> None:
        """For compute: each module attribute becomes its view of the gathered vector, in the parameter's
        shape (with autograd, if enabled), a plain tensor in place of the registered slice."""
        views = self.full[:self.numel].split(self.numels)
        for module, attr, i in self.slots:
            module._parameters.pop(attr, None)
            setattr(module, attr, views[i].view(self.shapes[i]))

    def cast(self, inputs):
        """The unit's inputs in its param_dtype: floating tensors cast, the rest (and all, without one) as is."""
        if self.param_dtype is None:
            return inputs
        return tree_map(lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t,
                        inputs)

    def attach_shards(self) -> None:
        """Between computations: each module attribute is this rank's slice again, a registered parameter."""
        for module, attr, i in self.slots:
            module.__dict__.pop(attr, None)
            module._parameters[attr] = self.params[i]


def pick_units(root: nn.Module, wrap, param_dtype) -> list:
    """wrap: None (each child of root), module classes, submodules, or a dict from those to a unit's own
    param_dtype. Returns [(root, dtype), *(unit, its dtype) in module order]: the order of forward."""
    if wrap is None:
        wrap = list(root.children())
    elif isinstance(wrap, (type, nn.Module)):
        wrap = [wrap]
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


def flatten_units(root: nn.Module, units: list, rank: int, world: int, ignored=()):
    """Each parameter not in `ignored` goes to the innermost unit around it; each unit with parameters
    becomes a FlatParameter, and its module attributes become this rank's slices of it.
    -> (FlatParameters, their modules, {name: the parameter's whole value before})"""
    names = {id(p): n for n, p in root.named_parameters()}
    module_names = {id(m): n or "root" for n, m in root.named_modules()}
    left_out = {id(p) for p in ignored}
    if not left_out <= names.keys():
        raise ValueError("ignored_params holds a tensor that is not a parameter of the wrapped module")
    found = {id(m): [] for m, _ in units}

    def visit(m, unit):
        unit = m if id(m) in found else unit
        found[id(unit)].extend((m, attr, p) for attr, p in m._parameters.items()
                               if p is not None and id(p) not in left_out)
        for child in m.children():
            visit(child, unit)
    visit(root, root)
    flats = []
    modules = []
    initial = {}
    owner = {}
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
        flat = FlatParameter(module_names[id(m)], [names[id(p)] for p in params], params,
                             [(sub, attr, index[id(p)]) for sub, attr, p in found[id(m)]], rank, world, dtype)
        flat.attach_shards()  # the module keeps no whole copy: its slices, and views while it computes
        flats.append(flat)
        modules.append(m)
        initial.update({names[id(p)]: p.detach() for p in params})
    return flats, modules, initial


# ----------------------------------------------------------------------------- demo

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
    units, _, _ = flatten_units(model, pick_units(model, (), None), env.rank, env.world_size)
    u = units[0]
    launch.print0(f"one unit of {u.numel} elements over K = {env.world_size} ranks: S = ceil({u.numel}/K) = "
                  f"{u.shard_numel}, padding {env.world_size * u.shard_numel - u.numel}")
    mine = {n: (p.detach().cpu(), s) for n, p, s in zip(u.names, u.params, u.slices)}
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    for r, theirs in enumerate(everyone):
        launch.print0(f"  rank {r}: " + ", ".join(f"{n}[{s.start}:{s.stop}]" for n, (_, s) in theirs.items()
                                                  if s.stop > s.start))
    tiled = {n: torch.cat([theirs[n][0] for theirs in everyone]).view(t.shape) for n, t in original.items()}
    registered = dict(model.named_parameters())
    launch.print0(f"model[0].weight between computations: this rank's slice, a registered nn.Parameter of shape "
                  f"{tuple(registered['0.weight'].shape)} on rank 0 (what the optimizer steps)")
    u.full.untyped_storage().resize_(u.full.nbytes)
    dist.all_gather_single(u.full.data, u.shard)  # what FSDP does before the unit computes
    u.attach_views()
    viewed = {n: getattr(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in original}
    u.attach_shards()
    launch.print0(f"model[0].weight while the unit computes: a view of the all-gathered vector, shape "
                  f"{tuple(viewed['0.weight'].shape)}")
    exact = all(torch.equal(tiled[n], t.cpu()) and torch.equal(viewed[n], t) for n, t in original.items())
    launch.print0(f"slices of every rank put end to end, and the views of the gathered vector: "
                  f"{'equal' if exact else 'NOT equal'} to the model's tensors")
    same = all(registered[n] is p for n, p in model.named_parameters()) and all(
        p is q for p, q in zip(model.parameters(), u.params))
    stored = torch.tensor([u.shard.numel()], device=env.device)
    dist.all_reduce(stored)
    return launch.conclude("flat_param", exact and same, "slices and gathered views = the model's tensors",
                           stored.item() == env.world_size * u.shard_numel,
                           f"K shards of S: {env.world_size} x {u.shard_numel} elements stored")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
