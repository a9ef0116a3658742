"""5D parallelism: a tiny GPT trained with data, pipeline, context, tensor and expert parallelism at once.

The world is a dp x pp x cp x tp grid of ranks (mini_dist/mesh.py), expert parallelism on ep ranks of its
dp x cp product. Each rank holds 1/pp of the layers (a pipeline stage, or v chunks of an interleaved one),
1/tp of their weights, E/ep of the experts, and sees 1/dp of the global batch and 1/cp of each sequence
(mini_dist/parallel_gpt.py: the model, and what TP, CP and EP move). The stage runs M microbatches on a
pipeline schedule (mini_dist/pipeline.py); the weights are then updated by data parallelism over the dp x cp
ranks, which hold the same weights and saw other tokens:

    --zero 0   DDP (mini_dist/ddp.py), inside the pipeline: every backward of a chunk but its last runs under
               no_sync, so the M microbatches' gradients are reduced once, during that last backward
    --zero 1|2 ZeroOptimizer (mini_dist/zero.py): optimizer state (and gradients) sharded dp x cp ways
    --zero 3   FSDP (mini_dist/fsdp.py), a unit per layer: gathered for each forward and each backward

Experts (ep > 1) are replicated only on the dp*cp/ep ranks that hold the same ones: ZeroOptimizer over that
group (stage 0 or --zero), their gradients first divided by ep, since each already sums the tokens of its
EP group. Bytes one rank moves per step (b sequences of s/C tokens per microbatch... as parallel_gpt.py, and):

    PP  b*(s/C)*h*e to the next stage and the same gradient back, per microbatch and chunk, + a shape header
    DP  DDP: ring all-reduce, 2(N-1)/N * D (N = dp*cp, D the stage's gradient bytes); ZeRO-1 3(N-1)*S*e,
        ZeRO-2 2(N-1)*S*e (S = ceil(numel/N)); FSDP 3M(N-1)*S_u*e per layer; experts as ZeRO over dp*cp/ep

Memory per rank by category (parameters, gradients, optimizer state, activations: the most bytes autograd
holds for backward at once, which the schedule decides, measure.PeakSaved) is measured and printed beside
the planner's prediction (mini_dist/cost_model.py), as are the bytes.

What cannot run together, and why (each refused in one line before any process group):
  zero_bubble with tp, cp or ep > 1   its W reruns part of a block's backward, collectives included
  zero_bubble with --zero 3           W needs the weights as autograd leaves: FSDP's are views of a gathered
                                      buffer, and the chunk's own parameters() are empty
  --zero 3 with ep > 1                FSDP shards every unit over one group (dp x cp); experts are replicated
                                      over dp*cp/ep ranks only (torchtitan gives them a second FSDP mesh)

    torchrun --standalone --nproc_per_node=8 mini_dist/train_5d.py --dp 2 --pp 2 --tp 2
    torchrun --standalone --nproc_per_node=8 mini_dist/train_5d.py --dp 2 --pp 2 --cp 2 --moe 4 --ep 2

Mirrors torchtitan's composition (FSDP/DDP + TP + PP + context_parallel + expert parallel on a DeviceMesh)
and Megatron-LM's 3D parallelism with context and expert parallelism.
"""
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import cost_model
from mini_dist.kit import debug, launch
from mini_dist.comm import COUNTER
from mini_dist.ddp import DistributedDataParallel
from mini_dist.expert_parallel import ExpertParallelMoE
from mini_dist.fsdp import FullyShardedDataParallel
from mini_dist.kit.measure import PeakSaved, side_by_side
from mini_dist.mesh import Mesh, grid_for
from mini_dist.parallel_gpt import (Config, dense_model, is_expert, kind, local_batch, loss_fn,
                                    padded_vocab, parallel_model, routed_rows, train_dense)
from mini_dist.parallel_gpt import configuration_error as model_error
from mini_dist.pipeline import HEADER_LEN, pipeline_step
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import balanced_split, pipeline_chunks
from mini_dist.ring_allreduce import LEDGER, ring_all_reduce
from mini_dist.zero import ZeroOptimizer
from mini_dist.zero_ledger import memory_ledger

DP_BUCKET_MB = 1 / 32  # 32 KiB: a few buckets per stage of the tiny GPT
AXES = ("dp", "pp", "cp", "tp", "ep")
MEMORY = ("params", "grads", "state", "activations")


def configuration_error(cfg: Config, grid, microbatches: int, schedule: str, chunks: int, zero: int) -> str | None:
    """Why this run cannot be, in one sentence that says what to change, or None. Everything here is known on
    every rank before any collective (the demo asks before setup)."""
    inside = model_error(cfg, grid)
    if inside:
        return inside
    if cfg.layers + 2 < grid.pp * chunks:
        return (f"--layers {cfg.layers} + embedding + head = {cfg.layers + 2} layers cannot fill {grid.pp} stages x "
                f"{chunks} chunk(s), one layer each at least: use --layers {grid.pp * chunks - 2} or more, or fewer "
                f"stages or chunks")
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


@dataclass
class Run:
    """What one rank measured: the global loss per step (the same on every rank), its bytes per axis per step,
    the rows its MoE layers routed, its memory by category, and what the predictions need."""
    losses: list
    bytes: list          # per step: {"dp": .., "pp": .., "cp": .., "tp": .., "ep": ..}
    routed: list         # its last step's Trainer.routed: per chunk, per MoE block forward, (off-rank, received)
    memory: dict         # params, grads, state (after the last step), activations (peak of the last step)
    layout: list         # its chunks' layers, e.g. [["embedding", "block"], ["block", "head"]]
    stages: list         # the virtual stage of each chunk
    local_batch: int
    numels: list         # per layer of its chunks: elements (replicated over dp x cp, experts over edp)


class Trainer:
    """One rank's chunks of the model, their data parallelism and optimizers, and one training step."""

    def __init__(self, cfg: Config, mesh: Mesh, microbatches: int, schedule: str, zero: int, chunks: int):
        grid = mesh.grid
        problem = configuration_error(cfg, grid, microbatches, schedule, chunks, zero)
        if problem:
            raise ValueError(problem)
        debug.agree("train_5d", (cfg, microbatches, schedule, zero, chunks))  # MINI_DIST_DEBUG=1: odd rank named
        self.cfg, self.mesh, self.zero, P = cfg, mesh, zero, grid.pp
        # Cut where the dense model would be cut: every TP, CP and EP rank of a stage holds the same layers
        costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in dense_model(cfg)]
        self.chunks = pipeline_chunks(parallel_model(cfg, mesh), mesh.pp_group, chunks,
                                      balanced_split(costs, P * chunks))
        self.plan = SCHEDULES[schedule](P, microbatches, chunks)
        sharded = lambda p: grid.ep > 1 and is_expert(p)  # noqa: E731  (ep = 1: experts replicated as the rest)
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
        # per chunk, one entry per forward of each MoE block: (rows it sent to or received from other ranks,
        # rows its experts received). A block's hook runs once per forward, never in its recomputation
        self.routed, me = [[] for _ in self.chunks], mesh.coords["ep_index"]
        for c, chunk in enumerate(self.chunks):
            for block in (b for b in chunk if isinstance(getattr(b, "mlp", None), ExpertParallelMoE)):
                block.register_forward_hook(lambda b, *_, c=c: self.routed[c].append(routed_rows(b.mlp, me)))

    def parameter_storages(self) -> set:
        """Where the weights live now: the parameters, and FSDP's gathered buffers (reallocated each gather)."""
        fulls = {u.full.untyped_storage().data_ptr() for f in self.fsdp for u in f.units}
        return fulls | {p.untyped_storage().data_ptr() for c in self.stage for p in c.parameters()}

    def step(self, step: int):
        """One step: the pipeline runs the M microbatches (DDP reducing during each chunk's last backward),
        then the experts' gradients are scaled and every optimizer steps. Returns (loss, StepStats, peak)."""
        ids, targets = local_batch(self.cfg, self.mesh, step)
        peak = PeakSaved(self.parameter_storages)
        with peak.hooks():
            loss, stats = pipeline_step(self.stage, self.plan, ids, targets, loss_fn(self.mesh.tp_group),
                                        self.mesh.pp_group, self.no_sync)
        for p in self.experts:  # a sum over the EP group's tokens: ZeRO's average over edp then / ep
            p.grad = p.grad / self.mesh.grid.ep if p.grad is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss, stats, peak.peak

    def memory(self) -> dict:
        """Bytes of this rank's parameters, gradients and optimizer state, from the tensors themselves."""
        total = dict.fromkeys(("params", "grads", "state"), 0)
        params = [p for c in self.stage for p in c.parameters() if not (self.experts and is_expert(p))]
        for optimizer, group in zip(self.optimizers, (params, self.experts)):
            ledger = memory_ledger(group, optimizer)  # its 'scalars' (Adam's step counts) are left out
            for key in total:
                total[key] += ledger[key]
        return total


def train_5d(cfg: Config, mesh: Mesh, steps: int, microbatches: int = 1, schedule: str = "1f1b", zero: int = 0,
             chunks: int = 1) -> Run:
    trainer = Trainer(cfg, mesh, microbatches, schedule, zero, chunks)
    grid, last = mesh.grid, mesh.pp_rank == mesh.grid.pp - 1
    losses, sent = [], []
    for step in range(steps):
        COUNTER.reset()
        LEDGER.reset()
        for f in trainer.fsdp:
            f.ledger.reset()
        for routed in trainer.routed:
            routed.clear()
        loss, stats, peak = trainer.step(step)
        dp = sum(f.ledger.sent for f in trainer.fsdp) if trainer.fsdp else LEDGER.sent
        sent.append({"dp": dp, "pp": stats.bytes_sent, "cp": COUNTER.bytes["ring"], "tp": COUNTER.bytes["all_reduce"],
                     "ep": COUNTER.bytes["all_to_all"]})
        memory = {**trainer.memory(), "activations": peak}
        for optimizer in trainer.optimizers:
            optimizer.zero_grad()
        # the mean loss over the dp x cp ranks, to every rank (one TP rank per last stage speaks); not counted
        mine = loss.item() / (grid.dp * grid.cp) if last and mesh.tp_rank == 0 else 0.0
        mine = torch.tensor([mine], dtype=torch.float64, device=launch.device())
        dist.all_reduce(mine)
        losses.append(mine.item())
    layout = [[kind(layer) for layer in c] for c in trainer.chunks]
    stages = [c * grid.pp + mesh.pp_rank for c in range(chunks)]
    return Run(losses, sent, trainer.routed, memory, layout, stages, cfg.batch // grid.dp, trainer.numels)


def predictions(run: Run, cfg: Config, mesh: Mesh, microbatches: int, schedule: str, zero: int) -> tuple[dict, dict]:
    """The planner's bytes per axis (per step) and memory by category for this rank (mini_dist/cost_model.py),
    from its layers, its coordinates and the rows its MoE layers routed in the last step."""
    grid, model = mesh.grid, cfg.model()
    plan = cost_model.Plan(dp=grid.dp, pp=grid.pp, cp=grid.cp, tp=grid.tp, ep=grid.ep, zero=zero,
                           checkpoint=cfg.checkpoint, micro_batch=run.local_batch // microbatches,
                           microbatches=microbatches, precision="fp64")
    layers = [k for c in run.layout for k in c]
    inside = cost_model.gpt_step_traffic(model, plan, layers.count("block"), "embedding" in layers,
                                         "head" in layers, sum(off for c in run.routed for off, _ in c))
    S, n = grid.pp * len(run.stages), plan.micro_batch * cfg.seq // grid.cp
    act = microbatches * n * cfg.hidden * 8  # one activation [b, s/C, h] per microbatch, fp64
    pp = (grid.pp > 1) * sum(act * ((j < S - 1) + (j > 0)) + 8 * HEADER_LEN * (j < S - 1) for j in run.stages)
    traffic = {"dp": cost_model.gpt_dp_traffic(model, plan, layers), "pp": pp, **inside}
    f = mesh.coords["ep_index"] + grid.ep * mesh.coords["ep_replica"]  # the rank's place in dp x cp
    memory = cost_model.gpt_rank_memory(model, plan, layers, f)
    actions = SCHEDULES[schedule](grid.pp, microbatches, len(run.stages)).actions[mesh.pp_rank]
    received = {}  # (chunk, microbatch): rows its experts received; a chunk's forwards run in schedule order
    for c, routed in enumerate(run.routed):
        forwards, k = [a.mb for a in actions if a.op == "forward" and a.chunk == c], len(routed) // microbatches
        received.update({(c, m): sum(rows for _, rows in routed[i * k:(i + 1) * k]) for i, m in enumerate(forwards)})
    memory["activations"] = cost_model.peak_activations(
        actions, lambda c, m: cost_model.gpt_activation_bytes(model, plan, run.layout[c], received[c, m]),
        lambda c: cost_model.gpt_forward_transient(model, plan, run.layout[c]))
    return traffic, memory


# ----- demo: the loss beside one process, bytes per axis and memory per rank beside the planner -----

def parser():
    p = launch.demo_parser(__doc__)
    for axis, what in (("dp", "data-parallel replicas"), ("pp", "pipeline stages"), ("cp", "context-parallel ranks"),
                       ("tp", "tensor-parallel ranks")):
        p.add_argument(f"--{axis}", type=int, default=None, help=f"{what} (default: tp 2, cp 1, pp 2 where the "
                                                                  "world allows, dp the rest)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, a divisor of dp x cp (needs --moe)")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 routing (0: an MLP)")
    p.add_argument("--microbatches", type=int, default=2, help="M per replica; the global batch grows to a "
                                                               "multiple of dp x M")
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
                  f"{', checkpointed blocks' * cfg.checkpoint}; {args.schedule}"
                  f"{f' x {args.chunks} chunks' * (args.chunks > 1)}, M={M}; {dp_axis} over dp x cp = "
                  f"{grid.dp * grid.cp}; Adam, fp64; global batch {cfg.batch} (at least 8, a multiple of dp x M)")
    run = train_5d(cfg, mesh, args.steps, M, args.schedule, args.zero, args.chunks)
    reference = train_dense(cfg, args.steps)
    # fp64: the runs differ only in the order of their sums (TP partial sums, DP averages, microbatch sums,
    # ring attention's online softmax, expert rows): a few ulps of a loss ~3. A wrong gradient moves a later
    # loss by 1e-6 or more, even under Adam; 1e-13 sits between (tests/test_train_5d.py measures both).
    worst = max(abs(a - b) for a, b in zip(run.losses, reference))
    launch.print0(f"  step {'loss, 5D':>16} {'loss, 1 process':>16} {'|diff|':>8}\n" + "\n".join(
        f"  {s:>4} {a:>16.12f} {b:>16.12f} {abs(a - b):>8.1e}" for s, (a, b) in enumerate(zip(run.losses,
                                                                                                reference))))
    traffic, memory = predictions(run, cfg, mesh, M, args.schedule, args.zero)
    got = dict(run.bytes[-1])
    if args.zero == 0:  # DDP's ring chunks may be uneven: its formula is the dp x cp group's average
        got["dp"] = Fraction(total(got["dp"], mesh.dp_cp_group), grid.dp * grid.cp)
    rows = [None] * world
    dist.all_gather_object(rows, (got, traffic, run.memory, memory))
    exact = all(r[0] == r[1] and r[2] == r[3] for r in rows)
    launch.print0("bytes per step, rank: measured = planner (DP: the DDP group's average)\n"
                  + side_by_side([r[:2] for r in rows], AXES) + "\nmemory per rank, bytes: measured = planner\n"
                  + side_by_side([r[2:] for r in rows], MEMORY))
    dims = "x".join(str(getattr(grid, a)) for a in ("dp", "pp", "cp", "tp"))
    return launch.conclude("train_5d", worst <= 1e-13, f"{dims} ep {grid.ep} loss = 1 process ({worst:.0e})", exact,
                           "bytes per axis and memory = planner")


def total(value: int, group=None) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=launch.device())
    dist.all_reduce(t, group=group)
    return int(t.item())


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
