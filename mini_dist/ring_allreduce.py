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
steps as one pipelined stream, tuned for gloo, and is what the library calls.

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
    me, n = dist.get_rank(group), dist.get_world_size(group)
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
    # exercise: N-1 steps: send chunk (r+1+s) % N to the left, receive chunk (r+2+s) % N from the right, reduce it in
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
    # exercise: N-1 steps: send chunk (r+s) % N to the left, receive chunk (r+1+s) % N from the right into place
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


# ----------------------------------------------------------------------------- what the demo measures


def _total(x: float, op=SUM, group=None) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64, device=launch.device())
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def ring_step_picture(group=None) -> tuple[str, bool]:
    """Who holds what after each step of one textbook ring all-reduce, drawn from the run's trace (kit/trace.py):
    each message recorded says where in its buffer it lies (its chunk) and meets the receive that got it, so
    following them step by step tells how many ranks' data each chunk holds. Rank r's tensor starts as 2^r,
    so the result also names the ranks summed into it. Returns (the table, whether rank r holds chunk r
    complete after N-1 steps and every rank all of it after 2(N-1), as the tensors say too)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    x = torch.full((2 * n,), 1 << r, dtype=torch.int64, device=launch.device())
    starts = [a for a, _ in chunk_bounds(x.numel(), n, x.element_size())]
    with trace.recording() as records:
        ring_all_reduce(x, SUM, group)
    everyone = trace.everyone(records, group)
    ranks = list(everyone)
    got = trace.received(everyone)  # [rank][k]: (sender, its send, which send) of the k-th message it received
    held = [[{q} for _ in range(n)] for q in range(n)]  # [rank][chunk]: the ranks summed into it
    rows = [[[1] * n + [-1] for _ in range(n)]]  # [step][rank]: chunk counts + the chunk sent (-1: none)
    for k in range(2 * (n - 1)):
        before = [[set(c) for c in chunks] for chunks in held]
        for q, g in enumerate(ranks):
            p, send, _ = got[g][k]
            c = starts.index(send.args["offset"])  # where the message lay in the sender's tensor: its chunk
            held[q][c] = before[q][c] | before[ranks.index(p)][c] if k < n - 1 else before[ranks.index(p)][c]
        sent = [starts.index([m for m in everyone[g] if m.what == trace.SEND][k].args["offset"]) for g in ranks]
        rows.append([[len(c) for c in held[q]] + [sent[q]] for q in range(n)])
    label = lambda k: "start" if k == 0 else f"reduce-scatter {k}" if k < n else f"all-gather {k - n + 1}"  # noqa: E731
    cell = lambda q, k: "".join(f"{c:>2}{'<' if j == rows[k][q][n] else ' '}"  # noqa: E731
                                for j, c in enumerate(rows[k][q][:n]))
    lines = [f"{'after step':<18}" + "".join(f" rank {q:<{3 * n - 4}}" for q in range(n))]
    lines += [f"{label(k):<18}" + "".join(cell(q, k) + "  " for q in range(n)) for k in range(len(rows))]
    ok = all(rows[n - 1][q][q] == n and rows[-1][q][:n] == [n] * n for q in range(n))
    ok &= bool((x == (1 << n) - 1).all())  # the tensors agree: every chunk holds 2^0 + ... + 2^(N-1)
    return (f"one ring all-reduce on {n} ranks, step by step: how many ranks' data each chunk holds ({n} = fully "
            f"reduced); < = the chunk the rank sent to its left at that step (from the run's trace: each message "
            f"met the receive that got it)\n" + "\n".join(lines)), ok


def what_each_rank_holds(group=None) -> tuple[str, bool]:
    """Question 4: rank r holds (r+1) x [1..N]; what all-reduce, reduce-scatter, all-gather leave on each rank."""
    n, r, dev = dist.get_world_size(group), dist.get_rank(group), launch.device()
    x = torch.arange(1.0, n + 1, device=dev) * (r + 1)
    native = x.clone()
    dist.all_reduce(native, group=group)
    summed = ring_all_reduce(x.clone(), group=group)
    block = ring_reduce_scatter(torch.empty(1, device=dev), x.clone(), group=group)
    gathered = ring_all_gather(torch.empty(n, device=dev), block, group=group)
    show = lambda t: "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"  # noqa: E731
    ok = torch.equal(summed, native) and torch.equal(block, native[r:r + 1]) and torch.equal(gathered, native)
    return (f"rank r holds (r+1) x {show(x / (r + 1))}; all-reduce: {show(summed)} on every rank; reduce-scatter: "
            f"rank r keeps block r of that sum ({', '.join(show(t) for t in gathered.chunk(n))}); all-gather of "
            f"those blocks: {show(gathered)} on every rank; all = torch.distributed's"), _total(not ok) == 0


def ring_bytes_per_rank(numel: int = 1 << 16) -> tuple[str, bool]:
    """Question 5 (every rank of the world): bytes the ring sends per rank on 2 ranks and on all of them, and
    what the naive all-reduce's root sends, for numel fp32."""
    N, D = dist.get_world_size(), 4 * numel

    def sent(fn, size):  # (mean, largest) bytes one of the first `size` ranks sent
        group = launch.new_group(range(size))  # every rank creates it; the others sit this one out
        LEDGER.reset()
        if dist.get_rank() < size:
            fn(torch.ones(numel, device=launch.device()), group=group)
        return _total(LEDGER.sent) / size, _total(LEDGER.sent, MAX)
    ring = {size: sent(ring_all_reduce, size)[0] / D for size in sorted({min(2, N), N})}
    root = sent(naive_all_reduce, N)[1] / D
    return (f"D = {D:,} B: the ring sends " + ", ".join(f"{v:.2f}D per rank on {s} ranks" for s, v in ring.items())
            + f" (2(N-1)/N D, never above 2D); the naive all-reduce's root (rank 0) sends {root:.2f}D on {N} "
            f"ranks ((N-1)D)"), all(v == 2 * (s - 1) / s for s, v in ring.items()) and root == N - 1


def all_reduce_is_reduce_scatter_plus_all_gather(group=None) -> tuple[str, bool]:
    """Question 6: one ring all-reduce against a ring reduce-scatter then all-gather: bytes and result."""
    n, dev = dist.get_world_size(group), launch.device()
    x = torch.randn(n * 4096, generator=torch.Generator().manual_seed(dist.get_rank(group))).to(dev)
    LEDGER.reset()
    whole = ring_all_reduce(x.clone(), group=group)
    one = _total(LEDGER.sent, group=group)
    LEDGER.reset()
    halves = ring_all_gather(torch.empty_like(x), ring_reduce_scatter(torch.empty(4096, device=dev), x, group=group),
                             group=group)
    two, D = _total(LEDGER.sent, group=group), x.nbytes
    same = _total(not torch.equal(whole, halves), group=group) == 0
    return (f"D = {D:,} B fp32 on {n} ranks: all-reduce sent {one / n / D:.2f}D per rank, reduce-scatter + "
            f"all-gather {two / n / D:.2f}D; results bit-identical: {same}"), same and one == two == 2 * (n - 1) * D


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--numel", type=int, default=1_048_579,
                   help="fp32 elements per rank (any count: chunks need not be equal)")
    return p


def demo(args) -> int:
    launch.require(args.numel >= 0, f"--numel must be at least 0, got {args.numel}")
    env = launch.setup()
    n, r = env.world_size, env.rank
    g = torch.Generator().manual_seed(r)
    x = torch.randn(args.numel, generator=g).to(env.device)
    # gloo reduce-scatters by all-reducing and keeping block r; blocks of an even count up to 1 MiB share
    # its chunk layout, so the sums are bit-identical (elsewhere only their order differs: tests bound it)
    blocks = torch.randn(n * min(args.numel // n // 2 * 2, 1 << 18), generator=g).to(env.device)
    native, rs = x.clone(), torch.empty(blocks.numel() // n, device=env.device)
    ag = torch.empty(n * x.numel(), device=env.device)
    dist.all_reduce(native)
    dist.reduce_scatter_single(rs, blocks)
    dist.all_gather_single(ag, x)
    same = [torch.equal(native, ring_all_reduce(x.clone())),
            torch.equal(rs, ring_reduce_scatter(torch.empty_like(rs), blocks)),
            torch.equal(ag, ring_all_gather(torch.empty_like(ag), x))]
    launch.print0(f"ring all-reduce, ring reduce-scatter, ring all-gather vs gloo's on {n} ranks, {args.numel:,} "
                  f"fp32 per rank: {'bit-identical' if all(same) else f'DIFFERENT {same}'}")
    figures = [ring_step_picture(), what_each_rank_holds(), ring_bytes_per_rank(),
               all_reduce_is_reduce_scatter_plus_all_gather()]
    for figure, _ in figures:
        launch.print0("\n" + figure)
    return launch.conclude("ring_allreduce", all(same), "bit-identical to dist.all_reduce/RS/AG",
                           all(ok for _, ok in figures), figures[2][0].split(";")[0])


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
