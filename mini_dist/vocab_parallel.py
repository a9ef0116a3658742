"""Vocabulary parallelism (Megatron-LM): the embedding table and the loss split by vocabulary, T ways.

The vocabulary is the widest dim of a language model (GPT-2: V = 50257 against h = 768), so its embedding
table [V, h] and its logits [b, s, V] are what tensor parallelism must not keep whole. Rank i of T holds
rows i*V/T .. (i+1)*V/T of the embedding; a token's vector comes from the one rank that owns its id (the
others contribute zeros) through one all-reduce, Megatron's g. The output layer is column-parallel, so
each rank ends with V/T logits per token, and the cross-entropy

    loss = log sum_j exp(z_j - m) - (z_target - m),        m = max_j z_j   (j over all V)

needs whole-vocabulary numbers only per token: all-reduce the local maxima, then the local sums of exp
together with the target logit (it lives on one rank, the others add 0). Per token that is

    3 elements all-reduced (max, sum, target logit)    vs    V elements all-gathered (and stored)

when the naive way all-gathers the b*s*V logits and calls F.cross_entropy. Backward talks not at all:
d loss / d z_j = softmax_j - [j = target] needs only the local softmax and the owner of the target.

Demo (checks against nn.Embedding + F.cross_entropy, prints bytes per token beside the naive all-gather):

    torchrun --standalone --nproc_per_node=4 mini_dist/vocab_parallel.py [--vocab 1200 --hidden 32]

Mirrors: nn.Embedding and F.cross_entropy, split the way Megatron-LM's VocabParallelEmbedding and
vocab_parallel_cross_entropy split them. The g operator comes from comm.py, the layers from tensor_parallel.py.
"""
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import flags, launch
from mini_dist.comm import (COUNTER, agree, all_reduce, check_divisible, g, gather_from_tp,
                            reduce_scatter_to_sp)
from mini_dist.tensor_parallel import ColumnParallelLinear, parameter, tp_size
from mini_dist.tp_layout import Layout, gather_to_dense, shard_from_dense


# ----- the idea: the loss from V/T logits per rank, three numbers per token all-reduced -----

def naive_vocab_cross_entropy(logits, target, group=None):
    """The naive way: all-gather the full [..., V] logits on every rank, then F.cross_entropy."""
    full = gather_from_tp(logits, group)                                    # (b, s, V/T) -> (b, s, V)
    return F.cross_entropy(full.flatten(0, -2), target.flatten(), reduction="none").view_as(target)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log sum_j exp(z_j - m) - (z_target - m) from my V/T logits z: three all-reduced numbers a token.
    Over the naive all-gather it buys 3 numbers a token sent for V, and no rank ever holds the [b, s, V] logits."""

    @staticmethod
    def forward(ctx, logits, target, group):
        start = dist.get_rank(group) * logits.shape[-1]                     # my ids are [start, start + V/T)
        # softmax needs the max and the sum over the WHOLE vocabulary: all-reduce one number per token each
        m = all_reduce(logits.max(-1).values, group, dist.ReduceOp.MAX)     # (b, s): the max over all V
        logits = logits - m.unsqueeze(-1)                                   # (b, s, V/T), every exponent <= 0
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])                    # (b, s): the target is one of mine
        local = torch.where(mine, local, 0)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine  # (b, s) target logit, on its owner
        exp = logits.exp()                                                  # (b, s, V/T)
        picked, sum_exp = all_reduce(torch.stack([picked, exp.sum(-1)]), group)  # two sums, one collective
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine)  # my V/T of the softmax
        return sum_exp.log() - picked                                       # (b, s): log sum exp - z_target

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j is the target]: only the owning rank subtracts the 1
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits, target, group=None):
    """Per-token F.cross_entropy(full_logits, target, reduction='none') from this rank's V/T logits."""
    agree("vocab_parallel_cross_entropy", (tuple(logits.shape), logits.dtype, tuple(target.shape)), group)
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must agree "
                         "on every dim but the last (vocabulary / T)")
    return _VocabParallelCrossEntropy.apply(logits, target, group)


# ----- the embedding, split by vocabulary the same way -----

class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the vocabulary split: rank i holds rows i*V/T..; a token's vector comes from
    the one rank that owns it (the others contribute zeros) through one all-reduce."""

    def __init__(self, num_embeddings, embedding_dim, sequence_parallel=False, group=None, device=None,
                 dtype=None):
        super().__init__()
        T = tp_size(group)
        check_divisible("num_embeddings (vocabulary)", num_embeddings, T,
                         "pad the vocabulary to a multiple of T (Megatron pads to a multiple of 128*T)")
        self.num_embeddings = num_embeddings
        self.sequence_parallel = sequence_parallel
        self.group = group
        self.vocab_start = dist.get_rank(group) * (num_embeddings // T)
        self.weight = parameter((num_embeddings // T, embedding_dim), device=device, dtype=dtype)
        self.tp_layout = {"weight": Layout(0)}

    def forward(self, ids):
        agree(type(self).__name__, (tuple(ids.shape), ids.dtype), self.group)  # MINI_DIST_DEBUG=1: same ids shape
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}); got "
                             f"[{ids.min().item()}, {ids.max().item()}]")
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1)
        return reduce_scatter_to_sp(out, self.group) if self.sequence_parallel else g(out, self.group)


# ----------------------------------------------------------------------------- demo


def parser():
    p = flags.tokens(launch.demo_parser(__doc__), hidden=32, hidden_help="h, the embedding width")
    p.add_argument("--vocab", type=int, default=1200, help="V, the vocabulary (cut T ways)")
    return p


def demo(args) -> int:
    T = launch.env_world_size()
    batch, seq, h = flags.token_sizes(args)
    V = args.vocab
    launch.require(V >= 1 and V % T == 0, f"a vocabulary of {V} cannot be cut into {T} equal slices: pick --vocab "
                                          f"a positive multiple of {T} (Megatron pads it to a multiple of 128*T)")
    env = launch.setup()
    dev = env.device
    f64 = torch.float64
    dense = nn.Sequential(nn.Embedding(V, h), nn.Linear(h, V, bias=False)).to(dev, f64)
    ids = torch.randint(0, V, (batch, seq), device=dev)  # the same on every rank: setup() seeds them alike
    target = torch.randint(0, V, (batch, seq), device=dev)
    dense_loss = F.cross_entropy(dense(ids).flatten(0, 1), target.flatten(), reduction="none").view_as(target)
    dense_loss.mean().backward()
    worst = 0.0
    sent = []  # the loss's payload bytes per token: naive, then vocab-parallel
    for loss_fn in (naive_vocab_cross_entropy, vocab_parallel_cross_entropy):
        model = shard_from_dense(nn.Sequential(VocabParallelEmbedding(V, h, device=dev, dtype=f64),
                                               ColumnParallelLinear(h, V, False, device=dev, dtype=f64)), dense)
        logits = model(ids)
        z = logits.detach().requires_grad_()  # a cut in the graph: count what the loss alone sends, both ways
        COUNTER.reset()
        loss = loss_fn(z, target)
        loss.mean().backward()
        sent.append(sum(COUNTER.bytes.values()) / (batch * seq))
        logits.backward(z.grad)
        gathered = gather_to_dense(model, copy.deepcopy(dense))
        pairs = [(loss, dense_loss)] + [(p.grad, q.grad) for p, q in zip(gathered.parameters(), dense.parameters())]
        worst = max([worst] + [(a - b).abs().max().item() for a, b in pairs])
    want = [V * 8, 3 * 8]  # fp64: 8 bytes an element
    launch.print0(f"nn.Embedding({V}, {h}) + F.cross_entropy over {batch * seq} tokens, V/T = {V // T} rows per "
                  f"rank, T={T}, fp64: max |parallel - dense| (per-token loss, weight grads) = {worst:.1e}")
    launch.print0(f"the loss's payload per token, per rank (forward and backward): naive {sent[0]:,g} B all-gathered "
                  f"(formula V x 8 = {want[0]:,}), vocab-parallel {sent[1]:,g} B all-reduced (formula 3 x 8 = "
                  f"{want[1]})" + ("; one rank sends nothing" if T == 1 else ""))
    return launch.conclude("vocab_parallel", worst < 1e-12, f"= nn.Embedding + F.cross_entropy ({worst:.0e})",
                           sent == (want if T > 1 else [0, 0]),
                           f"{sent[1]:,g} B/token all-reduced vs {sent[0]:,g} B all-gathered")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
