"""Sharding the replicas: the figures that answer questions 7, 8 and 9 (mini_dist/questions/questions.md).

    7. ZeRO-1 to ZeRO-2 to ZeRO-3, memory and bytes        stages_memory_and_traffic  (zero_ledger.py, fsdp_ledger.py)
    8. Why FSDP gathers the same parameters twice           gathers_twice              (fsdp_ledger.py)
    9. FSDP's traffic against DDP's                          traffic_vs_ddp             (fsdp_ledger.py)

Each runs on every rank of the default group and returns (figure, holds), as `./run.sh ask N` and
tests/test_questions.py call it; the measuring is the concepts' own (zero_ledger.measure_stage,
fsdp_ledger.trained, memory_per_rank and ddp_sent), so a figure here cannot drift from its demo.
"""
import torch
import torch.distributed as dist

from mini_dist.fsdp_ledger import ddp_sent, mean_over_ranks, memory_per_rank, trained
from mini_dist.kit import launch, models
from mini_dist.zero_ledger import FORMULAS, WIDTHS, measure_stage


def stages_memory_and_traffic(widths=WIDTHS) -> tuple[str, bool]:
    """Question 7: memory per rank and bytes sent per step of DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP), fp32 Adam,
    measured, with whether each equals its formula."""
    K = dist.get_world_size()
    rows = {s: measure_stage(s, torch.float32, widths) for s in (0, 1, 2)}
    exact = all(r.memory == r.formula and r.sent == r.sent_formula for r in rows.values())
    per_n = {s: sum(r.memory) / r.partition.numel for s, r in rows.items()}
    sent = {s: r.sent for s, r in rows.items()}
    fsdp, adam, fsdp_sent = trained()  # models.block_stack(8, 32, 3): N = 1,800, each Block a unit
    got = memory_per_rank(fsdp, adam)
    N = sum(u.numel for u in fsdp.units)
    S = sum(u.shard_numel for u in fsdp.units)  # N'/K, padding included
    mine = sum(p.numel() for p in fsdp.parameters())  # the real elements of my shards
    per_n[3] = (got["params"] + got["grads"] + got["state"]) / N
    sent[3] = fsdp_sent
    exact &= [got["params"], got["grads"], got["state"]] == [4 * S, 4 * S, 8 * mine] and sent[3] == 3 * (K - 1) * 4 * S
    ddp_like = {1: sent[0], 2: sent[0], 3: 2 * (K - 1) * 4 * S}  # what DDP sends for the same model
    ratio = {s: sent[s] / ddp_like[s] if K > 1 else 1.0 for s in (1, 2, 3)}
    names = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 (FSDP)")
    formulas = (*FORMULAS[False], "16N/K")
    figure = (f"fp32 Adam, K = {K}, bytes per rank: "
              + ", ".join(f"{names[s]} {per_n[s]:.2f}N = {formulas[s]}" for s in range(4))
              + f" (the mixed-precision ZeRO-1 count 4N + 12N/K would be {4 + 12 / K:.2f}N); sent per step vs DDP: "
              + ", ".join(f"{names[s]} {ratio[s]:.2f}x" for s in (1, 2, 3)))
    return figure, exact and ratio[2] == 1.0


def gathers_twice() -> tuple[str, bool]:
    """Question 8: each unit is all-gathered twice a step (forward, then backward), so at most root + 1 unit
    is whole; keeping it after forward saves the second gather and holds every unit."""
    runs = {name: trained(prefetch=False, reshard_after_forward=name == "resharded")[0]
            for name in ("resharded", "kept")}
    units = runs["kept"].units
    full = [u.full.nbytes for u in units]  # the root unit first
    gathers = {k: m.ledger.count("all-gather", units[1].name) for k, m in runs.items()}
    peak = {k: m.ledger.peak for k, m in runs.items()}  # the same on every rank: units are the same size
    figure = (f"per step each of the {len(units) - 1} blocks is all-gathered {gathers['resharded']}x (forward, then "
              f"again for backward): at most root + 1 block whole, {peak['resharded']:,} B; keeping it after "
              f"forward: {gathers['kept']} gather, every unit whole at once, {peak['kept']:,} B "
              f"({peak['kept'] / peak['resharded']:.1f}x)")
    return figure, gathers == {"resharded": 2, "kept": 1} and peak == {"resharded": full[0] + max(full[1:]),
                                                                       "kept": sum(full)}


def traffic_vs_ddp() -> tuple[str, bool]:
    """Question 9: FSDP sends 3(K-1)/K of the weights' bytes per step, 1.5x DDP's 2(K-1)/K: the second
    all-gather."""
    K = dist.get_world_size()
    fsdp = mean_over_ranks(trained()[2])  # bytes sent in its last step
    kept_sent = mean_over_ranks(trained(reshard_after_forward=False)[2])
    plain = models.block_stack(8, 32, 3, torch.float32, launch.device())  # the same model, bare, under DDP
    D = sum(p.nbytes for p in plain.parameters())
    ddp = ddp_sent(plain)
    figure = (f"per rank per step, D = {D:,} B of fp32 weights: DDP's ring all-reduce {ddp:,.0f} B = 2(K-1)/K D; "
              f"FSDP {fsdp:,.0f} B = 3(K-1)/K D (gather for forward, gather again for backward, reduce-scatter): "
              f"{fsdp / max(ddp, 1):.2f}x; keeping the weights after forward: {kept_sent / max(ddp, 1):.2f}x")
    return figure, ddp * K == 2 * (K - 1) * D and 2 * fsdp == 3 * ddp and kept_sent == ddp
