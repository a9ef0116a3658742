"""Checkpointing a sharded optimizer: every rank's shard of the state, put together into the state dict a
plain torch.optim optimizer has, and cut apart again on loading (mini_dist.zero's ZeroOptimizer).

A ZeRO rank r holds, for each per-element state tensor (Adam's exp_avg and exp_avg_sq, SGD's momentum,
fp32 master weights), the S = ceil(N/K) elements [r*S, (r+1)*S) of the model's padded flat vector, one
slice per param group; scalars (Adam's step) are the same on every rank. torch.optim's state dict is
per parameter. So, per state tensor:

    consolidate:  gather the K shards of S into the flat vector of Psi = K*S, cut it at the parameters'
                  spans (the last K*S - N elements are padding and vanish)
    load:         lay each parameter's tensor at its span in a flat vector, keep my [r*S, (r+1)*S)

A consolidated checkpoint (consolidated_state_dict(zero, to), load_consolidated_state_dict(zero, state,
src)) holds b*N bytes per state tensor and loads at any world size and any stage, or into a plain
optimizer; each rank's own shard (shard_state_dict(zero), load_shard_state_dict(zero, shard)) holds
b*S = b*N/K bytes and needs no communication, but loads only into the same rank of the same partition.

    torchrun --standalone --nproc_per_node=4 mini_dist/sharded_state.py [--stage 2] [--steps 2]

Mirrors ZeroRedundancyOptimizer.consolidate_state_dict(to) / state_dict(), and FSDP's full versus
sharded optimizer state dicts (torch.distributed.checkpoint.state_dict).
"""
import io
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/sharded_state.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, models, wire
from mini_dist.zero_optimizer import ZeroOptimizer, copy_settings, settings


def per_element(value) -> bool:
    """Per-element state (exp_avg, momentum_buffer) has the parameter's shape; scalars (step) have none."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _clone(value):
    """A tensor's own copy (a state dict must not share storage with the live optimizer); a number as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def consolidate(zero, own: torch.Tensor, to):
    """The padded vector of Psi elements from every rank's S: on every rank (to=None), or on `to` only."""
    if zero.stage == 0:
        return own  # every rank already holds all of it
    if to is None:
        full = own.new_empty(zero.partition.padded_numel)
        wire.call(dist.all_gather_single, full, own.contiguous(), group=zero.group)
        return full
    parts = [torch.empty_like(own) for _ in range(zero.partition.world_size)] if zero.rank == to else None
    wire.call(dist.gather, own.contiguous(), parts, group=zero.group, group_dst=to)
    return torch.cat(parts) if parts else None


def consolidated_state_dict(zero, to: int | None = None):
    """Collective. torch.optim's state dict of the ZeroOptimizer's param groups (parameters numbered across
    groups, frozen ones included, as a plain optimizer over the same groups numbers them)."""
    if to is not None and not 0 <= to < zero.partition.world_size:
        raise ValueError(f"to={to} is not a rank of the group (0..{zero.partition.world_size - 1})")
    shards = [zero.optimizer.state[s] for s in zero.slices]  # per group: this rank's slice's state
    full = {}
    for key in sorted({k for st in shards for k, v in st.items() if per_element(v)}):
        kind = next(st[key] for st in shards if key in st)  # zeros for groups without this key
        own = torch.cat([st.get(key, kind.new_zeros(b - a)) for st, (a, b) in zip(shards, zero.ranges)])
        full[key] = consolidate(zero, own, to)
    if zero.has_master:
        full["master_param"] = consolidate(zero, zero.master, to)
    if to is not None and zero.rank != to:
        return None
    state = {}
    groups = []
    i = 0  # parameters numbered across groups
    for group, st in zip(zero.param_groups, shards):
        for p in group["params"]:
            if p.requires_grad and (st or zero.has_master):
                a, b = zero.span[p]
                entry = {}
                for k, v in st.items():  # per-element state: this parameter's span of the whole vector
                    entry[k] = full[k][a:b].view_as(p).clone() if k in full else _clone(v)
                if "master_param" in full:
                    entry["master_param"] = full["master_param"][a:b].view_as(p).clone()
                state[i] = entry
            i += 1
        groups.append({**settings(group), "params": list(range(i - len(group["params"]), i))})
    return {"state": state, "param_groups": groups}


def load_consolidated_state_dict(zero, state_dict, src=None) -> None:
    """Every rank keeps its own shard. With src (a group rank) only that rank needs to pass the dict (the
    others may pass None) and it is broadcast; else every rank passes it."""
    if src is not None:
        box = [state_dict]
        wire.call(dist.broadcast_object_list, box, group=zero.group, group_src=src)
        state_dict = box[0]
    groups, state = state_dict["param_groups"], state_dict["state"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in zero.param_groups]:
        raise ValueError(f"expected param groups of {[len(g['params']) for g in zero.param_groups]} "
                         f"parameters; got {[len(g['params']) for g in groups]}: another model or grouping")
    index = {p: i for ours, theirs in zip(zero.param_groups, groups) for p, i in zip(ours["params"],
                                                                                     theirs["params"])}
    if state and all(p.dim() == 0 for p in zero.params):
        raise ValueError("every parameter is 0-dim, so per-element state cannot be told from scalar "
                         "counters such as Adam's step; give the model one parameter with dim >= 1")
    keys = {k for p in zero.params for k, v in state.get(index[p], {}).items() if per_element(v)}
    if zero.has_master:
        zero.master.copy_(zero.flat[zero.lo:zero.hi])  # the model's weights, unless the dict has masters
    shards = {}
    for j, (group, (ra, rb)) in enumerate(zip(zero.param_groups, zero.ranges)):
        members = [p for p in group["params"] if p.requires_grad]
        if not any(index[p] in state for p in members):
            continue  # this group was never stepped
        shard = {}
        for key, value in state[index[members[0]]].items():
            if key not in keys:
                shard[key] = _clone(value)
                continue
            flat = torch.zeros(zero.partition.padded_numel, dtype=value.dtype, device=zero.flat.device)
            for p in members:
                saved = state[index[p]][key]
                if saved.numel() != p.numel():
                    raise ValueError(f"state {key!r} of parameter {index[p]} has {saved.numel()} elements, "
                                     f"the parameter has {p.numel()}: the state dict is of another model")
                flat[slice(*zero.span[p])] = saved.reshape(-1)
            shard[key] = flat[zero.lo + ra:zero.lo + rb].clone()  # a clone keeps only my slice alive
        master = shard.pop("master_param", None)
        if master is not None and zero.has_master:
            zero.master[ra:rb] = master
        shards[j] = shard
    zero.optimizer.load_state_dict({"state": shards, "param_groups": [
        {**settings(g), "params": [j]} for j, g in enumerate(groups)]})
    copy_settings(zero.optimizer.param_groups, zero.param_groups)


def whose(zero) -> tuple:
    """(rank, K, lo, hi, Psi): which slice of which partition a shard is."""
    return zero.rank, zero.partition.world_size, zero.lo, zero.hi, zero.partition.padded_numel


def shard_state_dict(zero) -> dict:
    """This rank's shard of the state, no communication; loadable by the same rank of the same partition."""
    return {"shard": whose(zero), "optimizer": zero.optimizer.state_dict(),
            "master": zero.master.clone() if zero.has_master else None}


def load_shard_state_dict(zero, shard: dict) -> None:
    if shard["shard"] != whose(zero):
        raise ValueError(f"this shard is (rank, K, lo, hi, Psi) = {shard['shard']}, this optimizer's is "
                         f"{whose(zero)}: load it with the same model, world size and stage, or save "
                         f"a consolidated state_dict() instead")
    zero.optimizer.load_state_dict(shard["optimizer"])
    if zero.has_master:
        zero.master.copy_(shard["master"])
    copy_settings(zero.optimizer.param_groups, zero.param_groups)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--stage", type=int, choices=(0, 1, 2), default=2, help="ZeRO stage that saves")
    p.add_argument("--steps", type=int, default=2, help="Adam steps before saving, and again after")
    p.add_argument("--widths", type=int, nargs="+", default=[19, 60, 60], help="MLP widths")
    return p


def saved_bytes(obj) -> int:
    """The bytes torch.save writes for obj."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def demo(args) -> int:
    launch.require(args.steps >= 1 and len(args.widths) >= 2 and min(args.widths) >= 1,
                   "--steps must be >= 1 and --widths two or more numbers >= 1")
    k = launch.setup().world_size
    w = args.widths

    def zero(stage):
        """The same model on every rank, and a ZeroOptimizer of that stage over it (each rank its own batches)."""
        model = models.mlp(w, torch.float32).to(launch.device())
        return model, ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage, lr=1e-2)
    first, zero1 = zero(args.stage)
    models.random_batch_steps(first, first, zero1, args.steps)
    whole = consolidated_state_dict(zero1, to=0)
    shard = shard_state_dict(zero1)
    sizes = torch.tensor([saved_bytes(shard), saved_bytes(whole) if whole else 0], device=launch.device())
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # the largest shard; the consolidated dict (rank 0's)
    resumed, zero2 = zero(1 if args.stage != 1 else 2)  # another stage, same K
    resumed.load_state_dict(first.state_dict())
    load_consolidated_state_dict(zero2, whole, src=0)  # only rank 0 holds it: broadcast, each keeps its slice
    for model, opt in ((first, zero1), (resumed, zero2)):
        models.random_batch_steps(model, model, opt, args.steps)
    same = all(torch.equal(p, q) for p, q in zip(first.parameters(), resumed.parameters()))
    plain = torch.optim.Adam(first.parameters(), lr=1e-2)
    if whole is not None:
        plain.load_state_dict(whole)  # a plain optimizer takes the consolidated dict as it is
    n = zero1.partition.numel
    S = zero1.partition.shard_size
    b = 4 * sum(per_element(v) for v in zero1.optimizer.state[zero1.slices[0]].values())  # bytes per element
    launch.print0(f"ZeRO-{args.stage} Adam, K = {k}, N = {n:,}, S = {S:,}, {b} B of per-element state per element\n"
                  f"saved bytes: consolidated {sizes[1].item():,} B (b*N = {b * n:,} + the format), the largest "
                  f"shard of a rank {sizes[0].item():,} B (b*S = {b * S:,} + the format)\n"
                  f"resumed from the consolidated dict at stage {zero2.stage}: {args.steps} more steps "
                  f"{'bit for bit equal to' if same else 'DIFFERENT from'} never stopping; a plain "
                  f"torch.optim.Adam loads it too")
    return launch.conclude("sharded_state", same, "resumed at another stage = never stopped, bit for bit",
                           sizes[0] <= sizes[1] // k + 4096, f"shard {sizes[0].item():,} B vs consolidated "
                           f"{sizes[1].item():,} B (K = {k})")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
