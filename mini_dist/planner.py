"""The planner: the memory and traffic of every parallelism, worked out before any GPU is rented.

Per parameter, Adam in mixed precision keeps 2 bytes of bf16/fp16 weights, 2 of gradients and 12 of
fp32 optimizer state (master weights, momentum, variance): 16 bytes (fp32 Adam: 4 + 4 + 8, also 16).
ZeRO shards them over the K data-parallel ranks (Rajbhandari et al. 2020, Figure 1):

    DDP 16N     ZeRO-1 4N + 12N/K     ZeRO-2 2N + 14N/K     ZeRO-3 = FSDP 16N/K

Activations of one transformer layer for a microbatch of b sequences (length s, hidden h, a heads,
e-byte activations, tensor-parallel degree t; Korthikanti et al. 2022, dropout masks 1 byte each):

    e(4sbh + (12sbh + 2as^2b)/t) + 2sbh + as^2b/t        which for e = 2, t = 1 is sbh(34 + 5as/h)

Full activation checkpointing keeps each layer's input (e*sbh) plus the one layer being recomputed.
Bytes a GPU sends per step: ring all-reduce 2(K-1)/K*D, reduce-scatter and all-gather (K-1)/K*D;
Megatron TP 4 all-reduces of b*s*h activations per layer (6 when recomputing); a pipeline stage one
activation forward and one gradient back per microbatch. Bubble (P-1)/(M+P-1) of the step. Compute
6 flops per parameter per token (8 when recomputing). Amdahl: a serial fraction f caps speedup at 1/f.

The seeds' figures, recomputed (GB = 1e9 bytes; tests/test_planner.py asserts each):
  7B Adam mixed 16 x 7e9 = 112 GB > 80 GB; FSDP over 8: 14 GB    right, for the model states alone
  3B: 48 GB; ring all-reduce 2(N-1)/N x D per rank                right
  70B as TP8 x PP4 x DP8: 70e9/32 = 2.19B params per GPU          right; DP copies them (ZeRO aside)
  bubble P=4: M=16 3/19 = 15.8%, M=32 3/35 = 8.6%                 right; (P-1)/M = 18.8%, 9.4% is the
                                                                  bubble over compute, not of the step
  5% serial caps speedup at 20x                                   right as N -> inf; 18.6x on 256 GPUs
  "ZeRO-2 communicates less than DDP"                             wrong: its reduce-scatter + weight
                                                                  all-gather = one all-reduce's bytes
ZeRO-1 here all-reduces full gradients, as mini_dist/zero.py does (DeepSpeed reduce-scatters: = DDP).

The method (`recommend`): memory math first; the cheap baselines next (gradient accumulation, then
activation checkpointing); then the simplest parallelism that fits and whose traffic can hide behind
compute: DDP, ZeRO-1, ZeRO-2, FSDP across all GPUs, then TP inside a node, then PP across nodes.
Ranks are laid out TP innermost, then DP, then PP. Times are bytes / bandwidth, no latency, no
overlap. The formulas behind DeepSpeed's estimate_zero3_model_states_mem_needs and Megatron's memory
report; PyTorch has no planner.

    python -m mini_dist.planner                        # the worked example: 7B on 8 x 80 GB
    python -m mini_dist.planner --params 70B --layers 80 --hidden 8192 --heads 64 --seq 4096 --gpus 256
"""
import argparse
import sys
from dataclasses import dataclass, replace

GB = 1e9
PRECISIONS = {"fp32": (4, 4, 0), "bf16": (2, 2, 4), "fp16": (2, 2, 4)}  # weight, grad, fp32 master
OPTIMIZERS = {"sgd": 0, "momentum": 4, "adam": 8}  # fp32 state bytes per parameter (Adam: m and v)
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}


@dataclass(frozen=True)
class Model:
    params: int
    layers: int = 0  # 0: shape unknown, so are activations and TP/PP traffic
    hidden: int = 0
    heads: int = 0
    seq: int = 2048


def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """A GPT-2 style model (Narayanan et al. 2021 plus the final layer norm), embeddings tied:
    12Lh^2 + 13Lh + (V + s + 2)h; GPT-2 small (12, 768, 50257, 1024) has 124,439,808."""
    return 12 * layers * hidden ** 2 + 13 * layers * hidden + (vocab + seq + 2) * hidden


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory_gb: float = 80.0
    intra_gbps: float = 450.0  # per GPU per direction: NVLink 4 moves 900 GB/s both ways
    inter_gbps: float = 50.0   # one 400 Gb/s InfiniBand NIC per GPU
    tflops: float = 400.0      # achieved bf16 TFLOP/s per GPU: ~40% of an H100's dense peak


@dataclass(frozen=True)
class Plan:
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0             # 0 DDP, 1, 2, 3 FSDP
    checkpoint: bool = False  # full activation checkpointing
    micro_batch: int = 1      # b: sequences per GPU per microbatch
    microbatches: int = 1     # M: gradient-accumulation steps, or pipeline microbatches
    precision: str = "bf16"
    optimizer: str = "adam"

    @property
    def name(self) -> str:
        dp = STAGES[self.zero] + (f" DP{self.dp}" if self.tp * self.pp > 1 else "")
        axes = [f"TP{self.tp}"] * (self.tp > 1) + [f"PP{self.pp}"] * (self.pp > 1) + [dp]
        return " x ".join(axes) + (" +ckpt" if self.checkpoint else "")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate(model: Model, plan: Plan, cluster: Cluster) -> None:
    """Raise ValueError saying what to change; every plan passes here before any arithmetic."""
    counts = dict(params=model.params, seq=model.seq, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
                  dp=plan.dp, tp=plan.tp, pp=plan.pp, micro_batch=plan.micro_batch,
                  microbatches=plan.microbatches, layers=model.layers, hidden=model.hidden, heads=model.heads)
    for name, value in counts.items():
        least = 0 if name in ("layers", "hidden", "heads") else 1  # a shape of zeros: unknown
        _need(isinstance(value, int) and value >= least,
              f"{name} must be a whole number >= {least}, got {value!r}")
    for name in ("memory_gb", "intra_gbps", "inter_gbps", "tflops"):
        _need(getattr(cluster, name) > 0, f"{name} must be > 0, got {getattr(cluster, name)!r}")  # NaN too
    for name, value, allowed in (("zero stage", plan.zero, STAGES), ("precision", plan.precision, PRECISIONS),
                                 ("optimizer", plan.optimizer, OPTIMIZERS)):
        _need(value in allowed, f"{name} must be one of {list(allowed)}, got {value!r}")
    _need(cluster.gpus <= cluster.gpus_per_node or cluster.gpus % cluster.gpus_per_node == 0,
          f"{cluster.gpus} GPUs are not whole nodes of {cluster.gpus_per_node}: change gpus or gpus_per_node")
    _need(plan.dp * plan.tp * plan.pp == cluster.gpus, f"dp x tp x pp = {plan.dp} x {plan.tp} x {plan.pp} "
          f"must equal the {cluster.gpus} GPUs: pick tp and pp whose product divides {cluster.gpus}")
    shape = (model.layers, model.hidden, model.heads)
    if any(shape):
        _need(all(shape), f"give all of layers, hidden, heads or none of them, got {shape}")
        _need(model.hidden % model.heads == 0, f"heads ({model.heads}) must divide hidden ({model.hidden})")
        _need(model.heads % plan.tp == 0, f"tp = {plan.tp} must divide the {model.heads} heads "
              "(each rank owns whole heads)")
        _need(model.layers % plan.pp == 0, f"pp = {plan.pp} must divide the {model.layers} layers "
              "(equal stages)")


# ----------------------------------------------------------------------------- memory


def bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes per parameter; the fp32 master copy counts as state."""
    weight, grad, master = PRECISIONS[precision]
    return weight, grad, master + OPTIMIZERS[optimizer]


def shard(numel: int, k: int) -> int:
    """Elements per rank when a flat buffer of numel is split over k ranks, the last shard padded."""
    return -(-numel // k)


def model_state_bytes(numel: int, k: int, zero: int, precision: str = "bf16",
                      optimizer: str = "adam") -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes on one of k data-parallel ranks at a ZeRO stage:
    stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights."""
    w, g, o = bytes_per_param(precision, optimizer)
    s = shard(numel, k)
    return w * (s if zero >= 3 else numel), g * (s if zero >= 2 else numel), o * (s if zero >= 1 else numel)


def activation_bytes(model: Model, plan: Plan) -> tuple[int, int] | None:
    """(without, with full checkpointing) activation bytes on the busiest GPU; None if no shape given.
    1F1B keeps min(M, P) microbatches alive on the first stage; plain accumulation keeps one."""
    if not model.layers:
        return None
    s, b, h, a, t = model.seq, plan.micro_batch, model.hidden, model.heads, plan.tp
    e, sbh, as2b = PRECISIONS[plan.precision][0], s * b * h, a * s * s * b
    layer = e * (4 * sbh + (12 * sbh + 2 * as2b) // t) + 2 * sbh + as2b // t
    stored = model.layers // plan.pp * min(plan.microbatches, plan.pp)
    return stored * layer, stored * e * sbh + layer


# ----------------------------------------------------------------------------- communication


def collective_bytes(kind: str, numel: int, k: int, elem_size: int) -> int:
    """Bytes one rank sends in a ring collective over k ranks, the buffer padded to k equal chunks:
    all_reduce 2(k-1)/k*D = reduce_scatter (k-1)/k*D + all_gather (k-1)/k*D."""
    return (2 if kind == "all_reduce" else 1) * (k - 1) * shard(numel, k) * elem_size


def ring_all_reduce_bytes_exact(chunk_numels: list[int], rank: int, elem_size: int) -> int:
    """Bytes `rank` sends in a ring all-reduce with uneven chunks (the ring sends to rank - 1).
    Reduce-scatter: every chunk but the one it ends up owning (chunk `rank`); all-gather: every chunk
    but the one it receives last (chunk rank - 1, which by then has been everywhere else)."""
    return elem_size * (2 * sum(chunk_numels) - chunk_numels[rank] - chunk_numels[rank - 1])


def dp_traffic(numel: int, plan: Plan) -> dict[str, int]:
    """Bytes one rank sends per step in its data-parallel group, by collective.

    DDP all-reduces once per step (no_sync while accumulating). ZeRO-1 keeps full gradients and
    all-reduces them too, then all-gathers the updated weights. ZeRO-2 and FSDP keep gradient shards
    only, so they reduce-scatter after every microbatch; FSDP also gathers the weights for each forward
    and again for each backward (they were freed in between)."""
    w, g, _ = bytes_per_param(plan.precision, plan.optimizer)
    k, m = plan.dp, plan.microbatches
    ar, rs, ag = (collective_bytes(kind, numel, k, e) for kind, e in
                  (("all_reduce", g), ("reduce_scatter", g), ("all_gather", w)))
    return [{"all_reduce": ar}, {"all_reduce": ar, "all_gather": ag},
            {"reduce_scatter": m * rs, "all_gather": ag},
            {"all_gather": 2 * m * ag, "reduce_scatter": m * rs}][plan.zero]


def tp_traffic(model: Model, plan: Plan) -> int:
    """Megatron: per layer and microbatch 2 all-reduces of b*s*h in forward, 2 in backward, +2 recompute."""
    act = model.seq * plan.micro_batch * model.hidden
    per_layer = (6 if plan.checkpoint else 4) * collective_bytes("all_reduce", act, plan.tp,
                                                                 PRECISIONS[plan.precision][0])
    return model.layers // plan.pp * plan.microbatches * per_layer


def pp_traffic(model: Model, plan: Plan, stage: int | None = None) -> int:
    """Bytes a stage sends: M activations forward unless it is the last, M gradients back unless it
    is the first. By default the busiest stage (a middle one)."""
    stage = min(1, plan.pp - 1) if stage is None else stage
    act = model.seq * plan.micro_batch * model.hidden * PRECISIONS[plan.precision][0]
    return plan.microbatches * act * ((stage < plan.pp - 1) + (stage > 0))


def bubble(p: int, m: int) -> float:
    """Idle fraction of a GPipe or 1F1B step: P-1 slots of warm-up and drain out of M+P-1."""
    return (p - 1) / (m + p - 1)


def amdahl(serial: float, n: int) -> float:
    """Speedup on n workers when a fraction `serial` of the work cannot be split; tends to 1/serial."""
    _need(0 <= serial <= 1 and n >= 1, f"serial fraction must lie in [0, 1], workers >= 1; got {serial}, {n}")
    return 1 / (serial + (1 - serial) / n)


# ----------------------------------------------------------------------------- estimate and recommend


@dataclass(frozen=True)
class Estimate:
    plan: Plan
    states: tuple[int, int, int]         # weights, gradients, optimizer state: bytes per GPU
    activations: tuple[int, int] | None  # without, with checkpointing
    traffic: dict                        # "dp" / "tp" / "pp" -> bytes sent per GPU per step (None: unknown)
    comm_s: float | None
    compute_s: float
    bubble: float
    effective_batch: int
    total: int
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


def seed_checks() -> list[tuple[str, bool]]:
    """The seeds' worked examples, recomputed (tests/test_planner.py asserts the same numbers)."""
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


def _count(text: str) -> int:
    """'7B', '1.3e9', '125M' -> an integer count."""
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}.get(text[-1:].upper(), 1)
    return round(float(text[:-1] if scale > 1 else text) * scale)


def cli(argv: list[str]) -> tuple[Model, Cluster, Plan]:
    """Parse the command line and print the report; bad input exits 2 saying what to change."""
    ap = argparse.ArgumentParser(prog="python -m mini_dist.planner", description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=_count, help="parameter count, e.g. 7B (default: from the shape)")
    for name, default in [("layers", 0), ("hidden", 0), ("heads", 0), ("vocab", 32000), ("seq", 2048),
                          ("micro-batch", 1), ("microbatches", 1), ("gpus", 8), ("gpus-per-node", 8),
                          ("tp", 0), ("pp", 0), ("zero", 1)]:  # --tp/--pp/--zero: one more row to compare
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("memory-gb", 80.0), ("intra-gbps", 450.0), ("inter-gbps", 50.0),
                          ("tflops", 400.0), ("serial", None)]:
        ap.add_argument(f"--{name}", type=float, default=default)
    ap.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    ap.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS))
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint activations in every row")
    a = ap.parse_args(argv)
    try:
        _need(a.params is not None or a.layers, "give --params, or --layers --hidden --heads (--vocab --seq)")
        model = Model(a.params if a.params is not None else gpt_params(a.layers, a.hidden, a.vocab, a.seq),
                      a.layers, a.hidden, a.heads, a.seq)
        cluster = Cluster(a.gpus, a.gpus_per_node, a.memory_gb, a.intra_gbps, a.inter_gbps, a.tflops)
        base = Plan(a.gpus, 1, 1, 0, a.checkpoint, a.micro_batch, a.microbatches, a.precision, a.optimizer)
        tp, pp = a.tp or 1, a.pp or 1  # 0: not given
        extra = [replace(base, dp=a.gpus // max(1, tp * pp), tp=tp, pp=pp, zero=a.zero)] * bool(a.tp or a.pp)
        for plan in [base, *extra]:
            validate(model, plan, cluster)
        print(report(model, cluster, base, extra, a.serial))
    except ValueError as e:
        ap.error(str(e))
    return model, cluster, base


def demo() -> int:
    """The worked example, the seeds' figures, and the recommended plan's states against 4N + 12N/K."""
    argv = "--params 7B --layers 32 --hidden 4096 --heads 32 --seq 4096 --microbatches 8 --serial 0.05"
    print(f"worked example: python -m mini_dist.planner {argv}\n")
    model, cluster, base = cli(argv.split())
    checks = seed_checks()
    print("\nthe seeds' figures, recomputed:\n" + "\n".join(f"  {'ok' if ok else 'FAIL'} {text}"
                                                           for text, ok in checks))
    best, n, k = recommend(model, cluster, base), model.params, base.dp
    formula = 4 * n + 12 * n // k if best and best.plan.zero == 1 else None  # ZeRO-1's states
    passed, figure_ok = sum(ok for _, ok in checks), best is not None and sum(best.states) == formula
    plan, states = (best.plan.name, _gb(sum(best.states))) if best else ("nothing fits", "?")
    print(f"SUMMARY|planner|{'PASS' if passed == len(checks) else 'FAIL'} seeds' figures "
          f"{passed}/{len(checks)}|{'PASS' if figure_ok else 'FAIL'} 7B on 8x80GB: {plan}, "
          f"states {states} GB/GPU = 4N + 12N/K {_gb(formula)} GB")
    return 0 if passed == len(checks) and figure_ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        cli(sys.argv[1:])  # the report for these arguments; bad input exits with code 2
    else:
        raise SystemExit(demo())
