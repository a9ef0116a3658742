"""The cost model: what a plan of data, tensor, pipeline and context parallelism costs per GPU, in bytes.

Each figure is a formula from the paper that introduced it, checked against what mini_dist's modules measure
(tests/test_cost_model.py). mini_dist/gpt_ledger.py and mini_dist/rank_ledger.py do the same accounting
exactly, rank by rank, for mini_dist's tiny GPT; mini_dist/step_time.py turns the bytes into seconds on a
cluster, and mini_dist/planner.py picks a plan with both. GB = 1e9 bytes.

Model states. Per parameter, Adam in mixed precision keeps 2 bytes of bf16 weights, 2 of gradients and 12 of
fp32 optimizer state (master weights, momentum, variance): 16 bytes (fp32 Adam: 4 + 4 + 8, also 16). ZeRO
shards them over the K data-parallel ranks (Rajbhandari et al. 2020, Section 3.1 and Figure 1):

    DDP 16N     ZeRO-1 4N + 12N/K     ZeRO-2 2N + 14N/K     ZeRO-3 = FSDP 16N/K

Activations of one transformer layer, b sequences of s tokens, hidden h, a heads, e-byte activations, 1-byte
dropout masks, tensor-parallel degree t (Korthikanti et al. 2022, Section 4.1; full checkpointing keeps each
layer's input, e*sbh, plus one layer while it is recomputed, their Section 5):

    e(4sbh + (12sbh + 2as^2b)/t) + 2sbh + as^2b/t        which for e = 2, t = 1 is sbh(34 + 5as/h)

Traffic, the bytes one GPU sends per step. A ring all-reduce sends 2(K-1)/K*D, a reduce-scatter and an
all-gather (K-1)/K*D each (Patarasuk and Yuan 2009). Megatron's tensor parallelism all-reduces b*s*h four times
per layer, twice forward and twice backward (Shoeybi et al. 2019), six times when the layer is recomputed. A
pipeline stage sends one activation forward and one gradient back per microbatch. DeepSpeed's
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
OPTIMIZERS = {"sgd": 0, "momentum": 1, "adam": 2}  # state tensors per parameter (Adam: m and v), fp32 or wider
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}


@dataclass(frozen=True)
class Model:
    """A model as the cost model sees it: its parameter count and, where known, its shape."""
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
    """GPUs, their memory and their links (mini_dist/step_time.py prices a plan on them)."""
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
        """The plan as a table names it, e.g. "TP8 x PP4 x ZeRO-1 DP8 +ckpt"."""
        dp = STAGES[self.zero] + (f" DP{self.dp}" if self.tp * self.pp * self.cp > 1 else "")
        axes = [f"{a.upper()}{getattr(self, a)}" for a in ("tp", "cp", "pp", "ep") if getattr(self, a) > 1] + [dp]
        return " x ".join(axes) + (" +ckpt" if self.checkpoint else "")


# ----------------------------------------------------------------------------- memory

def bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes per parameter; the fp32 master copy counts as state, and
    the optimizer's state tensors are fp32 (the master's dtype), or the weights' dtype if wider."""
    # exercise: three ints, the bytes that torch holds per parameter after a step; PRECISIONS, OPTIMIZERS have them
    weight, grad, master = PRECISIONS[precision]
    return weight, grad, master + OPTIMIZERS[optimizer] * max(weight, 4)
    # end exercise


def shard(numel: int, k: int) -> int:
    """Elements per rank when a flat buffer of numel is split over k ranks, the last shard padded."""
    return -(-numel // k)


def model_state_bytes(numel: int, k: int, zero: int, precision: str = "bf16",
                      optimizer: str = "adam") -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes on one of k data-parallel ranks at a ZeRO stage:
    stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights."""
    # exercise: three ints: bytes_per_param's sizes times the elements a rank holds, shard(numel, k) if sharded
    w, g, o = bytes_per_param(precision, optimizer)
    s = shard(numel, k)
    weights = w * (s if zero >= 3 else numel)
    gradients = g * (s if zero >= 2 else numel)
    state = o * (s if zero >= 1 else numel)
    return weights, gradients, state
    # end exercise


def activation_bytes(model: Model, plan: Plan) -> tuple[int, int] | None:
    """(without, with full checkpointing) activation bytes on the busiest GPU; None if no shape given.
    1F1B keeps min(M, P) microbatches alive on the first stage; plain accumulation keeps one."""
    if not model.layers:
        return None
    s = model.seq
    b = plan.micro_batch
    h = model.hidden
    a = model.heads
    t = plan.tp
    e = PRECISIONS[plan.precision][0]
    sbh = s * b * h
    as2b = a * s * s * b
    layer = e * (4 * sbh + (12 * sbh + 2 * as2b) // t) + 2 * sbh + as2b // t
    stored = model.layers // plan.pp * min(plan.microbatches, plan.pp)
    return stored * layer, stored * e * sbh + layer


# ----------------------------------------------------------------------------- communication

def collective_bytes(kind: str, numel: int, k: int, elem_size: int) -> int:
    """Bytes one rank sends in a ring collective over k ranks, the buffer padded to k equal chunks:
    all_reduce 2(k-1)/k*D = reduce_scatter (k-1)/k*D + all_gather (k-1)/k*D."""
    # exercise: an int, exact for any numel and k: the docstring's share of D, the buffer padded as it says
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
    k = plan.dp
    m = plan.microbatches
    all_reduce = collective_bytes("all_reduce", numel, k, g)
    reduce_scatter = collective_bytes("reduce_scatter", numel, k, g)
    all_gather = collective_bytes("all_gather", numel, k, w)
    by_stage = [{"all_reduce": all_reduce},
                {"all_reduce": all_reduce, "all_gather": all_gather},
                {"reduce_scatter": m * reduce_scatter, "all_gather": all_gather},
                {"all_gather": 2 * m * all_gather, "reduce_scatter": m * reduce_scatter}]
    return by_stage[plan.zero]


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


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--numel", type=int, default=1_000_003, help="parameters of the model")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    p.add_argument("--ranks", type=int, default=8, help="K, data-parallel ranks of the ZeRO table")
    return p


def measured_model_state_bytes(numel: int, precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes torch holds after one step of a model of numel parameters.
    Mixed precision: the model's weights and gradients in 16 bits, the optimizer stepping an fp32 master copy
    (mini_dist/mixed_precision.py); its master and state tensors count as state. Adam's step counter, one
    scalar per parameter tensor, is left out, as the formula leaves it out."""
    weight = torch.zeros(numel, dtype=DTYPES[precision], device=launch.device(), requires_grad=True)
    weight.grad = torch.ones_like(weight)
    master = torch.nn.Parameter(weight.detach().float()) if PRECISIONS[precision][2] else weight
    master.grad = weight.grad.to(master.dtype)
    if optimizer == "adam":
        opt = torch.optim.Adam([master], lr=0.1)
    else:
        opt = torch.optim.SGD([master], lr=0.1, momentum=0.9 if optimizer == "momentum" else 0.0)
    opt.step()
    state = sum(size(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    if master is not weight:
        state += size(master)
    return size(weight), size(weight.grad), state


def size(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def demo(args) -> int:
    launch.require(args.numel >= 1, f"--numel must be >= 1, got {args.numel}")
    launch.require(args.ranks >= 1, f"--ranks must be >= 1, got {args.ranks}")
    n = args.numel
    k = args.ranks
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
