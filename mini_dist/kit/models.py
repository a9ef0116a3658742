"""The toy models and training steps that demos, tests and benchmarks share.

    mlp                 Linear, Tanh, ..., Linear: the replica DDP, ZeRO and the benchmarks train
    linears             Linear, ..., Linear, nothing between: plain gradient matrices, what PowerSGD compresses
    Block               a residual MLP standing in for a transformer block: the unit FSDP gathers whole
    block_stack         Linear -> Blocks -> Linear, the model FSDP wraps (each Block one unit)
    fully_shard_blocks  torch's own FSDP2 (fully_shard) on each Block and the root: FSDP's reference
    accumulation_step   one optimizer step over K micro-batches, the loss divided by K (DDP's lesson)
    regression_step     one step of mean squared error against a target (FSDP's loop)
    random_batch_steps  steps on a fresh random batch per rank and step (ZeRO's loop)
    teacher_steps       SGD toward a teacher's linear map, the test loss after each step (compression's loop)

Every model is seeded, so every rank builds the same one; the data is each rank's own. The training steps
record forward, backward and the optimizer's step as spans of a trace (kit/trace.py), when one records.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from mini_dist.kit import launch
from mini_dist.kit.trace import span
from mini_dist.kit.wire import LEDGER


def mlp(widths: list[int], dtype=torch.float64, seed: int = 0, device=None) -> nn.Sequential:
    """Linear(widths[0], widths[1]), Tanh, ..., Linear(widths[-2], widths[-1]), from torch.manual_seed(seed),
    on `device` (default: this rank's, launch.device())."""
    torch.manual_seed(seed)
    device = device or launch.device()
    layers = [m for a, b in zip(widths, widths[1:])
              for m in (nn.Linear(a, b, dtype=dtype, device=device), nn.Tanh())]
    return nn.Sequential(*layers[:-1])


def linears(widths: list[int], dtype=torch.float32, seed: int = 0, device=None) -> nn.Sequential:
    """Linear(widths[0], widths[1]), ..., Linear(widths[-2], widths[-1]) and nothing between, from
    torch.manual_seed(seed), on `device` (default: this rank's)."""
    torch.manual_seed(seed)
    device = device or launch.device()
    return nn.Sequential(*(nn.Linear(a, b, dtype=dtype, device=device) for a, b in zip(widths, widths[1:])))


class Block(nn.Module):
    """A residual MLP standing in for a transformer block: the unit FSDP gathers and frees whole."""

    def __init__(self, width: int, hidden: int, device=None):
        super().__init__()
        self.up = nn.Linear(width, hidden, device=device)
        self.down = nn.Linear(hidden, width, device=device)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def block_stack(width: int, hidden: int, depth: int, dtype, device) -> nn.Sequential:
    """Linear(width, width) -> depth Blocks -> Linear(width, width), from torch.manual_seed(0)."""
    torch.manual_seed(0)
    blocks = [Block(width, hidden, device) for _ in range(depth)]
    return nn.Sequential(nn.Linear(width, width, device=device), *blocks,
                         nn.Linear(width, width, device=device)).to(device, dtype)


def fully_shard_blocks(model: nn.Module, group=None) -> nn.Module:
    """torch's fully_shard (FSDP2) on every Block, then on the root: the units mini FSDP makes with wrap=Block."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, launch.device().type)
    for block in (m for m in model.modules() if isinstance(m, Block)):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def accumulation_step(model, optimizer, micro_batches) -> None:
    """One optimizer step over K micro-batches, the loss divided by K so the accumulated gradient is the
    mean of all of them. A model with no_sync (DDP) syncs in the last backward only; one with
    sync_gradients (the naive DDP) syncs after the last backward."""
    naive = hasattr(model, "sync_gradients")
    for k, (x, y) in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with contextlib.nullcontext() if naive or last or not hasattr(model, "no_sync") else model.no_sync():
            with span("forward", micro_batch=k):
                loss = nn.functional.mse_loss(model(x), y) / len(micro_batches)
            with span("backward", micro_batch=k):
                loss.backward()
    if naive:
        model.sync_gradients()
    with span("optimizer step"):
        optimizer.step()
    optimizer.zero_grad()


def regression_step(model, optimizer, x, y) -> float:
    """One step of mean((model(x) - y)^2); returns the loss."""
    with span("forward"):
        loss = ((model(x) - y) ** 2).mean()
    with span("backward"):
        loss.backward()
    with span("optimizer step"):
        optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def random_batch_steps(model, forward, optimizer, steps: int) -> None:
    """`steps` steps of mean(forward(x)^2), x a batch of 8 drawn per rank and step (seed 1000 t + rank), in
    model's first layer's width and dtype. zero_grad comes first, so the last step's gradients stay live."""
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 * t + dist.get_rank())
        x = torch.randn(8, model[0].in_features, generator=g).to(launch.device(), model[0].weight.dtype)
        optimizer.zero_grad()
        with span("forward", step=t):
            loss = (forward(x) ** 2).mean()
        with span("backward", step=t):
            loss.backward()
        with span("optimizer step", step=t):
            optimizer.step()


def teacher_steps(model, forward, steps: int, lr: float) -> list[float]:
    """`steps` steps of SGD (momentum 0.9) on model's parameters, each the mean squared error of forward(x)
    (the model, or the model wrapped by DDP) against a teacher's linear map, x a batch of 16 of this rank's
    own, its inputs scaled from 1 down to 0.03: steady small directions, the ones low-rank compression drops.
    The kit's LEDGER is reset before each step, so it holds the last step's bytes. Returns the loss on 512
    test samples (the same on every rank) after each step."""
    d = model[0].in_features
    g = torch.Generator().manual_seed(0)  # the teacher: the same on every rank
    teacher = torch.randn(d, model[-1].out_features, generator=g).to(launch.device()) / d ** 0.5
    scales = torch.logspace(0, -1.5, d, device=launch.device())
    x_test = torch.randn(512, d, generator=torch.Generator().manual_seed(7)).to(launch.device()) * scales
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(16, d, generator=g).to(launch.device()) * scales
        LEDGER.reset()
        nn.functional.mse_loss(forward(x), x @ teacher).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            losses.append(nn.functional.mse_loss(model(x_test), x_test @ teacher).item())
    return losses
