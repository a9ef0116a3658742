"""The pipelined ring: the textbook ring's steps run as one stream of segments, tuned for gloo.

The textbook ring (mini_dist/ring_allreduce.py) takes one step at a time: send a chunk to the left, receive
one from the right, wait for both, reduce, next step. The same sends, in the same order, reduced in the same
order (so still bit-identical to dist.all_reduce), go faster on gloo when they overlap:
- segments: a chunk travels in pieces of at most SEGMENT_BYTES, and a piece moves on the moment it has
  arrived and been reduced, so step j+1's first bytes leave while step j's last ones are still arriving;
- receives posted ahead (IN_FLIGHT into scratch while reducing, all of them in the all-gather, where the
  data lands in place): the transport writes straight into our buffer instead of staging it;
- at N = 2 both neighbours are one rank, and the two phases fuse into one exchange of the whole tensor
  (recursive doubling at N = 2, Thakur, Rabenseifner & Gropp 2005): the same D bytes in one step, not two.
The receive scratch is kept between calls: a fresh CPU MiB costs 256 page faults when data lands in it.

gloo only: NCCL runs a rank's unbatched sends and receives in order on one stream, where a receive posted
ahead of the neighbour's send, or a send ahead of the neighbour's receive all around the ring, waits forever.
Under NCCL ring_allreduce takes the textbook steps, each one batch_isend_irecv.

This module is also the wire that the rings and mini_dist/topology.py share: every send goes through
`send_recv` (one batched step) or `post` (the stream's), counted in LEDGER; and their input check.

    torchrun --standalone --nproc_per_node=4 mini_dist/ring_pipelined.py [--numel 4194304]
"""
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import debug, launch
from mini_dist.kit.timing import median, timed

SUM, AVG, MAX, MIN, PRODUCT = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                               dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
SEGMENT_BYTES = 1 << 20  # a chunk travels in pieces of at most this size
IN_FLIGHT = 2            # receives posted ahead while reducing (gloo's own ring keeps two)
EXCHANGE_AHEAD = 4       # and in the N = 2 exchange, where sends and receives share one socket


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
    """`count` buffers like `piece`, the same memory every call (gloo's scratch reuses its pages too)."""
    key, n = (piece.dtype, piece.device), piece.numel()
    if key not in _SCRATCH or _SCRATCH[key].numel() < count * n:
        _SCRATCH[key] = torch.empty(count * n, dtype=piece.dtype, device=piece.device)
    return [_SCRATCH[key][k * n:(k + 1) * n] for k in range(count)]


def pipelined_ring_steps(chunks: list[torch.Tensor], steps: range, group, name: str, op=SUM) -> None:
    """Steps of the ring all-reduce as one stream: at step j every rank sends chunk rank+1+j to its left
    neighbour and receives chunk rank+2+j from its right one, reduced into ours (steps 0..N-2: reduce-scatter)
    or stored (steps N-1..2N-3: all-gather); the chunk received at step j is the one sent at step j+1."""
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
    recvs, sends = {}, [post(dist.isend, piece(i, 1), left, group) for i in range(min(S, items))]  # ours
    for i in range(items):
        while len(recvs) < items and (len(recvs) < i + IN_FLIGHT or not reduces(len(recvs))):
            recvs[len(recvs)] = post(dist.irecv, landing(len(recvs)), right, group)
        if launch.VERBOSE:  # (formatting the line costs microseconds a step: not on the fast path)
            launch.trace(f"{name} step {step(i)} segment {i % S}: send chunk {(me + 1 + step(i)) % n} -> rank "
                         f"{left}, receive chunk {(me + 2 + step(i)) % n} <- rank {right}")
        wait(recvs[i], group, name)
        if reduces(i):
            reduce_into(piece(i, 2), landing(i), op)
        if i + S < items:  # pass on what just arrived first: the left neighbour is waiting for it
            sends.append(post(dist.isend, piece(i + S, 1), left, group))
    for posted in sends:
        wait(posted, group, name)


def fused_exchange(flat: torch.Tensor, group, name: str, op=SUM) -> None:
    """The ring of two ranks, its two phases fused. Each rank would send the peer's half (reduce-scatter),
    then its own half once reduced (all-gather). Sending its own half as it is, at once, lets the peer
    reduce that half too: the same D bytes, one step instead of two, D/2 more additions per rank. Two
    operands commute exactly: still gloo's sums. Receives go first, so the peer's sends can land."""
    peer, pieces, ahead = 1 - dist.get_rank(group), _segments([flat])[0], EXCHANGE_AHEAD
    scratch = _scratch(pieces[0], ahead)
    landing = lambda k: scratch[k % ahead][:pieces[k].numel()]  # noqa: E731
    recvs = [post(dist.irecv, landing(k), peer, group) for k in range(min(ahead, len(pieces)))]
    sends = [post(dist.isend, piece, peer, group) for piece in pieces]
    for k, piece in enumerate(pieces):
        if launch.VERBOSE:
            launch.trace(f"{name}, N = 2, one exchange: segment {k} -> rank {peer}, rank {peer}'s <- and reduced")
        wait(recvs[k], group, name)
        wait(sends[k], group, name)  # the piece is ours to change only once it has left
        reduce_into(piece, landing(k), op)
        if k + ahead < len(pieces):
            recvs.append(post(dist.irecv, landing(k + ahead), peer, group))


# ----------------------------------------------------------------------------- the wire, counted


@dataclass
class ByteLedger:
    """Bytes this rank put on the wire and took off it through this module (the rings, topology's
    algorithms). before_send(global peer, bytes), when set, runs before every send: mini_dist.topology.Links
    sorts the bytes by link there, and delays the ones that cross a SIMULATED slow link."""
    sent: int = 0
    received: int = 0
    before_send: object = None

    def reset(self) -> None:
        self.sent = self.received = 0

    def send(self, nbytes: int, peer: int, group) -> None:
        self.sent += nbytes
        if self.before_send is not None:
            self.before_send(dist.get_global_rank(group, peer) if group is not None else peer, nbytes)


LEDGER = ByteLedger()


def send_recv(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, group, name: str) -> None:
    """One step: send `send` to group rank dst while receiving `recv` from src, in ONE batch_isend_irecv.
    NCCL runs a rank's unbatched sends and receives in order on one stream: if every rank of a ring sent
    first, each send would wait for a receive its neighbour has queued behind its own send. A batch runs
    as one unit. Empty (or None) tensors stay home: the peer skips the same empty piece."""
    if debug.DEBUG:
        compare_sizes(send, dst, recv, src, group, name)
    ops, peers = [], []
    if send is not None and send.numel():
        LEDGER.send(send.nbytes, dst, group)
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=dst))
        peers.append(("sending to", dst))
    if recv is not None and recv.numel():
        LEDGER.received += recv.nbytes
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=src))
        peers.append(("receiving from", src))
    works = dist.batch_isend_irecv(ops) if ops else []
    for k, work in enumerate(works):  # one work per op on gloo; NCCL may coalesce them into one
        doing, peer = peers[k] if len(works) == len(peers) else peers[0]
        wait((work, doing, peer), group, name)


def compare_sizes(send, dst: int, recv, src: int, group, name: str) -> None:
    """Under MINI_DIST_DEBUG=1, each end of a send first tells the other its size, in one batch: a chunk index
    that is off by one (a piece of another size, or an empty one that stays home) fails at once on both ends,
    named, instead of a receive that waits for a message that never comes or comes cut."""
    me, of = dist.get_rank(group), (lambda r: dist.get_global_rank(group, r) if group is not None else r)
    mine = [(t, peer, torch.tensor([t.numel()], device=launch.device()), torch.empty(1, dtype=torch.int64,
             device=launch.device())) for t, peer in ((send, dst), (recv, src)) if t is not None]
    ops = [dist.P2POp(dist.isend, told, group=group, group_peer=peer) for _, peer, told, _ in mine]
    ops += [dist.P2POp(dist.irecv, heard, group=group, group_peer=peer) for _, peer, _, heard in mine[::-1]]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for (t, peer, _, heard), sending in zip(mine, [send is not None, False]):
        if heard.item() != t.numel():
            raise debug.Disagreement(
                f"{name}: rank {of(me)} {'sends' if sending else 'expects'} {t.numel()} elements "
                f"{'to' if sending else 'from'} rank {of(peer)}, which {'expects' if sending else 'sends'} "
                f"{heard.item()}: the two ranks mean different pieces (a chunk index off by one?)")


def post(p2p, piece: torch.Tensor, peer: int, group):
    """Unbatched isend or irecv of one piece to/from group rank `peer`, counted (nothing if empty)."""
    if not piece.numel():
        return None
    if p2p is dist.isend:
        LEDGER.send(piece.nbytes, peer, group)
        return p2p(piece, group=group, group_dst=peer), "sending to", peer
    LEDGER.received += piece.nbytes
    return p2p(piece, group=group, group_src=peer), "receiving from", peer


def wait(posted, group, name: str) -> None:
    """Wait for a posted send or receive; if it fails, say which rank we were talking to."""
    if posted is not None:
        work, doing, peer = posted
        debug.wait_for(work, dist.get_global_rank(group, peer) if group is not None else peer, f"{name}, {doing} it")


OPS = {SUM: "SUM", AVG: "AVG", MAX: "MAX", MIN: "MIN", PRODUCT: "PRODUCT"}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]


def check_collective(tensor: torch.Tensor, op, group, name: str, also: str = "") -> None:
    """Ranks that disagree are named on every rank (debug mode); bad input shared by all fails on all."""
    if debug.DEBUG:  # (one more latency-bound collective per call: only under MINI_DIST_DEBUG=1)
        debug.agree(name, f"shape {tuple(tensor.shape)} dtype {tensor.dtype} op {OPS.get(op, op)} on "
                          f"{tensor.device.type}{also}", group)
    if op not in OPS:
        raise ValueError(f"{name}: unsupported op {op}; use SUM, AVG, MAX, MIN or PRODUCT")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{name}: unsupported dtype {tensor.dtype}; use one of {DTYPES}")
    if tensor.device.type != launch.device().type:
        raise ValueError(f"{name}: a tensor on {tensor.device.type} cannot travel over "
                         f"{dist.get_backend(group)}; create it on mini_dist.launch.device()")
    if op == AVG and not tensor.is_floating_point():
        raise ValueError(f"{name}: AVG of {tensor.dtype} tensors would round; use SUM and divide")


# ----------------------------------------------------------------------------- demo


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--numel", type=int, default=1 << 22, help="fp32 elements per rank (a multiple of the ranks)")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per variant (median)")
    return p


def all_reduce(flat: torch.Tensor, group=None, name: str = "pipelined all-reduce") -> torch.Tensor:
    """SUM all-reduce of a contiguous 1-D tensor, N equal chunks: the stream, or the exchange at N = 2."""
    n = dist.get_world_size(group)
    if n == 2 and flat.numel():
        fused_exchange(flat, group, name)
    else:
        pipelined_ring_steps(list(flat.chunk(n)) if flat.numel() else [flat] * n, range(2 * n - 2), group, name)
    return flat


def demo(args) -> int:
    global SEGMENT_BYTES, IN_FLIGHT, EXCHANGE_AHEAD
    n = launch.env_world_size()
    launch.require(args.numel > 0 and args.numel % n == 0 and args.repeats >= 1,
                   f"--numel must be a positive multiple of the {n} ranks, and --repeats at least 1")
    env = launch.setup()
    # integer-valued data: every order of the sum is exact, so the check is equality whatever the layout
    x = torch.randint(-9, 10, (args.numel,), generator=torch.Generator().manual_seed(env.rank)).float().to(env.device)
    native = x.clone()
    dist.all_reduce(native)
    tuned, plain, ours = (SEGMENT_BYTES, IN_FLIGHT, EXCHANGE_AHEAD), "one message per step (textbook)", "pipelined"
    variants = {plain: (1 << 62, 1, 1), ours: tuned}
    times, same = {}, True
    for label, (SEGMENT_BYTES, IN_FLIGHT, EXCHANGE_AHEAD) in variants.items():
        same &= torch.equal(all_reduce(x.clone()), native)
        times[label] = median([timed(lambda: all_reduce(x.clone())) for _ in range(args.repeats)])
    SEGMENT_BYTES, IN_FLIGHT, EXCHANGE_AHEAD = tuned
    times["dist.all_reduce (gloo's own ring, C++)"] = median([timed(lambda: dist.all_reduce(x.clone()))
                                                             for _ in range(args.repeats)])
    launch.print0(f"all-reduce of {x.nbytes:,} B per rank on {n} ranks, ms (median of {args.repeats}, slowest rank):")
    for label, t in times.items():
        launch.print0(f"  {label:<44}{t * 1e3:>9.2f}")
    if times[ours] >= times[plain]:
        launch.print0(f"pipelining bought nothing in this run: {n} ranks share {os.cpu_count()} cores here and one "
                      f"run's wall clock is noisy; `./run.sh bench {n} collectives` times it in 101 pairs per size")
    return launch.conclude("ring_pipelined", same, "both shapes = dist.all_reduce exactly (integer data)", True,
                           f"pipelined {times[ours] * 1e3:.2f} ms vs one message per step {times[plain] * 1e3:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
