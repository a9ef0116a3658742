"""The tiny GPT's ledger, rank by rank: what each rank of a 5D run holds and sends, exactly, before it runs.

mini_dist/cost_model.py has the papers' formulas for a large model. This is the same accounting done to
the byte for mini_dist's tiny GPT (mini_dist/parallel_gpt.py) trained by mini_dist/train_5d.py, whose
demos print it beside what each rank measures. A rank holds some layers (its pipeline chunks), 1/T of their
matrices and E/ep of their experts, and sees n = b*s/C tokens per microbatch; e bytes an element (fp64: 8):

    parameters   block 2 layer norms 4h + attention (4h^2 + 4h)/T + h + MLP (8h^2 + 4h)/T + h
                 (experts: E/ep experts of 8h^2 + 5h, and an h x E router, replicated)
    TP           [n_T*L + embedding + head] * n*h*e + 3n*e per microbatch (n_T = 4 all-reduces, 2 with experts)
    CP           6(C-1) * n*(h/T)*e per block and microbatch (K and V round the ring, dK and dV back)
    EP           2 * (rows sent to other ranks + rows received from them) * h*e
    DP           over N = dp*cp ranks: DDP 2(N-1)/N * D, ZeRO-1 3(N-1)*S, ZeRO-2 2(N-1)*S, FSDP 3M(N-1)*S_u
    activations  per block and microbatch e[(4nh + 4n) + (12nh + Hn)/T], e*n*h if the block is checkpointed;
                 + e*Hn(s-1)/T under SDPA's math kernel (CUDA's for fp64), which keeps the H/T s x s
                 probabilities (Korthikanti's as^2b) where a fused kernel keeps one log-sum-exp per row
    peak         the most of them alive at once while a pipeline schedule runs its forwards and backwards

A checkpointed block repeats its forward's collectives in backward: n_T -> 1.5 n_T, 6 -> 8 CP hops, 2 -> 3
all-to-all trips. Demo (one process: each rank's ledger for a grid; the layers' counts beside PyTorch's):

    python -m mini_dist.gpt_ledger --dp 2 --pp 2 --tp 2 [--cp 2 --moe 4 --ep 2 --zero 1 --checkpoint]
"""
import sys
from fractions import Fraction
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import DTYPES, PRECISIONS, STAGES, Model, Plan, bytes_per_param, shard
from mini_dist.expert_parallel import MoE
from mini_dist.kit import launch
from mini_dist.parallel_transformer import TransformerBlock
from mini_dist.pipeline_messages import HEADER_LEN
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import balanced_split


def model_of(cfg) -> Model:
    """The ledger's view of a parallel_gpt.Config: its shape, vocabulary and experts."""
    return Model(0, cfg.layers, cfg.hidden, cfg.heads, cfg.seq, cfg.vocab, cfg.experts, cfg.top_k)


def layer_numel(model: Model, plan: Plan, kind: str) -> tuple[int, int]:
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


def step_traffic(model: Model, plan: Plan, blocks: int, embedding: bool, head: bool,
                 rows_off: int | None = None) -> dict[str, int]:
    """Bytes one rank moves per step inside the model (M microbatches) for its `blocks`, embedding and head:
    "tp" all-reduce payload, "cp" ring attention's K/V (and dK/dV) sends, "ep" all-to-all rows. rows_off: rows
    its MoE layers sent to and got from other ranks in the step's forwards (None: balanced, n*top_k*(ep-1)/ep
    each way per block and microbatch)."""
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


def pp_traffic(model: Model, plan: Plan, stages: list[int], chunks: int) -> int:
    """Bytes a pipeline rank sends per step for its virtual `stages` of P*chunks: M activations [b, s/C, h] on unless
    it is the last, M gradients back unless it is the first, one HEADER_LEN int64 header ahead of the first."""
    S, act = plan.pp * chunks, plan.microbatches * plan.micro_batch * model.seq // plan.cp * model.hidden
    e = PRECISIONS[plan.precision][0]
    return (plan.pp > 1) * sum(e * act * ((j < S - 1) + (j > 0)) + 8 * HEADER_LEN * (j < S - 1) for j in stages)


def zero_optimizer_states(numel: int, k: int, stage: int, w: int, g: int, o: int) -> tuple[int, int, int]:
    """mini_dist's ZeroOptimizer (stage 0: plain data parallelism) keeps a flat vector padded to K*S
    elements, S = ceil(numel/K): weights whole, gradients whole or the own shard, state of the own shard."""
    S = shard(numel, k)
    return w * k * S, g * (S if stage == 2 else k * S), o * (k * S if stage == 0 else S)


def dp_traffic(model: Model, plan: Plan, layers: list[str]):
    """Bytes one rank sends per step over its data-parallel groups, for `layers`: ZeRO-1 3 and ZeRO-2 2 ring
    passes of (N-1) shards (ZeroOptimizer reduces once per step, whatever M), FSDP 2M gathers and M
    reduce-scatters of each layer's unit; DDP's ring all-reduce 2(N-1)/N of the gradient bytes, on average
    over the N ranks of dp x cp (a Fraction: its chunks may be uneven). Experts (ep > 1): ZeRO at the same
    stage (0: 2 passes) over the dp*cp/ep ranks holding the same ones."""
    e, N = PRECISIONS[plan.precision][1], plan.dp * plan.cp
    numels = [layer_numel(model, plan, kind) for kind in layers]
    dense, experts = sum(d for d, _ in numels), sum(x for _, x in numels)
    passes = {0: 2, 1: 3, 2: 2}

    def ring(times, numel, k):
        return times * (k - 1) * shard(numel, k) * e
    if plan.zero == 3:
        sent = sum(ring(3 * plan.microbatches, d, N) for d, _ in numels)
    elif plan.zero:
        sent = ring(passes[plan.zero], dense, N)
    else:
        sent = Fraction(2 * (N - 1) * dense * e, N)
    return sent + (experts > 0) * ring(passes[min(plan.zero, 2)], experts, N // plan.ep)


def rank_memory(model: Model, plan: Plan, layers: list[str], rank: int) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on the rank at place `rank` of dp x cp, for `layers`:
    DDP (gradients in its buckets), ZeroOptimizer (zero_optimizer_states), or FSDP with a unit per layer
    (shards of S_u = ceil(numel_u/N); the optimizer steps only the real elements of the own shard)."""
    w, g, o = bytes_per_param(plan.precision, plan.optimizer)
    N = plan.dp * plan.cp
    numels = [layer_numel(model, plan, kind) for kind in layers]
    dense, experts = sum(d for d, _ in numels), sum(x for _, x in numels)
    if plan.zero == 3:
        S = [shard(d, N) for d, _ in numels]
        states = (w * sum(S), g * sum(S), o * sum(min(max(d - rank * s, 0), s) for (d, _), s in zip(numels, S)))
    elif plan.zero:
        states = zero_optimizer_states(dense, N, plan.zero, w, g, o)
    else:
        states = (w * dense, g * dense, o * dense)
    if experts:
        more = zero_optimizer_states(experts, N // plan.ep, min(plan.zero, 2), w, g, o)
        states = [a + b for a, b in zip(states, more)]
    return dict(zip(("params", "grads", "state"), states))


def activation_bytes(model: Model, plan: Plan, layers: list[str], received: int | None = None,
                     scores: bool = False) -> int:
    """Bytes one microbatch's forward leaves for backward on one rank in a chunk of `layers` (the loss after
    the head), n = micro_batch*seq/cp tokens, int64 indices, bool masks. A block with an MLP keeps
    e[(4nh + 4n) + (12nh + Hn)/T] (mini_dist/parallel_transformer.py's count; attention keeps q, k, v, its
    output and the log-sum-exp, as ring attention does); with a mixture of experts 4nh/T of the 12 stay, and
    the router, dispatch and experts keep e*nE + nk(24 + e + 2he) + (k > 1)n(k+1)e + R(16 + 9he), R the rows
    its experts received; `received`: R summed over the chunk's blocks (None: balanced, n*k per block, exact
    when ep = 1). A checkpointed block keeps its input, e*n*h. The embedding keeps token and position
    indices and a mask, 9n + 8*seq; the head its layer norm's input, statistics and output, e*n(2h + 2); the
    vocab-parallel loss its softmax, e*n*V/T, and 9n. scores: attention_keeps_scores, e*Hn(s-1)/T more a block."""
    e, h, T, E, k = PRECISIONS[plan.precision][0], model.hidden, plan.tp, model.experts, model.top_k
    n, routed = plan.micro_batch * model.seq // plan.cp, 0
    kept = model.heads * n * (model.seq if scores else 1)  # per token and head: s probabilities, or 1 lse
    if plan.checkpoint:
        block = e * n * h
    elif E:
        block = e * (4 * n * h + 4 * n + (4 * n * h + kept) // T) + e * n * E + n * k * (24 + e + 2 * h * e) \
            + (k > 1) * n * (k + 1) * e
        routed = (n * k * layers.count("block") if received is None else received) * (16 + 9 * h * e)
    else:
        block = e * (4 * n * h + 4 * n + (12 * n * h + kept) // T)
    head = e * n * (2 * h + 2) + n * (e * model.vocab // T + 9)
    return routed + sum({"embedding": 9 * n + 8 * model.seq, "block": block, "head": head}[kind] for kind in layers)


def attention_keeps_scores(model: Model, plan: Plan, device) -> bool:
    """Whether attention on `device` keeps its probabilities for backward: F.scaled_dot_product_attention's
    math kernel does (CUDA's, for fp64), a fused one keeps the log-sum-exp (CPU's flash kernel), and so does
    ring attention (cp > 1) everywhere. torch._fused_sdp_choice is the choice SDPA itself makes."""
    q = torch.empty(plan.micro_batch, model.heads // plan.tp, model.seq, model.hidden // model.heads,
                    dtype=DTYPES[plan.precision], device=device)
    return plan.cp == 1 and torch._fused_sdp_choice(q, q, q, is_causal=True) == int(SDPBackend.MATH)


def routed_rows(moe, me: int) -> tuple[int, int]:
    """(rows an ExpertParallelMoE's last call sent to or got from other ranks, rows its experts got), me its rank."""
    return sum(moe.sent) - moe.sent[me] + sum(moe.received) - moe.received[me], sum(moe.received)


def step_ledger(model: Model, plan: Plan, layers: list[str], routed: list, device) -> tuple[dict, dict]:
    """One forward + backward of `layers` (routed: its routed_rows): bytes sent by axis, bytes held by category."""
    numel = sum(sum(layer_numel(model, plan, k)) for k in layers)
    e, received = PRECISIONS[plan.precision][0], sum(r for _, r in routed)
    scores = attention_keeps_scores(model, plan, device)
    held = {"params": e * numel, "grads": e * numel,
            "activations": activation_bytes(model, plan, layers, received, scores)}
    sent = step_traffic(model, plan, layers.count("block"), "embedding" in layers, "head" in layers,
                        sum(o for o, _ in routed))
    return sent, held


def forward_transient(model: Model, plan: Plan, layers: list[str]) -> int:
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


def rank_ledger(model: Model, plan: Plan, schedule: str, layout: list, pp_rank: int, place: int, routed=None,
                scores: bool = False) -> tuple[dict, dict]:
    """One rank's bytes sent per step by axis, and bytes held by category. layout: its chunks' layers (chunk c
    is virtual stage c*P + pp_rank); place: its index in dp x cp; routed: per chunk, per MoE block forward in
    schedule order, routed_rows (None: balanced routing); scores: see attention_keeps_scores."""
    chunks, M, layers = len(layout), plan.microbatches, [k for chunk in layout for k in chunk]
    off = None if routed is None else sum(o for chunk in routed for o, _ in chunk)
    stages = [c * plan.pp + pp_rank for c in range(chunks)]
    traffic = {"dp": dp_traffic(model, plan, layers), "pp": pp_traffic(model, plan, stages, chunks),
               **step_traffic(model, plan, layers.count("block"), "embedding" in layers, "head" in layers, off)}
    actions = SCHEDULES[schedule](plan.pp, M, chunks).actions[pp_rank]
    received = {}  # (chunk, microbatch): rows its experts received; a chunk's forwards run in schedule order
    for c, rows in enumerate(routed or []):
        forwards, k = [a.mb for a in actions if a.op == "forward" and a.chunk == c], len(rows) // M
        received.update({(c, m): sum(r for _, r in rows[i * k:(i + 1) * k]) for i, m in enumerate(forwards)})
    peak = peak_activations(actions, lambda c, m: activation_bytes(model, plan, layout[c], received.get((c, m)),
                                                                   scores),
                            lambda c: forward_transient(model, plan, layout[c]))
    return traffic, {**rank_memory(model, plan, layers, place), "activations": peak}


# ----- demo: every rank's ledger, before anything runs -----

def dense_numel(model: Model, kind: str) -> int:
    """The parameters of one layer of the dense tiny GPT, counted by PyTorch on the meta device (no memory)."""
    h, kw = model.hidden, dict(device="meta", dtype=torch.float64)  # meta: shapes only
    if kind == "embedding":
        layer = nn.ModuleList([nn.Embedding(model.vocab, h, device="meta"), nn.Embedding(model.seq, h, device="meta")])
    elif kind == "head":
        layer = nn.ModuleList([nn.LayerNorm(h, device="meta"), nn.Linear(h, model.vocab, bias=False, device="meta")])
    else:
        layer = TransformerBlock(h, model.heads, causal=True, **kw)
        if model.experts:
            layer.mlp = MoE(h, 4 * h, model.experts, model.top_k, **kw)
    return sum(p.numel() for p in layer.parameters())


def stage_layers(model: Model, virtual_stages: int) -> list[list[str]]:
    """The layers of each virtual stage, cut as train_5d cuts the model: balanced by 1 + parameters."""
    kinds = ["embedding"] + ["block"] * model.layers + ["head"]
    sizes = balanced_split([1 + sum(layer_numel(model, Plan(dp=1), k)) for k in kinds], virtual_stages)
    return [kinds[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]


def parser():
    p = launch.demo_parser(__doc__)
    for axis in ("dp", "pp", "cp", "tp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=2 if axis in ("dp", "pp", "tp") else 1, help=f"{axis} degree")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 (0: an MLP)")
    p.add_argument("--zero", type=int, choices=tuple(STAGES), default=0, help="0 DDP, 1-2 ZeRO, 3 FSDP")
    p.add_argument("--microbatches", type=int, default=2, help="M per replica")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in backward")
    return p


def demo(args) -> int:
    d = {a: getattr(args, a) for a in ("dp", "pp", "cp", "tp", "ep")}
    M, E, keys = args.microbatches, args.moe, ("dp", "pp", "cp", "tp", "ep", "params", "grads", "state", "activations")
    launch.require(min(*d.values(), M, args.chunks) >= 1 and 4 % d["tp"] == 0 and 16 % (2 * d["cp"]) == 0 and
                   d["pp"] * args.chunks <= 6, f"degrees, --microbatches, --chunks >= 1; --tp {d['tp']} must divide "
                   f"the 4 heads, 2 x --cp the 16 tokens, --pp x --chunks <= the 6 layers (embedding, 4 blocks, head)")
    launch.require(d["dp"] * d["cp"] % d["ep"] == 0 and E % d["ep"] == 0 and E != 1 and E >= 0 and (E or d["ep"] == 1),
                   f"--ep {d['ep']} must divide dp x cp = {d['dp'] * d['cp']} and --moe {E} (0, or 2 or more: top-2)")
    model = Model(0, 4, 32, 4, 16, 28 + -28 % d["tp"], E, 2)  # train_5d's tiny GPT: V = 28 characters, padded
    plan = Plan(dp=d["dp"], pp=d["pp"], cp=d["cp"], tp=d["tp"], ep=d["ep"], zero=args.zero, microbatches=M,
                checkpoint=args.checkpoint, micro_batch=-(-8 // (d["dp"] * M)), precision="fp64")  # train_5d's batch
    counted, scores = {k: dense_numel(model, k) for k in ("embedding", "block", "head")}, False  # CPU attention
    ledger = {k: sum(layer_numel(model, Plan(dp=1), k)) for k in counted}
    print(f"tiny GPT: 4 blocks, h = 32, 4 heads, s = 16, V = {model.vocab}, {f'{E} experts top-2' if E else 'MLP'}; "
          + " x ".join(f"{a} {v}" for a, v in d.items()) + f"; {STAGES[args.zero]}, {args.schedule}, M = {M} "
          f"microbatches of b = {plan.micro_batch} sequences, fp64\nparameters of one dense layer, ledger = "
          "PyTorch's layers: " + ", ".join(f"{k} {ledger[k]:,} {'=' if ledger[k] == counted[k] else '!='} "
                                           f"{counted[k]:,}" for k in ledger))
    print("bytes per rank (every tp rank of a row alike): sent per step by axis | held, activations at their peak\n"
          "  pp dp*cp" + "".join(f"{k:>12}" for k in keys))
    for p in range(d["pp"]):
        for f in range(d["dp"] * d["cp"]):
            layout = [stage_layers(model, d["pp"] * args.chunks)[c * d["pp"] + p] for c in range(args.chunks)]
            row = {k: v for part in rank_ledger(model, plan, args.schedule, layout, p, f, None, scores)
                   for k, v in part.items()}
            print(f"  {p:>2} {f:>5}" + "".join(f"{float(row[k]):>12,.0f}" for k in keys))
    ok = ledger == counted
    print(f"SUMMARY|gpt_ledger|{'PASS' if ok else 'FAIL'} one layer's parameters = PyTorch's, dense|"
          f"{'PASS' if ok else 'FAIL'} {d['pp'] * d['dp'] * d['cp']} rank ledgers, tp {d['tp']} alike")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
