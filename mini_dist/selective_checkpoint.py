"""Selective activation checkpointing: keep what the matmuls return, recompute only the cheap ops.

Full checkpointing (mini_dist/activation_checkpoint.py) keeps a layer's input and reruns its whole forward
in backward: one more forward, 4/3 of a step. Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models") saw that FLOPs and bytes sit in different ops: the matmuls cost the FLOPs,
while the cheap ops (norms, softmax, GeLU, dropout) and attention's s x s scores cost the bytes (the 5as^2b
of a layer's sbh(34 + 5as/h)). So keep the matmul outputs and recompute the rest. For a layer whose input
is I bytes (its matmuls return qkv 3I, proj I, fc1 4I, fc2 I):

    kept     I + 3I + I + 4I + I = 10*I a layer, against A = e(16sbh + 2as^2b) + 2sbh + as^2b without
    compute  1 + s / (3(6h + s)) of a step: only attention's two bmm (4bs^2h of 24bsh^2 + 4bs^2h) rerun

A policy names the ops to keep (keep_matmuls: nn.Linear's mm and addmm). A dispatch mode (Selective) sees
every op of the segment: in forward it keeps the outputs of the ops the policy keeps; in the recomputation
those ops hand the kept outputs back instead of running.

    torchrun --standalone --nproc_per_node=1 mini_dist/selective_checkpoint.py [--layers 8 --seq 64]

Mirrors torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False,
context_fn=functools.partial(create_selective_checkpoint_contexts, ops)).
"""
import functools
import sys
from pathlib import Path

import torch
from torch.utils import checkpoint as tc
from torch.utils._python_dispatch import TorchDispatchMode

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.activation_checkpoint import checkpoint
from mini_dist.kit import launch
from mini_dist.kit.activations import (Strategy, each_layer, layer_bytes, no_checkpoint, profile_strategies,
                                       require_stack, stack_flags, strategy_table, transformer_stack)

MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]  # nn.Linear's, not attention's bmm


def keep_matmuls(op) -> bool:
    """The selective policy: keep what the weight matmuls return, recompute everything else."""
    return op in MATMULS


class Selective(TorchDispatchMode):
    """Sees every op of a segment. In forward (kept: a list) it keeps the outputs of the ops policy(op)
    keeps; in recomputation (kept: an iterator over them) those ops hand them back instead of running."""

    def __init__(self, policy, kept):
        super().__init__()
        self.policy = policy
        self.kept = kept

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        if self.policy(op) and not isinstance(self.kept, list):
            return next(self.kept).detach()
        out = op(*args, **(kwargs or {}))
        if self.policy(op):
            self.kept.append(out.detach())
        return out


def selective_checkpoint(fn, *args, policy=keep_matmuls, **kwargs):
    """checkpoint(fn, *args, **kwargs) that also keeps the outputs of the ops policy(op) keeps, handed to
    autograd beside the inputs (so saved_tensors_hooks count them) and handed back in the recomputation."""
    return checkpoint(fn, *args, context=functools.partial(Selective, policy), **kwargs)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    stack_flags(p, layers=8)
    return p


def strategies(L: int, s: int, h: int, A: int, I: int) -> list[Strategy]:
    """None, every layer, and selective, each beside torch's and its formulas (see the docstring)."""
    torchs = functools.partial(tc.checkpoint, use_reentrant=False)
    context = functools.partial(tc.create_selective_checkpoint_contexts, MATMULS)
    torchs_selective = functools.partial(tc.checkpoint, use_reentrant=False, context_fn=context)
    return [Strategy("none", no_checkpoint, no_checkpoint, L * A, 1),
            Strategy("every layer", each_layer(checkpoint), each_layer(torchs), L * I, 4 / 3),
            Strategy("selective", each_layer(selective_checkpoint), each_layer(torchs_selective), 10 * L * I,
                     1 + s / (3 * (6 * h + s)))]


def demo(args) -> int:
    require_stack(args)
    env = launch.setup(seed=args.seed)
    L = args.layers
    seed = args.seed + env.rank
    model, x, dy = transformer_stack(L, args.batch, args.seq, args.hidden, args.heads, args.dropout, seed)
    A, I = layer_bytes(args.batch, args.seq, args.hidden, args.heads)
    rows = profile_strategies(model, x, dy, strategies(L, args.seq, args.hidden, A, I), seed)
    figure, holds = strategy_table(rows)
    exact = max(r["diff"] for r in rows.values()) == 0
    none = rows["none"]
    sel = rows["selective"]
    launch.print0(f"{L} layers b={args.batch} s={args.seq} h={args.hidden} a={args.heads} fp32: a layer keeps "
                  f"A = {A:,} B without checkpointing, its input is I = {I:,} B, selective keeps 10*I = {10 * I:,} B"
                  f"\n{figure}")
    return launch.conclude("selective_checkpoint", exact, "gradients bit-identical to none and torch's",
                           holds, f"kept bytes and FLOPs = formulas; selective keeps "
                           f"{sel['saved'] / none['saved']:.0%} of none for {sel['ratio']:.3f}x the FLOPs")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
