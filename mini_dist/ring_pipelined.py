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
So the library's ring_all_reduce, ring_reduce_scatter and ring_all_gather (the last section: what DDP, ZeRO
and topology call) are ring_allreduce.py's, the same calls with the same checks, run as this stream on gloo
and as the textbook's batched steps under NCCL. Every message goes through the kit's wire (kit/wire.py).

    torchrun --standalone --nproc_per_node=4 mini_dist/ring_pipelined.py [--numel 4194304]
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import ring_allreduce as textbook
from mini_dist.kit import launch
from mini_dist.kit.debug import check_collective
from mini_dist.kit.timing import median, timed
from mini_dist.kit.wire import irecv, isend, wait
from mini_dist.ring_allreduce import AVG, SUM, chunk_bounds, reduce_into

SEGMENT_BYTES = 1 << 20  # a chunk travels in pieces of at most this size
IN_FLIGHT = 2            # receives posted ahead while reducing (gloo's own ring keeps two)
EXCHANGE_AHEAD = 4       # and in the N = 2 exchange, where sends and receives share one socket


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
    key = (piece.dtype, piece.device)
    n = piece.numel()
    if key not in _SCRATCH or _SCRATCH[key].numel() < count * n:
        _SCRATCH[key] = torch.empty(count * n, dtype=piece.dtype, device=piece.device)
    return [_SCRATCH[key][k * n:(k + 1) * n] for k in range(count)]


def pipelined_ring_steps(chunks: list[torch.Tensor], steps: range, group, name: str, op=SUM) -> None:
    """Steps of the ring all-reduce as one stream: at step j every rank sends chunk rank+1+j to its left
    neighbour and receives chunk rank+2+j from its right one, reduced into ours (steps 0..N-2: reduce-scatter)
    or stored (steps N-1..2N-3: all-gather); the chunk received at step j is the one sent at step j+1."""
    me = dist.get_rank(group)
    n = dist.get_world_size(group)
    left = (me - 1) % n
    right = (me + 1) % n
    pieces = _segments(chunks)
    S = len(pieces[0])         # segments per chunk
    items = len(steps) * S     # item i: step steps[i // S], segment i % S
    if not items:
        return

    def step(i):
        """The ring step item i belongs to."""
        return steps[i // S]

    def piece(i, shift):
        """Item i's segment of the chunk sent (shift 1) or received (shift 2) at its step."""
        return pieces[(me + shift + step(i)) % n][i % S]

    def reduces(i):
        """Whether item i is reduced (the reduce-scatter) or only stored (the all-gather)."""
        return step(i) < n - 1

    scratch = _scratch(pieces[0][0], IN_FLIGHT) if reduces(0) else []

    def landing(i):
        """Where item i's received segment lands: scratch while reducing, its place in the all-gather."""
        return scratch[i % IN_FLIGHT][:piece(i, 2).numel()] if reduces(i) else piece(i, 2)

    recvs = {}
    sends = [isend(piece(i, 1), left, group, name) for i in range(min(S, items))]  # ours
    for i in range(items):
        while len(recvs) < items and (len(recvs) < i + IN_FLIGHT or not reduces(len(recvs))):
            recvs[len(recvs)] = irecv(landing(len(recvs)), right, group, name)
        if launch.VERBOSE:  # (formatting the line costs microseconds a step: not on the fast path)
            launch.trace(f"{name} step {step(i)} segment {i % S}: send chunk {(me + 1 + step(i)) % n} -> rank "
                         f"{left}, receive chunk {(me + 2 + step(i)) % n} <- rank {right}")
        wait(recvs[i])
        if reduces(i):
            reduce_into(piece(i, 2), landing(i), op)
        if i + S < items:  # pass on what just arrived first: the left neighbour is waiting for it
            sends.append(isend(piece(i + S, 1), left, group, name))
    for posted in sends:
        wait(posted)


def fused_exchange(flat: torch.Tensor, group, name: str, op=SUM) -> None:
    """The ring of two ranks, its two phases fused. Each rank would send the peer's half (reduce-scatter),
    then its own half once reduced (all-gather). Sending its own half as it is, at once, lets the peer
    reduce that half too: the same D bytes, one step instead of two, D/2 more additions per rank. Two
    operands commute exactly: still gloo's sums. Receives go first, so the peer's sends can land."""
    peer = 1 - dist.get_rank(group)
    pieces = _segments([flat])[0]
    ahead = EXCHANGE_AHEAD
    scratch = _scratch(pieces[0], ahead)

    def landing(k):
        """Where segment k of the peer's tensor lands: scratch, reused every `ahead` segments."""
        return scratch[k % ahead][:pieces[k].numel()]

    recvs = [irecv(landing(k), peer, group, name) for k in range(min(ahead, len(pieces)))]
    sends = [isend(piece, peer, group, name) for piece in pieces]
    for k, piece in enumerate(pieces):
        if launch.VERBOSE:
            launch.trace(f"{name}, N = 2, one exchange: segment {k} -> rank {peer}, rank {peer}'s <- and reduced")
        wait(recvs[k])
        wait(sends[k])  # the piece is ours to change only once it has left
        reduce_into(piece, landing(k), op)
        if k + ahead < len(pieces):
            recvs.append(irecv(landing(k + ahead), peer, group, name))


# ----------------------------------------------------------------------------- the library's ring


def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """ring_allreduce.ring_all_reduce (in place, like dist.all_reduce): as one stream on gloo, at N = 2 one
    exchange; under NCCL (or a recorded run that takes NCCL's paths: nccl_order.py) the textbook steps."""
    if launch.nccl(group):
        return textbook.ring_all_reduce(tensor, op, group)
    check_collective(tensor, op, group, "ring_all_reduce")
    n = dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    if n == 2 and flat.numel():
        fused_exchange(flat, group, "ring_all_reduce", op)
    else:
        chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n, flat.element_size())]
        pipelined_ring_steps(chunks, range(2 * n - 2), group, "ring_all_reduce", op)
    if op == AVG:
        flat.div_(n)
    return tensor if tensor.is_contiguous() else tensor.copy_(flat.view_as(tensor))


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """ring_allreduce.ring_reduce_scatter (like dist.reduce_scatter_single), as one stream on gloo."""
    if launch.nccl(group):
        return textbook.ring_reduce_scatter(output, input, op, group)
    chunks = textbook.reduce_scatter_chunks(output, input, op, group)
    n = dist.get_world_size(group)
    pipelined_ring_steps(chunks, range(n - 1), group, "ring_reduce_scatter", op)
    output.view(-1).copy_(chunks[dist.get_rank(group)])
    return output.div_(n) if op == AVG else output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """ring_allreduce.ring_all_gather (like dist.all_gather_single), as one stream on gloo."""
    if launch.nccl(group):
        return textbook.ring_all_gather(output, input, group)
    n = dist.get_world_size(group)
    chunks = textbook.all_gather_chunks(output, input, group)
    pipelined_ring_steps(chunks, range(n - 1, 2 * n - 2), group, "ring_all_gather")
    return output


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
    plain = "one message per step (textbook)"
    ours = "pipelined"
    tuned = (SEGMENT_BYTES, IN_FLIGHT, EXCHANGE_AHEAD)
    shapes = {plain: (1 << 62, 1, 1), ours: tuned}  # one segment a chunk, nothing posted ahead: the textbook's
    times = {}
    same = True
    for label, shape in shapes.items():
        SEGMENT_BYTES, IN_FLIGHT, EXCHANGE_AHEAD = shape
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
