"""The planner: pick the parallelism for a model and a cluster before renting either, by the cost model.

The method (`recommend`), as practitioners describe it (e.g. Hugging Face's Ultra-Scale Playbook):
memory math first (mini_dist.cost_model); the cheap baselines next (gradient accumulation, then activation
checkpointing); then the simplest parallelism that fits and whose traffic can hide behind compute: DDP,
ZeRO-1, ZeRO-2, FSDP across all GPUs, then TP inside a node, then PP across nodes. Ranks are laid out TP
innermost, then DP, then PP (mini_dist.mesh), so a TP group never leaves its node.

Figures often quoted, recomputed (`quoted_figures`; tests/test_planner.py asserts each), with their source:
  7B, Adam, mixed precision: 16 x 7e9 = 112 GB > 80 GB;      ZeRO paper (Rajbhandari et al. 2020), 16 bytes
    fully sharded over 8 GPUs: 14 GB each                    per parameter, ZeRO-3 divides all 16 by K
  3B: 48 GB                                                  the same 16 bytes per parameter
  70B as TP8 x PP4 x DP8 on 256 GPUs: 70e9/32 = 2.19B        Megatron-LM's 3D layout (Narayanan et al. 2021):
    parameters per GPU                                       TP and PP split the weights, DP copies them
  bubble P = 4: M = 16 3/19 = 15.8%, M = 32 3/35 = 8.6%       GPipe (Huang et al. 2019), the idle share of the
                                                             step; (P-1)/M = 18.8%, 9.4% is over compute time
  5% serial work caps the speed-up at 20x                    Amdahl 1967: as N -> inf; 18.6x on 256 GPUs
  ring all-reduce sends 2(N-1)/N x D per rank                Patarasuk and Yuan 2009
  "ZeRO-2 communicates less than DDP" is wrong               ZeRO paper Section 7.2.1: its reduce-scatter +
                                                             weight all-gather = one all-reduce's bytes

    python -m mini_dist.planner                        # the worked example: 7B on 8 x 80 GB
    python -m mini_dist.planner --params 70B --layers 80 --hidden 8192 --heads 64 --seq 4096 --gpus 256
    python -m mini_dist.planner --help                 # every flag; a mistake is one line and exit status 2
"""
import argparse
import sys
from dataclasses import replace

if not __package__:  # run as `python mini_dist/planner.py`: put the repo, not mini_dist/, on the path
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import (GB, OPTIMIZERS, PRECISIONS, STAGES, Cluster, Estimate, Model, Plan,
                                  amdahl, bubble, bytes_per_param, collective_bytes, evaluate, gpt_params,
                                  model_state_bytes, need, shard, validate)


def layouts(model: Model, cluster: Cluster) -> list[tuple[int, int]]:
    """(tp, pp) in the method's order: no model split, TP inside a node, then full-node TP + PP across."""
    n, node = cluster.gpus, min(cluster.gpus, cluster.gpus_per_node)
    tps = [t for t in range(1, node + 1) if node % t == 0 and (not model.heads or model.heads % t == 0)]
    pps = [p for p in range(2, n // tps[-1] + 1) if n // tps[-1] % p == 0 and
           (not model.layers or model.layers % p == 0)]
    return [(t, 1) for t in tps] + [(tps[-1], p) for p in pps]


def candidates(model: Model, cluster: Cluster, base: Plan):
    """Every plan the method tries, simplest first; the baselines before more parallelism."""
    b, m = base.micro_batch, base.microbatches
    smaller = [d for d in range(b, 0, -1) if b % d == 0] if model.layers else [b]
    for tp, pp in layouts(model, cluster):
        for zero in STAGES:
            for ckpt in ([False, True] if model.layers else [False]):
                for micro in smaller:  # gradient accumulation: smaller microbatches, same effective batch
                    yield replace(base, dp=cluster.gpus // (tp * pp), tp=tp, pp=pp, zero=zero,
                                  checkpoint=ckpt, micro_batch=micro, microbatches=m * b // micro)


def recommend(model: Model, cluster: Cluster, base: Plan) -> Estimate | None:
    """The first plan in the method's order that fits and whose traffic could hide behind its compute;
    failing that the first that fits; None if nothing fits."""
    fitting = [e for e in (evaluate(model, p, cluster) for p in candidates(model, cluster, base)) if e.fits]
    return next((e for e in fitting if e.traffic_hidden), fitting[0] if fitting else None)


# ----------------------------------------------------------------------------- terminal


def _gb(x) -> str:
    return "?" if x is None else f"{x / GB:.1f}"


def _s(x) -> str:
    return "?" if x is None else f"{x:.2f}s" if x < 100 else f"{x:.0f}s"


def table(estimates: list[Estimate]) -> str:
    head = (f"{'strategy (GB per GPU)':<30}{'weights':>7}{'grads':>7}{'optim':>7}{'act':>8}{'+ckpt':>7}"
            f"{'total':>8}{'fits':>5} |{'sent GB':>8}{'comm':>8}{'compute':>8}{'bubble':>7}{'batch':>6}")
    lines = [head, "-" * len(head)]
    for e in estimates:
        sent = None if None in e.traffic.values() else sum(e.traffic.values())
        act, ckpt = e.activations or (None, None)
        lines.append(f"{e.plan.name:<30}{''.join(f'{_gb(x):>7}' for x in e.states)}{_gb(act):>8}"
                     f"{_gb(ckpt):>7}{_gb(e.total):>8}{'yes' if e.fits else 'no':>5} |{_gb(sent):>8}"
                     f"{_s(e.comm_s):>8}{_s(e.compute_s):>8}{e.bubble:>7.1%}{e.effective_batch:>6}")
    return "\n".join(lines)


def report(model: Model, cluster: Cluster, base: Plan, extra=(), serial=None) -> str:
    """The table of strategies, then the recommendation, step by step as the method goes."""
    rows = [replace(base, dp=cluster.gpus, zero=z) for z in STAGES]
    rows += [replace(base, dp=cluster.gpus // (t * p), tp=t, pp=p, zero=1)
             for t, p in layouts(model, cluster)[1:]]
    estimates, best = {}, recommend(model, cluster, base)
    for plan in rows + list(extra):  # checkpoint a row only when it needs that to fit
        e = evaluate(model, plan, cluster)
        if not e.fits and model.layers and not plan.checkpoint:
            e = evaluate(model, replace(plan, checkpoint=True), cluster)
        estimates.setdefault(e.plan, e)
    if best:
        estimates.setdefault(best.plan, best)
    w, g, o = bytes_per_param(base.precision, base.optimizer)
    states = model.params * (w + g + o)
    mixed = ("bf16 + fp32 master would halve activations and traffic (states stay: the master copy eats "
             "what half weights and grads save)"
             if base.precision == "fp32" else f"{base.precision} halves activations and traffic")
    out = [table(list(estimates.values())), "",
           f"1. memory: {model.params / 1e9:.2f}B params x {w + g + o} B ({base.precision} weights {w}, "
           f"grads {g}, {base.optimizer} state and fp32 master {o}) = {_gb(states)} GB: "
           f"{'fits' if states <= cluster.memory_gb * GB else 'does not fit'} one "
           f"{cluster.memory_gb:g} GB GPU",
           f"2. baselines: {mixed}; then gradient accumulation; then activation checkpointing"]
    if best is None:
        out.append(f"3. nothing fits in {cluster.memory_gb:g} GB per GPU: add GPUs or memory")
    else:
        p, hidden = best.plan, best.traffic_hidden
        out.append(f"3. simplest that fits{' with traffic hidden by compute' if hidden else ''}: {p.name}, "
                   f"{_gb(best.total)} GB/GPU\n   micro-batch {p.micro_batch} x {p.microbatches} "
                   f"microbatches x DP {p.dp} = batch {best.effective_batch}; comm {_s(best.comm_s)} "
                   f"vs compute {_s(best.compute_s)}{' incl. recompute' * p.checkpoint} per step")
    if serial is not None:
        out.append(f"Amdahl, {serial:.0%} serial: {amdahl(serial, cluster.gpus):.1f}x on {cluster.gpus} GPUs"
                   + (f", never above {1 / serial:.0f}x" if serial else ""))
    return "\n".join(out)


def quoted_figures() -> list[tuple[str, bool]]:
    """Figures often quoted, recomputed with the cost model: (the figure as computed, whether it holds)."""
    b = 10 ** 9
    adam7, fsdp7, adam3 = (sum(model_state_bytes(n * b, k, z)) for n, k, z in ((7, 1, 0), (7, 8, 3),
                                                                                 (3, 1, 0)))
    per_gpu70, ring = shard(70 * b, 8 * 4), collective_bytes("all_reduce", 4000, 4, 1)
    return [(f"7B Adam mixed: {_gb(adam7)} GB > 80 GB", adam7 == 112 * b > 80 * b),
            (f"7B FSDP over 8: {_gb(fsdp7)} GB/GPU", fsdp7 == 14 * b),
            (f"3B: {_gb(adam3)} GB", adam3 == 48 * b),
            (f"70B as TP8 x PP4: {per_gpu70 / b:.4g}B params/GPU", round(per_gpu70 / b, 1) == 2.2),
            (f"bubble P=4: M=16 {bubble(4, 16):.1%}, M=32 {bubble(4, 32):.1%}",
             round(bubble(4, 16), 2) == 0.16 and round(bubble(4, 32), 2) == 0.09),
            (f"5% serial: {amdahl(0.05, 10 ** 12):.3f}x as N -> inf", round(amdahl(0.05, 10 ** 12), 6) == 20),
            (f"ring all-reduce of D = 4000 B over N = 4: {ring} B = 2(N-1)/N x D per rank", ring == 6000)]


# ----------------------------------------------------------------------------- command line


class CommandLine(argparse.ArgumentParser):
    """argparse, except that every mistake (an unknown flag, a bad value, a plan that cannot be) is one
    line, `python -m mini_dist.planner: error: what to change`, and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def count(text: str) -> int:
    """'7B', '1.3e9', '125M' -> an integer count."""
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}.get(text[-1:].upper(), 1)
    try:
        return round(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: write it like 7B, 1.3e9 or 125M") from None


FLAGS = [  # name, type, default, help
    ("params", count, None, "parameter count: 7B, 1.3e9, 125M; None: counted from the shape"),
    ("layers", int, 0, "L, transformer layers (0: shape unknown: no activations, TP or PP traffic)"),
    ("hidden", int, 0, "h, hidden size"), ("heads", int, 0, "a, attention heads"),
    ("vocab", int, 32000, "V, vocabulary (for the count from the shape)"), ("seq", int, 2048, "s, tokens"),
    ("micro-batch", int, 1, "b, sequences per GPU per microbatch"),
    ("microbatches", int, 1, "M, gradient-accumulation steps or pipeline microbatches"),
    ("gpus", int, 8, "GPUs in all"), ("gpus-per-node", int, 8, "GPUs per node"),
    ("tp", int, 0, "one more row to compare: this tensor-parallel degree (0: none)"),
    ("pp", int, 0, "... and this pipeline degree (0: none)"),
    ("zero", int, 1, "... and this ZeRO stage (0 DDP, 1, 2, 3 FSDP)"),
    ("memory-gb", float, 80.0, "memory per GPU, GB"), ("intra-gbps", float, 450.0, "GB/s per GPU inside a node"),
    ("inter-gbps", float, 50.0, "GB/s per GPU across nodes"), ("tflops", float, 400.0, "achieved TFLOP/s per GPU"),
    ("serial", float, None, "serial fraction of the work, for Amdahl's law; None: not shown")]


def parser() -> CommandLine:
    ap = CommandLine(prog="python -m mini_dist.planner", description=__doc__.split("\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, kind, default, text in FLAGS:
        ap.add_argument(f"--{name}", type=kind, default=default, help=text)
    ap.add_argument("--precision", default="bf16", choices=list(PRECISIONS), help="weights and activations")
    ap.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS), help="its fp32 state per parameter")
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint activations in every row")
    return ap


def cli(argv: list[str]) -> tuple[Model, Cluster, Plan]:
    """Parse the command line and print the report; a mistake exits 2 with one line saying what to change."""
    ap = parser()
    a = ap.parse_args(argv)
    try:
        shape = (a.layers, a.hidden, a.heads)
        need(a.params is not None or any(shape), "give --params, or --layers --hidden --heads (and --vocab --seq)")
        need(not any(shape) or all(shape), f"give all of --layers --hidden --heads or none, got {shape}")
        model = Model(a.params if a.params is not None else gpt_params(a.layers, a.hidden, a.vocab, a.seq),
                      a.layers, a.hidden, a.heads, a.seq)
        cluster = Cluster(a.gpus, a.gpus_per_node, a.memory_gb, a.intra_gbps, a.inter_gbps, a.tflops)
        base = Plan(a.gpus, 1, 1, 0, a.checkpoint, a.micro_batch, a.microbatches, a.precision, a.optimizer)
        tp, pp = a.tp or 1, a.pp or 1  # 0: not given
        extra = [replace(base, dp=a.gpus // max(1, tp * pp), tp=tp, pp=pp, zero=a.zero)] * bool(a.tp or a.pp)
        for plan in [base, *extra]:
            validate(model, plan, cluster)
        if a.serial is not None:
            amdahl(a.serial, a.gpus)
    except ValueError as e:
        ap.error(str(e))
    print(report(model, cluster, base, extra, a.serial))
    return model, cluster, base


def demo() -> int:
    """The worked example, the figures often quoted, and the recommended plan's states against 4N + 12N/K."""
    argv = "--params 7B --layers 32 --hidden 4096 --heads 32 --seq 4096 --microbatches 8 --serial 0.05"
    print(f"worked example: python -m mini_dist.planner {argv}\n")
    model, cluster, base = cli(argv.split())
    checks = quoted_figures()
    print("\nfigures often quoted, recomputed:\n" + "\n".join(f"  {'ok' if ok else 'FAIL'} {text}"
                                                              for text, ok in checks))
    best, n, k = recommend(model, cluster, base), model.params, base.dp
    formula = 4 * n + 12 * n // k if best and best.plan.zero == 1 else None  # ZeRO-1's states
    passed, figure_ok = sum(ok for _, ok in checks), best is not None and sum(best.states) == formula
    plan, states = (best.plan.name, _gb(sum(best.states))) if best else ("nothing fits", "?")
    print(f"SUMMARY|planner|{'PASS' if passed == len(checks) else 'FAIL'} figures often quoted "
          f"{passed}/{len(checks)}|{'PASS' if figure_ok else 'FAIL'} 7B on 8x80GB: {plan}, "
          f"states {states} GB/GPU = 4N + 12N/K {_gb(formula)} GB")
    return 0 if passed == len(checks) and figure_ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        cli(sys.argv[1:])  # the report for these arguments
    else:
        raise SystemExit(demo())
