"""A transformer block under tensor parallelism, then sequence parallelism (Megatron-LM; Korthikanti et al. 2022).

Attention is cut by heads: W_q, W_k, W_v column-parallel (rank i owns heads i*H/T..), attention runs on its
own heads with no communication, and the output projection is row-parallel; with the MLP of
tensor_parallel.py a pre-norm block x + attn(ln1(x)) + mlp(ln2(.)) holds 1/T of its matrices per rank and
communicates

    TP:      2 all-reduces forward, 2 backward, each of one [b, s, h] activation (D = b*s*h elements)
    TP + SP: 2 all-gathers + 2 reduce-scatters forward, 4 all-gathers + 2 reduce-scatters backward

Same bytes on the wire (a ring all-reduce IS a reduce-scatter then an all-gather), plus one all-gather per
column layer in backward: SP gathers its input again instead of keeping the whole sequence. What that buys
is activation memory, the bytes autograd keeps from forward for backward, per rank and layer (e: bytes per
element; the layer norms' mean and rstd, 4*b*s, and attention's log-sum-exp, b*H*s, are the small terms):

    TP:      e * [ (4*b*s*h + 4*b*s)  +  (12*b*s*h + b*H*s) / T ]      layer-norm and column inputs stay whole
    TP + SP: e * [ (4*b*s*h + 4*b*s)  +  (12*b*s*h + b*H*s) ] / T      every activation is 1/T of one rank's

Plain TP is the naive half: layer norms and residuals run on the whole sequence, replicated T times. SP cuts
them along the sequence, s/T tokens per rank, and turns each all-reduce into its reduce-scatter and all-gather.

Layout is batch-first, [batch, seq, hidden], like nn.MultiheadAttention(batch_first=True).

Demo (a block at T=1, TP and TP+SP against the dense PyTorch block: collectives and bytes kept per rank):

    torchrun --standalone --nproc_per_node=4 mini_dist/parallel_transformer.py [--batch 2 --seq 24 --heads 12]

Mirrors: Megatron-LM's ParallelAttention / ParallelTransformerLayer; PyTorch's
torch.distributed.tensor.parallel with SequenceParallel does the same on DTensor.
"""
import copy
import sys
from collections import namedtuple
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.comm import COUNTER, SEQ, check_divisible
from mini_dist.kit.measure import SavedTensors
from mini_dist.tensor_parallel import (Layout, ParallelMLP, RowParallelLinear,
                                       allreduce_sequence_parallel_grads, check_input, column_parallel_linear,
                                       gather_to_dense, parameter, shard_from_dense, tp_size)


class ParallelAttention(nn.Module):
    """Multi-head self-attention, each rank owning num_heads/T whole heads: its Q, K, V rows are column
    shards, attention runs locally, and the output projection is row-parallel. Parameter names are those
    of nn.MultiheadAttention (in_proj_weight = [W_q; W_k; W_v], out_proj)."""

    def __init__(self, hidden, num_heads, causal=False, sequence_parallel=False, group=None, device=None,
                 dtype=None):
        super().__init__()
        T = tp_size(group)
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        check_divisible("num_heads", num_heads, T, "each rank must own whole heads: pick num_heads a multiple "
                                                   "of T, or a T that divides num_heads")
        self.hidden, self.local_heads, self.head_dim = hidden, num_heads // T, hidden // num_heads
        self.causal, self.sequence_parallel, self.group = causal, sequence_parallel, group
        self.in_proj_weight = parameter((3 * hidden // T, hidden), hidden ** -0.5, device, dtype)
        self.in_proj_bias = parameter((3 * hidden // T,), hidden ** -0.5, device, dtype)
        self.tp_layout = {"in_proj_weight": Layout(0, parts=3), "in_proj_bias": Layout(0, parts=3)}
        self.out_proj = RowParallelLinear(hidden, hidden, sequence_parallel=sequence_parallel, group=group,
                                          device=device, dtype=dtype)

    def forward(self, x):
        check_input(self, x, self.hidden, self.sequence_parallel)
        qkv = column_parallel_linear(x, self.in_proj_weight, self.in_proj_bias, self.group,
                                     self.sequence_parallel)  # [b, s, 3 * local heads * head_dim]
        q, k, v = (t.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2) for t in qkv.chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # my heads only, no talking
        return self.out_proj(out.transpose(1, 2).flatten(2))                   # [b, s, h/T] -> g -> [b, s, h]


class TransformerBlock(nn.Module):
    """The dense reference, from PyTorch's own layers: pre-norm GPT block x + attn(ln1(x)) + mlp(ln2(.))."""

    def __init__(self, hidden, num_heads, causal=True, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.causal = causal
        self.ln1 = nn.LayerNorm(hidden, **kw)
        self.attn = nn.MultiheadAttention(hidden, num_heads, batch_first=True, **kw)
        self.ln2 = nn.LayerNorm(hidden, **kw)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden, **kw), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden, **kw))

    def forward(self, x):
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        a = self.ln1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ParallelTransformerBlock(nn.Module):
    """TransformerBlock with attention and MLP tensor-parallel: 2 collectives forward, 2 backward (with
    SP: its input and output are [b, s/T, h] shards, layer norms and residuals work on s/T tokens)."""

    def __init__(self, hidden, num_heads, causal=True, sequence_parallel=False, group=None, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, group=group, device=device, dtype=dtype)
        self.ln1 = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.attn = ParallelAttention(hidden, num_heads, causal, **kw)
        self.ln2 = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.mlp = ParallelMLP(hidden, 4 * hidden, **kw)
        self.tp_layout = {f"{ln}.{p}": Layout(partial_grad=sequence_parallel)  # whole; under SP, s/T tokens
                          for ln in ("ln1", "ln2") for p in ("weight", "bias")}

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# ----- demo -----

Layer = namedtuple("Layer", "fwd bwd acts diff", defaults=[0.0])  # fwd, bwd: ({kind: calls}, payload bytes)


def _my_part(sp):
    """This rank's part of a whole [b, s, h] tensor: its s/T tokens under sequence parallelism, else all."""
    return (lambda t: t.chunk(dist.get_world_size(), SEQ)[dist.get_rank()]) if sp else (lambda t: t)


def _one_layer(block, dense, x, dy, sp, group):
    """Forward and backward of `block` on this rank's part of x (`dense` has run on all of x): what it
    communicates and keeps per rank, and its largest difference from dense (output, grad x, weight grads)."""
    mine = _my_part(sp)
    xin = mine(x.detach()).clone().requires_grad_()  # its own storage: a view would keep all of x alive
    COUNTER.reset()
    with SavedTensors(exclude=block.parameters()) as saved:
        out = block(xin)
    fwd = dict(COUNTER.calls), sum(COUNTER.bytes.values())
    COUNTER.reset()
    out.backward(mine(dy))
    bwd = dict(COUNTER.calls), sum(COUNTER.bytes.values())
    allreduce_sequence_parallel_grads(block, group)
    gathered = gather_to_dense(block, copy.deepcopy(dense), group)
    pairs = [(out, mine(dense(x))), (xin.grad, mine(x.grad))]
    pairs += [(p.grad, q.grad) for p, q in zip(gathered.parameters(), dense.parameters())]
    return Layer(fwd, bwd, saved.bytes, max((a - b).abs().max().item() for a, b in pairs))


def _row(name, layer, one) -> str:
    """One line of the demo's table: collectives each way, then activation bytes per rank against T=1."""
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    talk = [" + ".join(f"{n} {short[k]}" for k, n in sorted(c.items())) + f" {nb / 1024:.0f} KiB" if c else "-"
            for c, nb in (layer.fwd, layer.bwd)]
    return f"{name:9} {talk[0]:>20} {talk[1]:>20} {layer.acts:>12,} = 1/{one.acts / layer.acts:.2f}"


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--batch", type=int, default=2, help="b, sequences per batch")
    p.add_argument("--seq", type=int, default=24, help="s, tokens per sequence (SP cuts it T ways)")
    p.add_argument("--hidden", type=int, default=96, help="h")
    p.add_argument("--heads", type=int, default=12, help="H, attention heads (TP cuts them T ways)")
    return p


def demo(args) -> int:
    T = launch.env_world_size()
    b, s, h, heads = args.batch, args.seq, args.hidden, args.heads
    launch.require(min(b, s, h, heads) >= 1, "--batch, --seq, --hidden and --heads must be at least 1")
    launch.require(h % heads == 0, f"--hidden {h} must be a multiple of --heads {heads}")
    launch.require(heads % T == 0 and s % T == 0, f"{T} ranks cannot split {heads} heads and {s} tokens "
                   f"evenly: pick --heads and --seq multiples of {T}")
    env = launch.setup()
    rank, dev, f64 = env.rank, env.device, torch.float64
    alone = [launch.new_group([r]) for r in range(T)][rank]  # a group of one: the same layers, undivided
    dense = TransformerBlock(h, heads, causal=True, device=dev, dtype=f64)
    x = torch.randn(b, s, h, device=dev, dtype=f64, requires_grad=True)  # setup() seeds every rank alike
    dy = torch.randn(b, s, h, device=dev, dtype=f64)
    dense(x).backward(dy)
    one, tp, tp_sp = [
        _one_layer(shard_from_dense(ParallelTransformerBlock(h, heads, True, sp, group, dev, f64), dense, group),
                   dense, x, dy, sp, group) for group, sp in [(alone, False), (None, False), (None, True)]]
    worst = max(one.diff, tp.diff, tp_sp.diff)
    # the formulas of the docstring: every collective carries one [b, s, h] activation of D bytes
    D = b * s * h * 8
    whole, cut = 8 * (4 * b * s * h + 4 * b * s), 8 * (12 * b * s * h + b * heads * s)
    talk = lambda **calls: (calls, D * sum(calls.values())) if T > 1 else ({}, 0)  # noqa: E731
    want_tp = Layer(talk(all_reduce=2), talk(all_reduce=2), whole + cut // T)
    want_sp = Layer(talk(all_gather=2, reduce_scatter=2), talk(all_gather=4, reduce_scatter=2), (whole + cut) // T)
    figure_ok = one.acts == whole + cut and tp[:3] == want_tp[:3] and tp_sp[:3] == want_sp[:3]
    launch.print0(f"transformer block b={b} s={s} h={h} heads={heads} causal fp64, T={T}: "
                  f"max |parallel - dense| (output, grad x, all weight grads) = {worst:.1e}")
    launch.print0(f"{'per layer':9} {'forward':>20} {'backward':>20} {'activations/rank, B':>24}")
    for name, layer in [("T=1", one), ("TP", tp), ("formula", want_tp), ("TP+SP", tp_sp), ("formula", want_sp)]:
        launch.print0(_row(name, layer, one))
    params = sum(p.numel() * 8 for p in ParallelTransformerBlock(h, heads, device=dev, dtype=f64).parameters())
    dense_params = sum(p.numel() * 8 for p in dense.parameters())
    kept_whole = 8 * (4 * h + 2 * h)  # two layer norms (weight, bias) and the row layers' biases stay whole
    figure_ok &= params == kept_whole + (dense_params - kept_whole) // T
    launch.print0(f"parameters/rank {params:,} B = 1/{dense_params / params:.2f} of dense (formula: norms and row "
                  f"biases whole, the rest 1/T = {kept_whole + (dense_params - kept_whole) // T:,})")
    launch.print0(f"D = b*s*h*8 B = {D / 1024:.0f} KiB per collective: a ring sends 2(T-1)/T*D per AR, (T-1)/T*D "
                  f"per AG or RS; both send {4 * (T - 1) / T * D / 1024:.0f} KiB/rank forward")
    return launch.conclude("parallel_transformer", worst < 1e-12, f"block = dense PyTorch ({worst:.0e})",
                           figure_ok, f"{sum(tp.fwd[0].values())}+{sum(tp.bwd[0].values())} AR/layer, "
                           f"activations 1/{one.acts / tp.acts:.2f} (TP), 1/{one.acts / tp_sp.acts:.2f} (TP+SP)")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
