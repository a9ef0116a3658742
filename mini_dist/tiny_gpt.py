"""A tiny GPT written once: the dense model from PyTorch's layers, or the same model cut over a mesh from
mini_dist's, with the same parameter names.

Token + position embedding, L pre-norm blocks x + attn(ln1(x)) + ffn(ln2(x)), a final layer norm and an LM
head (Radford et al. 2019, as nanoGPT writes it), reading a character corpus shipped here: V = 28 characters,
sequences of s tokens cut from it at fixed offsets, so every run sees the same batches. `tiny_gpt(cfg)` builds
it dense, from PyTorch's own layers; `tiny_gpt(cfg, mesh)` builds the same model with each layer swapped for
the one that cuts it along an axis of the mesh (mini_dist/mesh.py):

    embedding     nn.Embedding          -> VocabParallelEmbedding: V/T rows a rank     (vocab_parallel.py)
    attention     nn.MultiheadAttention -> ParallelAttention: H/T heads a rank         (parallel_transformer.py)
                                        -> ContextParallelAttention: and s/C tokens, ring attention over cp
    feed-forward  MLP h -> 4h -> h      -> columns / rows cut by T                     (parallel_transformer.py)
                  MoE of E experts      -> ExpertParallelMoE: E/ep experts a rank      (expert_parallel.py)
    LM head       nn.Linear(h, V)       -> ColumnParallelLinear: V/T logits a rank     (tensor_parallel.py)

Every swapped layer keeps its dense twin's parameter names, each tensor whole or cut along one dimension, so
the cut model can start as an exact shard of the dense one and its gradients can be gathered back to be
compared (mini_dist/parallel_gpt.py). The model is one flat nn.Sequential, so that a pipeline can cut it into
stages (mini_dist/train_5d.py).

Demo (the dense model's layers and parameters beside this rank's, cut over cp x tp with ep experts a rank):

    torchrun --standalone --nproc_per_node=4 mini_dist/tiny_gpt.py --cp 2 --tp 2 --moe 4 --ep 2
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import gpt_ledger
from mini_dist.activation_checkpoint import checkpoint_module
from mini_dist.cost_model import Plan
from mini_dist.context_parallel import ring_attention
from mini_dist.expert_parallel import MoE, ExpertParallelMoE
from mini_dist.kit import launch
from mini_dist.mesh import Mesh, grid_for
from mini_dist.parallel_transformer import ParallelAttention, ParallelTransformerBlock, TransformerBlock
from mini_dist.sequence_layout import split_sequence
from mini_dist.tensor_parallel import ColumnParallelLinear, check_input, column_parallel_linear
from mini_dist.vocab_parallel import VocabParallelEmbedding

CORPUS = ("a pipeline cuts the layers into stages and the batch into microbatches. tensor parallelism cuts every "
          "weight matrix, so the ranks of one layer talk twice forward and twice backward. data parallelism copies "
          "the model and averages the gradients once per step. put the chatty axis inside the node, the pipeline "
          "across nodes, and data parallelism everywhere; then check that the loss is the loss of one process. ")
CHARS = sorted(set(CORPUS))


def padded_vocab(tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp, V/tp rows a rank (the extra rows are never a target)."""
    return -(-len(CHARS) // tp) * tp


@dataclass(frozen=True)
class Config:
    """The tiny GPT's shape and training; every rank and the single process build from the same one."""
    vocab: int = len(CHARS)
    layers: int = 4
    hidden: int = 32
    heads: int = 4
    seq: int = 16
    batch: int = 8           # the global batch, in sequences: every configuration trains on the same one
    experts: int = 0         # 0: each block's feed-forward is an MLP; E: a mixture of E experts h -> 4h -> h
    top_k: int = 2           # experts per token
    checkpoint: bool = False  # recompute each block in backward (the parallel model; the math is the same)
    lr: float = 1e-2
    seed: int = 0
    dtype: torch.dtype = torch.float64


def tiny_gpt(cfg: Config, mesh: Mesh | None = None, device=None) -> nn.Sequential:
    """The model, written once. mesh=None: dense, PyTorch's layers; else mini_dist's over the mesh's tp, cp
    and ep groups, with the same parameter names. A flat nn.Sequential, so that a pipeline can cut it."""
    h = cfg.hidden
    V = cfg.vocab
    kw = dict(dtype=cfg.dtype, device=device)
    positions = nn.Embedding(cfg.seq, h, **kw)
    ln_f = nn.LayerNorm(h, **kw)
    if mesh is None:
        embedding = Embedding(nn.Embedding(V, h, **kw), positions)
        blocks = [TransformerBlock(h, cfg.heads, causal=True, **kw) for _ in range(cfg.layers)]
        head = Head(ln_f, nn.Linear(h, V, bias=False, **kw))
    else:
        tp = mesh.tp_group
        cp = mesh.cp_group if mesh.grid.cp > 1 else None
        embedding = Embedding(VocabParallelEmbedding(V, h, group=tp, **kw), positions, cp)
        blocks = [ParallelTransformerBlock(h, cfg.heads, causal=True, group=tp, **kw) for _ in range(cfg.layers)]
        head = Head(ln_f, ColumnParallelLinear(h, V, bias=False, group=tp, **kw))
    for block in blocks:
        if cfg.experts and mesh is None:
            block.mlp = MoE(h, 4 * h, cfg.experts, cfg.top_k, **kw)
        elif cfg.experts:
            block.mlp = ExpertParallelMoE(h, 4 * h, cfg.experts, cfg.top_k, group=mesh.ep_group, **kw)
        if cfg.experts:
            block.mlp.register_forward_hook(drop_aux_loss_graph)
        if mesh is not None and cp is not None:
            block.attn = ContextParallelAttention(h, cfg.heads, cp, group=tp, **kw)
        if mesh is not None and cfg.checkpoint:
            checkpoint_module(block)
    return nn.Sequential(embedding, *blocks, head)


def drop_aux_loss_graph(moe, inputs, output) -> None:
    """The aux loss is not trained: drop its graph now, not at the layer's next call (else, in a pipeline, one
    microbatch's graph would stay alive beside the next one's activations)."""
    moe.aux_loss = moe.aux_loss.detach()


class Embedding(nn.Module):
    """Token embedding (dense, or V/tp rows per rank) + a learned position embedding (replicated); under
    context parallelism the positions are those of this rank's s/C tokens."""

    def __init__(self, tokens: nn.Module, positions: nn.Embedding, cp_group=None):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.cp_group = cp_group

    def forward(self, ids):
        C = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        where = torch.arange(ids.shape[1] * C, device=ids.device)
        if C > 1:
            where = split_sequence(where[None], self.cp_group, dim=1)[0]
        return self.tokens(ids) + self.positions(where)


class Head(nn.Sequential):
    """Final layer norm + LM head (dense, or V/tp output columns per rank: logits stay split)."""


class ContextParallelAttention(ParallelAttention):
    """ParallelAttention with the sequence cut too: this rank's s/C tokens (zigzag) of its H/T heads attend
    to the whole sequence by ring attention over cp_group."""

    def __init__(self, hidden, num_heads, cp_group, group=None, device=None, dtype=None):
        super().__init__(hidden, num_heads, causal=True, group=group, device=device, dtype=dtype)
        self.cp_group = cp_group

    def forward(self, x):
        check_input(self, x, self.hidden)
        qkv = column_parallel_linear(x, self.in_proj_weight, self.in_proj_bias, self.group)  # [b, s/C, 3h/T]
        q, k, v = (t.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2) for t in qkv.chunk(3, -1))
        out = ring_attention(q, k, v, causal=True, group=self.cp_group)  # [b, H/T, s/C, d]: keys go round
        return self.out_proj(out.transpose(1, 2).flatten(2))


def dense_model(cfg: Config, device=None) -> nn.Sequential:
    """The dense model every rank and the single process start from: drawn from the CPU generator, seeded
    (# cpu: the same numbers on every device), then moved to `device`."""
    torch.manual_seed(cfg.seed)
    return tiny_gpt(cfg).to(device)


def get_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: windows of the corpus at deterministic offsets, targets shifted by one."""
    data = torch.tensor([CHARS.index(c) for c in CORPUS], device=launch.device())
    starts = [(7 * (step * cfg.batch + i)) % (len(data) - cfg.seq - 1) for i in range(cfg.batch)]
    windows = torch.stack([data[a:a + cfg.seq + 1] for a in starts])
    return windows[:, :-1], windows[:, 1:]


def kind(layer) -> str:
    """The ledger's name for a layer of the flat model (mini_dist/gpt_ledger.py)."""
    if isinstance(layer, Embedding):
        return "embedding"
    if isinstance(layer, Head):
        return "head"
    return "block"


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default: the world / cp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, a divisor of cp and of --moe")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 (0: an MLP)")
    return p


def cut(dense: torch.Size, mine: torch.Size, ways: tuple) -> bool:
    """Whether `mine` is `dense` whole, or cut along one dimension into one of `ways` equal parts."""
    if len(mine) != len(dense):
        return False
    differ = [d for d in range(len(dense)) if dense[d] != mine[d]]
    return not differ or len(differ) == 1 and any(mine[differ[0]] * w == dense[differ[0]] for w in ways)


def layers_of(layer: nn.Module) -> str:
    """A layer and the classes of its children: Embedding(VocabParallelEmbedding, Embedding)."""
    return f"{type(layer).__name__}({', '.join(type(child).__name__ for child in layer.children())})"


def demo(args) -> int:
    world = launch.env_world_size()
    tp = args.tp if args.tp is not None else world // max(args.cp, 1)
    launch.require(min(args.cp, tp, args.ep) >= 1 and args.cp * tp == world, f"--cp {args.cp} x --tp {tp} must be "
                                                                              f"the world of {world} ranks")
    launch.require(4 % tp == 0 and 16 % (2 * args.cp) == 0, f"--tp {tp} must divide the 4 heads and 2 x --cp "
                                                            f"{args.cp} the 16 tokens")
    launch.require(args.moe >= 0 and args.moe != 1 and args.moe % args.ep == 0 and args.cp % args.ep == 0 and
                   (args.moe or args.ep == 1), f"--ep {args.ep} must divide --cp {args.cp} and --moe {args.moe} "
                                               "(0, or 2 or more: top-2)")
    grid = grid_for(world, dp=1, pp=1, cp=args.cp, tp=tp, ep=args.ep)
    cfg = Config(vocab=padded_vocab(tp), experts=args.moe)
    launch.setup()
    dense = tiny_gpt(cfg, device=launch.device())
    mine = tiny_gpt(cfg, Mesh(cp=grid.cp, tp=grid.tp, ep=grid.ep), launch.device())
    theirs = dict(dense.named_parameters())
    ours = dict(mine.named_parameters())
    same = list(theirs) == list(ours) and all(cut(theirs[n].shape, ours[n].shape, (tp, args.ep)) for n in theirs)
    plan = Plan(dp=1, cp=args.cp, tp=tp, ep=args.ep)
    ledger = sum(sum(gpt_ledger.layer_numel(gpt_ledger.model_of(cfg), plan, kind(layer))) for layer in mine)
    held = sum(p.numel() for p in ours.values())
    launch.print0(f"tiny GPT: {cfg.layers} blocks, h = {cfg.hidden}, {cfg.heads} heads, V = {cfg.vocab}; cp "
                  f"{args.cp} x tp {tp}, ep {args.ep}; each layer, dense (PyTorch's) -> on rank 0 (mini_dist's):")
    for i in (0, 1, len(dense) - 1):  # the embedding, a block (all alike), the head
        launch.print0(f"  {i}: {layers_of(dense[i])}\n  -> {layers_of(mine[i])}")
    launch.print0("the first block's parameters, dense -> rank 0:\n" + "\n".join(
        f"  {n[2:]:<22} {str(list(theirs[n].shape)):>14} -> {list(ours[n].shape)}" for n in theirs if n[:2] == "1."))
    return launch.conclude("tiny_gpt", same, "the dense model's parameter names, each tensor whole or cut",
                           held == ledger, f"rank 0 holds {held:,} of the {sum(p.numel() for p in theirs.values()):,}"
                           " dense parameters = gpt_ledger's")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
