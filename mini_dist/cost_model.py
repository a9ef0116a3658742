"""The cost model: what a plan of data, tensor, pipeline and context parallelism costs, in bytes and seconds.

Each figure is a formula from the paper that introduced it, checked against what mini_dist's modules measure
(tests/test_cost_model.py); mini_dist/gpt_ledger.py does the same accounting exactly, rank by rank, for
mini_dist's tiny GPT, and mini_dist/planner.py picks a plan with it. GB = 1e9 bytes.

Model states. Per parameter, Adam in mixed precision keeps 2 bytes of bf16 weights, 2 of gradients and 12 of
fp32 optimizer state (master weights, momentum, variance): 16 bytes (fp32 Adam: 4 + 4 + 8, also 16). ZeRO
shards them over the K data-parallel ranks (Rajbhandari et al. 2020, Section 3.1 and Figure 1):

    DDP 16N     ZeRO-1 4N + 12N/K     ZeRO-2 2N + 14N/K     ZeRO-3 = FSDP 16N/K

Activations of one transformer layer, b sequences of s tokens, hidden h, a heads, e-byte activations, 1-byte
dropout masks, tensor-parallel degree t (Korthikanti et al. 2022, Section 4.1; full checkpointing keeps each
layer's input, e*sbh, plus one layer while it is recomputed, their Section 5):

    e(4sbh + (12sbh + 2as^2b)/t) + 2sbh + as^2b/t        which for e = 2, t = 1 is sbh(34 + 5as/h)

Traffic, bytes one GPU sends per step: ring all-reduce 2(K-1)/K*D, reduce-scatter and all-gather (K-1)/K*D
each (Patarasuk and Yuan 2009); Megatron TP 4 all-reduces of b*s*h per layer, 2 forward, 2 backward (Shoeybi
et al. 2019), 6 recomputing; a pipeline stage one activation forward and one gradient back per microbatch.
Time: bubble (P-1)/(M+P-1) of a GPipe or 1F1B step (Huang et al. 2019; (P-1)/M is the bubble over the
compute); 6 FLOPs per parameter per token (Kaplan et al. 2020), 8 recomputing; bytes / bandwidth, no latency,
no overlap; Amdahl (1967): a serial fraction f caps the speed-up at 1/f. DeepSpeed's
estimate_zero3_model_states_mem_needs and Megatron's memory report use these formulas; PyTorch has none.

Demo (one process): the 16 bytes per parameter counted in what torch.optim holds after a step, then the ZeRO
table for K ranks:

    python -m mini_dist.cost_model --numel 1000003 --precision bf16 --optimizer adam --ranks 8
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch

GB = 1e9
PRECISIONS = {"fp32": (4, 4, 0), "bf16": (2, 2, 4), "fp16": (2, 2, 4), "fp64": (8, 8, 0)}  # weight, grad, master
OPTIMIZERS = {"sgd": 0, "momentum": 1, "adam": 2}  # state tensors per parameter (Adam: m and v), fp32 or wider
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}


@dataclass(frozen=True)
class Model:
    params: int
    layers: int = 0  # 0: shape unknown, so are activations and TP/PP traffic
    hidden: int = 0
    heads: int = 0
    seq: int = 2048
    vocab: int = 0    # vocab, experts, top_k: for the exact ledger of mini_dist's tiny GPT (gpt_ledger.py)
    experts: int = 0  # 0: each block's feed-forward is an MLP h -> 4h -> h; E: E such experts, top_k each token
    top_k: int = 1


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
    cp: int = 1               # context parallelism: each rank holds seq/cp tokens of a sequence
    ep: int = 1               # expert parallelism, on ranks of dp x cp (mini_dist/mesh.py)

    @property
    def name(self) -> str:
        dp = STAGES[self.zero] + (f" DP{self.dp}" if self.tp * self.pp * self.cp > 1 else "")
        axes = [f"{a.upper()}{getattr(self, a)}" for a in ("tp", "cp", "pp", "ep") if getattr(self, a) > 1] + [dp]
        return " x ".join(axes) + (" +ckpt" if self.checkpoint else "")


# ----------------------------------------------------------------------------- memory

def bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes per parameter; the fp32 master copy counts as state, and
    the optimizer's state tensors are fp32 (the master's dtype), or the weights' dtype if wider."""
    weight, grad, master = PRECISIONS[precision]
    return weight, grad, master + OPTIMIZERS[optimizer] * max(weight, 4)


def shard(numel: int, k: int) -> int:
    """Elements per rank when a flat buffer of numel is split over k ranks, the last shard padded."""
    return -(-numel // k)


def model_state_bytes(numel: int, k: int, zero: int, precision: str = "bf16",
                      optimizer: str = "adam") -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes on one of k data-parallel ranks at a ZeRO stage:
    stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights."""
    # exercise: each of the three, whole (numel) or sharded (ceil(numel/k)) by the stage; bytes_per_param's sizes
    w, g, o = bytes_per_param(precision, optimizer)
    s = shard(numel, k)
    return w * (s if zero >= 3 else numel), g * (s if zero >= 2 else numel), o * (s if zero >= 1 else numel)
    # end exercise


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
    # exercise: k-1 steps of one chunk of ceil(numel/k) elements, twice for an all-reduce
    return (2 if kind == "all_reduce" else 1) * (k - 1) * shard(numel, k) * elem_size
    # end exercise


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
    need(0 <= serial <= 1 and n >= 1, f"serial fraction must lie in [0, 1], workers >= 1; got {serial}, {n}")
    return 1 / (serial + (1 - serial) / n)


# ----------------------------------------------------------------------------- guards

def need(ok: bool, message: str) -> None:
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


# ----------------------------------------------------------------------------- the formulas against torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def measured_model_state_bytes(numel: int, precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes torch holds after one step of a model of numel parameters.
    Mixed precision: the model's weights and gradients in 16 bits, the optimizer stepping an fp32 master copy
    (mini_dist/mixed_precision.py); its master and state tensors count as state. Adam's step counter, one
    scalar per parameter tensor, is left out, as the formula leaves it out."""
    weight = torch.zeros(numel, dtype=DTYPES[precision], device=launch.device(), requires_grad=True)
    weight.grad = torch.ones_like(weight)
    master = torch.nn.Parameter(weight.detach().float()) if PRECISIONS[precision][2] else weight
    master.grad = weight.grad.to(master.dtype)
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(
        [master], lr=0.1, **({"momentum": 0.9} if optimizer == "momentum" else {}))
    opt.step()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(size(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return size(weight), size(weight.grad), state + (size(master) if master is not weight else 0)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--numel", type=int, default=1_000_003, help="parameters of the model")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    p.add_argument("--ranks", type=int, default=8, help="K, data-parallel ranks of the ZeRO table")
    return p


def demo(args) -> int:
    launch.require(args.numel >= 1, f"--numel must be >= 1, got {args.numel}")
    launch.require(args.ranks >= 1, f"--ranks must be >= 1, got {args.ranks}")
    n, k = args.numel, args.ranks
    measured = measured_model_state_bytes(n, args.precision, args.optimizer)
    predicted = model_state_bytes(n, 1, 0, args.precision, args.optimizer)
    print(f"{args.precision} {args.optimizer}, N = {n:,}: torch holds weights, gradients, state = "
          f"{measured[0]:,} + {measured[1]:,} + {measured[2]:,} B; formula {predicted[0]:,} + {predicted[1]:,} + "
          f"{predicted[2]:,} B = {sum(predicted) / n:g} B per parameter  {'ok' if measured == predicted else 'OFF'}")
    print(f"bytes per rank over K = {k} (Rajbhandari et al. 2020, Figure 1; S = ceil(N/K) = {shard(n, k):,}): weights "
          f"+ gradients + optimizer state = total (B/param: the total over N, per rank)")
    for stage, name in STAGES.items():
        w, g, o = model_state_bytes(n, k, stage, args.precision, args.optimizer)
        print(f"  {name:7s} {w:>14,} + {g:>14,} + {o:>14,} = {w + g + o:>15,} B  ({(w + g + o) / n:6.3f} B/param)")
    ok = measured == predicted
    print(f"SUMMARY|cost_model|{'PASS' if ok else 'FAIL'} torch.optim after a step holds the formula's bytes|"
          f"{'PASS' if ok else 'FAIL'} {sum(measured) / n:g} B/param ({args.precision} {args.optimizer}); FSDP over "
          f"K = {k}: {sum(model_state_bytes(n, k, 3, args.precision, args.optimizer)) / n:.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(launch.main(parser(), demo))
