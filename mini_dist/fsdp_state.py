"""FSDP's state dicts: whole tensors under the module's own keys, loadable at any world size, or each rank's slices.

Each unit keeps only its shard (mini_dist/flat_param.py), so a state dict has to turn shards back into whole
tensors, or say where each slice belongs:

    state_dict()            every key of the unwrapped module's state_dict() (buffers, a tied parameter under
                            each of its names), each sharded parameter whole, on every rank: one all-gather
                            per unit. FSDP1's FULL_STATE_DICT; torch's get_model_state_dict(model,
                            StateDictOptions(full_state_dict=True))
    load_state_dict(sd)     every rank passes the same whole tensors and copies its own slices out of them:
                            no communication, so the dict may come from any world size and wrap, or from the
                            plain module (and the plain module loads ours)
    full_state_dict(to=0)   the same tensors on one rank only, by a gather (FSDP1's rank0_only=True)
    sharded_state_dict()    {name: (this rank's 1-D slice, Slice(shape, start, stop))}, no communication;
                            with optimizer.state_dict() of the same rank, a checkpoint that every rank writes,
                            for the same world size and wrap (FSDP1's SHARDED_STATE_DICT; FSDP2's DTensors
                            carry the same placement). Resharding it: mini_dist/reshard.py

    torch.save(model.state_dict(), path)           # every rank holds the same dict: rank 0 writes it
    model.load_state_dict(torch.load(path))        # on every rank of a model sharded over any K'

Parameters left out of sharding (ignored_params) and buffers are whole on every rank: state_dict() holds them
as the module does, sharded_state_dict() only the sharded parameters. A load first checks, on every rank,
that every rank's tensors fit, and all raise the same error: one rank raising alone would leave the others
waiting in their next collective.

    torchrun --standalone --nproc_per_node=4 mini_dist/fsdp_state.py [--sizes 6 5 4]
"""
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

if not __package__:  # run as `torchrun mini_dist/fsdp_state.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.flat_param import flatten_units, pick_units
from mini_dist.kit import launch, wire


def state_dict(module: nn.Module, units: list, group=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """Collective: module.state_dict() with every sharded parameter whole, on every rank of `group`."""
    full = full_state_dict(units, to=None, group=group)
    whole = {id(p): full[n] for u in units for n, p in zip(u.names, u.params)}
    state = module.state_dict(prefix=prefix, keep_vars=True)  # this rank's slices, by identity
    for key, value in state.items():
        if id(value) in whole:
            state[key] = whole[id(value)]
        elif not keep_vars:
            state[key] = value.detach()
    return state


def load_state_dict(module: nn.Module, units: list, state: dict, strict: bool = True, group=None):
    """Collective: every rank passes the same state_dict() (whole tensors); each copies its own slices out of
    it, and the module loads the rest itself. -> (missing keys, unexpected keys), as nn.Module's."""
    expected = module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{n} (want shape {tuple(s.shape)}, got {tuple(state[n].shape)})"
             for u in units for n, s in zip(u.names, u.slices) if n in state and state[n].shape != s.shape]
    if strict and missing:
        wrong.append(f"missing keys {missing[:3]}")
    if strict and unexpected:
        wrong.append(f"unexpected keys {unexpected[:3]}")
    agree(units, wrong, "state dict does not fit the module ({}): pass the state_dict() of the same model, "
                        "or strict=False to skip what is missing", group)
    sharded = set()
    with torch.no_grad():
        for u in units:
            for n, p, s in zip(u.names, u.params, u.slices):
                sharded.add(id(p))
                if n in state:
                    p.copy_(state[n].reshape(-1)[s.start:s.stop])
    module.load_state_dict({k: v for k, v in state.items() if k in expected and id(expected[k]) not in sharded},
                           strict=False)
    return _IncompatibleKeys(missing, unexpected)


def full_state_dict(units: list, to: int | None = 0, group=None) -> dict:
    """Collective: every sharded parameter at full size on group rank `to` ({} on the others), or on every
    rank with to=None (an all-gather instead of a gather)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
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


def load_full_state_dict(units: list, state: dict | None, group=None, whole=()) -> None:
    """Collective: group rank 0's full_state_dict() (the others may pass None) -> every rank's shard; `whole`,
    parameters left out of sharding, get rank 0's values by a broadcast."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    wrong = []
    if rank == 0:
        wrong = [f"{n} (want shape {tuple(s)})" for u in units for n, s in zip(u.names, u.shapes)
                 if n not in state or tuple(state[n].shape) != tuple(s)]
    agree(units, wrong, "state dict lacks or misshapes: {}", group, whole)
    for u in units:
        pieces = None
        if rank == 0:
            flat = torch.cat([state[n].to(u.shard).reshape(-1) for n in u.names])
            pieces = list(torch.cat([flat, flat.new_zeros(world * u.shard_numel - u.numel)]).chunk(world))
        wire.call(dist.scatter, u.shard, pieces, group=group, group_src=0)
    for p in whole:
        wire.call(dist.broadcast, p.detach(), group=group, group_src=0)


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


def agree(units: list, wrong: list, problem: str, group=None, whole=()) -> None:
    """Before a load moves any data, every rank learns every rank's units (and the shapes of the parameters
    kept `whole`) and complaints, and raises the same error, naming ranks: a mismatch would otherwise pair
    the collectives up wrong and hang."""
    everyone = [None] * dist.get_world_size(group)
    mine = [(u.name, u.numel, str(u.shard.dtype)) for u in units] + [tuple(p.shape) for p in whole]
    wire.call(dist.all_gather_object, everyone, (mine, wrong[:3]), group=group)
    bad = [r for r, (theirs, _) in enumerate(everyone) if theirs != everyone[0][0]]
    if bad:
        raise ValueError(f"ranks {bad} built other units than rank 0 ({everyone[0][0]} vs {everyone[bad[0]][0]}): "
                         f"every rank must build the same module, same wrap")
    if any(w for _, w in everyone):
        raise ValueError(problem.format("; ".join(f"rank {r}: {', '.join(w)}" for r, (_, w) in enumerate(everyone)
                                                  if w)))


class StateDicts:
    """The state-dict methods of FSDP's wrapper (mini_dist/fsdp.py), read from its `module`, `units` and
    `group`, as torch's FSDPModule adds its own to a module."""

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Collective: the unwrapped module's state dict, every parameter whole, on every rank."""
        state = state_dict(self.module, self.units, self.group, prefix, keep_vars)
        if destination is None:
            return state
        destination.update(state)  # a parent module's state_dict() collects into one dict
        return destination

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Collective: every rank passes the same state_dict() (whole tensors) of any world size and wrap."""
        return load_state_dict(self.module, self.units, state_dict, strict, self.group)

    def full_state_dict(self, to: int | None = 0) -> dict:
        """Collective: the sharded parameters whole on group rank `to` ({} elsewhere), or every rank (None)."""
        return full_state_dict(self.units, to, self.group)

    def load_full_state_dict(self, state: dict | None) -> None:
        """Collective: group rank 0's full_state_dict() (the others may pass None) -> every rank's shard."""
        load_full_state_dict(self.units, state, self.group)

    def sharded_state_dict(self) -> dict:
        """This rank's slices of the sharded parameters; with optimizer.state_dict() of the same rank, a
        checkpoint for the same world size and wrap. No communication."""
        return sharded_state_dict(self.units)

    def load_sharded_state_dict(self, state: dict) -> None:
        """Collective: each rank loads its own sharded_state_dict()."""
        load_sharded_state_dict(self.units, state, self.group)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[6, 5, 4], help="widths of a Linear stack, a unit each")
    return p


def sharded(sizes: list, seed: int, group=None):
    """A Linear stack from torch.manual_seed(seed), each Linear a unit, sharded over `group`. -> (model, units)"""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]).to(launch.device())
    units, _, initial = flatten_units(model, pick_units(model, None, None), dist.get_rank(group),
                                      dist.get_world_size(group))
    load_full_state_dict(units, initial if dist.get_rank(group) == 0 else None, group)
    return model, units


def demo(args) -> int:
    launch.require(len(args.sizes) >= 2 and min(args.sizes) >= 1, "--sizes needs two or more widths >= 1")
    env = launch.setup()
    K = env.world_size
    smaller = max(1, K - 1)
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(args.sizes, args.sizes[1:])]).to(env.device)
    model, units = sharded(args.sizes, seed=0)
    launch.print0(f"K = {K}: model[0].weight between computations is rank 0's slice, shape "
                  f"{tuple(model[0].weight.shape)}; model.state_dict() would hold slices like it")
    saved = state_dict(model, units)
    where = [os.path.join(tempfile.mkdtemp(prefix="mini_dist_fsdp_state_"), "model.pt") if env.rank == 0 else None]
    dist.broadcast_object_list(where)
    if env.rank == 0:
        torch.save(saved, where[0])
    dist.barrier()
    group = launch.new_group(range(smaller))  # every rank creates it; the first K' = K-1 use it
    same_keys = list(saved) == list(plain.state_dict())
    exact = same_keys and all(torch.equal(saved[k], v) for k, v in plain.state_dict().items())
    launch.print0(f"state_dict(): {len(saved)} keys, the plain module's, each whole: "
                  + ", ".join(f"{k} {tuple(v.shape)}" for k, v in list(saved.items())[:2]) + ", ...")
    if env.rank < smaller:
        fresh, fresh_units = sharded(args.sizes, seed=1, group=group)  # other values, K' ranks
        loaded = torch.load(where[0], map_location=env.device)
        result = load_state_dict(fresh, fresh_units, loaded, group=group)
        again = state_dict(fresh, fresh_units, group=group)
        exact &= not result.missing_keys and all(torch.equal(again[k], v) for k, v in saved.items())
        plain.load_state_dict(loaded)  # and the plain module takes the file as it is
    slices = sum(p.numel() for p, _ in sharded_state_dict(units).values())
    counts = torch.tensor([slices, exact], device=env.device)
    dist.all_reduce(counts)
    N = sum(u.numel for u in units)
    launch.print0(f"saved at K = {K}, loaded at K' = {smaller} into another initialisation and into the plain "
                  f"module: {'equal' if counts[1] == K else 'NOT equal'}; sharded_state_dict(): {slices} of "
                  f"N = {N} elements on rank 0, {counts[0].item()} on all ranks together")
    if env.rank == 0:
        os.remove(where[0])
        os.rmdir(os.path.dirname(where[0]))
    return launch.conclude("fsdp_state", counts[1].item() == K, f"torch.save(state_dict()) at K = {K} loads at "
                           f"K' = {smaller} and into the plain module", counts[0].item() == N,
                           f"the ranks' slices hold each of the N = {N} elements once")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
