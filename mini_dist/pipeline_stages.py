"""Pipeline stages: which layers each rank holds, so that the slowest stage is as fast as it can be.

A pipeline cuts a sequential model's L layers into P runs of consecutive layers, stage s on rank s. Every
microbatch passes through every stage, so once the pipe is full a step goes at the pace of the slowest one:

    step time  ~  (M + P - 1) * max over stages s of cost(s)

The naive cut gives every stage L/P layers; when layers differ (an embedding, a wide projection, a head),
one stage gets the costly ones and the others wait for it. The balanced cut minimises the costliest stage
exactly (dynamic programming over where the P-1 cuts go: O(P * L^2)). With v model chunks per rank
(interleaved schedules) the model is cut into P*v virtual stages and rank r holds stages r, r+P, r+2P, ...

    torchrun --standalone --nproc_per_node=4 mini_dist/pipeline_stages.py [--layers 12 --chunks 2]

Mirrors the manual split of torch.distributed.pipelining (one PipelineStage per chunk of the model); a
layer's cost here is its parameter count, + 1.
"""
import functools
import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch


def equal_split(n_layers: int, n_stages: int) -> list[int]:
    """The naive cut: as many layers on every stage as can be (the first L % P stages one more)."""
    return [n_layers // n_stages + (s < n_layers % n_stages) for s in range(n_stages)]


# The balanced cut buys a faster pipe when layers differ: the step waits for the costliest stage, and
# this cut makes that stage as cheap as any cut can.
def balanced_split(costs: list[int], n_stages: int) -> list[int]:
    """Layers per stage: cut `costs` into n_stages consecutive runs so that the costliest run is as cheap
    as it can be (the slowest stage sets the pace of the whole pipe). Exact, by dynamic programming."""
    prefix = [0, *itertools.accumulate(costs)]

    @functools.cache
    def best(p: int, i: int) -> tuple:
        """(cost of the costliest stage, layers per stage) of the best cut of layers [0, i) into p stages."""
        if p == 1:
            return prefix[i], (i,)
        cuts = []
        for j in range(p - 1, i):  # the last stage holds layers [j, i), the p-1 before it the best cut of [0, j)
            costliest, sizes = best(p - 1, j)
            cuts.append((max(costliest, prefix[i] - prefix[j]), sizes + (i - j,)))
        return min(cuts)
    _, sizes = best(n_stages, len(costs))
    return list(sizes)


def layer_costs(model: nn.Sequential) -> list[int]:
    """A layer's cost: its parameter count, + 1 so that parameter-free layers are spread too."""
    return [1 + sum(p.numel() for p in layer.parameters()) for layer in model]


def split_model(model: nn.Sequential, n_stages: int, sizes: list[int] | None = None) -> list[nn.Sequential]:
    """Cut a sequential model into n_stages stages that share its layers: sizes[i] layers for stage i if
    given, else balanced by layer_costs."""
    layers = list(model)
    if n_stages > len(layers):
        raise ValueError(f"cannot cut {len(layers)} layers into {n_stages} pipeline stages (a stage needs at "
                         f"least one layer): use fewer pipeline ranks or model chunks, or a deeper model")
    if sizes is None:
        sizes = balanced_split(layer_costs(model), n_stages)
    if len(sizes) != n_stages or min(sizes) < 1 or sum(sizes) != len(layers):
        raise ValueError(f"sizes {sizes} must be {n_stages} positive layer counts summing to {len(layers)}")
    bounds = [0, *itertools.accumulate(sizes)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def pipeline_chunks(model: nn.Sequential, group=None, n_chunks: int = 1, sizes=None) -> list[nn.Sequential]:
    """This rank's chunks of `model` cut into P*v virtual stages: stage j lives on rank j % P, so rank r
    holds stages r, r+P, r+2P, ... (v = 1: just stage r)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    return split_model(model, P * n_chunks, sizes)[r::P]


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--layers", type=int, default=12, help="L, Linear layers, each wider than the one before")
    p.add_argument("--chunks", type=int, default=2, help="v, model chunks per rank for the virtual stages")
    return p


def stage_costs(costs: list[int], sizes: list[int]) -> list[int]:
    """What each stage of a cut costs: the sum of its layers' costs."""
    bounds = [0, *itertools.accumulate(sizes)]
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def demo(args) -> int:
    P = launch.env_world_size()
    L = args.layers
    v = args.chunks
    launch.require(v >= 1 and L >= P * v, f"--layers must be at least P*v = {P * v} (a stage needs a layer)")
    launch.setup()
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(*[nn.Linear(8 * (i + 1), 8 * (i + 2)) for i in range(L)]).to(launch.device())
    costs = layer_costs(model)
    naive = equal_split(L, P)
    balanced = balanced_split(costs, P)
    brute = min(max(stage_costs(costs, [b - a for a, b in zip((0, *cuts), (*cuts, L))]))
                for cuts in itertools.combinations(range(1, L), P - 1))
    launch.print0(f"P={P}, L={L} layers of growing width, cost = parameters + 1, per stage:\n"
                  f"{'cut':<10} | {'layers per stage':<20} | {'cost per stage':<36} | slowest")
    for name, sizes in (("equal", naive), ("balanced", balanced)):
        launch.print0(f"{name:<10} | {str(sizes):<20} | {str(stage_costs(costs, sizes)):<36} | "
                      f"{max(stage_costs(costs, sizes)):,}")
    slow_naive = max(stage_costs(costs, naive))
    slow_balanced = max(stage_costs(costs, balanced))
    launch.print0(f"a full pipe runs at the slowest stage's pace: the balanced cut is "
                  f"{slow_naive / slow_balanced:.2f}x faster than the equal one (the best of all {L - 1} choose "
                  f"{P - 1} cuts: {brute:,})")
    chunks = pipeline_chunks(model, None, v)
    held = torch.tensor([sum(p.numel() for c in chunks for p in c.parameters())], device=launch.device())
    everyone = [torch.zeros_like(held) for _ in range(P)]
    dist.all_gather(everyone, held)
    stages = [list(range(r, P * v, P)) for r in range(P)]
    launch.print0(f"v={v}: rank r holds virtual stages {stages}; parameters per rank "
                  f"{[int(t) for t in everyone]}, total {sum(int(t) for t in everyone):,}")
    whole = sum(p.numel() for p in model.parameters())
    return launch.conclude("pipeline_stages", sum(int(t) for t in everyone) == whole,
                           f"the ranks' chunks hold the {whole:,} parameters once",
                           slow_balanced == brute, "balanced cut = the best of every cut")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
