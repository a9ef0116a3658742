"""Resharding ZeRO: a ZeroOptimizer's parameters and optimizer state as boxes, loadable at any stage and world size.

ZeRO (mini_dist/zero.py) keeps every parameter whole on every rank but cuts the optimizer state of the
model's flat vector of N elements into K padded shards: rank r steps elements [r*S, (r+1)*S), S = ceil(N/K).
Saved as boxes of global tensors under a plain optimizer's names (mini_dist/reshard.py: model.<parameter>,
optim.state.<parameter>.<key>), that state loads into ZeRO of another stage on another number of ranks,
or into FSDP, tensor parallelism or one process with a plain torch.optim optimizer:

    save   rank r writes, of each parameter at [a, b) of the flat vector, its part [x, y) = [a, b) ∩
           [r*S, (r+1)*S): the parameter's elements, and each per-element state tensor's (exp_avg,
           exp_avg_sq, fp32 master weights) as flat_shard boxes; a scalar (Adam's step) with each parameter,
           a frozen parameter once. Stage 0 holds all of the state but writes only its part: each element once.
    load   every rank reads every parameter whole, and of the state only its new shard [lo, hi).

So a ZeRO rank reads b·N of parameters where FSDP reads b·N/K', plus its 1/K' of the state; and the saved
boxes its shard cuts at either end are read whole (their crc32 covers the whole box).

    torchrun --standalone --nproc_per_node=4 mini_dist/reshard_zero.py [--steps 2 --width 24]

Mirrors DeepSpeed's universal checkpoint (ZeRO shards as whole per-parameter tensors, loadable at another
data-parallel degree), where torch's ZeroRedundancyOptimizer consolidates the state on one rank instead
(mini_dist/sharded_state.py).
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/reshard_zero.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import checkpoint
from mini_dist.kit import launch
from mini_dist.kit.models import mlp, random_batch_steps
from mini_dist.reshard import flat_shard, load_module_state, module_layout, read_saved, saved_keys
from mini_dist.sharded_state import consolidated_state_dict, per_element
from mini_dist.zero_optimizer import ZeroOptimizer, copy_settings, settings


def zero_pieces(zero, lo: int, hi: int):
    """Per parameter: its name, itself, its param group j, where its span [a, b) of the flat vector starts,
    and [x, y): the part of the span inside [lo, hi) (empty, x = y, if none)."""
    group_of = [j for j, g in enumerate(zero.param_groups) for p in g["params"] if p.requires_grad]
    for name, p, j, (a, b) in zip(zero.partition.names, zero.params, group_of, zero.partition.spans):
        x = min(max(a, lo), b)
        y = max(min(b, hi), x)
        yield name, p, j, a, x, y


def frozen(zero):
    """(name, parameter) of each named parameter in the ZeroOptimizer's groups that it does not step: not in
    its flat vector, the same on every rank, saved once, as DDP's are."""
    for g in zero.param_groups:
        for name, p in zip(g.get("param_names") or [None] * len(g["params"]), g["params"]):
            if name is not None and not p.requires_grad:
                yield name, p


def zero_state(zero) -> dict:
    """A ZeroOptimizer (any stage) and its model: the parameters and each per-element state tensor as this
    rank's ZeRO slice [r*S, (r+1)*S) of them, scalars, settings and frozen parameters once. (Stage 0 holds
    all of the state but writes only that slice: each element is saved by one rank.)"""
    S = zero.partition.shard_size
    state = {"optim.param_groups": [settings(g) for g in zero.param_groups]}
    keys = {"master_param"} if zero.has_master else set()  # the per-element ones
    for name, p, j, a, x, y in zero_pieces(zero, zero.rank * S, (zero.rank + 1) * S):
        state[f"model.{name}"] = flat_shard(zero.flat[x:y], p.shape, x - a)
        base = zero.lo + zero.ranges[j][0]  # where group j's optimizer state starts in the flat vector
        for k, v in zero.optimizer.state[zero.slices[j]].items():
            if per_element(v):
                state[f"optim.state.{name}.{k}"] = flat_shard(v[x - base:y - base], p.shape, x - a)
                keys.add(k)
            else:  # a scalar (Adam's step), the same for every parameter of the group
                state[f"optim.state.{name}.{k}"] = v
        if zero.has_master:
            master = zero.master[x - zero.lo:y - zero.lo]
            state[f"optim.state.{name}.master_param"] = flat_shard(master, p.shape, x - a)
    for name, p in frozen(zero):
        state[f"model.{name}"] = p.detach()
    state["optim.per_element"] = sorted(keys)
    return state


def load_zero_state(path: str, zero, group=None) -> dict:
    """Collective: a ZeroOptimizer of any stage and world size takes every parameter whole (frozen ones too)
    and its own shard of the optimizer state from checkpoint `path`, whatever layout saved it."""
    manifest, per = read_saved(path, len(zero.param_groups), group)
    own = {}         # per-element state: {key: this rank's [lo, hi) of it}
    scalars = {}     # {(param group, key): the group's one value}
    stepped = set()  # the param groups with saved state
    state = {"optim.param_groups": None}  # replaced by the saved settings
    for name, p, j, a, x, y in zero_pieces(zero, zero.lo, zero.hi):
        state[f"model.{name}"] = flat_shard(zero.flat[a:a + p.numel()], p.shape, 0)  # every rank: all of it
        for k, (shape, dtype) in saved_keys(manifest, name).items():
            stepped.add(j)
            if k not in per:  # a ZeRO group has one step: every parameter's saved copy of it is the same
                step = scalars.setdefault((j, k), torch.zeros(shape, dtype=dtype))  # cpu: Adam keeps it on the host
                state[f"optim.state.{name}.{k}"] = step
            elif k != "master_param" or zero.has_master:
                vector = own.setdefault(k, torch.zeros(zero.hi - zero.lo, dtype=dtype, device=zero.flat.device))
                state[f"optim.state.{name}.{k}"] = flat_shard(vector[x - zero.lo:y - zero.lo], p.shape, x - a)
    for name, p in frozen(zero):
        state[f"model.{name}"] = p.detach()
    stats = checkpoint.load(state, path, group)
    master = own.pop("master_param", None)
    if zero.has_master:
        zero.master.copy_(zero.flat[zero.lo:zero.hi] if master is None else master)
    shards = {}  # the inner optimizer's state: one "parameter" per param group, this rank's slice of it
    for j, (lo, hi) in enumerate(zero.ranges):
        if j in stepped:
            shards[j] = {k: t for (i, k), t in scalars.items() if i == j}
            shards[j].update({k: v[lo:hi] for k, v in own.items()})
    settings_saved = [{**s, "params": [j]} for j, s in enumerate(state["optim.param_groups"])]
    zero.optimizer.load_state_dict({"state": shards, "param_groups": settings_saved})
    copy_settings(zero.optimizer.param_groups, zero.param_groups)
    return stats


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--steps", type=int, default=2, help="Adam steps before the save")
    p.add_argument("--width", type=int, default=24, help="MLP width")
    return p


def zero_adam(width: int, stage: int, group=None, seed: int = 0) -> tuple:
    """An MLP (fp64, from `seed`) and a ZeroOptimizer of `stage` with Adam over it, on `group`."""
    model = mlp([width, 3 * width, width], seed=seed).to(launch.device())
    return model, ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage, group=group, lr=0.01)


def same_state(model, state: dict, other_model, other: dict) -> bool:
    """Two models' parameters and two optimizers' torch.optim states ({parameter: {key: value}}), bit for bit."""
    if state.keys() != other.keys() or any(state[i].keys() != other[i].keys() for i in state):
        return False
    params = all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))
    return params and all(torch.equal(v, other[i][k]) for i, s in state.items() for k, v in s.items())


def demo(args) -> int:
    launch.require(args.steps >= 1 and args.width >= 1, "--steps and --width must be >= 1")
    env = launch.setup()
    K = env.world_size
    k = max(1, K - 1)
    model, zero = zero_adam(args.width, 1)
    random_batch_steps(model, model, zero, args.steps)
    saved = consolidated_state_dict(zero)["state"]  # torch.optim's state dict of the whole, on every rank
    where = [tempfile.mkdtemp(prefix="mini_dist_reshard_zero_") if env.rank == 0 else None]
    dist.broadcast_object_list(where)
    path = os.path.join(where[0], "zero1")
    checkpoint.save(zero_state(zero), path)
    launch.print0(f"ZeRO-1 with Adam at K = {K} after {args.steps} steps (fp64, width {args.width}), saved; loaded")
    fewer = launch.new_group(range(k))
    one = launch.new_group([0])
    same = True
    overhead = torch.zeros((), dtype=torch.float64, device=env.device)  # the most any rank reads for what it holds
    if env.rank < k:  # another stage, other ranks, another seed: all it holds must come from the checkpoint
        other, zero2 = zero_adam(args.width, 2, fewer, seed=1)
        stats = load_zero_state(path, zero2, fewer)
        same = same_state(model, saved, other, consolidated_state_dict(zero2)["state"])
        overhead.fill_(stats["bytes read"] / stats["bytes wanted"])
        launch.print0(f"  as ZeRO-2 at K' = {k}: {'bit for bit' if same else 'DIFFERENT'}; rank 0 read "
                      f"{stats['bytes read']:,} B for the {stats['bytes wanted']:,} it holds")
    dist.all_reduce(overhead, op=dist.ReduceOp.MAX)
    if env.rank == 0:  # and in one process, into a plain model and torch.optim.Adam
        plain = mlp([args.width, 3 * args.width, args.width], seed=2).to(env.device)
        adam = torch.optim.Adam(plain.parameters(), lr=0.01)
        load_module_state(path, module_layout(plain, one), adam, one)
        alone = same_state(model, saved, plain, adam.state_dict()["state"])
        same = same and alone
        launch.print0(f"  as a plain model and torch's Adam, one process: {'bit for bit' if alone else 'DIFFERENT'}")
        shutil.rmtree(where[0])
    return launch.conclude("reshard_zero", same, f"ZeRO-1 at {K} -> ZeRO-2 at {k}, and -> plain Adam: bit for bit",
                           overhead.item() < 2, f"bytes read / held at K' = {k}: at most {overhead.item():.2f}x")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
