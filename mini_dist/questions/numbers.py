"""Numbers and memory: the figure that answers question 19 (mini_dist/questions/questions.md).

    19. fp16 gives NaN: overflow or underflow, how loss scaling fixes it, why bf16 needs none
                                                  overflow_or_underflow  (mixed_precision.py, loss_scaling.py)

It runs on every rank of its group and returns (figure, holds), as `./run.sh ask 19` and
tests/test_questions.py call it. The failures are mixed_precision's own computations and the skip is
DynamicLossScaler's, so the figure cannot drift from the demos. Questions 18 (what checkpointing saves and
costs) and 20 (why fp32 master weights) are their demos' own figures: activation_checkpoint.memory_and_compute
and mixed_precision.master_weights_vs_half.
"""
import math

import torch

from mini_dist.kit import launch
from mini_dist.loss_scaling import DynamicLossScaler
from mini_dist.mixed_precision import overflow, underflow


def overflow_or_underflow() -> tuple[str, bool]:
    """Question 19: fp16's NaN (overflow) and its silent 0 (underflow); the same product with one factor scaled
    by 2^16 and unscaled in fp32; bf16's with no scaling; and the loss scaler skipping the step of an inf
    gradient and halving S."""
    half = torch.float16
    nan = overflow(half)
    zero = underflow(half)
    small = torch.tensor(1e-4, dtype=half, device=launch.device())
    lifted = torch.tensor(1e-4 * 2**16, dtype=half, device=launch.device())  # the other factor, times S = 2^16
    rescued = (small * lifted).float() / 2**16
    wide = underflow(torch.bfloat16).float()
    weight = torch.ones(2, device=launch.device(), requires_grad=True)
    weight.grad = torch.tensor([math.inf, 1.0], device=launch.device())
    scaler = DynamicLossScaler(init_scale=2.0**16)
    scaler.step(torch.optim.SGD([weight], lr=1.0))
    scaler.update()
    skipped = bool((weight == 1).all())
    S = scaler.get_scale()
    figure = (f"fp16: 300*300 - 300*300 = {nan.item()} (90000 > 65504 rounds to inf, inf - inf = NaN); 1e-4*1e-4 = "
              f"{zero.item():g} (underflow: silent); scaled by 2^16 and unscaled in fp32: {rescued.item():.3g}; bf16 "
              f"with no scaling: {wide.item():.3g}; an inf gradient: step skipped ({skipped}), S 65536 -> {S:g}")
    near = all(math.isclose(v.item(), 1e-8, rel_tol=0.01) for v in (rescued, wide))
    return figure, bool(nan.isnan()) and zero.item() == 0 and skipped and S == 2.0**15 and near
