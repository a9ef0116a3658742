"""Resharding a training state: ZeRO, FSDP and tensor-parallel parameters and optimizer state as boxes of
one set of global tensors, so that a checkpoint saved in one layout loads into another.

Every layout holds pieces of the same tensors -- each parameter and, beside it, the optimizer's
per-element state (Adam's exp_avg, exp_avg_sq; fp32 master weights) -- cut differently:

    layout      rank r holds, of a parameter at [o, o + n) of the flat vector         as boxes
    DDP         all of it (the same on every rank: rank 0 writes it)                   one tensor
    ZeRO-1/2    [o, o + n) ∩ [r*S, (r+1)*S), S = ceil(N/K): its part of the shard       flat_shard
    FSDP        the same, unit by unit (flat_param.Slice)                               flat_shard
    TP          slice r of T along the layout's dim ([q; k; v] part by part)            dim_shard

A flat range [a, b) of a row-major tensor is at most 2·ndim - 1 boxes: a partial first row, whole rows, a
partial last row (each partial row cut the same way one dim down). Saved under one naming,
model.<parameter> and optim.state.<parameter>.<key> (a plain optimizer's names), with scalars (Adam's
step) and the param groups' settings once, any layout's state is one set of global tensors, and a load
intersects boxes (checkpoint.plan). ZeRO-1 at K = 4 -> ZeRO-2 at K = 3, one parameter flattened:

        saved   |--rank 0--|--rank 1--|--rank 2--|--rank 3--|
        wanted  |---rank 0----|----rank 1----|----rank 2----|     rank 1 reads the boxes of saved 1 and 2

A ZeRO rank reads every parameter whole (each rank holds the whole model) but only its shard of the
optimizer state; an FSDP or TP rank reads about its share, b·N/K'. A layout that cuts across the saved
boxes reads more: the columns of a row-major flat range touch every saved box of it.

    torchrun --standalone --nproc_per_node=4 mini_dist/reshard.py [--steps 2 --width 24]

Mirrors torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict), which presents FSDP and
TP models and optimizers to DCP as DTensors under the parameters' fully qualified names.
"""
import os
import shutil
import sys
import tempfile
from math import prod
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/reshard.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import checkpoint
from mini_dist.kit import launch
from mini_dist.checkpoint import Sharded
from mini_dist.sharded_state import copy_settings, per_element, settings
from mini_dist.tp_layout import Layout, layouts


def flat_boxes(shape, a: int, b: int) -> list:
    """Elements [a, b) of a row-major tensor as boxes (offsets, lengths), in order, each contiguous:
    a partial first row, whole rows, a partial last row, each partial row cut the same way one dim down."""
    # exercise: the boxes of [a, b): recurse one dim down for a partial first and last row, whole rows between
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    n = prod(shape[1:])       # elements per index of dim 0
    i, j = -(-a // n), b // n  # the whole rows [i, j)
    if i > j:                 # a and b fall in one row
        return [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - j * n, b - j * n)]
    head = [((i - 1, *o), (1, *l)) for o, l in flat_boxes(shape[1:], a - (i - 1) * n, n)]
    body = [((i, *[0] * (len(shape) - 1)), (j - i, *shape[1:]))] if j > i else []
    return head + body + [((j, *o), (1, *l)) for o, l in flat_boxes(shape[1:], 0, b - j * n)]
    # end exercise


def flat_shard(data: torch.Tensor, shape, start: int) -> Sharded:
    """A 1-D `data` holding elements [start, start + len) of the flattened tensor of `shape` (a ZeRO or
    FSDP slice). The boxes are views of `data`: loading into them fills it."""
    boxes, k = [], 0
    for offsets, lengths in flat_boxes(tuple(shape), start, start + data.numel()):
        boxes.append((offsets, data[k:k + prod(lengths)].view(lengths)))
        k += prod(lengths)
    return Sharded(tuple(shape), data.dtype, tuple(boxes))


def dim_shard(local: torch.Tensor, dim: int, index: int, count: int, parts: int = 1) -> Sharded:
    """Slice `index` of `count` equal slices along `dim` (a tensor-parallel weight); with `parts`, a stacked
    [W_q; W_k; W_v] cut part by part, the rank holding slice `index` of each part."""
    # exercise: the global shape, and one box per part: part j's slice `index` starts at row (j*count + index)*m
    m, shape = local.shape[dim] // parts, list(local.shape)
    shape[dim] *= count
    at = lambda j: tuple((j * count + index) * m if d == dim else 0 for d in range(local.dim()))  # noqa: E731
    return Sharded(tuple(shape), local.dtype, tuple((at(j), local.narrow(dim, j * m, m)) for j in range(parts)))
    # end exercise


def module_layout(module, group=None) -> dict:
    """{name: (parameter, how a tensor shaped like it is sharded)}: tensor-parallel parameters by their
    tp_layout, the rest (and every parameter of a plain or DDP module) replicated."""
    where, rank, T = layouts(module), dist.get_rank(group), dist.get_world_size(group)
    cut = lambda t, L: t if L.dim is None else dim_shard(t, L.dim, rank, T, L.parts)  # noqa: E731
    return {n: (p, lambda t, L=where.get(n, Layout()): cut(t, L)) for n, p in module.named_parameters()}


def fsdp_layout(model) -> dict:
    """The same for mini_dist.fsdp: each parameter is this rank's 1-D slice [start, stop) of the flattened one,
    but for those left out of sharding (ignored_params): whole, replicated."""
    cuts = {n: lambda t, s=s: flat_shard(t, s.shape, s.start) for n, (_, s) in model.sharded_state_dict().items()}
    return {n: (p, cuts.get(n, lambda t: t)) for n, p in model.named_parameters()}


def module_state(layout: dict, optimizer=None) -> dict:
    """A checkpoint state: every parameter and, with a torch.optim optimizer over them, every per-element
    state tensor sharded like its parameter; scalars and the param groups' settings replicated."""
    state = {f"model.{n}": cut(p.detach()) for n, (p, cut) in layout.items()}
    if optimizer is not None:
        named, keys = {id(p): (n, cut) for n, (p, cut) in layout.items()}, set()
        for p, values in optimizer.state.items():
            name, cut = named[id(p)]
            for k, v in values.items():
                state[f"optim.state.{name}.{k}"] = cut(v) if per_element(v) else v
                keys |= {k} if per_element(v) else set()
        state["optim.per_element"] = sorted(keys)
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
        manifest = checkpoint.read_manifest(path)
        per = manifest["values"].get("optim.per_element", [])
        saved = manifest["values"].get("optim.param_groups", [{}] * (groups or 0))
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
    fresh = {}
    if optimizer is not None:
        named = {id(p): (n, cut) for n, (p, cut) in layout.items()}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            name, cut = named[id(p)]
            for k, (shape, dtype) in saved_keys(manifest, name).items():
                t = fresh.setdefault(i, {})[k] = torch.zeros_like(p, dtype=dtype) if k in per else torch.zeros(
                    shape, dtype=dtype)  # cpu: Adam's step, kept on the host; load_state_dict moves it if asked
                state[f"optim.state.{name}.{k}"] = cut(t) if k in per else t
        state["optim.param_groups"] = None  # replaced by the saved settings
    stats = checkpoint.load(state, path, group)
    if optimizer is not None:
        ids = iter(range(sum(len(g["params"]) for g in optimizer.param_groups)))
        optimizer.load_state_dict({"state": fresh, "param_groups": [
            {**s, "params": [next(ids) for _ in g["params"]]}
            for s, g in zip(state["optim.param_groups"], optimizer.param_groups)]})
    return stats


def zero_pieces(zero, lo: int, hi: int):
    """(name, parameter, its param group, [x, y): the part of its span [a, b) inside [lo, hi), a)."""
    group_of = [j for j, g in enumerate(zero.param_groups) for p in g["params"] if p.requires_grad]
    for name, p, j, (a, b) in zip(zero.partition.names, zero.params, group_of, zero.partition.spans):
        x = min(max(a, lo), b)
        yield name, p, j, x, max(min(b, hi), x), a


def zero_state(zero) -> dict:
    """A ZeroOptimizer (any stage) and its model: the parameters and each per-element state tensor as this
    rank's ZeRO slice [r*S, (r+1)*S) of them, scalars and settings once. (Stage 0 holds all of the state
    but writes only that slice: each element is saved by one rank.)"""
    S, r = zero.partition.shard_size, zero.rank
    state, keys = {"optim.param_groups": [settings(g) for g in zero.param_groups]}, set()
    for name, p, j, x, y, a in zero_pieces(zero, r * S, (r + 1) * S):
        cut = lambda v, base: flat_shard(v[x - base:y - base], p.shape, x - a)  # noqa: E731
        state[f"model.{name}"] = cut(zero.flat, 0)
        for k, v in zero.optimizer.state[zero.slices[j]].items():  # group j's state starts at lo + ranges[j][0]
            state[f"optim.state.{name}.{k}"] = cut(v, zero.lo + zero.ranges[j][0]) if per_element(v) else v
            keys |= {k} if per_element(v) else set()
        if zero.has_master:
            state[f"optim.state.{name}.master_param"] = cut(zero.master, zero.lo)
    return {**state, "optim.per_element": sorted(keys | ({"master_param"} if zero.has_master else set()))}


def load_zero_state(path: str, zero, group=None) -> dict:
    """Collective: a ZeroOptimizer of any stage and world size takes every parameter whole and its own
    shard of the optimizer state from checkpoint `path`, whatever layout saved it."""
    manifest, per = read_saved(path, len(zero.param_groups), group)
    own, scalars, stepped, state = {}, {}, set(), {"optim.param_groups": None}
    for name, p, j, x, y, a in zero_pieces(zero, zero.lo, zero.hi):
        state[f"model.{name}"] = flat_shard(zero.flat[a:a + p.numel()], p.shape, 0)  # every rank: all of it
        for k, (shape, dtype) in saved_keys(manifest, name).items():
            stepped.add(j)
            if k not in per:  # a ZeRO group has one step: every parameter's saved copy of it is the same
                state[f"optim.state.{name}.{k}"] = scalars.setdefault(
                    (j, k), torch.zeros(shape, dtype=dtype))  # cpu: Adam keeps its step on the CPU
            elif k != "master_param" or zero.has_master:
                vector = own.setdefault(k, torch.zeros(zero.hi - zero.lo, dtype=dtype, device=zero.flat.device))
                state[f"optim.state.{name}.{k}"] = flat_shard(vector[x - zero.lo:y - zero.lo], p.shape, x - a)
    stats = checkpoint.load(state, path, group)
    master = own.pop("master_param", None)
    if zero.has_master:
        zero.master.copy_(zero.flat[zero.lo:zero.hi] if master is None else master)
    zero.optimizer.load_state_dict({
        "state": {j: {**{k: t for (i, k), t in scalars.items() if i == j}, **{k: v[a:b] for k, v in own.items()}}
                  for j, (a, b) in enumerate(zero.ranges) if j in stepped},
        "param_groups": [{**s, "params": [j]} for j, s in enumerate(state["optim.param_groups"])]})
    copy_settings(zero.optimizer.param_groups, zero.param_groups)
    return stats


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=2, help="Adam steps before the first save")
    p.add_argument("--width", type=int, default=24, help="MLP width (tensor parallelism cuts it: a multiple of K)")
    return p


def demo(args) -> int:
    K = launch.env_world_size()
    launch.require(args.steps >= 1 and args.width >= 1 and args.width % K == 0,
                   f"--steps must be >= 1 and --width a multiple of the {K} ranks (tensor parallelism cuts it)")
    from torch import nn

    from mini_dist.fsdp import FullyShardedDataParallel
    from mini_dist.kit.models import Block, block_stack, random_batch_steps, regression_step
    from mini_dist.tensor_parallel import ParallelMLP
    from mini_dist.zero_optimizer import ZeroOptimizer
    env, w = launch.setup(), args.width
    x = [torch.randn(4, w, dtype=torch.float64, generator=torch.Generator().manual_seed(r)).to(env.device)
         for r in (env.rank, 0)]

    def zero(group, first):  # -> (state, load, tensors to compare, train)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(w, 3 * w), nn.Tanh(), nn.Linear(3 * w, w)).to(env.device, torch.float64)
        z = ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=1 if first else 2, group=group, lr=0.01)
        return (lambda: zero_state(z), lambda path: load_zero_state(path, z, group),
                lambda: [*model.parameters(), *(t for s in z.optimizer.state.values() for t in s.values())],
                lambda: random_batch_steps(model, model, z, args.steps))

    def plain(model, layout, group, x):  # data parallel: x differs across ranks; tensor parallel: the same
        adam = torch.optim.Adam(model.parameters(), lr=0.01)
        return (lambda: module_state(layout(), adam), lambda path: load_module_state(path, layout(), adam, group),
                lambda: [*model.parameters(), *(t for s in adam.state.values() for t in s.values())],
                lambda: [regression_step(model, adam, x, x) for _ in range(args.steps)])

    def fsdp(group, first):
        model = FullyShardedDataParallel(block_stack(w, 3 * w, 2, torch.float64, env.device), Block, group)
        return plain(model, lambda: fsdp_layout(model), group, x[0])

    def tp(group, first):  # T = K ranks first, then one dense process with the same parameter names
        torch.manual_seed(0)
        model = ParallelMLP(w, group=group, device=env.device, dtype=torch.float64) if first else nn.Sequential(
            nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)).to(env.device, torch.float64)
        return plain(model, lambda: module_layout(model, group), group, x[1])

    where = [tempfile.mkdtemp(prefix="mini_dist_reshard_") if env.rank == 0 else None]
    dist.broadcast_object_list(where)
    launch.print0(f"save at K = {K} after {args.steps} Adam steps (fp64, width {w}), load and save again at K', "
                  f"load back at K:")
    equal, overhead = True, {}
    for name, case, k in (("ZeRO-1 -> ZeRO-2", zero, max(1, K - 1)), ("FSDP -> FSDP", fsdp, max(1, K // 2)),
                          ("TP -> one dense process", tp, 1)):
        group, there, back = launch.new_group(range(k)), *(os.path.join(where[0], f"{name}{i}") for i in (1, 2))
        first = case(None, True)
        first[3]()
        checkpoint.save(first[0](), there)
        if env.rank < k:
            middle = case(group, False)
            stats = middle[1](there)
            checkpoint.save(middle[0](), back, group)
            overhead[name] = stats["bytes read"] / stats["bytes wanted"]
            launch.print0(f"  {name:<24} K = {K} -> {k} -> {K}: at {k} rank 0 read {stats['bytes read']:>7,} B for "
                          f"the {stats['bytes wanted']:>7,} it holds ({overhead[name]:.2f}x)", end="")
        dist.barrier()
        returned = case(None, True)
        returned[1](back)
        same = all(torch.equal(a, b) for a, b in zip(first[2](), returned[2]()))
        equal &= same
        launch.print0(f", back at K = {K}: {'bit for bit' if same else 'DIFFERENT'}")
    if env.rank == 0:
        shutil.rmtree(where[0])
    return launch.conclude("reshard", equal, "ZeRO-1 -> ZeRO-2, FSDP, TP -> dense and back: bit for bit",
                           max(overhead.values(), default=1) < 2, "bytes read / held at K': " + ", ".join(
                               f"{n.split()[0]} {x:.2f}x" for n, x in overhead.items()))


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
