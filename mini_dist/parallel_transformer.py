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
b*H*s is what a flash kernel keeps (SDPA's on the CPU); the math kernel (SDPA in fp64 on CUDA) keeps the
b*H*s*s probabilities instead. Either way the parts scale the same, and that is what the demo judges, exactly.

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
from mini_dist.kit import flags, launch
from mini_dist.comm import COUNTER, SEQ, check_divisible
from mini_dist.kit.measure import SavedTensors
from mini_dist.tensor_parallel import (ParallelMLP, RowParallelLinear, SequenceParallelColumnLinear, check_input,
                                       column_parallel_linear, parameter, tp_size)
from mini_dist.tp_layout import Layout, allreduce_sequence_parallel_grads, gather_to_dense, shard_from_dense


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
        self.hidden = hidden
        self.local_heads = num_heads // T
        self.head_dim = hidden // num_heads
        self.causal = causal
        self.sequence_parallel = sequence_parallel
        self.group = group
        self.in_proj_weight = parameter((3 * hidden // T, hidden), hidden ** -0.5, device, dtype)
        self.in_proj_bias = parameter((3 * hidden // T,), hidden ** -0.5, device, dtype)
        self.tp_layout = {"in_proj_weight": Layout(0, parts=3), "in_proj_bias": Layout(0, parts=3)}
        self.out_proj = RowParallelLinear(hidden, hidden, sequence_parallel=sequence_parallel, group=group,
                                          device=device, dtype=dtype)

    def forward(self, x):
        check_input(self, x, self.hidden, self.sequence_parallel)
        linear = SequenceParallelColumnLinear.apply if self.sequence_parallel else column_parallel_linear
        qkv = linear(x, self.in_proj_weight, self.in_proj_bias, self.group)  # f; (b, s, h) @ (h, 3h/T) -> (b, s, 3h/T)
        q, k, v = (t.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2)  # (b, H/T, s, h/H) each
                   for t in qkv.chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # my heads only, no talking
        return self.out_proj(out.transpose(1, 2).flatten(2))                   # (b, s, h/T) -> g -> (b, s, h)


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


class TransformerBlock(nn.Module):
    """The dense reference, from PyTorch's own layers: pre-norm GPT block x + attn(ln1(x)) + mlp(ln2(.))."""

    def __init__(self, hidden, num_heads, causal=True, device=None, dtype=None):
        super().__init__()
        self.causal = causal
        self.ln1 = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.attn = nn.MultiheadAttention(hidden, num_heads, batch_first=True, device=device, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden, device=device, dtype=dtype), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden, device=device, dtype=dtype))

    def forward(self, x):
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        a = self.ln1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


# ----- what a layer moves and keeps, measured, beside the docstring's formulas -----

Layer = namedtuple("Layer", "fwd bwd acts diff", defaults=[0.0])  # fwd, bwd: ({kind: calls}, payload bytes)
Block = namedtuple("Block", "one tp sp b s h heads")  # the Layers of one rank alone, TP and TP + SP


def _my_part(t, sp):
    """This rank's part of a whole [b, s, h] tensor: its s/T tokens under sequence parallelism, else all of it."""
    return t.chunk(dist.get_world_size(), SEQ)[dist.get_rank()] if sp else t


def _one_layer(block, dense, x, dy, sp, group):
    """Forward and backward of `block` on this rank's part of x (`dense` has run on all of x): what it
    communicates and keeps per rank, and its largest difference from dense (output, grad x, weight grads)."""
    xin = _my_part(x.detach(), sp).clone().requires_grad_()  # its own storage: a view would keep all of x alive
    COUNTER.reset()
    with SavedTensors(exclude=block.parameters()) as saved:
        out = block(xin)
    fwd = (dict(COUNTER.calls), sum(COUNTER.bytes.values()))
    COUNTER.reset()
    out.backward(_my_part(dy, sp))
    bwd = (dict(COUNTER.calls), sum(COUNTER.bytes.values()))
    allreduce_sequence_parallel_grads(block, group)
    gathered = gather_to_dense(block, copy.deepcopy(dense), group)
    pairs = [(out, _my_part(dense(x), sp)), (xin.grad, _my_part(x.grad, sp))]
    pairs += [(p.grad, q.grad) for p, q in zip(gathered.parameters(), dense.parameters())]
    return Layer(fwd, bwd, saved.bytes, max((a - b).abs().max().item() for a, b in pairs))


def block_three_ways(b=2, s=16, h=32, heads=4) -> Block:
    """On every rank of the world: the dense TransformerBlock and its twin on one rank (a group of one), under
    TP and under TP + SP, forward and backward on the same fp64 [b, s, h] data."""
    dev = launch.device()
    torch.manual_seed(0)  # every rank: the same dense block and the same data
    dense = TransformerBlock(h, heads, causal=True, device=dev, dtype=torch.float64)
    x, dy = torch.randn(2, b, s, h, device=dev, dtype=torch.float64)
    dense(x.requires_grad_()).backward(dy)
    alone = [launch.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # undivided layers
    layers = []
    for group, sp in [(alone, False), (None, False), (None, True)]:
        block = ParallelTransformerBlock(h, heads, True, sp, group, dev, torch.float64)
        layers.append(_one_layer(shard_from_dense(block, dense, group), dense, x, dy, sp, group))
    return Block(*layers, b, s, h, heads)


def whole_activations(block: Block) -> int:
    """Bytes TP keeps whole on every rank: the layer norms' inputs and outputs (4*b*s*h), their mean and rstd
    (4*b*s), fp64."""
    return 8 * (4 * block.b * block.s * block.h + 4 * block.b * block.s)


def expected(block: Block) -> tuple[Layer, Layer]:
    """The docstring's formulas for TP and TP + SP: collectives of one [b, s, h] activation each, and the
    activations kept, from T=1's measured bytes: the layer norms' part whole under TP, everything 1/T with SP."""
    T = dist.get_world_size()

    def talk(**calls):
        """({kind: calls}, payload B) for collectives of one [b, s, h] fp64 activation each; none on one rank."""
        return (calls, 8 * block.b * block.s * block.h * sum(calls.values())) if T > 1 else ({}, 0)
    tp_acts = (whole_activations(block) * (T - 1) + block.one.acts) // T
    return (Layer(talk(all_reduce=2), talk(all_reduce=2), tp_acts),
            Layer(talk(all_gather=2, reduce_scatter=2), talk(all_gather=4, reduce_scatter=2), block.one.acts // T))


# ----------------------------------------------------------------------------- demo

def parser():
    p = flags.tokens(launch.demo_parser(__doc__), hidden=96)
    p.add_argument("--heads", type=int, default=12, help="H, attention heads (TP cuts them T ways)")
    return p


def _row(name, layer, one) -> str:
    """One line of the demo's table: collectives each way (calls, payload B), activation bytes per rank."""
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    talk = [" + ".join(f"{n} {short[k]}" for k, n in sorted(c.items())) + f", {nb:,}" if c else "-"
            for c, nb in (layer.fwd, layer.bwd)]
    return f"{name:9} {talk[0]:>24} {talk[1]:>24} {layer.acts:>14,} {f'1/{one.acts / layer.acts:.2f}':>9}"


def demo(args) -> int:
    T = launch.env_world_size()
    b, s, h = flags.token_sizes(args)
    heads = args.heads
    launch.require(heads >= 1 and h % heads == 0, f"--heads {heads} must be at least 1 and divide --hidden {h}")
    launch.require(heads % T == 0 and s % T == 0, f"{T} ranks cannot split {heads} heads and {s} tokens "
                   f"evenly: pick --heads and --seq multiples of {T}")
    dev = launch.setup().device
    block = block_three_ways(b, s, h, heads)
    worst = max(block.one.diff, block.tp.diff, block.sp.diff)
    launch.print0(f"transformer block b={b} s={s} h={h} heads={heads} causal fp64, T={T}: "
                  f"max |parallel - dense| (output, grad x, all weight grads) = {worst:.1e}")
    launch.print0(f"{'per rank':9} {'forward: calls, B':>24} {'backward: calls, B':>24} {'activations, B':>14} "
                  f"{'vs T=1':>9}   (activations: the bytes autograd saves for backward, kit.measure.SavedTensors)")
    want_tp, want_sp = expected(block)
    for name, layer in [("T=1", block.one), ("TP", block.tp), ("formula", want_tp), ("TP+SP", block.sp),
                        ("formula", want_sp)]:
        launch.print0(_row(name, layer, block.one))
    closed = whole_activations(block) + 8 * (12 * b * s * h + b * heads * s)
    launch.print0(f"formulas: TP keeps the layer norms' {whole_activations(block):,} B whole and 1/T of the rest, SP "
                  f"1/T of all (both judged)\nT=1 in closed form, e*[(4bsh + 4bs) + (12bsh + bHs)] = {closed:,} B "
                  f"{'=' if closed == block.one.acts else '!='} measured (information: bHs is the log-sum-exp a flash "
                  f"kernel keeps, SDPA's on the CPU; other kernels keep other bytes, the math kernel s x s "
                  f"probabilities)")
    params = sum(p.nbytes for p in ParallelTransformerBlock(h, heads, device=dev, dtype=torch.float64).parameters())
    dense_params = 8 * (12 * h * h + 13 * h)  # fp64: 4 [h, h] attention and 2 [4h, h] MLP weights, biases, norms
    kept_whole = 8 * (4 * h + 2 * h)  # two layer norms (weight, bias) and the row layers' biases stay whole
    want_params = kept_whole + (dense_params - kept_whole) // T
    launch.print0(f"parameters per rank {params:,} B = 1/{dense_params / params:.2f} of dense's {dense_params:,} B "
                  f"(formula: norms and row biases whole, the rest 1/T = {want_params:,} B)")
    formulas_hold = [block.tp[:3], block.sp[:3]] == [want_tp[:3], want_sp[:3]] and params == want_params
    return launch.conclude("parallel_transformer", worst < 1e-12, f"block = dense PyTorch ({worst:.0e})",
                           formulas_hold, f"{sum(block.tp.fwd[0].values())}+{sum(block.tp.bwd[0].values())} "
                           f"AR/layer, activations per rank 1/{block.one.acts / block.tp.acts:.2f} of one rank's "
                           f"(TP), 1/{block.one.acts / block.sp.acts:.2f} (TP+SP)")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
