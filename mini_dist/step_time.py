"""A plan's step on a cluster: the memory each GPU holds, the seconds it computes and talks, and why adding
GPUs stops speeding training up.

mini_dist/cost_model.py counts the bytes a plan holds and sends per GPU. On a cluster those bytes become time,
by the estimates practitioners use before renting anything (Hugging Face's Ultra-Scale Playbook; Megatron-LM,
Narayanan et al. 2021). `evaluate` prices one plan on the busiest GPU:

    memory    weights + gradients + optimizer state + the activations the plan keeps, against the GPU's memory
    compute   6 FLOPs per parameter per token (Kaplan et al. 2020), 8 when every layer is recomputed, at the
              FLOP/s a GPU achieves (about 40% of an H100's dense bf16 peak)
    talk      the bytes of each axis at the bandwidth of the links it crosses: NVLink when the axis's ranks
              share a node, InfiniBand when they do not; no latency and no overlap with compute
    bubble    (P-1)/(M+P-1) of a GPipe or 1F1B step idles (Huang et al. 2019)

A plan whose talk takes no longer than its useful compute (recomputation does not count) could hide its traffic
behind backward: the planner (mini_dist/planner.py) prefers those. At a fixed global batch each added GPU
computes less but sends as many bytes (a ring all-reduce sends 2(N-1)/N of the gradients whatever N is), so
talk takes a growing share of the step; and a serial fraction f of the work caps the speed-up on N workers at
1/(f + (1-f)/N) < 1/f, 20x for f = 5% (Amdahl 1967).

Demo (one process): the figures often quoted, recomputed; then a 7B model under FSDP on 8, 64 and 256 GPUs:

    python -m mini_dist.step_time --serial 0.05
"""
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import (GB, OPTIMIZERS, PRECISIONS, STAGES, Cluster, Model, Plan, activation_bytes,
                                  collective_bytes, dp_traffic, model_state_bytes, pp_traffic, shard, tp_traffic)
from mini_dist.kit import launch


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

    def bandwidth(span: int) -> float:
        """Bytes per second for a group of `span` consecutive ranks: inside one node, or across nodes."""
        inside = cluster.gpus <= cluster.gpus_per_node or cluster.gpus_per_node % span == 0
        return (cluster.intra_gbps if inside else cluster.inter_gbps) * GB
    spans = {"dp": plan.tp * plan.dp, "tp": plan.tp, "pp": cluster.gpus}  # ranks laid out TP, then DP, then PP
    comm = None if None in traffic.values() else sum(traffic[a] / bandwidth(spans[a]) for a in traffic)
    tokens = plan.micro_batch * plan.microbatches * model.seq
    compute = (8 if plan.checkpoint else 6) * per_gpu * tokens / (cluster.tflops * 1e12)
    kept = acts[plan.checkpoint] if acts else 0
    total = sum(states) + kept
    return Estimate(plan, states, acts, traffic, comm, compute, bubble(plan.pp, plan.microbatches),
                    plan.micro_batch * plan.microbatches * plan.dp, total, total <= cluster.memory_gb * GB)


def bubble(p: int, m: int) -> float:
    """Idle fraction of a GPipe or 1F1B step: P-1 slots of warm-up and drain out of M+P-1."""
    return (p - 1) / (m + p - 1)


def amdahl(serial: float, n: int) -> float:
    """Speedup on n workers when a fraction `serial` of the work cannot be split; tends to 1/serial."""
    need(0 <= serial <= 1 and n >= 1, f"serial fraction must lie in [0, 1], workers >= 1; got {serial}, {n}")
    return 1 / (serial + (1 - serial) / n)


def need(ok: bool, message: str) -> None:
    """Refuse an input with a ValueError whose message says what to change."""
    if not ok:
        raise ValueError(message)


def validate(model: Model, plan: Plan, cluster: Cluster) -> None:
    """Raise ValueError saying what to change; every plan passes here before any arithmetic."""
    counts = dict(params=model.params, seq=model.seq, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
                  dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep, micro_batch=plan.micro_batch,
                  microbatches=plan.microbatches, layers=model.layers, hidden=model.hidden, heads=model.heads)
    for name, value in counts.items():
        least = 0 if name in ("layers", "hidden", "heads") else 1  # a shape of zeros: unknown
        need(isinstance(value, int) and value >= least, f"{name} must be a whole number >= {least}, got {value!r}")
    for name in ("memory_gb", "intra_gbps", "inter_gbps", "tflops"):
        need(getattr(cluster, name) > 0, f"{name} must be > 0, got {getattr(cluster, name)!r}")  # NaN too
    for name, value, allowed in (("zero stage", plan.zero, STAGES), ("precision", plan.precision, PRECISIONS),
                                 ("optimizer", plan.optimizer, OPTIMIZERS)):
        need(value in allowed, f"{name} must be one of {list(allowed)}, got {value!r}")
    need(cluster.gpus <= cluster.gpus_per_node or cluster.gpus % cluster.gpus_per_node == 0,
         f"{cluster.gpus} GPUs are not whole nodes of {cluster.gpus_per_node}: change gpus or gpus_per_node")
    need(plan.dp * plan.tp * plan.pp * plan.cp == cluster.gpus, f"dp x tp x pp x cp = {plan.dp} x {plan.tp} x "
         f"{plan.pp} x {plan.cp} must equal the {cluster.gpus} GPUs: pick tp, pp, cp whose product divides "
         f"{cluster.gpus}")
    need(plan.dp * plan.cp % plan.ep == 0, f"ep = {plan.ep} must divide dp x cp = {plan.dp * plan.cp}")
    shape = (model.layers, model.hidden, model.heads)
    if any(shape):
        need(all(shape), f"give all of layers, hidden, heads or none of them, got {shape}")
        need(model.hidden % model.heads == 0, f"heads ({model.heads}) must divide hidden ({model.hidden})")
        need(model.heads % plan.tp == 0, f"tp = {plan.tp} must divide the {model.heads} heads (whole heads each)")
        need(model.layers % plan.pp == 0, f"pp = {plan.pp} must divide the {model.layers} layers (equal stages)")


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--serial", type=float, default=0.05, help="serial fraction of the work, for Amdahl's law")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256],
                   help="GPU counts, ascending: each 8 or fewer, or whole nodes of 8, and a divisor of 256")
    return p


def quoted_figures() -> list[tuple[str, bool]]:
    """Figures often quoted, recomputed with the cost model: (the figure as computed, whether it holds)."""
    b = 10 ** 9
    seven = sum(model_state_bytes(7 * b, 1, 0))
    seven_sharded = sum(model_state_bytes(7 * b, 8, 3))
    three = sum(model_state_bytes(3 * b, 1, 0))
    per_gpu70 = shard(70 * b, 8 * 4)
    ring = collective_bytes("all_reduce", 4000, 4, 1)
    return [(f"7B, Adam, mixed precision: {seven / b:g} GB > 80 GB; fully sharded over 8: {seven_sharded / b:g} GB "
             "each", seven == 112 * b and seven_sharded == 14 * b),
            (f"3B, Adam, mixed precision: {three / b:g} GB", three == 48 * b),
            (f"70B as TP8 x PP4: {per_gpu70 / b:.4g}B params/GPU", round(per_gpu70 / b, 1) == 2.2),
            (f"bubble P=4: M=16 {bubble(4, 16):.1%}, M=32 {bubble(4, 32):.1%}",
             round(bubble(4, 16), 2) == 0.16 and round(bubble(4, 32), 2) == 0.09),
            (f"5% serial: {amdahl(0.05, 10 ** 12):.3f}x as N -> inf", round(amdahl(0.05, 10 ** 12), 6) == 20),
            (f"ring all-reduce of D = 4000 B over N = 4: {ring} B = 2(N-1)/N x D per rank", ring == 6000)]


def scaling_stops(serial: float = 0.05, gpus: tuple = (8, 64, 256)) -> tuple[str, bool]:
    """Question 26: a 7B model under FSDP at a fixed global batch of 256 sequences of 4096 tokens on 8, 64, 256
    GPUs: compute per GPU falls as 1/N, the bytes each GPU sends do not (3(N-1)/N of the weights' bytes), and
    past one node they cross the slow links: communication's share of the step grows. Amdahl caps the rest."""
    model = Model(7 * 10 ** 9, 32, 4096, 32, 4096)
    rows = []
    shares = []
    for n in gpus:
        e = evaluate(model, Plan(n, zero=3, checkpoint=True, micro_batch=256 // n), Cluster(n))
        share = e.comm_s / (e.comm_s + e.compute_s)
        shares.append(share)
        rows.append(f"{n} GPUs {e.compute_s:.2f} + {e.comm_s:.2f} s ({share:.0%} communicating)")
    speedups = ", ".join(f"{amdahl(serial, n):.1f}x on {n} GPUs" for n in gpus)
    figure = (f"7B, FSDP, a global batch of 256 x 4096 tokens, seconds per step, compute + communication (not "
              f"overlapped): {', '.join(rows)}; Amdahl with {serial:.0%} serial: {speedups}, never {1 / serial:.0f}x")
    return figure, shares == sorted(shares) and shares[0] < shares[-1] and amdahl(serial, gpus[-1]) < 1 / serial


def demo(args) -> int:
    gpus = args.gpus
    launch.require(0 < args.serial < 1, f"--serial must lie strictly between 0 and 1, got {args.serial}")
    launch.require(len(gpus) >= 2 and gpus == sorted(set(gpus)) and all(256 % n == 0 and (n <= 8 or n % 8 == 0)
                                                                       for n in gpus),
                   f"--gpus {' '.join(map(str, gpus))}: give two or more counts, ascending, each 8 or fewer or whole "
                   "nodes of 8, and each a divisor of the 256 sequences of the batch")
    checks = quoted_figures()
    passed = sum(ok for _, ok in checks)
    print("figures often quoted, recomputed:")
    for text, ok in checks:
        print(f"  {'ok' if ok else 'FAIL'} {text}")
    figure, holds = scaling_stops(args.serial, tuple(gpus))
    print(f"why adding GPUs stops speeding training up: {figure}")
    print(f"SUMMARY|step_time|{'PASS' if passed == len(checks) else 'FAIL'} figures often quoted {passed}/"
          f"{len(checks)}|{'PASS' if holds else 'FAIL'} 7B, FSDP, a fixed batch: communication's share of the step "
          f"grows with the GPUs; Amdahl caps {args.serial:.0%} serial at {1 / args.serial:.0f}x")
    return 0 if passed == len(checks) and holds else 1


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
