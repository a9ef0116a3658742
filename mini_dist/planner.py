"""The planner: pick the parallelism for a model and a cluster before renting either, by the cost model.

A plan (`evaluate`) costs, per GPU, the memory of its model states and activations, the bytes it sends and
the seconds those take (bytes / bandwidth: NVLink inside a node, InfiniBand across), the compute (6 FLOPs
per parameter per token) and the pipeline bubble, all by the formulas of mini_dist/cost_model.py.

The method (`recommend`), as practitioners describe it (e.g. Hugging Face's Ultra-Scale Playbook):
memory math first; the cheap baselines next (gradient accumulation, then activation checkpointing); then
the simplest parallelism that fits and whose traffic can hide behind compute: DDP, ZeRO-1, ZeRO-2, FSDP
across all GPUs, then TP inside a node, then PP across nodes. Ranks are laid out TP innermost, then DP,
then PP (mini_dist.mesh), so a TP group never leaves its node.

Figures often quoted, recomputed (`quoted_figures`, asserted by tests/test_planner.py), with their source:
  7B, Adam, mixed precision: 16 x 7e9 = 112 GB > 80 GB; fully sharded over 8: 14 GB each; 3B: 48 GB (ZeRO)
  70B as TP8 x PP4 x DP8 on 256 GPUs: 70e9/32 = 2.19B parameters per GPU (Megatron-LM, Narayanan et al. 2021)
  bubble P = 4: M = 16 15.8%, M = 32 8.6% of the step (GPipe); 5% serial caps the speed-up at 20x (Amdahl)
  a ring all-reduce sends 2(N-1)/N x D per rank (Patarasuk and Yuan 2009); "ZeRO-2 communicates less than
  DDP" is wrong: its reduce-scatter + all-gather are an all-reduce's bytes (ZeRO paper, Section 7.2.1)

    python -m mini_dist.planner                        # the worked example: 7B on 8 x 80 GB
    python -m mini_dist.planner --params 70B --layers 80 --hidden 8192 --heads 64 --seq 4096 --gpus 256
    python -m mini_dist.planner --help                 # every flag; a mistake is one line and exit status 2
"""
import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

if not __package__:  # run as `python mini_dist/planner.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import (GB, OPTIMIZERS, PRECISIONS, STAGES, Cluster, Model, Plan, activation_bytes,
                                  amdahl, bubble, bytes_per_param, collective_bytes, dp_traffic, gpt_params,
                                  measured_model_state_bytes, model_state_bytes, need, pp_traffic, shard,
                                  tp_traffic, validate)


@dataclass(frozen=True)
class Estimate:
    """One plan's costs on one GPU (the busiest), per step."""
    plan: Plan
    states: tuple[int, int, int]         # weights, gradients, optimizer state: bytes per GPU
    activations: tuple[int, int] | None  # bytes per GPU without, with checkpointing (None: shape unknown)
    traffic: dict                        # "dp" / "tp" / "pp" -> bytes sent per GPU per step (None: unknown)
    comm_s: float | None                 # seconds per step those bytes take
    compute_s: float                     # seconds per step of FLOPs, recomputation included
    bubble: float                        # idle share of the step
    effective_batch: int                 # sequences per step, all GPUs together
    total: int                           # bytes per GPU: states + the activations the plan keeps
    fits: bool

    @property
    def traffic_hidden(self) -> bool:
        """Could overlap hide the traffic behind useful compute (recomputation does not count)?"""
        useful = self.compute_s * (6 / 8 if self.plan.checkpoint else 1)
        return self.comm_s is not None and self.comm_s <= useful


def evaluate(model: Model, plan: Plan, cluster: Cluster) -> Estimate:
    """One plan's memory per GPU by component, its traffic and the time that takes, compute and bubble."""
    validate(model, plan, cluster)
    per_gpu = shard(model.params, plan.tp * plan.pp)  # TP and PP split the weights, DP copies them
    states = model_state_bytes(per_gpu, plan.dp, plan.zero, plan.precision, plan.optimizer)
    acts = activation_bytes(model, plan)
    known = bool(model.layers)
    traffic = {"dp": sum(dp_traffic(per_gpu, plan).values()),
               "tp": tp_traffic(model, plan) if known else (0 if plan.tp == 1 else None),
               "pp": pp_traffic(model, plan) if known else (0 if plan.pp == 1 else None)}

    def bandwidth(span: int) -> float:  # a group of `span` consecutive ranks sits inside one node?
        inside = cluster.gpus <= cluster.gpus_per_node or cluster.gpus_per_node % span == 0
        return (cluster.intra_gbps if inside else cluster.inter_gbps) * GB
    spans = {"dp": plan.tp * plan.dp, "tp": plan.tp, "pp": cluster.gpus}
    comm = None if None in traffic.values() else sum(traffic[a] / bandwidth(spans[a]) for a in traffic)
    tokens = plan.micro_batch * plan.microbatches * model.seq
    compute = (8 if plan.checkpoint else 6) * per_gpu * tokens / (cluster.tflops * 1e12)
    total = sum(states) + (acts[plan.checkpoint] if acts else 0)
    return Estimate(plan, states, acts, traffic, comm, compute, bubble(plan.pp, plan.microbatches),
                    plan.micro_batch * plan.microbatches * plan.dp, total, total <= cluster.memory_gb * GB)


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


def _gb(x) -> str:  # bytes as GB, ? where unknown
    return "?" if x is None else f"{x / GB:.1f}"


def _s(x) -> str:  # seconds
    return "?" if x is None else f"{x:.2f}s" if x < 100 else f"{x:.0f}s"


def table(estimates: list[Estimate]) -> str:
    """One row per plan: GB held per GPU (act: activations, +ckpt: checkpointed), then per step: GB sent per
    GPU, seconds of communication and compute, the bubble's share of the step, sequences in the batch."""
    head = (f"{'strategy (GB per GPU)':<30}{'weights':>7}{'grads':>7}{'optim':>7}{'act':>8}{'+ckpt':>7}"
            f"{'total':>8}{'fits':>5} |{'sent GB':>8}{'comm':>8}{'compute':>8}{'bubble':>7}{'batch':>6}")
    units = f"{'':<30}{'(per GPU)':>51} |{'per GPU per step':>32}{'% step':>7}{'seqs':>6}"
    lines = [head, units, "-" * len(head)]
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
    mixed = ("bf16 + fp32 master would halve activations and traffic (states stay: the master copy eats what "
             "half weights and grads save)" if base.precision == "fp32" else f"{base.precision} halves activations "
             "and traffic")
    out = [table(list(estimates.values())), "",
           f"1. memory: {model.params / 1e9:.2f}B params x {w + g + o} B ({base.precision} weights {w}, grads {g}, "
           f"{base.optimizer} state and fp32 master {o}) = {_gb(states)} GB: "
           f"{'fits' if states <= cluster.memory_gb * GB else 'does not fit'} one {cluster.memory_gb:g} GB GPU",
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
    b, adam3 = 10 ** 9, sum(model_state_bytes(3 * 10 ** 9, 1, 0))
    per_gpu70, ring = shard(70 * b, 8 * 4), collective_bytes("all_reduce", 4000, 4, 1)
    return [memory_for_7b(), (f"3B, Adam, mixed precision: {_gb(adam3)} GB", adam3 == 48 * b),
            (f"70B as TP8 x PP4: {per_gpu70 / b:.4g}B params/GPU", round(per_gpu70 / b, 1) == 2.2),
            (f"bubble P=4: M=16 {bubble(4, 16):.1%}, M=32 {bubble(4, 32):.1%}",
             round(bubble(4, 16), 2) == 0.16 and round(bubble(4, 32), 2) == 0.09),
            (f"5% serial: {amdahl(0.05, 10 ** 12):.3f}x as N -> inf", round(amdahl(0.05, 10 ** 12), 6) == 20),
            (f"ring all-reduce of D = 4000 B over N = 4: {ring} B = 2(N-1)/N x D per rank", ring == 6000)]


def memory_for_7b() -> tuple[str, bool]:
    """Question 21: the 16 bytes per parameter counted in what torch.optim holds after an Adam step, 7B of them
    against an 80 GB GPU, fully sharded over 8, and the plan the method picks for 8 x 80 GB."""
    b, numel = 10 ** 9, 10_000
    per = sum(measured_model_state_bytes(numel, "bf16", "adam")) / numel
    best = recommend(Model(7 * b, 32, 4096, 32, 4096), Cluster(8), Plan(8, microbatches=8))
    sharded = sum(model_state_bytes(7 * b, 8, 3)) / b
    return (f"torch holds {per:g} B per parameter after an Adam step with bf16 weights and an fp32 master copy "
            f"(counted on {numel:,}); 7B x {per:g} B = {7 * per:g} GB > 80 GB; one 80 GB GPU holds the states of "
            f"{80 / per:.1f}B parameters at most; fully sharded over 8: {sharded:g} GB per GPU; the planner's pick "
            f"for 8 x 80 GB, seq 4096: {best.plan.name}, {best.total / b:.1f} GB per GPU"), per == 16 and sharded == 14


def scaling_stops(serial: float = 0.05) -> tuple[str, bool]:
    """Question 26: a 7B model under FSDP at a fixed global batch of 256 sequences of 4096 tokens on 8, 64, 256
    GPUs: compute per GPU falls as 1/N, the bytes each GPU sends do not (3(N-1)/N of the weights' bytes), and
    past one node they cross the slow links: communication's share of the step grows. Amdahl caps the rest."""
    model, gpus = Model(7 * 10 ** 9, 32, 4096, 32, 4096), (8, 64, 256)
    rows = [(n, e.compute_s, e.comm_s, e.comm_s / (e.comm_s + e.compute_s)) for n in gpus for e in
            [evaluate(model, Plan(n, zero=3, checkpoint=True, micro_batch=256 // n), Cluster(n))]]
    speedup, share = {n: amdahl(serial, n) for n in gpus}, [r[3] for r in rows]
    return (f"7B, FSDP, a global batch of 256 x 4096 tokens, seconds per step, compute + communication (not "
            f"overlapped): " + ", ".join(f"{n} GPUs {c:.2f} + {m:.2f} s ({f:.0%} communicating)" for n, c, m, f in rows)
        + f"; Amdahl with {serial:.0%} serial: " + ", ".join(f"{s:.1f}x on {n} GPUs" for n, s in speedup.items())
        + f", never {1 / serial:.0f}x"), share == sorted(share) and share[0] < share[-1] and speedup[256] < 1 / serial


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
    ("micro-batch", int, 1, "b, sequences per GPU per microbatch"), ("gpus", int, 8, "GPUs in all"),
    ("microbatches", int, 1, "M, gradient-accumulation steps or pipeline microbatches"),
    ("gpus-per-node", int, 8, "GPUs per node"), ("pp", int, 0, "... and this pipeline degree (0: none)"),
    ("tp", int, 0, "one more row to compare: this tensor-parallel degree (0: none)"),
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
    checks = quoted_figures() + [scaling_stops()]
    print("\nfigures often quoted, recomputed (the first and the last answer questions 21 and 26):\n"
          + "\n".join(f"  {'ok' if ok else 'FAIL'} {text}" for text, ok in checks))
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
