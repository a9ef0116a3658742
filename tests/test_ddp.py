"""mini DDP against native DistributedDataParallel and against one process on the full batch, for drawn
adversarial models; plus silent no_sync, unused parameters, subgroups and communication hooks. (Bucket
membership and launches during backward: tests/test_reducer.py.)"""
import contextlib
import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist import ddp
from mini_dist.buckets import Timeline
from mini_dist.kit import models
from mini_dist.kit.wire import LEDGER
from mini_dist.ring_pipelined import ring_all_reduce

F64 = torch.float64
# fp64 throughout. Mini and native DDP (ranks >= 3), or one process on the full batch, add the same
# terms in another order: native's buckets differ from ours, so gloo's chunks (and per-element sum
# orders) do; one process sums all N*K*B <= 80 samples in one matmul. Each gradient element then moves
# by a few ulps of its largest term, ~1e-15 relative. SGD passes that on unchanged; Adam divides by
# sqrt(v), which magnifies it only where a gradient cancels to < ~1e-7 of its terms (a ~1e-7 chance per
# element, on ~100 elements). After 3 steps parameters agree to ~1e-15 relative; 1e-12 leaves 1000x
# margin, while a real bug (no 1/N, a stale bucket, a lost micro-step, zeros for None) moves them >= 1e-4.
RTOL = 1e-12


class Net(nn.Module):
    """The adversaries: any depth and widths, biases or not, a frozen weight, one weight tied between two
    layers, a branch no forward uses, a branch only some ranks use."""

    def __init__(self, widths, bias=True, frozen=False, tied=False, unused=False, used_by=None):
        super().__init__()

        def linear(a, b):
            """A layer of the net, fp64, on the rank's device."""
            return nn.Linear(a, b, bias=bias, dtype=F64, device=device())
        self.layers = nn.ModuleList(linear(a, b) for a, b in zip(widths, widths[1:]))
        w = widths[-1]
        self.tied = tied
        self.used_by = used_by
        if tied:
            self.tied_in = linear(w, w)
            self.tied_out = linear(w, w)
            self.tied_out.weight = self.tied_in.weight
        if unused:
            self.unused = linear(w, 2)
        if used_by is not None:
            self.sometimes = linear(w, w)
        if frozen:
            self.layers[0].weight.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.tied:
            x = self.tied_out(torch.tanh(self.tied_in(x)))
        if self.used_by is not None and dist.get_rank() in self.used_by:
            x = x + self.sometimes(x)
        return x


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-300)).item()
               for p, q in zip(a.parameters(), b.parameters()))


def where(a: nn.Module, b: nn.Module) -> str:
    """The parameter element where two models differ most, for a one-line failure message."""
    name, p, q = max(((n, p, q) for (n, p), q in zip(a.named_parameters(), b.parameters())),
                     key=lambda t: (t[1] - t[2]).abs().max().item())
    i = int((p - q).abs().argmax())
    return f"{name}, element {i} ({p.flatten()[i].item():.17g} vs {q.flatten()[i].item():.17g})"


def trainable_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def make_optimizer(name, model):
    # weight decay moves a parameter with a zero gradient, not one with none: tells the two apart
    return (torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1) if name == "adam" else
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1))


def draw_batches(g, widths, batch, accumulation):
    return [(torch.randn(batch, widths[0], generator=g, dtype=F64).to(device()),
             torch.randn(batch, widths[-1], generator=g, dtype=F64).to(device()))
            for _ in range(accumulation)]


def full_batch(micro_batches):
    """Every rank's micro-batches, concatenated: what one process would train on."""
    mine = [torch.cat(t) for t in zip(*micro_batches)]
    everyone = [[torch.empty_like(t) for _ in range(dist.get_world_size())] for t in mine]
    for out, t in zip(everyone, mine):
        dist.all_gather(out, t)
    return [torch.cat(out) for out in everyone]


def train_four_ways(spec, seed, steps=3):
    """Per step: (mini vs native DDP, mini on the ring vs mini on dist.all_reduce, mini vs one process
    on the full batch), max relative parameter differences; plus each mini's bucket count."""
    torch.manual_seed(seed + dist.get_rank())  # a different init on every rank: the broadcast must fix it
    model = Net(spec["widths"], spec["bias"], spec["frozen"], spec["tied"], spec["unused"])
    native_model, single, ring_model = (copy.deepcopy(model) for _ in range(3))
    cap = {"one bucket": trainable_bytes(model), "several": trainable_bytes(model) // 3,
           "one param each": 1}[spec["cap"]] / 2 ** 20
    kwargs = dict(bucket_cap_mb=cap, gradient_as_bucket_view=spec["as_view"],
                  find_unused_parameters=spec["unused"])
    minis = [ddp.DistributedDataParallel(model, **kwargs),
             ddp.DistributedDataParallel(ring_model, all_reduce=ring_all_reduce, **kwargs)]
    native = NativeDDP(native_model, find_unused_parameters=spec["unused"])
    single.load_state_dict(native.module.state_dict())  # rank 0's init, as the DDPs start from
    replicas = minis + [native]
    optimizers = [make_optimizer(spec["optimizer"], m) for m in replicas + [single]]
    g = rank_generator(seed)
    diffs = []
    for _ in range(steps):
        micro = draw_batches(g, spec["widths"], spec["batch"], spec["accumulation"])
        for replica, optimizer in zip(replicas, optimizers):
            models.accumulation_step(replica, optimizer, micro)
        x, y = full_batch(micro)
        nn.functional.mse_loss(single(x), y).backward()
        optimizers[-1].step()
        optimizers[-1].zero_grad()
        diffs.append((max_rel_diff(minis[0].module, native.module),
                      max_rel_diff(minis[1].module, minis[0].module),
                      max_rel_diff(minis[0].module, single)))
    return (diffs, [len(m.buckets) for m in minis], sum(p.requires_grad for p in model.parameters()),
            where(minis[0].module, native.module))


specs = st.fixed_dictionaries(dict(
    widths=st.lists(st.integers(1, 6), min_size=3, max_size=5), bias=st.booleans(),
    frozen=st.booleans(), tied=st.booleans(), unused=st.booleans(),
    cap=st.sampled_from(["one bucket", "several", "one param each"]), as_view=st.booleans(),
    accumulation=st.integers(1, 4), batch=st.integers(1, 4), optimizer=st.sampled_from(["sgd", "adam"])))


@pytest.mark.exercise
@given(world=st.integers(1, 5), spec=specs, seed=st.integers(0, 10 ** 6))
def test_mini_ddp_trains_like_native_ddp_and_like_one_process_on_the_full_batch(world, spec, seed):
    """mini DDP trains like native DDP and like one process on the full batch (fp64, 1e-12 relative)

    Three steps of SGD or Adam, with gradient accumulation under no_sync, on a drawn model: the parameters
    within 1e-12 (relative) of native DDP's and of one process's (other sum orders); on <= 2 ranks, and on the
    ring against dist.all_reduce, bit for bit (x/N and one add, commutative; the ring sums in gloo's order)."""
    for rank, (diffs, n_buckets, n_trainable, at) in enumerate(run(world, train_four_ways, spec, seed)):
        for step, (to_native, ring_to_native_collective, to_single) in enumerate(diffs):
            # ranks <= 2: x/N then one add, commutative, so bit for bit; beyond: another sum order
            assert to_native == 0.0 if world <= 2 else to_native <= RTOL, \
                f"rank {rank}, step {step}: mini DDP {to_native:.1e} (relative) from native DDP; last step at {at}"
            # same buckets, and the ring sums every chunk in gloo's order: bit for bit at any N
            assert ring_to_native_collective == 0.0, f"rank {rank}, step {step}: mini DDP on the ring " \
                f"{ring_to_native_collective:.1e} (relative) from mini DDP on dist.all_reduce, want the same bits"
            # one process sums the whole batch in one matmul: same terms, other grouping
            assert to_single <= RTOL, f"rank {rank}, step {step}: mini DDP {to_single:.1e} (relative) from one " \
                f"process on the full batch, want <= {RTOL:g}"
        expected = {"one bucket": 1, "one param each": n_trainable}.get(spec["cap"])
        assert expected is None or n_buckets == [expected, expected], f"rank {rank}: {n_buckets} buckets, want " \
            f"{expected} for bucket cap {spec['cap']!r}"


def bytes_per_micro_step(accumulation, seed):
    torch.manual_seed(seed)
    model = Net([5, 7, 3])
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4, all_reduce=ring_all_reduce)
    sent, launched, grads = [], [], []
    for k, (x, y) in enumerate(draw_batches(rank_generator(seed), [5, 7, 3], 2, accumulation)):
        LEDGER.reset()
        mini.reducer.timeline = Timeline()
        with mini.no_sync() if k < accumulation - 1 else contextlib.nullcontext():
            nn.functional.mse_loss(mini(x), y).backward()
        sent.append(LEDGER.sent)
        launched.append(len(mini.timeline.start))
        grads.append(model.layers[0].weight.grad.clone())
    return sent, launched, grads, trainable_bytes(model), mini.timeline.bytes, len(mini.buckets)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_no_sync_sends_nothing_until_the_last_micro_step_which_sends_2_n_minus_1_over_n_d(world):
    results = run(world, bytes_per_micro_step, 4, seed=7)
    for sent, launched, grads, D, handed, n_buckets in results:
        assert sent[:-1] == [0, 0, 0] and launched == [0, 0, 0, n_buckets]
        assert handed == D  # every gradient byte goes to the all-reduce exactly once
    # per rank the ring sends 2(N-1)/N*D up to uneven chunks; summed over ranks, exactly 2(N-1)*D
    assert sum(r[0][-1] for r in results) == 2 * (world - 1) * results[0][3]
    if world > 1:  # micro-steps under no_sync keep local sums; the last one leaves every rank the same
        assert not torch.equal(results[0][2][-2], results[1][2][-2])
        assert all(torch.equal(r[2][-1], results[0][2][-1]) for r in results)


def booked_on_torchs_all_reduce(seed):
    torch.manual_seed(seed)
    model = Net([5, 7, 3])
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4)  # dist.all_reduce, a bucket per few params
    x, y = draw_batches(rank_generator(seed), [5, 7, 3], 2, 1)[0]
    LEDGER.reset()
    nn.functional.mse_loss(mini(x), y).backward()
    bucketed = (LEDGER.calls["all_reduce"], LEDGER.bytes["all_reduce"])
    naive = ddp.NaiveDataParallel(Net([5, 7, 3]))
    LEDGER.reset()
    nn.functional.mse_loss(naive(x), y).backward()
    naive.sync_gradients()
    by_hand = (LEDGER.calls["all_reduce"], LEDGER.bytes["all_reduce"])
    n_trainable = sum(p.requires_grad for p in model.parameters())
    return bucketed, by_hand, len(mini.buckets), n_trainable, trainable_bytes(model)


@pytest.mark.parametrize("world", [1, 3])
def test_on_torchs_all_reduce_each_bucket_is_booked_once_in_the_wires_ledger_with_its_payload(world):
    for rank, (bucketed, by_hand, n_buckets, n_trainable, D) in enumerate(run(world, booked_on_torchs_all_reduce, 3)):
        assert bucketed == (n_buckets, D), f"rank {rank}: the wire's LEDGER booked (all-reduces, bytes) " \
            f"{bucketed} for mini DDP, want one a bucket ({n_buckets}) and the gradients' {D} B"
        assert by_hand == (n_trainable, D), f"rank {rank}: the wire's LEDGER booked (all-reduces, bytes) " \
            f"{by_hand} for the naive DDP, want one a gradient ({n_trainable}) and {D} B"


def backward_with_a_branch(used_by, find_unused, optimizer, seed):
    """A branch only the ranks in used_by run; returns mini's and native's parameters after 2 steps."""
    torch.manual_seed(seed + dist.get_rank())
    model = Net([4, 3, 3], used_by=used_by)
    native = NativeDDP(copy.deepcopy(model), find_unused_parameters=find_unused)
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4, find_unused_parameters=find_unused)
    optimizers = [make_optimizer(optimizer, m) for m in (mini, native)]
    g = rank_generator(seed)
    for _ in range(2):
        micro = draw_batches(g, [4, 3, 3], 2, 2)
        for replica, opt in zip((mini, native), optimizers):
            models.accumulation_step(replica, opt, micro)
    return [p.detach().clone() for p in mini.parameters()], [p.detach().clone() for p in native.parameters()]


@pytest.mark.parametrize("world,used_by,optimizer", [(1, [], "adam"), (3, [1], "adam"), (4, [0, 3], "sgd"),
                                                     (5, [], "sgd")])
def test_a_branch_some_or_no_ranks_use_trains_like_native_with_find_unused_parameters(world, used_by,
                                                                                     optimizer):
    for mine, native in run(world, backward_with_a_branch, used_by, True, optimizer, seed=3):
        for p, q in zip(mine, native):
            assert (p - q).abs().max() <= RTOL * q.abs().max()


def test_an_unused_parameter_without_find_unused_parameters_is_named_on_every_rank_without_a_hang():
    with pytest.raises(RankFailure, match=r"\['sometimes.weight', 'sometimes.bias'\] got no gradient.*"
                                          r"find_unused_parameters=True") as info:
        run(3, backward_with_a_branch, [], False, "sgd", seed=1)
    assert "no answer" not in str(info.value)  # every rank raised: nobody was left waiting


def wrap_mismatched_models():
    ddp.DistributedDataParallel(nn.Linear(3, 2 + (dist.get_rank() == 1), device=device()))


def test_ranks_with_different_models_are_told_so_on_every_rank():
    with pytest.raises(RankFailure, match=r"rank 1 of the group holds another model than rank 0: rank 0 has "
                                          r"weight of shape \(2, 3\) in torch.float32 where rank 1 has weight of "
                                          r"shape \(3, 3\)") as info:
        run(3, wrap_mismatched_models)
    assert "no answer" not in str(info.value)


def buckets_beside_native(cap, widths, steps=3):
    """Mini and native DDP with the same bucket_cap_mb: bucket membership (parameter indices, native's
    after its rebuild, which for a chain of layers follows the same reverse order) and parameters."""
    model = nn.Sequential(*[nn.Linear(a, b, dtype=F64, device=device()) for a, b in zip(widths, widths[1:])])
    native = NativeDDP(copy.deepcopy(model), bucket_cap_mb=cap)
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=cap)
    optimizers = [make_optimizer("sgd", m) for m in (mini, native)]
    g = rank_generator(5)
    for _ in range(steps):
        micro = draw_batches(g, widths, 2, 1)
        for replica, opt in zip((mini, native), optimizers):
            models.accumulation_step(replica, opt, micro)
    index = {p: i for i, p in enumerate(model.parameters())}
    rebuilt = native._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return ([[index[p] for p in b.params] for b in mini.buckets],
            [[int(i) for i in bucket.split()] for bucket in rebuilt.split(",")], max_rel_diff(mini, native))


# 200 x 200 fp64 weights are 312.5 KiB: torch's default (None) closes its first bucket at 1 MiB, after the
# fourth weight, then fills 25 MiB; 0 and a cap below every gradient (10 B < 24 B, the smallest) give one
# parameter per bucket; 1e4 MiB holds the whole model. (Native silently makes a negative cap one bucket.)
@pytest.mark.parametrize("cap", [None, 0, 1e-5, 1e4])
def test_edge_bucket_caps_bucket_and_train_like_native_ddp(cap):
    if cap == 0 and torch.__version__ < "2.13":
        pytest.skip("torch 2.11's DistributedDataParallel asserts a nonzero bucket_cap_mb (2.13 takes 0)")
    for mine, native, diff in run(2, buckets_beside_native, cap, [8, 200, 200, 200, 200, 200, 3]):
        assert mine == native
        assert diff == 0.0  # two ranks: x/2 + y/2 in any order is one rounding, bit for bit
    assert len(mine) == {None: 2, 0: 12, 1e-5: 12, 1e4: 1}[cap]


def test_a_negative_or_nan_bucket_cap_is_refused_with_the_values_that_work():
    for cap in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"bucket_cap_mb must be >= 0 \(0: one parameter per bucket\) or "
                                             r"None \(torch's default, 25 MiB\)"):
            ddp.DistributedDataParallel(nn.Linear(2, 2, device=device()), bucket_cap_mb=cap)


def naive_and_native(widths, optimizer, seed):
    torch.manual_seed(seed + dist.get_rank())
    model = Net(widths, frozen=True)
    native = NativeDDP(copy.deepcopy(model))
    naive = ddp.NaiveDataParallel(model)
    optimizers = [make_optimizer(optimizer, m) for m in (naive, native)]
    g = rank_generator(seed)
    for _ in range(3):
        (x, y), = draw_batches(g, widths, 3, 1)
        for replica, opt in zip((naive, native), optimizers):
            nn.functional.mse_loss(replica(x), y).backward()
            if replica is naive:
                naive.sync_gradients()
            opt.step()
            opt.zero_grad()
    return max_rel_diff(naive.module, native.module)


@settings(max_examples=8)
@given(world=st.integers(1, 5), widths=st.lists(st.integers(1, 6), min_size=3, max_size=4),
       optimizer=st.sampled_from(["sgd", "adam"]), seed=st.integers(0, 10 ** 6))
def test_naive_data_parallel_trains_like_native_ddp(world, widths, optimizer, seed):
    # the naive version sums first, then divides (native: divides, then sums): another rounding
    assert max(run(world, naive_and_native, widths, optimizer, seed)) <= RTOL


def train_in_subgroups(groups, seed):
    """Each subgroup trains its own replica, mini (on the ring) and native DDP side by side."""
    handles = [subgroup(g) for g in groups]  # every rank creates every group, in the same order
    k = next(i for i, g in enumerate(groups) if dist.get_rank() in g)
    torch.manual_seed(seed + dist.get_rank())
    model = Net([3, 4, 2])
    native = NativeDDP(copy.deepcopy(model), process_group=handles[k])
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4, group=handles[k],
                                       all_reduce=ring_all_reduce)
    optimizers = [make_optimizer("adam", m) for m in (mini, native)]
    g = rank_generator(seed)
    for _ in range(2):
        micro = draw_batches(g, [3, 4, 2], 2, 2)
        for replica, opt in zip((mini, native), optimizers):
            models.accumulation_step(replica, opt, micro)
    return k, torch.cat([p.detach().flatten() for p in mini.parameters()]), max_rel_diff(mini, native)


def test_ddp_on_subgroups_trains_each_group_like_native_ddp_on_that_group():
    results = run(5, train_in_subgroups, [[0, 2, 4], [1, 3]], seed=11)
    assert max(diff for _, _, diff in results) <= RTOL
    by_group = {k: [params for kk, params, _ in results if kk == k] for k in (0, 1)}
    for replicas in by_group.values():  # in step within a group...
        assert all(torch.equal(p, replicas[0]) for p in replicas)
    assert not torch.equal(by_group[0][0], by_group[1][0])  # ...and on their own across groups


def grads_after_sync(as_view):
    model = Net([3, 4, 2])
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4, gradient_as_bucket_view=as_view)
    (x, y), = draw_batches(rank_generator(0), [3, 4, 2], 2, 1)
    nn.functional.mse_loss(mini(x), y).backward()
    buffers = [b.buffer() for b in mini.buckets]
    return [any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
            for p in model.parameters()]


@pytest.mark.parametrize("as_view", [True, False])
def test_gradient_as_bucket_view_leaves_grads_inside_the_buckets(as_view):
    assert run(2, grads_after_sync, as_view)[0] == [as_view] * 4


# ----------------------------------------------------------------------------- communication hooks


def hooks(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[name]


def train_with_hook(hook_name, widths, seed, steps=3):
    """torch's own hook registered on mini DDP and on native DDP, beside mini DDP without a hook: the
    parameters after `steps` SGD steps, and what the hook saw of each bucket in the last backward."""
    torch.manual_seed(seed + dist.get_rank())
    model = Net(widths)
    native, plain = NativeDDP(copy.deepcopy(model)), ddp.DistributedDataParallel(copy.deepcopy(model), 1e-4)
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4)
    seen = []

    def recording(state, bucket):
        seen.append((bucket.index(), bucket.is_last(), bucket.buffer().numel(), [g.shape for g in bucket.gradients()],
                     [p.shape for p in bucket.parameters()]))
        return hooks(hook_name)(state, bucket)
    mini.register_comm_hook(None, recording)
    native.register_comm_hook(None, hooks(hook_name))
    optimizers = [make_optimizer("sgd", m) for m in (mini, native, plain)]
    g = rank_generator(seed)
    for _ in range(steps):
        seen.clear()
        micro = draw_batches(g, widths, 3, 2)
        for replica, opt in zip((mini, native, plain), optimizers):
            models.accumulation_step(replica, opt, micro)
    return max_rel_diff(mini, native), max_rel_diff(mini, plain), seen, len(mini.buckets)


@settings(max_examples=8)
@given(world=st.integers(1, 5), widths=st.lists(st.integers(1, 6), min_size=3, max_size=4),
       seed=st.integers(0, 10 ** 6))
def test_torchs_allreduce_hook_on_mini_ddp_equals_the_default_and_native_ddp_with_that_hook(world, widths, seed):
    for to_native, to_default, seen, n_buckets in run(world, train_with_hook, "allreduce", widths, seed):
        # the hook divides by N, the default multiplies by 1/N: the same for N = 1, 2, 4, an ulp apart else
        assert to_default == 0.0 if world in (1, 2, 4) else to_default <= RTOL
        assert to_native == 0.0 if world <= 2 else to_native <= RTOL  # native buckets differently
        assert [(k, last) for k, last, *_ in seen] == [(k, k == n_buckets - 1) for k in range(n_buckets)]
        for _, _, numel, gradient_shapes, parameter_shapes in seen:
            assert gradient_shapes == parameter_shapes and numel == sum(s.numel() for s in parameter_shapes)


@pytest.mark.parametrize("world", [1, 2])
def test_torchs_fp16_compression_hook_on_mini_ddp_equals_native_ddp_with_it(world):
    # fp16 sums of two addends are one rounding in any order: bit for bit; mini without the hook differs
    for to_native, to_default, _, _ in run(world, train_with_hook, "fp16", [5, 6, 4], 3):
        assert to_native == 0.0 and to_default > 0.0


def backward_with_a_failing_hook(how):
    model = Net([3, 4, 4, 2])
    mini = ddp.DistributedDataParallel(model, bucket_cap_mb=1e-4)

    def hook(state, bucket):
        if bucket.index() == 1 and how == "raises":
            raise ValueError("compression failed")
        if bucket.index() == 1:
            future = torch.futures.Future()
            future.set_exception(ValueError("compression failed"))
            return future
        return hooks("allreduce")(state, bucket)
    mini.register_comm_hook(None, hook)
    try:
        mini(torch.randn(2, 3, dtype=F64, device=device())).sum().backward()
    except RuntimeError as e:
        dist.barrier()  # every rank launched the same buckets before failing: the group is in step
        return str(e)
    return None


@pytest.mark.parametrize("how", ["raises", "fails its future"])
def test_a_failed_bucket_surfaces_from_backward_naming_the_bucket_and_the_rank(how):
    for rank, error in enumerate(run(3, backward_with_a_failing_hook, how)):
        assert error == (f"DistributedDataParallel on rank {rank}: the all-reduce of bucket 1 (layers.1.weight) "
                         f"failed: ValueError: compression failed")


def test_a_second_comm_hook_is_refused_as_in_torch():
    mini = run(1, register_twice)[0]
    assert mini == "register_comm_hook can only be called once (as in torch's DDP)"


def register_twice():
    mini = ddp.DistributedDataParallel(nn.Linear(2, 2, device=device()))
    mini.register_comm_hook(None, hooks("allreduce"))
    with pytest.raises(RuntimeError) as info:
        mini.register_comm_hook(None, hooks("allreduce"))
    return str(info.value)


def train_drop_and_collect(wrap):
    """One synced step through a wrapper, then drop it: is it freed (the hooks on its parameters live on)?"""
    model = wrap(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(device()))
    model(torch.ones(5, 3, device=device())).sum().backward()
    freed = [weakref.ref(model)] + ([weakref.ref(model.reducer)] if isinstance(model, ddp.DistributedDataParallel)
                                    else [])
    del model
    gc.collect()
    return all(r() is None for r in freed)


def test_a_dropped_ddp_model_is_freed_with_its_reducer_buckets_and_group():
    """A tensor keeps its hooks in C++, out of sight of Python's garbage collector: a hook holding the reducer
    strongly would keep every DDP ever built, its buckets and its process group, alive in a long-lived rank."""
    assert run(2, train_drop_and_collect, ddp.DistributedDataParallel) == [True, True]
