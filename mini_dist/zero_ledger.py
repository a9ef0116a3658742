"""What ZeRO saves and what it costs: bytes per rank and bytes sent per step, measured beside the formulas.

Memory per rank of K ranks training N parameters (N/K means the shard S; N counts the padding):

    stage            fp32 Adam (4 + 4 + 8 B)   half params + fp32 master weights (the paper's 2 + 2 + 12 B)
    0 (DDP)          16N                       16N
    1 (ZeRO-1)       8N + 8N/K                 4N + 12N/K
    2 (ZeRO-2)       4N + 12N/K                2N + 14N/K
    3 (ZeRO-3/FSDP)  16N/K                     16N/K

Bytes each rank sends per step: a ring reduce-scatter or all-gather of the flat vector sends (K-1)*S*b
(b bytes per element), and a step takes 2 of them in DDP (the all-reduce), 3 in ZeRO-1 (+ the parameter
all-gather), 2 in ZeRO-2 (reduce-scatter, all-gather): ZeRO-2 moves exactly what DDP moves, not less.
The ledgers read the live tensors' storages (memory) and the kit's wire LEDGER (bytes), never a formula;
native DDP with torch.optim.Adam, measured the same way, holds what stage 0 holds.

    torchrun --standalone --nproc_per_node=4 mini_dist/zero_ledger.py [--widths 19 60 60]

The paper: Rajbhandari et al., ZeRO (SC 2020), Sec. 5 and 7.2.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

if not __package__:  # run as `torchrun mini_dist/zero_ledger.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, models
from mini_dist.kit.wire import LEDGER
from mini_dist.zero import Partition
from mini_dist.zero_optimizer import ZeroOptimizer

PASSES = {0: 2, 1: 3, 2: 2}  # ring passes of (K-1)*S*b bytes per step: reduce-scatter, all-gathers
FORMULAS = {False: ("16N", "8N + 8N/K", "4N + 12N/K"), True: ("16N", "4N + 12N/K", "2N + 14N/K")}
WIDTHS = [19, 60, 60]  # N = 4,860 elements: divisible by K = 1..5, no padding


def memory_formula(stage: int, partition: Partition, param_bytes: int, state_bytes: int) -> dict:
    """The table above with N = Psi and N/K = S: params, grads (whole or shard), state (whole or shard).
    state_bytes per element: 8 for fp32 Adam, 4 for SGD with momentum, +4 for fp32 master weights."""
    psi = partition.padded_numel
    s = partition.shard_size
    return {"params": param_bytes * psi, "grads": param_bytes * (psi if stage < 2 else s),
            "state": state_bytes * (psi if stage == 0 else s)}


def bytes_sent_formula(stage: int, partition: Partition, elem_bytes: int) -> int:
    """Ring bytes one rank sends per step: PASSES[stage] passes of (K-1)*S*b."""
    return PASSES[stage] * (partition.world_size - 1) * partition.shard_size * elem_bytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors: views of one buffer count once, padding too."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(storages.values())


def memory_ledger(params, optimizer) -> dict:
    """Bytes live on this rank by component, measured from the tensors (of a ZeroOptimizer, or of a plain
    optimizer over `params`). 'state' is per-element optimizer state, master weights included; 0-dim
    counters (Adam's step, 4 bytes per stepped tensor) are outside the formulas, reported as 'scalars'."""
    params = list(params)
    inner = optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params]
    if isinstance(optimizer, ZeroOptimizer):
        grads.append(optimizer.grad)
        if optimizer.has_master:
            state.append(optimizer.master)
    return {"params": storage_bytes(params), "grads": storage_bytes(grads),
            "state": storage_bytes(t for t in state if t.dim() > 0),
            "scalars": sum(t.nbytes for t in state if t.dim() == 0)}


def measure_stage(stage: int, dtype=torch.float32, widths=WIDTHS) -> SimpleNamespace:
    """One Adam step of a ZeroOptimizer (ring collectives) on models.mlp(widths), after a first step made
    Adam's state: this rank's memory ledger and bytes sent, each beside its formula."""
    model = models.mlp(widths, dtype).to(launch.device())
    zero = ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage, collectives="ring", lr=1e-2)
    models.random_batch_steps(model, model, zero, 1)
    LEDGER.reset()
    models.random_batch_steps(model, model, zero, 1)  # one step's bytes; the ledger right after it
    b = dtype.itemsize  # bytes per element of params and grads, 4 or 2
    state_bytes = 12 if b == 2 else 8  # fp32 Adam: 8; bf16 params: + 4 of fp32 master weights
    want = memory_formula(stage, zero.partition, b, state_bytes)
    got = memory_ledger(model.parameters(), zero)
    return SimpleNamespace(partition=zero.partition, memory=[got[c] for c in want], formula=list(want.values()),
                           sent=LEDGER.sent, sent_formula=bytes_sent_formula(stage, zero.partition, b))


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--widths", type=int, nargs="+", default=WIDTHS,
                   help="MLP widths; the default's N = 4,860 divides by K = 1..5: no padding")
    return p


def ddp_bytes_per_parameter(widths=WIDTHS) -> float:
    """Native DDP + torch.optim.Adam, fp32, after a step: this rank's bytes (weights, grads, state) / N."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = models.mlp(widths, torch.float32).to(launch.device())
    ddp = DDP(model)
    adam = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    models.random_batch_steps(model, ddp, adam, 1)
    got = memory_ledger(model.parameters(), adam)
    return (got["params"] + got["grads"] + got["state"]) / sum(p.numel() for p in model.parameters())


def demo(args) -> int:
    launch.require(len(args.widths) >= 2 and min(args.widths) >= 1, "--widths: two or more numbers >= 1")
    k = launch.setup().world_size
    exact = True
    same_traffic = True  # ZeRO-2 sends what DDP (stage 0) sends
    for half in (False, True):
        rows = {s: measure_stage(s, torch.bfloat16 if half else torch.float32, args.widths) for s in (0, 1, 2)}
        n = rows[0].partition.numel
        launch.print0(f"\n{'bf16 params + fp32 master Adam' if half else 'fp32 Adam'}, K = {k}, N = {n:,}; bytes per "
                      f"rank (rank 0 shown, every rank checked)\nstage | sent per step = formula    |     params"
                      f"      grads      state | total = formula")
        for stage, r in rows.items():
            exact &= r.memory == r.formula and r.sent == r.sent_formula
            launch.print0(f"{stage:<6}| {r.sent:>10,} B = {PASSES[stage]}(K-1)S*b | {r.memory[0]:>8,} B "
                          f"{r.memory[1]:>8,} B {r.memory[2]:>8,} B | {sum(r.memory):>8,} B = {FORMULAS[half][stage]}"
                          f" = {sum(r.memory) / n:.2f}N")
        same_traffic &= rows[2].sent == rows[0].sent
    ddp = ddp_bytes_per_parameter(args.widths)
    launch.print0(f"\nnative DDP + Adam measures {ddp:.2f}N, as stage 0 does. ZeRO-2 sends what DDP sends, in both "
                  f"tables: its reduce-scatter is half of DDP's all-reduce, its all-gather of the new weights the "
                  f"other half.")
    return launch.conclude("zero_ledger", exact, "memory and bytes sent = the formulas, every stage, fp32 and bf16",
                           same_traffic and ddp == 16, "ZeRO-2 sends what DDP sends; DDP measures 16N")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
