"""Ring collectives from point-to-point sends: all-reduce = reduce-scatter + all-gather.

N ranks stand in a ring; each cuts its D-byte tensor into N chunks. Reduce-scatter: in each of N-1
steps every rank sends one chunk to its neighbour and adds the chunk it receives into its own copy;
afterwards rank r holds chunk r reduced over all ranks. All-gather: N-1 more steps pass the finished
chunks around until everyone has all of them. Each rank sends

    reduce-scatter (N-1)/N * D  +  all-gather (N-1)/N * D  =  2(N-1)/N * D  bytes,

whatever N is: adding ranks does not add traffic per rank, and every link is busy at every step. The
naive way (everyone sends to a root, the root reduces and sends the result back) makes the root send
and receive (N-1) * D bytes, growing with N (Patarasuk & Yuan 2009; Baidu's ring all-reduce, 2017).

Which rank starts which chunk is not arbitrary here: we send to the LEFT neighbour (r -> r-1) and give
rank c chunk c, the layout gloo uses (chunk_bounds), so chunk c is summed in the order x[c-1] + x[c-2] +
... + x[c]. Floating-point addition is not associative; with the same order our result equals gloo's bit
for bit. Each step is one `send_recv` of the kit's wire (mini_dist/kit/wire.py: one batch, safe under NCCL,
counted in its LEDGER). The naive way comes first, then the ring; mini_dist/ring_pipelined.py runs the same
steps as one pipelined stream, tuned for gloo, and is what the library calls. The demo checks all three
against gloo, counts the bytes beside the formulas, and draws who holds what after each step:

    torchrun --standalone --nproc_per_node=4 mini_dist/ring_allreduce.py [--numel 1048579]

Mirrors torch.distributed.all_reduce / reduce_scatter_single / all_gather_single.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch, trace
from mini_dist.kit.debug import check_collective
from mini_dist.kit.wire import LEDGER, send_recv

SUM = dist.ReduceOp.SUM
AVG = dist.ReduceOp.AVG
MAX = dist.ReduceOp.MAX
MIN = dist.ReduceOp.MIN
PRODUCT = dist.ReduceOp.PRODUCT


def reduce_into(acc: torch.Tensor, incoming: torch.Tensor, op) -> None:
    """acc = acc (op) incoming, in place. AVG adds: the caller divides once, at the end."""
    if op in (SUM, AVG):
        acc.add_(incoming)
    elif op == PRODUCT:
        acc.mul_(incoming)
    elif op == MAX:
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


# ----------------------------------------------------------------------------- the naive way, then the ring


def naive_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """The baseline: everyone sends to rank 0, which reduces and sends the result back to everyone.
    Rank 0 receives and sends (N-1) * D bytes; the ring needs 2(N-1)/N * D on every rank."""
    check_collective(tensor, op, group, "naive_all_reduce")
    me = dist.get_rank(group)
    n = dist.get_world_size(group)
    flat = tensor.reshape(-1).clone()
    if me == 0:
        incoming = torch.empty_like(flat)
        for src in range(1, n):
            send_recv(None, 0, incoming, src, group, "naive_all_reduce")
            reduce_into(flat, incoming, op)
        if op == AVG:
            flat.div_(n)
        for dst in range(1, n):
            send_recv(flat, dst, None, 0, group, "naive_all_reduce")
    elif n > 1:
        send_recv(flat, 0, None, 0, group, "naive_all_reduce")
        send_recv(None, 0, flat, 0, group, "naive_all_reduce")
    return tensor.copy_(flat.view_as(tensor))


GLOO_SEGMENT_BYTES = 1 << 20  # gloo cuts an all-reduce into segments of at most 1 MiB (see chunk_bounds)


def chunk_bounds(numel: int, n: int, elem_size: int) -> list[tuple[int, int]]:
    """Where chunk c of an all-reduce starts and ends: gloo's layout, so the sums match it bit for bit.
    gloo cuts the buffer into a multiple of n equal segments (at least 2n, at most GLOO_SEGMENT_BYTES
    each); chunk c is segments [c*s, (c+1)*s). The last chunks can be short or empty."""
    segments = max(-(-numel * elem_size // GLOO_SEGMENT_BYTES), 2 * n)
    segments = -(-segments // n) * n
    per_chunk = -(-numel // segments) * (segments // n)
    return [(min(c * per_chunk, numel), min((c + 1) * per_chunk, numel)) for c in range(n)]


def textbook_reduce_scatter_steps(chunks: list[torch.Tensor], op=SUM, group=None) -> None:
    """N-1 steps, in place: afterwards chunks[rank] is chunk `rank` reduced over every rank (AVG: summed)."""
    # exercise: when it returns, chunks[r] on rank r is chunk r reduced by op over every rank (AVG: summed; the
    #   caller divides); other chunks may hold anything. Any N, chunks of any lengths. Move pieces only with
    #   send_recv(send, to, receive_into, from, group, "reduce-scatter"), combine with reduce_into(mine, incoming, op).
    r, n = dist.get_rank(group), dist.get_world_size(group)
    left, right = (r - 1) % n, (r + 1) % n
    for s in range(n - 1):
        send, mine = chunks[(r + 1 + s) % n], chunks[(r + 2 + s) % n]
        incoming = torch.empty_like(mine)
        send_recv(send, left, incoming, right, group, "reduce-scatter")  # one batch: see send_recv
        reduce_into(mine, incoming, op)
    # end exercise


def textbook_all_gather_steps(chunks: list[torch.Tensor], group=None) -> None:
    """N-1 steps, in place: chunks[rank] is complete; afterwards every chunk is."""
    # exercise: chunks[r] on rank r is complete when called; when it returns, every chunks[c] on every rank holds
    #   rank c's chunks[c], copied (nothing added). Any N, chunks of any lengths. Move pieces only with
    #   send_recv(send, to, receive_into, from, group, "all-gather").
    r, n = dist.get_rank(group), dist.get_world_size(group)
    left, right = (r - 1) % n, (r + 1) % n
    for s in range(n - 1):
        send_recv(chunks[(r + s) % n], left, chunks[(r + 1 + s) % n], right, group, "all-gather")
    # end exercise


def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place, like dist.all_reduce: reduce-scatter, then all-gather."""
    check_collective(tensor, op, group, "ring_all_reduce")
    n = dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n, flat.element_size())]  # [D/N] each, about
    textbook_reduce_scatter_steps(chunks, op, group)
    textbook_all_gather_steps(chunks, group)
    if op == AVG:
        flat.div_(n)
    return tensor if tensor.is_contiguous() else tensor.copy_(flat.view_as(tensor))


def reduce_scatter_chunks(output: torch.Tensor, input: torch.Tensor, op, group) -> list[torch.Tensor]:
    """ring_reduce_scatter's checks, and the N chunks its steps reduce: a copy of the input."""
    check_collective(input, op, group, "ring_reduce_scatter")
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, expected "
                         f"group size {n} x output's {output.numel()}")
    return list(input.reshape(-1).clone().chunk(n)) if output.numel() else [output.view(-1)] * n


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """Like dist.reduce_scatter_single: rank r gets block r of the reduced input (N equal blocks)."""
    chunks = reduce_scatter_chunks(output, input, op, group)
    textbook_reduce_scatter_steps(chunks, op, group)
    output.view(-1).copy_(chunks[dist.get_rank(group)])
    return output.div_(dist.get_world_size(group)) if op == AVG else output


def all_gather_chunks(output: torch.Tensor, input: torch.Tensor, group) -> list[torch.Tensor]:
    """ring_all_gather's checks, and the N chunks of the output its steps fill: this rank's already in place."""
    check_collective(input, SUM, group, "ring_all_gather")
    n = dist.get_world_size(group)
    if output.numel() != n * input.numel() or not output.is_contiguous():
        raise ValueError(f"ring_all_gather: output must be contiguous with group size {n} x input's "
                         f"{input.numel()} elements, got {output.numel()}")
    chunks = list(output.view(-1).chunk(n)) if input.numel() else [output.view(-1)] * n
    chunks[dist.get_rank(group)].copy_(input.reshape(-1))
    return chunks


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Like dist.all_gather_single: output = every rank's input, concatenated in rank order."""
    textbook_all_gather_steps(all_gather_chunks(output, input, group), group)
    return output


def bytes_sent(all_reduce, x: torch.Tensor, group=None) -> list[int]:
    """What each rank of the group sent in one all_reduce of a copy of x, counted by the wire's LEDGER: the
    figure beside 2(N-1)/N * D (the ring) and (N-1) * D (the naive root). In rank order."""
    LEDGER.reset()
    all_reduce(x.clone(), group=group)
    everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=x.device)
    dist.all_gather_single(everyone, torch.tensor([LEDGER.sent], device=x.device), group=group)
    return everyone.tolist()


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--numel", type=int, default=1_048_579, help="fp32 elements per rank, any count (chunks may differ)")
    return p


def ring_step_picture(group=None) -> tuple[str, bool]:
    """Who holds what after each step of one textbook ring all-reduce, read from its trace (kit/trace.py): each
    message says which chunk it carried and meets its receive; rank r starts with 2^r. -> (the table, its check)"""
    n = dist.get_world_size(group)
    x = torch.full((2 * n,), 1 << dist.get_rank(group), dtype=torch.int64, device=launch.device())
    starts = [a for a, _ in chunk_bounds(x.numel(), n, x.element_size())]
    with trace.recording() as records:
        ring_all_reduce(x, SUM, group)
    everyone = trace.everyone(records, group)
    ranks = list(everyone)
    got = trace.received(everyone)  # [rank][k]: (sender, its send, which send) of the k-th message it received
    held = [[{q} for _ in range(n)] for q in range(n)]  # [rank][chunk]: the ranks summed into it
    rows = [[[1] * n + [-1] for _ in range(n)]]  # [step][rank]: chunk counts + the chunk sent (-1: none)
    sends = [[m for m in everyone[g] if m.what == trace.SEND] for g in ranks]
    for k in range(2 * (n - 1)):
        before = [[set(c) for c in chunks] for chunks in held]
        for q, g in enumerate(ranks):
            p, send, _ = got[g][k]
            c = starts.index(send.args["offset"])  # where the message lay in the sender's tensor: its chunk
            theirs = before[ranks.index(p)][c]
            held[q][c] = before[q][c] | theirs if k < n - 1 else theirs  # reduce-scatter sums, all-gather copies
        rows.append([[len(c) for c in held[q]] + [starts.index(sends[q][k].args["offset"])] for q in range(n)])
    reduced = (x == (1 << n) - 1).all().item()  # the tensors agree: every chunk holds 2^0 + ... + 2^(N-1)
    ok = reduced and all(rows[n - 1][q][q] == n and rows[-1][q][:n] == [n] * n for q in range(n))
    return (f"one ring all-reduce on {n} ranks, read from its trace: how many ranks' data each chunk holds after "
            f"each step ({n} = fully reduced); < = the chunk the rank sent left\n" + "\n".join(table(rows, n))), ok


def table(rows: list, n: int) -> list[str]:
    """Per step, each rank's count of ranks summed into each chunk, the chunk it sent marked <."""
    lines = [f"{'after step':<18}" + "".join(f" rank {q:<{3 * n - 4}}" for q in range(n))]
    for k, row in enumerate(rows):
        step = "start" if k == 0 else f"reduce-scatter {k}" if k < n else f"all-gather {k - n + 1}"
        cells = ["".join(f"{c:>2}{'<' if j == row[q][n] else ' '}" for j, c in enumerate(row[q][:n])) for q in range(n)]
        lines.append(f"{step:<18}" + "".join(c + "  " for c in cells))
    return lines


def demo(args) -> int:
    launch.require(args.numel >= 0, f"--numel must be at least 0, got {args.numel}")
    env = launch.setup()
    n = env.world_size
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(args.numel, generator=g).to(env.device)
    # gloo reduce-scatters by all-reducing, and blocks of an even count up to 1 MiB share its chunks: same bits
    blocks = torch.randn(n * min(args.numel // n // 2 * 2, 1 << 18), generator=g).to(env.device)
    native = x.clone()
    rs = torch.empty(blocks.numel() // n, device=env.device)
    ag = torch.empty(n * x.numel(), device=env.device)
    dist.all_reduce(native)
    dist.reduce_scatter_single(rs, blocks)
    dist.all_gather_single(ag, x)
    same = [torch.equal(native, ring_all_reduce(x.clone())),
            torch.equal(rs, ring_reduce_scatter(torch.empty_like(rs), blocks)),
            torch.equal(ag, ring_all_gather(torch.empty_like(ag), x))]
    launch.print0(f"ring all-reduce, ring reduce-scatter, ring all-gather vs gloo's on {n} ranks, {args.numel:,} "
                  f"fp32 per rank: {'bit-identical' if all(same) else f'DIFFERENT {same}'}")
    D = x.nbytes
    ring = sum(bytes_sent(ring_all_reduce, x))  # over the ranks: their chunks may differ by an element
    root = bytes_sent(naive_all_reduce, x)[0]
    figure = (f"D = {D:,} B: the ring sent {ring / n / max(D, 1):.2f}D per rank (2(N-1)/N D, never above 2D), "
              f"the naive all-reduce's root {root / max(D, 1):.2f}D ((N-1)D, growing with N)")
    picture, picture_ok = ring_step_picture()
    launch.print0(f"{figure}\n\n{picture}\n\n(what each rank holds after each collective, the ring's bytes as N "
                  f"grows, all-reduce = reduce-scatter + all-gather: ./run.sh ask 4 5 6)")
    bytes_ok = ring == 2 * (n - 1) * D and root == (n - 1) * D
    return launch.conclude("ring_allreduce", all(same), "bit-identical to dist.all_reduce/RS/AG",
                           bytes_ok and picture_ok, figure)


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
