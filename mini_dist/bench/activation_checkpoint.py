"""Activation checkpointing against torch.utils.checkpoint: one training step of a stack of transformer layers.

    ./run.sh bench 1 activation_checkpoint

The same 8 layers (activation_checkpoint.TransformerLayer, fp32, dropout 0.1) on every rank, forward +
backward, checkpointed three ways: every layer (ours vs checkpoint(use_reentrant=False)), checkpoint_sequential
in sqrt(L) segments, and selective with the matmul outputs kept (ours vs create_selective_checkpoint_contexts).
Both sides run the same kernels, the recomputation included; what differs is the Python around them: the
saved-tensor hooks, and for the selective policy a dispatch mode that sees every op. So the targets are
parity with some slack for a busy machine: <= 1.1x for full checkpointing, <= 1.2x for selective.
A last row, measured with no target, is what recomputation costs against no checkpointing at all.
"""
import functools
import math

import torch
from torch import nn
from torch.utils import checkpoint as tc

from mini_dist import bench
from mini_dist.activation_checkpoint import TransformerLayer, checkpoint, checkpoint_sequential, run_layers
from mini_dist.kit.launch import device
from mini_dist.selective_checkpoint import MATMULS, selective_checkpoint


def stack(args, layers=8, b=2, s=64, h=128, heads=4, repeats=15) -> list[bench.Result]:
    torch.manual_seed(0)
    model = nn.Sequential(*[TransformerLayer(h, heads, 0.1) for _ in range(layers)]).to(device())
    x = torch.randn(b, s, h, device=device())
    k = round(math.sqrt(layers))
    each = lambda ckpt: lambda: run_layers([functools.partial(ckpt, layer) for layer in model], x)  # noqa: E731
    sac = functools.partial(tc.create_selective_checkpoint_contexts, MATMULS)
    sides = [("every layer", each(checkpoint), each(functools.partial(tc.checkpoint, use_reentrant=False)), 1.1),
             (f"checkpoint_sequential k={k}", lambda: checkpoint_sequential(model, k, x),
              lambda: tc.checkpoint_sequential(model, k, x, use_reentrant=False), 1.1),
             ("selective (matmuls kept)", each(selective_checkpoint),
              each(functools.partial(tc.checkpoint, use_reentrant=False, context_fn=sac)), 1.2),
             ("every layer vs none", each(checkpoint), lambda: model(x), None)]
    note = f"L={layers} b={b} s={s} h={h} a={heads} fp32"
    return [bench.compare(f"activation_checkpoint {name}", lambda f=ours: f().sum().backward(),
                          lambda f=native: f().sum().backward(), repeats, target, note=note)
            for name, ours, native, target in sides]


BENCHES = {"activation_checkpoint": stack}
