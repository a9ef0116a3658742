"""Activation checkpointing against torch.utils.checkpoint: one training step of a stack of transformer layers.

    ./run.sh bench 1 activation_checkpoint

The same 8 layers (kit.activations.TransformerLayer, fp32, dropout 0.1) on every rank, forward +
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
from mini_dist.activation_checkpoint import checkpoint, checkpoint_sequential
from mini_dist.kit.activations import TransformerLayer, each_layer
from mini_dist.kit.launch import device
from mini_dist.selective_checkpoint import MATMULS, selective_checkpoint


def stack(args, layers=8, b=2, s=64, h=128, heads=4, repeats=15) -> list[bench.Result]:
    torch.manual_seed(0)
    model = nn.Sequential(*[TransformerLayer(h, heads, 0.1) for _ in range(layers)]).to(device())
    x = torch.randn(b, s, h, device=device())
    k = round(math.sqrt(layers))
    torchs = functools.partial(tc.checkpoint, use_reentrant=False)
    context = functools.partial(tc.create_selective_checkpoint_contexts, MATMULS)
    torchs_selective = functools.partial(tc.checkpoint, use_reentrant=False, context_fn=context)
    sides = [("every layer", each_layer(checkpoint), each_layer(torchs), 1.1),
             (f"checkpoint_sequential k={k}", lambda m, y: checkpoint_sequential(m, k, y),
              lambda m, y: tc.checkpoint_sequential(m, k, y, use_reentrant=False), 1.1),
             ("selective (matmuls kept)", each_layer(selective_checkpoint), each_layer(torchs_selective), 1.2),
             ("every layer vs none", each_layer(checkpoint), lambda m, y: m(y), None)]
    note = f"L={layers} b={b} s={s} h={h} a={heads} fp32"
    return [bench.compare(f"activation_checkpoint {name}", lambda f=ours: f(model, x).sum().backward(),
                          lambda f=native: f(model, x).sum().backward(), repeats, target, note=note)
            for name, ours, native, target in sides]


BENCHES = {"activation_checkpoint": stack}
