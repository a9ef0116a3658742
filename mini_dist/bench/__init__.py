"""Every head-to-head timing against PyTorch's native implementation, in one place.

    torchrun --standalone --nproc_per_node=4 -m mini_dist.bench              # all of them
    torchrun --standalone --nproc_per_node=4 -m mini_dist.bench ddp zero     # some of them
    ./run.sh bench [NPROC] [NAMES]                                           # the same, through run.sh

How we time, so that a busy, shared machine says as little as possible about the result:
- the two sides take turns (ours, native, native, ours, ...), so noise slows both alike;
- before each timed call every rank meets at a barrier, and a call lasts as long as its slowest rank
  (one all-reduce of MAX of the ranks' times), because a collective is as slow as its slowest rank;
- warm-up calls are dropped, and we report medians: of each side's times and of the paired ratios.

Each file of this package registers its benchmarks in BENCHES = {name: function(args) -> [Result]}.
The runner prints one table, each ratio beside its target, and exits non-zero when a ratio misses its
target in this run (a benchmark, not a unit test: the test suite stays free of timing).
"""
from dataclasses import dataclass, field

from mini_dist.kit import launch
from mini_dist.kit.timing import median, paired, quantile, timed  # noqa: F401  (the runner's)


@dataclass
class Result:
    """One row of the table: ours against the native reference (seconds, medians), the target ratio."""
    name: str
    ours: float
    native: float
    ratio: float           # median of paired ratios ours/native (not ours/native of the medians)
    target: float | None   # ours/native must be <= target; None: measured, no target
    note: str = ""
    times: dict = field(default_factory=dict, repr=False)  # {"ours": [s, ...], "native": [...]}, in pairs
    limit_s: float | None = None  # ours must also take at most this long (a wait a person sits through)

    @property
    def ok(self) -> bool:
        within_target = self.target is None or self.ratio <= self.target
        return within_target and (self.limit_s is None or self.ours <= self.limit_s)


def compare(name: str, ours, native, repeats: int, target: float | None, warmup: int = 1, note: str = "",
            group=None, limit_s: float | None = None) -> Result:
    """Time ours() against native() in turns: a Result with both medians and the median paired ratio.
    Rank 0 prints the row the moment it is measured: a whole run takes minutes."""
    t = paired({"ours": ours, "native": native}, repeats, warmup, group)
    ratio = median([a / b for a, b in zip(t["ours"], t["native"])])
    result = Result(name, median(t["ours"]), median(t["native"]), ratio, target, note, t, limit_s)
    launch.print0(f"  {name}: mini_dist {fmt_seconds(result.ours)}, native {fmt_seconds(result.native)}, ratio "
                  f"{ratio:.2f}x (median of {repeats} paired ratios){'' if result.ok else ' MISS'}")
    return result


def with_debug(fn, on: bool):
    """fn with mini_dist's debug checks (MINI_DIST_DEBUG) switched on or off for the call: their price."""
    from mini_dist.kit import debug

    def call():
        saved, debug.DEBUG = debug.DEBUG, on
        try:
            fn()
        finally:
            debug.DEBUG = saved
    return call


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def table(results: list[Result]) -> str:
    """One row per benchmark: each side's median time per call, the ratio, its target. The ratio is the median
    of the paired ratios ours/native, not the ratio of the two medians: "1.23 ms | 2.44 ms | 1.11x" is no error."""
    rows = [("benchmark", "mini_dist (median)", "native (median)", "ours/native: median of pairs", "target", "", "")]
    rows += [(r.name, fmt_seconds(r.ours), fmt_seconds(r.native), f"{r.ratio:.2f}x",
              f"<= {r.target:g}x" if r.target is not None else f"ours <= {r.limit_s:g} s" if r.limit_s else "-",
              "ok" if r.ok else "MISS", r.note)
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "\n".join([" | ".join(c.ljust(w) for c, w in zip(row, widths)) + (f" | {row[6]}" if row[6] else "")
                      for row in rows] + ["times: per call, slowest rank; ratio: the median over the pairs of "
                                          "(our time / native time in the same pair), < 1 means ours is faster"])
