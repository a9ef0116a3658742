"""The cost model (mini_dist/cost_model.py): the papers' formulas, their invariants, and each checked against
what mini_dist's modules measure.

Everything here is integer arithmetic, so the assertions are exact (==); the bubble and Amdahl's law
are tested with mini_dist/step_time.py (tests/test_step_time.py). Cross-checks against measurements:
PyTorch's own optimizer state tensors (single process), the bytes activation_checkpoint.py's transformer
layer keeps for backward (with and without checkpointing), and the byte ledgers of ring_allreduce.py,
ddp.py, zero.py, fsdp.py, the tensor-parallel block (plain and recomputed) and pipeline_executor.py (multi-rank,
via the harness).
"""
import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grading import mistake
from harness import device, rank_generator, run
from mini_dist import cost_model
from mini_dist.cost_model import (GB, Model, Plan, activation_bytes, bytes_per_param, collective_bytes, dp_traffic,
                                  gpt_params, model_state_bytes, ring_all_reduce_bytes_exact, shard)

B = 10 ** 9
PRECISION = st.sampled_from(["fp32", "bf16", "fp16"])
OPTIMIZER = st.sampled_from(["sgd", "momentum", "adam"])


# ----- the learner's exercise (./run.sh check cost_model): bytes per parameter, per rank, per collective, exact

MISTAKES = {  # each is made by a wrong solution of tests/bank_cost_model.py (tests/test_exercise.py holds that)
    "bytes from the wrong dtype": ("bytes_per_param", "the weights and .grad are in the precision's dtype; the "
                                   "optimizer's state tensors in fp32, the master copy's dtype, or in the weights' "
                                   "dtype where it is wider (fp64)"),
    "master copy left out": ("bytes_per_param", "with 16-bit weights the optimizer steps an fp32 master copy of them: "
                             "its 4 bytes per parameter count as state"),
    "a master copy of fp32 weights": ("bytes_per_param", "weights already in fp32 (or wider) are stepped in place: "
                                      "a master copy exists only for 16-bit weights (PRECISIONS' third size)"),
    "sharded at the wrong stage": ("model_state_bytes", "ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, "
                                   "ZeRO-3 the weights too: each shard is shard(numel, k) elements, the rest whole"),
    "chunk not rounded up": ("collective_bytes", "the buffer is padded to k equal pieces of ceil(numel/k) elements, "
                             "shard(numel, k): a rank holds, and a ring step sends, a whole one"),
    "all-reduce counted once": ("collective_bytes", "a ring all-reduce is a reduce-scatter then an all-gather: k-1 "
                                "steps each, twice the bytes of either"),
    "k steps instead of k-1": ("collective_bytes", "each rank starts with its own chunk: a ring phase over k ranks "
                               "takes k-1 steps"),
}
PROBE = (10, 4)  # numel, k: k does not divide numel, and whole (10), ceil (3), floor (2) all differ


def also(said: str, found: str | None) -> str:
    """A failure's words, and the mistake behind it on a line of its own where one was recognised."""
    return f"{said}\n{found}" if found else said


def ints(values) -> bool:
    return isinstance(values, tuple) and all(type(v) is int for v in values)


def torch_holds(precision: str, optimizer: str) -> list[tuple[str, torch.dtype, int]]:
    """What torch holds per parameter after one step of a model of 1001 parameters: (what, dtype, bytes) of the
    weights, their .grad, the fp32 master copy the optimizer steps (16-bit weights), and each state tensor."""
    weight = torch.zeros(1001, dtype=cost_model.DTYPES[precision], requires_grad=True)  # cpu: one process
    weight.grad = torch.ones_like(weight)
    master = torch.nn.Parameter(weight.detach().float()) if weight.element_size() < 4 else weight
    master.grad = weight.grad.to(master.dtype)
    opt = torch.optim.Adam([master]) if optimizer == "adam" else torch.optim.SGD(
        [master], lr=0.1, momentum=0.9 if optimizer == "momentum" else 0.0)
    opt.step()
    held = [("weight", weight.dtype, weight.element_size()), (".grad", weight.grad.dtype, weight.element_size())]
    if master is not weight:
        held.append(("master copy", master.dtype, master.element_size()))
    held += [(name, t.dtype, t.element_size()) for s in opt.state.values() for name, t in s.items() if t.dim()]
    return held


def bytes_per_param_mistake() -> str | None:
    """The learner's bytes per parameter, read against torch's: state tensors in the weights' dtype (or fp32 for
    fp64 weights), weights counted at the master's size, or the master copy left out."""
    for precision, (weight, _, master) in cost_model.PRECISIONS.items():
        for optimizer, count in cost_model.OPTIMIZERS.items():
            right = (weight, weight, master + count * max(weight, 4))
            try:
                got = tuple(cost_model.bytes_per_param(precision, optimizer))
            except Exception:  # the failing property says what it raised
                return None
            said = f"bytes_per_param({precision!r}, {optimizer!r}) is {got}, torch holds {right}"
            if got == right or len(got) != 3:
                continue
            if master and got[:2] == (4, 4):
                return mistake(MISTAKES, "bytes from the wrong dtype", f"{said}: weights and .grad counted at the "
                               f"fp32 master's 4 bytes; the model's are {precision}, {weight} bytes")
            if count and got[2] != right[2] and got[2] == master + count * weight:
                tensors = "m and v" if optimizer == "adam" else "momentum buffer"
                return mistake(MISTAKES, "bytes from the wrong dtype", f"{said}: {optimizer}'s {tensors} counted at "
                               f"the weights' {weight} bytes; torch keeps the state in "
                               f"{'fp32' if weight < 4 else precision}, {max(weight, 4)} bytes a tensor")
            if count and weight > 4 and got[2] == master + count * 4:
                return mistake(MISTAKES, "bytes from the wrong dtype", f"{said}: {optimizer}'s state counted in "
                               f"fp32; for {precision} weights torch keeps it in {precision}, {weight} bytes each")
            if master and got[2] == count * max(weight, 4):
                return mistake(MISTAKES, "master copy left out", f"{said}: the state has no room for the fp32 "
                               f"master weights, 4 bytes a parameter")
            if not master and got[2] - right[2] in (4, weight):
                return mistake(MISTAKES, "a master copy of fp32 weights", f"{said}: {got[2] - right[2]} B more state "
                               f"than torch keeps, a master copy of weights that are {precision} already")
    return None


def int_note(got, want) -> str:
    """What to add when the values are right but not ints (a / where // was meant)."""
    return ": the right values, but as floats; the contract asks for ints (// divides to an int)" if got == want else ""


def elements(got: int, size: int) -> str:
    numel, k = PROBE
    count = {numel: "whole", -(-numel // k): "sharded", numel // k: "rounded down"}
    return count.get(got // size, "") if size and got % size == 0 else ""


def model_state_mistake() -> str | None:
    """The learner's model_state_bytes on N = 10 parameters over K = 4 ranks at every stage, read part by part:
    counted whole (10 elements), sharded (ceil(10/4) = 3) or rounded down (10 // 4 = 2)."""
    numel, k = PROBE
    try:
        sizes = cost_model.bytes_per_param("bf16", "adam")
        got = [cost_model.model_state_bytes(numel, k, zero, "bf16", "adam") for zero in range(4)]
    except Exception:
        return None
    parts = ("weights", "gradients", "optimizer state")
    sharded_from = (3, 2, 1)  # the first stage that shards each part
    for zero in range(4):
        for i, part in enumerate(parts):
            counted = elements(got[zero][i], sizes[i])
            said = (f"model_state_bytes({numel}, {k}, {zero}) counts the {part} as {got[zero][i]} B = "
                    f"{got[zero][i] // max(sizes[i], 1)} x {sizes[i]} B")
            stage = cost_model.STAGES[zero]
            if counted == "rounded down":
                return mistake(MISTAKES, "chunk not rounded up", f"{said}: {numel} // {k} elements; a rank's shard of "
                               f"{numel} over {k} is ceil({numel}/{k}) = {-(-numel // k)}", "model_state_bytes")
            if counted == "whole" and zero >= sharded_from[i]:
                return mistake(MISTAKES, "sharded at the wrong stage", f"{said}: all {numel} elements, but {stage} "
                               f"shards the {part}: {-(-numel // k)} elements a rank")
            if counted == "sharded" and zero < sharded_from[i]:
                return mistake(MISTAKES, "sharded at the wrong stage", f"{said}: a shard, but {stage} keeps every "
                               f"rank's {part} whole: all {numel} elements")
    return None


def collective_mistake() -> str | None:
    """The learner's collective_bytes for 10 elements of 2 bytes over 4 ranks, read against the ring's figures."""
    numel, k = PROBE
    chunk = -(-numel // k)
    try:
        got = {kind: cost_model.collective_bytes(kind, numel, k, 2) for kind in ("all_reduce", "reduce_scatter")}
    except Exception:
        return None
    said = f"collective_bytes('all_reduce', {numel}, {k}, 2) is {got['all_reduce']}"
    phase = (k - 1) * chunk * 2
    if got["all_reduce"] == phase and got["reduce_scatter"] == phase:
        return mistake(MISTAKES, "all-reduce counted once", f"{said}, the same as the reduce-scatter's: {k - 1} steps "
                       f"x {chunk} elements x 2 B, one phase; the all-reduce's all-gather sends as much again")
    for factor, kind in ((2, "all_reduce"), (1, "reduce_scatter")):
        shown = f"collective_bytes({kind!r}, {numel}, {k}, 2) is {got[kind]}"
        if got[kind] == factor * (k - 1) * (numel // k) * 2:
            return mistake(MISTAKES, "chunk not rounded up", f"{shown}: {k - 1} steps of {numel}/{k} elements "
                           f"rounded down, not of whole chunks of ceil({numel}/{k}) = {chunk}")
        if factor * (k - 1) * (numel // k) * 2 < got[kind] <= factor * (k - 1) * numel * 2 / k:
            return mistake(MISTAKES, "chunk not rounded up", f"{shown}: (k-1)/k of the {numel} elements x 2 B "
                           f"as they are, {factor * (k - 1) * numel * 2 / k:g} B at most; the ring sends whole chunks "
                           f"of the buffer padded to {k} x ceil({numel}/{k}) = {k * chunk} elements")
        if got[kind] == factor * k * chunk * 2:
            return mistake(MISTAKES, "k steps instead of k-1", f"{shown} = {factor} x {k} steps x {chunk} elements "
                           f"x 2 B: {k} steps where the ring takes {k - 1}")
    return None


@pytest.mark.exercise(judges=("bytes_per_param",))
@pytest.mark.single_process
def test_bytes_per_param_are_what_torch_holds_after_a_step_for_every_precision_and_optimizer():
    """bytes_per_param: (weight, gradient, state) bytes = what torch holds per parameter after a step, each precision
    and optimizer (exact)

    Measured with torch.optim (torch_holds): the weights and their .grad in the precision's dtype; the state, for
    16-bit weights the fp32 master copy the optimizer steps, and each state tensor the optimizer keeps."""
    for precision in cost_model.PRECISIONS:
        for optimizer in cost_model.OPTIMIZERS:
            held = torch_holds(precision, optimizer)
            want = (held[0][2], held[1][2], sum(b for _, _, b in held[2:]))
            got = cost_model.bytes_per_param(precision, optimizer)
            if got != want or not ints(got):
                state = " + ".join(f"{what} ({str(dtype)[6:]}, {b} B)" for what, dtype, b in held[2:]) or "nothing"
                assert False, also(f"bytes_per_param({precision!r}, {optimizer!r}) is {got!r}, want {want}"
                                   f"{int_note(got, want)}: per parameter torch holds the weight "
                                   f"({str(held[0][1])[6:]}, {held[0][2]} B), its .grad ({held[1][2]} B), and as "
                                   f"state {state}", bytes_per_param_mistake())


@pytest.mark.exercise(judges=("model_state_bytes",))
@pytest.mark.single_process
@given(numel=st.integers(1, 10 ** 12), k=st.integers(1, 4096), zero=st.integers(0, 3), precision=PRECISION,
       optimizer=OPTIMIZER)
def test_model_state_bytes_count_a_shard_of_what_the_stage_shards_and_the_rest_whole(numel, k, zero, precision,
                                                                                    optimizer):
    """model_state_bytes: bytes_per_param's sizes x ceil(numel/k) elements for what the stage shards (1: the state,
    2: + gradients, 3: + weights), x numel for the rest (exact)"""
    sizes = cost_model.bytes_per_param(precision, optimizer)
    per_rank = -(-numel // k)
    want = tuple(size * (per_rank if zero >= first else numel) for size, first in zip(sizes, (3, 2, 1)))
    got = cost_model.model_state_bytes(numel, k, zero, precision, optimizer)
    assert got == want and ints(got), also(f"model_state_bytes({numel}, {k}, {zero}, {precision!r}, {optimizer!r}) "
                                           f"is {got!r}, want {want}{int_note(got, want)}: bytes_per_param {sizes} "
                                           f"x (weights, gradients, "
                                           f"state) elements, ceil({numel}/{k}) = {per_rank} for what "
                                           f"{cost_model.STAGES[zero]} shards", model_state_mistake())


@pytest.mark.exercise(judges=("model_state_bytes",))
@pytest.mark.single_process
@given(per_rank=st.integers(1, 10 ** 10), k=st.integers(1, 1024))
def test_zero_stages_match_the_zero_paper_for_mixed_and_fp32_adam(per_rank, k):
    """model_state_bytes: the ZeRO paper's 16N, 4N + 12N/K, 2N + 14N/K, 16N/K per rank for mixed-precision Adam
    (fp32 Adam: 16N, 8N + 8N/K, 4N + 12N/K, 16N/K), exact where K divides N"""
    n = per_rank * k
    for precision, want in (("bf16", [16 * n, 4 * n + 12 * n // k, 2 * n + 14 * n // k, 16 * n // k]),
                            ("fp32", [16 * n, 8 * n + 8 * n // k, 4 * n + 12 * n // k, 16 * n // k])):
        for zero, bytes_ in enumerate(want):
            got = sum(cost_model.model_state_bytes(n, k, zero, precision, "adam"))
            assert got == bytes_, also(f"{precision} Adam, N = {n}, K = {k}, stage {zero}: {got} B per rank, want "
                                       f"{bytes_}", model_state_mistake() or bytes_per_param_mistake())


@pytest.mark.exercise(judges=("collective_bytes",))
@pytest.mark.single_process
@given(kind=st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]), numel=st.integers(0, 10 ** 6),
       k=st.integers(1, 64), elem=st.sampled_from([1, 2, 4, 8]))
def test_collective_bytes_are_k_minus_1_steps_of_a_whole_chunk_of_the_padded_buffer(kind, numel, k, elem):
    """collective_bytes: (k-1)/k x D, D the buffer padded to k chunks of ceil(numel/k) elements, twice for an
    all-reduce (exact, any numel)

    zero.py and fsdp.py pad their flat buffers the same way: tests below hold their ledgers to these bytes."""
    padded = k * -(-numel // k) * elem
    phases = 2 if kind == "all_reduce" else 1
    got = cost_model.collective_bytes(kind, numel, k, elem)
    want = phases * (k - 1) * padded // k
    assert type(got) is int and got == want, also(
        f"collective_bytes({kind!r}, {numel}, {k}, {elem}) is {got!r}, want {want} = {phases} x (k-1)/k x D, D = "
        f"{k} chunks of ceil({numel}/{k}) = {-(-numel // k)} elements x {elem} B{int_note(got, want)}",
        collective_mistake())


@pytest.mark.exercise(judges=("collective_bytes",))
@pytest.mark.single_process
@given(n=st.integers(1, 64), chunk=st.integers(0, 10 ** 6), elem=st.sampled_from([1, 2, 4, 8]))
def test_ring_all_reduce_sends_2_n_minus_1_over_n_times_d_per_rank(n, chunk, elem):
    """collective_bytes: a ring all-reduce sends 2(N-1)/N x D per rank, a reduce-scatter half that (exact)"""
    d = n * chunk * elem
    got = cost_model.collective_bytes("all_reduce", n * chunk, n, elem)
    assert got * n == 2 * (n - 1) * d, also(f"all_reduce of D = {d} B over {n} ranks: {got} B per rank, want "
                                            f"2(N-1)/N D", collective_mistake())
    half = cost_model.collective_bytes("reduce_scatter", n * chunk, n, elem)
    assert 2 * half == got, also(f"reduce_scatter of D = {d} B over {n} ranks: {half} B, want half the all-reduce's "
                                 f"{got}", collective_mistake())


# ----------------------------------------------------------------------------- figures often quoted


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_mixed_precision_saves_no_state_memory_because_the_fp32_master_copy_eats_it(optimizer):
    """Half weights and grads save 2 + 2 bytes; the fp32 master weights cost 4. Activations and traffic
    halve, the states do not: why the planner never offers mixed precision as a state-memory fix."""
    assert sum(bytes_per_param("bf16", optimizer)) == sum(bytes_per_param("fp32", optimizer))


def test_3b_adam_mixed_precision_needs_48_gb():
    assert sum(model_state_bytes(3 * B, 1, 0)) == 48 * B


@pytest.mark.single_process
@given(numel=st.integers(1, 10 ** 12), k=st.integers(1, 1024), m=st.integers(1, 64), precision=PRECISION)
def test_zero2_sends_the_same_bytes_as_ddp_not_fewer(numel, k, m, precision):
    """A correction: 'ZeRO-2 communicates less than DDP' holds for the reduce-scatter alone. ZeRO-2
    then all-gathers the updated weights, and the two together are an all-reduce's bytes: equal
    traffic at one microbatch; with accumulation it reduce-scatters every microbatch and sends more."""
    numel = shard(numel, k) * k  # whole chunks, so the ring's 2(K-1)/K is exact
    ddp = sum(dp_traffic(numel, Plan(dp=k, zero=0, microbatches=m, precision=precision)).values())
    zero2 = sum(dp_traffic(numel, Plan(dp=k, zero=2, microbatches=m, precision=precision)).values())
    assert zero2 == ddp if m == 1 or k == 1 else zero2 > ddp
    fsdp = sum(dp_traffic(numel, Plan(dp=k, zero=3, precision=precision)).values())
    assert 2 * fsdp == 3 * ddp  # FSDP gathers twice and reduce-scatters once: ~3N vs DDP's ~2N


# ----------------------------------------------------------------------------- the papers' formulas


def test_zero_paper_figure_1_for_7_5b_parameters_on_64_gpus():
    """Rajbhandari et al. Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    got = [round(sum(model_state_bytes(7_500_000_000, 64, z)) / GB, 1) for z in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


@given(s=st.integers(1, 4096), b=st.integers(1, 16), head_dim=st.integers(1, 256),
       heads=st.sampled_from([1, 2, 4, 8, 16]), t=st.sampled_from([1, 2, 4, 8]))
@pytest.mark.single_process
def test_activations_match_korthikanti_per_layer_formula(s, b, head_dim, heads, t):
    """Per layer, fp16/bf16: sbh(34 + 5as/h) without TP; sbh(10 + 24/t + 5as/(ht)) with TP degree t."""
    assume(heads % t == 0)
    h = heads * head_dim
    full, kept = activation_bytes(Model(1, 1, h, heads, s), Plan(dp=1, tp=t, micro_batch=b))
    assert full * h * t == s * b * h * (10 * h * t + 24 * h + 5 * heads * s)
    assert kept == 2 * s * b * h + full  # layer input kept, plus the one layer being recomputed


def test_gpt_params_counts_gpt2_small_exactly():
    assert gpt_params(12, 768, 50257, 1024) == 124_439_808  # GPT-2 small; nanoGPT: 123.65M without wpe


def gpt2_block(h: int) -> list:
    """A GPT-2 block's layers: layer norm, q/k/v, the attention's output, layer norm, MLP up and down."""
    return [torch.nn.LayerNorm(h), torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h),
            torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)]


@pytest.mark.single_process
@settings(max_examples=10)
@given(layers=st.integers(1, 3), hidden=st.integers(1, 24), vocab=st.integers(1, 50), seq=st.integers(1, 20))
def test_gpt_params_equals_the_parameter_count_of_a_torch_gpt(layers, hidden, vocab, seq):
    h = hidden
    with torch.device("meta"):  # shapes only, nothing allocated or initialised
        gpt = torch.nn.ModuleList([torch.nn.Embedding(vocab, h), torch.nn.Embedding(seq, h),
                                   *[m for _ in range(layers) for m in gpt2_block(h)], torch.nn.LayerNorm(h)])
    assert sum(p.numel() for p in gpt.parameters()) == gpt_params(layers, hidden, vocab, seq)


@pytest.mark.parametrize("optimizer,momentum", [("adam", None), ("momentum", 0.9), ("sgd", 0.0)])
def test_fp32_state_bytes_equal_pytorchs_live_tensors_after_a_step(optimizer, momentum):
    """DDP-style full replica: weights, .grad and the optimizer's state tensors, measured. Adam also
    keeps one `step` counter per parameter tensor (a 4-byte fp32 scalar) that per-parameter formulas
    leave out; the test adds it, so the rest must match exactly."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    opt = (torch.optim.Adam(model.parameters()) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum))
    model(torch.randn(2, 7)).sum().backward()  # cpu: one process, no ranks: torch.optim's own state tensors
    opt.step()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    steps = 4 * len(params) if optimizer == "adam" else 0
    assert (nbytes(params), nbytes(p.grad for p in params), nbytes(state) - steps) == \
        model_state_bytes(numel, 1, 0, "fp32", optimizer)


def nbytes(tensors) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- invariants


@pytest.mark.single_process
@given(numel=st.integers(1, 10 ** 12), k=st.integers(1, 4096), precision=PRECISION, optimizer=OPTIMIZER)
def test_state_memory_never_grows_with_more_ranks_and_zero_stages_are_ordered(numel, k, precision, optimizer):
    totals = [sum(model_state_bytes(numel, k, z, precision, optimizer)) for z in range(4)]
    more = [sum(model_state_bytes(numel, k + 1, z, precision, optimizer)) for z in range(4)]
    assert totals == sorted(totals, reverse=True)  # DDP >= ZeRO-1 >= ZeRO-2 >= FSDP
    assert all(m <= t for m, t in zip(more, totals))
    one = [sum(model_state_bytes(numel, 1, z, precision, optimizer)) for z in range(4)]
    assert len(set(one)) == 1  # on one rank there is nothing to shard


@given(layers=st.integers(1, 16), s=st.integers(1, 512), b=st.integers(1, 8),
       heads=st.sampled_from([1, 2, 4, 8]), m=st.integers(1, 16), pp=st.sampled_from([1, 2, 4]),
       precision=PRECISION)
@pytest.mark.single_process
def test_checkpointing_saves_activation_memory_once_a_stage_has_two_layers(layers, s, b, heads, m, pp,
                                                                           precision):
    assume(layers % pp == 0)
    full, ckpt = activation_bytes(Model(1, layers, 8 * heads, heads, s),
                                  Plan(dp=1, pp=pp, micro_batch=b, microbatches=m, precision=precision))
    stored = layers // pp * min(m, pp)
    assert ckpt <= full if stored >= 2 else ckpt > full  # one layer: its input is kept on top of it
    bigger = activation_bytes(Model(1, layers, 8 * heads, heads, s),
                              Plan(dp=1, pp=pp, micro_batch=b + 1, microbatches=m, precision=precision))
    assert bigger[0] > full and bigger[1] > ckpt  # gradient accumulation shrinks the microbatch: less memory


@pytest.mark.single_process
@given(chunks=st.lists(st.integers(0, 1000), min_size=1, max_size=8), elem=st.sampled_from([1, 2, 4, 8]))
def test_ring_exact_bytes_sum_to_2_n_minus_1_times_d_over_all_ranks_for_any_chunking(chunks, elem):
    n, d = len(chunks), sum(chunks) * elem
    sent = [ring_all_reduce_bytes_exact(chunks, r, elem) for r in range(n)]
    assert sum(sent) == 2 * (n - 1) * d
    if len(set(chunks)) == 1:
        assert sent == [collective_bytes("all_reduce", sum(chunks), n, elem)] * n


# ----------------------------------------------------------------------------- measured ledgers


def ring_ledgers(numel, dtype, seed):
    """On every rank: bytes the ring collectives sent and received, and the all-reduce's chunk sizes."""
    from mini_dist.ring_allreduce import (LEDGER, chunk_bounds, ring_all_gather, ring_all_reduce,
                                          ring_reduce_scatter)
    n = dist.get_world_size()
    x = torch.randn(numel, generator=rank_generator(seed), dtype=torch.float64).to(dtype).to(device())
    LEDGER.reset()
    ring_all_reduce(x)
    all_reduce = (LEDGER.sent, LEDGER.received)
    LEDGER.reset()
    ring_reduce_scatter(torch.empty(numel, dtype=dtype, device=device()), x.repeat(n))
    reduce_scatter = LEDGER.sent
    LEDGER.reset()
    ring_all_gather(torch.empty(n * numel, dtype=dtype, device=device()), x)
    chunks = [b - a for a, b in chunk_bounds(numel, n, x.element_size())]
    return all_reduce, reduce_scatter, LEDGER.sent, chunks


@settings(max_examples=20)
@given(world=st.sampled_from([1, 2, 3, 4, 5]), numel=st.integers(0, 3000),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]), seed=st.integers(0, 99))
def test_ring_bytes_per_rank_equal_the_ledger_of_ring_allreduce(world, numel, dtype, seed):
    """Exact: per rank, including uneven and empty chunks; received by r = sent by r+1 (its right)."""
    results = run(world, ring_ledgers, numel, dtype, seed)
    elem = torch.tensor([], dtype=dtype).element_size()  # cpu: a dtype's size only
    for rank, ((sent, received), rs, ag, chunks) in enumerate(results):
        assert sent == ring_all_reduce_bytes_exact(chunks, rank, elem)
        assert received == results[(rank + 1) % world][0][0]
        assert rs == ag == collective_bytes("reduce_scatter", world * numel, world, elem)
    assert sum(r[0][0] for r in results) == 2 * (world - 1) * numel * elem


def linear_stack(widths):
    """The same small model on every rank (seeded): Linear layers of the given widths."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def zero_ledgers(stage, sizes, dtype):
    """One ZeroOptimizer step with ring collectives: bytes sent, and the memory ledger after it."""
    from mini_dist.ring_allreduce import LEDGER
    from mini_dist.zero_optimizer import ZeroOptimizer
    from mini_dist.zero_ledger import memory_ledger
    model = linear_stack(sizes).to(dtype)
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, collectives="ring")
    model(torch.randn(3, sizes[0], generator=rank_generator(stage)).to(dtype)).float().sum().backward()
    LEDGER.reset()
    opt.step()
    mem = memory_ledger(model.parameters(), opt)
    return LEDGER.sent, (mem["params"], mem["grads"], mem["state"]), opt.partition.numel


@settings(max_examples=15)
@given(world=st.sampled_from([1, 2, 3, 4, 5]), stage=st.sampled_from([0, 1, 2]),
       sizes=st.lists(st.integers(1, 9), min_size=2, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_zero_bytes_and_state_per_rank_equal_the_ledgers_of_zero_py(world, stage, sizes, dtype):
    """Exact, including parameter counts that K does not divide. zero.py keeps the weights (and full
    gradients) in one flat buffer padded to K equal shards, so the memory check uses the padded count;
    the traffic functions pad by themselves."""
    precision = "fp32" if dtype == torch.float32 else "bf16"  # bf16: fp32 master weights in the state
    for sent, states, numel in run(world, zero_ledgers, stage, sizes, dtype):
        plan = Plan(dp=world, zero=stage, precision=precision)
        assert sent == sum(dp_traffic(numel, plan).values())
        assert states == model_state_bytes(shard(numel, world) * world, world, stage, precision, "adam")


# ----------------------------------------------------------------------------- the other modules' ledgers


def ddp_ring_ledger(widths):
    """One mini-DDP step with the ring collective and one bucket: the bytes this rank sent."""
    from mini_dist.ddp import DistributedDataParallel
    from mini_dist.ring_allreduce import LEDGER, ring_all_reduce
    model = linear_stack(widths).to(device())
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024, all_reduce=ring_all_reduce)
    LEDGER.reset()
    ddp(torch.randn(2, widths[0], generator=rank_generator(1)).to(device())).sum().backward()
    return LEDGER.sent, sum(p.numel() for p in model.parameters())


@settings(max_examples=10)
@given(world=st.sampled_from([1, 2, 3, 4, 5]), widths=st.lists(st.integers(1, 12), min_size=2, max_size=4))
def test_ddp_bytes_per_step_equal_the_ring_ledger_of_ddp_py(world, widths):
    """Per rank exact with the ring's own (possibly uneven) chunks; over the group the planner's padded
    figure, which is exact whenever K divides the gradient count."""
    from mini_dist.ring_allreduce import chunk_bounds
    results = run(world, ddp_ring_ledger, widths)
    numel = results[0][1]
    chunks = [b - a for a, b in chunk_bounds(numel, world, 4)]
    for rank, (sent, _) in enumerate(results):
        assert sent == ring_all_reduce_bytes_exact(chunks, rank, 4)
    total = sum(sent for sent, _ in results)
    assert total == 2 * (world - 1) * numel * 4
    planned = dp_traffic(numel, Plan(dp=world, zero=0, precision="fp32"))["all_reduce"]
    assert total <= world * planned and (numel % world or total == world * planned)


def fsdp_ledger(widths):
    """One FSDP step, the whole model one unit: bytes sent by its all-gathers and reduce-scatter."""
    from mini_dist.fsdp import BOOKED, FullyShardedDataParallel
    from mini_dist.kit import measure
    model = linear_stack(widths).to(device())
    numel = sum(p.numel() for p in model.parameters())
    fsdp = FullyShardedDataParallel(model, wrap=[])  # no children as units: the root is the one unit
    x = torch.randn(2, widths[0], generator=rank_generator(2)).to(device())
    return measure.step_sent(lambda: fsdp(x).sum().backward(), fsdp.ledger, BOOKED, dist.get_world_size()), numel


@settings(max_examples=10)
@given(world=st.sampled_from([1, 2, 3, 4, 5]), widths=st.lists(st.integers(1, 12), min_size=2, max_size=4))
def test_fsdp_bytes_per_step_equal_the_ledger_of_fsdp_py(world, widths):
    """Gather for forward, gather again for backward, reduce-scatter: 3(K-1) shards, padding included."""
    for sent, numel in run(world, fsdp_ledger, widths):
        assert sent == sum(dp_traffic(numel, Plan(dp=world, zero=3, precision="fp32")).values())


def tp_counter(b, s, h, heads, ranks, recompute):
    """One tensor-parallel block forward and backward on a TP group, checkpointed (its forward recomputed
    in backward) or not: the collectives it counted."""
    from mini_dist.activation_checkpoint import checkpoint
    from mini_dist.comm import COUNTER
    from mini_dist.parallel_transformer import ParallelTransformerBlock
    from harness import subgroup
    group = subgroup(ranks)
    if dist.get_rank() not in ranks:
        return None
    block = ParallelTransformerBlock(h, heads, group=group, device=device(), dtype=torch.float32)
    x = torch.randn(b, s, h, generator=rank_generator(3)).to(device()).requires_grad_()
    COUNTER.reset()
    (checkpoint(block, x) if recompute else block(x)).sum().backward()
    return dict(COUNTER.calls), dict(COUNTER.bytes)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_tensor_parallel_bytes_per_layer_equal_the_counter_of_the_parallel_block(tp, recompute):
    """Megatron: 2 all-reduces of b*s*h forward and 2 backward per layer; a checkpointed layer runs its
    forward again in backward, 2 more: the planner's ring bytes are those of 4 (6) such all-reduces."""
    b, s, h, heads, n = 2, 5, 12, 12, 6 if recompute else 4
    model, plan = Model(0, layers=1, hidden=h, heads=heads, seq=s), Plan(dp=1, tp=tp, micro_batch=b,
                                                                        precision="fp32", checkpoint=recompute)
    for result in run(4, tp_counter, b, s, h, heads, list(range(tp)), recompute):
        if result is None:
            continue
        calls, payload = result
        if tp == 1:  # a group of one communicates nothing
            assert calls.get("all_reduce", 0) == 0 and cost_model.tp_traffic(model, plan) == 0
            continue
        assert calls == {"all_reduce": n} and payload == {"all_reduce": n * b * s * h * 4}
        assert n * collective_bytes("all_reduce", b * s * h, tp, 4) == cost_model.tp_traffic(model, plan)


def pp_bytes(P, M, batch, h, name):
    """One pipeline step over P stages of Linear(h, h): the bytes this stage sent."""
    from mini_dist.pipeline_executor import pipeline_step
    from mini_dist.pipeline_messages import HEADER_LEN
    from mini_dist.pipeline_schedules import SCHEDULES
    from mini_dist.pipeline_stages import pipeline_chunks
    from harness import subgroup
    group = subgroup(range(P))
    if dist.get_rank() >= P:
        return None
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(P)]).to(device())
    stage = pipeline_chunks(model, group=group)
    x = torch.randn(batch, h).to(device())
    _, stats = pipeline_step(stage, SCHEDULES[name](P, M), inputs=x, targets=x,
                             loss_fn=torch.nn.functional.mse_loss, group=group)
    return stats.bytes_sent, HEADER_LEN * 8


@settings(max_examples=10)
@given(P=st.integers(1, 4), M=st.sampled_from([1, 2, 4]), h=st.integers(1, 9),
       name=st.sampled_from(["gpipe", "1f1b"]))
def test_pipeline_bytes_per_stage_equal_the_stats_of_pipeline_py(P, M, h, name):
    """Each stage sends M activations forward (not the last) and M gradients back (not the first);
    the executor adds one shape header ahead of its first activation."""
    batch = 2 * M
    model, plan = Model(0, layers=P, hidden=h, seq=1), Plan(dp=1, pp=P, micro_batch=batch // M,
                                                            microbatches=M, precision="fp32")
    for stage, result in enumerate(run(4, pp_bytes, P, M, batch, h, name)[:P]):
        sent, header = result
        assert sent == cost_model.pp_traffic(model, plan, stage) + header * (stage < P - 1)


def kept_for_backward(layers, b, s, heads, head_dim, precision, seed):
    """L of activation_checkpoint's transformer layers (which save exactly Korthikanti's tensors), plain
    and each layer checkpointed: bytes kept after forward, and the peak alive during backward."""
    from mini_dist.activation_checkpoint import checkpoint, run_layers
    from mini_dist.kit.activations import TransformerLayer
    from mini_dist.kit.measure import profile_step
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[TransformerLayer(heads * head_dim, heads, 0.1, dtype=dtype)
                                  for _ in range(layers)]).to(device())
    x = torch.randn(b, s, heads * head_dim, dtype=dtype, device=device())
    steps = [profile_step(forward, lambda out: out.sum().backward(), exclude=model.parameters())
             for forward in (lambda: model(x), lambda: run_layers([functools.partial(checkpoint, layer)
                                                                   for layer in model], x))]
    # the layer norm's mean and 1/std, in the dtype this device keeps them in (CPU: x's; CUDA: fp32 for bf16)
    stat = torch.native_layer_norm(x, (x.shape[-1],), None, None, 1e-5)[1].element_size()
    return steps[0]["saved"], steps[1]["saved"], max(steps[1]["backward"]), 2 * 2 * s * b * stat


@settings(max_examples=15)
@given(layers=st.integers(1, 3), b=st.integers(1, 2), s=st.integers(1, 8), heads=st.integers(1, 3),
       head_dim=st.integers(1, 4), precision=st.sampled_from(["fp32", "bf16"]), seed=st.integers(0, 99))
@pytest.mark.single_process
def test_activation_bytes_equal_what_a_transformer_layer_keeps_with_and_without_checkpointing(
        layers, b, s, heads, head_dim, precision, seed):
    """Exact, from the measured bytes saved for backward (measure.SavedTensors): without checkpointing
    L * Korthikanti's per-layer count, plus the layer norms' statistics (2 norms x mean and 1/std per token,
    which the paper leaves out); with every layer checkpointed, the L layer inputs, e*sbh each. The
    planner adds one layer for the recomputation in backward: the peak of activation bytes alive then
    (measure.LiveActivations) reaches that, and exceeds it by at most the op in flight, whose output is no
    larger than the largest tensor a layer makes (fc1's 4sbh or the attention scores' as^2b, e bytes each),
    plus the loss and its gradient seed (e bytes each)."""
    h = heads * head_dim
    plain, inputs, peak, stats = kept_for_backward(layers, b, s, heads, head_dim, precision, seed)
    full, kept = activation_bytes(Model(1, layers, h, heads, s), Plan(dp=1, micro_batch=b, precision=precision))
    e = cost_model.PRECISIONS[precision][0]
    assert plain == full + layers * stats
    assert inputs == layers * e * s * b * h == kept - full // layers
    assert 0 <= peak - kept - stats <= max(4 * s * b * h, heads * s * s * b) * e + 2 * e


@pytest.mark.parametrize("precision", list(cost_model.PRECISIONS))
@pytest.mark.parametrize("optimizer", list(cost_model.OPTIMIZERS))
def test_model_state_bytes_equal_what_torch_optim_holds_after_a_step(precision, optimizer):
    numel = 1001  # odd: no size divides it
    assert cost_model.measured_model_state_bytes(numel, precision, optimizer) == \
        cost_model.model_state_bytes(numel, 1, 0, precision, optimizer)

