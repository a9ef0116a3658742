"""DynamicLossScaler vs torch.amp.GradScaler, bit for bit; the one-pass unscale; fp16 gradients refused.

Every comparison with GradScaler is exact (torch.equal / ==), no tolerance: both sides run the same
forward and backward on identical copies, then compute the same fp32 products (g * fp32(1/S) for the
unscale, fp32(S * factor) rounded from fp64 for the update), so any difference is a real bug.

Across ranks (a sharded model's ranks agreeing on the skip): tests/test_sharded_loss_scaling.py.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import loss_scaling_exercise as lse
from harness import device
from loss_scaling_exercise import MISTAKES  # noqa: F401  (the exercise's, declared beside its judge)
from mini_dist import loss_scaling
from mini_dist.mixed_precision import MasterWeights
from mini_dist.questions import numbers
from raised import raised

KINDS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def count_steps(opt):
    """A list whose length is the number of times opt.step() really ran (a skipped step adds nothing)."""
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    return calls


# ----- the learner's exercise (./run.sh check loss_scaling): update() and step(), judged against torch's own

@pytest.mark.exercise(judges=("DynamicLossScaler.update",))
@pytest.mark.single_process
@given(init_scale=st.sampled_from([2.0**16, 2.0**127]) | st.floats(1.0, 2.0**24),
       growth=st.sampled_from([2.0]) | st.floats(1.01, 8.0), backoff=st.sampled_from([0.5]) | st.floats(0.01, 0.99),
       interval=st.integers(1, 4), overflows=st.lists(st.booleans(), min_size=1, max_size=20))
@example(init_scale=2.0**10, growth=2.0, backoff=0.5, interval=3, overflows=[False] * 7)  # grows at 3 and 6
@example(init_scale=2.0**10, growth=2.0, backoff=0.5, interval=3,  # the count restarts at the overflow
         overflows=[False, False, True, False, False, False])
@example(init_scale=2.0**127, growth=2.0, backoff=0.5, interval=1, overflows=[False])  # kept below inf
@example(init_scale=1.0, growth=1.1, backoff=0.3, interval=1, overflows=[False, True])  # rounded to fp32
def test_update_backs_off_on_overflow_and_grows_after_the_interval_exactly_as_torchs_update_scale(
        init_scale, growth, backoff, interval, overflows):
    """update() leaves the scale and its count of clean iterations as torch's: backed off on an overflow, grown
    after growth_interval clean ones in a row, kept finite, rounded to fp32

    Against torch._amp_update_scale_ (what GradScaler.update calls) on the same overflow flags, each recorded
    by unscale_: after every iteration the same fp32 scale and the same count, exactly (fp32 arithmetic on
    both sides, no rounding left to differ)."""
    hyper = (init_scale, growth, backoff, interval)
    ours = lse.updates(*hyper, overflows)
    want = lse.torchs(*hyper, overflows)
    for t, (got, expected) in enumerate(zip(ours, want)):
        assert got == expected, (
            f"iteration {t + 1} of {lse.spelled(overflows)} (S0 = {init_scale!r}, growth_factor {growth!r}, "
            f"backoff_factor {backoff!r}, growth_interval {interval}): yours left scale {got[0]!r}, "
            f"_growth_tracker {got[1]}; torch._amp_update_scale_ {expected[0]!r}, {expected[1]}"
            f"\n{lse.update_mistake() or lse.CONTRACT}")


class Pipeline:
    """One training setup: a linear layer (+ a frozen parameter, whose grad stays None) with two
    optimizers, so that an inf in W's gradient skips W's optimizer while the bias's optimizer steps.
    `clip`: the gradients unscaled by the caller and clipped before step(), as GradScaler's docs show."""

    def __init__(self, scaler, dev, W, b, adam, master, half_loss, clip):
        self.scaler = scaler
        self.master = master
        self.half_loss = half_loss
        self.clip = clip
        half = torch.float16 if master else torch.float32  # fp16 params need fp32 master weights
        self.W, self.b = (t.to(dev, half, copy=True).requires_grad_() for t in (W, b))
        self.frozen = torch.zeros(3, device=dev, dtype=half)
        targets = [[self.W, self.frozen], [self.b]]
        if master:
            self.masters = [MasterWeights(ps) for ps in targets]
            targets = [m.params for m in self.masters]
        make = torch.optim.Adam if adam else (lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9))
        self.opts = [make(ps, lr=1e-2) for ps in targets]
        self.calls = [count_steps(o) for o in self.opts]

    def iteration(self, x, c):
        with torch.autocast(x.device.type, dtype=torch.float16, enabled=not self.master):
            y = F.linear(x.to(self.W.dtype), self.W, self.b + self.frozen)
        loss = (y.float() * c).sum()
        # A 0-dim fp16 loss times GradScaler's 0-dim fp32 scale is promoted to fp32: dtypes must match too.
        scaled = self.scaler.scale(loss.half() if self.half_loss else loss)
        scaled.backward()
        self.scaled = scaled.detach()
        for m in self.masters if self.master else ():
            m.grads_to_master()
        for opt in self.opts if self.clip else ():
            self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], 1.0)
        for opt in self.opts:
            self.scaler.step(opt)
        self.scaler.update()
        for opt in self.opts:
            opt.zero_grad()
        for m in self.masters if self.master else ():
            m.master_to_model()

    def observed(self):
        return (self.scaler.state_dict(), [len(c) for c in self.calls], self.W.detach(), self.b.detach(),
                self.scaled)


def against_grad_scaler(dev, seed, init_scale, growth, backoff, interval, steps, injected, loud,
                        adam, master, half_loss, reload_at, clip) -> str | None:
    """Where the scaler first leaves torch.amp.GradScaler's run, in words; None when it never does."""
    g = torch.Generator().manual_seed(seed)
    W, b = torch.randn(3, 5, generator=g), torch.randn(3, generator=g)  # cpu: Pipeline copies them to dev
    hyper = dict(init_scale=init_scale, growth_factor=growth, backoff_factor=backoff,
                 growth_interval=interval)
    mine = Pipeline(loss_scaling.DynamicLossScaler(**hyper), dev, W, b, adam, master, half_loss, clip)
    ref = Pipeline(torch.amp.GradScaler(dev.type, **hyper), dev, W, b, adam, master, half_loss, clip)
    w_skipped = []
    for t in range(steps):
        x, c = torch.randn(4, 5, generator=g), loud * torch.randn(4, 3, generator=g)  # cpu: moved to dev below
        if t in injected:
            x[t % 4, t % 5] = KINDS[injected[t]]
        before = len(mine.calls[0])
        ref_before = [len(c) for c in ref.calls]
        try:
            mine.iteration(x.to(dev), c.to(dev))
        except NotImplementedError:
            raise  # a blank: its own words say what to write
        except Exception as e:
            return f"step {t}: {raised(e, 'loss_scaling')}"
        ref.iteration(x.to(dev), c.to(dev))
        (state, calls, W1, b1, s1), (ref_state, ref_calls, W2, b2, s2) = mine.observed(), ref.observed()
        what = ", ".join(f"optimizer {i} {'stepped' if after > was else 'skipped (inf/NaN)'}"
                         for i, (was, after) in enumerate(zip(ref_before, ref_calls)))
        same = s1.dtype == s2.dtype and (torch.equal(s1, s2) or bool(s1.isnan() and s2.isnan()))  # exact
        if not same:
            return f"step {t}: scaled loss {s1.item()} ({s1.dtype}) != GradScaler's {s2.item()} ({s2.dtype})"
        if state != ref_state:
            return (f"step {t} (GradScaler: {what}): scale {state['scale']!r}, _growth_tracker "
                    f"{state['_growth_tracker']}; GradScaler's {ref_state['scale']!r}, {ref_state['_growth_tracker']}")
        if calls != ref_calls:
            return f"step {t}: optimizer steps taken so far {calls}, GradScaler's {ref_calls} (GradScaler: {what})"
        if not (torch.equal(W1, W2) and torch.equal(b1, b2)):
            return f"step {t} (GradScaler: {what}): the parameters differ from GradScaler's run"
        if len(mine.calls[0]) == before:
            w_skipped.append(t)
        if t == reload_at:  # each side continues from the other's checkpoint
            mine.scaler, ref.scaler = loss_scaling.DynamicLossScaler(), torch.amp.GradScaler(dev.type)
            mine.scaler.load_state_dict(ref_state)
            ref.scaler.load_state_dict(state)
    missed = sorted({t for t in injected if t < steps} - set(w_skipped))
    return f"steps {missed}: an injected inf/NaN did not skip the step" if missed else None


grad_scaler_cases = given(
    seed=st.integers(0, 2**16),
    init_scale=st.sampled_from([2.0**16, 1.0]) | st.floats(1.0, 2.0**24),  # non-fp32 values: rounding
    growth=st.sampled_from([2.0]) | st.floats(1.01, 8.0),
    backoff=st.sampled_from([0.5]) | st.floats(0.01, 0.99),
    interval=st.integers(1, 4),
    steps=st.integers(4, 14),
    injected=st.dictionaries(st.integers(0, 13), st.sampled_from(sorted(KINDS)), max_size=4),
    loud=st.sampled_from([1.0, 1e3, 1e5]),  # loud gradients overflow fp16 by themselves
    adam=st.booleans(), master=st.booleans(), half_loss=st.booleans(), reload_at=st.integers(-1, 13),
    clip=st.booleans())


@pytest.mark.exercise(judges=("DynamicLossScaler.step", "DynamicLossScaler.update"))
@grad_scaler_cases
@example(seed=1, init_scale=2.0**16, growth=2.0, backoff=0.5, interval=2, steps=12,
         injected={3: "nan", 4: "inf"}, loud=1e3, adam=False, master=False, half_loss=False,
         reload_at=-1, clip=False)
@example(seed=3, init_scale=2.0**10, growth=2.0, backoff=0.5, interval=3, steps=10,  # reload mid-
         injected={}, loud=1.0, adam=True, master=True, half_loss=False, reload_at=3,  # growth interval
         clip=True)
@example(seed=2, init_scale=2.0**124, growth=4.0, backoff=0.5, interval=1, steps=4,  # growth stops
         injected={}, loud=0.0, adam=False, master=False, half_loss=False, reload_at=-1,  # below inf
         clip=False)
def test_scaler_equals_grad_scaler_bit_for_bit_with_injected_and_natural_overflows(**case):
    """The scaler equals torch.amp.GradScaler bit for bit: scaled loss, scale, steps taken (none on inf/NaN),
    parameters

    The same forward and backward on identical copies, two optimizers (one skipped when only its gradients
    overflow), Adam or SGD, fp32 master weights or fp16 autocast, gradients unscaled by the caller to clip or by
    step() itself, a checkpoint swapped between the two: every number exact."""
    wrong = against_grad_scaler(torch.device("cpu"), **case)  # cpu: the test below compares with GradScaler("cuda")
    assert wrong is None, f"{wrong}\n{lse.step_mistake() or lse.update_mistake() or lse.CONTRACT}"


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: compares with torch.amp.GradScaler('cuda') under real fp16 "
                           "autocast on CUDA tensors (the CPU test above covers the same logic)")
@grad_scaler_cases
def test_scaler_equals_cuda_grad_scaler_bit_for_bit_under_cuda_fp16_autocast(**case):
    wrong = against_grad_scaler(torch.device("cuda"), **case)
    assert wrong is None, wrong


def test_the_fp16_failures_and_the_skipped_step_are_shown_and_hold():
    """Question 19's figure (mini_dist/questions/numbers.py)."""
    figure, holds = numbers.overflow_or_underflow()
    assert holds and "= nan" in figure and "S 65536 -> 32768" in figure, figure


@pytest.mark.single_process
def test_fp16_gradients_are_refused_as_grad_scaler_refuses_them():
    """S*g/S in fp16 underflows again: the scaler wants fp32 (master) gradients, and says so, as GradScaler does."""
    for scaler in (loss_scaling.DynamicLossScaler(), torch.amp.GradScaler(device().type)):
        p = torch.zeros(3, device=device(), dtype=torch.float16, requires_grad=True)
        p.grad = torch.ones_like(p)
        scaler.scale(torch.ones((), device=device()))  # GradScaler makes its scale tensor here
        with pytest.raises(ValueError, match="(?i)fp16 gradients"):
            scaler.unscale_(torch.optim.SGD([p], lr=1.0))


def huge_gradients(poison):
    """fp32 gradients of 1e30: finite, but their squares overflow fp32, so an L2 norm of them is inf."""
    runs = []
    for scaler in (loss_scaling.DynamicLossScaler(1.0), torch.amp.GradScaler(device().type, 1.0)):
        params = [torch.zeros(4, device=device(), requires_grad=True) for _ in range(3)]
        for i, p in enumerate(params):
            p.grad = torch.full((4,), 1e30 * (i + 1), device=device())
        if poison is not None:
            params[1].grad[2] = KINDS[poison]
        opt = torch.optim.SGD(params, lr=1e-31)
        calls = count_steps(opt)
        scaler.scale(torch.ones((), device=device()))
        scaler.step(opt)
        scaler.update()
        runs.append((len(calls), scaler.get_scale(), [p.detach().clone() for p in params]))
    return runs


@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_finite_gradients_whose_squares_overflow_are_not_an_overflow_and_a_real_inf_among_them_is(poison):
    (steps, scale, params), (ref_steps, ref_scale, ref_params) = huge_gradients(poison)
    assert (steps, scale) == (ref_steps, ref_scale) == ((1, 1.0) if poison is None else (0, 0.5))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


SIZES = [(), (0,), (3,), (2, 5), (4, 300), (70_000,)]  # 70,000: more than one chunk of a fused GPU kernel
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
OPMATH = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # the fused kernel multiplies these in fp32


@pytest.mark.single_process
@settings(max_examples=60)
@given(shapes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=6), dtypes=st.lists(st.sampled_from(DTYPES),
       min_size=1, max_size=3), poison=st.sampled_from([None, *sorted(KINDS)]), where=st.integers(0, 10**6),
       magnitude=st.sampled_from([1.0, 1e30, 1e38]), scale=st.floats(1.0, 2.0**24), seed=st.integers(0, 99))
@example(shapes=[(3,), (3,)], dtypes=[torch.float32], poison="inf", where=0, magnitude=1.0, scale=2.0**16, seed=0)
@example(shapes=[(2, 5), (4, 300)], dtypes=[torch.float64, torch.complex64], poison="nan", where=10**6,
         magnitude=1e38, scale=3.0, seed=0)
def test_one_pass_unscale_flags_exactly_the_non_finite_and_multiplies_every_gradient_by_one_over_s(
        shapes, dtypes, poison, where, magnitude, scale, seed):
    """unscale_and_check flags inf/NaN anywhere and nothing else (finite values near fp32's max included), and
    leaves each gradient g * fp32(1/S) in its dtype (fp16 and bf16 multiplied in fp32, as GradScaler does);
    where the product is exact in the gradient's own dtype (fp32, fp64, complex) the textbook two passes agree."""
    g = torch.Generator().manual_seed(seed)  # cpu: drawn here, then moved to the rank's device
    grads = [(magnitude * torch.randn(shape, generator=g, dtype=torch.float64)).to(device(), dtypes[i % len(dtypes)])
             for i, shape in enumerate(shapes)]
    sizes = [x.numel() for x in grads]
    if poison is not None and sum(sizes):
        i = where % sum(sizes)  # the element it lands on, counted over all the gradients
        k = next(k for k in range(len(sizes)) if i < sum(sizes[:k + 1]))
        grads[k].view(-1)[i - sum(sizes[:k])] = KINDS[poison]
    non_finite = any(not bool(x.isfinite().all()) for x in grads)
    inv_scale = torch.full((), 1.0 / scale, dtype=torch.float32, device=device())
    want = [(x.to(OPMATH.get(x.dtype, x.dtype)) * inv_scale).to(x.dtype) for x in grads]
    exact = [x.clone() for x in grads if x.dtype in (torch.float32, torch.float64, torch.complex64)]
    found = loss_scaling.unscale_and_check(grads, inv_scale)
    assert found.item() == float(non_finite), f"flag {found.item()}, a non-finite value present: {non_finite}"
    for x, y in zip(grads, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)  # bit for bit, NaN where NaN
    textbook = torch.zeros((), device=device())
    loss_scaling.unscale_textbook(exact, inv_scale, textbook)
    assert textbook.item() == float(any(not bool(x.isfinite().all()) for x in exact))
    for x, y in zip(exact, (x for x in grads if x.dtype in (torch.float32, torch.float64, torch.complex64))):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


class HostReads(TorchFunctionMode):
    """Counts the tensor values read into Python (item, bool, float, tolist): on a GPU each read waits for every
    launch before it, so a scaler that reads more than one per iteration leaves the GPU idle more often."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.tolist}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


class Launches(TorchDispatchMode):
    """Counts the aten operations run (on a GPU each is a kernel launch, a few microseconds of host time)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "aten"
        return func(*args, **(kwargs or {}))


@pytest.mark.single_process
def test_an_iteration_reads_one_number_from_the_device_and_launches_fewer_operations_than_grad_scaler():
    """unscale_, step and update read the agreed flag once (the branch: skip or step), as GradScaler reads its
    found_inf once, and run fewer operations than GradScaler's (its scale lives on the device: its reciprocal
    and its update are operations there). (A changed scale costs ours one more read, of a number on the host,
    its fp32 rounding: here the scale stays 1, the growth interval far away.) Both step the same SGD."""
    counts = []
    for scaler in (loss_scaling.DynamicLossScaler(1.0, growth_interval=1000),
                   torch.amp.GradScaler(device().type, 1.0, growth_interval=1000)):
        params = [torch.zeros(5, device=device(), requires_grad=True) for _ in range(3)]
        opt = torch.optim.SGD(params, lr=0.1)
        scaler.scale(torch.ones((), device=device()))  # GradScaler makes its scale tensor here
        for _ in range(3):
            for p in params:
                p.grad = torch.ones(5, device=device())
            with HostReads() as reads, Launches() as launches:
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            counts.append((reads.count, launches.count))
    ours, theirs = counts[:3], counts[3:]
    assert [r for r, _ in ours] == [r for r, _ in theirs] == [1] * 3, f"values read per iteration: {counts}"
    assert all(a < b for (_, a), (_, b) in zip(ours, theirs)), f"operations per iteration: {counts}"


# ----- misuse -----

@pytest.mark.parametrize("bad, fix", [(dict(growth_factor=1.0), "growth_factor must be > 1"),
                                      (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
                                      (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
                                      (dict(growth_interval=0), "growth_interval must be an int >= 1"),
                                      (dict(init_scale=math.inf), "init_scale must be positive")])
def test_bad_hyper_parameters_are_rejected_with_what_to_change(bad, fix):
    with pytest.raises(ValueError, match=fix):
        loss_scaling.DynamicLossScaler(**bad)


def test_lifecycle_misuse_is_rejected():
    p = torch.zeros(2, device=device(), requires_grad=True)
    opt, scaler = torch.optim.SGD([p], lr=1.0), loss_scaling.DynamicLossScaler()
    with pytest.raises(RuntimeError, match="needs unscale_"):
        scaler.update()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.step(opt)
