"""Context parallelism: one sequence split across C ranks, attention computed with no rank holding it all.

Attention needs every query to meet every key: the scores are S x S and K, V are as long as the sequence.
Each of C ranks holds S/C tokens of q, k and v ([batch, heads, seq, head_dim], as F.scaled_dot_product_attention
takes them), and keys and values move instead of tokens:

    naive   all-gather K and V, then softmax(q K^T / sqrt(d)) V for my S/C queries: S/C x S scores
    ring    (Liu et al. 2023; Megatron-LM's context parallelism, torch's context_parallel) K/V blocks go round
            the ring, one hop a step, the next block in flight while this one is computed; each block gives a
            partial attention (o_j, lse_j) over its keys, merged online by the log-sum-exps, never the S x S
            scores (the online softmax, Milakov & Gimelshein 2018; FlashAttention's inner loop).
            Backward walks the ring again; dK/dV follow their block one step behind and land home.

Causal masking: split contiguously, rank r needs K/V blocks 0..r and the last rank works C times as hard as
the first, (r+1)(S/C)^2 scores. Zigzag (sequence_layout.py: rank r holds chunks r and 2C-1-r of 2C), with the
tiles the mask zeroes entirely skipped: every rank computes (2C+1)(S/2C)^2.

Bytes each rank sends per layer, |K| = b*S*H*d*e bytes (all of K, or of V; e bytes an element):
    naive   forward 2(C-1)/C |K| (all-gather of K, V)   backward 2(C-1)/C |K| (reduce-scatter of dK, dV)
    ring    forward 2(C-1)/C |K| (K, V: C-1 hops)       backward 4(C-1)/C |K| (K, V again, dK, dV accumulators)
The same bytes forward; the ring buys memory, scores per rank (S/C)^2 a head (causal zigzag (S/2C)^2) against
naive's S^2/C, K/V of two blocks against the whole sequence's, and hops hidden behind tiles of compute.
The other design moves tokens instead of keys: DeepSpeed-Ulysses, mini_dist/ulysses.py (when each wins).

    torchrun --standalone --nproc_per_node=4 mini_dist/context_parallel.py [--seq 48 --heads 12]

Mirrors torch.distributed.tensor.experimental.context_parallel (ring attention, head-tail load balance).
"""
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import flags, launch, references, trace
from mini_dist.kit.wire import isend_irecv, wait
from mini_dist.sequence_layout import (CONTIGUOUS, LAYOUTS, SCORES, SEQ_DIM, ZIGZAG, bytes_sent, causal_tiles,
                                       check_inputs, rank_order, reorder_chunks, split_sequence)


# ----- naive: gather all of K and V -----

def allgather_attention(q, k, v, causal=False, group=None, layout: str = ZIGZAG):
    """softmax(q K^T / sqrt(d)) V of my queries q [b, H, S/C, d] against the whole, gathered K and V."""
    check_inputs("allgather_attention", q, k, v, causal, layout, group)
    C = dist.get_world_size(group)
    me = dist.get_rank(group)
    k = comm.gather_from_sp(k, group, SEQ_DIM)                       # [b, H, S, d]; backward reduce-scatters dK
    v = comm.gather_from_sp(v, group, SEQ_DIM)                       # [b, H, S, d]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])             # [b, H, S/C, S]: my rows of the scores
    if causal:  # the position of each gathered token; my queries are the me-th S/C of them
        where = reorder_chunks(torch.arange(k.shape[2], device=q.device), rank_order(C, layout), 0)
        s = s.masked_fill(where.view(C, -1)[me][:, None] < where[None, :], -math.inf)
    SCORES.record(s.shape, s.dtype)
    return s.softmax(-1) @ v                                          # [b, H, S/C, S] @ [b, H, S, d]


# ----- ring attention: K/V blocks rotate, partial results merged by log-sum-exp. Over the naive version it buys
# memory (two K/V blocks and one S/C x S/C score tile, never S/C x S) and overlap (a hop travels during a tile)

def _ring_pass(send, group):
    """Start sending `send` to the next rank and receiving the previous rank's; (buffer, posted) to wait on. One
    batch (the kit's wire): under NCCL a receive queued ahead of the send its neighbour waits for never ends."""
    me = dist.get_rank(group)
    C = dist.get_world_size(group)
    recv = torch.empty_like(send)
    return recv, isend_irecv(send, (me + 1) % C, recv, (me - 1) % C, group, "ring attention", "ring attention")


def _arrived(pending):
    """Wait for a hop that _ring_pass started; the block it brought."""
    recv, posted = pending
    for message in posted:
        wait(message)
    return recv


def _scores(q, k, diagonal):
    """q K^T / sqrt(d) of one tile, the mask applied when the tile is a chunk against itself."""
    s = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)    # [b, H, Lq, d] @ [b, H, d, Lk]: one tile, never S x S
    if diagonal:                                               # one chunk against itself: query i sees keys <= i
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


def attend(q, k, v, diagonal):
    """Attention of q over these keys only, and each query's log-sum-exp of its scores."""
    s = _scores(q, k, diagonal)
    SCORES.record(s.shape, s.dtype)
    m = s.amax(-1, keepdim=True)                               # [b, H, Lq, 1]; every row sees a key
    p = s.sub_(m).exp_()                                       # in place: the tile is used once
    total = p.sum(-1, keepdim=True)
    return (p @ v).div_(total), m + total.log()               # [b, H, Lq, Lk] @ [b, H, Lk, d]; [b, H, Lq, 1]


def merge(out, lse, block_out, block_lse):
    """Online softmax: attention over keys A (out, lse) and over keys B (block_out, block_lse) -> attention
    over A and B, and its log-sum-exp. out [b, H, Lq, d], lse [b, H, Lq, 1]; lse = -inf: no keys yet."""
    # exercise: return (attention over A and B [b, H, Lq, d], its log-sum-exp [b, H, Lq, 1]) for any lse: -inf (no
    #   keys yet), or as large or small as scores make it (e^lse overflows fp64 past 709). torch.exp, log, maximum
    m = torch.maximum(lse, block_lse)                          # the running max: every exponent below is <= 0
    new = m + ((lse - m).exp() + (block_lse - m).exp()).log()
    return (lse - new).exp() * out + (block_lse - new).exp() * block_out, new
    # end exercise


def attend_backward(q, k, v, dout, lse, delta, diagonal):
    """One tile's share of dq, dk, dv; the probabilities are rebuilt from the forward's lse, not stored."""
    p = _scores(q, k, diagonal).sub_(lse).exp_()               # [b, H, Lq, Lk]: exactly the forward's weights
    ds = (dout @ v.transpose(-2, -1)).sub_(delta).mul_(p)    # softmax backward: p (dp - sum_j p dp)
    scale = 1 / math.sqrt(q.shape[-1])
    return (ds @ k).mul_(scale), (ds.transpose(-2, -1) @ q).mul_(scale), p.transpose(-2, -1) @ dout


def _ring_forward(q, k, v, causal, layout, group):
    """C steps: attend to the K/V block held, merge it in, while the next block travels."""
    me = dist.get_rank(group)
    C = dist.get_world_size(group)
    kv = torch.stack([k, v])                                   # one message a hop: [2, b, H, S/C, d]
    out = torch.zeros_like(q)                                  # [b, H, S/C, d]
    lse = q.new_full((*q.shape[:3], 1), -math.inf)             # [b, H, S/C, 1]: no keys yet
    for step in range(C):                                      # at step s I hold rank (me - s)'s block
        pending = _ring_pass(kv, group) if step < C - 1 else None  # the next block travels meanwhile
        block_k, block_v = kv
        for rows, cols, diagonal in causal_tiles(me, (me - step) % C, C, q.shape[2], causal, layout):
            block_out, block_lse = attend(q[:, :, rows], block_k[:, :, cols], block_v[:, :, cols], diagonal)
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        kv = _arrived(pending) if pending else kv
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, causal, layout, group):
    """1. delta_i = dout_i . out_i, the softmax backward's row term, once.
    2. Send my K/V block on round the ring, as the forward did.
    3. C-1 steps: take block me-step, pass it on, compute its tiles' share of dq (kept here) and of its
       dK/dV; add the accumulator of that block that the previous rank sent, and send the sum to the
       next rank, which computes that block at the next step.
    4. My own block last: my share, plus its accumulator, home after C-1 hops with every other rank's."""
    me = dist.get_rank(group)
    C = dist.get_world_size(group)
    delta = (dout * out).sum(-1, keepdim=True)                 # 1. sum_j p_ij dp_ij = dout_i . out_i
    dq = torch.zeros_like(q)

    def share(src, kv):
        """My tiles against rank src's block: their dq added here; their dK, dV returned as one [2, ...]."""
        block_k, block_v = kv
        dkv = torch.zeros_like(kv)
        dk, dv = dkv                                           # views: adding into them adds into dkv
        for rows, cols, diagonal in causal_tiles(me, src, C, q.shape[2], causal, layout):
            dq_tile, dk_tile, dv_tile = attend_backward(q[:, :, rows], block_k[:, :, cols], block_v[:, :, cols],
                                                        dout[:, :, rows], lse[:, :, rows], delta[:, :, rows], diagonal)
            dq[:, :, rows] += dq_tile
            dk[:, :, cols] += dk_tile
            dv[:, :, cols] += dv_tile
        return dkv

    own = torch.stack([k, v])
    pending = _ring_pass(own, group) if C > 1 else None       # 2.
    accumulator = None
    for step in range(1, C):                                   # 3.
        kv = _arrived(pending)                                 # block of rank me - step
        pending = _ring_pass(kv, group) if step < C - 1 else None
        dkv = share((me - step) % C, kv)
        if accumulator:
            dkv += _arrived(accumulator)
        accumulator = _ring_pass(dkv, group)
    dkv = share(me, own)                                       # 4.
    if accumulator:
        dkv += _arrived(accumulator)
    dk, dv = dkv
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group):
        out, lse = _ring_forward(q, k, v, causal, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = causal, layout, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, layout, group = ctx.args
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout.contiguous(), causal, layout, group)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, causal=False, group=None, layout: str = ZIGZAG):
    """F.scaled_dot_product_attention(q, k, v, is_causal=causal) on the whole sequence, this rank's part of it:
    q, k, v [b, H, S/C, d] are this rank's tokens (split_sequence), and so is the output."""
    check_inputs("ring_attention", q, k, v, causal, layout, group)
    return RingAttention.apply(q, k, v, causal, layout, group)


# ----------------------------------------------------------------------------- demo


def parser():
    return flags.attention(launch.demo_parser(__doc__))


def rotation(full, layout=ZIGZAG) -> list[list[int]]:
    """The ring as it ran, from its trace (kit/trace.py): [rank][step] = whose K/V block that rank attended to at
    that forward step: its own, then each step the block that the message it received carried."""
    with trace.recording() as records:
        ring_attention(*(split_sequence(t, layout=layout) for t in full[:3]))
    got = trace.received(trace.everyone(records))  # [rank][k]: (sender, its send, which send) of message k
    held = [[r] for r in range(len(got))]
    for step in range(len(got) - 1):
        for r, messages in got.items():
            sender, _, sent_at = messages[step]
            held[r].append(held[sender][sent_at])  # a rank sends at step s the block it holds at step s
    return held


def demo(args) -> int:
    C = flags.zigzag_ranks(args)
    env = launch.setup()
    full = [torch.randn(args.batch, args.heads, args.seq, args.head_dim, dtype=torch.float64, device=env.device)
            for _ in range(4)]  # q, k, v, dout of the whole sequence, alike on every rank (setup seeds them)
    b, H, S, d = full[0].shape
    K = b * S * H * d * 8
    sent = 2 * (C - 1) * K // C  # bytes each rank sends of K and V: every block but its own
    want = {"naive": (sent, sent), "ring": (sent, 2 * sent)}
    launch.print0(f"C={C} ranks, b={b} H={H} S={S} d={d}, fp64, |K| = b*S*H*d*8 = {K:,} B\n"
                  f"{'':13}| max |diff| out, dq, dk, dv | bytes each rank sent, fwd / bwd | formula, fwd / bwd")
    worst = 0.0
    ledgers_ok = True
    peak = {}  # the largest score tensor, without the mask (whole tiles)
    for name, attention in (("naive", allgather_attention), ("ring", ring_attention)):
        for causal in (False, True):
            SCORES.reset()
            diff, fwd, bwd = references.against_sdpa(attention, full, causal, split_sequence, bytes_sent)
            worst = max(worst, diff)
            ledgers_ok = ledgers_ok and (fwd, bwd) == want[name]
            peak.setdefault(name, SCORES.peak_bytes)
            launch.print0(f"{name + (' causal' if causal else ''):13}| {diff:27.1e} | {fwd:>15,} / {bwd:<15,}| "
                          f"2(C-1)/C / {2 if name == 'naive' else 4}(C-1)/C |K|")
    launch.print0(f"largest score tensor per rank, bytes: ring {peak['ring']:,} = b*H*(S/C)^2*8, naive "
                  f"{peak['naive']:,} = b*H*S^2/C*8; one process {b * H * S * S * 8:,}")
    held = rotation(full)
    launch.print0("ring rotation, from the trace: whose K/V block each rank attended to at each forward step (each "
                  "step passes it on to rank r+1)\n       " + "".join(f"{f'step {s}':>8}" for s in range(C)) +
                  "".join(f"\nrank {r:<2}" + "".join(f"{f'K/V {j}':>8}" for j in row) for r, row in enumerate(held)))
    work = {}  # causal ring: scores computed per rank and head, each layout
    for layout in LAYOUTS:
        SCORES.reset()
        ring_attention(*(split_sequence(t, layout=layout) for t in full[:3]), causal=True, layout=layout)
        work[layout] = comm.all_gather(torch.tensor([SCORES.elements], device=env.device), 0).tolist()
    balanced = work[CONTIGUOUS] == [(r + 1) * (S // C) ** 2 for r in range(C)] and \
        work[ZIGZAG] == [(2 * C + 1) * (S // C // 2) ** 2] * C
    launch.print0(f"causal ring, scores computed per rank and head (elements): contiguous {work[CONTIGUOUS]} = "
                  f"(r+1)(S/C)^2, zigzag {work[ZIGZAG]} = (2C+1)(S/2C)^2")
    return launch.conclude("context_parallel", worst < 1e-12, f"= F.scaled_dot_product_attention ({worst:.0e})",
                           ledgers_ok and balanced and held == [[(r - s) % C for s in range(C)] for r in range(C)],
                           f"bytes = formulas; K/V rotate one rank a step; zigzag work {work[ZIGZAG][0]} on every rank")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
