"""The one-process mixture of experts (mini_dist/moe.py) equals its formulas, token by token.

No ranks: the router's top-k and renormalised weights, capacity slots in GShard's priority (first choices
before second, then token order) with the drops counted directly, the layer's output as the literal sum
y = sum_j w_j expert_{e_j}(x) over the kept choices, and Switch's auxiliary loss with its gradient, which
reaches the router only. The tolerance TOL = 1000 eps(fp64), relative, is derived in
tests/test_expert_parallel.py: the same products summed in another order.
"""
import math

import torch
import torch.nn.functional as F
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_dist.moe import MoE, route
from test_expert_parallel import CAPACITY_FACTORS, F64, TOL, rel_err


@given(n=st.integers(0, 25), E=st.integers(1, 6), k=st.integers(1, 2), cf=st.sampled_from(CAPACITY_FACTORS),
       seed=st.integers(0, 1000))
@pytest.mark.single_process
def test_capacity_keeps_first_choices_before_second_then_token_order_and_counts_drops(n, E, k, cf, seed):
    k = min(k, E)
    logits = torch.randn(n, E, dtype=F64, generator=torch.Generator().manual_seed(seed))  # cpu: one process
    r = route(logits, k, cf)
    C = n * k if cf is None else math.ceil(cf * n * k / E)
    filled, keep = [0] * E, [[None] * k for _ in range(n)]
    for j in range(k):                      # every token's first choice takes its slot before any second
        for t in range(n):
            e = int(r.expert[t, j])
            keep[t][j], filled[e] = filled[e] < C, filled[e] + 1
    assert r.keep.tolist() == keep
    per_expert = torch.bincount(r.expert.flatten(), minlength=E)
    direct = int((per_expert - C).clamp_min(0).sum())  # what overflows each expert
    assert int((~r.keep).sum()) == direct
    if cf is None or C >= n:  # no expert can overflow: nothing dropped
        assert direct == 0


@given(n=st.integers(0, 12), E=st.integers(1, 5), k=st.integers(1, 2), cf=st.sampled_from(CAPACITY_FACTORS),
       h=st.integers(1, 4), seed=st.integers(0, 1000))
@pytest.mark.single_process
def test_one_process_moe_equals_the_formula_token_by_token(n, E, k, cf, h, seed):
    k = min(k, E)
    torch.manual_seed(seed)
    moe = MoE(h, 3, E, k, cf, dtype=F64)
    x = torch.randn(n, h, dtype=F64)  # cpu: one process, as MoE(...) above
    y = moe(x)
    p = (x @ moe.router.weight.T).softmax(-1)
    C = n * k if cf is None else math.ceil(cf * n * k / E)
    filled = [0] * E
    want = torch.zeros(n, h, dtype=F64)  # cpu: one process
    top = p.topk(k, -1)
    for j in range(k):
        for t in range(n):
            e, w = int(top.indices[t, j]), top.values[t, j] / (top.values[t].sum() if k > 1 else 1)
            if filled[e] < C:
                we = moe.experts
                want[t] += w * (F.gelu(x[t] @ we.w1[e] + we.b1[e]) @ we.w2[e] + we.b2[e])
            filled[e] += 1
    assert rel_err(y, want) <= TOL
    assert moe.dropped == sum(max(0, c - C) for c in filled)


@pytest.mark.single_process
@given(n=st.integers(1, 30), E=st.integers(1, 6), k=st.integers(1, 2), seed=st.integers(0, 1000))
def test_aux_loss_is_switch_formula_and_its_gradient_reaches_only_the_router(n, E, k, seed):
    k = min(k, E)
    torch.manual_seed(seed)
    moe = MoE(4, 3, E, k, dtype=F64)
    x = torch.randn(n, 4, dtype=F64)  # cpu: one process, as MoE(...) above
    moe(x)
    logits = (x @ moe.router.weight.T).detach().requires_grad_()
    p = logits.softmax(-1)
    f = torch.tensor([sum(i in p[t].topk(k).indices.tolist() for t in range(n)) / (n * k) for i in range(E)],
                     dtype=F64)  # cpu: one process
    P = p.mean(0)
    assert abs(moe.aux_loss.item() - E * (f * P).sum().item()) <= TOL
    moe.aux_loss.backward()
    assert all(q.grad is None for q in moe.experts.parameters())  # aux is about routing only
    # d aux / d logits of token t = E/n * p_t * (f - <f, p_t>) (softmax's Jacobian); f is a count
    d_logits = E / n * p * (f - (p * f).sum(-1, keepdim=True))
    assert rel_err(moe.router.weight.grad, (d_logits.T @ x).detach()) <= TOL
    if not torch.equal(f, f.roll(1)):  # f uniform (k = E, say) makes aux = sum_i P_i = 1: a constant
        assert moe.router.weight.grad.abs().max() > 0


def test_aux_loss_is_one_when_balanced_and_E_when_collapsed():
    E = 4
    balanced = route(torch.eye(E, dtype=F64) * 60, 1).aux   # cpu: one process; token t sure of expert t
    collapsed = route(torch.zeros(E, E, dtype=F64).index_fill(1, torch.tensor([0]), 60), 1).aux  # cpu: one process
    assert abs(balanced.item() - 1) < 1e-12 and abs(collapsed.item() - E) < 1e-12
