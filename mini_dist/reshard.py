"""Resharding a training state: FSDP and tensor-parallel parameters and optimizer state as boxes of one set of
global tensors, so that a checkpoint saved in one layout loads into another.

Every layout holds pieces of the same tensors -- each parameter and, beside it, the optimizer's
per-element state (Adam's exp_avg, exp_avg_sq; fp32 master weights) -- cut differently:

    layout      rank r holds, of a parameter at [o, o + n) of the flat vector         as boxes
    DDP         all of it (the same on every rank: rank 0 writes it)                   one tensor
    ZeRO-1/2    [o, o + n) ∩ [r*S, (r+1)*S), S = ceil(N/K): its part of the shard       flat_shard (reshard_zero.py)
    FSDP        the same, unit by unit (flat_param.Slice)                               flat_shard
    TP          slice r of T along the layout's dim ([q; k; v] part by part)            dim_shard

A flat range [a, b) of a row-major tensor is at most 2·ndim - 1 contiguous boxes (flat_boxes). Saved under one
naming, model.<parameter> and optim.state.<parameter>.<key> (a plain optimizer's names), with scalars (Adam's
step) and the param groups' settings once, any layout's state is one set of global tensors, and a load intersects
boxes (checkpoint_plan.plan). FSDP at K = 4 -> K' = 3, one parameter flattened:

        saved   |--rank 0--|--rank 1--|--rank 2--|--rank 3--|
        wanted  |---rank 0----|----rank 1----|----rank 2----|     rank 1 reads the boxes of saved 1 and 2

so an FSDP or TP rank reads about its share, b·N/K'; one that cut across the saved boxes would read more.

    torchrun --standalone --nproc_per_node=4 mini_dist/reshard.py [--steps 2 --width 24]

Mirrors torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict), which presents FSDP and
TP models and optimizers to DCP as DTensors under the parameters' fully qualified names.
"""
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from math import prod
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/reshard.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import checkpoint
from mini_dist.checkpoint_plan import Sharded
from mini_dist.kit import launch
from mini_dist.manifest import read_manifest
from mini_dist.sharded_state import per_element
from mini_dist.tp_layout import Layout, layouts
from mini_dist.zero_optimizer import settings


def flat_boxes(shape, a: int, b: int) -> list:
    """Elements [a, b) of a row-major tensor as at most 2·ndim - 1 contiguous boxes (offsets, lengths), in order."""
    # exercise: boxes (offsets, lengths), one of each per dim, inside the tensor, each contiguous in row-major order,
    #   holding [a, b) in order, each element once ([] if a == b; [((), ())] for 0-dim); at most 2·ndim - 1 hold any
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    n = prod(shape[1:])  # elements per index of dim 0
    i = -(-a // n)       # the whole rows are [i, j)
    j = b // n
    if i > j:            # a and b fall in one row
        return [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - j * n, b - j * n)]
    head = [((i - 1, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - (i - 1) * n, n)]
    body = [((i, *[0] * (len(shape) - 1)), (j - i, *shape[1:]))] if j > i else []
    return head + body + [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], 0, b - j * n)]
    # end exercise


def flat_shard(data: torch.Tensor, shape, start: int) -> Sharded:
    """A 1-D `data` holding elements [start, start + len) of the flattened tensor of `shape` (a ZeRO or
    FSDP slice). The boxes are views of `data`: loading into them fills it."""
    boxes = []
    k = 0  # where the next box starts in data
    for offsets, lengths in flat_boxes(tuple(shape), start, start + data.numel()):
        boxes.append((offsets, data[k:k + prod(lengths)].view(lengths)))
        k += prod(lengths)
    return Sharded(tuple(shape), data.dtype, tuple(boxes))


def dim_shard(local: torch.Tensor, dim: int, index: int, count: int, parts: int = 1) -> Sharded:
    """Slice `index` of `count` along `dim` of each of `parts` stacked parts ([W_q; W_k; W_v]): a TP weight."""
    # exercise: return Sharded(global shape, local.dtype, boxes). The global tensor is `parts` equal parts along
    #   dim, each cut in `count` equal slices; local stacks slice `index` of each part, in part order. Each box's
    #   data is a view of local, its offsets where that data sits in the global tensor; each element of local once
    m = local.shape[dim] // parts  # this rank's rows of one part
    shape = list(local.shape)
    shape[dim] *= count
    boxes = []
    for j in range(parts):
        offsets = [0] * local.dim()
        offsets[dim] = (j * count + index) * m
        boxes.append((tuple(offsets), local.narrow(dim, j * m, m)))
    return Sharded(tuple(shape), local.dtype, tuple(boxes))
    # end exercise


# ----- a module's parameters and a torch.optim optimizer's state, in any of these layouts

def replicated(t: torch.Tensor) -> torch.Tensor:
    """A tensor every rank holds whole (DDP, a plain module, what TP leaves whole): rank 0 writes it."""
    return t


def tp_cut(t: torch.Tensor, layout: Layout, rank: int, T: int):
    """A tensor shaped like a tensor-parallel parameter: this rank's slice of it as boxes, or whole."""
    return replicated(t) if layout.dim is None else dim_shard(t, layout.dim, rank, T, layout.parts)


def module_layout(module, group=None) -> dict:
    """{name: (parameter, how a tensor shaped like it is sharded)}: tensor-parallel parameters by their
    tp_layout, the rest (and every parameter of a plain or DDP module) replicated."""
    where = layouts(module)
    rank = dist.get_rank(group)
    T = dist.get_world_size(group)
    return {n: (p, partial(tp_cut, layout=where.get(n, Layout()), rank=rank, T=T))
            for n, p in module.named_parameters()}


def fsdp_layout(model) -> dict:
    """The same for mini_dist.fsdp: each parameter is this rank's 1-D slice [start, stop) of the flattened one,
    but for those left out of sharding (ignored_params): whole, replicated."""
    slices = {n: s for n, (_, s) in model.sharded_state_dict().items()}
    layout = {}
    for n, p in model.named_parameters():
        s = slices.get(n)
        layout[n] = (p, replicated if s is None else partial(flat_shard, shape=s.shape, start=s.start))
    return layout


def module_state(layout: dict, optimizer=None) -> dict:
    """A checkpoint state: every parameter and, with a torch.optim optimizer over them, every per-element
    state tensor sharded like its parameter; scalars and the param groups' settings replicated."""
    state = {f"model.{n}": cut(p.detach()) for n, (p, cut) in layout.items()}
    if optimizer is not None:
        named = {id(p): (n, cut) for n, (p, cut) in layout.items()}
        for p, values in optimizer.state.items():
            name, cut = named[id(p)]
            for k, v in values.items():
                state[f"optim.state.{name}.{k}"] = cut(v) if per_element(v) else v
        state["optim.per_element"] = sorted({k for values in optimizer.state.values()
                                             for k, v in values.items() if per_element(v)})
        state["optim.param_groups"] = [settings(g) for g in optimizer.param_groups]
    return state


def saved_keys(manifest: dict, name: str) -> dict:
    """{optimizer state key: (shape, dtype)} saved for parameter `name`."""
    prefix = f"optim.state.{name}."
    return {k[len(prefix):]: (tuple(shape), getattr(torch, dtype)) for k, (shape, dtype) in
            manifest["tensors"].items() if k.startswith(prefix) and "." not in k[len(prefix):]}


def read_saved(path: str, groups: int | None, group=None) -> tuple:
    """Collective: the checked manifest and its list of per-element state keys, once every rank found them
    and `groups` param groups' settings (None: no optimizer) in it; else CheckpointError on every rank."""
    def read():
        manifest = read_manifest(path)
        per = manifest["values"].get("optim.per_element", [])
        none_saved = [{} for _ in range(groups or 0)]  # then checkpoint.load names what is missing
        saved = manifest["values"].get("optim.param_groups", none_saved)
        if not (isinstance(per, list) and all(isinstance(k, str) for k in per) and groups in (None, len(saved))
                and all(isinstance(s, dict) and all(isinstance(k, str) for k in s) for s in saved)):
            raise ValueError(f"checkpoint {path} refused: objects optim.per_element and optim.param_groups are not "
                             f"a list of names and {groups} param groups' settings")
        return manifest, per
    return checkpoint.everyone(f"cannot load {path}", read, group)


def load_module_state(path: str, layout: dict, optimizer=None, group=None) -> dict:
    """Collective: parameters in place, and the optimizer's state (built fresh, each per-element tensor
    shaped like its local parameter) from checkpoint `path`, whatever layout and world size saved it."""
    manifest, per = read_saved(path, optimizer and len(optimizer.param_groups), group)
    state = {f"model.{n}": cut(p.detach()) for n, (p, cut) in layout.items()}
    fresh = {}  # the optimizer's state dict to be: {parameter's index: {key: tensor}}
    if optimizer is not None:
        named = {id(p): (n, cut) for n, (p, cut) in layout.items()}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            name, cut = named[id(p)]
            for k, (shape, dtype) in saved_keys(manifest, name).items():
                if k in per:
                    t = torch.zeros_like(p, dtype=dtype)
                    state[f"optim.state.{name}.{k}"] = cut(t)
                else:
                    t = torch.zeros(shape, dtype=dtype)  # cpu: Adam keeps its step on the host
                    state[f"optim.state.{name}.{k}"] = t
                fresh.setdefault(i, {})[k] = t
        state["optim.param_groups"] = None  # replaced by the saved settings
    stats = checkpoint.load(state, path, group)
    if optimizer is not None:
        groups = []
        first = 0  # the index of the group's first parameter in the state dict
        for saved, g in zip(state["optim.param_groups"], optimizer.param_groups):
            groups.append({**saved, "params": list(range(first, first + len(g["params"])))})
            first += len(g["params"])
        optimizer.load_state_dict({"state": fresh, "param_groups": groups})
    return stats


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=2, help="Adam steps before the first save")
    p.add_argument("--width", type=int, default=24, help="MLP width (tensor parallelism cuts it: a multiple of K)")
    return p


@dataclass
class Trained:
    """A model, its layout (fsdp_layout or module_layout, bound to it) and its Adam."""
    model: nn.Module
    layout: partial
    adam: torch.optim.Optimizer

    def tensors(self) -> list:
        """What must come back bit for bit: the parameters, and Adam's state (its step on the host)."""
        return [*self.model.parameters(), *(t for s in self.adam.state.values() for t in s.values())]


def demo(args) -> int:
    from mini_dist.fsdp import FullyShardedDataParallel
    from mini_dist.kit.models import Block, block_stack, regression_step
    from mini_dist.tensor_parallel import ParallelMLP
    K = launch.env_world_size()
    w = args.width
    launch.require(args.steps >= 1 and w >= 1 and w % K == 0,
                   f"--steps must be >= 1 and --width a multiple of the {K} ranks (tensor parallelism cuts it)")
    env = launch.setup()

    def fsdp(group, first):  # K ranks, then K // 2
        model = FullyShardedDataParallel(block_stack(w, 3 * w, 2, torch.float64, env.device), Block, group)
        return Trained(model, partial(fsdp_layout, model), torch.optim.Adam(model.parameters(), lr=0.01))

    def tp(group, first):  # T = K ranks first, then one dense process with the same parameter names
        torch.manual_seed(0)
        if first:
            model = ParallelMLP(w, group=group, device=env.device, dtype=torch.float64)
        else:
            model = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)).to(env.device, torch.float64)
        return Trained(model, partial(module_layout, model, group), torch.optim.Adam(model.parameters(), lr=0.01))

    where = [tempfile.mkdtemp(prefix="mini_dist_reshard_") if env.rank == 0 else None]
    dist.broadcast_object_list(where)
    launch.print0(f"save at K = {K} after {args.steps} Adam steps (fp64, width {w}), load and save at K', load at K:")
    equal = True
    overhead = {}
    for name, case, k, seed in (("FSDP -> FSDP", fsdp, max(1, K // 2), env.rank), ("TP -> dense", tp, 1, 0)):
        group = launch.new_group(range(k))
        there = os.path.join(where[0], f"{name} at K'")
        back = os.path.join(where[0], f"{name} back")
        x = torch.randn(4, w, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(env.device)
        first = case(None, True)
        for _ in range(args.steps):  # data parallel: each rank its own x; tensor parallel: the same
            regression_step(first.model, first.adam, x, x)
        checkpoint.save(module_state(first.layout(), first.adam), there)
        if env.rank < k:
            middle = case(group, False)
            stats = load_module_state(there, middle.layout(), middle.adam, group)
            checkpoint.save(module_state(middle.layout(), middle.adam), back, group)
            overhead[name] = stats["bytes read"] / stats["bytes wanted"]
            launch.print0(f"  {name:<12} K = {K} -> {k} -> {K}: at {k} rank 0 read {stats['bytes read']:>7,} B for "
                          f"the {stats['bytes wanted']:>7,} it holds ({overhead[name]:.2f}x)", end="")
        dist.barrier()
        returned = case(None, True)
        load_module_state(back, returned.layout(), returned.adam)
        same = all(torch.equal(a, b) for a, b in zip(first.tensors(), returned.tensors()))
        equal = equal and same
        launch.print0(f", back at K = {K}: {'bit for bit' if same else 'DIFFERENT'}")
    if env.rank == 0:
        shutil.rmtree(where[0])
    return launch.conclude("reshard", equal, "FSDP K -> K // 2, TP -> dense and back: bit for bit",
                           max(overhead.values(), default=1) < 2, "bytes read / held at K': " + ", ".join(
                               f"{n.split()[0]} {x:.2f}x" for n, x in overhead.items()))


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
