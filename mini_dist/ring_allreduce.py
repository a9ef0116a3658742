"""Ring collectives from point-to-point sends: all-reduce = reduce-scatter + all-gather.

N ranks stand in a ring; each splits its D-byte tensor into N chunks. Reduce-scatter: in each of N-1
steps every rank sends one chunk to its neighbour and adds the chunk it receives into its own copy;
afterwards rank r holds chunk r reduced over all ranks. All-gather: N-1 more steps pass the finished
chunks around until everyone has all of them. Each rank sends

    reduce-scatter (N-1)/N * D  +  all-gather (N-1)/N * D  =  2(N-1)/N * D  bytes,

whatever N is: adding ranks does not add traffic per rank, and every link is busy at every step. The
naive way (everyone sends to a root, the root reduces and sends the result back) makes the root send
and receive (N-1) * D bytes, growing with N.

Which rank starts which chunk is not arbitrary here: we send to the LEFT neighbour (r -> r-1) and give
rank c chunk c, the layout gloo uses, so chunk c is summed in the order x[c-1] + x[c-2] + ... + x[c].
Floating-point addition is not associative; with the same order our result equals gloo's bit for bit.

Large chunks travel in segments of SEGMENT_BYTES: while segment k+1 is on the wire, segment k is being
reduced, so sending and adding overlap.

Demo (checks against dist.all_reduce / reduce_scatter_single / all_gather_single, prints the byte
ledger beside 2(N-1)/N*D and a bandwidth table; VERBOSE=1 prints every send and receive):

    torchrun --standalone --nproc_per_node=4 mini_dist/ring_allreduce.py [--bench]

Mirrors: torch.distributed.all_reduce / reduce_scatter_single / all_gather_single.
"""
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.launch import VERBOSE, conclude, device, print0, setup

SUM, AVG, MAX, MIN, PRODUCT = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                               dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
SEGMENT_BYTES = 1 << 20
GLOO_SEGMENT_BYTES = 1 << 20  # gloo ring: segments of at most 1 MiB (measured: see chunk_bounds)


@dataclass
class ByteLedger:
    """Bytes this rank put on the wire and took off it through the functions of this module."""
    sent: int = 0
    received: int = 0

    def reset(self) -> None:
        self.sent = self.received = 0


LEDGER = ByteLedger()


def _reduce_into(acc: torch.Tensor, incoming: torch.Tensor, op) -> None:
    if op in (SUM, AVG):
        acc.add_(incoming)
    elif op == PRODUCT:
        acc.mul_(incoming)
    elif op == MAX:
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def _ranks(group):
    """(my rank in the group, group size, global rank of group rank i)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    return me, n, lambda i: dist.get_global_rank(group, i) if group is not None else i


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]
OPS = [SUM, AVG, MAX, MIN, PRODUCT]
MAX_DIMS = 8


def _check_inputs(tensor: torch.Tensor, op, group, name: str) -> None:
    """Every rank shares (shape, dtype, op, device ok) first, so bad input fails everywhere at once:
    a rank that raised alone would leave the others waiting for it in the ring."""
    dims = min(tensor.dim(), MAX_DIMS)
    meta = [tensor.dim(), *tensor.shape[:dims], *[-1] * (MAX_DIMS - dims),
            DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else -1, OPS.index(op) if op in OPS else -1,
            int(tensor.device.type == device().type)]
    mine = torch.tensor(meta, dtype=torch.int64, device=device())
    everyone = torch.empty(dist.get_world_size(group) * len(meta), dtype=torch.int64, device=mine.device)
    dist.all_gather_single(everyone, mine, group=group)
    everyone = everyone.view(-1, len(meta)).tolist()
    describe = lambda m: f"shape {tuple(m[1:1 + min(m[0], MAX_DIMS)])} dtype {DTYPES[m[-3]]} op {OPS[m[-2]]}"
    for rank, theirs in enumerate(everyone):
        ndim, dtype_code, op_code, device_ok = theirs[0], *theirs[-3:]
        if op_code < 0:
            raise ValueError(f"{name}: rank {rank} asked for an unsupported op; use SUM, AVG, MAX, MIN or "
                             f"PRODUCT")
        if dtype_code < 0 or ndim > MAX_DIMS:
            raise ValueError(f"{name}: rank {rank} passed a tensor of an unsupported dtype or more than "
                             f"{MAX_DIMS} dims; use one of {DTYPES}")
        if not device_ok:
            raise ValueError(f"{name}: rank {rank} passed a tensor on the wrong device for backend "
                             f"{dist.get_backend(group)}; create it on mini_dist.launch.device() "
                             f"(cuda:LOCAL_RANK under NCCL, cpu under gloo)")
        if theirs != everyone[0]:
            raise ValueError(f"{name}: ranks disagree: rank 0 has {describe(everyone[0])}, rank {rank} "
                             f"has {describe(theirs)}; every rank must pass the same shape, dtype and op")
    if op == AVG and not tensor.is_floating_point():
        raise ValueError(f"{name}: AVG of {tensor.dtype} tensors would round; use SUM and divide")


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


def ring_schedule(n: int, rank: int) -> list[tuple[int, int]]:
    """For each of the N-1 reduce-scatter steps: (chunk rank sends left, chunk it receives from right).

    The all-gather steps shift the same pattern by one: forward the chunk that just arrived.
    """
    return [((rank + 1 + k) % n, (rank + 2 + k) % n) for k in range(n - 1)]


def _exchange(send: torch.Tensor, recv: torch.Tensor, left: int, right: int, reduce=None) -> None:
    """Send `send` to the left, receive `recv` from the right, in segments; reduce each as it lands."""
    seg = max(1, SEGMENT_BYTES // max(1, send.element_size()))
    sends = [dist.isend(send[i:i + seg], left) for i in range(0, send.numel(), seg)]
    pieces = [(i, dist.irecv(recv[i:i + seg], right)) for i in range(0, recv.numel(), seg)]
    for i, work in pieces:
        work.wait()
        if reduce is not None:
            reduce(i, recv[i:i + seg])
    for work in sends:
        work.wait()
    LEDGER.sent += send.numel() * send.element_size()
    LEDGER.received += recv.numel() * recv.element_size()


def _ring_reduce_scatter_chunks(chunks: list[torch.Tensor], op, group) -> None:
    """After this, chunks[rank] holds the reduction of chunk `rank` over every rank of the group."""
    me, n, global_rank = _ranks(group)
    left, right = global_rank((me - 1) % n), global_rank((me + 1) % n)
    for k, (send_c, recv_c) in enumerate(ring_schedule(n, me)):
        if VERBOSE and sum(c.numel() for c in chunks) <= 64:
            print(f"[rank {me}] reduce-scatter step {k}: send chunk {send_c} -> rank {(me - 1) % n}, "
                  f"recv chunk {recv_c} <- rank {(me + 1) % n}, reduce", flush=True)
        target = chunks[recv_c]
        buf = torch.empty_like(target)
        _exchange(chunks[send_c], buf, left, right,
                  reduce=lambda i, piece: _reduce_into(target[i:i + piece.numel()], piece, op))


def _ring_all_gather_chunks(chunks: list[torch.Tensor], group) -> None:
    """Each rank starts with chunks[rank] final; afterwards every rank has every chunk."""
    me, n, global_rank = _ranks(group)
    left, right = global_rank((me - 1) % n), global_rank((me + 1) % n)
    for k in range(n - 1):
        send_c, recv_c = (me + k) % n, (me + 1 + k) % n
        if VERBOSE and sum(c.numel() for c in chunks) <= 64:
            print(f"[rank {me}] all-gather step {k}: send chunk {send_c} -> rank {(me - 1) % n}, "
                  f"recv chunk {recv_c} <- rank {(me + 1) % n}", flush=True)
        _exchange(chunks[send_c], chunks[recv_c], left, right)


def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """In place, like dist.all_reduce: every rank ends with the reduction of every rank's tensor."""
    _check_inputs(tensor, op, group, "ring_all_reduce")
    n = dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n, flat.element_size())]
    _ring_reduce_scatter_chunks(chunks, op, group)
    if op == AVG:
        chunks[dist.get_rank(group)].div_(n)
    _ring_all_gather_chunks(chunks, group)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """Like dist.reduce_scatter_single: rank r gets block r of the reduced input (N equal blocks)."""
    _check_inputs(input, op, group, "ring_reduce_scatter")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, expected "
                         f"group size {n} x output's {output.numel()}")
    chunks = list(input.reshape(-1).clone().chunk(n)) if output.numel() else [output.view(-1)] * n
    _ring_reduce_scatter_chunks(chunks, op, group)
    if op == AVG:
        chunks[me].div_(n)
    output.view(-1).copy_(chunks[me])
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Like dist.all_gather_single: output = every rank's input, concatenated in rank order."""
    _check_inputs(input, SUM, group, "ring_all_gather")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if output.numel() != n * input.numel() or not output.is_contiguous():
        raise ValueError(f"ring_all_gather: output must be contiguous with group size {n} x input's "
                         f"{input.numel()} elements, got {output.numel()}")
    chunks = list(output.view(-1).chunk(n)) if input.numel() else [output.view(-1)] * n
    chunks[me].copy_(input.reshape(-1))
    _ring_all_gather_chunks(chunks, group)
    return output


def naive_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> torch.Tensor:
    """The baseline: everyone sends to rank 0, which reduces and sends the result back to everyone.

    Rank 0 receives and sends (N-1) * D bytes; the ring needs 2(N-1)/N * D on every rank.
    """
    _check_inputs(tensor, op, group, "naive_all_reduce")
    me, n, global_rank = _ranks(group)
    flat = tensor.reshape(-1).clone()
    nbytes = flat.numel() * flat.element_size()
    if me == 0:
        incoming = torch.empty_like(flat)
        for src in range(1, n):
            dist.recv(incoming, global_rank(src))
            _reduce_into(flat, incoming, op)
        if op == AVG:
            flat.div_(n)
        for dst in range(1, n):
            dist.send(flat, global_rank(dst))
        LEDGER.received += (n - 1) * nbytes
        LEDGER.sent += (n - 1) * nbytes
    else:
        dist.send(flat, global_rank(0))
        dist.recv(flat, global_rank(0))
        LEDGER.sent += nbytes
        LEDGER.received += nbytes
    tensor.copy_(flat.view_as(tensor))
    return tensor


# ----------------------------------------------------------------------------- demo


def bandwidth_table(sizes_kib: list[int]) -> list[tuple[int, float, float, float]]:
    """(KiB, native s, ring s, naive s) per message size: medians of interleaved runs, so that a noisy
    neighbour on a shared machine slows all three alike instead of whichever ran during the noise."""
    rows = []
    for kib in sizes_kib:
        x = torch.randn(kib * 256, device=device())
        times = {fn: [] for fn in (dist.all_reduce, ring_all_reduce, naive_all_reduce)}
        for repeat in range(max(3, min(30, (8 << 10) // kib))):
            for fn, samples in times.items():
                y = x.clone()
                dist.barrier()
                start = time.perf_counter()
                fn(y)
                if y.is_cuda:
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], device=x.device)
                dist.all_reduce(elapsed, op=MAX)  # a collective is as slow as its slowest rank
                if repeat:  # the first run of each size sets up buffers
                    samples.append(elapsed.item())
        rows.append((kib, *(sorted(v)[len(v) // 2] for v in times.values())))
    return rows


def _print_table(rows, n: int) -> None:
    print0(f"{'size':>9} | {'native':>9} | {'ring':>9} | {'naive':>9} | ring/native | "
           f"ring busbw GB/s")
    for kib, native, ring, naive in rows:
        busbw = 2 * (n - 1) / n * kib * 1024 / ring / 1e9
        size = f"{kib} KiB" if kib < 1024 else f"{kib >> 10} MiB"
        print0(f"{size:>9} | {native * 1e3:7.2f}ms | {ring * 1e3:7.2f}ms | {naive * 1e3:7.2f}ms | "
               f"{ring / native:11.2f} | {busbw:.2f}")


def demo() -> int:
    env = setup()
    n, r = env.world_size, env.rank
    g = torch.Generator().manual_seed(r)
    x = torch.randn(1000, 37, generator=g).to(env.device)
    native = x.clone()
    dist.all_reduce(native)
    ring = ring_all_reduce(x.clone())
    rs_in = torch.randn(n * 1000, generator=g).to(env.device)
    rs_native, rs_ring = torch.empty(1000, device=env.device), torch.empty(1000, device=env.device)
    dist.reduce_scatter_single(rs_native, rs_in)
    ring_reduce_scatter(rs_ring, rs_in)
    ag_native = torch.empty(n * 1000, device=env.device)
    dist.all_gather_single(ag_native, rs_in[:1000])
    ag_ring = ring_all_gather(torch.empty_like(ag_native), rs_in[:1000])
    diff = max((native - ring).abs().max().item(), (rs_native - rs_ring).abs().max().item())
    same = torch.equal(native, ring) and torch.equal(rs_native, rs_ring) and torch.equal(ag_native, ag_ring)
    print0(f"ring vs native on {n} ranks: all_reduce, reduce_scatter, all_gather "
           f"{'bit-identical' if same else f'max diff {diff:.3g}'}")

    D = 4 * (1 << 20) + 4 * 3  # not a multiple of N: chunks are uneven, the total is still exact
    LEDGER.reset()
    ring_all_reduce(torch.ones(D // 4, device=env.device))
    ring_sent = torch.tensor([LEDGER.sent], device=env.device)
    dist.all_reduce(ring_sent)  # over the ring: sum of bytes sent by every rank = 2(N-1) * D
    print0(f"ledger, ring all-reduce of D = {D} B: rank 0 sent {LEDGER.sent} B, mean over ranks "
           f"{ring_sent.item() / n:.1f} B, formula 2(N-1)/N*D = {2 * (n - 1) / n * D:.1f} B")
    ring_ok = ring_sent.item() == 2 * (n - 1) * D
    LEDGER.reset()
    naive_all_reduce(torch.ones(D // 4, device=env.device))
    print0(f"ledger, naive all-reduce: rank 0 sent {LEDGER.sent} B, formula (N-1)*D = {(n - 1) * D} B")
    naive_ok = LEDGER.sent == ((n - 1) * D if r == 0 else (D if n > 1 else 0))
    if VERBOSE:  # a tensor small enough that every send and receive is printed as it happens
        dist.barrier()
        print(f"[rank {r}] before: {(torch.arange(2.0 * n) + 10 * r).tolist()}", flush=True)
        after = ring_all_reduce(torch.arange(2.0 * n, device=env.device) + 10 * r)
        print(f"[rank {r}] after: {after.tolist()}", flush=True)
        dist.barrier()
    _print_table(bandwidth_table([1, 64, 1024] if "--bench" not in sys.argv else
                                 [1, 16, 256, 1024, 4096, 16384, 65536]), n)
    return conclude("ring_allreduce", same, "bit-identical to dist.all_reduce/RS/AG",
                    ring_ok and naive_ok, f"ring sent {ring_sent.item() / n:.0f} B/rank = 2(N-1)/N*D, "
                    f"naive root {(n - 1) * D} B = (N-1)*D")


if __name__ == "__main__":
    raise SystemExit(demo())
