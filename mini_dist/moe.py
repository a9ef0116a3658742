"""Mixture of experts: the top-k router, expert capacity and Switch's load-balancing loss, in one process.

A mixture-of-experts (MoE) feed-forward (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021) holds E expert MLPs and a router W_r. For each token x:

    p = softmax(x W_r)                  gate probabilities over the E experts
    e_1..e_k = top-k(p)                 the k experts the token goes to
    w_j = p_{e_j} / sum_j p_{e_j}       renormalised weights (k = 1 keeps w = p_e, as Switch does: a
                                        weight renormalised to 1 would give the router no gradient)
    y = sum_j w_j * expert_{e_j}(x)     only the choices that found a slot

Capacity: an expert takes at most C = ceil(capacity_factor * n * k / E) of a group's n tokens' choices.
Its slots go to first choices before second choices, and within a choice in token order (GShard's
priority); the choices past slot C are dropped. A token whose every choice is dropped gets y = 0, so the
block's residual x + y carries it through unchanged. capacity_factor=None: no capacity, nothing dropped.

Load balance: Switch's auxiliary loss  aux = E * sum_i f_i * P_i,  f_i the share of the group's n*k choices
that picked expert i (before capacity), P_i the mean gate probability of expert i. It is 1 when routing is
uniform and E when every token picks one expert; only P_i is differentiable, so it trains the router.

`route` applies these rules to a whole group at once (a token's place in its expert's queue is a cumulative
sum); `MoE` runs each expert once on the rows routed to it. expert_parallel.py puts the experts on different
ranks and moves the rows to them by all-to-all; this one-process layer is its reference.

    python mini_dist/moe.py [--experts 8 --k 2 --tokens 256]    # capacity and aux, balanced vs skewed tokens

Mirrors Megatron-LM's core/transformer/moe (TopKRouter, its capacity and aux loss).
"""
import math
import sys
from collections import namedtuple
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as `torchrun mini_dist/x.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist import comm
from mini_dist.kit import launch, measure

Routing = namedtuple("Routing", "expert weight keep aux")  # [n, k] ids, [n, k] w_j, [n, k] slot found, scalar


def capacity(capacity_factor, n: int, k: int, E: int) -> int:
    """C = ceil(capacity_factor * n * k / E) slots per expert; no capacity: all n*k choices fit."""
    return n * k if capacity_factor is None else math.ceil(capacity_factor * n * k / E)


def route(logits, k: int, capacity_factor=None) -> Routing:
    """Top-k routing of one group's tokens, [n, E] router logits -> Routing."""
    n, E = logits.shape
    probs = logits.softmax(-1)                                 # [n, E]
    top, expert = probs.topk(k, -1)                            # [n, k], best first
    weight = top / top.sum(-1, keepdim=True) if k > 1 else top
    chosen = F.one_hot(expert, E)                              # [n, k, E]
    queue = chosen.transpose(0, 1).reshape(k * n, E)           # every first choice queues before any second
    slot = ((queue.cumsum(0) - 1) * queue).sum(-1).view(k, n).T  # [n, k]: place in its expert's queue
    keep = slot < capacity(capacity_factor, n, k, E)
    f = chosen.sum((0, 1)).to(probs.dtype) / max(n * k, 1)     # share of choices, a count: no gradient
    P = probs.sum(0) / max(n, 1)                               # mean gate probability: the router's gradient
    return Routing(expert, weight, keep, E * (f * P).sum())


class Experts(nn.Module):
    """`num` small MLPs stacked along dim 0 (tagged ep_dim = 0): expert i is
    gelu(x @ w1[i] + b1[i]) @ w2[i] + b2[i]. Stacking keeps the names of a shard and of the whole equal."""

    def __init__(self, num, hidden, ffn_hidden, device=None, dtype=None):
        super().__init__()

        def param(shape, fan_in):
            """Drawn as nn.Linear draws its weights, tagged: cut along dim 0 by expert parallelism."""
            p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-fan_in ** -0.5, fan_in ** -0.5))
            p.ep_dim = 0
            return p
        self.w1 = param((num, hidden, ffn_hidden), hidden)
        self.b1 = param((num, ffn_hidden), hidden)
        self.w2 = param((num, ffn_hidden, hidden), ffn_hidden)
        self.b2 = param((num, hidden), ffn_hidden)

    def mlp(self, i, x):
        """Expert i on its rows x."""
        return F.gelu(x @ self.w1[i] + self.b1[i]) @ self.w2[i] + self.b2[i]   # [m, h] -> [m, h]

    def forward(self, x, counts):
        """Rows grouped by expert, counts[i] of them for expert i."""
        return torch.cat([self.mlp(i, rows) for i, rows in enumerate(x.split(counts))])


class MoE(nn.Module):
    """The one-process layer, every expert here. Each call is one group (capacity and aux loss over its
    tokens); after it, .aux_loss and .dropped (choices dropped). `parts` > 1: hold only E/parts experts
    (the shard of an expert-parallel rank, see expert_parallel.ExpertParallelMoE)."""

    def __init__(self, hidden, ffn_hidden, num_experts, k=2, capacity_factor=None, parts=1, device=None,
                 dtype=None):
        super().__init__()
        check_config(num_experts, k, capacity_factor, parts)
        self.hidden = hidden
        self.ffn_hidden = ffn_hidden
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = Experts(num_experts // parts, hidden, ffn_hidden, device, dtype)

    def routing(self, x):
        """Tokens [..., h] as rows [n, h], and their Routing; the aux loss and the drops kept for the caller."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"{type(self).__name__} expects tokens [..., {self.hidden}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden)                                  # [n, h]
        r = route(self.router(tokens), self.k, self.capacity_factor)
        self.aux_loss = r.aux
        self.dropped = int((~r.keep).sum())
        return tokens, r

    def forward(self, x):
        """y = sum_j w_j expert_{e_j}(x) over each token's kept choices, expert by expert."""
        tokens, r = self.routing(x)
        y = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            t, j = (r.keep & (r.expert == e)).nonzero(as_tuple=True)        # expert e's kept choices
            y = y.index_add(0, t, r.weight[t, j, None] * self.experts.mlp(e, tokens[t]))
        return y.view_as(x)


# ----- the guard, and tokens that lean one way (for the demos and the questions)

def check_config(num_experts: int, k: int, capacity_factor, parts: int) -> None:
    """Refuse a layer that cannot route: k outside 1..E, a capacity factor <= 0, E not a multiple of `parts`."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} experts per token must be between 1 and the number of experts "
                         f"E={num_experts}: each token picks k different experts")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for no capacity)")
    comm.check_divisible("num_experts", num_experts, parts,
                         "pick E a multiple of the expert-parallel size (each rank holds E/W whole experts)")


def skewed_tokens(n, h, seed, rank=0, step=0, skew=2.0):
    """Tokens around one common offset (skew standard deviations): every token's logits lean the same way,
    so a few experts get most of them. skew=0: tokens without a common direction."""
    offset = skew * torch.randn(h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)  # cpu: moved
    g = torch.Generator().manual_seed(seed * 7919 + step * 101 + rank + 1)
    return (torch.randn(n, h, generator=g, dtype=torch.float64) + offset).to(launch.device())


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--experts", type=int, default=8, help="E")
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--hidden", type=int, default=16, help="h")
    p.add_argument("--tokens", type=int, default=256, help="n, the tokens of one routing group")
    p.add_argument("--skew", type=float, default=2.0, help="the skewed tokens' common offset, in standard deviations")
    p.add_argument("--seed", type=int, default=0)
    return p


def demo(args) -> int:
    E = args.experts
    k = args.k
    n = args.tokens
    h = args.hidden
    launch.require(1 <= k <= E, f"--k must be between 1 and --experts ({E})")
    launch.require(min(n, h) >= 1, "--tokens and --hidden must be >= 1")
    env = launch.setup(seed=args.seed)
    router = nn.Linear(h, E, bias=False, dtype=torch.float64, device=env.device)
    factors = (1.0, 1.25, 2.0)
    launch.print0(f"E={E} experts, top-{k}, n={n} tokens through a fresh router; capacity C = ceil(cf*n*k/E) = "
                  f"{' / '.join(str(capacity(cf, n, k, E)) for cf in factors)} at cf {' / '.join(map(str, factors))}"
                  f"\n  {'':10}{'choices per expert':<20}{'aux':>5}   dropped at each cf, % of the n*k choices "
                  f"(= sum_i max(0, count_i - C))")
    exact, aux = True, []
    for name, skew in (("balanced", 0.0), ("skewed", args.skew)):
        with torch.no_grad():
            logits = router(skewed_tokens(n, h, args.seed, skew=skew))
        r = route(logits, k)
        counts = torch.bincount(r.expert.flatten(), minlength=E)
        dropped = [int((~route(logits, k, cf).keep).sum()) for cf in factors]
        direct = [int((counts - capacity(cf, n, k, E)).clamp_min(0).sum()) for cf in factors]
        f = counts.double() / (n * k)     # each expert's share of the choices
        P = logits.softmax(-1).mean(0)    # its mean gate probability
        exact = exact and dropped == direct and math.isclose(r.aux.item(), E * (f * P).sum().item(), rel_tol=1e-12)
        aux.append(r.aux.item())
        launch.print0(f"  {name:<10}{measure.bars(counts.tolist(), counts.max().item(), E):<20}{aux[-1]:>5.2f}   "
                      f"{' / '.join(f'{d / (n * k):.0%}' for d in dropped)}")
    launch.print0(f"  (uniform routing: aux 1, every token on one expert: aux E = {E})")
    return launch.conclude("moe", exact, "drops = direct count, aux = E*sum f*P", aux[1] > aux[0],
                           f"aux {aux[0]:.2f} balanced -> {aux[1]:.2f} skewed")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
