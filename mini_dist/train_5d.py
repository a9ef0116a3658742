"""5D parallelism: a tiny GPT trained with data, pipeline, context, tensor and expert parallelism at once.

The world is a dp x pp x cp x tp grid of ranks (mini_dist/mesh.py), expert parallelism on ep ranks of its
dp x cp product. Each rank holds 1/pp of the layers (a pipeline stage, or v chunks of an interleaved one),
1/tp of their weights, E/ep of the experts, and sees 1/dp of the global batch and 1/cp of each sequence
(mini_dist/parallel_gpt.py). The stage runs M microbatches on a pipeline schedule (mini_dist/pipeline.py);
then data parallelism over the dp x cp ranks, which hold the same weights and saw other tokens, updates them:

    --zero 0   DDP (mini_dist/ddp.py), inside the pipeline: every backward of a chunk but its last runs under
               no_sync, so the M microbatches' gradients are reduced once, during that last backward
    --zero 1|2 ZeroOptimizer (mini_dist/zero_optimizer.py): optimizer state (and gradients) sharded dp x cp ways
    --zero 3   FSDP (mini_dist/fsdp.py), a unit per layer: gathered for each forward and each backward

Experts (ep > 1) live on the dp*cp/ep ranks that hold the same ones: ZeroOptimizer over that group, their
gradients first divided by ep, since each already sums its EP group's tokens. The demo prints the loss beside
one process's, and each rank's bytes per axis and memory by category beside its ledger (gpt_ledger.py).
Refused: zero_bubble with tp, cp or ep > 1 (W reruns part of a block's backward, collectives included) or
--zero 3 (W needs leaf weights, FSDP's are views); --zero 3 with ep > 1 (FSDP shards units over dp x cp).

    torchrun --standalone --nproc_per_node=8 mini_dist/train_5d.py --dp 2 --pp 2 --tp 2
    torchrun --standalone --nproc_per_node=8 mini_dist/train_5d.py --dp 2 --pp 2 --cp 2 --moe 4 --ep 2

Mirrors torchtitan's composition (FSDP/DDP, TP, PP, CP, EP on a DeviceMesh) and Megatron-LM's 3D parallelism.
"""
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import cost_model, gpt_ledger, rank_ledger
from mini_dist.gpt_ledger import routed_rows
from mini_dist.comm import COUNTER
from mini_dist.ddp import DistributedDataParallel
from mini_dist.expert_parallel import ExpertParallelMoE
from mini_dist.fsdp import FullyShardedDataParallel
from mini_dist.kit import debug, launch
from mini_dist.kit.measure import PeakSaved, side_by_side
from mini_dist.mesh import Mesh, RankGrid, grid_for
from mini_dist.parallel_gpt import configuration_error as model_error
from mini_dist.parallel_gpt import local_batch, parallel_model
from mini_dist.tiny_gpt import Config, dense_model, get_batch, kind, padded_vocab
from mini_dist.pipeline import pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import balanced_split, pipeline_chunks
from mini_dist.ring_pipelined import ring_all_reduce
from mini_dist.vocab_parallel import vocab_parallel_cross_entropy
from mini_dist.zero_optimizer import ZeroOptimizer
from mini_dist.zero_ledger import memory_ledger

DP_BUCKET_MB = 1 / 32  # 32 KiB: a few buckets per stage of the tiny GPT
AXES = ("dp", "pp", "cp", "tp", "ep")
MEMORY = ("params", "grads", "state", "activations")


class Trainer:
    """One rank's chunks of the model, their data parallelism and optimizers, and one training step."""

    def __init__(self, cfg: Config, mesh: Mesh, microbatches: int, schedule: str, zero: int, chunks: int):
        grid = mesh.grid
        if problem := configuration_error(cfg, grid, microbatches, schedule, chunks, zero):
            raise ValueError(problem)
        debug.agree("train_5d", (cfg, microbatches, schedule, zero, chunks))  # MINI_DIST_DEBUG=1: odd rank named
        self.cfg, self.mesh, self.zero, P = cfg, mesh, zero, grid.pp
        # Cut where the dense model would be cut: every TP, CP and EP rank of a stage holds the same layers
        costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in dense_model(cfg)]
        self.chunks = pipeline_chunks(parallel_model(cfg, mesh), mesh.pp_group, chunks,
                                      balanced_split(costs, P * chunks))
        self.plan = SCHEDULES[schedule](P, microbatches, chunks)
        sharded = lambda p: grid.ep > 1 and hasattr(p, "ep_dim")  # noqa: E731  an expert (ep = 1: as the rest)
        experts = [(n, p) for c in self.chunks for n, p in c.named_parameters() if sharded(p)]
        dense = [[(n, p) for n, p in c.named_parameters() if not sharded(p)] for c in self.chunks]
        self.numels = [[sum(p.numel() for p in layer.parameters() if sharded(p) == x) for x in (False, True)]
                       for c in self.chunks for layer in c]  # per layer: (replicated, expert) elements
        self.stage, self.no_sync, self.optimizers, self.fsdp = self.chunks, None, [], []
        if zero == 3:
            self.stage = self.fsdp = [FullyShardedDataParallel(c, group=mesh.dp_cp_group) for c in self.chunks]
            self.optimizers.append(torch.optim.Adam([p for f in self.fsdp for p in f.parameters()], lr=cfg.lr))
        elif zero:
            self.optimizers.append(ZeroOptimizer([p for d in dense for p in d], torch.optim.Adam, stage=zero,
                                                 group=mesh.dp_cp_group, collectives="ring", lr=cfg.lr))
        else:  # DDP over each chunk's replicated weights; gradients land in its buckets (no second copy)
            replicas = [DistributedDataParallel(nn.ParameterDict({n.replace(".", "/"): p for n, p in d}), DP_BUCKET_MB,
                                                mesh.dp_cp_group, ring_all_reduce, gradient_as_bucket_view=True,
                                                find_unused_parameters=cfg.experts > 0) for d in dense]
            self.no_sync = [r.no_sync for r in replicas]
            self.optimizers.append(torch.optim.Adam([p for d in dense for _, p in d], lr=cfg.lr))
        self.experts = [p for _, p in experts]
        if experts:  # ZeRO at the same stage (0: plain data parallelism) over the ranks with the same experts
            self.optimizers.append(ZeroOptimizer(experts, torch.optim.Adam, stage=min(zero, 2), group=mesh.edp_group,
                                                 collectives="ring", lr=cfg.lr))
        # per chunk, each MoE block forward's routed_rows: a block's hook runs once a forward, never in recomputation
        self.routed, me = [[] for _ in self.chunks], mesh.coords["ep_index"]
        for c, chunk in enumerate(self.chunks):
            for block in (b for b in chunk if isinstance(getattr(b, "mlp", None), ExpertParallelMoE)):
                block.register_forward_hook(lambda b, *_, c=c: self.routed[c].append(routed_rows(b.mlp, me)))

    def parameter_storages(self) -> set:
        """Where the weights live now: the parameters, and FSDP's gathered buffers (reallocated each gather)."""
        fulls = {u.full.untyped_storage().data_ptr() for f in self.fsdp for u in f.units}
        return fulls | {p.untyped_storage().data_ptr() for c in self.stage for p in c.parameters()}

    def loss(self, logits, targets):
        """The mean cross-entropy over this rank's tokens, from its V/tp logits."""
        return vocab_parallel_cross_entropy(logits, targets, self.mesh.tp_group).mean()

    def step(self, step: int):
        """M microbatches through the pipeline (DDP reducing in each chunk's last backward), the experts'
        gradients scaled, every optimizer stepped. Returns (loss, StepStats, peak of saved activation bytes)."""
        ids, targets = local_batch(self.cfg, self.mesh, step)
        peak = PeakSaved(self.parameter_storages)
        with peak.hooks():
            loss, stats = pipeline_step(self.stage, self.plan, ids, targets, self.loss, self.mesh.pp_group,
                                        self.no_sync)
        for p in self.experts:  # a sum over the EP group's tokens: ZeRO's average over edp then / ep
            p.grad = p.grad / self.mesh.grid.ep if p.grad is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss, stats, peak.peak

    def memory(self) -> dict:
        """Bytes of this rank's parameters, gradients and optimizer state (not Adam's step counts)."""
        params = [p for c in self.stage for p in c.parameters() if not (self.experts and hasattr(p, "ep_dim"))]
        ledgers = [memory_ledger(group, opt) for opt, group in zip(self.optimizers, (params, self.experts))]
        return {key: sum(ledger[key] for ledger in ledgers) for key in ("params", "grads", "state")}


@dataclass
class Run:
    """What one rank measured (the global loss per step is the same on every rank), and what its ledger needs."""
    losses: list
    bytes: list          # per step: {"dp": .., "pp": .., "cp": .., "tp": .., "ep": ..}
    routed: list         # its last step's Trainer.routed: per chunk, per MoE block forward, (off-rank, received)
    memory: dict         # params, grads, state (after the last step), activations (peak of the last step)
    layout: list         # its chunks' layers, e.g. [["embedding", "block"], ["block", "head"]]
    local_batch: int
    numels: list         # per layer of its chunks: elements (replicated over dp x cp, experts over edp)


def train_5d(cfg: Config, mesh: Mesh, steps: int, microbatches: int = 1, schedule: str = "1f1b", zero: int = 0,
             chunks: int = 1) -> Run:
    trainer = Trainer(cfg, mesh, microbatches, schedule, zero, chunks)
    grid, last = mesh.grid, mesh.pp_rank == mesh.grid.pp - 1
    losses, sent = [], []
    for step in range(steps):
        for ledger in [COUNTER] + [f.ledger for f in trainer.fsdp]:  # COUNTER: the kit's wire LEDGER
            ledger.reset()
        for routed in trainer.routed:
            routed.clear()
        loss, stats, peak = trainer.step(step)
        dp = sum(f.ledger.sent for f in trainer.fsdp) if trainer.fsdp else COUNTER.bytes["ring"]
        sent.append({"dp": dp, "pp": stats.bytes_sent, "cp": COUNTER.bytes["ring attention"],
                     "tp": COUNTER.bytes["all_reduce"], "ep": COUNTER.bytes["all_to_all"]})
        memory = {**trainer.memory(), "activations": peak}
        for optimizer in trainer.optimizers:
            optimizer.zero_grad()
        # the mean loss over the dp x cp ranks, to every rank (one TP rank per last stage speaks); not counted
        mine = loss.item() / (grid.dp * grid.cp) if last and mesh.tp_rank == 0 else 0.0
        dist.all_reduce(mine := torch.tensor([mine], dtype=torch.float64, device=launch.device()))
        losses.append(mine.item())
    layout = [[kind(layer) for layer in c] for c in trainer.chunks]
    return Run(losses, sent, trainer.routed, memory, layout, cfg.batch // grid.dp, trainer.numels)


def train_dense(cfg: Config, steps: int) -> list[float]:
    """The reference: one process, the dense model, the whole global batch, torch.optim.Adam."""
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
    if inside := model_error(cfg, grid):
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


def predictions(run: Run, cfg: Config, mesh: Mesh, microbatches: int, schedule: str, zero: int) -> tuple[dict, dict]:
    """This rank's ledger (gpt_ledger.py) from its layers, coordinates and the rows its MoE layers routed."""
    g, model = mesh.grid, gpt_ledger.model_of(cfg)
    plan = cost_model.Plan(dp=g.dp, pp=g.pp, cp=g.cp, tp=g.tp, ep=g.ep, zero=zero, checkpoint=cfg.checkpoint,
                           micro_batch=run.local_batch // microbatches, microbatches=microbatches, precision="fp64")
    place = mesh.coords["ep_index"] + g.ep * mesh.coords["ep_replica"]  # the rank's place in dp x cp
    return rank_ledger.rank_ledger(model, plan, schedule, run.layout, mesh.pp_rank, place, run.routed,
                                  gpt_ledger.attention_keeps_scores(model, plan, launch.device()))


def five_axes(mesh: Mesh | None = None, cfg: Config | None = None, run: Run | None = None,
              reference: list | None = None) -> tuple[str, bool]:
    """Question 27: the axes multiply, the chattiest innermost, and train like one process: `run` (else a step
    on `mesh`, else dp x tp 2) beside `reference`; a 2x2x2x2 grid's groups; a 7B model's TP and DP bytes."""
    mesh = mesh or Mesh(dp=dist.get_world_size() // 2, tp=2)
    g = mesh.grid
    cfg = cfg or Config(vocab=padded_vocab(g.tp), layers=2, hidden=16, heads=2, seq=8, batch=2 * g.dp)
    run = run or train_5d(cfg, mesh, steps=1)
    diff = max(abs(a - b) for a, b in zip(run.losses, reference or train_dense(cfg, len(run.losses))))
    sent, calls, grid = run.bytes[-1], COUNTER.calls["all_reduce"], RankGrid(dp=2, pp=2, cp=2, tp=2)
    groups = ", ".join(f"{a} {grid.groups(a)[0]}" for a in ("tp", "cp", "pp", "dp"))
    big, plan = cost_model.Model(7 * 10 ** 9, 32, 4096, 32, 4096), cost_model.Plan(8, tp=8, microbatches=8)
    tp, dp = cost_model.tp_traffic(big, plan), sum(cost_model.dp_traffic(big.params // 8, plan).values())
    return (f"a tiny GPT on dp {g.dp} x pp {g.pp} x cp {g.cp} x tp {g.tp}: the loss = one process's to {diff:.0e}; "
            f"this rank sent per step TP {sent['tp']:,} B in {calls} blocking all-reduces (forward and backward), DP "
            f"{sent['dp']:,} B once per step, during backward; a 7B model as TP 8 x DP 8, 8 microbatches of 4096 "
            f"tokens: TP {tp / 1e9:.0f} GB, DP {dp / 1e9:.1f} GB per GPU per step (cost model); in a dp 2 x pp 2 x "
            f"cp 2 x tp 2 grid rank 0's groups are {groups}: the chattiest axis on the nearest ranks"), \
        diff <= 1e-13 and (g.tp == 1 or calls > 1) and grid.groups("tp")[0] == [0, 1] and tp > 10 * dp


# ----- demo: the loss beside one process, bytes per axis and memory per rank beside the ledger -----

def parser():
    p = launch.demo_parser(__doc__)
    for axis in ("dp", "pp", "cp", "tp"):
        p.add_argument(f"--{axis}", type=int, help=f"{axis} degree (default: tp 2, cp 1, pp 2 if the world allows, "
                                                   "dp the rest)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, a divisor of dp x cp (needs --moe)")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 routing (0: an MLP)")
    p.add_argument("--microbatches", type=int, default=2, help="M per replica (the global batch: a multiple of dp x M)")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="0 DDP, 1-2 ZeRO, 3 FSDP on dp x cp")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in backward")
    p.add_argument("--steps", type=int, default=4)
    for name in ("layers", "hidden", "heads", "seq"):
        p.add_argument(f"--{name}", type=int, default=getattr(Config, name), help=f"the model's {name}")
    return p


def demo(args) -> int:
    world, M = launch.env_world_size(), args.microbatches
    grid = grid_for(world, args.dp, args.pp, args.cp, args.tp, args.ep, default_pp=2)
    launch.require(M >= 1 and args.chunks >= 1 and args.steps >= 1, "--microbatches, --chunks, --steps must be >= 1")
    cfg = Config(vocab=padded_vocab(grid.tp), layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                 batch=-(-8 // (grid.dp * M)) * grid.dp * M, experts=args.moe, checkpoint=args.checkpoint)
    problem = configuration_error(cfg, grid, M, args.schedule, args.chunks, args.zero)
    launch.require(problem is None, problem)
    launch.setup()
    mesh = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    dp_axis = ("DDP inside the pipeline", "ZeRO-1", "ZeRO-2", "FSDP")[args.zero]
    launch.print0(f"{grid.picture()}\ntiny GPT: {cfg.layers} blocks, h={cfg.hidden}, {cfg.heads} heads, s={cfg.seq}, "
                  f"V={cfg.vocab}, {f'MoE {cfg.experts} experts top-{cfg.top_k}' if cfg.experts else 'MLP'}"
                  f"{', checkpointed' * cfg.checkpoint}; {args.schedule}{f' x {args.chunks}' * (args.chunks > 1)}, "
                  f"M={M}; {dp_axis} over dp x cp = {grid.dp * grid.cp}; Adam, fp64; global batch {cfg.batch} seqs")
    run = train_5d(cfg, mesh, args.steps, M, args.schedule, args.zero, args.chunks)
    reference = train_dense(cfg, args.steps)
    figure, holds = five_axes(mesh, cfg, run, reference)  # the loss beside one process's, within 1e-13
    launch.print0(f"  step {'loss, 5D':>16} {'loss, 1 process':>16} {'|diff|':>8}   (mean cross-entropy, nats per "
                  "token)\n" + "\n".join(f"  {s:>4} {a:>16.12f} {b:>16.12f} {abs(a - b):>8.1e}"
                                          for s, (a, b) in enumerate(zip(run.losses, reference))) + f"\n{figure}")
    traffic, memory = predictions(run, cfg, mesh, M, args.schedule, args.zero)
    got = dict(run.bytes[-1])
    if args.zero == 0:  # DDP's ring chunks may be uneven: its formula is the dp x cp group's average
        dist.all_reduce(t := torch.tensor([got["dp"]], device=launch.device()), group=mesh.dp_cp_group)
        got["dp"] = Fraction(int(t.item()), grid.dp * grid.cp)
    cuda, rows = launch.device().type == "cuda", [None] * world
    dist.all_gather_object(rows, (got, traffic, run.memory, memory, cuda and torch.cuda.max_memory_allocated()))
    exact = all(r[0] == r[1] and r[2] == r[3] for r in rows)
    launch.print0("bytes each rank sent in the last step, by axis: measured = ledger (mini_dist/gpt_ledger.py; DP: "
                  "the DDP group's average)\n" + side_by_side([r[:2] for r in rows], AXES) + "\nbytes each rank "
                  "holds: measured = ledger; activations: the most bytes autograd saved for backward at once in the "
                  "last step (measure.PeakSaved)\n" + side_by_side([r[2:4] for r in rows], MEMORY)
                  + ("\nCUDA allocator's peak per rank, bytes, for information (weights, states, activations, "
                     "workspaces, rounding: no formula predicts it): " + ", ".join(f"{r[4]:,}" for r in rows)) * cuda)
    dims = "x".join(str(getattr(grid, a)) for a in ("dp", "pp", "cp", "tp"))
    return launch.conclude("train_5d", holds, f"{dims} ep {grid.ep} loss = 1 process (question 27)", exact,
                           "bytes per axis and memory = ledger")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
