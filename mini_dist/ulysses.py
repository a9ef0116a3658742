"""DeepSpeed-Ulysses: context parallelism by all-to-all, from a split sequence to split heads and back.

Ring attention (context_parallel.py) leaves each rank's S/C queries where they are and sends the keys and
values round the ring. Ulysses (Jacobs et al. 2023) uses instead that attention heads are independent, and
moves the tokens:

    all-to-all   q, k, v [b, H, S/C, d] -> [b, H/C, S, d]   every rank: all S tokens of H/C whole heads
    attention    F.scaled_dot_product_attention, unchanged  (causal: the chunks put in position order first)
    all-to-all   out [b, H/C, S, d] -> [b, H, S/C, d]       back to this rank's tokens, all heads
Backward: the same all-to-alls reversed (dout in; dq, dk, dv back): comm.all_to_all's conjugate.

Bytes sent per rank per layer, |K| = b*S*H*d*e bytes (all of K; e bytes an element): a rank holds |K|/C of
each tensor and an all-to-all keeps 1/C of that, so moving one tensor costs (C-1)/C |K|/C:
    Ulysses   forward 4(C-1)/C |K|/C    q, k, v in, out back       backward the same: dout in; dq, dk, dv back
    ring      forward 2(C-1)/C |K|      K and V round the ring     backward 4(C-1)/C |K|
When each wins: Ulysses sends C/2 times less than the ring forward and C times less backward, and its bytes
per rank shrink as C grows. But C can never exceed the head count (each rank needs H/C whole heads; with
grouped-query attention, the K/V heads), and every all-to-all crosses every link at once, where the ring talks
only to its neighbours and hides each hop behind a tile of compute: the ring scales past H and over slow links.
Scores held per rank: S^2 for each of H/C heads (one process: H heads; ring: (S/C)^2 per head).

    torchrun --standalone --nproc_per_node=4 mini_dist/ulysses.py [--seq 48 --heads 12]

Mirrors DeepSpeed's DistributedAttention (deepspeed/sequence/layer.py).
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import flags, launch, references
from mini_dist.context_parallel import ring_attention
from mini_dist.sequence_layout import (CONTIGUOUS, SCORES, SEQ_DIM, ZIGZAG, bytes_sent, check_inputs, rank_order,
                                       reorder_chunks, split_sequence, to_position_order)

HEAD_DIM = 1  # [batch, heads, seq, head_dim]


def ulysses_attention(q, k, v, causal=False, group=None, layout: str = ZIGZAG):
    """F.scaled_dot_product_attention(q, k, v, is_causal=causal) on the whole sequence, this rank's part of it
    (q, k, v [b, H, S/C, d] as split_sequence cuts them), computed on H/C whole heads over the whole sequence."""
    check_inputs("ulysses_attention", q, k, v, causal, layout, group)
    C = dist.get_world_size(group)
    H = q.shape[HEAD_DIM]
    if H % C:  # every rank raises: check_inputs made sure they all hold the same shape
        raise ValueError(f"ulysses_attention: {H} heads cannot be split over {C} ranks: Ulysses gives each rank "
                         f"H/C whole heads; use a context-parallel size that divides {H}, or ring_attention")
    layout = layout if causal else CONTIGUOUS                  # without the mask the keys' order does not matter
    q, k, v = (comm.all_to_all(t, HEAD_DIM, SEQ_DIM, group) for t in (q, k, v))  # [b, H, S/C, d] -> [b, H/C, S, d]
    q, k, v = (to_position_order(t, C, layout) for t in (q, k, v))  # the chunks in the sequence's order, for the mask
    SCORES.record((*q.shape[:3], k.shape[2]), q.dtype)         # [b, H/C, S, S]: whole rows, for H/C heads
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # [b, H/C, S, d]: my heads, no talking
    out = reorder_chunks(out, rank_order(C, layout))           # back to the ranks' order
    return comm.all_to_all(out, SEQ_DIM, HEAD_DIM, group)      # [b, H/C, S, d] -> [b, H, S/C, d]


# ----------------------------------------------------------------------------- demo


def parser():
    return flags.attention(launch.demo_parser(__doc__))


def demo(args) -> int:
    C = flags.zigzag_ranks(args)
    launch.require(args.heads % C == 0, f"--heads {args.heads} on {C} ranks: use a multiple of {C} (Ulysses "
                                        f"gives each rank H/C whole heads)")
    env = launch.setup()
    full = [torch.randn(args.batch, args.heads, args.seq, args.head_dim, dtype=torch.float64, device=env.device)
            for _ in range(4)]  # q, k, v, dout of the whole sequence, alike on every rank (setup seeds them)
    b, H, S, d = full[0].shape
    K = b * S * H * d * 8
    want = {"Ulysses": (4 * (C - 1) * K // C ** 2,) * 2, "ring": (2 * (C - 1) * K // C, 4 * (C - 1) * K // C)}
    formula = {"Ulysses": "4(C-1)/C^2 / 4(C-1)/C^2 |K|", "ring": "2(C-1)/C / 4(C-1)/C |K|"}
    launch.print0(f"C={C} ranks, b={b} H={H} S={S} d={d}, fp64, |K| = b*S*H*d*8 = {K:,} B\n"
                  f"{'':16}| max |diff| out, dq, dk, dv | bytes each rank sent, fwd / bwd | formula, fwd / bwd")
    worst = 0.0
    ledgers_ok = True
    sent = {}
    peak = {}  # the largest score tensor, without the mask
    for name, attention in (("Ulysses", ulysses_attention), ("ring", ring_attention)):
        for causal in (False, True):
            SCORES.reset()
            diff, fwd, bwd = references.against_sdpa(attention, full, causal, split_sequence, bytes_sent)
            worst = max(worst, diff)
            ledgers_ok = ledgers_ok and (fwd, bwd) == (want[name] if C > 1 else (0, 0))
            sent[name] = fwd, bwd
            peak.setdefault(name, SCORES.peak_bytes)
            launch.print0(f"{name + (' causal' if causal else ''):16}| {diff:27.1e} | {fwd:>15,} / {bwd:<15,}| "
                          f"{formula[name]}")
    if C > 1:
        launch.print0(f"ring / Ulysses bytes: forward {sent['ring'][0] / sent['Ulysses'][0]:g} = C/2, backward "
                      f"{sent['ring'][1] / sent['Ulysses'][1]:g} = C")
    scores_ok = peak == {"Ulysses": b * H // C * S * S * 8, "ring": b * H * (S // C) ** 2 * 8}
    launch.print0(f"largest score tensor per rank, bytes: Ulysses {peak['Ulysses']:,} = b*(H/C)*S^2*8, ring "
                  f"{peak['ring']:,} = b*H*(S/C)^2*8; one process {b * H * S * S * 8:,}")
    return launch.conclude("ulysses", worst < 1e-12, f"= F.scaled_dot_product_attention ({worst:.0e})",
                           ledgers_ok and scores_ok,
                           "bytes = formulas: 4(C-1)/C^2 |K| each way, ring C/2 and C times more")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
