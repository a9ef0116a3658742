"""The tiny GPT cut along four axes at once: data, tensor, context and expert parallelism, equal to the dense
model in one process.

mini_dist/tiny_gpt.py writes the model once, dense from PyTorch's layers or cut from mini_dist's with the same
parameter names. Here each rank takes its shard of the dense weights and its part of the batch, over its
groups of the mesh (mini_dist/mesh.py):

    DP                                      the batch: B/dp sequences a replica, the weights whole
    TP  (tensor_parallel, vocab_parallel)   every weight matrix: heads, MLP columns/rows, vocabulary rows
    CP  (context_parallel)                  the sequence: s/C tokens per rank (zigzag), ring attention
    EP  (expert_parallel)                   the experts: E/ep per rank, their tokens moved by all-to-all

One forward + backward on every rank, then the ranks that hold the same weights and saw other tokens (the
dp x cp of them) average their gradients: each rank then holds its shard of the dense model's gradient on the
whole batch, exactly (an expert's gradient already holds every token its EP group routed to it). Per block
and microbatch of b(s/C) tokens, a rank sends 4 TP all-reduces of b(s/C)h elements (2 with experts, which TP
does not cut), 6(C-1) CP hops of b(s/C)h/T (K, V forward, dK, dV back) and its routed rows twice
(mini_dist/gpt_ledger.py: every byte sent and held, exactly). Experts route with no
capacity limit and no auxiliary loss: both depend on which tokens are routed together, so the run would no
longer equal one process.

Demo (one forward + backward against the dense model; bytes per axis and memory per rank beside the ledger):

    torchrun --standalone --nproc_per_node=4 mini_dist/parallel_gpt.py --cp 2 --tp 2 --moe 4 --ep 2

Mirrors the model side of torchtitan (parallelize_llama: TP plan, context_parallel, expert-parallel MoE).
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import cost_model, expert_parallel, gpt_ledger, tp_layout
from mini_dist.collectives import all_reduce
from mini_dist.expert_parallel import ExpertParallelMoE
from mini_dist.kit import launch
from mini_dist.kit.measure import PeakSaved, side_by_side
from mini_dist.kit.wire import LEDGER
from mini_dist.mesh import Mesh, grid_for
from mini_dist.sequence_layout import split_sequence
from mini_dist.tiny_gpt import CORPUS, Config, dense_model, get_batch, kind, padded_vocab, tiny_gpt
from mini_dist.vocab_parallel import vocab_parallel_cross_entropy


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


def parallel_model(cfg: Config, mesh: Mesh) -> nn.Sequential:
    """This rank's shard of dense_model(cfg), on this rank's device."""
    return shard_from_dense(tiny_gpt(cfg, mesh, launch.device()), dense_model(cfg, launch.device()), mesh)


def local_batch(cfg: Config, mesh: Mesh, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of the global batch: its replica's b = B/dp sequences, its s/C part of each."""
    b = cfg.batch // mesh.grid.dp
    ids, targets = (t[mesh.dp_rank * b:(mesh.dp_rank + 1) * b] for t in get_batch(cfg, step))
    if mesh.grid.cp == 1:
        return ids, targets
    return tuple(split_sequence(t, mesh.cp_group, dim=1) for t in (ids, targets))


def average_gradients(model, mesh: Mesh) -> None:
    """Plain data parallelism (train_5d.py overlaps it): after one forward + backward of the mean loss over this
    rank's tokens, every rank's gradients become its shard of the dense model's gradient of the whole batch."""
    # exercise: nothing returned; every p.grad of model replaced by this rank's shard of the dense model's
    #   gradient (within fp64 rounding), on every rank. An expert's weights carry ep_dim; mesh has the groups
    #   (mesh.dp_cp_group, mesh.ep_group, mesh.edp_group, ...); all_reduce (collectives) sums over one
    n = mesh.grid.dp * mesh.grid.cp
    for p in model.parameters():
        p.grad = all_reduce(p.grad, mesh.edp_group if hasattr(p, "ep_dim") else mesh.dp_cp_group) / n
    # end exercise


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


# ----------------------------------------------------------------------------- demo

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
    g = mesh.grid
    model = parallel_model(cfg, mesh)
    dense = dense_model(cfg, launch.device())
    ids, targets = local_batch(cfg, mesh, 0)
    LEDGER.reset()
    saved = PeakSaved(lambda: {p.untyped_storage().data_ptr() for p in model.parameters()})
    with saved.hooks():
        loss = vocab_parallel_cross_entropy(model(ids), targets, mesh.tp_group).mean()  # from V/tp logits
    loss.backward()
    sent = {"tp": LEDGER.bytes["all_reduce"], "cp": LEDGER.bytes["ring attention"], "ep": LEDGER.bytes["all_to_all"]}
    me = mesh.coords["ep_index"]
    routed = [gpt_ledger.routed_rows(m, me) for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    held = {"params": sum(p.nbytes for p in model.parameters()),
            "grads": sum(p.grad.nbytes for p in model.parameters()), "activations": saved.peak}
    ids, targets = get_batch(cfg, 0)
    whole = F.cross_entropy(dense(ids).flatten(0, 1), targets.flatten())
    whole.backward()
    mean_loss = all_reduce(loss.detach(), mesh.dp_cp_group) / (g.dp * g.cp)
    average_gradients(model, mesh)
    gathered = gather_to_dense(model, dense_model(cfg, launch.device()), mesh)
    diffs = [mean_loss - whole] + [p.grad - q.grad for p, q in zip(gathered.parameters(), dense.parameters())]
    plan = cost_model.Plan(dp=g.dp, cp=g.cp, tp=g.tp, ep=g.ep, checkpoint=cfg.checkpoint,
                           micro_batch=cfg.batch // g.dp, precision="fp64")
    layers = [kind(layer) for layer in model]
    traffic, planned = gpt_ledger.step_ledger(gpt_ledger.model_of(cfg), plan, layers, routed, launch.device())
    return max(d.abs().max().item() for d in diffs), (sent, traffic), (held, planned)


def demo(args) -> int:
    world = launch.env_world_size()
    if args.tp is None:  # unset: the world's rest when --cp is given, else 2 where the world allows
        args.tp = world // args.cp if args.cp and world % args.cp == 0 else 2 - world % 2
    if args.cp is None:
        args.cp = max(world // max(args.tp, 1), 1)
    ranks = args.cp * args.tp
    launch.require(min(args.cp, args.tp) >= 1 and ranks == world, f"--cp {args.cp} x --tp {args.tp} = {ranks} ranks, "
                   f"but the world has {world}: choose degrees >= 1 with a product of {world}")
    grid = grid_for(world, dp=1, pp=1, cp=args.cp, tp=args.tp, ep=args.ep)
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
                  f"{', checkpointed blocks' if cfg.checkpoint else ''}; cp {grid.cp} x tp {grid.tp}, ep {grid.ep}, "
                  f"fp64\n|loss - dense| and max |grad - dense| over every weight: {worst:.1e}\nbytes each rank sent "
                  "in one forward + backward, by axis: measured = the docstring's formulas\n"
                  + side_by_side([t for t, _ in rows], ("tp", "cp", "ep")) + "\nbytes each rank holds: measured = "
                  "ledger (mini_dist/gpt_ledger.py); activations: the most bytes autograd saved for backward at once "
                  "(measure.PeakSaved)\n" + side_by_side([m for _, m in rows], ("params", "grads", "activations")))
    exact = all(a == b for pairs in rows for a, b in pairs)
    return launch.conclude("parallel_gpt", worst < 1e-12, f"= dense GPT ({worst:.0e})", exact,
                           "bytes per axis = formulas, memory = ledger")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
