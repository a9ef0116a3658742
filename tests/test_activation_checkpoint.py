"""Activation checkpointing: gradients bit-identical to no checkpointing and to torch.utils.checkpoint,
saved bytes equal to the formula, the reentrant form's known failures, bad input, and tensor parallelism.

Tolerance: none. Recomputation runs the same kernels on the same inputs with the same RNG state, and
backward then runs the same ops as without checkpointing, so every gradient must be bit for bit the same
(==), in fp64 and in fp32 with dropout. A different dropout mask, a missing or doubled gradient, a stale
recomputed tensor shows up as a difference, not as rounding.

The MLP layer is Linear -> GeLU -> dropout. Per layer it saves its input and GeLU's input (e bytes per
element each, n x w elements) and a 1-byte dropout mask (torch.native_dropout's bool mask, as F.dropout
keeps on CUDA). So with d = 1 if dropout else 0, for L layers:

    none                       L * (2e + d) * n*w
    every layer checkpointed   L * e * n*w                       (inputs only)
    checkpoint_sequential k    (k-1) * e*n*w + m * (2e + d) * n*w,   m = L - (k-1) * floor(L/k)

Selective checkpointing, built on the same Checkpoint, is tested in test_selective_checkpoint.py.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import checkpoint as tc

from grading import mistake
from harness import device, rank_generator, run, subgroup
from mini_dist import activation_checkpoint as ac
from mini_dist.activation_checkpoint import checkpoint, checkpoint_module, checkpoint_sequential
from mini_dist.kit import launch
from mini_dist.kit.activations import TransformerLayer
from mini_dist.kit.measure import SavedTensors, profile_step
from raised import raised


class MLPLayer(nn.Module):
    def __init__(self, width, p, dtype):
        super().__init__()
        self.linear, self.p = nn.Linear(width, width, dtype=dtype, device=device()), p

    def forward(self, x, scale=None):
        y = F.gelu(self.linear(x))
        y = torch.native_dropout(y, self.p, True)[0] if self.p else y
        return y if scale is None else y * scale


def mlp(depth, width, p, dtype, tied, seed):
    """depth layers; `tied`: the first layer is used again as the last (a parameter used twice)."""
    torch.manual_seed(seed)
    layers = [MLPLayer(width, p, dtype) for _ in range(depth - tied)]
    return nn.Sequential(*layers, *layers[:1] * tied)


def each(ckpt):
    return lambda m, x: functools.reduce(lambda y, layer: ckpt(layer, y), m, x)


def strategies(k):
    """name -> (ours, torch's)."""
    return {"every layer": (each(checkpoint), each(functools.partial(tc.checkpoint, use_reentrant=False))),
            "sequential": (lambda m, x: checkpoint_sequential(m, k, x),
                           # a list: torch's takes nn.Sequential.children(), which skips a repeated layer
                           lambda m, x: tc.checkpoint_sequential(list(m), k, x, use_reentrant=False))}


def step(run_model, model, x, seed):
    """Forward and backward under a fixed RNG seed: (output, saved bytes, input grad, parameter grads)."""
    model.zero_grad()
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    with SavedTensors(exclude=model.parameters()) as saved:
        out = run_model(model, x)
    out.backward(torch.ones_like(out))
    return out.detach(), saved.bytes, x.grad, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def identical(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def first_difference(a, b) -> str:
    """Where two tensors (or None) first differ, in one line; '' when they are equal."""
    if a is None or b is None or a.shape != b.shape:
        return "" if a is None and b is None else f"{a if a is None else tuple(a.shape)} vs " \
                                                  f"{b if b is None else tuple(b.shape)}"
    where = (a != b).nonzero()
    if not len(where):
        return ""
    i = tuple(where[0].tolist())
    return f"element {i}: {a[i].item()!r} vs {b[i].item()!r}"


def inputs(n, width, dtype, seed, requires_grad=False):
    """Inputs drawn on the CPU (the same numbers on every device), then moved to the device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, dtype=dtype, generator=g).to(device()).requires_grad_(requires_grad)


CASES = dict(depth=st.integers(1, 6), width=st.integers(1, 8), n=st.integers(1, 4),
             dtype_dropout=st.sampled_from([(torch.float64, 0.0), (torch.float32, 0.0), (torch.float32, 0.3)]),
             x_grad=st.booleans(), tied=st.booleans(), seed=st.integers(0, 99), data=st.data())


@pytest.mark.single_process
@given(**CASES)
def test_gradients_are_bit_identical_to_no_checkpointing_and_to_torch_and_saved_bytes_equal_the_formula(
        depth, width, n, dtype_dropout, x_grad, tied, seed, data):
    dtype, p = dtype_dropout
    tied = tied and depth >= 2
    k = data.draw(st.integers(1, depth), label="segments")
    model = mlp(depth, width, p, dtype, tied, seed)
    x = inputs(n, width, dtype, seed, x_grad)
    out, none_bytes, x_grad_ref, grads_ref = step(lambda m, y: m(y), model, x, seed)
    e, nw, d = x.element_size(), n * width, int(p > 0)
    m = depth - (k - 1) * (depth // k)
    formula = {"every layer": depth * e * nw, "sequential": (k - 1) * e * nw + m * (2 * e + d) * nw}
    assert none_bytes == depth * (2 * e + d) * nw
    for name, (ours, native) in strategies(k).items():
        mine, theirs = step(ours, model, x, seed), step(native, model, x, seed)
        for other in ((out, none_bytes, x_grad_ref, grads_ref), theirs):
            assert torch.equal(mine[0], other[0]), name
            assert identical(mine[2], other[2]), name
            assert all(torch.equal(a, b) for a, b in zip(mine[3], other[3])), name
        assert mine[1] == formula[name] == theirs[1], name


@pytest.mark.single_process
@settings(max_examples=10)
@given(depth=st.integers(2, 5), k=st.integers(1, 5), seed=st.integers(0, 99))
def test_peak_activation_bytes_alive_in_backward_equal_torchs_checkpoint(depth, k, seed):
    """The recomputation holds what torch's does at its worst moment: one segment's recomputed tensors,
    the inputs of the segments still waiting, and the op in flight (measure.LiveActivations, op by op)."""
    k = min(k, depth)
    model = mlp(depth, 6, 0.3, torch.float32, False, seed)
    x = inputs(3, 6, torch.float32, seed)
    for name, (ours, native) in strategies(k).items():
        peaks = []
        for run_model in (ours, native):
            torch.manual_seed(seed)
            peaks.append(max(profile_step(lambda: run_model(model, x), lambda out: out.sum().backward())["backward"]))
        assert peaks[0] == peaks[1], name


def test_a_checkpointed_segment_runs_forward_twice_and_recomputes_every_matmul():
    calls, ops = [], []
    model = mlp(3, 4, 0.0, torch.float64, False, 0)
    model[1].register_forward_pre_hook(lambda *_: calls.append(1))
    from torch.utils.flop_counter import FlopCounterMode
    x = inputs(2, 4, torch.float64, 0)
    for run_model, forwards, recomputed_matmuls in [(lambda m, y: m(y), 1, 0), (each(checkpoint), 2, 3)]:
        calls.clear()
        with FlopCounterMode(display=False) as flops:
            run_model(model, x).sum().backward()
        ops.append(flops.get_total_flops())
        assert len(calls) == forwards
        assert ops[-1] == ops[0] + recomputed_matmuls * 2 * 2 * 4 * 4  # 2*n*w*w per recomputed Linear


def test_non_reentrant_works_where_reentrant_cannot_inputs_without_grad_autograd_grad_and_kwargs():
    """The three reasons PyTorch recommends use_reentrant=False, for ours and for torch's."""
    layer = mlp(1, 5, 0.0, torch.float64, False, 1)[0]
    x = inputs(3, 5, torch.float64, 1)  # data: no gradient needed
    weights = list(layer.parameters())
    want = torch.autograd.grad(layer(x).sum(), weights)
    # (1) no input requires grad: the reentrant output does not either, the weights would get nothing
    assert not ac.ReentrantCheckpoint.apply(layer, x).requires_grad
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        assert not tc.checkpoint(layer, x, use_reentrant=True).requires_grad
    for ours in (checkpoint, functools.partial(tc.checkpoint, use_reentrant=False)):
        got = torch.autograd.grad(ours(layer, x).sum(), weights)  # (2) autograd.grad sees the weights
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # (2) reentrant: the inner backward fills .grad, the weights are not in the outer graph
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(ac.ReentrantCheckpoint.apply(layer, xg).sum(), weights)
    # (3) keyword arguments, a tensor among them, which gets its gradient through the real graph
    scale = torch.tensor(3.0, dtype=torch.float64, device=device(), requires_grad=True)
    want_scale = torch.autograd.grad(layer(x, scale=scale).sum(), scale)
    assert torch.equal(torch.autograd.grad(checkpoint(layer, x, scale=scale).sum(), scale)[0], want_scale[0])
    with pytest.raises(TypeError):
        ac.ReentrantCheckpoint.apply(layer, x, scale=scale)


# ----- the learner's exercise (./run.sh check activation_checkpoint): the textbook checkpoint, and its mistakes

MISTAKES = {  # each is made by a wrong solution of tests/bank_activation_checkpoint.py (test_exercise.py holds that)
    "dropout's randomness not replayed": ("ReentrantCheckpoint.backward", "the rerun must draw forward's dropout "
                                          "masks: keep rng_state(inputs) in forward before fn runs, and rerun fn "
                                          "inside replayed_rng(ctx.rng)"),
    "recomputed without grad": ("ReentrantCheckpoint.backward", "a Function's backward runs with grad off, so the "
                                "rerun records no graph to backpropagate through: rerun fn inside "
                                "torch.enable_grad()"),
    "inputs' gradients not returned": ("ReentrantCheckpoint.backward", "autograd takes an input's gradient only "
                                       "from what backward returns: return the .grad of each input's detached "
                                       "copy (requires_grad as the input's) after backpropagating"),
    "not one gradient per forward argument": ("ReentrantCheckpoint.backward", "backward returns one value per "
                                              "argument of forward, in order: None for fn (not a tensor), then "
                                              "one per input"),
    "rerun on the inputs themselves, not detached copies": (
        "ReentrantCheckpoint.backward", "the rerun's graph must end at leaves of its own: rerun fn on "
        "x.detach().requires_grad_(x.requires_grad) for each kept input, so that its backward stops there and an "
        "input's gradient reaches the input once, through what backward returns"),
    "weights' .grad not accumulated": ("ReentrantCheckpoint.backward", "the weights inside fn are not inputs of "
                                       "the Function: they get their gradient only from the rerun's own backward "
                                       "(torch.autograd.backward or output.backward, which accumulate into every "
                                       "leaf's .grad); torch.autograd.grad(output, inputs) leaves them untouched"),
    "whole activation kept": ("ReentrantCheckpoint.forward", "forward keeps only the inputs "
                              "(ctx.save_for_backward) and runs fn as a Function's forward runs, without grad, so "
                              "that nothing inside fn is saved; backward runs it again"),
    "inputs kept beside autograd": ("ReentrantCheckpoint.forward", "keep the inputs with "
                                    "ctx.save_for_backward(*inputs) and read them back from ctx.saved_tensors: "
                                    "autograd then knows backward needs them (and refuses to run it if they were "
                                    "modified in place); a tensor put on ctx directly is hidden from it"),
}
TORCH_SAYS = {  # what torch raises for a backward that does not fit its forward: the mistake behind it
    "does not require grad and does not have a grad_fn": "recomputed without grad",
    "incorrect number of gradients": "not one gradient per forward argument",
    "corresponding forward input was not a Variable": "not one gradient per forward argument",
}


def textbook(model, x):
    return ac.ReentrantCheckpoint.apply(model, x)


def plainly(model, x):
    return model(x)


def gradients(run_model, model, x, seed):
    """step's output and gradients, without its saved-tensor hooks: under hooks autograd hands backward a new
    tensor for each kept input, which would hide a rerun on the input itself (its gradient counted twice)."""
    model.zero_grad()
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    out = run_model(model, x)
    out.backward(torch.ones_like(out))
    return out.detach(), None, x.grad, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def returned_gradient(model, x, seed):
    """The input's gradient as backward returns it (torch.autograd.grad takes it from there alone), and the .grad
    the input was left with: what a rerun on the input itself wrote into it."""
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    out = textbook(model, x)
    (returned,) = torch.autograd.grad(out, x, torch.ones_like(out), allow_unused=True)
    return returned, x.grad


def spelled(t) -> str:
    return "None" if t is None else f"a {tuple(t.shape)} tensor"


def textbook_departure(depth, width, p, tied, seed) -> tuple[str | None, str | None]:
    """Where ReentrantCheckpoint.apply(model, x) on an MLP first leaves its contract, in words, and the classic
    mistake behind it where one is recognised; (None, None) when it keeps it."""
    case = (f"{depth} layer{'s' * (depth > 1)} of width {width}, dropout p={p}"
            f"{', a layer used twice' if tied else ''}, seed {seed}")
    model = mlp(depth, width, p, torch.float32, tied, seed)
    x = inputs(2, width, torch.float32, seed, requires_grad=True)  # reentrant needs an input that requires grad
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))  # the segment: the whole model
    try:
        kept = step(textbook, model, x, seed)[1]
        runs = len(calls)
        ours = gradients(textbook, model, x, seed)
        returned, written = returned_gradient(model, x, seed)
    except NotImplementedError:
        raise  # a blank: its own words say what to write
    except Exception as e:
        named = next((name for words, name in TORCH_SAYS.items() if words in str(e)), None)
        found = mistake(MISTAKES, named, f"torch said: {' '.join(str(e).split())}") if named else None
        return f"{case}: forward and backward through it: {raised(e, 'activation_checkpoint')}", found
    plain = step(plainly, model, x, seed)
    want = x.numel() * x.element_size()
    found = None
    if kept == plain[1]:
        found = mistake(MISTAKES, "whole activation kept", f"forward kept {kept} bytes, as many as without "
                        "checkpointing")
    elif kept == 0:
        found = mistake(MISTAKES, "inputs kept beside autograd", "autograd was handed no tensor to keep")
    if runs != 2:
        return (f"{case}: the segment ran forward {runs} times in one forward and backward, not 2 (once in "
                f"forward, once more in backward to recompute what forward did not keep)"), found
    if kept != want:
        return (f"{case}: forward kept {kept} bytes for backward (what autograd saved), not the input's {want} "
                f"(the inputs by ctx.save_for_backward, nothing inside fn)"), found
    theirs = {"plain": plain, "torch's reentrant": step(functools.partial(tc.checkpoint, use_reentrant=True), model,
                                                         x, seed)}
    for name, other in theirs.items():
        for what, a, b in [("output", ours[0], other[0]), ("input gradient", ours[2], other[2]),
                           *((f"gradient of parameter {i}", g, h) for i, (g, h) in enumerate(zip(ours[3], other[3])))]:
            if a is None or b is None:
                if a is not b:
                    return (f"{case}: {what}: yours is {spelled(a)}, the {name} run's {spelled(b)}"), \
                        checkpoint_mistake(ours, plain, (depth, width, p, tied, seed))
            elif first_difference(a, b):
                return (f"{case}: {what} differs from the {name} run at {first_difference(a, b)} (yours vs theirs; "
                        f"the same kernels on the same inputs with the same dropout masks: exact)"), \
                    checkpoint_mistake(ours, plain, (depth, width, p, tied, seed))
    if not identical(returned, plain[2]):
        found = None
        if returned is None and written is not None:
            found = mistake(MISTAKES, "inputs' gradients not returned", "backward returned None for the input, "
                            "whose .grad the rerun's backward then wrote itself, reaching it through the graph")
        off = first_difference(returned, plain[2])
        how = "is None" if returned is None else f"differs from the plain run's at {off}"
        return f"{case}: the input's gradient as backward returns it (torch.autograd.grad(output, x)) {how}", found
    return None, None


def checkpoint_mistake(ours, plain, case) -> str | None:
    """The mistake behind gradients that differ: an input's gradient not returned or counted twice, the weights'
    .grad left empty, or dropout's masks drawn anew (the same case without dropout passes)."""
    if ours[2] is None and plain[2] is not None:
        return mistake(MISTAKES, "inputs' gradients not returned", "the input requires grad, and after backward "
                       "its .grad is None")
    if ours[2] is not None and torch.equal(ours[2], 2 * plain[2]) and plain[2].any():
        return mistake(MISTAKES, "rerun on the inputs themselves, not detached copies", "the input's gradient is "
                       "exactly twice the plain run's: the rerun's backward reached the input, then autograd added "
                       "the gradient backward returned")
    empty = [i for i, (g, h) in enumerate(zip(ours[3], plain[3])) if g is None and h is not None]
    if empty and identical(ours[2], plain[2]):
        return mistake(MISTAKES, "weights' .grad not accumulated", f"the input's gradient is exact, and after "
                       f"backward parameter{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} of fn "
                       f"{'have' if len(empty) > 1 else 'has'} .grad None")
    depth, width, p, tied, seed = case
    if p > 0 and textbook_departure(depth, width, 0.0, tied, seed)[0] is None:
        return mistake(MISTAKES, "dropout's randomness not replayed", f"with dropout p={p} the gradients differ, "
                       f"without dropout they are exact: the rerun drew other masks than forward")
    return None


@pytest.mark.exercise(judges=("ReentrantCheckpoint.backward", "ReentrantCheckpoint.forward"))
@pytest.mark.single_process
@given(depth=st.integers(1, 4), width=st.integers(1, 6), p=st.sampled_from([0.0, 0.3]), tied=st.booleans(),
       seed=st.integers(0, 99))
@example(depth=2, width=4, p=0.3, tied=False, seed=0)  # dropout's masks, drawn twice
def test_the_textbook_checkpoint_keeps_only_its_input_reruns_forward_once_and_equals_torchs_reentrant(
        depth, width, p, tied, seed):
    """The textbook checkpoint keeps only its input (ctx.save_for_backward) and reruns forward once in backward;
    output and every gradient (the input's, the weights' .grad) bit for bit as without checkpointing

    Forward saves nothing inside the segment; backward runs it once more with the forward's dropout masks, so
    the output and every gradient equal the plain model's and torch.utils.checkpoint(use_reentrant=True)'s,
    and the input's gradient is the one backward returns (torch.autograd.grad(output, x) takes it from there)."""
    wrong, found = textbook_departure(depth, width, p, tied and depth >= 2, seed)
    assert wrong is None, wrong + (f"\n{found}" if found else "")


def test_retain_graph_recomputes_again_for_a_second_backward():
    model, x = mlp(3, 4, 0.3, torch.float32, False, 2), inputs(2, 4, torch.float32, 2)
    grads = []
    for run_model in (lambda m, y: m(y), each(checkpoint)):
        model.zero_grad()
        torch.manual_seed(2)
        loss = run_model(model, x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_checkpoint_module_keeps_parameter_names_and_gradients():
    plain, wrapped = mlp(2, 4, 0.3, torch.float32, False, 3), mlp(2, 4, 0.3, torch.float32, False, 3)
    names = [n for n, _ in wrapped.named_parameters()]
    for layer in wrapped:
        checkpoint_module(layer)
    assert [n for n, _ in wrapped.named_parameters()] == names
    x = inputs(5, 4, torch.float32, 3)
    a, b = step(lambda m, y: m(y), plain, x, 3), step(lambda m, y: m(y), wrapped, x, 3)
    assert b[1] == 2 * x.numel() * 4 and all(torch.equal(p, q) for p, q in zip(a[3], b[3]))
    with torch.no_grad():  # no graph, nothing to keep: a plain call
        outs = [torch.manual_seed(3) and model(x) for model in (plain, wrapped)]
    assert torch.equal(*outs)


def test_the_transformer_layer_saves_korthikantis_count_and_checkpoints_to_its_input():
    b, s, h, a = 2, 6, 8, 2
    layer, x = TransformerLayer(h, a, 0.1).to(device()), torch.randn(b, s, h).to(device())
    with SavedTensors(exclude=layer.parameters()) as saved:
        layer(x)
    stats = 4 * s * b * 4  # two layer norms' mean and 1/std, fp32 on the CPU
    assert saved.bytes == 4 * (16 * s * b * h + 2 * a * s * s * b) + 2 * s * b * h + a * s * s * b + stats
    with SavedTensors(exclude=layer.parameters()) as saved:
        checkpoint(layer, x)
    assert saved.bytes == 4 * s * b * h


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("segments", [0, 4, -1, 1.5, True, "2"])
def test_segments_outside_1_to_the_layer_count_are_refused_with_what_to_change(segments):
    with pytest.raises(ValueError, match="segments must be a whole number from 1 to the 3 layers"):
        checkpoint_sequential(mlp(3, 2, 0.0, torch.float64, False, 0), segments, inputs(1, 2, torch.float64, 0))


def test_a_model_that_is_not_a_chain_of_layers_is_refused():
    with pytest.raises(TypeError, match="checkpoint its blocks with checkpoint"):
        checkpoint_sequential(nn.Linear(2, 2, device=device()), 1, inputs(1, 2, torch.float32, 0))


def test_a_segment_that_computes_something_else_when_recomputed_is_named_not_silently_wrong():
    linear, calls = nn.Linear(3, 3, device=device()), []

    def moody(x):  # a branch on Python state: the recomputation takes the other branch
        calls.append(1)
        return linear(x).tanh() if len(calls) == 1 else linear(x)
    with pytest.raises(RuntimeError, match="saved 2 tensors in forward and 1 when recomputed"):
        checkpoint(moody, inputs(2, 3, torch.float32, 0)).sum().backward()


def demo(argv, monkeypatch, module=ac) -> int:
    """The demo's command line run in this process as one rank (no wall-clock budget: a busy machine is slow)."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(launch.free_port())).items():
        monkeypatch.setenv(name, value)
    return launch.main(module.parser(), module.demo, argv)


def test_demo_command_checks_itself_and_refuses_bad_segments_in_one_line(monkeypatch, capsys):
    assert demo(["--layers", "4", "--seq", "8", "--hidden", "8", "--heads", "2"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "SUMMARY|activation_checkpoint|PASS" in out and "|PASS" in out.split("SUMMARY")[1], out
    assert demo(["--layers", "4", "--segments", "5"], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--segments" in err, err


# ----------------------------------------------------------------------------- tensor parallelism


def tp_block_grads(h, heads, tp, seed):
    """A tensor-parallel block with and without checkpointing on a TP group of `tp`: equal gradients."""
    from mini_dist.parallel_transformer import ParallelTransformerBlock
    group = subgroup(range(tp))
    if dist.get_rank() >= tp:
        return None
    torch.manual_seed(seed)
    block = ParallelTransformerBlock(h, heads, group=group, device=device(), dtype=torch.float64)
    x = torch.randn(2, 5, h, generator=rank_generator(seed), dtype=torch.float64).to(device())
    results = []
    for run_block in (block, functools.partial(checkpoint, block)):
        block.zero_grad()
        xg = x.clone().requires_grad_()
        run_block(xg).square().sum().backward()
        results.append([xg.grad] + [p.grad.clone() for p in block.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results))


@settings(max_examples=6)
@given(tp=st.integers(1, 4), seed=st.integers(0, 99))
def test_a_checkpointed_tensor_parallel_block_equals_the_uncheckpointed_one_on_every_rank(tp, seed):
    """The recomputation repeats the block's forward all-reduces inside backward, on every rank of the
    group in the same order, and gets the same sums."""
    assert all(r for r in run(4, tp_block_grads, 12, 12, tp, seed)[:tp])


def tp_block_all_reduces(h, heads, tp, checkpointed, seed):
    """All-reduce calls and ring bytes one forward + backward of a tensor-parallel block issues on this rank."""
    from mini_dist.comm import COUNTER
    from mini_dist.parallel_transformer import ParallelTransformerBlock
    group = subgroup(range(tp))
    if dist.get_rank() >= tp:
        return None
    torch.manual_seed(seed)
    block = ParallelTransformerBlock(h, heads, group=group, device=device(), dtype=torch.float64)
    x = torch.randn(2, 5, h, generator=rank_generator(seed), dtype=torch.float64).to(device()).requires_grad_()
    COUNTER.reset()
    (checkpoint(block, x) if checkpointed else block(x)).square().sum().backward()
    numel = x.numel()  # every all-reduce of the block is one [b, s, h] activation or its gradient
    assert COUNTER.bytes["all_reduce"] == COUNTER.calls["all_reduce"] * numel * 8
    return COUNTER.calls["all_reduce"], COUNTER.calls["all_reduce"] * 2 * (tp - 1) * -(-numel // tp) * 8


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_planners_tensor_parallel_traffic_with_recomputation_equals_the_counted_all_reduces(tp, checkpointed):
    """Megatron's 4 all-reduces per layer (2 forward, 2 backward) become 6 when the block is recomputed: the
    rerun forward repeats its 2 (Korthikanti et al. 2022). The planner's figure is the counted one."""
    from mini_dist.cost_model import Model, Plan, tp_traffic
    calls, sent = run(tp, tp_block_all_reduces, 12, 6, tp, checkpointed, 0)[0]
    assert calls == (6 if checkpointed else 4)
    plan = Plan(dp=1, tp=tp, micro_batch=2, microbatches=1, precision="fp64", checkpoint=checkpointed)
    assert sent == tp_traffic(Model(params=1, layers=1, hidden=12, heads=6, seq=5), plan)
