"""Activation memory of a transformer, measured: what checkpointing's demos, tests and benchmark share.

    TransformerLayer    a GPT layer written op by op, so that the bytes it saves for backward are
                        Korthikanti et al.'s count: layer_bytes(b, s, h, a) -> (A, I)
    transformer_stack   L of them on this rank's device, with an input and an output gradient
    stack_flags         the command line of such a stack, and require_stack: what it cannot build, refused
    no_checkpoint       run(model, x) as it is; each_layer: with every layer called through ckpt(layer, x)
    Strategy            a way to run a stack (ours, torch's), and what the formulas say it keeps and costs
    profile_strategies  each strategy's step measured: bytes kept after forward, bytes alive during backward,
                        forward runs per layer, FLOPs, and its gradients against the first strategy's and torch's
    strategy_table      those figures beside the formulas, one line per strategy

A kit module imports no concept: the checkpointing functions come in as the strategies' runs. Used by
activation_checkpoint.py and selective_checkpoint.py (their demos and question 18), their tests and
mini_dist/bench/activation_checkpoint.py.
"""
import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mini_dist.kit import launch
from mini_dist.kit.measure import profile_step


class TransformerLayer(nn.Module):
    """A pre-norm GPT layer written op by op, so that what it saves is Korthikanti et al.'s count (their
    Section 4.1): e(16sbh + 2as^2b) + 2sbh + as^2b bytes, plus the layer norms' mean and 1/std."""

    def __init__(self, hidden, heads, dropout=0.1, dtype=None, device=None):
        super().__init__()
        self.heads = heads
        self.p = dropout
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype, device=device)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=dtype, device=device)

    def drop(self, x):
        """Dropout that keeps a 1-byte mask on any device (F.dropout on the CPU keeps e bytes)."""
        return torch.native_dropout(x, self.p, True)[0]

    def forward(self, x):                                                                  # [b, s, h]
        qkv = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1))                     # [b, s, 3, a, d]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                                               # [b, a, s, d] each
        attn = self.drop((q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1))  # [b, a, s, s]
        x = x + self.drop(self.proj((attn @ v).transpose(1, 2).flatten(2)))               # [b, s, h]
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def layer_bytes(b: int, s: int, h: int, a: int, e: int = 4) -> tuple[int, int]:
    """(A, I): the bytes a TransformerLayer keeps for backward (with its norms' 4sb statistics), its input's."""
    kept = e * (16 * s * b * h + 2 * a * s * s * b) + 2 * s * b * h + a * s * s * b + 4 * s * b * e
    return kept, e * s * b * h


def transformer_stack(layers: int, batch: int, seq: int, hidden: int, heads: int, dropout: float, seed: int):
    """(model, x, dy): `layers` TransformerLayers from torch.manual_seed(seed) on this rank's device, an input
    (it needs no gradient: data) and the output's gradient."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[TransformerLayer(hidden, heads, dropout, device=launch.device()) for _ in range(layers)])
    x = torch.randn(batch, seq, hidden, device=launch.device())
    dy = torch.randn(batch, seq, hidden, device=launch.device())
    return model, x, dy


def stack_flags(parser, layers: int) -> None:
    """--layers, --batch, --seq, --hidden, --heads, --seed and --dropout of a transformer_stack."""
    parser.add_argument("--layers", type=int, default=layers, help="L, transformer layers")
    parser.add_argument("--batch", type=int, default=2, help="b, sequences")
    parser.add_argument("--seq", type=int, default=64, help="s, tokens")
    parser.add_argument("--hidden", type=int, default=64, help="h")
    parser.add_argument("--heads", type=int, default=4, help="a")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability (masks are recomputed)")


def require_stack(args) -> None:
    """Refuse, in one line, a stack that stack_flags' values cannot build."""
    sizes = [args.layers, args.batch, args.seq, args.hidden, args.heads]
    launch.require(min(sizes) >= 1, "--layers, --batch, --seq, --hidden and --heads must be >= 1")
    launch.require(args.hidden % args.heads == 0, f"--heads ({args.heads}) must divide --hidden ({args.hidden})")
    launch.require(0 <= args.dropout < 1, f"--dropout must lie in [0, 1), got {args.dropout}")


def no_checkpoint(model, x):
    """run(model, x) as it is: every layer keeps what it saves for backward."""
    return model(x)


def each_layer(ckpt):
    """run(model, x) with every layer of the model called through ckpt(layer, x)."""
    def run(model, x):
        for layer in model:
            x = ckpt(layer, x)
        return x
    return run


@dataclasses.dataclass
class Strategy:
    """A way to run a model for one step, torch's way beside it, and what the formulas say it costs."""
    name: str
    ours: Callable    # run(model, x) -> output
    torchs: Callable  # the same through torch.utils.checkpoint
    kept: int         # bytes kept for backward after forward, by the formula
    flops: float      # FLOPs of the step over the first strategy's, by the formula


def largest_difference(grads: list, others: list) -> float:
    """max |a - b| over two lists of gradients."""
    return max((a - b).abs().max().item() for a, b in zip(grads, others))


def profile_strategies(model, x, dy, strategies: list[Strategy], seed: int) -> dict:
    """name -> profile_step's figures for each strategy's run of model(x) (backward from dy), with its forward
    runs per layer, its FLOPs over the first strategy's, the largest |difference| of its gradients from the
    first strategy's and from torch's run, and its formulas. Each run starts from torch.manual_seed(seed): the
    same dropout masks for every strategy."""
    calls = []

    def count(layer, args):
        """A forward pre-hook: one more forward run of a layer."""
        calls.append(layer)

    def step(run) -> dict:
        """One forward and backward of run(model, x): the figures, forward runs per layer and the gradients."""
        calls.clear()
        model.zero_grad()
        torch.manual_seed(seed)
        figures = profile_step(lambda: run(model, x), lambda out: out.backward(dy), exclude=model.parameters())
        grads = [p.grad.clone() for p in model.parameters()]
        return dict(figures, calls=len(calls) / len(model), grads=grads)

    hooks = [layer.register_forward_pre_hook(count) for layer in model]
    rows = {}
    for strategy in strategies:
        row = step(strategy.ours)
        rows[strategy.name] = row
        first = rows[strategies[0].name]
        theirs = step(strategy.torchs)
        diff = max(largest_difference(row["grads"], first["grads"]), largest_difference(row["grads"], theirs["grads"]))
        row.update(kept=strategy.kept, more=strategy.flops, ratio=row["flops"] / first["flops"], diff=diff)
    for hook in hooks:
        hook.remove()
    return rows


def strategy_table(rows: dict) -> tuple[str, bool]:
    """profile_strategies' rows as a table: per strategy, the bytes kept after forward and alive at backward's
    peak, forward runs per layer and FLOPs over the first, beside the formulas. Holds when each equals its
    formula and every gradient is bit-identical to the first strategy's and torch's."""
    lines = []
    holds = True
    for name, r in rows.items():
        same = r["saved"] == r["kept"] and math.isclose(r["ratio"], r["more"], rel_tol=1e-12)
        holds = holds and same and r["diff"] == 0
        lines.append(f"  {name:<16} kept {r['saved']:>11,} B {'=' if same else '!='} formula {r['kept']:>11,} B, "
                     f"peak {max(r['backward']):>11,} B, forward x{r['calls']:<4.3g} FLOPs x{r['ratio']:.3f} "
                     f"(formula x{r['more']:.3f}), gradients' max |diff| {r['diff']:.0e}")
    head = "bytes on this rank, kept after forward and alive at backward's peak; compute over none:\n"
    return head + ";\n".join(lines), holds
