"""What each rank of a 5D run moves and holds, measured step by step, beside its ledger.

mini_dist/train_5d.py trains the tiny GPT with every axis at once; mini_dist/rank_ledger.py predicts, before
anything runs, what each of its ranks sends on every axis and holds in every category. A MeasuredTrainer is a
train_5d.Trainer that counts the same things while it trains:

    bytes by axis   the kit's one byte ledger (mini_dist/kit/wire.py), reset before each step: TP's all-reduces,
                    CP's ring attention messages, EP's all-to-alls and DP's ring collectives (under --zero 3,
                    FSDP's own ledger); PP's activations and gradients from the pipeline's StepStats
    routed rows     each MoE block's forward records the rows it sent to and got from other ranks, which the
                    ledger needs: where tokens are routed depends on the data
    memory          parameters, gradients and optimizer state after the step (zero_ledger.memory_ledger)
    activations     the most bytes autograd held for backward at once during the step (measure.PeakSaved,
                    exact on any device, unlike an allocator's peak); FSDP's gathered buffers count as weights

The two agree to the byte on every rank, for any grid, ZeRO stage, schedule and expert layout
(tests/test_train_5d.py). DDP's ring all-reduce cuts its buffer into N chunks that may be uneven, so its bytes
are compared as the average over the N = dp x cp ranks of its group: 2(N-1)/N of the gradient bytes.

Demo (two steps of train_5d; each rank's bytes per axis and memory by category beside its ledger):

    torchrun --standalone --nproc_per_node=8 mini_dist/measure_5d.py --dp 2 --pp 2 --cp 2 --moe 4 --ep 2
"""
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import cost_model, gpt_ledger, rank_ledger
from mini_dist.expert_parallel import ExpertParallelMoE
from mini_dist.fsdp import BOOKED
from mini_dist.kit import flags, launch, measure
from mini_dist.kit.measure import PeakSaved, side_by_side
from mini_dist.kit.wire import LEDGER
from mini_dist.mesh import Mesh, grid_for
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.tiny_gpt import Config, kind, padded_vocab
from mini_dist.train_5d import Trainer, configuration_error, train
from mini_dist.zero_ledger import memory_ledger

AXES = ("dp", "pp", "cp", "tp", "ep")
MEMORY = ("params", "grads", "state", "activations")


class MeasuredTrainer(Trainer):
    """A train_5d.Trainer that measures, each step, what rank_ledger predicts."""

    def data_parallel(self, zero: int) -> None:
        """Before data parallelism wraps the chunks (FSDP cuts their weights into shards): each layer's elements
        (replicated over dp x cp, experts over edp) and kind; after it, the hooks that record routing."""
        self.numels = [[sum(p.numel() for p in layer.parameters() if self.is_expert(p) == expert)
                        for expert in (False, True)] for c in self.chunks for layer in c]
        self.layout = [[kind(layer) for layer in c] for c in self.chunks]
        super().data_parallel(zero)
        self.bytes = []
        self.routed = [[] for _ in self.chunks]  # per chunk, per MoE block forward: gpt_ledger.routed_rows
        for c, chunk in enumerate(self.chunks):
            for block in chunk:
                if isinstance(getattr(block, "mlp", None), ExpertParallelMoE):
                    block.register_forward_hook(self.routed_hook(c))

    def routed_hook(self, c: int):
        """A forward hook recording chunk c's routed rows: it runs once a forward, never in recomputation."""
        def hook(block, inputs, output):
            self.routed[c].append(gpt_ledger.routed_rows(block.mlp, self.mesh.coords["ep_index"]))
        return hook

    def step(self, step: int):
        """Trainer.step, this step's bytes by axis, memory and peak of activations recorded."""
        for ledger in [LEDGER] + [f.ledger for f in self.fsdp]:
            ledger.reset()
        for routed in self.routed:
            routed.clear()
        loss, stats = super().step(step)
        dp = measure.ring_sent(BOOKED, self.fsdp[0].world) if self.fsdp else LEDGER.bytes["ring"]
        self.bytes.append({"dp": dp, "pp": stats.bytes_sent, "cp": LEDGER.bytes["ring attention"],
                           "tp": LEDGER.bytes["all_reduce"], "ep": LEDGER.bytes["all_to_all"]})
        self.memory = {**self.held(), "activations": self.peak}
        return loss, stats

    def forward_backward(self, ids, targets):
        """Trainer.forward_backward, with the bytes autograd saves for backward watched."""
        saved = PeakSaved(self.parameter_storages)
        with saved.hooks():
            result = super().forward_backward(ids, targets)
        self.peak = saved.peak
        return result

    def parameter_storages(self) -> set:
        """Where the weights live now: the parameters, and FSDP's gathered buffers (reallocated each gather)."""
        fulls = {u.full.untyped_storage().data_ptr() for f in self.fsdp for u in f.units}
        return fulls | {p.untyped_storage().data_ptr() for c in self.stage for p in c.parameters()}

    def held(self) -> dict:
        """Bytes of this rank's parameters, gradients and optimizer state (not Adam's step counts)."""
        params = [p for c in self.stage for p in c.parameters() if not (self.experts and hasattr(p, "ep_dim"))]
        ledgers = [memory_ledger(group, opt) for opt, group in zip(self.optimizers, (params, self.experts))]
        return {key: sum(ledger[key] for ledger in ledgers) for key in ("params", "grads", "state")}


@dataclass
class Run:
    """What one rank measured (the global loss per step is the same on every rank), and what its ledger needs."""
    losses: list
    bytes: list          # per step: {"dp": .., "pp": .., "cp": .., "tp": .., "ep": ..}
    routed: list         # its last step's: per chunk, per MoE block forward, (off-rank rows, rows received)
    memory: dict         # params, grads, state (after the last step), activations (peak of the last step)
    layout: list         # its chunks' layers, e.g. [["embedding", "block"], ["block", "head"]]
    local_batch: int
    numels: list         # per layer of its chunks: elements (replicated over dp x cp, experts over edp)


def measured_run(cfg: Config, mesh: Mesh, steps: int, microbatches: int = 1, schedule: str = "1f1b", zero: int = 0,
                 chunks: int = 1) -> Run:
    """train_5d's run on this rank, measured: the losses, every step's bytes, the last step's routing and memory."""
    trainer = MeasuredTrainer(cfg, mesh, microbatches, schedule, zero, chunks)
    losses = train(trainer, steps)
    return Run(losses, trainer.bytes, trainer.routed, trainer.memory, trainer.layout, cfg.batch // mesh.grid.dp,
               trainer.numels)


def predictions(run: Run, cfg: Config, mesh: Mesh, microbatches: int, schedule: str, zero: int) -> tuple[dict, dict]:
    """This rank's ledger (rank_ledger.py) from its layers, coordinates and the rows its MoE layers routed."""
    g = mesh.grid
    plan = cost_model.Plan(dp=g.dp, pp=g.pp, cp=g.cp, tp=g.tp, ep=g.ep, zero=zero, checkpoint=cfg.checkpoint,
                           micro_batch=run.local_batch // microbatches, microbatches=microbatches, precision="fp64")
    model = gpt_ledger.model_of(cfg)
    place = mesh.coords["ep_index"] + g.ep * mesh.coords["ep_replica"]  # the rank's place in dp x cp
    scores = gpt_ledger.attention_keeps_scores(model, plan, launch.device())
    return rank_ledger.rank_ledger(model, plan, schedule, run.layout, mesh.pp_rank, place, run.routed, scores)


# ----------------------------------------------------------------------------- demo

def parser():
    return flags.grid_5d(launch.demo_parser(__doc__), SCHEDULES)


def demo(args) -> int:
    world = launch.env_world_size()
    M = args.microbatches
    grid = grid_for(world, args.dp, args.pp, args.cp, args.tp, args.ep, default_pp=2)
    launch.require(M >= 1 and args.chunks >= 1, "--microbatches and --chunks must be >= 1")
    cfg = Config(vocab=padded_vocab(grid.tp), batch=-(-8 // (grid.dp * M)) * grid.dp * M, experts=args.moe,
                 checkpoint=args.checkpoint)
    problem = configuration_error(cfg, grid, M, args.schedule, args.chunks, args.zero)
    launch.require(problem is None, problem)
    launch.setup()
    mesh = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    run = measured_run(cfg, mesh, 2, M, args.schedule, args.zero, args.chunks)
    traffic, memory = predictions(run, cfg, mesh, M, args.schedule, args.zero)
    got = dict(run.bytes[-1])
    if args.zero == 0:  # DDP's ring chunks may be uneven: its formula is the dp x cp group's average
        total = torch.tensor([got["dp"]], device=launch.device())
        dist.all_reduce(total, group=mesh.dp_cp_group)
        got["dp"] = Fraction(int(total.item()), grid.dp * grid.cp)
    cuda = launch.device().type == "cuda"
    rows = [None] * world
    dist.all_gather_object(rows, (got, traffic, run.memory, memory, cuda and torch.cuda.max_memory_allocated()))
    launch.print0(f"{grid.picture()}\ntiny GPT, {f'MoE {cfg.experts} experts' if cfg.experts else 'MLP'}; "
                  f"{args.schedule}, M={M}; {('DDP', 'ZeRO-1', 'ZeRO-2', 'FSDP')[args.zero]}; the second of 2 steps\n"
                  "bytes each rank sent, by axis: measured = ledger (mini_dist/rank_ledger.py; DP: the DDP group's "
                  "average)\n" + side_by_side([r[:2] for r in rows], AXES) + "\nbytes each rank holds: measured = "
                  "ledger; activations: the most bytes autograd saved for backward at once (measure.PeakSaved)\n"
                  + side_by_side([r[2:4] for r in rows], MEMORY))
    if cuda:
        launch.print0("CUDA allocator's peak per rank, bytes, for information (weights, states, activations, "
                      "workspaces, rounding: no formula predicts it): " + ", ".join(f"{r[4]:,}" for r in rows))
    sent = all(r[0] == r[1] for r in rows)
    held = all(r[2] == r[3] for r in rows)
    return launch.conclude("measure_5d", sent, "bytes per axis = ledger, every rank", held,
                           "memory by category = ledger, every rank")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
