"""Figures for the questions about surviving failure (section 4 of the reading order) that are not a demo's own.

    reload_at_half_the_ranks   question 24: what a recoverable sharded checkpoint needs, and whether it loads on
                               another number of ranks

Each function is the measure of its question (mini_dist/questions/questions.md): every rank of the question's
group calls it and gets (figure, holds). The saving and loading are the concepts' own (checkpoint.save,
reshard_zero.zero_state and load_zero_state), so a figure here cannot drift from the code.
"""
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from mini_dist import checkpoint
from mini_dist.kit import launch
from mini_dist.kit.models import mlp, random_batch_steps
from mini_dist.reshard_zero import load_zero_state, zero_state
from mini_dist.sharded_state import consolidated_state_dict
from mini_dist.zero_optimizer import ZeroOptimizer


def zero_adam(width: int, seed: int, stage: int, group=None) -> tuple:
    """An MLP (fp64, from `seed`) and a ZeroOptimizer of `stage` with Adam over it, on `group`."""
    model = mlp([width, 3 * width, width], seed=seed).to(launch.device())
    return model, ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage, group=group, lr=0.01)


def same_as_saved(model, saved: dict, other_model, other: dict) -> bool:
    """The parameters, and the optimizer state of two consolidated state dicts, bit for bit."""
    params = all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))
    return params and all(torch.equal(other["state"][i][k], v) for i, s in saved["state"].items() for k, v in s.items())


def reload_at_half_the_ranks(width: int = 8, steps: int = 2) -> tuple[str, bool]:
    """Question 24, on every rank: ZeRO-1 with Adam on K ranks saves; ZeRO-2 on K // 2 ranks (at least one),
    built from another seed, loads it. Returns the files written and whether the parameters and Adam state
    came back bit for bit and a load with the manifest deleted was refused on every rank."""
    K = dist.get_world_size()
    rank = dist.get_rank()
    k = max(1, K // 2)
    model, zero = zero_adam(width, 0, stage=1)
    random_batch_steps(model, model, zero, steps)
    half = launch.new_group(range(k))
    where = [tempfile.mkdtemp(prefix="mini_dist_recovery_") if rank == 0 else None]
    dist.broadcast_object_list(where)
    path = os.path.join(where[0], f"step_{steps:08d}")
    same = torch.ones((), device=launch.device())  # 0 on a rank whose reload differs
    refused = False
    try:
        checkpoint.save(zero_state(zero), path)
        files = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
        saved = consolidated_state_dict(zero, to=None)
        if rank < k:  # a refused load raises on every rank of `half`: they go on to meet the others below
            other, zero2 = zero_adam(width, 1, stage=2, group=half)
            try:
                load_zero_state(path, zero2, half)
            except checkpoint.CheckpointError:
                same.fill_(0)
            if not same_as_saved(model, saved, other, consolidated_state_dict(zero2, to=None)):
                same.fill_(0)
        dist.all_reduce(same, dist.ReduceOp.MIN)
        if rank == 0:
            os.remove(os.path.join(path, checkpoint.MANIFEST))
        dist.barrier()
        try:
            checkpoint.load(zero_state(zero), path)
        except checkpoint.CheckpointError:
            refused = True
    finally:
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    written = ", ".join(f"{f} {n:,} B" for f, n in files.items())
    figure = (f"ZeRO-1 with Adam on {K} ranks saved {written} (the manifest written last); loaded as ZeRO-2 on {k} "
              f"ranks: parameters and Adam state bit for bit: {bool(same)}; with the manifest gone, the load is "
              f"refused on every rank: {refused}")
    return figure, bool(same) and refused and len(files) == K + 1 and checkpoint.MANIFEST in files
