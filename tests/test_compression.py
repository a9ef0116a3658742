"""Compression hooks against torch's own (fp16/bf16, PowerSGD) on mini DDP and on native DDP; bytes per step
against r(n + m); error feedback's residual; orthogonalization; bad input."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as native_powersgd
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from harness import device, rank_generator, run
from mini_dist import comm, compression, ddp
from mini_dist.kit import launch

F64 = torch.float64


class Layers(nn.Module):
    """Linear layers with these (in, out) shapes side by side (repeated shapes test torch's grouping order);
    forward(xs) is the loss of one input per layer."""

    def __init__(self, shapes, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b, dtype=dtype, device=device()) for a, b in shapes)

    def forward(self, xs):
        return sum(layer(x).square().mean() * (i + 1) for i, (layer, x) in enumerate(zip(self.layers, xs)))


def inputs(g, shapes, dtype, batch=3):
    return [torch.randn(batch, a, generator=g, dtype=dtype).to(device()) for a, _ in shapes]


def one_bucket_at_a_time(hook):
    """torch's powerSGD_hook issues the all-reduces of P and Q from callbacks on gloo's thread, while the
    next bucket's hook issues its first all-reduce from the autograd thread: with several buckets the ranks
    can issue them in different orders (gloo: "Received data size doesn't match"). Waiting for each bucket
    keeps one order, as our hook does by running every bucket on one communication thread."""
    def serialized(state, bucket):
        future = torch.futures.Future()
        future.set_result(hook(state, bucket).wait())
        return future
    return serialized


HOOKS = {"fp16": (compression.fp16_compress_hook, default_hooks.fp16_compress_hook),
         "bf16": (compression.bf16_compress_hook, default_hooks.bf16_compress_hook),
         "powersgd": (compression.powerSGD_hook, one_bucket_at_a_time(native_powersgd.powerSGD_hook))}


def train(shapes, hook, state_args, steps, cap, which, native_ddp, dtype=F64, seed=0):
    """SGD steps with our hook or torch's, on mini DDP or native DDP; each rank its own data.
    Returns every step's averaged gradients and the final parameters."""
    model = Layers(shapes, dtype)
    wrapper = NativeDDP(model, bucket_cap_mb=cap) if native_ddp else ddp.DistributedDataParallel(model, cap)
    state = None
    if hook == "powersgd":
        state = (compression.PowerSGDState if which == "ours" else native_powersgd.PowerSGDState)(None, **state_args)
    wrapper.register_comm_hook(state, HOOKS[hook][which == "torch"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g, grads = rank_generator(seed), []
    for _ in range(steps):
        wrapper(inputs(g, shapes, dtype)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


def ours_equal_torchs(shapes, hook, state_args, steps, cap, native_ddp, dtype=F64):
    ours = train(shapes, hook, state_args, steps, cap, "ours", native_ddp, dtype)
    theirs = train(shapes, hook, state_args, steps, cap, "torch", native_ddp, dtype)
    same = all(torch.equal(a, b) for step_a, step_b in zip(ours[0], theirs[0]) for a, b in zip(step_a, step_b))
    return same and all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))


shape_lists = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=4).map(
    lambda s: s + s[:1])  # the first shape twice: torch visits same-shaped matrices together


@settings(max_examples=10)
@given(world=st.integers(1, 5), shapes=shape_lists, rank=st.integers(1, 4), start=st.integers(2, 3),
       error_feedback=st.booleans(), warm_start=st.booleans(), cap=st.sampled_from([None, 1e-4]),
       epsilon=st.sampled_from([0, 1e-8]))
def test_powersgd_equals_torchs_hook_bit_for_bit_through_warm_up_and_compressed_steps(
        world, shapes, rank, start, error_feedback, warm_start, cap, epsilon):
    # The same arithmetic in the same order: the same seed draws the same Qs (torch's grouping of matrices
    # by shape), Gram-Schmidt for r <= 2 and QR above it, one flat all-reduce for P, for Q and for the
    # uncompressed tensors, in torch's layout. So no bound is needed: fp64 results are identical, through
    # the plain steps before start_powerSGD_iter, the first compressed step (random Q) and warm starts.
    args = dict(matrix_approximation_rank=rank, start_powerSGD_iter=start, min_compression_rate=0.5,
                use_error_feedback=error_feedback, warm_start=warm_start, orthogonalization_epsilon=epsilon,
                random_seed=7)
    assert all(run(world, ours_equal_torchs, shapes, "powersgd", args, start + 3, cap, False))


@pytest.mark.parametrize("world", [1, 3])
def test_our_powersgd_hook_on_native_ddp_equals_torchs_on_native_ddp(world):
    # torch's signature: our hook runs on torch's DistributedDataParallel too (its GradBucket, its rebuilt
    # buckets after the first step), with the same result as torch's hook
    args = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=3)
    assert all(run(world, ours_equal_torchs, [(8, 6), (5, 9), (8, 6)], "powersgd", args, 5, 1e-4, True))


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 5])
def test_cast_hooks_equal_torchs_bit_for_bit(hook, world):
    assert all(run(world, ours_equal_torchs, [(7, 5), (3, 4)], hook, None, 3, None, False, torch.float32))


def bytes_per_step(shapes, rank, dtype, hook):
    wrapper = ddp.DistributedDataParallel(Layers(shapes, dtype))
    state = compression.PowerSGDState(None, rank, start_powerSGD_iter=2) if hook == "powersgd" else None
    wrapper.register_comm_hook(state, HOOKS[hook][0])
    g, sent = rank_generator(1), []
    for _ in range(3):
        comm.COUNTER.reset()
        wrapper(inputs(g, shapes, dtype)).backward()
        sent.append(comm.COUNTER.bytes["all_reduce"])
    return sent


@settings(max_examples=15)
@given(world=st.integers(1, 4), shapes=shape_lists, rank=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, F64]))
def test_bytes_per_step_are_r_times_n_plus_m_per_compressed_matrix_and_d_before(world, shapes, rank, dtype):
    e = torch.empty(0, dtype=dtype).element_size()  # cpu: only its element size
    D = sum(a * b + b for a, b in shapes) * e
    # a weight is n x m = out x in; it is compressed when r(n + m) * 2 < n m, else sent whole like a bias
    compressed = sum(min(b, a, rank) * (a + b) if compression.should_compress(b, a, rank, 2) else a * b
                     for a, b in shapes) + sum(b for _, b in shapes)
    for sent in run(world, bytes_per_step, shapes, rank, dtype, "powersgd"):
        assert sent == ([D, D, compressed * e] if world > 1 else [0, 0, 0])  # one rank sends nothing
    for sent in run(world, bytes_per_step, shapes, rank, dtype, "fp16"):
        assert sent == [D // e * 2] * 3 if world > 1 else [0] * 3  # half of fp32, a quarter of fp64


def exact_sum(tensors):
    """Elementwise sum, rounded once (math.fsum)."""
    return torch.tensor([math.fsum(column) for column in zip(*(t.tolist() for t in tensors))], dtype=F64,
                        device=tensors[0].device)


def residuals(shapes, rank, steps):
    """Per compressed step and bucket: the rank's gradient g, the error e it carried in, what the hook
    applied, and the error it kept."""
    wrapper = ddp.DistributedDataParallel(Layers(shapes, F64), bucket_cap_mb=1e-4)
    state = compression.PowerSGDState(None, rank, start_powerSGD_iter=2)
    seen = []

    def recording(state, bucket):
        k, g = bucket.index(), bucket.buffer().clone()
        before = state.error_dict.get(k)
        before = None if before is None else before.clone()
        future = compression.powerSGD_hook(state, bucket)
        return future.then(lambda f: seen.append((k, g, before, f.value().clone())) or f.value())
    wrapper.register_comm_hook(state, recording)
    gen = rank_generator(2)
    for _ in range(steps):
        wrapper(inputs(gen, shapes, F64)).backward()
    return seen, {k: e.clone() for k, e in state.error_dict.items()}, len(wrapper.buckets)


@settings(max_examples=8)
@given(world=st.integers(1, 4), shapes=shape_lists, rank=st.integers(1, 3))
def test_error_feedback_keeps_exactly_what_was_not_sent(world, shapes, rank):
    steps = 5
    for seen, final, n_buckets in run(world, residuals, shapes, rank, steps):
        compressed = [s for s in seen[2 * n_buckets:]]  # after the 2 plain steps
        by_bucket = {}
        for k, g, before, applied in compressed:
            by_bucket.setdefault(k, []).append((g, before, applied))
        for k, history in by_bucket.items():
            # e_(t+1) = (g_t + e_t) - applied_t, the same floating-point operations: bit for bit
            errors = [b for _, b, _ in history[1:]] + [final[k]]
            for (g, before, applied), after in zip(history, errors):
                carried = g if before is None else g + before
                assert torch.equal(after, carried - applied)
            # nothing is lost, only delayed: sum_t applied_t + e_T - sum_t g_t is, exactly, the sum of each
            # step's two roundings (g + e: <= u|g + e|; (g + e) - applied: <= u|e_next|); the two sums are
            # taken exactly rounded (math.fsum), one more rounding each
            u = 2.0 ** -53
            kept = exact_sum([a for _, _, a in history] + [final[k]])
            g_sum = exact_sum([g for g, _, _ in history])
            bound = sum(u * ((g if b is None else g + b).abs() + after.abs()) for (g, b, _), after in
                        zip(history, errors)) + u * (kept.abs() + g_sum.abs())
            assert ((kept - g_sum).abs() <= bound).all()


@given(n=st.integers(1, 30), r=st.integers(1, 6), dtype=st.sampled_from([F64, torch.float32]),
       seed=st.integers(0, 10 ** 6))
@pytest.mark.single_process
def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space(n, r, dtype, seed):
    r = min(n, r)
    M = torch.randn(n, r, generator=torch.Generator().manual_seed(seed), dtype=dtype)  # cpu: no ranks
    Q = M.clone()
    compression.orthogonalize(Q)
    eps = torch.finfo(dtype).eps
    # Gaussian n x r columns are well conditioned (r <= n) with overwhelming probability: Q^T Q = I to a
    # few hundred ulps, and M = Q (Q^T M) (the same column space)
    assert torch.allclose(Q.T @ Q, torch.eye(r, dtype=dtype), atol=500 * eps * n, rtol=0)  # cpu: as M
    assert torch.allclose(Q @ (Q.T @ M), M, atol=500 * eps * n * M.abs().max().item(), rtol=0)


def test_should_compress_is_r_times_n_plus_m_times_the_rate_below_n_m():
    assert compression.should_compress(64, 64, 1, 2) and not compression.should_compress(64, 64, 16, 2)
    assert compression.should_compress(64, 64, 15, 2)       # 15 * 128 * 2 = 3840 < 4096
    assert not compression.should_compress(5, 1, 1, 2)      # a vector: never
    assert compression.should_compress(4, 100, 9, 0.5)      # r clamps to min(n, m) = 4: 4 * 104 * 0.5 < 400


@pytest.mark.parametrize("kwargs, message", [
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be an integer >= 1, got 0"),
    (dict(matrix_approximation_rank=1.5), "matrix_approximation_rank must be an integer >= 1, got 1.5"),
    (dict(start_powerSGD_iter=1), "start_powerSGD_iter must be > 1 with error feedback or warm start")])
def test_a_state_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        compression.PowerSGDState(None, **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "64"], "--ranks 64: a gradient matrix of this model has rank at most 32; choose ranks from 1 to 32"),
    (["--ranks", "8"], "--ranks 8: r(n + m) * 2 >= n m for a layer of widths [32, 32, 32], so PowerSGD would "
                       "send it whole; choose a smaller r or wider layers"),
    (["--start-iter", "1"], "--start-iter >= 2")])
def test_the_demo_refuses_a_rank_the_matrices_cannot_take_in_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert launch.main(compression.parser(), compression.demo, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
