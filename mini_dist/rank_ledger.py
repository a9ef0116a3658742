"""Each rank of a 5D run, over a whole training step: what it sends on every axis and holds at its peak,
exactly, before it runs.

mini_dist/gpt_ledger.py counts one forward + backward of a rank's layers. mini_dist/train_5d.py runs more:
its rank holds some layers of a pipeline (its chunks), runs M microbatches through them in a schedule's
order, and shares its weights with the N = dp*cp ranks of data parallelism. This ledger adds what that adds,
with e bytes an element, S = ceil(D/N) elements a shard of the D replicated ones:

    PP           per step, M activations [b, s/C, h] to the next stage unless the rank holds the last, M
                 gradients back unless it holds the first, and one header of 13 int64s ahead of the first
                 activation (its shape: mini_dist/pipeline_messages.py)
    DP           DDP 2(N-1)/N * D*e (a ring all-reduce), ZeRO-1 3(N-1) * S*e (its reduce-scatter and all-gather
                 of the gradients, then the all-gather of the updated weights), ZeRO-2 2(N-1) * S*e, FSDP
                 3M(N-1) * S_u*e for each layer u (a gather for forward and for backward, a reduce-scatter);
                 experts: ZeRO at the same stage over the dp*cp/ep ranks that hold the same ones
    memory       weights, gradients and optimizer state of DDP (whole), ZeroOptimizer (a flat vector padded
                 to N*S elements: gradients or their shard, state of the shard) or FSDP (shards of S_u)
    peak         the most activation bytes alive at once: each forward of a microbatch adds its layers'
                 activations (gpt_ledger.activation_bytes) until its backward frees them, so GPipe keeps all
                 M on a stage and 1F1B at most P - stage (Narayanan et al. 2021)

Demo (one process: every rank's ledger for a grid, the model cut as train_5d cuts it):

    python -m mini_dist.rank_ledger --dp 2 --pp 2 --tp 2 [--cp 2 --moe 4 --ep 2 --zero 1 --checkpoint]
"""
import sys
from fractions import Fraction
from pathlib import Path

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.cost_model import PRECISIONS, STAGES, Model, Plan, bytes_per_param, shard
from mini_dist.gpt_ledger import activation_bytes, layer_numel, step_traffic
from mini_dist.kit import launch
from mini_dist.pipeline_messages import HEADER_LEN
from mini_dist.pipeline_schedules import SCHEDULES
from mini_dist.pipeline_stages import balanced_split
from mini_dist.tiny_gpt import padded_vocab


def rank_ledger(model: Model, plan: Plan, schedule: str, layout: list, pp_rank: int, place: int, routed=None,
                scores: bool = False) -> tuple[dict, dict]:
    """One rank's bytes sent per step by axis, and bytes held by category. layout: its chunks' layers (chunk c
    is virtual stage c*P + pp_rank); place: its index in dp x cp; routed: per chunk, per MoE block forward in
    schedule order, gpt_ledger.routed_rows (None: balanced routing); scores: gpt_ledger.attention_keeps_scores."""
    chunks = len(layout)
    M = plan.microbatches
    layers = [kind for chunk in layout for kind in chunk]
    rows_off = None if routed is None else sum(off for chunk in routed for off, _ in chunk)
    stages = [c * plan.pp + pp_rank for c in range(chunks)]
    inside = step_traffic(model, plan, layers.count("block"), "embedding" in layers, "head" in layers, rows_off)
    traffic = {"dp": dp_traffic(model, plan, layers), "pp": pp_traffic(model, plan, stages, chunks), **inside}
    actions = SCHEDULES[schedule](plan.pp, M, chunks).actions[pp_rank]
    received = {}  # (chunk, microbatch): rows its experts received; a chunk's forwards run in schedule order
    for c, rows in enumerate(routed or []):
        forwards = [a.mb for a in actions if a.op == "forward" and a.chunk == c]
        per_forward = len(rows) // M  # the chunk's MoE blocks, each called once a forward
        for i, m in enumerate(forwards):
            received[(c, m)] = sum(r for _, r in rows[i * per_forward:(i + 1) * per_forward])

    def cost(c: int, m: int) -> int:
        """Activation bytes microbatch m's forward through chunk c keeps for backward."""
        return activation_bytes(model, plan, layout[c], received.get((c, m)), scores)

    def transient(c: int) -> int:
        """Bytes chunk c's forward holds only while it runs."""
        return forward_transient(model, plan, layout[c])
    peak = peak_activations(actions, cost, transient)
    return traffic, {**rank_memory(model, plan, layers, place), "activations": peak}


def pp_traffic(model: Model, plan: Plan, stages: list[int], chunks: int) -> int:
    """Bytes a pipeline rank sends per step for its virtual `stages` of P*chunks: M activations [b, s/C, h] on
    unless it is the last, M gradients back unless it is the first, one HEADER_LEN int64 header ahead of the
    first activation."""
    if plan.pp == 1:
        return 0
    last = plan.pp * chunks - 1
    e = PRECISIONS[plan.precision][0]
    activation = plan.microbatches * plan.micro_batch * model.seq // plan.cp * model.hidden * e
    sent = 0
    for j in stages:
        if j < last:
            sent += activation + 8 * HEADER_LEN
        if j > 0:
            sent += activation
    return sent


def dp_traffic(model: Model, plan: Plan, layers: list[str]):
    """Bytes one rank sends per step over its data-parallel groups, for `layers`: ZeRO-1 3 and ZeRO-2 2 ring
    passes of (N-1) shards (ZeroOptimizer reduces once per step, whatever M), FSDP 2M gathers and M
    reduce-scatters of each layer's unit; DDP's ring all-reduce 2(N-1)/N of the gradient bytes, on average
    over the N ranks of dp x cp (a Fraction: its chunks may be uneven). Experts (ep > 1): ZeRO at the same
    stage (0: 2 passes) over the dp*cp/ep ranks holding the same ones."""
    e = PRECISIONS[plan.precision][1]
    N = plan.dp * plan.cp
    numels = [layer_numel(model, plan, kind) for kind in layers]
    dense = sum(d for d, _ in numels)
    experts = sum(x for _, x in numels)
    passes = {0: 2, 1: 3, 2: 2}

    def ring(times: int, numel: int, k: int) -> int:
        """Bytes of `times` ring passes of k-1 shards of a flat vector of numel over k ranks."""
        return times * (k - 1) * shard(numel, k) * e
    if plan.zero == 3:
        sent = sum(ring(3 * plan.microbatches, d, N) for d, _ in numels)
    elif plan.zero:
        sent = ring(passes[plan.zero], dense, N)
    else:
        sent = Fraction(2 * (N - 1) * dense * e, N)
    if experts:
        sent += ring(passes[min(plan.zero, 2)], experts, N // plan.ep)
    return sent


def rank_memory(model: Model, plan: Plan, layers: list[str], rank: int) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on the rank at place `rank` of dp x cp, for `layers`:
    DDP (gradients in its buckets), ZeroOptimizer (zero_optimizer_states), or FSDP with a unit per layer
    (shards of S_u = ceil(numel_u/N); the optimizer steps only the real elements of the own shard)."""
    w, g, o = bytes_per_param(plan.precision, plan.optimizer)
    N = plan.dp * plan.cp
    numels = [layer_numel(model, plan, kind) for kind in layers]
    dense = sum(d for d, _ in numels)
    experts = sum(x for _, x in numels)
    if plan.zero == 3:
        shards = [shard(d, N) for d, _ in numels]
        real = sum(min(max(d - rank * s, 0), s) for (d, _), s in zip(numels, shards))  # the last shard's padding
        states = [w * sum(shards), g * sum(shards), o * real]
    elif plan.zero:
        states = zero_optimizer_states(dense, N, plan.zero, w, g, o)
    else:
        states = [w * dense, g * dense, o * dense]
    if experts:
        more = zero_optimizer_states(experts, N // plan.ep, min(plan.zero, 2), w, g, o)
        states = [a + b for a, b in zip(states, more)]
    return dict(zip(("params", "grads", "state"), states))


def zero_optimizer_states(numel: int, k: int, stage: int, w: int, g: int, o: int) -> list[int]:
    """mini_dist's ZeroOptimizer (stage 0: plain data parallelism) keeps a flat vector padded to K*S
    elements, S = ceil(numel/K): weights whole, gradients whole or the own shard, state of the own shard."""
    S = shard(numel, k)
    return [w * k * S, g * (S if stage == 2 else k * S), o * (k * S if stage == 0 else S)]


def peak_activations(actions, cost, transient=None) -> int:
    """The most activation bytes alive at once on a rank running `actions` (a pipeline schedule's, see
    mini_dist/pipeline_schedules.py): each forward of chunk c and microbatch m adds cost(c, m) until the
    backward (or, split, the weight gradient W) that frees them, and holds transient(c) more while it runs."""
    alive = 0
    peak = 0
    for a in actions:
        if a.op == "forward":
            alive += cost(a.chunk, a.mb)
            peak = max(peak, alive + (transient(a.chunk) if transient else 0))
        elif a.op in ("backward", "backward_weight"):
            alive -= cost(a.chunk, a.mb)
    return peak


def forward_transient(model: Model, plan: Plan, layers: list[str]) -> int:
    """Bytes a chunk's forward holds only until it returns: the E gate shares f_i that the (untrained) aux
    loss saves live until their MoE layer returns, so they top the peak when a chunk ends in a MoE block."""
    if model.experts and not plan.checkpoint and layers[-1] == "block":
        return PRECISIONS[plan.precision][0] * model.experts
    return 0


# ----------------------------------------------------------------------------- demo

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


def stage_layers(model: Model, virtual_stages: int) -> list[list[str]]:
    """The layers of each virtual stage, cut as train_5d cuts the model: balanced by 1 + parameters."""
    kinds = ["embedding"] + ["block"] * model.layers + ["head"]
    sizes = balanced_split([1 + sum(layer_numel(model, Plan(dp=1), k)) for k in kinds], virtual_stages)
    return [kinds[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]


def one(chunk: int, microbatch: int) -> int:
    """A cost of 1 for every forward: peak_activations then counts the microbatches alive."""
    return 1


def demo(args) -> int:
    d = {axis: getattr(args, axis) for axis in ("dp", "pp", "cp", "tp", "ep")}
    M = args.microbatches
    E = args.moe
    launch.require(min(*d.values(), M, args.chunks) >= 1 and 4 % d["tp"] == 0 and 16 % (2 * d["cp"]) == 0 and
                   d["pp"] * args.chunks <= 6, f"degrees, --microbatches, --chunks >= 1; --tp {d['tp']} must divide "
                   f"the 4 heads, 2 x --cp the 16 tokens, --pp x --chunks <= the 6 layers (embedding, 4 blocks, head)")
    launch.require(d["dp"] * d["cp"] % d["ep"] == 0 and E % d["ep"] == 0 and E != 1 and E >= 0 and (E or d["ep"] == 1),
                   f"--ep {d['ep']} must divide dp x cp = {d['dp'] * d['cp']} and --moe {E} (0, or 2 or more: top-2)")
    model = Model(0, 4, 32, 4, 16, padded_vocab(d["tp"]), E, 2)  # train_5d's tiny GPT
    plan = Plan(dp=d["dp"], pp=d["pp"], cp=d["cp"], tp=d["tp"], ep=d["ep"], zero=args.zero, microbatches=M,
                checkpoint=args.checkpoint, micro_batch=-(-8 // (d["dp"] * M)), precision="fp64")  # train_5d's batch
    keys = ("dp", "pp", "cp", "tp", "ep", "params", "grads", "state", "activations")
    print(f"tiny GPT: 4 blocks, h = 32, 4 heads, s = 16, V = {model.vocab}, {f'{E} experts top-2' if E else 'MLP'}; "
          + " x ".join(f"{a} {v}" for a, v in d.items()) + f"; {STAGES[args.zero]}, {args.schedule}, M = {M} "
          f"microbatches of b = {plan.micro_batch} sequences, fp64")
    print("bytes per rank (every tp rank of a row alike): sent per step by axis | held, activations at their peak\n"
          "  pp dp*cp" + "".join(f"{k:>12}" for k in keys))
    stages = stage_layers(model, d["pp"] * args.chunks)
    rows = 0
    for p in range(d["pp"]):
        layout = [stages[c * d["pp"] + p] for c in range(args.chunks)]
        for f in range(d["dp"] * d["cp"]):
            traffic, memory = rank_ledger(model, plan, args.schedule, layout, p, f)  # CPU attention: no scores
            row = {**traffic, **memory}
            print(f"  {p:>2} {f:>5}" + "".join(f"{float(row[k]):>12,.0f}" for k in keys))
            rows += 1
    P = d["pp"]
    keeps = [peak_activations(SCHEDULES[args.schedule](P, M, args.chunks).actions[p], one) for p in range(P)]
    textbook = {"gpipe": [M] * P, "1f1b": [min(M, P - p) for p in range(P)]}.get(args.schedule)
    holds = textbook is None or keeps == textbook
    said = f" (GPipe keeps all M, 1F1B min(M, P - stage): {textbook})" if textbook else ""
    print(f"{args.schedule}: microbatch forwards alive at the peak, per pp rank: {keeps}{said}")
    print(f"SUMMARY|rank_ledger|{'PASS' if holds else 'FAIL'} {args.schedule}'s peak keeps {keeps} microbatches per "
          f"stage|PASS {rows} rank ledgers, tp {d['tp']} alike")
    return 0 if holds else 1


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
