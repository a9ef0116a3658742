"""The cost model: what a plan of data, tensor and pipeline parallelism costs, in bytes and seconds.

Every figure is a formula from the paper that introduced it, and the tests check each one against what
mini_dist's modules measure (tests/test_planner.py). GB = 1e9 bytes.

Model states. Per parameter, Adam in mixed precision keeps 2 bytes of bf16/fp16 weights, 2 of gradients
and 12 of fp32 optimizer state (master weights, momentum, variance): 16 bytes (fp32 Adam: 4 + 4 + 8, also
16). ZeRO shards them over the K data-parallel ranks (Rajbhandari et al. 2020, Section 3.1 and Figure 1):

    DDP 16N     ZeRO-1 4N + 12N/K     ZeRO-2 2N + 14N/K     ZeRO-3 = FSDP 16N/K

Activations of one transformer layer, microbatch of b sequences of s tokens, hidden h, a heads, e-byte
activations, 1-byte dropout masks, tensor-parallel degree t (Korthikanti et al. 2022, Section 4.1):

    e(4sbh + (12sbh + 2as^2b)/t) + 2sbh + as^2b/t        which for e = 2, t = 1 is sbh(34 + 5as/h)

Full checkpointing keeps each layer's input, e*sbh (their Section 5), plus one layer while it is recomputed
(mini_dist/activation_checkpoint.py measures both).

Traffic, bytes one GPU sends per step: ring all-reduce 2(K-1)/K*D, reduce-scatter and all-gather (K-1)/K*D
each (Patarasuk and Yuan 2009); Megatron TP 4 all-reduces of b*s*h activations per layer, 2 forward and 2
backward (Shoeybi et al. 2019), 6 when recomputing, as the recomputed forward repeats its 2; a pipeline
stage one activation forward and one gradient back per microbatch. ZeRO-1 here all-reduces the full
gradients, as mini_dist/zero.py does (DeepSpeed reduce-scatters them: then it sends what DDP sends).

Time: bubble (P-1)/(M+P-1) of a GPipe or 1F1B step (Huang et al. 2019; Narayanan et al. 2021 write (P-1)/M,
the bubble over the compute); compute 6 FLOPs per parameter per token (Kaplan et al. 2020), 8 when
recomputing; Amdahl (1967): a serial fraction f caps the speed-up at 1/f. Traffic time is bytes /
bandwidth, with no latency and no overlap. These are the formulas behind DeepSpeed's
estimate_zero3_model_states_mem_needs and Megatron's memory report; PyTorch has no planner.

Demo (one process): the 16 bytes per parameter counted in what torch.optim really holds after a step,
then the ZeRO table for K ranks; mini_dist/planner.py builds its recommendations on these functions.

    python -m mini_dist.cost_model --numel 1000003 --precision bf16 --optimizer adam --ranks 8
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as `python mini_dist/cost_model.py`: put the repo, not mini_dist/, on the path
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
    vocab: int = 0    # the rank-by-rank predictions of mini_dist's tiny GPT (gpt_*) need these three
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
        need(isinstance(value, int) and value >= least,
              f"{name} must be a whole number >= {least}, got {value!r}")
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
        need(model.heads % plan.tp == 0, f"tp = {plan.tp} must divide the {model.heads} heads "
              "(each rank owns whole heads)")
        need(model.layers % plan.pp == 0, f"pp = {plan.pp} must divide the {model.layers} layers "
              "(equal stages)")


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
    need(0 <= serial <= 1 and n >= 1, f"serial fraction must lie in [0, 1], workers >= 1; got {serial}, {n}")
    return 1 / (serial + (1 - serial) / n)


# ----------------------------------------------------------------------------- one plan, evaluated


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


# ----------------------------------------------------------------------------- mini_dist's tiny GPT, rank by rank
# Exact, for mini_dist/parallel_gpt.py trained by mini_dist/train_5d.py: what one rank holds and moves per step,
# given the layers of its pipeline chunks. A token count n = micro_batch * seq/cp is one microbatch on one rank.


def gpt_layer_numel(model: Model, plan: Plan, kind: str) -> tuple[int, int]:
    """Elements of one layer on one rank: (weights replicated over dp x cp, experts replicated over the
    dp*cp/ep ranks that hold the same ones; with ep = 1 they count with the first). kind: "embedding" (V/T
    rows + seq positions), "block" (2 layer norms, attention cut by heads, then an MLP cut by TP or a router
    and E/ep experts h -> 4h -> h), "head" (a layer norm + V/T rows)."""
    h, T, E = model.hidden, plan.tp, model.experts
    if kind != "block":
        return model.vocab // T * h + (model.seq * h if kind == "embedding" else 2 * h), 0
    attention = (3 * h * h + 3 * h + h * h) // T + h          # in_proj cut by heads, out_proj's bias whole
    if not E:
        return 4 * h + attention + (8 * h * h + 4 * h) // T + h, 0
    experts = E // plan.ep * (8 * h * h + 5 * h)
    dense = 4 * h + attention + h * E                          # + the router, replicated
    return (dense + experts, 0) if plan.ep == 1 else (dense, experts)


def gpt_step_traffic(model: Model, plan: Plan, blocks: int, embedding: bool, head: bool,
                     rows_off: int | None = None) -> dict[str, int]:
    """Bytes one rank moves per step inside the model, over plan.microbatches microbatches, for its `blocks`
    transformer blocks, embedding and head: "tp" all-reduce payload, "cp" ring attention's K/V (and dK/dV)
    sends, "ep" all-to-all rows sent to other ranks. A recomputed (checkpointed) block repeats its forward's
    collectives in backward. rows_off: rows this rank's MoE layers sent to and received from other ranks in
    all the step's forwards; None: balanced routing, n*top_k*(ep-1)/ep each way per block and microbatch."""
    e, h, T, C = PRECISIONS[plan.precision][0], model.hidden, plan.tp, plan.cp
    n = plan.micro_batch * model.seq // C
    again = 1.5 if plan.checkpoint else 1
    per_block = int((2 if model.experts else 4) * again)
    tp = (T > 1) * plan.microbatches * n * e * ((per_block * blocks + embedding + head) * h + 3 * head)
    cp = (C > 1) * plan.microbatches * (8 if plan.checkpoint else 6) * (C - 1) * blocks * n * h // T * e
    if rows_off is None:
        rows_off = plan.microbatches * blocks * 2 * n * model.top_k * (plan.ep - 1) // plan.ep
    ep = (plan.ep > 1 and model.experts > 0) * int(2 * again) * rows_off * h * e
    return {"tp": tp, "cp": cp, "ep": ep}


def zero_optimizer_states(numel: int, k: int, stage: int, w: int, g: int, o: int) -> tuple[int, int, int]:
    """mini_dist's ZeroOptimizer (stage 0: plain data parallelism) keeps a flat vector padded to K*S
    elements, S = ceil(numel/K): weights whole, gradients whole or the own shard, state of the own shard."""
    S = shard(numel, k)
    return w * k * S, g * (S if stage == 2 else k * S), o * (k * S if stage == 0 else S)


def gpt_dp_traffic(model: Model, plan: Plan, layers: list[str]):
    """Bytes one rank sends per step over its data-parallel groups, for `layers`: ZeRO-1 3 and ZeRO-2 2 ring
    passes of (N-1) shards (mini_dist's ZeroOptimizer reduces once per step, whatever M), FSDP 2M gathers and M
    reduce-scatters of each layer's unit; DDP's ring all-reduce 2(N-1)/N of the gradient bytes, on average
    over the N ranks of dp x cp (a Fraction: its chunks may be uneven). Experts (ep > 1): ZeRO at the same
    stage (0: 2 passes) over the dp*cp/ep ranks holding the same ones."""
    from fractions import Fraction
    e, N = PRECISIONS[plan.precision][1], plan.dp * plan.cp
    numels = [gpt_layer_numel(model, plan, kind) for kind in layers]
    dense, experts = sum(d for d, _ in numels), sum(x for _, x in numels)
    passes = {0: 2, 1: 3, 2: 2}
    ring = lambda n, numel, k: n * (k - 1) * shard(numel, k) * e  # noqa: E731
    if plan.zero == 3:
        sent = sum(ring(3 * plan.microbatches, d, N) for d, _ in numels)
    elif plan.zero:
        sent = ring(passes[plan.zero], dense, N)
    else:
        sent = Fraction(2 * (N - 1) * dense * e, N)
    return sent + (experts > 0) * ring(passes[min(plan.zero, 2)], experts, N // plan.ep)


def gpt_rank_memory(model: Model, plan: Plan, layers: list[str], rank: int) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on the rank at place `rank` of dp x cp, for `layers`:
    DDP (gradients in its buckets), ZeroOptimizer (zero_optimizer_states), or FSDP with a unit per layer
    (shards of S_u = ceil(numel_u/N); the optimizer steps only the real elements of the own shard)."""
    w, g, o = bytes_per_param(plan.precision, plan.optimizer)
    N = plan.dp * plan.cp
    numels = [gpt_layer_numel(model, plan, kind) for kind in layers]
    dense, experts = sum(d for d, _ in numels), sum(x for _, x in numels)
    if plan.zero == 3:
        S = [shard(d, N) for d, _ in numels]
        states = (w * sum(S), g * sum(S), o * sum(min(max(d - rank * s, 0), s) for (d, _), s in zip(numels, S)))
    elif plan.zero:
        states = zero_optimizer_states(dense, N, plan.zero, w, g, o)
    else:
        states = (w * dense, g * dense, o * dense)
    if experts:
        states = [a + b for a, b in zip(states, zero_optimizer_states(experts, N // plan.ep, min(plan.zero, 2), w, g, o))]
    return dict(zip(("params", "grads", "state"), states))


def gpt_activation_bytes(model: Model, plan: Plan, layers: list[str], received: int | None = None) -> int:
    """Bytes one microbatch's forward leaves for backward on one rank in a chunk of `layers` (the loss after
    the head), n = micro_batch*seq/cp tokens, int64 indices, bool masks. A block with an MLP keeps
    e[(4nh + 4n) + (12nh + Hn)/T] (mini_dist/parallel_transformer.py's count; ring attention keeps what SDPA
    keeps); with a mixture of experts 4nh/T of the 12 stay, and the router, dispatch and experts keep
    e*nE + nk(24 + e + 2he) + (k > 1)n(k+1)e + R(16 + 9he), R the rows its experts received; `received`: R
    summed over the chunk's blocks (None: balanced, n*k per block, exact when ep = 1). A checkpointed block
    keeps its input, e*n*h. The embedding keeps token and position indices and a mask, 9n + 8*seq; the head
    its layer norm's input, statistics and output, e*n(2h + 2); the vocab-parallel loss its softmax,
    e*n*V/T, and 9n."""
    e, h, T, H, E, k = PRECISIONS[plan.precision][0], model.hidden, plan.tp, model.heads, model.experts, model.top_k
    n, routed = plan.micro_batch * model.seq // plan.cp, 0
    if plan.checkpoint:
        block = e * n * h
    elif E:
        block = e * (4 * n * h + 4 * n + (4 * n * h + H * n) // T) + e * n * E + n * k * (24 + e + 2 * h * e) \
            + (k > 1) * n * (k + 1) * e
        routed = (n * k * layers.count("block") if received is None else received) * (16 + 9 * h * e)
    else:
        block = e * (4 * n * h + 4 * n + (12 * n * h + H * n) // T)
    head = e * n * (2 * h + 2) + n * (e * model.vocab // T + 9)
    return routed + sum({"embedding": 9 * n + 8 * model.seq, "block": block, "head": head}[kind] for kind in layers)


def gpt_forward_transient(model: Model, plan: Plan, layers: list[str]) -> int:
    """Bytes a chunk's forward holds only until it returns: the E gate shares f_i that the (untrained) aux
    loss saves live until their MoE layer returns, so they top the peak when a chunk ends in a MoE block."""
    return (model.experts > 0 and not plan.checkpoint and layers[-1] == "block") * \
        PRECISIONS[plan.precision][0] * model.experts


def peak_activations(actions, cost, transient=lambda chunk: 0) -> int:
    """The most activation bytes alive at once on a rank running `actions` (a pipeline schedule's, see
    mini_dist/pipeline_schedules.py): each forward of chunk c and microbatch m adds cost(c, m) until the
    backward (or, split, the weight gradient W) that frees them, and holds transient(c) more while it runs."""
    alive = peak = 0
    for a in actions:
        alive += cost(a.chunk, a.mb) * ((a.op == "forward") - (a.op in ("backward", "backward_weight")))
        peak = max(peak, alive + (a.op == "forward") * transient(a.chunk))
    return peak


# ----------------------------------------------------------------------------- demo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def measured_model_state_bytes(numel: int, precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes torch holds after one step of a model of numel parameters.
    Mixed precision: the model's weights and gradients in 16 bits, the optimizer stepping an fp32 master copy
    (mini_dist/mixed_precision.py); its master and state tensors count as state. Adam's step counter, one
    scalar per parameter tensor, is left out, as the formula leaves it out."""
    weight = torch.zeros(numel, dtype=DTYPES[precision], requires_grad=True)
    weight.grad = torch.ones_like(weight)
    master = torch.nn.Parameter(weight.detach().float()) if PRECISIONS[precision][2] else weight
    master.grad = weight.grad.to(master.dtype)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "momentum": lambda p: torch.optim.SGD(p, 0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.1)}[optimizer]
    opt = make([master])
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    return size(weight), size(weight.grad), state + (size(master) if master is not weight else 0)


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
    print(f"per rank over K = {k} (Rajbhandari et al. 2020, Figure 1; S = ceil(N/K) = {shard(n, k):,}):")
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
