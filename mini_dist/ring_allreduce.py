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
rank c chunk c, the layout gloo uses, so chunk c is summed in the order x[c-1] + x[c-2] + ... + x[c].
Floating-point addition is not associative; with the same order our result equals gloo's bit for bit.

Speed comes from keeping the wire busy, as gloo does. The all-reduce is one stream of 2(N-1) steps in
which the chunk received at step j is the one sent at step j+1: a chunk travels in segments of at most
SEGMENT_BYTES, each moving on the moment it has arrived (and been reduced), and every receive is posted
before its data can arrive, so the transport writes straight into place. At N = 2 both neighbours are one
rank and, on gloo, the two phases fuse into one exchange of the whole tensor (_exchange): the same D bytes,
one step instead of two (measured on 2 vCPUs: 0.7-1.1x gloo's time, where the two phases took 1.0-1.4x).
Whether the ranks agree on shape, dtype and op is checked under MINI_DIST_DEBUG=1 only (mini_dist.debug.agree,
as TORCH_DISTRIBUTED_DEBUG=DETAIL does): the check is one more latency-bound collective per call.

    torchrun --standalone --nproc_per_node=4 mini_dist/ring_allreduce.py [--numel 1048579] [--verbose]

Timings against gloo: `./run.sh bench 4 collectives`. Mirrors torch.distributed.all_reduce /
reduce_scatter_single / all_gather_single.
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import debug, launch

SUM, AVG, MAX, MIN, PRODUCT = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                               dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
OPS = {SUM: "SUM", AVG: "AVG", MAX: "MAX", MIN: "MIN", PRODUCT: "PRODUCT"}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]
SEGMENT_BYTES = 1 << 20       # a chunk travels in pieces of at most this size
GLOO_SEGMENT_BYTES = 1 << 20  # gloo's ring: segments of at most 1 MiB (measured: see chunk_bounds)
IN_FLIGHT = 2                 # receives posted ahead in the reduce-scatter (gloo keeps two)
EXCHANGE_AHEAD = 4            # and in the N = 2 exchange (at 4 MiB, 2 ahead: 1.16-1.30x gloo; 4: 0.89-1.06x)


@dataclass
class ByteLedger:
    """Bytes this rank put on the wire and took off it through the functions of this module."""
    sent: int = 0
    received: int = 0

    def reset(self) -> None:
        self.sent = self.received = 0


LEDGER = ByteLedger()


def reduce_into(acc: torch.Tensor, incoming: torch.Tensor, op) -> None:
    if op in (SUM, AVG):
        acc.add_(incoming)
    elif op == PRODUCT:
        acc.mul_(incoming)
    elif op == MAX:
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def _check(tensor: torch.Tensor, op, group, name: str) -> None:
    """Ranks that disagree are named on every rank (debug mode); bad input shared by all fails on all."""
    if debug.DEBUG:  # (formatting the signature costs microseconds: not on the fast path)
        debug.agree(name, f"shape {tuple(tensor.shape)} dtype {tensor.dtype} op {OPS.get(op, op)} on "
                         f"{tensor.device.type}", group)
    if op not in OPS:
        raise ValueError(f"{name}: unsupported op {op}; use SUM, AVG, MAX, MIN or PRODUCT")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{name}: unsupported dtype {tensor.dtype}; use one of {DTYPES}")
    if tensor.device.type != launch.device().type:
        raise ValueError(f"{name}: a tensor on {tensor.device.type} cannot travel over "
                         f"{dist.get_backend(group)}; create it on mini_dist.launch.device()")
    if op == AVG and not tensor.is_floating_point():
        raise ValueError(f"{name}: AVG of {tensor.dtype} tensors would round; use SUM and divide")


def _post(p2p, piece: torch.Tensor, peer: int, group):
    """isend or irecv of one piece to/from group rank `peer`, counted in the ledger (nothing if empty)."""
    if not piece.numel():
        return None
    if p2p is dist.isend:
        LEDGER.sent += piece.nbytes
        return p2p(piece, group=group, group_dst=peer), "sending to", peer
    LEDGER.received += piece.nbytes
    return p2p(piece, group=group, group_src=peer), "receiving from", peer


def _wait(posted, group, name: str) -> None:
    """Wait for a posted send or receive; if it fails, say which rank we were talking to."""
    if posted is not None:
        work, doing, peer = posted
        debug.wait_for(work, dist.get_global_rank(group, peer) if group is not None else peer, f"{name}, {doing} it")


# ----------------------------------------------------------------------------- the naive way


def naive_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """The baseline: everyone sends to rank 0, which reduces and sends the result back to everyone.

    Rank 0 receives and sends (N-1) * D bytes; the ring needs 2(N-1)/N * D on every rank.
    """
    _check(tensor, op, group, "naive_all_reduce")
    me, n = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.reshape(-1).clone()
    if me == 0:
        incoming = torch.empty_like(flat)
        for src in range(1, n):
            _wait(_post(dist.irecv, incoming, src, group), group, "naive_all_reduce")
            reduce_into(flat, incoming, op)
        if op == AVG:
            flat.div_(n)
        for dst in range(1, n):
            _wait(_post(dist.isend, flat, dst, group), group, "naive_all_reduce")
    elif n > 1:
        _wait(_post(dist.isend, flat, 0, group), group, "naive_all_reduce")
        _wait(_post(dist.irecv, flat, 0, group), group, "naive_all_reduce")
    tensor.copy_(flat.view_as(tensor))
    return tensor


# ----------------------------------------------------------------------------- the ring


def chunk_bounds(numel: int, n: int, elem_size: int) -> list[tuple[int, int]]:
    """Where chunk c of an all-reduce starts and ends: gloo's layout, so the sums match it bit for bit.

    gloo cuts the buffer into a multiple of n equal segments (at least 2n, at most GLOO_SEGMENT_BYTES
    each); chunk c is segments [c*s, (c+1)*s). The last chunks can be short or empty.
    """
    total = numel * elem_size
    segments = max(-(-total // GLOO_SEGMENT_BYTES), 2 * n)
    segments = -(-segments // n) * n
    seg = -(-numel // segments)
    per_chunk = seg * (segments // n)
    return [(min(c * per_chunk, numel), min((c + 1) * per_chunk, numel)) for c in range(n)]


def _segments(chunks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every chunk cut the same way (from the size of chunk 0, the largest): pieces of a chunk that a rank
    sends line up with the pieces its neighbour receives. Short chunks get short or empty pieces."""
    largest = chunks[0].numel()
    count = max(1, -(-largest * chunks[0].element_size() // SEGMENT_BYTES))
    if count == 1:  # a view per piece costs microseconds: a chunk that fits is its own piece
        return [[c] for c in chunks]
    seg = -(-largest // count)
    return [[c[s * seg:(s + 1) * seg] for s in range(count)] for c in chunks]


_SCRATCH: dict = {}  # (dtype, device) -> receive scratch, kept between calls (it only ever grows)


def _scratch(piece: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` buffers like `piece`, the same memory every call: a fresh CPU MiB is 256 page faults when
    the data lands in it, about 0.35 ms measured on 2 vCPUs (gloo's scratch comes from the C heap, which
    reuses its pages)."""
    key, n = (piece.dtype, piece.device), piece.numel()
    if key not in _SCRATCH or _SCRATCH[key].numel() < count * n:
        _SCRATCH[key] = torch.empty(count * n, dtype=piece.dtype, device=piece.device)
    return [_SCRATCH[key][k * n:(k + 1) * n] for k in range(count)]


def _ring_steps(chunks: list[torch.Tensor], steps: range, group, name: str, op=SUM) -> None:
    """Steps of the ring all-reduce: at step j every rank sends chunk rank+1+j to its left neighbour and
    receives chunk rank+2+j from its right one, to be reduced into ours (steps 0..N-2: reduce-scatter) or
    stored (steps N-1..2N-3: all-gather). Receives are posted ahead, in order: IN_FLIGHT into scratch while
    reducing, all of them once they land in place."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    left, right, pieces = (me - 1) % n, (me + 1) % n, _segments(chunks)
    S, items = len(pieces[0]), len(steps) * len(pieces[0])  # item i: step steps[i // S], segment i % S
    if not items:
        return
    step = lambda i: steps[i // S]  # noqa: E731
    piece = lambda i, shift: pieces[(me + shift + step(i)) % n][i % S]  # noqa: E731  shift 1: sent, 2: received
    reduces = lambda i: step(i) < n - 1  # noqa: E731
    scratch = _scratch(pieces[0][0], IN_FLIGHT) if reduces(0) else []
    landing = lambda i: scratch[i % IN_FLIGHT][:piece(i, 2).numel()] if reduces(i) else piece(i, 2)  # noqa: E731
    recvs, sends = {}, [_post(dist.isend, piece(i, 1), left, group) for i in range(min(S, items))]  # ours
    for i in range(items):
        while len(recvs) < items and (len(recvs) < i + IN_FLIGHT or not reduces(len(recvs))):
            recvs[len(recvs)] = _post(dist.irecv, landing(len(recvs)), right, group)
        if launch.VERBOSE:
            launch.trace(f"{name} step {step(i)} segment {i % S}: send chunk {(me + 1 + step(i)) % n} -> rank "
                         f"{left}, receive chunk {(me + 2 + step(i)) % n} <- rank {right}"
                         f"{' and reduce it' if reduces(i) else ''}")
        _wait(recvs[i], group, name)
        if reduces(i):
            reduce_into(piece(i, 2), landing(i), op)
            if op == AVG and step(i) == n - 2:  # chunk `rank` is complete: average it before it moves on
                piece(i, 2).div_(n)
        if i + S < items:  # pass on what just arrived first: the left neighbour is waiting for it
            sends.append(_post(dist.isend, piece(i + S, 1), left, group))
    for posted in sends:
        _wait(posted, group, name)


def _exchange(flat: torch.Tensor, group, name: str, op) -> None:
    """The ring of two ranks, its two phases fused. Each rank would send the peer's half (reduce-scatter),
    then its own half once reduced (all-gather). Sending its own half as it is, at once, lets the peer
    reduce that half too: the same D bytes, one step instead of two, D/2 more additions per rank (recursive
    doubling at N = 2, Thakur, Rabenseifner & Gropp 2005). Two operands commute exactly: still gloo's sums."""
    peer, pieces, ahead = 1 - dist.get_rank(group), _segments([flat])[0], EXCHANGE_AHEAD
    scratch = _scratch(pieces[0], ahead)
    landing = lambda k: scratch[k % ahead][:pieces[k].numel()]  # noqa: E731
    recvs = [_post(dist.irecv, landing(k), peer, group) for k in range(min(ahead, len(pieces)))]  # before
    sends = [_post(dist.isend, piece, peer, group) for piece in pieces]  # the peer's sends can reach them
    for k, piece in enumerate(pieces):
        if launch.VERBOSE:
            launch.trace(f"{name}, N = 2, one exchange: segment {k} of the whole tensor -> rank {peer}, "
                         f"rank {peer}'s <- and reduced into ours")
        _wait(recvs[k], group, name)
        _wait(sends[k], group, name)  # the piece is ours to change only once it has left
        reduce_into(piece, landing(k), op)
        if k + ahead < len(pieces):
            recvs.append(_post(dist.irecv, landing(k + ahead), peer, group))
    if op == AVG:
        flat.div_(2)


def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place, like dist.all_reduce: every rank ends with the reduction of every rank's tensor."""
    _check(tensor, op, group, "ring_all_reduce")
    n = dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    # (not on NCCL: it runs a rank's sends and receives in order on one stream, where the exchange's receives,
    # posted ahead of the peer's sends, would wait forever; the ring's sends go first, as at N >= 3)
    if n == 2 and flat.numel() and dist.get_backend(group) != dist.Backend.NCCL:
        _exchange(flat, group, "ring_all_reduce", op)
    else:
        chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n, flat.element_size())]
        _ring_steps(chunks, range(2 * n - 2), group, "ring_all_reduce", op)  # reduce-scatter, all-gather
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """Like dist.reduce_scatter_single: rank r gets block r of the reduced input (N equal blocks)."""
    _check(input, op, group, "ring_reduce_scatter")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, expected "
                         f"group size {n} x output's {output.numel()}")
    chunks = list(input.reshape(-1).clone().chunk(n)) if output.numel() else [output.view(-1)] * n
    _ring_steps(chunks, range(n - 1), group, "ring_reduce_scatter", op)  # in a copy: the input stays as it was
    output.view(-1).copy_(chunks[me])
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Like dist.all_gather_single: output = every rank's input, concatenated in rank order."""
    _check(input, SUM, group, "ring_all_gather")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if output.numel() != n * input.numel() or not output.is_contiguous():
        raise ValueError(f"ring_all_gather: output must be contiguous with group size {n} x input's "
                         f"{input.numel()} elements, got {output.numel()}")
    chunks = list(output.view(-1).chunk(n)) if input.numel() else [output.view(-1)] * n
    chunks[me].copy_(input.reshape(-1))
    _ring_steps(chunks, range(n - 1, 2 * n - 2), group, "ring_all_gather")
    return output


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--numel", type=int, default=1_048_579,
                   help="fp32 elements per rank (any count: chunks need not be equal)")
    p.add_argument("--verbose", action="store_true",
                   help="trace every send and receive of one small all-reduce (as VERBOSE=1 does)")
    return p


def demo(args) -> int:
    launch.require(args.numel >= 0, f"--numel must be at least 0, got {args.numel}")
    verbose, launch.VERBOSE = args.verbose or launch.VERBOSE, False  # trace one small call, not every call
    env = launch.setup()
    n, r = env.world_size, env.rank
    g = torch.Generator().manual_seed(r)
    x = torch.randn(args.numel, generator=g).to(env.device)
    # gloo reduce-scatters by all-reducing and keeping block r; blocks of an even count up to 1 MiB share
    # its chunk layout, so the sums are bit-identical (elsewhere only their order differs: tests bound it)
    blocks = torch.randn(n * min(args.numel // n // 2 * 2, 1 << 18), generator=g).to(env.device)
    native, ring = x.clone(), x.clone()
    dist.all_reduce(native)
    ring_all_reduce(ring)
    rs = [torch.empty(blocks.numel() // n, device=env.device) for _ in range(2)]
    ag = [torch.empty(n * x.numel(), device=env.device) for _ in range(2)]
    dist.reduce_scatter_single(rs[0], blocks)
    ring_reduce_scatter(rs[1], blocks)
    dist.all_gather_single(ag[0], x)
    ring_all_gather(ag[1], x)
    same = [torch.equal(a, b) for a, b in [(native, ring), rs, ag]]
    launch.print0(f"ring vs gloo on {n} ranks, {args.numel:,} fp32 per rank: all-reduce, reduce-scatter, "
                  f"all-gather {'bit-identical' if all(same) else f'DIFFERENT {same}'}")

    D = x.nbytes
    sent = {}
    for name, fn in [("naive", naive_all_reduce), ("ring", ring_all_reduce)]:
        LEDGER.reset()
        fn(x.clone())
        everyone = torch.tensor([LEDGER.sent, LEDGER.sent], device=env.device)
        dist.all_reduce(everyone[:1])
        dist.all_reduce(everyone[1:], op=MAX)
        sent[name] = everyone.tolist()
    ring_ok = sent["ring"][0] == 2 * (n - 1) * D and sent["naive"][1] == (n - 1) * D
    launch.print0(f"bytes sent for D = {D:,} B    busiest rank     mean over ranks   formula\n"
                  f"  naive (root = rank 0)     {sent['naive'][1]:>12,}  {sent['naive'][0] / n:>16,.0f}   "
                  f"root (N-1)*D = {(n - 1) * D:,}\n"
                  f"  ring                      {sent['ring'][1]:>12,}  {sent['ring'][0] / n:>16,.0f}   "
                  f"2(N-1)/N*D = {2 * (n - 1) / n * D:,.0f}")
    if verbose:  # 2 elements per chunk: every send and receive of one all-reduce, each rank's line whole
        launch.VERBOSE = True
        dist.barrier()
        after = ring_all_reduce(torch.arange(2.0 * n, device=env.device) + 10 * r)
        launch.trace(f"x = arange(2N) + 10 * rank -> {after.tolist()}")
        launch.VERBOSE = False
    return launch.conclude("ring_allreduce", all(same), "bit-identical to dist.all_reduce/RS/AG", ring_ok,
                           f"ring sent {sent['ring'][0] / n:,.0f} B/rank = 2(N-1)/N*D, naive root "
                           f"{sent['naive'][1]:,} B = (N-1)*D")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
