"""3D parallelism: one tiny GPT trained with data x pipeline x tensor parallelism, equal to one process.

The world is a dp x pp x tp grid of ranks (mini_dist.mesh). Each rank holds 1/tp of the weights (Megatron
tensor parallelism) of 1/pp of the layers (a pipeline stage, or v chunks of an interleaved one) and sees
1/dp of the global batch (a data-parallel replica, cut further into M microbatches). The model is written
once: the same class builds the dense reference from PyTorch's layers or the tensor-parallel one from
mini_dist's, with the same parameter names, so the parallel model starts as an exact shard of the dense
one and must stay one, step after step.

Data parallelism inside a pipeline: mini_dist.ddp's bucketed DistributedDataParallel wraps each chunk, and
every weight-gradient computation but a chunk's last runs under its no_sync(): the gradients of all M
microbatches are reduced once per step, during that last backward, while earlier stages still drain.

Bytes one rank moves per step (b = its replica's batch = B/dp sequences, s tokens, h hidden, e bytes per
element, L = transformer blocks on its stage):

    TP  (payload of each collective)  [4L + embedding + LM head] * b*s*h*e  +  3*b*s*e for the loss
        (2 all-reduces per block forward, 2 backward; the vocab-parallel embedding all-reduces forward and
        the LM head backward; the cross-entropy all-reduces a max and two sums per token)
    PP  b*s*h*e to the next stage + b*s*h*e of gradient to the previous one, per chunk (+ one shape
        header): activations between neighbours only, whatever M is
    DP  ring all-reduce of the stage's D gradient bytes, once per step: 2(N-1)/N * D (ZeRO-1:
        3(N-1)*S*e, ZeRO-2: 2(N-1)*S*e with S = ceil(numel/N), see mini_dist.zero)

so TP's bytes scale with the activations of every layer (keep it inside a node), PP's with one activation
per stage boundary, DP's with the parameters. Demo (loss per step beside one process, bytes beside formulas):

    torchrun --standalone --nproc_per_node=8 mini_dist/train_3d.py --dp 2 --pp 2 --tp 2
    torchrun --standalone --nproc_per_node=4 mini_dist/train_3d.py --pp 2 --tp 2 --schedule interleaved --chunks 2 --zero 2

Mirrors Megatron-LM's 3D parallelism (tensor, pipeline, data) and torchtitan's composition of
torch.distributed.tensor.parallel, torch.distributed.pipelining and FSDP/DDP on a DeviceMesh.
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
from mini_dist import launch  # noqa: E402
from mini_dist.comm import COUNTER  # noqa: E402
from mini_dist.ddp import DistributedDataParallel  # noqa: E402
from mini_dist.mesh import Mesh, grid_for  # noqa: E402
from mini_dist.parallel_transformer import ParallelTransformerBlock, TransformerBlock  # noqa: E402
from mini_dist.pipeline import HEADER_LEN, pipeline_step  # noqa: E402
from mini_dist.pipeline_schedules import SCHEDULES, balanced_split, pipeline_chunks  # noqa: E402
from mini_dist.ring_allreduce import LEDGER, ring_all_reduce  # noqa: E402
from mini_dist.tensor_parallel import ColumnParallelLinear, shard_from_dense  # noqa: E402
from mini_dist.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy  # noqa: E402
from mini_dist.zero import Partition, ZeroOptimizer, bytes_sent_formula  # noqa: E402

CORPUS = (
    "a pipeline cuts the layers into stages and the batch into microbatches. tensor parallelism cuts every "
    "weight matrix, so the ranks of one layer talk twice forward and twice backward. data parallelism copies "
    "the model and averages the gradients once per step. put the chatty axis inside the node, the pipeline "
    "across nodes, and data parallelism everywhere; then check that the loss is the loss of one process. "
)
CHARS = sorted(set(CORPUS))


def padded_vocab(tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp: each rank owns V/tp rows (the extra rows are never a
    target; Megatron pads to a multiple of 128*tp for fast matmuls)."""
    return -(-len(CHARS) // tp) * tp


@dataclass(frozen=True)
class Config:
    vocab: int = len(CHARS)
    layers: int = 4
    hidden: int = 32
    heads: int = 4
    seq: int = 16
    batch: int = 8  # the global batch, in sequences: every configuration trains on the same one
    lr: float = 1e-2
    seed: int = 0
    dtype: torch.dtype = torch.float64


def get_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: windows of the corpus at deterministic offsets, targets shifted by one."""
    data = torch.tensor([CHARS.index(c) for c in CORPUS])
    starts = [(7 * (step * cfg.batch + i)) % (len(data) - cfg.seq - 1) for i in range(cfg.batch)]
    windows = torch.stack([data[a:a + cfg.seq + 1] for a in starts])
    return windows[:, :-1], windows[:, 1:]


class Embedding(nn.Module):
    """Token embedding (dense, or V/tp rows per rank) + a learned position embedding (replicated)."""

    def __init__(self, cfg: Config, token_embedding: nn.Module, device=None):
        super().__init__()
        self.tokens = token_embedding
        self.positions = nn.Parameter(0.02 * torch.randn(cfg.seq, cfg.hidden, dtype=cfg.dtype, device=device))

    def forward(self, ids):
        return self.tokens(ids) + self.positions[:ids.shape[1]]


class Head(nn.Module):
    """Final layer norm + LM head (dense, or V/tp output columns per rank: logits stay split)."""

    def __init__(self, cfg: Config, lm_head: nn.Module, device=None):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(cfg.hidden, dtype=cfg.dtype, device=device), lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def tiny_gpt(cfg: Config, tensor_parallel: bool = False, tp_group=None, device=None) -> nn.Sequential:
    """The model, written once: embedding, cfg.layers pre-norm blocks, head. Dense layers are PyTorch's
    own; tensor-parallel ones are mini_dist's over tp_group, with the same parameter names. A flat
    nn.Sequential, so that the pipeline can cut it anywhere."""
    h, kw = cfg.hidden, dict(dtype=cfg.dtype, device=device)
    if tensor_parallel:
        return nn.Sequential(
            Embedding(cfg, VocabParallelEmbedding(cfg.vocab, h, group=tp_group, **kw), device),
            *[ParallelTransformerBlock(h, cfg.heads, causal=True, group=tp_group, **kw) for _ in range(cfg.layers)],
            Head(cfg, ColumnParallelLinear(h, cfg.vocab, bias=False, group=tp_group, **kw), device))
    return nn.Sequential(Embedding(cfg, nn.Embedding(cfg.vocab, h, **kw), device),
                         *[TransformerBlock(h, cfg.heads, causal=True, **kw) for _ in range(cfg.layers)],
                         Head(cfg, nn.Linear(h, cfg.vocab, bias=False, **kw), device))


def dense_model(cfg: Config) -> nn.Sequential:
    torch.manual_seed(cfg.seed)  # every rank, and the single process, build the same initial model
    return tiny_gpt(cfg)


def train_dense(cfg: Config, steps: int) -> list[float]:
    """The reference: one process, the dense model, the whole global batch, torch.optim.Adam."""
    model = dense_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(steps):
        ids, targets = get_batch(cfg, step)
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@dataclass
class Run:
    """What one rank of a 3D run measured: the global loss per step (the same on every rank), this rank's
    bytes per axis per step, and what its formulas need."""
    losses: list
    bytes: list          # per step: {"dp": .., "tp": .., "pp": ..} sent (pp, dp) or reduced (tp) by this rank
    stages: list         # this rank's virtual stages j, one per chunk
    layout: dict         # its chunks together: transformer blocks, embedding?, head?
    numel: int           # parameters (elements) of this rank's shards: D = numel * e
    local_batch: int
    peak_live: int       # most microbatches x chunks whose activations this rank held at once


SCHEDULES_3D = ("gpipe", "1f1b", "interleaved")  # zero bubble: see configuration_error


def configuration_error(cfg: Config, dims: tuple, microbatches: int, schedule: str, chunks: int) -> str | None:
    """Why (dp, pp, tp) and the rest cannot run, in one sentence that says what to change, or None.
    Everything here is known on every rank before any collective (the demo asks before setup)."""
    dp, pp, tp = dims
    if cfg.hidden % cfg.heads or cfg.heads % tp:
        heads = -(-cfg.heads // tp) * tp
        return (f"--heads {cfg.heads} must divide --hidden {cfg.hidden} and be a multiple of --tp {tp} (each "
                f"tensor-parallel rank owns whole heads): try --heads {heads} --hidden {-(-cfg.hidden // heads) * heads}")
    if cfg.layers + 2 < pp * chunks:
        return (f"--layers {cfg.layers} + embedding + head = {cfg.layers + 2} layers cannot fill {pp} stages x "
                f"{chunks} chunk(s), one layer each at least: use --layers {pp * chunks - 2} or more, or fewer stages "
                f"or chunks")
    if cfg.batch % (dp * microbatches) or cfg.vocab % tp:
        return (f"the global batch {cfg.batch} must split into dp={dp} replicas x {microbatches} microbatches and "
                f"the vocabulary {cfg.vocab} into tp={tp} shards: use a multiple of each (padded_vocab(tp))")
    if schedule not in SCHEDULES_3D:  # its W would rerun a transformer block's all-reduces (see pipeline.py)
        return f"{schedule} does not run a transformer block's weight gradients alone: use one of {SCHEDULES_3D}"
    try:
        SCHEDULES[schedule](pp, microbatches, chunks)
    except ValueError as e:
        return str(e)


DP_BUCKET_MB = 1 / 32  # 32 KiB: a few buckets per stage of the tiny GPT


def train_3d(cfg: Config, mesh: Mesh, steps: int, microbatches: int = 1, schedule: str = "gpipe",
             zero: int = 0, chunks: int = 1) -> Run:
    grid = mesh.grid
    problem = configuration_error(cfg, (grid.dp, grid.pp, grid.tp), microbatches, schedule, chunks)
    if problem:
        raise ValueError(problem)
    P, dp, dev = grid.pp, grid.dp, launch.device()
    dense = dense_model(cfg)
    model = shard_from_dense(tiny_gpt(cfg, True, mesh.tp_group, dev), dense, mesh.tp_group)
    # Cut where the dense model would be cut: every TP rank of a stage must hold the same layers
    sizes = balanced_split([1 + sum(p.numel() for p in layer.parameters()) for layer in dense], P * chunks)
    stage = pipeline_chunks(model, mesh.pp_group, chunks, sizes)
    params = nn.ModuleList(stage).named_parameters()
    no_sync = None
    if zero:
        optimizer = ZeroOptimizer(params, torch.optim.Adam, stage=zero, group=mesh.dp_group, collectives="ring",
                                  lr=cfg.lr)
    else:
        optimizer = torch.optim.Adam([p for _, p in params], lr=cfg.lr)
        if dp > 1:  # a few buckets per chunk, so that reducing starts while its last backward still runs
            replicas = [DistributedDataParallel(c, DP_BUCKET_MB, mesh.dp_group, ring_all_reduce) for c in stage]
            no_sync = [replica.no_sync for replica in replicas]

    def loss_fn(logits, targets):  # the mean over a microbatch, from each rank's V/tp logits
        return vocab_parallel_cross_entropy(logits, targets, mesh.tp_group).mean()
    b, plan = cfg.batch // dp, SCHEDULES[schedule](P, microbatches, chunks)
    losses, sent, peak = [], [], 0
    for step in range(steps):
        ids, targets = (t[mesh.dp_rank * b:(mesh.dp_rank + 1) * b].to(dev) for t in get_batch(cfg, step))
        COUNTER.reset()
        LEDGER.reset()
        loss, stats = pipeline_step(stage, plan, ids, targets, loss_fn, mesh.pp_group, no_sync)
        optimizer.step()
        optimizer.zero_grad()
        sent.append({"dp": LEDGER.sent, "tp": sum(COUNTER.bytes.values()), "pp": stats.bytes_sent})
        peak = max(peak, stats.peak_live)
        # the replicas' mean loss, to every rank (one TP rank per last stage speaks); not counted above
        last = mesh.pp_rank == P - 1
        mine = torch.tensor([loss.item() / dp if last and mesh.tp_rank == 0 else 0.0], dtype=torch.float64, device=dev)
        dist.all_reduce(mine)
        losses.append(mine.item())
    layout = {"blocks": sum(isinstance(m, ParallelTransformerBlock) for c in stage for m in c),
              "embedding": isinstance(stage[0][0], Embedding), "head": isinstance(stage[-1][-1], Head)}
    stages = [c * P + mesh.pp_rank for c in range(chunks)]
    return Run(losses, sent, stages, layout, sum(p.numel() for c in stage for p in c.parameters()), b, peak)


def formulas(run: Run, cfg: Config, grid, zero: int) -> dict:
    """What this rank should move per step (the docstring's formulas). A plain ring all-reduce's chunks may be
    uneven: its DP formula, 2(N-1) * D, holds for the sum over the DP group, which the caller takes."""
    e, (T, P, N), lay = torch.finfo(cfg.dtype).bits // 8, (grid.tp, grid.pp, grid.dp), run.layout
    bs = run.local_batch * cfg.seq * e
    bsh, S = bs * cfg.hidden, P * len(run.stages)
    tp = (T > 1) * ((4 * lay["blocks"] + lay["embedding"] + lay["head"]) * bsh + 3 * bs * lay["head"])
    pp = (P > 1) * sum(bsh * ((j < S - 1) + (j > 0)) + 8 * HEADER_LEN * (j < S - 1) for j in run.stages)
    if zero:
        dp = bytes_sent_formula(zero, Partition(("stage",), (torch.Size([run.numel]),), N), e)
    else:
        dp = 2 * (N - 1) * run.numel * e
    return {"dp": dp, "tp": tp, "pp": pp}


def parser():
    p = launch.demo_parser(__doc__)
    for axis, what in (("dp", "data-parallel replicas"), ("pp", "pipeline stages"), ("tp", "tensor-parallel ranks")):
        p.add_argument(f"--{axis}", type=int, default=None, help=f"{what} (default: tp 2, pp 2 where the world "
                                                                  "allows, dp the rest)")
    p.add_argument("--microbatches", type=int, default=2, help="M per replica; the global batch grows to a "
                                                               "multiple of dp x M")
    p.add_argument("--schedule", choices=SCHEDULES_3D, default="1f1b")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=0, help="ZeRO stage on the DP axis (0: DDP)")
    p.add_argument("--steps", type=int, default=5)
    for name in ("layers", "hidden", "heads"):
        p.add_argument(f"--{name}", type=int, default=getattr(Config, name), help=f"the model's {name}")
    return p


def demo(args) -> int:
    world, M = launch.env_world_size(), args.microbatches
    grid = grid_for(world, dp=args.dp, pp=args.pp, tp=args.tp, default_pp=2)
    launch.require(grid.cp == 1, f"--dp {grid.dp} x --pp {grid.pp} x --tp {grid.tp} = {grid.size // grid.cp} ranks, "
                                 f"but the world has {world}: choose degrees whose product is {world} (context "
                                 "parallelism: mini_dist/train_5d.py --cp)")
    launch.require(M >= 1 and args.chunks >= 1 and args.steps >= 1 and min(args.layers, args.hidden, args.heads) >= 1,
                   "--microbatches, --chunks, --steps, --layers, --hidden and --heads must be at least 1")
    dp, pp, tp = grid.dp, grid.pp, grid.tp
    cfg = Config(vocab=padded_vocab(tp), layers=args.layers, hidden=args.hidden, heads=args.heads,
                 batch=-(-8 // (dp * M)) * dp * M)  # >= 8, divisible by dp * M
    problem = configuration_error(cfg, (dp, pp, tp), M, args.schedule, args.chunks)
    launch.require(problem is None, problem)
    launch.setup()
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    dp_axis = "" if dp == 1 else f"; DP over {dp} replicas: " + (
        f"ZeRO-{args.zero}" if args.zero else "DDP, gradients reduced once per step during the last backward")
    launch.print0(f"{grid.picture()}\ntiny GPT: {cfg.layers} blocks, h={cfg.hidden}, {cfg.heads} heads, s={cfg.seq}, "
                  f"V={cfg.vocab} ({len(CHARS)} chars padded to a multiple of tp); {args.schedule}"
                  f"{f' x {args.chunks} chunks' if args.chunks > 1 else ''}{dp_axis}; Adam, fp64\n"
                  f"global batch {cfg.batch} sequences = dp {dp} x M {M} x {cfg.batch // (dp * M)} (at least 8, a "
                  f"multiple of dp x M: --microbatches changes it)")
    run = train_3d(cfg, mesh, args.steps, M, args.schedule, args.zero, args.chunks)
    reference = train_dense(cfg, args.steps)
    launch.print0(f"{'step':>4} {'loss dp x pp x tp':>18} {'loss 1 process':>16} {'|diff|':>8}")
    for step, (a, b) in enumerate(zip(run.losses, reference)):
        launch.print0(f"{step:>4} {a:>18.12f} {b:>16.12f} {abs(a - b):>8.1e}")
    # fp64: the runs differ only in the order of their sums (TP partial sums, DP averages, microbatch
    # sums, attention kernels): a few ulps of a loss ~3 (ulp 4.4e-16), measured <= 3.1e-15. 1e-13 leaves
    # room and still catches any wrong gradient, which moves the next loss by ~lr = 1e-2.
    worst = max(abs(a - b) for a, b in zip(run.losses, reference))
    want, got = formulas(run, cfg, grid, args.zero), run.bytes[-1]
    if not args.zero:  # the ring's chunks may be uneven: its formula holds for the DP group's sum
        got = dict(got, dp=total(got["dp"], mesh.dp_group))
    exact = all(got[a] == want[a] for a in want)
    everyone = {a: total(run.bytes[-1][a]) for a in want}  # over all ranks; each rank was checked on its own
    formula = {a: total(want[a]) // (dp if a == "dp" and not args.zero else 1) for a in want}
    text = {"dp": "ring " + ("3(N-1)S*e" if args.zero == 1 else "2(N-1)S*e" if args.zero else "2(N-1)/N*D, once"),
            "tp": "(4L + emb + head)*bsh*e + 3bs*e", "pp": "bsh*e to each neighbour + header"}
    launch.print0("bytes/step, all ranks: " + " | ".join(f"{a.upper()} {everyone[a]:,} = {text[a]} = {formula[a]:,}"
                                                         for a in want if {"dp": dp, "pp": pp, "tp": tp}[a] > 1))
    return launch.conclude("train_3d", worst <= 1e-13, f"{dp}x{pp}x{tp} loss = 1 process ({worst:.0e})", exact,
                           "bytes per axis = formulas")


def total(value: int, group=None) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=launch.device())
    dist.all_reduce(t, group=group)
    return int(t.item())


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
