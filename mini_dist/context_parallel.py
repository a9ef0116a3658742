"""Context parallelism: one sequence split across C ranks, attention computed with no rank holding it all.

Attention needs every query to meet every key: the scores are S x S and K, V are as long as the sequence.
Context parallelism gives each of C ranks S/C tokens of q, k and v ([batch, heads, seq, head_dim], the
layout of F.scaled_dot_product_attention) and moves keys and values instead of tokens:

    naive   all-gather K and V, attend my S/C queries to all S keys: S tokens of K/V, S/C x S scores
    ring    (Liu et al. 2023; Megatron-LM's context parallelism, torch's context_parallel) K/V blocks go
            round the ring, one hop a step, the next block in flight (isend/irecv) while this one is
            computed; each block gives a partial attention (o_j, lse_j) over its keys, merged online,
            m = max(lse, lse_j), lse' = m + log(e^(lse-m) + e^(lse_j-m)), o' = e^(lse-lse') o + e^(lse_j-lse') o_j,
            so a rank holds two K/V blocks and one S/C x S/C tile of scores at a time. Backward walks
            the ring again; dK/dV follow their block one step behind and land home after C-1 hops.

Causal masking: split contiguously, rank r needs K/V blocks 0..r and the last rank works C times as hard as
the first, (r+1)(S/C)^2 scores. Zigzag (sequence_layout.py: rank r holds chunks r and 2C-1-r of 2C), with the
tiles the mask zeroes entirely skipped: every rank computes (2C+1)(S/2C)^2.

Bytes sent per rank per layer, |K| = b*S*H*d*e bytes (all of K, or of V; e bytes an element):
    ring    forward 2(C-1)/C |K|      K and V blocks, C-1 hops
            backward 4(C-1)/C |K|     K and V again, and their dK, dV accumulators
    naive   forward all-gather of 2|K| (each rank sends (C-1)/C of it), backward reduce-scatter of 2|K|
Scores held per rank: ring (S/C)^2 per head (causal zigzag (S/2C)^2), naive S^2/C, one process S^2.
The other design moves tokens instead of keys: DeepSpeed-Ulysses, mini_dist/ulysses.py (when each wins).

    torchrun --standalone --nproc_per_node=4 mini_dist/context_parallel.py [--seq 48 --heads 12]

Mirrors torch.distributed.tensor.experimental.context_parallel (ring attention, head-tail load balance).
"""
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import launch
from mini_dist.sequence_layout import (CONTIGUOUS, LAYOUTS, SEQ_DIM, ZIGZAG, chunk_ids, rank_order,
                                       reorder_chunks, split_sequence)

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass
class ScoreLedger:
    """Attention scores this rank computed (elements per batch and head) and its largest score tensor."""
    elements: int = 0
    peak_bytes: int = 0

    def reset(self) -> None:
        self.elements = self.peak_bytes = 0

    def record(self, shape, dtype) -> None:
        self.elements += shape[-2] * shape[-1]
        self.peak_bytes = max(self.peak_bytes, math.prod(shape) * dtype.itemsize)


SCORES = ScoreLedger()


def check_inputs(name, q, k, v, causal, layout, group) -> None:
    """Every rank shares its inputs' shapes before anything moves, so a bad input raises the same error on
    every rank (naming the rank at fault) instead of leaving the others waiting in the ring."""
    C, known = dist.get_world_size(group), layout in LAYOUTS
    fits = known and q.dim() == 4 and q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype in DTYPES
    mine = torch.tensor([*(q.shape if q.dim() == 4 else [-1] * 4), causal, fits, LAYOUTS.index(layout) if known
                         else -1], device=q.device)
    everyone = mine
    if C > 1:  # raw, not comm's all_gather: a check is not traffic for the byte ledgers
        everyone = mine.new_empty(C * mine.numel())
        dist.all_gather_single(everyone, mine, group=group)
    rows = everyone.view(C, -1).tolist()
    rank = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
    for r, m in enumerate(rows):
        if not m[5]:
            raise ValueError(f"{name}: rank {rank(r)} passed q, k, v that are not all [batch, heads, seq/C, "
                             f"head_dim] of one shape and one dtype of {DTYPES}, or a layout not in {LAYOUTS}")
        if m != rows[0]:
            raise ValueError(f"{name}: ranks disagree: rank {rank(0)} has [b, H, S/C, d] = {rows[0][:4]}, "
                             f"causal={bool(rows[0][4])}, {LAYOUTS[rows[0][6]]}; rank {rank(r)} has {m[:4]}, "
                             f"causal={bool(m[4])}, {LAYOUTS[m[6]]}: every rank holds an equal part of one "
                             f"sequence (split_sequence cuts it so)")
    if rows[0][2] == 0 or (causal and rows[0][2] % len(chunk_ids(0, C, layout))):
        raise ValueError(f"{name}: local sequence length {rows[0][2]} cannot be the {layout} part of a sequence: "
                         f"it holds {len(chunk_ids(0, C, layout))} equal chunks; cut the sequence with split_sequence")


# ----- naive: gather all of K and V -----

def allgather_attention(q, k, v, causal=False, group=None, layout: str = ZIGZAG):
    """F.scaled_dot_product_attention of my queries against the whole, gathered K and V."""
    check_inputs("allgather_attention", q, k, v, causal, layout, group)
    C, me = dist.get_world_size(group), dist.get_rank(group)
    k, v = (comm.gather_from_sp(t, group, SEQ_DIM) for t in (k, v))  # [b, H, S, d]; backward reduce-scatters
    mask = None
    if causal:  # the position of each gathered token; my queries are the me-th S/C of them
        where = reorder_chunks(torch.arange(k.shape[2], device=q.device), rank_order(C, layout), 0)
        mask = where.view(C, -1)[me][:, None] >= where[None, :]
    SCORES.record((*q.shape[:3], k.shape[2]), q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ----- ring attention -----

def _ring_pass(send, group):
    """Start sending `send` to the next rank and receiving the previous rank's; (buffer, works) to wait on."""
    me, C = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group=group, group_peer=(me + 1) % C),
                                    dist.P2POp(dist.irecv, recv, group=group, group_peer=(me - 1) % C)])
    comm.COUNTER.record("ring", send.nbytes)
    launch.trace(f"ring: {send.nbytes} B to group rank {(me + 1) % C}, receiving from {(me - 1) % C}")
    return recv, works


def _arrived(pending):
    recv, works = pending
    for work in works:
        work.wait()
    return recv


def _tiles(me, src, C, local_len, causal, layout):
    """(query rows, key rows, diagonal?) of the score tiles rank `me` computes against rank src's block;
    under the causal mask a tile is whole (query chunk after key chunk), diagonal (same chunk) or skipped."""
    if not causal:
        return [(slice(None), slice(None), False)]
    mine, theirs = chunk_ids(me, C, layout), chunk_ids(src, C, layout)
    L = local_len // len(mine)
    return [(slice(a * L, (a + 1) * L), slice(b * L, (b + 1) * L), qa == kb)
            for a, qa in enumerate(mine) for b, kb in enumerate(theirs) if qa >= kb]


def _scores(q, k, diagonal):
    s = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)    # [b, H, Lq, Lk]: one tile, never S x S
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
    return (p @ v).div_(total), m + total.log()


def merge(out, lse, block_out, block_lse):
    """Online softmax: attention over keys A and over keys B -> attention over A and B."""
    m = torch.maximum(lse, block_lse)                          # the running max: every exponent below is <= 0
    new = m + ((lse - m).exp() + (block_lse - m).exp()).log()
    return (lse - new).exp() * out + (block_lse - new).exp() * block_out, new


def attend_backward(q, k, v, dout, lse, delta, diagonal):
    """One tile's share of dq, dk, dv; the probabilities are rebuilt from the forward's lse, not stored."""
    p = _scores(q, k, diagonal).sub_(lse).exp_()               # exactly the forward's softmax weights
    ds = (dout @ v.transpose(-2, -1)).sub_(delta).mul_(p)    # softmax backward: p (dp - sum_j p dp)
    scale = 1 / math.sqrt(q.shape[-1])
    return (ds @ k).mul_(scale), (ds.transpose(-2, -1) @ q).mul_(scale), p.transpose(-2, -1) @ dout


def _ring_forward(q, k, v, causal, layout, group):
    me, C = dist.get_rank(group), dist.get_world_size(group)
    kv = torch.stack([k, v])                                   # one message a hop: [2, b, H, S/C, d]
    out, lse = torch.zeros_like(q), q.new_full((*q.shape[:3], 1), -math.inf)
    for step in range(C):
        pending = _ring_pass(kv, group) if step < C - 1 else None  # the next block travels meanwhile
        for rows, cols, diagonal in _tiles(me, (me - step) % C, C, q.shape[2], causal, layout):
            o, l = attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], diagonal)
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
        kv = _arrived(pending) if pending else kv
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, causal, layout, group):
    """The other ranks' blocks first, in forward's order, my own last: the dK/dV accumulator of block j is
    started by rank j+1, passed on with each hop, and reaches rank j just as rank j adds its own share."""
    me, C = dist.get_rank(group), dist.get_world_size(group)
    delta = (dout * out).sum(-1, keepdim=True)                 # sum_j p_ij dp_ij = dout_i . out_i
    dq = torch.zeros_like(q)

    def share(src, kv):
        dkv = torch.zeros_like(kv)
        for rows, cols, diagonal in _tiles(me, src, C, q.shape[2], causal, layout):
            dq_t, dk_t, dv_t = attend_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                               dout[:, :, rows], lse[:, :, rows], delta[:, :, rows], diagonal)
            dq[:, :, rows] += dq_t
            dkv[0][:, :, cols] += dk_t
            dkv[1][:, :, cols] += dv_t
        return dkv

    own = torch.stack([k, v])
    pending, accumulator, kv = (_ring_pass(own, group) if C > 1 else None), None, own
    for step in range(1, C):
        kv = _arrived(pending)                                 # block of rank me - step
        pending = _ring_pass(kv, group) if step < C - 1 else None
        dkv = share((me - step) % C, kv)
        if accumulator:
            dkv += _arrived(accumulator)
        accumulator = _ring_pass(dkv, group)                   # the next rank computes this block next
    dkv = share(me, own)
    if accumulator:
        dkv += _arrived(accumulator)                           # every other rank's share of my block
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, layout, group):
        out, lse = _ring_forward(q, k, v, causal, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = causal, layout, group
        return out

    @staticmethod
    def backward(ctx, dout):
        return *_ring_backward(*ctx.saved_tensors, dout.contiguous(), *ctx.args), None, None, None


def ring_attention(q, k, v, causal=False, group=None, layout: str = ZIGZAG):
    """F.scaled_dot_product_attention(q, k, v, is_causal=causal) on the whole sequence, this rank's part of it:
    q, k, v [b, H, S/C, d] are this rank's tokens (split_sequence), and so is the output."""
    check_inputs("ring_attention", q, k, v, causal, layout, group)
    return RingAttention.apply(q, k, v, causal, layout, group)


# ----- demo -----

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--seq", type=int, default=48, help="sequence length S (a multiple of 2C: zigzag's chunks)")
    p.add_argument("--heads", type=int, default=12, help="attention heads H")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension d")
    p.add_argument("--batch", type=int, default=2, help="sequences in the batch")
    return p


def against_sdpa(attention, full, causal, layout=ZIGZAG):
    """attention forward and backward on this rank's part of full = (q, k, v, dout): the max |difference| from
    F.scaled_dot_product_attention on the whole sequence over out, dq, dk, dv; bytes sent forward, backward.
    SCORES holds the scores this call computed."""
    whole = [t.clone().requires_grad_() for t in full[:3]]
    ref = F.scaled_dot_product_attention(*whole, is_causal=causal)
    ref.backward(full[3])
    mine = [split_sequence(t, layout=layout).requires_grad_() for t in full[:3]]
    comm.COUNTER.reset()
    SCORES.reset()
    out = attention(*mine, causal=causal, layout=layout)
    forward = sum(comm.COUNTER.bytes.values())
    comm.COUNTER.reset()
    out.backward(split_sequence(full[3], layout=layout))
    pairs = zip([out] + [t.grad for t in mine], [ref.detach()] + [t.grad for t in whole])
    return max((a - split_sequence(b, layout=layout)).abs().max().item() for a, b in pairs), forward, \
        sum(comm.COUNTER.bytes.values())


def demo(args) -> int:
    C = launch.env_world_size()
    launch.require(min(args.seq, args.heads, args.head_dim, args.batch) > 0, "sizes must be positive")
    launch.require(args.seq % (2 * C) == 0, f"--seq {args.seq} on {C} ranks: use a multiple of 2C = {2 * C} "
                                            f"(the zigzag layout cuts the sequence into 2C equal chunks)")
    env = launch.setup()
    b, H, S, d = args.batch, args.heads, args.seq, args.head_dim
    full = [torch.randn(b, H, S, d, dtype=torch.float64, device=env.device) for _ in range(4)]  # alike on all
    K = b * S * H * d * 8
    want = {"naive": (2 * K, 2 * K), "ring": (2 * (C - 1) * K // C, 4 * (C - 1) * K // C)}
    launch.print0(f"C={C} ranks, b={b} H={H} S={S} d={d}, fp64, |K| = b*S*H*d*8 = {K} B\n"
                  f"{'':13}| max |diff| out, dq, dk, dv | bytes fwd / bwd per rank | formula")
    worst, ledgers_ok, peak = 0.0, True, {}
    for name, attention in (("naive", allgather_attention), ("ring", ring_attention)):
        for causal in (False, True):
            diff, fwd, bwd = against_sdpa(attention, full, causal)
            formula = want[name] if C > 1 else (0, 0)
            worst, ledgers_ok = max(worst, diff), ledgers_ok and (fwd, bwd) == formula
            peak.setdefault(name, SCORES.peak_bytes)  # non-causal: whole tiles
            launch.print0(f"{name + ' causal' * causal:13}| {diff:27.1e} | {fwd:>10} / {bwd:<11} | "
                          f"{formula[0]} / {formula[1]}")
    launch.print0(f"peak score bytes per rank: ring {peak['ring']} = b*H*(S/C)^2*8, naive {peak['naive']} = "
                  f"b*H*S^2/C*8; one process {b * H * S * S * 8}")
    work = {}
    for layout in LAYOUTS:
        against_sdpa(ring_attention, full, True, layout)
        work[layout] = comm.all_gather(torch.tensor([SCORES.elements], device=env.device), 0).tolist()
    balanced = work[CONTIGUOUS] == [(r + 1) * (S // C) ** 2 for r in range(C)] and \
        work[ZIGZAG] == [(2 * C + 1) * (S // C // 2) ** 2] * C
    launch.print0(f"causal ring, scores per rank and head: contiguous {work[CONTIGUOUS]} = (r+1)(S/C)^2, "
                  f"zigzag {work[ZIGZAG]} = (2C+1)(S/2C)^2")
    return launch.conclude("context_parallel", worst < 1e-12, f"= F.scaled_dot_product_attention ({worst:.0e})",
                           ledgers_ok and balanced, f"bytes = formulas; zigzag work {work[ZIGZAG][0]} on every rank")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
