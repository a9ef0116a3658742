"""Number formats and fp32 master weights: bit layouts decode to the stored values; fp16 with master weights
follows fp32 where fp16 alone stalls; the master-weight path is the same with torch.amp.GradScaler.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import device

from mini_dist.mixed_precision import (bits, master_weights_vs_half, regression_problem, train_regression,
                                       update_to_spacing)


def decode(text: str) -> float:
    """sign|exponent|mantissa back to a number: (-1)^s * (1.m) * 2^(e - bias), subnormal when e = 0."""
    s, e, m = text.split("|")
    bias, frac = 2 ** (len(e) - 1) - 1, int(m, 2) / 2 ** len(m)
    if int(e, 2) == 0:
        return (-1) ** int(s) * frac * 2.0 ** (1 - bias)
    return (-1) ** int(s) * (1 + frac) * 2.0 ** (int(e, 2) - bias)


@pytest.mark.single_process
@given(x=st.floats(-6e4, 6e4))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bit_layout_decodes_to_the_stored_value(dtype, x):
    info = torch.finfo(dtype)
    for v in (x, info.max, info.smallest_normal, info.smallest_normal / 2):
        assert decode(bits(v, dtype)) == torch.tensor(v, dtype=dtype).item()  # cpu: the value as stored
    assert len(bits(1.0, dtype).split("|")[1]) == {torch.float16: 5}.get(dtype, 8)


def test_fp16_master_weights_follow_fp32_where_fp16_alone_stalls():
    # Precondition that makes the stall exact, not statistical: every update is below half the spacing.
    assert update_to_spacing(torch.float16) < 1
    w0 = regression_problem()[2].to(device())
    fp32, _ = train_regression(torch.float32, master=False)
    master, _ = train_regression(torch.float16, master=True)
    alone, w_alone = train_regression(torch.float16, master=False)
    assert fp32[-1] < fp32[0] / 10  # the fp32 run makes real progress (measured: 15x)
    assert torch.equal(w_alone, w0.half()) and alone[-1] == alone[0]  # every update rounded away
    # Step 0 already differs by rounding w0 to fp16 (~1% of the loss); fp32 master weights keep the run
    # from drifting further: it ends no farther from fp32 than it started (measured 1.8e-5 vs 1.3e-4).
    assert abs(master[-1] - fp32[-1]) <= abs(master[0] - fp32[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_master_weights_with_our_scaler_equal_master_weights_with_grad_scaler_bit_for_bit(dtype):
    ours = train_regression(dtype, master=True, steps=60, lr=2e-2)
    native = train_regression(dtype, master=True, steps=60, lr=2e-2,
                              scaler=torch.amp.GradScaler(device().type, init_scale=2.0**10))
    assert ours[0] == native[0] and torch.equal(ours[1], native[1])
    assert ours[0][-1] < ours[0][0] / 2  # it trained: a scaler that skipped every step would tie too


@pytest.mark.parametrize("lr", [2e-3, 5e-2])
def test_half_weights_alone_stall_exactly_where_the_update_is_under_half_the_spacing(lr):
    """Question 20's figure: at lr 2e-3 both half runs stall (fp16 0.91, bf16 0.11 of half the spacing); at
    5e-2 every update lands, and the figure still holds because it predicts which."""
    figure, holds = master_weights_vs_half(steps=50, lr=lr)
    assert holds, figure
    assert ("fp16 0.91" in figure) == (lr == 2e-3), figure
