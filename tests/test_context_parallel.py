"""Context parallelism (mini_dist/context_parallel.py) equals attention over the whole sequence.

Every rank builds the same whole q, k, v and output gradient (one example's sequence: what differs between ranks
is which part of it they hold, not the data), runs ring or the naive all-gather attention on its part, and
compares its part of the output and of dq, dk, dv with F.scaled_dot_product_attention on the whole sequence, in
fp64. Also checked: the byte ledgers equal the docstring's formulas exactly, the zigzag layout gives every rank
the same work, torch's own ring (the loop context_parallel runs) agrees, and bad input raises the same error on
every rank. Ulysses (tests/test_ulysses.py) reuses the helpers and the bound below.

Tolerance, derived (`bound`). u = 2^-53, and a chain of n roundings changes a result by at most
gamma = n*u/(1-n*u) of the sum of its terms' magnitudes; the longest chain here is n = S + d + 2C + 8 (a
length-d dot product, a length-S sum, up to 2C online-softmax merges, a few pointwise ops).
  scores   |s_ij| <= A = max_ij sum_c |q_ic||k_jc| / sqrt(d); each is off by <= gamma*A
  weights  p = exp(s - lse): an absolute error e in the exponent is a relative error e in p; the score and
           the log-sum-exp each bring gamma*A, exp and the division gamma: eps_p = gamma*(2A + 1)
  out      = sum_j p_ij v_j with sum_j p_ij = 1:                     (eps_p + gamma) * max|v|
  dv_j     = sum_i p_ij dout_i, sum_i p_ij <= P (max column sum):      (eps_p + gamma) * max|dout| * P
  ds_ij    = p_ij (dout_i.v_j - dout_i.out_i); both dot products are at most G = max_ij sum_c |dout_ic||v_jc|
           (out_i is an average of v_j), so per unit of p_ij ds is off by E = (eps_p + 3 gamma) 2G + |dout_i|_1 err(out)
  dq_i     = sum_j ds_ij k_j / sqrt(d):                                (E + 2 gamma G) max|k| / sqrt(d)
  dk_j     = sum_i ds_ij q_i / sqrt(d):                                (E + 2 gamma G) max|q| P / sqrt(d)
Measured differences are 1e-4 to 5e-3 of these bounds (a worst case adds every rounding error in the same
direction); a wrong merge, a lost tile, a block from the wrong rank or a gradient that did not come home is an
O(1) error.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import cp_exercise
from cp_exercise import MISTAKES  # noqa: F401  (the exercise's, declared beside its judge)
from grading import optional
from harness import BACKEND, RankFailure, device, run, subgroup
from mini_dist import comm, nccl_order
from mini_dist import context_parallel as cp
from mini_dist import sequence_layout as sl

F64 = torch.float64
U = 2.0 ** -53
METHODS = {"ring": "ring_attention", "naive": "allgather_attention"}  # looked up in cp at call time


def method(name):
    return getattr(cp, METHODS[name])


def whole_sequence(seed, b, H, S, d):
    """q, k, v, dout of one example: the same on every rank (each rank then holds a different part of it)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, H, S, d, dtype=F64, generator=g).to(device()) for _ in range(4)]


def reference(q, k, v, dout, causal):
    """F.scaled_dot_product_attention on the whole sequence: output and the gradients of q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def bound(q, k, v, dout, causal, C):
    """The worst-case fp64 difference of out, dq, dk, dv derived in the module docstring."""
    b, H, S, d = q.shape
    n = S + d + 2 * C + 8
    gamma = n * U / (1 - n * U)
    A = (q.abs() @ k.abs().transpose(-2, -1)).max().item() / math.sqrt(d)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    P = scores.softmax(-1).sum(-2).max().item()  # the largest column sum of the attention weights
    eps_p = gamma * (2 * A + 1)
    g, V = dout.abs().max().item(), v.abs().max().item()
    out = (eps_p + gamma) * V
    G = (dout.abs() @ v.abs().transpose(-2, -1)).max().item()
    E = (eps_p + 3 * gamma) * 2 * G + dout.abs().sum(-1).max().item() * out
    return [out, (E + 2 * gamma * G) * k.abs().max().item() / math.sqrt(d),
            (E + 2 * gamma * G) * q.abs().max().item() * P / math.sqrt(d), (eps_p + gamma) * g * P]


def largest_difference(ours, want):
    """(max |ours - want|, the [b, H, s, d] index where it is)."""
    diff = (ours - want).abs()
    return diff.max().item(), [i.item() for i in torch.unravel_index(diff.argmax(), diff.shape)]


def attention_case(attention, ranks, causal, layout, shape, seed):
    """On the group of `ranks`: for out, dq, dk, dv, (max |ours - reference|, bound, where); bytes this rank
    sent forward and backward; scores computed. Ranks outside the group return None. attention: a function,
    or the name of one in context_parallel (looked up now, so a learner's copy of the module is what runs)."""
    attention = getattr(cp, attention) if isinstance(attention, str) else attention
    group = subgroup(ranks)
    if dist.get_rank() not in ranks:
        return None
    C = len(ranks)
    q, k, v, dout = whole_sequence(seed, *shape)
    want = reference(q, k, v, dout, causal)
    mine = [sl.split_sequence(t, group, layout).requires_grad_() for t in (q, k, v)]
    comm.COUNTER.reset()
    sl.SCORES.reset()
    out = attention(*mine, causal=causal, group=group, layout=layout)
    forward, scores = sl.bytes_sent(group), sl.SCORES.elements
    comm.COUNTER.reset()
    out.backward(sl.split_sequence(dout, group, layout))
    got = [out.detach()] + [t.grad for t in mine]
    errors = [largest_difference(a, sl.split_sequence(b, group, layout)) for a, b in zip(got, want)]
    return ([(e, tol, where) for (e, where), tol in zip(errors, bound(q, k, v, dout, causal, C))], forward,
            sl.bytes_sent(group), scores)


def every_case(methods, ranks, b, H, chunk, d, seed):
    """attention_case for every method of {name: attention}, causal and not, in both layouts: one call of the
    pool, so that every drawn world and shape meets every combination."""
    C = len(ranks)
    subgroup(ranks)  # created by every rank of the pool, members or not
    if dist.get_rank() not in ranks:
        return None
    return {(name, causal, layout): attention_case(attention, ranks, causal, layout,
                                                   (b, H, chunk * C * len(sl.chunk_ids(0, C, layout)), d), seed)
            for name, attention in methods.items() for causal in (False, True) for layout in sl.LAYOUTS}


def assert_within_bound(results):
    for rank, cases in enumerate(results):
        for (name, causal, layout), result in (cases or {}).items():
            for what, (error, tol, where) in zip(("out", "dq", "dk", "dv"), result[0]):
                assert error <= tol, (f"rank {rank}, {name} {'causal' if causal else 'unmasked'} {layout}: {what} "
                                      f"[b, H, s, d] = {where} differs from sdpa by {error:.2e} > bound {tol:.2e}")


# ----- the merge, the learner's exercise (./run.sh check context_parallel), judged first (one process, quick):
# any equivalent form passes (torch.logaddexp, a running max); the classic mistakes named (tests/cp_exercise.py)

SHIFTS = st.sampled_from([0.0, 0.0, 750.0, -750.0])  # past +-709.78, e^lse overflows fp64 (underflows past -745)


@pytest.mark.exercise(judges=("merge",))
@pytest.mark.single_process
@given(n=st.integers(2, 12), d=st.integers(1, 6), data=st.data(), seed=st.integers(0, 1000), shift_a=SHIFTS,
       shift_b=SHIFTS)
def test_merge_of_attention_over_two_key_sets_is_attention_over_both(n, d, data, seed, shift_a, shift_b):
    """merge: attention over keys [0, a) and over [a, n) is attention over all n keys, and its log-sum-exp, for any lse

    Each key set's scores shifted by 0 or +-750 (as large scores make lse; e^750 overflows fp64); merged into the
    ring's start (out 0, lse -inf: no keys yet), a block comes out as it went in. Bound: an lse is off by ~u (|s|
    + log n) per rounding, which is a relative error of a weight e^(lse_j - lse'); out sums n weighted values of
    size max|v|."""
    a = data.draw(st.integers(1, n - 1))
    q, k, v = (torch.randn(2, 3, m, d, dtype=F64, generator=torch.Generator().manual_seed(seed + i))  # cpu: one
               for i, m in enumerate((4, n, n)))                                                    # process
    s = q @ k.transpose(-2, -1) / math.sqrt(d)
    s = torch.cat([s[..., :a] + shift_a, s[..., a:] + shift_b], -1)  # as if these keys scored that much higher
    parts = [(s[..., keys].softmax(-1) @ v[:, :, keys], s[..., keys].logsumexp(-1, keepdim=True))
             for keys in (slice(0, a), slice(a, n))]
    scale = 4 * (n + d + 8) * U * (1 + s.abs().max().item() + math.log(n))
    wanted = [(s.softmax(-1) @ v, scale * v.abs().max().item()), (s.logsumexp(-1, keepdim=True), scale)]
    start = [torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], -math.inf)]
    for given, want, what in (([*parts[0], *parts[1]], wanted, "over both key sets"),
                              ([*start, *parts[0]], [(x, tol) for x, (_, tol) in zip(parts[0], wanted)],
                               "merged into the ring's start (out 0, lse -inf)")):
        got = cp_exercise.learners_merge(*given)
        wrong = merge_difference(got, want, what, f" (scores shifted by {shift_a:g} and {shift_b:g})")
        found = cp_exercise.merge_mistake() if wrong else None
        assert wrong is None, wrong + (f"\n{found}" if found else "")
    start_got = cp_exercise.learners_merge(*start, *parts[0])
    same = all(torch.equal(x, y) for x, y in zip(start_got, parts[0]))
    optional(same, "a block merged into (0, -inf) comes out bit for bit", "" if same else "it changed in the last "
             "bits", "e^0 = 1 and e^-inf = 0 exactly: the larger lse subtracted first, nothing else rounds")


def merge_difference(got, want, what, shifted) -> str | None:
    """The first way merge's (out, lse) leaves attention `what`: a shape, a value beyond its bound, inf or nan."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"merge returned {type(got).__name__}, want a pair (out, lse)"
    for name, ours, (value, tol) in zip(("out [b, H, query, d]", "lse [b, H, query, 1]"), got, want):
        if not isinstance(ours, torch.Tensor) or ours.shape != value.shape:
            return (f"merge's {name.split()[0]} is {getattr(ours, 'shape', ours)}, want shape {tuple(value.shape)}")
        error, where = largest_difference(ours.nan_to_num(math.inf, math.inf, math.inf), value)
        if not error <= tol:
            return (f"merge: {name} = {where}, {what}{shifted}: got {ours[tuple(where)].item():.8g}, want "
                    f"{value[tuple(where)].item():.8g} (bound {tol:.1e})")
    return None


@pytest.mark.exercise(judges=("merge",))
@given(world=st.integers(1, 5), data=st.data(), b=st.integers(1, 2), d=st.integers(1, 8), chunk=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_ring_and_allgather_equal_sdpa_on_the_whole_sequence_outputs_and_gradients(world, data, b, d, chunk,
                                                                                    seed):
    """Ring and naive attention equal SDPA on the whole sequence: out, dq, dk, dv, causal or not, both layouts.

    A context-parallel group of any ranks of the world (size C), any head count (a multiple of C half the
    time), chunk tokens in each chunk of the layout (S = 2C*chunk zigzag, C*chunk contiguous)."""
    ranks = sorted(data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)))
    C = len(ranks)
    H = data.draw(st.integers(1, 2)) * C if data.draw(st.booleans()) else data.draw(st.integers(1, 4))
    results = run(world, every_case, METHODS, ranks, b, H, chunk, d, seed)
    try:
        assert_within_bound(results)
    except AssertionError as e:  # the merge is the learner's: its mistake, where the probe recognises one
        found = cp_exercise.merge_mistake()
        raise AssertionError(f"{e}" + (f"\n{found}" if found else "")) from None


@pytest.mark.parametrize("C", [1, 2, 3, 5])
def test_bytes_sent_equal_the_formulas_exactly(C):
    b, H, S, d = 2, 2 * C, 4 * C, 3
    K = b * S * H * d * 8  # all of K (or V) over the whole sequence, fp64
    sent = 2 * (C - 1) * K // C  # K and V, all but this rank's own 1/C: to the C-1 others
    want = {"ring": (sent, 2 * sent), "naive": (sent, sent)}  # naive: all-gather, then reduce-scatter of dK, dV
    for name, (forward, backward) in want.items():
        for causal in (False, True):
            for _, sent_forward, sent_backward, _ in run(C, attention_case, METHODS[name], list(range(C)), causal,
                                                          sl.ZIGZAG, (b, H, S, d), 0):
                assert (sent_forward, sent_backward) == (forward, backward), (name, causal)


@pytest.mark.parametrize("C", [1, 2, 3, 4, 5])
def test_zigzag_gives_every_rank_equal_causal_work_and_contiguous_gives_rank_r_r_plus_1_blocks(C):
    L = 2  # tokens in a zigzag chunk
    S = 2 * C * L
    work = {layout: [r[3] for r in run(C, attention_case, "ring_attention", list(range(C)), True, layout,
                                        (1, 1, S, 2), 0)]
            for layout in sl.LAYOUTS}
    assert work[sl.ZIGZAG] == [(2 * C + 1) * L * L] * C
    assert work[sl.CONTIGUOUS] == [(r + 1) * (S // C) ** 2 for r in range(C)]


def unmasked_any_length(attention, S):
    """Non-causal attention of a contiguous split with an odd length per rank, the layout argument left at zigzag:
    without the mask the order of the keys does not matter, so every method must accept it."""
    attention = getattr(cp, attention) if isinstance(attention, str) else attention
    q, k, v, dout = whole_sequence(1, 2, dist.get_world_size(), S, 3)
    want = reference(q, k, v, dout, False)
    mine = [sl.split_sequence(t, layout=sl.CONTIGUOUS).requires_grad_() for t in (q, k, v)]
    out = attention(*mine)
    out.backward(sl.split_sequence(dout, layout=sl.CONTIGUOUS))
    return max((a - sl.split_sequence(b, layout=sl.CONTIGUOUS)).abs().max().item()
               for a, b in zip([out.detach()] + [t.grad for t in mine], want))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_attention_without_the_mask_takes_any_split_of_any_length(name):
    for C in (2, 3):
        assert max(run(C, unmasked_any_length, METHODS[name], 3 * C)) < 1e-14


def ring_events(C):
    """The order in which one ring forward + backward posts transfers, computes tiles and waits for arrivals."""
    events, originals = [], (cp._ring_pass, cp._arrived, cp.attend, cp.attend_backward)

    def logged(name, fn):
        def call(*args):
            events.append(name)
            return fn(*args)
        return call
    cp._ring_pass, cp._arrived, cp.attend, cp.attend_backward = (
        logged(name, fn) for name, fn in zip(("post", "arrive", "tile", "tile"), originals))
    try:
        q, k, v, dout = (sl.split_sequence(t) for t in whole_sequence(0, 1, 2, 4 * C, 3))
        out = cp.ring_attention(q.requires_grad_(), k, v)
        forward = list(events)
        out.backward(dout)
    finally:
        cp._ring_pass, cp._arrived, cp.attend, cp.attend_backward = originals
    return forward, events[len(forward):]


@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_ring_posts_the_next_block_before_computing_the_current_one(C):
    """Forward: each step posts the next K/V hop, computes its tile, then waits (C-1 times), then the last tile.
    Backward: the first K/V hop is posted up front; at each step the next hop leaves before the tile is computed,
    the accumulator from the left is waited for only after it, and this block's accumulator goes on; the
    own block comes last, and its accumulator (everyone else's share) is the last arrival."""
    backward = ["post"] if C > 1 else []
    for step in range(1, C):
        backward += ["arrive"] + ["post"] * (step < C - 1) + ["tile"] + ["arrive"] * (step > 1) + ["post"]
    backward += ["tile"] + ["arrive"] * (C > 1)
    for forward_events, backward_events in run(C, ring_events, C):
        assert forward_events == ["post", "tile", "arrive"] * (C - 1) + ["tile"]
        assert backward_events == backward


def torch_ring(causal, shape, seed):
    """torch's own ring-attention loop, the one context_parallel runs on CUDA (_templated_ring_attention and its
    backward), driven here with the CPU flash-attention kernel and fp64 accumulation, against ours."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
    aten = torch.ops.aten
    q, k, v, dout = (sl.split_sequence(t) for t in whole_sequence(seed, *shape))
    options = torch_cp._cp_options
    saved = options.convert_to_f32, options.enable_load_balance
    options.convert_to_f32, options.enable_load_balance = False, causal  # load balance: the head-tail layout
    try:
        out, lse = torch_cp._templated_ring_attention(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, is_causal=causal)
        grads = torch_cp._templated_ring_attention_backward(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=causal,
            dropout_p=0.0)[:3]
    finally:
        options.convert_to_f32, options.enable_load_balance = saved
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = cp.ring_attention(*leaves, causal=causal)
    ours.backward(dout)
    return max((a - b).abs().max().item() for a, b in zip([ours] + [t.grad for t in leaves], [out, *grads]))


def torch_context_parallel(causal, shape, seed):
    """The public context_parallel on CPU/gloo: (max |ours - torch| over out, dq, dk, dv) or torch's error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    whole = whole_sequence(seed, *shape)
    buffers = [t.clone() for t in whole]
    # torch's error is caught inside the context: in torch 2.11 an exception leaving it skips the restore of
    # F.scaled_dot_product_attention, and every later attention on this rank would go through DTensor
    with sdpa_kernel(SDPBackend.MATH), context_parallel(
            init_device_mesh(device().type, (dist.get_world_size(),)), buffers=buffers,
            buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        q, k, v = (t.detach().requires_grad_() for t in buffers[:3])
        try:
            with torch.enable_grad():  # context_parallel runs under no_grad
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                out.backward(buffers[3])
        except (NotImplementedError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
    leaves = [sl.split_sequence(t).requires_grad_() for t in whole[:3]]
    ours = cp.ring_attention(*leaves, causal=causal)
    ours.backward(sl.split_sequence(whole[3]))
    return max((a - b).abs().max().item() for a, b in zip([ours] + [t.grad for t in leaves],
                                                          [out.detach(), q.grad, k.grad, v.grad]))


@pytest.mark.skipif(BACKEND == "nccl", reason="pins torch 2.13's CPU paths of context_parallel (the CPU "
                    "flash-attention kernel, the CPU dispatch it lacks); on CUDA its ring runs the CUDA kernels, "
                    "which take no fp64, so equality there needs an fp16/bf16 bound of its own")
@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_equal_to_torch_context_parallel_where_it_runs_on_cpu_gloo(C):
    """torch.distributed.tensor.experimental.context_parallel on CPU/gloo, in torch 2.13:
    - its buffer sharding is our zigzag layout (tests/test_sequence_layout.py);
    - its ring (_templated_ring_attention, forward and backward) is dispatched only for the CUDA kernels
      (_scaled_dot_product_flash/efficient/cudnn_attention); on the CPU, F.scaled_dot_product_attention calls
      aten._scaled_dot_product_flash_attention_for_cpu, for which context_parallel has no handler and DTensor no
      sharding rule: NotImplementedError. Driven with that CPU kernel by hand, torch's ring loop runs, and
      equals ours, causal and not;
    - with the math backend, non-causal attention runs through DTensor's generic rules (all-gathers of K and V,
      no ring) and equals ours; causal fails: the math path adds a plain-tensor mask to DTensor scores."""
    shape = (2, 3, 4 * C, 5)
    for causal in (False, True):
        assert max(run(C, torch_ring, causal, shape, 7)) < 1e-13
    assert max(run(C, torch_context_parallel, False, shape, 7)) < 1e-13
    for message in run(C, torch_context_parallel, True, shape, 7):
        assert "mixed torch.Tensor and DTensor" in message, message
    for message in run(C, torch_context_parallel_default_kernel):
        assert "_scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy" in message


def torch_context_parallel_default_kernel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    buffers = whole_sequence(0, 1, 1, 4 * dist.get_world_size(), 2)[:3]
    with context_parallel(init_device_mesh(device().type, (dist.get_world_size(),)), buffers=buffers,
                          buffer_seq_dims=[2] * 3):
        try:  # caught inside the context, as above
            F.scaled_dot_product_attention(*buffers, is_causal=True)
        except NotImplementedError as e:
            return str(e)
    return "no error"


def causal_with_padding(S, pad):
    """Causal attention on a sequence padded at its end to a multiple of 2C: the real positions are exact."""
    C = dist.get_world_size()
    q, k, v, _ = whole_sequence(3, 1, 2, S, 4)
    padded = [F.pad(t, (0, 0, 0, pad)) for t in (q, k, v)]
    out = sl.gather_sequence(cp.ring_attention(*(sl.split_sequence(t) for t in padded), causal=True))
    return (out[:, :, :S] - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item(), C


@pytest.mark.parametrize("C,S", [(2, 7), (3, 10), (5, 11)])
def test_a_length_not_divisible_by_2C_is_refused_on_every_rank_and_padding_at_the_end_is_exact_for_causal(C, S):
    with pytest.raises(RankFailure) as failure:
        run(C, split_only, S)
    for rank in range(C):
        assert f"rank {rank} failed: ValueError: sequence length {S} is not a positive multiple of {2 * C}" \
               in str(failure.value)
    assert "Pad it at the end" in str(failure.value)
    pad = -S % (2 * C)
    assert max(error for error, _ in run(C, causal_with_padding, S, pad)) < 1e-14


def split_only(S):
    return sl.split_sequence(torch.zeros(1, 1, S, 1, device=device())).shape


def bad_input(attention, kind):
    """A mistake: rank 1 holds another sequence length than the others; heads that C does not divide (Ulysses);
    an odd local length, which cannot be a zigzag part (two equal chunks)."""
    C, r = dist.get_world_size(), dist.get_rank()
    S, H = {"length": (4 + 2 * (r == 1), C), "heads": (4, C + 1), "odd": (5, C), "none": (4, C)}[kind]
    q = torch.randn(2, H, S, 3, dtype=F64, device=device())
    return attention(q, q, q, causal=True).shape


def assert_same_clear_errors(attention, C, extra=None):
    """Every kind of mistake raises on every rank with the function's name and the message; the pool stays
    in step afterwards."""
    kinds = {"length": f"ranks disagree: rank 0 has [b, H, S/C, d] = [2, {C}, 4, 3], causal=True, zigzag; "
                       f"rank 1 has [2, {C}, 6, 3]",
             "odd": "local sequence length 5 cannot be the zigzag part of a sequence", **(extra or {})}
    for kind, message in kinds.items():
        with pytest.raises(RankFailure) as failure:
            run(C, bad_input, attention, kind)
        for rank in range(C):
            assert f"rank {rank} failed: ValueError: {attention.__name__}: " in str(failure.value), kind
        assert message in str(failure.value), kind
    assert run(C, bad_input, attention, "none") == [(2, C, 4, 3)] * C


@pytest.mark.parametrize("C", [2, 3, 5])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_bad_input_raises_the_same_clear_error_on_every_rank(name, C):
    assert_same_clear_errors(method(name), C)


def rotation_on_the_ranks(S):
    return cp.rotation(whole_sequence(4, 1, 2, S, 3))


@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_the_recorded_rotation_shows_rank_r_holding_block_r_minus_s_at_step_s(C):
    want = [[(r - s) % C for s in range(C)] for r in range(C)]
    for rank, held in enumerate(run(C, rotation_on_the_ranks, 2 * C)):
        assert held == want, f"rank {rank}'s picture: ranks held blocks {held} at steps 0..{C - 1}, want {want}"


def ring_attention_under_nccl_order(causal):
    q, k, v, dout = (sl.split_sequence(t) for t in whole_sequence(2, 1, 2, 4 * dist.get_world_size(), 3))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    return nccl_order.check(lambda: cp.ring_attention(*leaves, causal=causal).backward(dout))


@pytest.mark.parametrize("C", [2, 3, 4])
def test_ring_attention_forward_and_backward_complete_under_nccls_in_order_rule(C):
    """Recorded on gloo, replayed as NCCL runs it (mini_dist/nccl_order.py): every hop's send and receive
    are one batch, and the K/V and accumulator hops are posted in the same order on every rank."""
    for causal in (False, True):
        assert run(C, ring_attention_under_nccl_order, causal) == [[]] * C
