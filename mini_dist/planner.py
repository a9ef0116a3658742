"""The planner: pick the parallelism for a model and a cluster before renting either, by the cost model.

The method, as practitioners describe it (e.g. Hugging Face's Ultra-Scale Playbook): memory math first; the
cheap baselines next (gradient accumulation, then activation checkpointing); then the simplest parallelism
that fits and whose traffic can hide behind compute: DDP, ZeRO-1, ZeRO-2, FSDP across all GPUs, then TP inside
a node, then PP across nodes. Ranks are laid out TP innermost, then DP, then PP (mini_dist/mesh.py), so a TP
group never leaves its node.

`candidates` lists the plans in the method's order, simplest first; `recommend` prices each on the cluster
(mini_dist/step_time.py's `evaluate`: memory per GPU, seconds of communication and of compute, the bubble, by
the formulas of mini_dist/cost_model.py) and returns the first that fits with its traffic hidden by its
compute, else the first that fits. `report` prints the table of strategies and the method step by step.
For 7B parameters on 8 x 80 GB GPUs (sequences of 4096 tokens) the states alone take 112 GB; ZeRO-1 with
checkpointed activations fits, 42.8 GB per GPU, its states the ZeRO paper's 4N + 12N/K.

    python -m mini_dist.planner                        # the worked example: 7B on 8 x 80 GB
    python -m mini_dist.planner --params 70B --layers 80 --hidden 8192 --heads 64 --seq 4096 --gpus 256
    python -m mini_dist.planner --help                 # every flag; a mistake is one line and exit status 2
"""
import argparse
import sys
from dataclasses import replace
from pathlib import Path

if not __package__:  # run as `python mini_dist/planner.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import GB, OPTIMIZERS, PRECISIONS, STAGES, Cluster, Model, Plan, bytes_per_param, gpt_params
from mini_dist.step_time import Estimate, amdahl, evaluate, need, validate


def layouts(model: Model, cluster: Cluster) -> list[tuple[int, int]]:
    """(tp, pp) in the method's order: no model split, TP inside a node, then full-node TP + PP across."""
    n = cluster.gpus
    node = min(cluster.gpus, cluster.gpus_per_node)
    tps = [t for t in range(1, node + 1) if node % t == 0 and (not model.heads or model.heads % t == 0)]
    widest = tps[-1]  # the most TP ranks one node holds
    pps = [p for p in range(2, n // widest + 1) if n // widest % p == 0 and (not model.layers or model.layers % p == 0)]
    return [(t, 1) for t in tps] + [(widest, p) for p in pps]


def candidates(model: Model, cluster: Cluster, base: Plan):
    """Every plan the method tries, simplest first; the baselines before more parallelism."""
    b = base.micro_batch
    m = base.microbatches
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


def report(model: Model, cluster: Cluster, base: Plan, extra=(), serial=None) -> str:
    """The table of strategies, then the recommendation, step by step as the method goes."""
    rows = [replace(base, dp=cluster.gpus, zero=z) for z in STAGES]
    rows += [replace(base, dp=cluster.gpus // (t * p), tp=t, pp=p, zero=1) for t, p in layouts(model, cluster)[1:]]
    estimates = {}
    for plan in rows + list(extra):
        e = evaluate(model, plan, cluster)
        if not e.fits and model.layers and not plan.checkpoint:  # checkpoint a row only when it needs that to fit
            e = evaluate(model, replace(plan, checkpoint=True), cluster)
        estimates.setdefault(e.plan, e)
    best = recommend(model, cluster, base)
    if best:
        estimates.setdefault(best.plan, best)
    w, g, o = bytes_per_param(base.precision, base.optimizer)
    states = model.params * (w + g + o)
    fits_one = "fits" if states <= cluster.memory_gb * GB else "does not fit"
    if base.precision == "fp32":
        mixed = ("bf16 + fp32 master would halve activations and traffic (states stay: the master copy eats what "
                 "half weights and grads save)")
    else:
        mixed = f"{base.precision} halves activations and traffic"
    out = [table(list(estimates.values())), "",
           f"1. memory: {model.params / 1e9:.2f}B params x {w + g + o} B ({base.precision} weights {w}, grads {g}, "
           f"{base.optimizer} state and fp32 master {o}) = {gb(states)} GB: {fits_one} one {cluster.memory_gb:g} GB "
           "GPU",
           f"2. baselines: {mixed}; then gradient accumulation; then activation checkpointing"]
    if best is None:
        out.append(f"3. nothing fits in {cluster.memory_gb:g} GB per GPU: add GPUs or memory")
    else:
        p = best.plan
        hidden = " with traffic hidden by compute" if best.traffic_hidden else ""
        recompute = " incl. recompute" if p.checkpoint else ""
        out.append(f"3. simplest that fits{hidden}: {p.name}, {gb(best.total)} GB/GPU\n   micro-batch "
                   f"{p.micro_batch} x {p.microbatches} microbatches x DP {p.dp} = batch {best.effective_batch}; comm "
                   f"{seconds(best.comm_s)} vs compute {seconds(best.compute_s)}{recompute} per step")
    if serial is not None:
        cap = f", never above {1 / serial:.0f}x" if serial else ""
        out.append(f"Amdahl, {serial:.0%} serial: {amdahl(serial, cluster.gpus):.1f}x on {cluster.gpus} GPUs{cap}")
    return "\n".join(out)


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
        lines.append(f"{e.plan.name:<30}{''.join(f'{gb(x):>7}' for x in e.states)}{gb(act):>8}"
                     f"{gb(ckpt):>7}{gb(e.total):>8}{'yes' if e.fits else 'no':>5} |{gb(sent):>8}"
                     f"{seconds(e.comm_s):>8}{seconds(e.compute_s):>8}{e.bubble:>7.1%}{e.effective_batch:>6}")
    return "\n".join(lines)


def gb(x) -> str:
    """Bytes as GB, ? where unknown."""
    return "?" if x is None else f"{x / GB:.1f}"


def seconds(x) -> str:
    """Seconds, ? where unknown."""
    if x is None:
        return "?"
    return f"{x:.2f}s" if x < 100 else f"{x:.0f}s"


def count(text: str) -> int:
    """'7B', '1.3e9', '125M' -> an integer count: how the command line reads --params."""
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        return round(float(number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: write it like 7B, 1.3e9 or 125M") from None


# ----------------------------------------------------------------------------- demo

class CommandLine(argparse.ArgumentParser):
    """argparse, except that every mistake (an unknown flag, a bad value, a plan that cannot be) is one
    line, `python -m mini_dist.planner: error: what to change`, and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> CommandLine:
    p = CommandLine(prog="python -m mini_dist.planner", description=__doc__.split("\n")[0],
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_argument_group("the model")
    model.add_argument("--params", type=count, help="parameter count: 7B, 1.3e9, 125M; None: counted from the shape")
    model.add_argument("--layers", type=int, default=0, help="L, layers (0: unknown: no activation, TP, PP bytes)")
    model.add_argument("--hidden", type=int, default=0, help="h, hidden size")
    model.add_argument("--heads", type=int, default=0, help="a, attention heads")
    model.add_argument("--vocab", type=int, default=32000, help="V, vocabulary (for the count from the shape)")
    model.add_argument("--seq", type=int, default=2048, help="s, tokens")
    training = p.add_argument_group("the training step")
    training.add_argument("--micro-batch", type=int, default=1, help="b, sequences per GPU per microbatch")
    training.add_argument("--microbatches", type=int, default=1, help="M, accumulation steps or pipeline microbatches")
    training.add_argument("--precision", default="bf16", choices=list(PRECISIONS), help="weights and activations")
    training.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS), help="its fp32 state per parameter")
    training.add_argument("--checkpoint", action="store_true", help="checkpoint activations in every row")
    cluster = p.add_argument_group("the cluster")
    cluster.add_argument("--gpus", type=int, default=8, help="GPUs in all")
    cluster.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    cluster.add_argument("--memory-gb", type=float, default=80.0, help="memory per GPU, GB")
    cluster.add_argument("--intra-gbps", type=float, default=450.0, help="GB/s per GPU inside a node")
    cluster.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per GPU across nodes")
    cluster.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU")
    extra = p.add_argument_group("one more row to compare, and Amdahl's law")
    extra.add_argument("--tp", type=int, default=0, help="this tensor-parallel degree (0: none)")
    extra.add_argument("--pp", type=int, default=0, help="and this pipeline degree (0: none)")
    extra.add_argument("--zero", type=int, default=1, help="and this ZeRO stage (0 DDP, 1, 2, 3 FSDP)")
    extra.add_argument("--serial", type=float, help="serial fraction of the work, for Amdahl's law; None: not shown")
    return p


def demo(argv: list[str]) -> int:
    """The report for these arguments; without any, the worked example, its pick checked against the method."""
    worked = not argv
    argv = argv or "--params 7B --layers 32 --hidden 4096 --heads 32 --seq 4096 --microbatches 8 --serial 0.05".split()
    ap = parser()
    a = ap.parse_args(argv)
    shape = (a.layers, a.hidden, a.heads)
    try:
        need(a.params is not None or any(shape), "give --params, or --layers --hidden --heads (and --vocab --seq)")
        need(not any(shape) or all(shape), f"give all of --layers --hidden --heads or none, got {shape}")
        params = a.params if a.params is not None else gpt_params(a.layers, a.hidden, a.vocab, a.seq)
        model = Model(params, a.layers, a.hidden, a.heads, a.seq)
        cluster = Cluster(a.gpus, a.gpus_per_node, a.memory_gb, a.intra_gbps, a.inter_gbps, a.tflops)
        base = Plan(a.gpus, checkpoint=a.checkpoint, micro_batch=a.micro_batch, microbatches=a.microbatches,
                    precision=a.precision, optimizer=a.optimizer)
        validate(model, base, cluster)
        tp = a.tp or 1
        pp = a.pp or 1
        extra = [replace(base, dp=a.gpus // max(1, tp * pp), tp=tp, pp=pp, zero=a.zero)] if a.tp or a.pp else []
        text = report(model, cluster, base, extra, a.serial)  # evaluates each plan: a ValueError says what to change
    except ValueError as e:
        ap.error(str(e))
    if worked:
        print(f"worked example: python -m mini_dist.planner {' '.join(argv)}\n")
    print(text)
    if not worked:
        return 0
    best = recommend(model, cluster, base)
    hidden = best is not None and best.traffic_hidden
    states = sum(best.states) if best else None
    formula = 4 * model.params + 12 * model.params // base.dp  # ZeRO-1's states: 4N + 12N/K
    print(f"SUMMARY|planner|{'PASS' if hidden else 'FAIL'} 7B on 8 x 80 GB: {best.plan.name if best else 'nothing'} "
          f"fits, traffic hidden by compute|{'PASS' if states == formula else 'FAIL'} its states {gb(states)} GB/GPU "
          f"= 4N + 12N/K = {gb(formula)} GB")
    return 0 if hidden and states == formula else 1


if __name__ == "__main__":
    raise SystemExit(demo(sys.argv[1:]))
