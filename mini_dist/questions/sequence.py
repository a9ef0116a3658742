"""Splitting the sequence: the figure that answers question 16 (mini_dist/questions/questions.md).

    16. What are context parallelism and Ulysses for?   ring_vs_ulysses   (context_parallel.py, ulysses.py)

It runs on every rank of the world and returns (figure, holds), as `./run.sh ask 16` and tests/test_questions.py
call it: both attentions against F.scaled_dot_product_attention on the whole sequence (kit/references.py), with
the ledgers every context-parallel attention counts in (sequence_layout.SCORES and bytes_sent).
"""
import torch
import torch.distributed as dist

from mini_dist import comm
from mini_dist.context_parallel import ring_attention
from mini_dist.kit import launch, references
from mini_dist.sequence_layout import SCORES, bytes_sent, split_sequence
from mini_dist.ulysses import ulysses_attention


def ring_vs_ulysses(b=1, H=4, S=32, d=8) -> tuple[str, bool]:
    """Question 16, on the ranks of the world: causal ring attention and Ulysses against
    F.scaled_dot_product_attention on the whole sequence, each one's largest score tensor and the bytes each
    rank sent forward, against the formulas."""
    C = dist.get_world_size()
    dev = launch.device()
    K = b * S * H * d * 8
    full = [torch.randn(b, H, S, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(dev)
            for seed in range(4)]  # the same whole sequence on every rank
    diffs = {}
    forward = {}
    peak = {}
    for name, attention in (("ring", ring_attention), ("Ulysses", ulysses_attention)):
        SCORES.reset()
        diffs[name], forward[name], _ = references.against_sdpa(attention, full, True, split_sequence, bytes_sent)
        peak[name] = SCORES.peak_bytes
    worst = comm.all_reduce(torch.tensor([max(diffs.values())], dtype=torch.float64, device=dev),
                            op=dist.ReduceOp.MAX).item()
    whole = b * H * S * S * 8
    figure = (f"S = {S} tokens, {S // C} per rank on C = {C} (zigzag), causal: ring attention and Ulysses = "
              f"scaled_dot_product_attention on the whole sequence to {worst:.0e}; largest score tensor per rank: "
              f"ring {peak['ring']:,} B = 1/{whole // peak['ring']} of the whole S x S, Ulysses {peak['Ulysses']:,} B "
              f"(S x S for H/C heads); bytes each rank sent forward: ring {forward['ring']:,} = 2(C-1)/C |K|, "
              f"Ulysses {forward['Ulysses']:,} = 4(C-1)/C^2 |K|")
    formulas = {"ring": 2 * (C - 1) * K // C, "Ulysses": 4 * (C - 1) * K // C ** 2}
    return figure, worst < 1e-12 and forward == formulas
