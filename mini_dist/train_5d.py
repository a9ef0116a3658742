"""5D parallelism: a tiny GPT trained with data, pipeline, context, tensor and expert parallelism at once.

The world is a dp x pp x cp x tp grid of ranks (mini_dist/mesh.py), and expert parallelism borrows ep ranks
of its dp x cp product. Each rank holds 1/pp of the layers (one pipeline stage, or v chunks of an interleaved
pipeline), 1/tp of their weight matrices and E/ep of their experts; it sees 1/dp of the global batch and 1/cp
of each sequence (mini_dist/parallel_gpt.py). A training step runs M microbatches through the stage on a
pipeline schedule (mini_dist/pipeline_executor.py). Then data parallelism updates the weights over the dp x cp ranks,
which hold the same weights and saw other tokens, in one of three ways:

    --zero 0   DDP (mini_dist/ddp.py) inside the pipeline: every backward of a chunk but its last runs under
               no_sync, so the M microbatches' gradients are reduced once, during that last backward
    --zero 1|2 ZeroOptimizer (mini_dist/zero_optimizer.py): the optimizer state (and at stage 2 the gradients)
               sharded dp x cp ways, the updated weights gathered after the step
    --zero 3   FSDP (mini_dist/fsdp.py) with one unit per layer: each unit gathered for its forward and again
               for its backward

An expert is held by the dp*cp/ep ranks with the same ep_index, so its weights are updated by a ZeroOptimizer
over that group. Its gradient already sums the tokens of its EP group, which ZeRO would then average again, so
it is first divided by ep. However the axes are combined, the losses equal those of one process training the
dense model on the whole global batch (the demo prints both), and each rank's bytes per axis and memory by
category equal its ledger (mini_dist/rank_ledger.py) exactly, as mini_dist/measure_5d.py measures them.

Two combinations are refused. zero_bubble cannot run with tp, cp or ep > 1, since its weight-gradient step W
reruns part of a block's backward, collectives included, nor with --zero 3, since W needs leaf weights and
FSDP's are views of the gathered buffer. And --zero 3 cannot run with ep > 1: FSDP shards every unit over
dp x cp, where an expert is replicated only over dp*cp/ep ranks.

    torchrun --standalone --nproc_per_node=8 mini_dist/train_5d.py --dp 2 --pp 2 --tp 2
    torchrun --standalone --nproc_per_node=8 mini_dist/train_5d.py --dp 2 --pp 2 --cp 2 --moe 4 --ep 2

Mirrors torchtitan's composition (FSDP/DDP, TP, PP, CP, EP on a DeviceMesh) and Megatron-LM's 3D parallelism.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.ddp import DistributedDataParallel
from mini_dist.fsdp import FullyShardedDataParallel
from mini_dist.kit import debug, flags, launch
from mini_dist.mesh import Mesh, grid_for
from mini_dist.parallel_gpt import configuration_error as model_error, local_batch, parallel_model
from mini_dist.pipeline_executor import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import balanced_split, pipeline_chunks
from mini_dist.ring_pipelined import ring_all_reduce
from mini_dist.tiny_gpt import Config, dense_model, get_batch, padded_vocab
from mini_dist.vocab_parallel import vocab_parallel_cross_entropy
from mini_dist.zero_optimizer import ZeroOptimizer

DP_BUCKET_MB = 1 / 32  # 32 KiB: a few buckets per stage of the tiny GPT


class Trainer:
    """One rank's part of the 5D run: its pipeline chunks of the model, the data parallelism over their replicas,
    its optimizers, and one training step."""

    def __init__(self, cfg: Config, mesh: Mesh, microbatches: int, schedule: str, zero: int, chunks: int):
        problem = configuration_error(cfg, mesh.grid, microbatches, schedule, chunks, zero)
        if problem:
            raise ValueError(problem)
        debug.agree("train_5d", (cfg, microbatches, schedule, zero, chunks))  # MINI_DIST_DEBUG=1: odd rank named
        self.cfg = cfg
        self.mesh = mesh
        # cut where the dense model would be cut, so that every TP, CP and EP rank of a stage holds the same layers
        costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in dense_model(cfg)]
        cuts = balanced_split(costs, mesh.grid.pp * chunks)
        self.chunks = pipeline_chunks(parallel_model(cfg, mesh), mesh.pp_group, chunks, cuts)
        self.plan = SCHEDULES[schedule](mesh.grid.pp, microbatches, chunks)
        self.data_parallel(zero)

    def data_parallel(self, zero: int) -> None:
        """Data parallelism over the dp x cp ranks that hold the same weights (DDP, ZeroOptimizer or FSDP), and
        a ZeroOptimizer over the edp ranks that hold the same experts."""
        mesh = self.mesh
        lr = self.cfg.lr
        replicated = [[(n, p) for n, p in c.named_parameters() if not self.is_expert(p)] for c in self.chunks]
        experts = [(n, p) for c in self.chunks for n, p in c.named_parameters() if self.is_expert(p)]
        self.experts = [p for _, p in experts]
        self.stage = self.chunks  # what the pipeline runs: the chunks, or their FSDP units
        self.no_sync = None       # DDP's, one per chunk: the pipeline syncs a chunk's gradients in its last backward
        self.fsdp = []
        if zero == 3:
            self.fsdp = [FullyShardedDataParallel(c, group=mesh.dp_cp_group) for c in self.chunks]
            self.stage = self.fsdp
            self.optimizers = [torch.optim.Adam([p for f in self.fsdp for p in f.parameters()], lr=lr)]
        elif zero:
            named = [pair for r in replicated for pair in r]  # (name, parameter): ZeRO's layout names each
            self.optimizers = [ZeroOptimizer(named, torch.optim.Adam, stage=zero, group=mesh.dp_cp_group,
                                             collectives="ring", lr=lr)]
        else:  # DDP over each chunk's replicated weights; gradients land in its buckets (no second copy)
            ddp = [DistributedDataParallel(nn.ParameterDict({n.replace(".", "/"): p for n, p in r}), DP_BUCKET_MB,
                                           mesh.dp_cp_group, ring_all_reduce, gradient_as_bucket_view=True,
                                           find_unused_parameters=self.cfg.experts > 0) for r in replicated]
            self.no_sync = [replica.no_sync for replica in ddp]
            self.optimizers = [torch.optim.Adam([p for r in replicated for _, p in r], lr=lr)]
        if experts:  # ZeRO at the same stage (0: plain data parallelism) over the ranks with the same experts
            self.optimizers.append(ZeroOptimizer(experts, torch.optim.Adam, stage=min(zero, 2), group=mesh.edp_group,
                                                 collectives="ring", lr=lr))

    def is_expert(self, p) -> bool:
        """An expert's weight, cut over ep > 1 ranks (with ep = 1 experts are replicated like the rest)."""
        return self.mesh.grid.ep > 1 and hasattr(p, "ep_dim")

    def step(self, step: int):
        """One training step on the global batch of `step`: forward and backward, the experts' gradients scaled,
        every optimizer stepped. Returns (the batch loss on the last stage, else None; the step's StepStats)."""
        ids, targets = local_batch(self.cfg, self.mesh, step)
        loss, stats = self.forward_backward(ids, targets)
        for p in self.experts:  # a sum over the EP group's tokens: ZeRO's average over edp, then / ep
            if p.grad is not None:
                p.grad = p.grad / self.mesh.grid.ep
        for optimizer in self.optimizers:
            optimizer.step()
        return loss, stats

    def forward_backward(self, ids, targets):
        """M microbatches through the pipeline schedule, DDP reducing in each chunk's last backward."""
        return pipeline_step(self.stage, self.plan, ids, targets, self.loss, self.mesh.pp_group, self.no_sync)

    def loss(self, logits, targets):
        """The mean cross-entropy over this rank's tokens, from its V/tp logits."""
        return vocab_parallel_cross_entropy(logits, targets, self.mesh.tp_group).mean()


def train(trainer: Trainer, steps: int) -> list[float]:
    """`steps` training steps: the mean loss of each over the whole global batch, the same on every rank."""
    grid = trainer.mesh.grid
    losses = []
    for step in range(steps):
        loss, _ = trainer.step(step)
        for optimizer in trainer.optimizers:
            optimizer.zero_grad()
        # one TP rank of each last stage speaks for its dp x cp replica; an all-reduce gives every rank the mean
        speaks = trainer.mesh.pp_rank == grid.pp - 1 and trainer.mesh.tp_rank == 0
        mine = torch.tensor([loss.item() / (grid.dp * grid.cp) if speaks else 0.0], dtype=torch.float64,
                            device=launch.device())
        dist.all_reduce(mine)
        losses.append(mine.item())
    return losses


def train_5d(cfg: Config, mesh: Mesh, steps: int, microbatches: int = 1, schedule: str = "1f1b", zero: int = 0,
             chunks: int = 1) -> list[float]:
    """The tiny GPT trained `steps` steps on this rank's part of the mesh: the loss of each step."""
    return train(Trainer(cfg, mesh, microbatches, schedule, zero, chunks), steps)


def train_dense(cfg: Config, steps: int) -> list[float]:
    """What the 5D run must equal: one process, the dense model, the whole global batch, torch.optim.Adam."""
    model = dense_model(cfg, launch.device())
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


def configuration_error(cfg: Config, grid, microbatches: int, schedule: str, chunks: int, zero: int) -> str | None:
    """Why this run cannot be, in one sentence that says what to change, or None: known before any collective."""
    inside = model_error(cfg, grid)
    if inside:
        return inside
    if cfg.layers + 2 < grid.pp * chunks:
        return (f"--layers {cfg.layers} + embedding + head = {cfg.layers + 2} layers cannot fill {grid.pp} stages x "
                f"{chunks} chunk(s), a layer each: use --layers {grid.pp * chunks - 2} or more, or fewer chunks")
    if cfg.batch % (grid.dp * microbatches) or cfg.vocab % grid.tp:
        return (f"the global batch {cfg.batch} must split into dp={grid.dp} replicas x {microbatches} microbatches "
                f"and the vocabulary {cfg.vocab} into tp={grid.tp} shards: use a multiple of each (padded_vocab(tp))")
    if schedule not in SCHEDULES:
        return f"--schedule {schedule}: use one of {tuple(SCHEDULES)}"
    if schedule == "zero_bubble" and max(grid.tp, grid.cp, grid.ep) > 1:
        return "zero_bubble's W reruns part of a block's backward, collectives included: use --tp 1 --cp 1 --ep 1"
    if zero == 3 and (schedule == "zero_bubble" or grid.ep > 1):
        return ("--zero 3 (FSDP) computes with views of gathered weights, which zero_bubble's W cannot differentiate, "
                "and shards over dp x cp, where experts are replicated over dp*cp/ep: use --zero 0, 1 or 2")
    try:
        SCHEDULES[schedule](grid.pp, microbatches, chunks)
    except ValueError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------- demo

def parser():
    p = flags.grid_5d(launch.demo_parser(__doc__), SCHEDULES)
    p.add_argument("--steps", type=int, default=4)
    for name in ("layers", "hidden", "heads", "seq"):
        p.add_argument(f"--{name}", type=int, default=getattr(Config, name), help=f"the model's {name}")
    return p


def run_config(args) -> tuple:
    """The grid and the model a demo's flags ask for, refused in one line (launch.UsageError) if they cannot be:
    the global batch is the least multiple of dp x M that holds 8 sequences."""
    M = args.microbatches
    grid = grid_for(launch.env_world_size(), args.dp, args.pp, args.cp, args.tp, args.ep, default_pp=2)
    launch.require(M >= 1 and args.chunks >= 1 and args.steps >= 1, "--microbatches, --chunks, --steps must be >= 1")
    cfg = Config(vocab=padded_vocab(grid.tp), layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                 batch=-(-8 // (grid.dp * M)) * grid.dp * M, experts=args.moe, checkpoint=args.checkpoint)
    problem = configuration_error(cfg, grid, M, args.schedule, args.chunks, args.zero)
    launch.require(problem is None, problem)
    return grid, cfg


def demo(args) -> int:
    grid, cfg = run_config(args)
    launch.setup()
    mesh = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    launch.print0(f"{grid.picture()}\ntiny GPT: {cfg.layers} blocks, h={cfg.hidden}, {cfg.heads} heads, s={cfg.seq}, "
                  f"V={cfg.vocab}, {f'MoE {cfg.experts} experts top-{cfg.top_k}' if cfg.experts else 'MLP'}"
                  f"{', checkpointed' if cfg.checkpoint else ''}; {args.schedule} x {args.chunks} chunk(s), "
                  f"M={args.microbatches}; {('DDP inside the pipeline', 'ZeRO-1', 'ZeRO-2', 'FSDP')[args.zero]} over "
                  f"dp x cp = {grid.dp * grid.cp}; Adam, fp64; global batch {cfg.batch} seqs")
    losses = train_5d(cfg, mesh, args.steps, args.microbatches, args.schedule, args.zero, args.chunks)
    reference = train_dense(cfg, args.steps)
    worst = max(abs(a - b) for a, b in zip(losses, reference))
    launch.print0(f"  step {'loss, 5D':>16} {'loss, 1 process':>16} {'|diff|':>8}   (mean cross-entropy, nats per "
                  "token)\n" + "\n".join(f"  {s:>4} {a:>16.12f} {b:>16.12f} {abs(a - b):>8.1e}"
                                          for s, (a, b) in enumerate(zip(losses, reference))))
    groups = {axis: mesh.ranks[axis] for axis in ("tp", "cp", "pp", "dp")}
    launch.print0("rank 0's groups, the chattiest axis on the nearest ranks: " + ", ".join(
        f"{axis} {ranks}" for axis, ranks in groups.items()))
    nearest = groups["tp"] == list(range(groups["tp"][0], groups["tp"][0] + grid.tp))
    dims = "x".join(str(getattr(grid, a)) for a in ("dp", "pp", "cp", "tp"))
    return launch.conclude("train_5d", worst <= 1e-13, f"{dims} ep {grid.ep} loss = 1 process ({worst:.0e})", nearest,
                           f"tp groups of {grid.tp} adjacent ranks: TP innermost")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
