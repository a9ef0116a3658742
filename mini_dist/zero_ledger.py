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
The ledgers read the live tensors' storages (memory) and the kit's wire LEDGER (bytes), never a formula.

    torchrun --standalone --nproc_per_node=4 mini_dist/zero_ledger.py [--widths 19 60 60]

The paper: Rajbhandari et al., ZeRO (SC 2020), Sec. 5 and 7.2.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/zero_ledger.py`: Python put mini_dist/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import fsdp_ledger
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
    psi, s = partition.padded_numel, partition.shard_size
    return {"params": param_bytes * psi, "grads": param_bytes * (psi if stage < 2 else s),
            "state": state_bytes * (psi if stage == 0 else s)}


def bytes_sent_formula(stage: int, partition: Partition, elem_bytes: int) -> int:
    """Ring bytes one rank sends per step: PASSES[stage] passes of (K-1)*S*b."""
    return PASSES[stage] * (partition.world_size - 1) * partition.shard_size * elem_bytes


def _storage_bytes(tensors) -> int:
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
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
            "state": _storage_bytes(t for t in state if t.dim() > 0),
            "scalars": sum(t.nbytes for t in state if t.dim() == 0)}


def measure_stage(stage: int, dtype=torch.float32, widths=WIDTHS) -> SimpleNamespace:
    """One Adam step of a ZeroOptimizer (ring collectives) on models.mlp(widths), after a first step made
    Adam's state: this rank's memory ledger and bytes sent, each beside its formula."""
    model = models.mlp(widths, dtype).to(launch.device())
    zero = ZeroOptimizer(model.named_parameters(), torch.optim.Adam, stage=stage, collectives="ring", lr=1e-2)
    models.random_batch_steps(model, model, zero, 1)
    LEDGER.reset()
    models.random_batch_steps(model, model, zero, 1)  # one step's bytes; the ledger right after it
    b, state_bytes = (2, 12) if dtype.itemsize == 2 else (4, 8)  # 12 = fp32 master 4 + Adam 8
    want = memory_formula(stage, zero.partition, b, state_bytes)
    got = memory_ledger(model.parameters(), zero)
    return SimpleNamespace(partition=zero.partition, memory=[got[c] for c in want], formula=list(want.values()),
                           sent=LEDGER.sent, sent_formula=bytes_sent_formula(stage, zero.partition, b))


def ddp_bytes_per_parameter(widths=WIDTHS) -> float:
    """Native DDP + torch.optim.Adam, fp32, after a step: this rank's bytes (weights, grads, state) / N."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = models.mlp(widths, torch.float32).to(launch.device())
    ddp = DDP(model)
    adam = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    models.random_batch_steps(model, ddp, adam, 1)
    got = memory_ledger(model.parameters(), adam)
    return (got["params"] + got["grads"] + got["state"]) / sum(p.numel() for p in model.parameters())


def stages_memory_and_traffic(widths=WIDTHS) -> tuple[str, bool]:
    """Memory per rank and bytes sent per step of DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP), fp32 Adam,
    measured, with whether each equals its formula. Collective: every rank of the default group calls it."""
    K, rows = dist.get_world_size(), {s: measure_stage(s, torch.float32, widths) for s in (0, 1, 2)}
    exact = all(r.memory == r.formula and r.sent == r.sent_formula for r in rows.values())
    per_n = {s: sum(r.memory) / r.partition.numel for s, r in rows.items()}
    sent = {s: r.sent for s, r in rows.items()}
    fsdp, adam = fsdp_ledger.trained()  # models.block_stack(8, 32, 3): N = 1,800, each Block a unit
    got = fsdp_ledger.memory_per_rank(fsdp, adam)
    N, S = sum(u.numel for u in fsdp.units), sum(u.shard_numel for u in fsdp.units)  # S: N'/K, padding included
    mine = sum(p.numel() for p in fsdp.parameters())  # the real elements of my shards
    per_n[3], sent[3] = (got["params"] + got["grads"] + got["state"]) / N, fsdp.ledger.sent
    exact &= [got["params"], got["grads"], got["state"]] == [4 * S, 4 * S, 8 * mine] and sent[3] == 3 * (K - 1) * 4 * S
    ratio = {s: sent[s] / (sent[0] if s < 3 else 2 * (K - 1) * 4 * S) if K > 1 else 1.0 for s in (1, 2, 3)}
    names, formulas = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 (FSDP)"), (*FORMULAS[False], "16N/K")
    return (f"fp32 Adam, K = {K}, bytes per rank: " + ", ".join(f"{names[s]} {per_n[s]:.2f}N = {formulas[s]}"
                                                               for s in range(4))
            + f" (the mixed-precision ZeRO-1 count 4N + 12N/K would be {4 + 12 / K:.2f}N); sent per step vs DDP: "
            + ", ".join(f"{names[s]} {ratio[s]:.2f}x" for s in (1, 2, 3))), exact and ratio[2] == 1.0


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--widths", type=int, nargs="+", default=WIDTHS,
                   help="MLP widths; the default's N = 4,860 divides by K = 1..5: no padding")
    return p


def demo(args) -> int:
    launch.require(len(args.widths) >= 2 and min(args.widths) >= 1, "--widths: two or more numbers >= 1")
    k, exact = launch.setup().world_size, True
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
    ddp = ddp_bytes_per_parameter(args.widths)
    figure, holds = stages_memory_and_traffic(args.widths)
    launch.print0(f"\nnative DDP + Adam measures {ddp:.2f}N, as stage 0 does.\n{figure}")
    return launch.conclude("zero_ledger", exact, "memory and bytes sent = the formulas, every stage, fp32 and bf16",
                           holds and ddp == 16, "ZeRO-2 sends what DDP sends; DDP measures 16N")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
