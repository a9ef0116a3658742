"""Sequence layouts: which tokens of one sequence each rank of a context-parallel group holds.

Context parallelism (context_parallel.py, ulysses.py) gives each of C ranks S/C tokens of one sequence. Any
S/C would do for plain attention; under the causal mask, where query i attends to keys 0..i, it matters:

    contiguous   rank r holds positions [r*L, (r+1)*L), L = S/C. Its causal (query, key) pairs:
                 sum over its queries of (position + 1) = r*L^2 + L(L+1)/2: the last rank has about
                 2C-1 times the first's work, and the ring waits for it at every step
    zigzag       cut the sequence into 2C chunks of L = S/2C; rank r holds chunks r and 2C-1-r, an early
                 one and a late one: (r + 2C-1-r)*L^2 + 2*L(L+1)/2 = (2C-1)L^2 + L(L+1) pairs on every rank

A layout is a permutation of the 2C (or C) chunks: put them in the ranks' order (rank 0's chunks, then rank
1's, ...), cut in C equal parts, and part r is rank r's. split_sequence does that (its backward all-gathers
the parts' gradients back in place), gather_sequence is its inverse (an all-gather stacks the parts in the
ranks' order; the inverse permutation puts them back in the sequence's). causal_tiles says which tiles of
(query chunk, key chunk) the mask leaves a rank against another's block; check_inputs is the guard every
context-parallel attention runs first, so that a bad input fails on every rank alike; SCORES and bytes_sent are
the ledgers they all count in (scores computed and held, bytes sent), so that ring and Ulysses compare alike.

    torchrun --standalone --nproc_per_node=4 mini_dist/sequence_layout.py [--seq 16]

Mirrors the head-tail load balancer of torch.distributed.tensor.experimental.context_parallel (zigzag) and
Megatron-LM's context-parallel batch split.
"""
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import launch
from mini_dist.kit.wire import global_rank

SEQ_DIM = 2  # [batch, heads, seq, head_dim], the layout of F.scaled_dot_product_attention
ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)


def chunk_ids(rank: int, C: int, layout: str = ZIGZAG) -> list[int]:
    """contiguous: chunk r of C; zigzag: chunks r and 2C-1-r of 2C (one early, one late)."""
    return [rank, 2 * C - 1 - rank] if layout == ZIGZAG else [rank]


def rank_order(C: int, layout: str) -> list[int]:
    """The chunks of the whole sequence in the order the ranks hold them: rank 0's, then rank 1's, ..."""
    return [c for r in range(C) for c in chunk_ids(r, C, layout)]


def reorder_chunks(x, order, dim: int = SEQ_DIM):
    """Cut x into len(order) equal chunks along dim; chunk order[i] comes i-th."""
    chunks = x.chunk(len(order), dim)
    return torch.cat([chunks[c] for c in order], dim)


def to_position_order(x, C: int, layout: str, dim: int = SEQ_DIM):
    """Chunks in the ranks' order (as an all-gather stacks them) back in the sequence's order."""
    order = rank_order(C, layout)
    return reorder_chunks(x, [order.index(c) for c in range(len(order))], dim)


def split_sequence(x, group=None, layout: str = ZIGZAG, dim: int = SEQ_DIM):
    """This rank's part of a whole sequence (backward: the parts' gradients all-gathered back)."""
    C = dist.get_world_size(group)
    n = len(chunk_ids(0, C, layout)) * C
    if x.shape[dim] == 0 or x.shape[dim] % n:
        raise ValueError(f"sequence length {x.shape[dim]} is not a positive multiple of {n}: the {layout} layout "
                         f"on {C} ranks cuts it into {n} equal chunks. Pad it at the end to a multiple of {n}: "
                         f"causal attention stays exact (no real query sees a later position); without the mask "
                         f"every query would attend to the padding")
    return comm.split_to_tp(reorder_chunks(x, rank_order(C, layout), dim), group, dim)


def gather_sequence(x, group=None, layout: str = ZIGZAG, dim: int = SEQ_DIM):
    """The whole sequence from every rank's part, in position order (backward: keep my part's gradient)."""
    return to_position_order(comm.gather_from_tp(x, group, dim), dist.get_world_size(group), layout, dim)


def causal_pairs(S: int, C: int, layout: str) -> list[int]:
    """The (query, key) pairs the causal mask keeps for each rank's queries: sum of (position + 1)."""
    positions = reorder_chunks(torch.arange(S), rank_order(C, layout), 0).view(C, -1)  # cpu: counting; [C, S/C]
    return (positions + 1).sum(1).tolist()


def causal_tiles(me, src, C, local_len, causal, layout):
    """(query rows, key rows, diagonal?) of the score tiles rank `me` computes against rank src's block;
    under the causal mask a tile is whole (query chunk after key chunk), diagonal (same chunk) or skipped."""
    if not causal:
        return [(slice(None), slice(None), False)]
    mine = chunk_ids(me, C, layout)
    theirs = chunk_ids(src, C, layout)
    L = local_len // len(mine)
    return [(slice(a * L, (a + 1) * L), slice(b * L, (b + 1) * L), qa == kb)
            for a, qa in enumerate(mine) for b, kb in enumerate(theirs) if qa >= kb]


# ----- the guard every context-parallel attention runs first, and the ledgers they count in -----

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def check_inputs(name, q, k, v, causal, layout, group) -> None:
    """Every rank shares its inputs' shapes before anything moves, so a bad input raises the same error on
    every rank (naming the rank at fault) instead of leaving the others waiting in the ring."""
    C = dist.get_world_size(group)
    known = layout in LAYOUTS
    fits = known and q.dim() == 4 and q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype in DTYPES
    mine = torch.tensor([*(q.shape if q.dim() == 4 else [-1] * 4), causal, fits, LAYOUTS.index(layout) if known
                         else -1], device=q.device)
    everyone = mine
    if C > 1:  # raw, not comm's all_gather: a check is not traffic for the byte ledgers
        everyone = mine.new_empty(C * mine.numel())
        dist.all_gather_single(everyone, mine, group=group)
    rows = everyone.view(C, -1).tolist()
    for r, m in enumerate(rows):
        who = global_rank(group, r)
        if not m[5]:
            raise ValueError(f"{name}: rank {who} passed q, k, v that are not all [batch, heads, seq/C, "
                             f"head_dim] of one shape and one dtype of {DTYPES}, or a layout not in {LAYOUTS}")
        if m != rows[0]:
            raise ValueError(f"{name}: ranks disagree: rank {global_rank(group, 0)} has [b, H, S/C, d] = "
                             f"{rows[0][:4]}, causal={bool(rows[0][4])}, {LAYOUTS[rows[0][6]]}; rank {who} has "
                             f"{m[:4]}, causal={bool(m[4])}, {LAYOUTS[m[6]]}: every rank holds an equal part of one "
                             f"sequence (split_sequence cuts it so)")
    if rows[0][2] == 0 or (causal and rows[0][2] % len(chunk_ids(0, C, layout))):
        raise ValueError(f"{name}: local sequence length {rows[0][2]} cannot be the {layout} part of a sequence: "
                         f"it holds {len(chunk_ids(0, C, layout))} equal chunks; cut the sequence with split_sequence")


class ScoreLedger:
    """Attention scores this rank computed (elements per batch and head) and its largest score tensor."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.elements = 0
        self.peak_bytes = 0

    def record(self, shape, dtype) -> None:
        self.elements += shape[-2] * shape[-1]
        self.peak_bytes = max(self.peak_bytes, math.prod(shape) * dtype.itemsize)


SCORES = ScoreLedger()


def bytes_sent(group=None) -> int:
    """Bytes this rank sent since comm.COUNTER.reset(). comm counts an all-gather by its output and a
    reduce-scatter by its input, the whole D, of which each rank sends the (C-1)/C that others keep; ring
    hops and all-to-alls it counts as sent."""
    C = dist.get_world_size(group)
    counted = comm.COUNTER.bytes
    return (counted["ring attention"] + counted["all_to_all"]
            + (counted["all_gather"] + counted["reduce_scatter"]) * (C - 1) // C)


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--seq", type=int, default=16, help="sequence length S (a multiple of 2C: zigzag's chunks)")
    return p


def torch_head_tail(x):
    """x as torch's context_parallel shards a buffer along dim 2 with its head-tail load balancer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    x = x.clone()
    with context_parallel(init_device_mesh(launch.device().type, (dist.get_world_size(),)), buffers=[x],
                          buffer_seq_dims=[SEQ_DIM]):
        return x.clone()


def demo(args) -> int:
    C = launch.env_world_size()
    S = args.seq
    launch.require(S > 0 and S % (2 * C) == 0, f"--seq {S} on {C} ranks: use a positive multiple of 2C = "
                                               f"{2 * C} (the zigzag layout cuts the sequence into 2C chunks)")
    env = launch.setup()
    x = torch.arange(S, dtype=torch.float64, device=env.device).view(1, 1, S, 1).requires_grad_()
    L = {ZIGZAG: S // (2 * C), CONTIGUOUS: S // C}
    want = {ZIGZAG: ([(2 * C - 1) * L[ZIGZAG] ** 2 + L[ZIGZAG] * (L[ZIGZAG] + 1)] * C, "(2C-1)L^2 + L(L+1), L = S/2C"),
            CONTIGUOUS: ([r * L[CONTIGUOUS] ** 2 + L[CONTIGUOUS] * (L[CONTIGUOUS] + 1) // 2 for r in range(C)],
                         "r*L^2 + L(L+1)/2, L = S/C")}
    launch.print0(f"S={S} on C={C} ranks: the positions each rank holds; causal (query, key) pairs per rank")
    inverse = True
    formulas = True
    for layout in LAYOUTS:
        part = split_sequence(x, layout=layout)
        (part * (env.rank + 1)).sum().backward()  # rank r's part gets gradient r + 1, in place
        owner = to_position_order(torch.arange(C).repeat_interleave(S // C) + 1.0, C, layout, 0)  # cpu: expected
        inverse = inverse and torch.equal(gather_sequence(part, layout=layout), x.detach()) and \
            torch.equal(x.grad.flatten().cpu(), owner.double())
        x.grad = None
        held = comm.all_gather(part.detach().flatten().long(), 0).view(C, -1).tolist()
        pairs = causal_pairs(S, C, layout)
        formulas = formulas and pairs == want[layout][0]
        launch.print0(f"  {layout:<11}{' | '.join(' '.join(map(str, p)) for p in held)}\n"
                      f"  {'':<11}pairs {pairs} = {want[layout][1]}")
    same_as_torch = torch.equal(split_sequence(x.detach()), torch_head_tail(x.detach()))
    launch.print0(f"gather(split(x)) = x and split's gradient lands in place: {inverse}; zigzag split = "
                  f"torch context_parallel's head-tail sharding: {same_as_torch}")
    return launch.conclude("sequence_layout", inverse and same_as_torch, "split/gather inverse, = torch head-tail",
                           formulas, f"causal pairs = formulas; zigzag {want[ZIGZAG][0][0]} on every rank")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
