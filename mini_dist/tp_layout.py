"""Where each parameter of a tensor-parallel model lives, and moving weights between it and the dense model.

A tensor-parallel module holds, on rank i of T, slice i of some of its parameters and the whole of others.
Each module says which, by parameter name, in a `tp_layout` dict of `Layout`s (on the module, not on the
Parameter, so a fresh nn.Parameter assigned to `.weight` keeps it):

    Layout(dim)            slice i of T along dim       a column layer's weight rows, a row layer's columns
    Layout(dim, parts=3)   slice i of each part         a stacked [W_q; W_k; W_v]: each rank its heads of q, k, v
    Layout()               whole on every rank          a row layer's bias, layer norms
    Layout(partial_grad)   whole, gradient partial      the same under sequence parallelism: s/T tokens each
                                                        (allreduce_sequence_parallel_grads sums them)

With it, one pair of functions moves any model between its dense and its parallel form:

    shard_from_dense(parallel, dense)   rank i copies its slice of each dense parameter       (no communication)
    gather_to_dense(parallel, dense)    all-gather each slice and its gradient into the dense   (T-1)/T per rank

That is how the tests prove a parallel model equal to its dense PyTorch twin, and how a checkpoint of one
moves to the other. A parameter whole on every rank costs T times its bytes; a cut one, 1/T per rank.

Demo (an attention-like pair of layers, [q; k; v] then an output projection: what each rank holds, bytes per
rank, and the round trip dense -> parallel -> dense, exact):

    torchrun --standalone --nproc_per_node=4 mini_dist/tp_layout.py [--hidden 8]

Mirrors: torch.distributed.tensor's placements (Shard(dim), Replicate(); a partial gradient is Partial()),
distribute_tensor and DTensor.full_tensor; Megatron-LM's tensor_model_parallel / partition_dim attributes.
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch
from mini_dist.comm import all_gather, all_reduce, split


@dataclass(frozen=True)
class Layout:
    """Where a parameter lives on the TP group. dim: cut along it, rank i holding slice i (None: whole on
    every rank); parts: a stacked [W_q; W_k; W_v] is cut into its parts first, each rank holding a slice of
    each; partial_grad: whole, but each rank's gradient covers only its s/T tokens (sequence parallelism)."""
    dim: int | None = None
    parts: int = 1
    partial_grad: bool = False


def layouts(module: nn.Module) -> dict[str, Layout]:
    """{parameter name in module: Layout} from every submodule's `tp_layout`; a name absent is whole."""
    found = {}
    for prefix, m in module.named_modules():
        for name, layout in getattr(m, "tp_layout", {}).items():
            found[f"{prefix}.{name}" if prefix else name] = layout
    return found


def _along(t, layout: Layout, collective, group):
    """split (my slice of a whole tensor) or all_gather (the whole from the slices) along the layout's dim;
    a stacked [q; k; v] is taken part by part, so that each rank holds a slice of each."""
    if layout.dim is None:
        return t
    d = layout.dim
    return collective(t.unflatten(d, (layout.parts, -1)), d + 1, group).flatten(d, d + 1)


def _pairs(parallel, dense):
    """(parallel parameter, its layout, the dense parameter of the same name), for every parameter."""
    full = dict(dense.named_parameters())
    where = layouts(parallel)
    for name, p in parallel.named_parameters():
        if name not in full:
            raise ValueError(f"the dense module has no parameter {name!r}: build the parallel module "
                             f"with the same layout as {type(dense).__name__}")
        yield p, where.get(name, Layout()), full[name]


def _must_fit(moved, into, what: str, where: str) -> None:
    """A shard or a whole that does not fit its parameter: the two modules were built with other sizes."""
    if moved.shape != into.shape:
        raise ValueError(f"{what} of shape {tuple(moved.shape)} does not fit {where} of shape {tuple(into.shape)}: "
                         f"were both modules built with the same sizes?")


@torch.no_grad()
def shard_from_dense(parallel, dense, group=None):
    """Copy this rank's shard of every parameter of `dense` (same names) into `parallel`; return it."""
    for p, layout, full in _pairs(parallel, dense):
        local = _along(full, layout, split, group)
        _must_fit(local, p, "the shard", "the parallel parameter")
        p.copy_(local)
    return parallel


@torch.no_grad()
def gather_to_dense(parallel, dense, group=None):
    """The inverse: all-gather every shard, and its gradient when there is one, into `dense`, on each dense
    parameter's own device and dtype (the dense model need not live where its parallel twin does)."""
    for p, layout, full in _pairs(parallel, dense):
        whole = _along(p, layout, all_gather, group)
        _must_fit(whole, full, "the gathered whole", "the dense parameter")
        full.copy_(whole)
        grad = None if p.grad is None else _along(p.grad, layout, all_gather, group)
        full.grad = None if grad is None else grad.to(full.device, full.dtype, copy=True)
    return dense


def allreduce_sequence_parallel_grads(module, group=None) -> None:
    """Under sequence parallelism, layer norms and row-parallel biases see only s/T tokens per rank: sum the
    gradients of every partial_grad parameter over the group (one all-reduce for all) before the optimizer step."""
    named = dict(module.named_parameters())
    params = [named[n] for n, layout in layouts(module).items()
              if layout.partial_grad and n in named and named[n].grad is not None]
    if params:
        flat = all_reduce(torch.cat([p.grad.flatten() for p in params]), group)
        for p, grad in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(grad.view_as(p))


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--hidden", type=int, default=8, help="h: [q; k; v] is [3h, h], the projection [h, h]")
    return p


class ShardedPair(nn.Module):
    """nn.Sequential(nn.Linear(h, 3h), nn.Linear(h, h))'s parameters as T ranks hold them in attention: the
    stacked [q; k; v] rows cut part by part (heads), the projection's columns cut, its bias whole."""

    def __init__(self, h, T, device):
        super().__init__()
        self.add_module("0", nn.Linear(h, 3 * h // T, device=device, dtype=torch.float64))
        self.add_module("1", nn.Linear(h // T, h, device=device, dtype=torch.float64))
        self.tp_layout = {"0.weight": Layout(0, parts=3), "0.bias": Layout(0, parts=3), "1.weight": Layout(1)}


def demo(args) -> int:
    T = launch.env_world_size()
    h = args.hidden
    launch.require(h >= 1 and h % T == 0, f"--hidden {h} cannot be cut into {T} equal slices: pick a multiple "
                                          f"of {T}")
    dev = launch.setup().device
    dense = nn.Sequential(nn.Linear(h, 3 * h), nn.Linear(h, h)).to(dev, torch.float64)
    pair = shard_from_dense(ShardedPair(h, T, dev), dense)
    for p in pair.parameters():
        p.grad = p.detach().clone()  # a gradient equal to the shard: gathered, it must be the dense parameter
    back = gather_to_dense(pair, nn.Sequential(nn.Linear(h, 3 * h), nn.Linear(h, h)).to(dev))  # an fp32 twin
    exact = all(torch.equal(q, p.float()) and torch.equal(q.grad, p.float())
                for p, q in zip(dense.parameters(), back.parameters()))
    where = layouts(pair)
    launch.print0(f"[q; k; v] [{3 * h}, {h}] and a projection [{h}, {h}], fp64, T={T}: what rank r holds\n"
                  f"  {'parameter':10}{'shape':>10}{'bytes/rank':>12}   slice")
    for name, p in pair.named_parameters():
        layout = where.get(name, Layout())
        if layout.dim is None:
            cut = "whole"
        elif layout.parts > 1:
            cut = f"slice r of {T} along dim {layout.dim} in each of its {layout.parts} parts"
        else:
            cut = f"slice r of {T} along dim {layout.dim}"
        launch.print0(f"  {name:10}{str(tuple(p.shape)):>10}{p.nbytes:>12,}   {cut}")
    mine = sum(p.nbytes for p in pair.parameters())
    whole = sum(p.nbytes for p in dense.parameters())
    want = (whole - 8 * h) // T + 8 * h  # all but the projection's bias is cut T ways
    launch.print0(f"per rank {mine:,} B of the dense model's {whole:,} B (formula: cut bytes / T + whole bytes = "
                  f"{want:,} B)")
    return launch.conclude("tp_layout", exact, "dense -> parallel -> dense (fp64 into fp32), gradients too: exact",
                           mine == want, f"per rank {mine:,} B, 1/{whole / mine:.2f} of the dense model's")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
