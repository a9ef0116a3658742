"""Ring collectives (the library's: mini_dist.ring_pipelined) against gloo's own, and where the ring's time goes.

    ./run.sh bench 4 collectives        (and ./run.sh bench 2 collectives)

Four parts, all in one run:
- the table: ring / native time for all-reduce, reduce-scatter and all-gather, D from 4 KiB to 16 MiB
  (D = the whole tensor: the all-reduced one, the reduce-scatter's input, the all-gather's output). Targets:
  <= 1.2x from 256 KiB up, where bytes dominate; <= 2x below, where each of the 2(N-1) steps is a
  wake-up of a waiting process, and the ring's tens of microseconds of Python per step (post, wait,
  slice) count. Beside each row, the bus bandwidth
  of both (nccl-tests' convention: all-reduce 2(N-1)/N*D / t, the other two (N-1)/N*D / t);
- the machine's limit: one core's memory-copy bandwidth, measured here, beside those bus bandwidths
  (over TCP loopback every byte is copied at least twice: into the kernel and out of it);
- a profile of one ring all-reduce per size, on the rank that took longest: time spent posting sends
  and receives (milliseconds at 16 MiB: gloo writes a send into the socket from the calling thread
  when it can, so posting includes that copy into the kernel), waiting for them (the neighbour's data
  on the wire, or the neighbour itself, still busy or not yet scheduled), reducing (reduce_into:
  reading two buffers, writing one) and the rest, Python between steps; beside gloo's whole
  all-reduce, which does the same sends, receives and reductions in C++ on its own thread. Also the
  price of MINI_DIST_DEBUG=1's agreement check;
- the all-reduce rows' own samples split in two: the 10th percentile (a call nothing got in the way of)
  and the share of calls that lost STALL_S or more to the machine.

Why 2 ranks are harder than 4 on 2 cores. At N = 2 the left and the right neighbour are the same rank,
so every send and receive goes through one gloo pair: one socket, one lock. gloo moves a message only
once the receiver has posted for it; a send posted after that writes its segment into the socket from
the calling thread, holding the pair's lock. If the peer's data arrives meanwhile, the rank's own gloo
I/O thread wakes, finds the lock taken and goes back to epoll_wait, which reports the same readable
socket at once: it spins, and it can hold the core the lock holder needs until the scheduler's next
tick. perf sched shows such runs of the I/O thread lasting 4-5 ms, perf record puts them in epoll_wait
and Pair::handleEvents. gloo's all-reduce posts the same sends from its worker thread and stalls too,
from 256 KiB to 4 MiB less often than the ring; at N >= 3 sends (left) and receives (right) use
different pairs and locks. (batch_isend_irecv would not change this on gloo: the backend does not
coalesce, so torch runs it as the same isend/irecv calls, one by one.) At N = 2 the all-reduce is one
exchange of the whole tensor (ring_pipelined.fused_exchange) with its receives posted first, EXCHANGE_AHEAD
of them: of the orders and depths measured, the one that stalled least.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from mini_dist import bench
from mini_dist import ring_pipelined
from mini_dist.kit import debug, launch

SIZES_KIB = [4, 64, 256, 1024, 4096, 16384]
STALL_S = 2.5e-3  # a call that lost this much waited for a core: more than half a 4 ms scheduler tick


def target(nbytes: int) -> float:
    return 1.2 if nbytes >= 256 << 10 else 2.0


# Pairs per row, enough that the median ratio is stable from run to run: a third of the calls lose
# milliseconds to the scheduler, at random. With 9 pairs at 4 MiB one run said 0.9x and the next 1.9x;
# with 41, the 2-rank all-reduce at 4 MiB still moved between 1.0x and 1.33x on one day.
REPEATS = 101


def size_name(kib: int) -> str:
    return f"{kib} KiB" if kib < 1024 else f"{kib >> 10} MiB"


def zeros(numel: int) -> torch.Tensor:
    """A buffer of the benchmark: fp32 zeros on the rank's device."""
    return torch.zeros(numel, device=launch.device())


def cases(numel: int, n: int):
    """(name, ring call, native call, bytes on the ring per D): fp32 buffers, zeros (the values do not
    change the cost, and repeated sums stay finite)."""
    x = zeros(numel)  # the ring's all-reduce
    y = zeros(numel)  # gloo's
    full = zeros(numel)
    shard = zeros(numel // n)
    out = zeros(numel)
    return [
        ("all_reduce", lambda: ring_pipelined.ring_all_reduce(x), lambda: dist.all_reduce(y), 2 * (n - 1) / n),
        ("reduce_scatter", lambda: ring_pipelined.ring_reduce_scatter(shard, full),
         lambda: dist.reduce_scatter_single(shard, full), (n - 1) / n),
        ("all_gather", lambda: ring_pipelined.ring_all_gather(out, shard), lambda: dist.all_gather_single(out, shard),
         (n - 1) / n),
    ]


def memcpy_bandwidth(nbytes: int = 16 << 20) -> float:
    """Bytes per second the device copies (one core on the CPU; median of 21 copies of a buffer larger than
    the caches; a GPU copy is waited for)."""
    a = torch.ones(nbytes // 4, device=launch.device())
    b, times = torch.empty_like(a), []
    for _ in range(21):
        start = time.perf_counter()
        b.copy_(a)
        if a.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / bench.median(times)


@contextlib.contextmanager
def profiled(spent: dict):
    """Time every isend/irecv call, every wait on what they return, and every reduce_into of the ring.
    (Under NCCL the ring posts batches, built from the real dist.isend: the batch call is timed instead.)"""
    posts = ["batch_isend_irecv"] if dist.get_backend() == dist.Backend.NCCL else ["isend", "irecv"]
    originals = {name: getattr(dist, name) for name in posts}, ring_pipelined.reduce_into

    class TimedWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            start = time.perf_counter()
            try:
                return self.work.wait()
            finally:
                spent["waiting"] += time.perf_counter() - start

    def timed(fn, key, wrap=False):
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            spent[key] += time.perf_counter() - start
            if not wrap:
                return result
            return [TimedWork(w) for w in result] if isinstance(result, list) else TimedWork(result)
        return call
    for name, fn in originals[0].items():
        setattr(dist, name, timed(fn, "posting", True))
    ring_pipelined.reduce_into = timed(ring_pipelined.reduce_into, "reducing")
    try:
        yield spent
    finally:
        for name, fn in originals[0].items():
            setattr(dist, name, fn)
        ring_pipelined.reduce_into = originals[1]


def profile_row(numel: int) -> list[float]:
    """[total, posting, waiting, reducing, rest] of one ring all-reduce on the rank that took longest
    (median over 9 calls), and gloo's all-reduce of the same tensor (median, slowest rank)."""
    x = torch.zeros(numel, device=launch.device())
    n = dist.get_world_size()
    rows = []
    gloo = []
    for i in range(10):
        spent = dict.fromkeys(["posting", "waiting", "reducing"], 0.0)
        dist.barrier()
        with profiled(spent):
            start = time.perf_counter()
            ring_pipelined.ring_all_reduce(x)
            total = time.perf_counter() - start
        mine = torch.tensor([total, spent["posting"], spent["waiting"], spent["reducing"]], dtype=torch.float64,
                            device=launch.device())
        everyone = torch.empty(n * 4, dtype=torch.float64, device=launch.device())
        dist.all_gather_single(everyone, mine)
        gloo.append(bench.timed(lambda: dist.all_reduce(x)))
        if i:  # the first call allocates; drop it
            total, *parts = max(everyone.view(n, 4).tolist())
            rows.append([total, *parts, total - sum(parts)])
    rows.sort()
    return rows[len(rows) // 2] + [bench.median(gloo)]


def split(times: list[float]) -> tuple[float, float, float]:
    """(10th percentile, median, share of calls that took STALL_S longer than the 10th percentile)."""
    fast = bench.quantile(times, 0.1)
    return fast, bench.median(times), sum(t > fast + STALL_S for t in times) / len(times)


def debug_cost(n: int) -> list[bench.Result]:
    """MINI_DIST_DEBUG=1 against off: one all_gather_object of (op, shape, dtype, call site) per call."""
    results = []
    for kib in (4, 1024):
        x = torch.zeros(kib * 256, device=launch.device())

        def with_debug():
            saved = debug.DEBUG
            debug.DEBUG = True
            try:
                ring_pipelined.ring_all_reduce(x)
            finally:
                debug.DEBUG = saved
        results.append(bench.compare(f"ring all_reduce {size_name(kib)}, MINI_DIST_DEBUG=1 vs off", with_debug,
                                     lambda: ring_pipelined.ring_all_reduce(x), REPEATS, None,
                                     note="the agreement check's price"))
    return results


def run_collectives(args) -> list[bench.Result]:
    n = dist.get_world_size()
    results = []
    busbw = {}  # (collective, KiB) -> (ring, gloo) bus bandwidth, GB/s
    for kib in SIZES_KIB:
        nbytes = kib << 10
        for name, ours, native, per_d in cases(nbytes // 4, n):
            r = bench.compare(f"ring {name} {size_name(kib)}", ours, native, REPEATS, target(nbytes))
            ring_gbps = per_d * nbytes / r.ours / 1e9  # nccl-tests' bus bandwidth: the ring's bytes over the time
            gloo_gbps = per_d * nbytes / r.native / 1e9
            r.note = f"busbw ring {ring_gbps * 1e3:,.1f} / gloo {gloo_gbps * 1e3:,.1f} MB/s"
            busbw[(name, kib)] = (ring_gbps, gloo_gbps)
            results.append(r)
    results += debug_cost(n)

    copy = torch.tensor([memcpy_bandwidth() if dist.get_rank() == 0 else 0.0], dtype=torch.float64,
                        device=launch.device())
    dist.broadcast(copy, 0)
    launch.print0(f"memory-copy bandwidth, one core: {copy.item() / 1e9:.1f} GB/s; the best bus bandwidth above: "
                  f"ring {max(v[0] for v in busbw.values()):.2f}, gloo {max(v[1] for v in busbw.values()):.2f} GB/s "
                  f"(each byte crosses the kernel twice on TCP loopback, and {n} ranks share the cores)")
    steps = "one exchange with both phases fused" if n == 2 else f"2(N-1) = {2 * n - 2} steps"
    launch.print0(f"\nwhere one ring all-reduce's time goes on {n} ranks, {steps} (slowest rank, median of 9, ms; "
                  f"Python = the rest, this profiler's own few us per call included):")
    launch.print0(f"{'D':>7} | {'ring':>7} | {'posting':>7} | {'waiting':>7} | {'reducing':>8} | {'Python':>7} | "
                  f"{'gloo':>7}")
    for kib in SIZES_KIB:
        total, posting, waiting, reducing, rest, gloo = profile_row(kib << 8)
        launch.print0(f"{size_name(kib):>7} | {total * 1e3:7.2f} | {posting * 1e3:7.2f} | {waiting * 1e3:7.2f} | "
                      f"{reducing * 1e3:8.2f} | {rest * 1e3:7.2f} | {gloo * 1e3:7.2f}")
    launch.print0(f"\nthe all-reduce rows above, their own samples split in two (ms): q10 = a call nothing got in "
                  f"the way of; stalled = calls {STALL_S * 1e3:g} ms or more slower than that")
    launch.print0(f"{'D':>7} | {'ring q10':>8} | {'median':>6} | {'stalled':>7} | {'gloo q10':>8} | {'median':>6} | "
                  f"{'stalled':>7}")
    for r in results:
        if r.name.startswith("ring all_reduce") and r.target is not None:
            (a, b, c), (d, e, f) = split(r.times["ours"]), split(r.times["native"])
            launch.print0(f"{r.name.split('all_reduce ')[1]:>7} | {a * 1e3:8.2f} | {b * 1e3:6.2f} | {c:7.0%} | "
                          f"{d * 1e3:8.2f} | {e * 1e3:6.2f} | {f:7.0%}")
    return results


BENCHES = {"collectives": run_collectives}
