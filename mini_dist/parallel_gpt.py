"""A tiny GPT written once, dense or cut along three axes at once: tensor, context and expert parallelism.

Token + position embedding, L pre-norm blocks x + attn(ln1(x)) + ffn(ln2(x)), a final layer norm and an LM
head, on a character corpus shipped here. The dense model is PyTorch's own layers (nn.MultiheadAttention, an
MLP or a mixture of experts); the parallel one is mini_dist's, with the same parameter names, so it starts as
an exact shard of the dense one. Each axis cuts one thing, over its group of the mesh (mini_dist/mesh.py):

    TP  (tensor_parallel, vocab_parallel)   every weight matrix: heads, MLP columns/rows, vocabulary rows
    CP  (context_parallel)                  the sequence: s/C tokens per rank (zigzag), ring attention
    EP  (expert_parallel)                   the experts: E/ep per rank, their tokens moved by all-to-all

Per block and microbatch of b(s/C) tokens, a rank sends 4 TP all-reduces of b(s/C)h elements (2 with experts,
which TP does not cut), 6(C-1) CP hops of b(s/C)h/T (K, V forward, dK, dV back) and its routed rows twice
(mini_dist/gpt_ledger.py: every byte sent and held, exactly). Experts route with no capacity limit and no
auxiliary loss: both depend on which tokens are routed together, so the run would no longer equal one process.

Demo (one forward + backward against the dense model; bytes per axis and memory per rank beside the ledger):

    torchrun --standalone --nproc_per_node=4 mini_dist/parallel_gpt.py --cp 2 --tp 2 --moe 4 --ep 2

Mirrors the model side of torchtitan (parallelize_llama: TP plan, context_parallel, expert-parallel MoE).
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import cost_model, expert_parallel, gpt_ledger, tp_layout
from mini_dist.activation_checkpoint import checkpoint_module
from mini_dist.comm import COUNTER, all_reduce
from mini_dist.context_parallel import ring_attention
from mini_dist.expert_parallel import MoE, ExpertParallelMoE
from mini_dist.kit import launch
from mini_dist.kit.measure import PeakSaved, side_by_side
from mini_dist.mesh import Mesh, grid_for
from mini_dist.parallel_transformer import ParallelAttention, ParallelTransformerBlock, TransformerBlock
from mini_dist.sequence_layout import split_sequence
from mini_dist.tensor_parallel import ColumnParallelLinear, check_input, column_parallel_linear
from mini_dist.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

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
    h, V, kw = cfg.hidden, cfg.vocab, dict(dtype=cfg.dtype, device=device)
    positions, ln_f = nn.Embedding(cfg.seq, h, dtype=cfg.dtype, device=device), nn.LayerNorm(h, dtype=cfg.dtype,
                                                                                            device=device)
    if mesh is None:
        embedding = Embedding(nn.Embedding(V, h, dtype=cfg.dtype, device=device), positions)
        blocks = [TransformerBlock(h, cfg.heads, causal=True, **kw) for _ in range(cfg.layers)]
        head = Head(ln_f, nn.Linear(h, V, bias=False, dtype=cfg.dtype, device=device))
    else:
        tp, cp = mesh.tp_group, mesh.cp_group if mesh.grid.cp > 1 else None
        embedding = Embedding(VocabParallelEmbedding(V, h, group=tp, **kw), positions, cp)
        blocks = [ParallelTransformerBlock(h, cfg.heads, causal=True, group=tp, **kw) for _ in range(cfg.layers)]
        head = Head(ln_f, ColumnParallelLinear(h, V, bias=False, group=tp, **kw))
    for block in blocks:
        if cfg.experts:
            block.mlp = MoE(h, 4 * h, cfg.experts, cfg.top_k, **kw) if mesh is None else \
                ExpertParallelMoE(h, 4 * h, cfg.experts, cfg.top_k, group=mesh.ep_group, **kw)
            # the aux loss is not trained: drop its graph now, not at the layer's next call (else, in a pipeline,
            # one microbatch's graph would stay alive beside the next one's activations)
            block.mlp.register_forward_hook(lambda moe, *_: setattr(moe, "aux_loss", moe.aux_loss.detach()))
        if mesh is not None and cp is not None:
            block.attn = ContextParallelAttention(h, cfg.heads, cp, group=tp, **kw)
        if mesh is not None and cfg.checkpoint:
            checkpoint_module(block)
    return nn.Sequential(embedding, *blocks, head)


class Embedding(nn.Module):
    """Token embedding (dense, or V/tp rows per rank) + a learned position embedding (replicated); under
    context parallelism the positions are those of this rank's s/C tokens."""

    def __init__(self, tokens: nn.Module, positions: nn.Embedding, cp_group=None):
        super().__init__()
        self.tokens, self.positions, self.cp_group = tokens, positions, cp_group

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


def parts(model: nn.Sequential, dense: nn.Sequential, mesh: Mesh):
    """(part, its dense twin, the module that moves its weights, over which group): each weight once."""
    for layer, whole in zip(model, dense):
        for name, part in layer.named_children():
            axis = expert_parallel if isinstance(part, ExpertParallelMoE) else tp_layout
            yield part, getattr(whole, name), axis, mesh.ep_group if axis is expert_parallel else mesh.tp_group


def shard_from_dense(model: nn.Sequential, dense: nn.Sequential, mesh: Mesh) -> nn.Sequential:
    """Copy this rank's shard of every dense weight: TP slices, this rank's experts, the rest whole."""
    for part, twin, axis, group in parts(model, dense, mesh):
        axis.shard_from_dense(part, twin, group)
    return model


def gather_to_dense(model: nn.Sequential, dense: nn.Sequential, mesh: Mesh) -> nn.Sequential:
    """The inverse, gradients included (each rank's gradients as they are: average them over dp_cp first)."""
    for part, twin, axis, group in parts(model, dense, mesh):
        axis.gather_to_dense(part, twin, group)
    return dense


def dense_model(cfg: Config, device=None) -> nn.Sequential:
    """The dense model every rank and the single process start from: drawn from the CPU generator, seeded
    (# cpu: the same numbers on every device), then moved to `device`."""
    torch.manual_seed(cfg.seed)
    return tiny_gpt(cfg).to(device)


def parallel_model(cfg: Config, mesh: Mesh) -> nn.Sequential:
    """This rank's shard of dense_model(cfg), on this rank's device."""
    return shard_from_dense(tiny_gpt(cfg, mesh, launch.device()), dense_model(cfg, launch.device()), mesh)


def get_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: windows of the corpus at deterministic offsets, targets shifted by one."""
    data = torch.tensor([CHARS.index(c) for c in CORPUS], device=launch.device())
    starts = [(7 * (step * cfg.batch + i)) % (len(data) - cfg.seq - 1) for i in range(cfg.batch)]
    windows = torch.stack([data[a:a + cfg.seq + 1] for a in starts])
    return windows[:, :-1], windows[:, 1:]


def local_batch(cfg: Config, mesh: Mesh, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of the global batch: its replica's b = B/dp sequences, its s/C part of each."""
    b = cfg.batch // mesh.grid.dp
    ids, targets = (t[mesh.dp_rank * b:(mesh.dp_rank + 1) * b] for t in get_batch(cfg, step))
    if mesh.grid.cp == 1:
        return ids, targets
    return tuple(split_sequence(t, mesh.cp_group, dim=1) for t in (ids, targets))


def average_gradients(model, mesh: Mesh) -> None:
    """Plain data parallelism (train_5d.py overlaps it): each gradient averaged over the dp x cp ranks, which
    saw other tokens; an expert's already sums its EP group's tokens: its replicas (edp) sum theirs, / dp*cp."""
    # exercise: sum each gradient over its group (edp for an expert, which has ep_dim; dp_cp else), / (dp x cp)
    n = mesh.grid.dp * mesh.grid.cp
    for p in model.parameters():
        p.grad = all_reduce(p.grad, mesh.edp_group if hasattr(p, "ep_dim") else mesh.dp_cp_group) / n
    # end exercise


def kind(layer) -> str:
    """The ledger's name for a layer of the flat model (mini_dist/gpt_ledger.py)."""
    return "embedding" if isinstance(layer, Embedding) else "head" if isinstance(layer, Head) else "block"


def configuration_error(cfg: Config, grid) -> str | None:
    """Why this model cannot be cut over this grid, in one sentence saying what to change, or None."""
    if min(cfg.layers, cfg.hidden, cfg.heads, cfg.seq) < 1 or cfg.experts < 0 or cfg.seq > len(CORPUS) - 2:
        return f"--layers, --hidden, --heads, --seq must be >= 1 (--seq <= {len(CORPUS) - 2}), --moe >= 0"
    if cfg.hidden % cfg.heads or cfg.heads % grid.tp:
        heads = -(-cfg.heads // grid.tp) * grid.tp
        return (f"--heads {cfg.heads} must divide --hidden {cfg.hidden} and be a multiple of --tp {grid.tp} (each "
                f"rank owns whole heads): try --heads {heads} --hidden {-(-cfg.hidden // heads) * heads}")
    if grid.cp > 1 and cfg.seq % (2 * grid.cp):
        return f"--seq {cfg.seq} must be a multiple of 2 x cp = {2 * grid.cp}: zigzag gives each rank 2 of 2C chunks"
    if cfg.experts % grid.ep or (grid.ep > 1 and not cfg.experts):
        return (f"--ep {grid.ep} must divide the experts, --moe {cfg.experts} (E/ep whole experts a rank): try "
                f"--moe {-(-max(cfg.experts, 1) // grid.ep) * grid.ep}")
    if cfg.batch % grid.dp:
        return f"the global batch of {cfg.batch} sequences must split into dp = {grid.dp} equal replica batches"
    if cfg.experts and not 1 <= cfg.top_k <= cfg.experts:
        return f"top-{cfg.top_k} routing needs at least {cfg.top_k} experts: use --moe {cfg.top_k} or more"
    return None


# ----- demo: one forward + backward against the dense model -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks (default: the world / tp)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default 2 where the world allows)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, a divisor of cp and of --moe")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 (0: an MLP)")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in backward")
    for name in ("layers", "hidden", "heads", "seq"):
        p.add_argument(f"--{name}", type=int, default=getattr(Config, name), help=f"the model's {name}")
    return p


def step_against_dense(cfg: Config, mesh: Mesh):
    """One forward + backward of this rank's shard on its tokens beside the dense model on the whole batch.
    Returns the largest difference (the loss and every gradient), then (measured, ledger) pairs: the bytes
    each axis moved, and the bytes of parameters, gradients and activations (the most bytes autograd saved
    for backward at once, measure.PeakSaved: exact on any device, unlike an allocator's peak)."""
    dev, g = launch.device(), mesh.grid
    model, dense = parallel_model(cfg, mesh), dense_model(cfg, dev)
    ids, targets = local_batch(cfg, mesh, 0)
    COUNTER.reset()
    saved = PeakSaved(lambda: {p.untyped_storage().data_ptr() for p in model.parameters()})
    with saved.hooks():
        loss = vocab_parallel_cross_entropy(model(ids), targets, mesh.tp_group).mean()  # from V/tp logits
    loss.backward()
    sent = {"tp": COUNTER.bytes["all_reduce"], "cp": COUNTER.bytes["ring attention"], "ep": COUNTER.bytes["all_to_all"]}
    me = mesh.coords["ep_index"]
    routed = [gpt_ledger.routed_rows(m, me) for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    held = {"params": sum(p.nbytes for p in model.parameters()),
            "grads": sum(p.grad.nbytes for p in model.parameters()), "activations": saved.peak}
    ids, targets = get_batch(cfg, 0)
    whole = F.cross_entropy(dense(ids).flatten(0, 1), targets.flatten())
    whole.backward()
    mean_loss = all_reduce(loss.detach(), mesh.dp_cp_group) / (g.dp * g.cp)
    average_gradients(model, mesh)
    gathered = gather_to_dense(model, dense_model(cfg, dev), mesh)
    diffs = [mean_loss - whole] + [p.grad - q.grad for p, q in zip(gathered.parameters(), dense.parameters())]
    plan = cost_model.Plan(dp=g.dp, cp=g.cp, tp=g.tp, ep=g.ep, checkpoint=cfg.checkpoint,
                           micro_batch=cfg.batch // g.dp, precision="fp64")
    traffic, planned = gpt_ledger.step_ledger(gpt_ledger.model_of(cfg), plan, list(map(kind, model)), routed, dev)
    return max(d.abs().max().item() for d in diffs), (sent, traffic), (held, planned)


def demo(args) -> int:
    world, cp = launch.env_world_size(), args.cp  # unset: tp 2 where the world allows, cp the rest
    tp = args.tp if args.tp is not None else world // cp if cp and world % cp == 0 else 2 - world % 2
    cp = cp if cp is not None else max(world // max(tp, 1), 1)
    launch.require(min(cp, tp) >= 1 and cp * tp == world, f"--cp {cp} x --tp {tp} = {cp * tp} ranks, but the world "
                                                          f"has {world}: choose degrees >= 1 with a product of {world}")
    grid = grid_for(world, dp=1, pp=1, cp=cp, tp=tp, ep=args.ep)
    cfg = Config(vocab=padded_vocab(grid.tp), layers=args.layers, hidden=args.hidden, heads=args.heads,
                 seq=args.seq, batch=2, experts=args.moe, checkpoint=args.checkpoint)
    problem = configuration_error(cfg, grid)
    launch.require(problem is None, problem)
    launch.setup()
    worst, traffic, memory = step_against_dense(cfg, Mesh(cp=grid.cp, tp=grid.tp, ep=grid.ep))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (traffic, memory))
    launch.print0(f"tiny GPT: {cfg.layers} blocks, h={cfg.hidden}, {cfg.heads} heads, s={cfg.seq}, batch 2, "
                  f"{f'MoE {cfg.experts} experts top-{cfg.top_k}' if cfg.experts else 'MLP'}"
                  f"{', checkpointed blocks' * cfg.checkpoint}; cp {grid.cp} x tp {grid.tp}, ep {grid.ep}, fp64\n"
                  f"|loss - dense| and max |grad - dense| over every weight: {worst:.1e}\nbytes each rank sent in one "
                  "forward + backward, by axis: measured = the docstring's formulas\n" + side_by_side(
                      [t for t, _ in rows], ("tp", "cp", "ep")) + "\nbytes each rank holds: measured = ledger "
                  "(mini_dist/gpt_ledger.py); activations: the most bytes autograd saved for backward at once "
                  "(measure.PeakSaved)\n" + side_by_side([m for _, m in rows], ("params", "grads", "activations")))
    exact = all(a == b for pairs in rows for a, b in pairs)
    return launch.conclude("parallel_gpt", worst < 1e-12, f"= dense GPT ({worst:.0e})", exact,
                           "bytes per axis = formulas, memory = ledger")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
