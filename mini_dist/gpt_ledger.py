"""The tiny GPT's ledger, layer by layer: what one forward + backward of a rank's layers holds and sends,
exactly, before anything runs.

mini_dist/cost_model.py has the papers' formulas for a large model. This is the same accounting done to the
byte for mini_dist's tiny GPT (mini_dist/parallel_gpt.py), whose demo prints it beside what each rank
measures. A rank holds 1/T of every weight matrix and E/ep of the experts, and sees n = b*s/C tokens of a
microbatch (b sequences of s tokens, cut by context parallelism C); e bytes an element (fp64: 8). Per layer:

    parameters   a block holds 2 layer norms (4h), attention (4h^2 + 4h)/T + h and an MLP (8h^2 + 4h)/T + h;
                 with experts, E/ep experts of 8h^2 + 5h each and an h x E router, replicated
    TP           a block all-reduces n*h*e four times (twice forward, twice backward; twice with experts,
                 which TP does not cut); the embedding once, the head once and its loss 3n*e more
    CP           ring attention sends K and V forward and dK and dV back: 6(C-1) * n*(h/T)*e per block
    EP           2 * (rows sent to other ranks + rows received from them) * h*e: forward, then their gradients
    activations  a block keeps e[(4nh + 4n) + (12nh + Hn)/T] for backward, e*n*h if it is checkpointed;
                 + e*Hn(s-1)/T under SDPA's math kernel (CUDA's for fp64), which keeps the H/T s x s
                 probabilities (Korthikanti's as^2b) where a fused kernel keeps one log-sum-exp per row

A checkpointed block runs its forward again in backward, and with it the forward's collectives: 4 TP
all-reduces become 6, 6 CP hops 8, 2 all-to-all trips 3. mini_dist/rank_ledger.py adds what a whole 5D
training step adds on each rank: the pipeline's messages, data parallelism's bytes and memory at each ZeRO
stage, and the peak of activations while a pipeline schedule runs.

Demo (one process: one layer's parameters beside PyTorch's dense layers, then each layer's ledger on one rank):

    python -m mini_dist.gpt_ledger --cp 2 --tp 2 [--moe 4 --ep 2 --checkpoint]
"""
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import DTYPES, PRECISIONS, Model, Plan
from mini_dist.expert_parallel import MoE
from mini_dist.kit import launch
from mini_dist.parallel_transformer import TransformerBlock

KINDS = ("embedding", "block", "head")  # the layers of the tiny GPT, in order: embedding, L blocks, head


def model_of(cfg) -> Model:
    """The ledger's view of a tiny_gpt.Config: its shape, vocabulary and experts."""
    return Model(0, cfg.layers, cfg.hidden, cfg.heads, cfg.seq, cfg.vocab, cfg.experts, cfg.top_k)


def layer_numel(model: Model, plan: Plan, kind: str) -> tuple[int, int]:
    """Elements of one layer on one rank: (weights replicated over dp x cp, experts replicated over the
    dp*cp/ep ranks that hold the same ones; with ep = 1 they count with the first). kind: "embedding" (V/T
    rows + seq positions), "block" (2 layer norms, attention cut by heads, then an MLP cut by TP or a router
    and E/ep experts h -> 4h -> h), "head" (a layer norm + V/T rows)."""
    h = model.hidden
    T = plan.tp
    E = model.experts
    if kind == "embedding":
        return model.vocab // T * h + model.seq * h, 0
    if kind == "head":
        return model.vocab // T * h + 2 * h, 0
    attention = (3 * h * h + 3 * h + h * h) // T + h          # in_proj cut by heads, out_proj's bias whole
    if not E:
        return 4 * h + attention + (8 * h * h + 4 * h) // T + h, 0
    experts = E // plan.ep * (8 * h * h + 5 * h)
    dense = 4 * h + attention + h * E                          # + the router, replicated
    if plan.ep == 1:
        return dense + experts, 0
    return dense, experts


def step_traffic(model: Model, plan: Plan, blocks: int, embedding: bool, head: bool,
                 rows_off: int | None = None) -> dict[str, int]:
    """Bytes one rank moves per step inside the model (M microbatches) for its `blocks`, embedding and head:
    "tp" all-reduce payload, "cp" ring attention's K/V (and dK/dV) sends, "ep" all-to-all rows. rows_off: rows
    its MoE layers sent to and got from other ranks in the step's forwards (None: balanced, n*top_k*(ep-1)/ep
    each way per block and microbatch)."""
    e = PRECISIONS[plan.precision][0]
    h = model.hidden
    T = plan.tp
    C = plan.cp
    M = plan.microbatches
    n = plan.micro_batch * model.seq // C
    again = 1.5 if plan.checkpoint else 1                       # a recomputed forward repeats its collectives
    per_block = int((2 if model.experts else 4) * again)
    tp = M * n * e * ((per_block * blocks + embedding + head) * h + 3 * head) if T > 1 else 0
    hops = 8 if plan.checkpoint else 6
    cp = M * hops * (C - 1) * blocks * n * h // T * e if C > 1 else 0
    if rows_off is None:
        rows_off = M * blocks * 2 * n * model.top_k * (plan.ep - 1) // plan.ep
    ep = int(2 * again) * rows_off * h * e if plan.ep > 1 and model.experts else 0
    return {"tp": tp, "cp": cp, "ep": ep}


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
    e = PRECISIONS[plan.precision][0]
    h = model.hidden
    T = plan.tp
    E = model.experts
    k = model.top_k
    n = plan.micro_batch * model.seq // plan.cp
    kept = model.heads * n * (model.seq if scores else 1)  # per token and head: s probabilities, or 1 lse
    routed = 0
    if plan.checkpoint:
        block = e * n * h
    elif E:
        pairs = n * (k + 1) * e if k > 1 else 0             # the top-k weights, renormalised
        block = e * (4 * n * h + 4 * n + (4 * n * h + kept) // T) + e * n * E + n * k * (24 + e + 2 * h * e) + pairs
        rows = n * k * layers.count("block") if received is None else received
        routed = rows * (16 + 9 * h * e)
    else:
        block = e * (4 * n * h + 4 * n + (12 * n * h + kept) // T)
    head = e * n * (2 * h + 2) + n * (e * model.vocab // T + 9)
    per_kind = {"embedding": 9 * n + 8 * model.seq, "block": block, "head": head}
    return routed + sum(per_kind[kind] for kind in layers)


def step_ledger(model: Model, plan: Plan, layers: list[str], routed: list, device) -> tuple[dict, dict]:
    """One forward + backward of `layers` (routed: each MoE layer's routed_rows): bytes sent by axis, bytes
    held by category."""
    numel = sum(sum(layer_numel(model, plan, kind)) for kind in layers)
    e = PRECISIONS[plan.precision][0]
    received = sum(r for _, r in routed)
    scores = attention_keeps_scores(model, plan, device)
    held = {"params": e * numel, "grads": e * numel,
            "activations": activation_bytes(model, plan, layers, received, scores)}
    rows_off = sum(o for o, _ in routed)
    sent = step_traffic(model, plan, layers.count("block"), "embedding" in layers, "head" in layers, rows_off)
    return sent, held


def routed_rows(moe, me: int) -> tuple[int, int]:
    """(rows an ExpertParallelMoE's last call sent to or got from other ranks, rows its experts got), me its rank."""
    off_rank = sum(moe.sent) - moe.sent[me] + sum(moe.received) - moe.received[me]
    return off_rank, sum(moe.received)


def attention_keeps_scores(model: Model, plan: Plan, device) -> bool:
    """Whether attention on `device` keeps its probabilities for backward: F.scaled_dot_product_attention's
    math kernel does (CUDA's, for fp64), a fused one keeps the log-sum-exp (CPU's flash kernel), and so does
    ring attention (cp > 1) everywhere. torch._fused_sdp_choice is the choice SDPA itself makes."""
    q = torch.empty(plan.micro_batch, model.heads // plan.tp, model.seq, model.hidden // model.heads,
                    dtype=DTYPES[plan.precision], device=device)
    return plan.cp == 1 and torch._fused_sdp_choice(q, q, q, is_causal=True) == int(SDPBackend.MATH)


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    for axis in ("cp", "tp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=2 if axis == "tp" else 1, help=f"{axis} degree")
    p.add_argument("--moe", type=int, default=0, help="E experts per block, top-2 (0: an MLP)")
    p.add_argument("--batch", type=int, default=2, help="b, sequences per microbatch")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in backward")
    return p


def dense_numel(model: Model, kind: str) -> int:
    """The parameters of one layer of the dense tiny GPT, counted by PyTorch on the meta device (no memory)."""
    h = model.hidden
    if kind == "embedding":
        layer = nn.ModuleList([nn.Embedding(model.vocab, h, device="meta"), nn.Embedding(model.seq, h, device="meta")])
    elif kind == "head":
        layer = nn.ModuleList([nn.LayerNorm(h, device="meta"), nn.Linear(h, model.vocab, bias=False, device="meta")])
    else:
        layer = TransformerBlock(h, model.heads, causal=True, device="meta", dtype=torch.float64)
        if model.experts:
            layer.mlp = MoE(h, 4 * h, model.experts, model.top_k, device="meta", dtype=torch.float64)
    return sum(p.numel() for p in layer.parameters())


def demo(args) -> int:
    E = args.moe
    launch.require(min(args.cp, args.tp, args.ep, args.batch) >= 1 and 4 % args.tp == 0 and 16 % (2 * args.cp) == 0,
                   f"--cp, --tp, --ep, --batch must be >= 1; --tp {args.tp} must divide the 4 heads and 2 x --cp "
                   f"the 16 tokens")
    launch.require(E % args.ep == 0 and E != 1 and E >= 0 and (E or args.ep == 1),
                   f"--ep {args.ep} must divide --moe {E} (0, or 2 or more: top-2)")
    model = Model(0, 4, 32, 4, 16, 27 + -27 % args.tp, E, 2)  # the tiny GPT: its 27 characters, padded to T rows
    plan = Plan(dp=1, cp=args.cp, tp=args.tp, ep=args.ep, checkpoint=args.checkpoint, micro_batch=args.batch,
                precision="fp64")
    counted = {kind: dense_numel(model, kind) for kind in KINDS}
    ledger = {kind: sum(layer_numel(model, Plan(dp=1), kind)) for kind in KINDS}
    same = ledger == counted
    print(f"tiny GPT: 4 blocks, h = 32, 4 heads, s = 16, V = {model.vocab}, {f'{E} experts top-2' if E else 'MLP'}; "
          f"cp {args.cp} x tp {args.tp} x ep {args.ep}, one forward + backward of b = {args.batch} sequences, fp64"
          f"{', blocks checkpointed' if args.checkpoint else ''}\nparameters of one dense layer, ledger = PyTorch's "
          "layers: " + ", ".join(f"{k} {ledger[k]:,} {'=' if ledger[k] == counted[k] else '!='} {counted[k]:,}"
                                 for k in KINDS))
    print("bytes on one rank, by layer: parameters | sent by axis (TP, CP, EP balanced) | kept for backward")
    for kind in KINDS:
        sent = step_traffic(model, plan, kind == "block", kind == "embedding", kind == "head")
        print(f"  {kind:>9} {8 * sum(layer_numel(model, plan, kind)):>9,} |" + "".join(
            f" {axis} {sent[axis]:>8,}" for axis in sent) + f" | {activation_bytes(model, plan, [kind]):>8,}")
    layers = ["embedding"] + ["block"] * 4 + ["head"]
    params = 8 * sum(sum(layer_numel(model, plan, kind)) for kind in layers)
    sent = sum(step_traffic(model, plan, 4, True, True).values())
    kept = activation_bytes(model, plan, layers)
    print(f"  the whole model: {params:,} B of parameters (and as many of gradients), {sent:,} B sent, {kept:,} B "
          "kept for backward")
    print(f"SUMMARY|gpt_ledger|{'PASS' if same else 'FAIL'} one layer's parameters = PyTorch's, dense|PASS one rank at "
          f"cp {args.cp} x tp {args.tp}: {params:,} B of parameters, {sent:,} B sent, {kept:,} B kept")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
