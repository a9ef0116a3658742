"""FSDP against PyTorch: native fully_shard (FSDP2) and one process on the full batch; collectives counted
per unit, bytes checked against the ring module's measured ledger, gathered-parameter peaks exact; the
module holds the optimizer's slices under its own names; ignored_params stay whole with averaged gradients.

Tolerances. With K <= 2 ranks every gradient average is a sum of at most two numbers, and a + b == b + a
bit for bit: our flat layout and FSDP2's per-parameter layout then give identical results, so we demand
equality (fp64, and bf16 below). With K >= 3 gloo's reduce-scatter adds the K values of an element in an
order that depends on where the element sits in the buffer, and the two layouts put it in different
places: an averaged gradient then differs by at most K-1 <= 4 roundings of 2^-53 relative to sum_k |g_k|,
O(1) here, so ~5e-16 per step. SGD (lr 0.1) and Adam (m/sqrt(v) is scale-free) carry that into the
parameters, and 3 steps through these small tanh MLPs (weights and Lipschitz constants O(1)) add it up
with little growth: FP64_ATOL = 1e-14 (45 ulps of 1.0; we saw at most 4.4e-16 over 30 random draws on
3-5 ranks). Real bugs (a missing 1/K, a stale or misplaced shard, a dropped gradient) move results by 1e-3
or more. The single-process reference sums the K*B samples in one matmul instead of K partial sums then
an average: the same kind and size of rounding, the same bound.
"""
import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # at the top: a check's fork server imports
# it once, before the ranks start; imported in a test, each rank would import it (half a second each)

import fsdp_exercise
import grading
from fsdp_exercise import MISTAKES  # noqa: F401  (the hooks', declared beside their judge)
from harness import BACKEND, RankFailure, device, rank_generator, run, subgroup
from mini_dist import ring_allreduce as ring
from mini_dist.fsdp import BOOKED
from mini_dist.fsdp import FullyShardedDataParallel as FSDP
from mini_dist.kit import measure, wire
from mini_dist.kit.models import Block

FP64_ATOL = 1e-14
STEPS = 3
BATCH = 3


def gathered_batches(data, group=None):
    """Every rank's (x, y) batches concatenated in rank order: what one process training on all K*B
    samples sees (the same mean loss, one big sum)."""
    K = dist.get_world_size(group)
    full = []
    for pair in data:
        gathered = [torch.empty(K * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device) for t in pair]
        for out, local in zip(gathered, pair):
            dist.all_gather_single(out, local, group=group)
        full.append(tuple(gathered))
    return full


def build(width, hidden, tied=False, seed=0, dtype=torch.float64, frozen=()):
    """Linear -> Blocks -> Linear; the outer Linears (tied if asked) are the root's leftovers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width, device=device()), *[Block(width, h, device()) for h in hidden],
                          nn.Linear(width, width, device=device()))
    if tied:
        model[-1].weight = model[0].weight
    for i in frozen:
        model[i + 1].requires_grad_(False)
    return model.to(device=device(), dtype=dtype)


def wrapped(model, mask):
    return [model[i + 1] for i, w in enumerate(mask) if w]


def native_fully_shard(model, mask, reshard, param_dtype=None, group=None):
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device().type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for m in wrapped(model, mask):
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def batches(width, seed, dtype):
    g = rank_generator(seed)
    return [(torch.randn(BATCH, width, generator=g, dtype=torch.float64).to(device(), dtype),
             torch.randn(BATCH, width, generator=g, dtype=torch.float64).to(device(), dtype))
            for _ in range(STEPS)]


def train(model, optimizer, data):
    losses = []
    for x, y in data:
        loss = ((model(x).to(y.dtype) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# ----- the hooks around a unit, the learner's exercise: what one step does to each unit


@pytest.mark.exercise(judges=("FullyShardedDataParallel._pre_forward", "FullyShardedDataParallel._post_forward",
                              "FullyShardedDataParallel._pre_backward"))
@settings(max_examples=6)
@given(world=st.integers(1, 4), width=st.integers(2, 5), hidden=st.integers(1, 6), depth=st.integers(1, 3),
       reshard=st.booleans(), prefetch=st.booleans(), seed=st.integers(0, 10 ** 6))
@example(world=2, width=3, hidden=4, depth=2, reshard=True, prefetch=True, seed=0)
@example(world=3, width=3, hidden=2, depth=2, reshard=False, prefetch=False, seed=1)
def test_each_unit_is_whole_while_it_computes_forward_and_backward_and_freed_after_when_resharding(
        world, width, hidden, depth, reshard, prefetch, seed):
    """each unit whole while it computes, forward and backward; freed after, when resharding or without grad

    One step of a Linear -> Blocks -> Linear stack, then a forward without grad, the hooks watched: each unit's
    module computes its forward on gathered parameters in their shapes and holds its slices after; the unit is
    freed after forward when resharding; _pre_backward runs before each unit's backward and leaves it whole, a
    prefetch never gathering a unit whose backward is done; a forward without grad leaves no unit gathered."""
    wrong = fsdp_exercise.judged(run(world, fsdp_exercise.probe, width, hidden, depth, reshard, prefetch, seed))
    assert wrong is None, wrong


# ----- equivalence: ours == native fully_shard == one process on the full batch

def train_three_ways(width, hidden, mask, tied, opt, reshard, prefetch, param_dtype=None):
    dtype = torch.float64 if param_dtype is None else torch.float32
    data = batches(width, seed=len(hidden) + width, dtype=dtype)
    model = build(width, hidden, tied, dtype=dtype)
    ours = FSDP(model, wrap=wrapped(model, mask), reshard_after_forward=reshard, prefetch=prefetch,
                param_dtype=param_dtype)
    our_losses = train(ours, make_optimizer(opt, ours.parameters()), data)
    our_params = ours.full_state_dict()

    native = native_fully_shard(build(width, hidden, tied, dtype=dtype), mask, reshard, param_dtype)
    native_losses = train(native, make_optimizer(opt, native.parameters()), data)
    native_params = {n: p.full_tensor() for n, p in native.named_parameters()}  # collective: all ranks

    full_batches = gathered_batches(data)
    single = build(width, hidden, tied, dtype=dtype)  # trained on rank 0 only, in fp64 only
    single_losses = train(single, make_optimizer(opt, single.parameters()), full_batches) \
        if param_dtype is None and dist.get_rank() == 0 else None
    single_params = {n: p.detach() for n, p in single.named_parameters()}
    return our_losses, native_losses, our_params, native_params, single_losses, single_params


models = st.tuples(st.integers(1, 6), st.lists(st.integers(1, 9), min_size=0, max_size=4)).flatmap(
    lambda wh: st.tuples(st.just(wh[0]), st.just(tuple(wh[1])),
                         st.lists(st.booleans(), min_size=len(wh[1]), max_size=len(wh[1])).map(tuple)))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


def where(a: dict, b: dict) -> str:
    """The parameter element where two state dicts differ most, for a one-line failure message."""
    name = max(a, key=lambda n: (a[n].double() - b[n].double()).abs().max().item())
    d = (a[name].double() - b[name].double()).flatten()
    i = int(d.abs().argmax())
    return f"{name}, element {i} ({a[name].flatten()[i].item():.17g} vs {b[name].flatten()[i].item():.17g})"


@pytest.mark.exercise
@settings(max_examples=12)
@given(world=st.integers(1, 5), model=models, tied=st.booleans(), opt=st.sampled_from(["sgd", "adam"]),
       reshard=st.booleans(), prefetch=st.booleans())
@example(world=2, model=(3, (2, 5), (True, True)), tied=False, opt="adam", reshard=True, prefetch=False)
def test_fsdp_trains_like_native_fully_shard_and_like_one_process(world, model, tied, opt, reshard, prefetch):
    """FSDP trains like native fully_shard and like one process on the full batch, within 1e-14 (fp64)

    Three SGD or Adam steps of a Linear -> Blocks -> Linear stack (some Blocks units, tied outer weights): every
    rank's losses and the parameters within FP64_ATOL of fully_shard's and of one process's (the K gradients
    summed in another order, see the top of this file). On <= 2 ranks mini_dist's own FSDP matches fully_shard
    bit for bit; a check notes it, it does not judge by it."""
    width, hidden, mask = model
    results = run(world, train_three_ways, width, hidden, mask, tied, opt, reshard, prefetch)
    exact = "bit-identical to fully_shard on <= 2 ranks"
    why = "two gradients add alike in any order; another order of the other roundings may still move an ulp"
    for rank, (ours, native, *_) in enumerate(results):  # every rank's own loss, step by step
        for step, (a, b) in enumerate(zip(ours, native)):
            said = f"rank {rank}, step {step}: loss {a!r}, fully_shard's {b!r}"
            assert abs(a - b) <= FP64_ATOL, f"{said}, more than {FP64_ATOL:g} apart"
            grading.optional(world > 2 or a == b, exact, said, why)
    _, _, our_params, native_params, single_losses, single_params = results[0]
    apart = max_diff(our_params, native_params)
    said = f"rank 0: parameters differ from fully_shard's by {apart:.1e} at {where(our_params, native_params)}"
    assert apart <= FP64_ATOL, said
    grading.optional(world > 2 or apart == 0.0, exact, said, why)
    mean_losses = [sum(r[0][s] for r in results) / world for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(mean_losses, single_losses)) <= FP64_ATOL, \
        f"the ranks' mean losses {mean_losses}, one process on the full batch {single_losses}"
    assert max_diff(our_params, single_params) <= FP64_ATOL, \
        f"rank 0: parameters differ from one process's at {where(our_params, single_params)}"


@settings(max_examples=6)
@given(world=st.integers(1, 2), model=models, opt=st.sampled_from(["sgd", "adam"]), reshard=st.booleans())
def test_bf16_fsdp_equals_native_mixed_precision_bit_for_bit_on_up_to_two_ranks(world, model, opt, reshard):
    # Both compute in bf16 from the same bf16 casts, average two bf16 gradients (commutative, see top)
    # and step fp32 masters: identical. With K >= 3 the summation order differs and each bf16 sum can
    # round differently by 2^-8 relative, which Adam then turns into visible steps; not compared there.
    width, hidden, mask = model
    results = run(world, train_three_ways, width, hidden, mask, False, opt, reshard, True, torch.bfloat16)
    for ours, native, *_ in results:
        assert ours == native
    assert max_diff(results[0][2], results[0][3]) == 0.0


# ----- the ledger: collectives per unit, bytes against the ring's measured ledger, gathered peaks

def ledger_of_one_step(width, hidden, mask, reshard, prefetch, param_dtype=None):
    model = build(width, hidden, dtype=torch.float32)
    ours = FSDP(model, wrap=wrapped(model, mask), reshard_after_forward=reshard, prefetch=prefetch,
                param_dtype=param_dtype)
    x, y = batches(width, seed=1, dtype=torch.float32)[0]
    sent = measure.step_sent(lambda: ((ours(x).float() - y) ** 2).mean().backward(), ours.ledger, BOOKED,
                             dist.get_world_size())
    step = {"peak": ours.ledger.peak, "after": ours.ledger.gathered, "sent": sent,
            "units": [u.name for u in ours.units],
            "full": [u.full.numel() * u.full.element_size() for u in ours.units],
            "counts": {u.name: (ours.ledger.count("all-gather", u.name),
                                ours.ledger.count("reduce-scatter", u.name)) for u in ours.units},
            "grads": [(tuple(p.grad.shape), p.grad.dtype, p.dtype, s.stop - s.start)
                      for u in ours.units for p, s in zip(u.params, u.slices)],
            "optimized": [(p.untyped_storage().data_ptr(), p.numel()) for p in ours.parameters()],
            "unpadded": {u.shard.untyped_storage().data_ptr():  # elements of my shard that are not padding
                         min(max(u.numel - dist.get_rank() * u.shard_numel, 0), u.shard_numel)
                         for u in ours.units}}
    ring_bytes = 0  # the same collectives through the ring module, whose ledger counts real sends
    for u in ours.units:
        for _ in range(2 if reshard else 1):
            ring.LEDGER.reset()
            ring.ring_all_gather(torch.empty_like(u.full), u.shard.detach().to(u.full.dtype))
            ring_bytes += ring.LEDGER.sent
        ring.LEDGER.reset()
        ring.ring_reduce_scatter(torch.empty_like(u.shard, dtype=u.full.dtype), torch.zeros_like(u.full))
        ring_bytes += ring.LEDGER.sent
    step.update(ring=ring_bytes, shards=sum(u.shard_numel for u in ours.units), events=ours.ledger.events[:])
    ours.ledger.reset()
    with torch.no_grad():
        ours(x)
    step["eval"] = (ours.ledger.count("all-gather"), ours.ledger.gathered)
    return step


flags = dict(world=st.integers(1, 5), model=models, reshard=st.booleans(), prefetch=st.booleans())
deep = (3, (2, 5, 4, 3), (True, True, True, True))  # four units in a row: room for a prefetch to overreach


@pytest.mark.exercise
@settings(max_examples=10)
@given(**flags)
@example(world=3, model=deep, reshard=True, prefetch=True)
def test_each_unit_is_gathered_twice_and_reduce_scattered_once_per_step_once_and_once_without_reshard(
        world, model, reshard, prefetch):
    for rank, step in enumerate(run(world, ledger_of_one_step, *model, reshard, prefetch)):
        wrong = {u: c for u, c in step["counts"].items() if c != (2 if reshard else 1, 1)}
        assert not wrong, f"rank {rank}: (all-gathers, reduce-scatters) per unit {wrong}, want " \
                          f"({2 if reshard else 1}, 1)"
        assert step["eval"] == (len(step["units"]), 0), f"rank {rank}: a forward without grad made " \
            f"{step['eval'][0]} all-gathers for {len(step['units'])} units and left {step['eval'][1]} bytes " \
            f"gathered, want one each and none left: no backward will free them"


@settings(max_examples=10)
@given(**flags)
def test_bytes_sent_are_3N_with_reshard_2N_without_exactly_what_the_ring_ledger_measures(
        world, model, reshard, prefetch):
    # (K-1)/K of each padded unit per collective; DDP's 2(K-1)/K N is measured beside it in the demo
    for step in run(world, ledger_of_one_step, *model, reshard, prefetch):
        collectives = 3 if reshard else 2
        assert step["sent"] == step["ring"] == collectives * (world - 1) * step["shards"] * 4


@settings(max_examples=10)
@given(**flags)
@example(world=3, model=deep, reshard=True, prefetch=True)
@example(world=2, model=deep, reshard=True, prefetch=False)
def test_peak_of_gathered_parameters_in_forward_and_in_backward_is_root_plus_what_prefetch_allows(
        world, model, reshard, prefetch):
    for step in run(world, ledger_of_one_step, *model, reshard, prefetch):
        root, units = step["full"][0], step["full"][1:]  # bytes of each unit's gathered K*S vector
        if not reshard:
            expected = sum(step["full"])  # every unit stays from forward to backward
        elif prefetch and len(units) >= 2:
            expected = root + max(a + b for a, b in zip(units, units[1:]))
        else:
            expected = root + max(units, default=0)
        for phase in ("forward", "backward"):
            assert max(e[3] for e in step["events"] if e[0] == phase) == expected
        assert step["peak"] == expected and step["after"] == 0


@settings(max_examples=8)
@given(world=st.integers(1, 5), model=models, prefetch=st.booleans())
@example(world=3, model=deep, prefetch=True)
def test_prefetch_issues_the_next_units_all_gather_before_the_current_unit_computes_both_ways(
        world, model, prefetch):
    for step in run(world, ledger_of_one_step, *model, True, prefetch):
        for phase in ("forward", "backward"):
            events = [(unit, what) for p, unit, what, *_ in step["events"] if p == phase]
            computes = [unit for unit, what in events if what == "compute"]
            root, *blocks = step["units"]  # backward: the root's output gets its gradient first
            assert computes == ([root, *blocks] if phase == "forward" else [root, *blocks[::-1]])
            for current, following in zip(computes, computes[1:]):
                issued_before = events.index((following, "all-gather")) < events.index((current, "compute"))
                assert issued_before == prefetch


@settings(max_examples=8)
@given(world=st.integers(1, 5), model=models, dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_half_param_dtype_keeps_fp32_gradient_shards_of_the_shard_shape_and_halves_traffic(
        world, model, dtype):
    for step in run(world, ledger_of_one_step, *model, True, False, dtype):
        for shape, grad_dtype, slice_dtype, slice_numel in step["grads"]:
            assert (shape, grad_dtype, slice_dtype) == ((slice_numel,), torch.float32, torch.float32)
        seen = dict.fromkeys(step["unpadded"], 0)  # the optimizer sees shards only: views of their storages,
        for storage, numel in step["optimized"]:   # covering every element that is not padding, once
            seen[storage] += numel
        assert seen == step["unpadded"]
        assert step["sent"] == 3 * (world - 1) * step["shards"] * 2
        assert step["peak"] == step["full"][0] + max(step["full"][1:], default=0)


# ----- state dicts, subgroups, frozen units

def state_dict_round_trip(tied):
    model = build(3, (4, 5), tied, seed=1)
    ours = FSDP(model, wrap=Block)
    train(ours, make_optimizer("adam", ours.parameters()), batches(3, seed=2, dtype=torch.float64))
    saved = ours.full_state_dict()
    other_model = build(3, (4, 5), tied, seed=99)
    other = FSDP(other_model, wrap=Block)
    other.load_full_state_dict(saved if dist.get_rank() == 0 else None)
    x = torch.randn(2, 3, dtype=torch.float64, device=device())
    plain = build(3, (4, 5), tied, seed=5)
    if dist.get_rank() == 0:
        plain.load_state_dict(saved, strict=not tied)  # a tied weight is saved once, under its first name
    return saved, other.full_state_dict(), other(x), ours(x), plain(x)


@pytest.mark.parametrize("world,tied", [(1, False), (3, True), (4, False)])
def test_full_state_dict_is_the_unsharded_model_and_loads_back_into_any_sharding(world, tied):
    saved, reloaded, other_out, our_out, plain_out = run(world, state_dict_round_trip, tied)[0]
    assert saved.keys() == reloaded.keys() and all(torch.equal(saved[n], reloaded[n]) for n in saved)
    assert torch.equal(other_out, our_out) and torch.equal(plain_out, our_out)  # same values, same ops


def train_on_a_subgroup(ranks):
    group = subgroup(ranks)
    if dist.get_rank() not in ranks:
        return None
    model = build(4, (3, 6), seed=3)
    ours = FSDP(model, wrap=Block, group=group)
    data = batches(4, seed=4, dtype=torch.float64)
    losses = train(ours, make_optimizer("sgd", ours.parameters()), data)
    params = ours.full_state_dict()
    full_batches = gathered_batches(data, group)
    single = build(4, (3, 6), seed=3)
    single_losses = train(single, make_optimizer("sgd", single.parameters()), full_batches)
    return losses, params, single_losses, {n: p.detach() for n, p in single.named_parameters()}


def test_fsdp_on_a_subgroup_of_odd_size_trains_like_one_process_on_its_ranks_data():
    ranks = (1, 2, 4)  # group rank 0 is global rank 1: the state dict lands there
    results = run(5, train_on_a_subgroup, ranks)
    assert [r is None for r in results] == [True, False, False, True, False]
    losses, params, single_losses, single_params = results[1]
    assert results[2][1] == {} and results[4][1] == {}
    mean_losses = [sum(results[r][0][s] for r in ranks) / len(ranks) for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(mean_losses, single_losses)) <= FP64_ATOL
    assert max_diff(params, single_params) <= FP64_ATOL


def train_with_a_frozen_unit():
    model = build(3, (4, 5, 2), frozen=(1,))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours = FSDP(model, wrap=Block)
    data = batches(3, seed=6, dtype=torch.float64)
    losses = train(ours, make_optimizer("adam", ours.parameters()), data)
    ours.ledger.reset()
    ((ours(data[0][0]) - data[0][1]) ** 2).mean().backward()
    native = native_fully_shard(build(3, (4, 5, 2), frozen=(1,)), (True, True, True), True)
    native_losses = train(native, make_optimizer("adam", native.parameters()), data)
    native_params = {n: p.full_tensor() for n, p in native.named_parameters()}
    counts = [(ours.ledger.count("all-gather", u.name), ours.ledger.count("reduce-scatter", u.name))
              for u in ours.units]
    return losses, native_losses, ours.full_state_dict(), native_params, before, counts, ours.ledger.gathered


@pytest.mark.parametrize("world", [2, 3])
def test_a_frozen_unit_is_gathered_for_backward_never_reduce_scattered_and_stays_put(world):
    results = run(world, train_with_a_frozen_unit)
    tol = 0.0 if world <= 2 else FP64_ATOL
    for ours, native, *_ in results:
        assert max(abs(a - b) for a, b in zip(ours, native)) <= tol
    _, _, params, native_params, before, counts, gathered = results[0]
    assert max_diff(params, native_params) <= tol
    assert all(torch.equal(params[n], before[n]) for n in params if n.startswith("2."))
    assert counts == [(2, 1), (2, 1), (2, 0), (2, 1)] and gathered == 0  # root, block 1, frozen block 2, ...


# ----- the module's own parameters: per-parameter slices of the shards, with their own gradients

def named_slices_and_native_grads(width, hidden, mask, tied):
    model = build(width, hidden, tied)
    names = [n for n, _ in model.named_parameters()]  # the plain module's names and order, tied ones once
    ours = FSDP(model, wrap=wrapped(model, mask))
    optimizer = make_optimizer("sgd", ours.parameters())
    native = native_fully_shard(build(width, hidden, tied), mask, True)
    for x, y in batches(width, seed=width + 7, dtype=torch.float64)[:2]:  # 2 backwards: .grad accumulates
        for m in (ours, native):
            ((m(x) - y) ** 2).mean().backward()
    full = {n: (p.full_tensor(), p.grad.full_tensor()) for n, p in native.named_parameters()}  # collective
    held = list(model.named_parameters())  # the wrapped module itself, between computations
    stepped = optimizer.param_groups[0]["params"]
    same = [n for n, _ in held] == names and [n for n, _ in ours.named_parameters()] == names and all(
        p is q and p is r and p is model.get_parameter(n)  # the attribute the submodule holds
        for (n, p), (_, q), r in zip(held, ours.named_parameters(), stepped))
    checked = []
    for name, p in held:  # as code written for a plain module would loop
        unit = next(u for u in ours.units if name in u.names)
        shape, start, stop = ours.sharded_state_dict()[name][1]
        value, grad = (t.reshape(-1)[start:stop] for t in full[name])
        checked.append((name, tuple(shape) == tuple(full[name][0].shape),
                        p.dim() == 1 and p.numel() == stop - start,
                        p.untyped_storage().data_ptr() == unit.shard.untyped_storage().data_ptr(),
                        torch.equal(p.detach(), value), (p.grad - grad).abs().max().item() if p.numel() else 0.0))
    return checked, sorted(full), same


@pytest.mark.exercise
@settings(max_examples=10)
@given(world=st.integers(1, 5), model=models, tied=st.booleans())
def test_the_module_holds_its_parameters_as_shard_slices_the_optimizer_steps_with_native_fully_shards_grads(
        world, model, tied):
    """the module, the wrapper and the optimizer hold the same parameters: this rank's slices, with .grad

    model.module.named_parameters(), model.named_parameters(), the submodules' attributes and the optimizer's
    parameters are the same tensors, in the module's order."""
    results = run(world, named_slices_and_native_grads, *model, tied)
    for rank, (checked, native_names, same) in enumerate(results):
        assert same, f"rank {rank}: the module, the wrapper and the optimizer hold different parameters"
        names = sorted(name for name, *_ in checked)
        assert names == native_names, f"rank {rank}: parameters {names}, the module's own {native_names}"
        for name, same_shape, is_slice, in_shard, same_value, grad_diff in checked:
            said = (f"rank {rank}, {name}: between steps a 1-D slice of this rank's shard {is_slice and in_shard}, "
                    f"its whole shape kept {same_shape}, the value fully_shard's {same_value}")
            assert same_shape and is_slice and in_shard and same_value, said
            assert grad_diff <= FP64_ATOL, f"rank {rank}, {name}: .grad {grad_diff:.1e} from fully_shard's"
            # two averaged gradients: the sums of the file's header
            grading.optional(world > 2 or grad_diff == 0.0, "bit-identical to fully_shard on <= 2 ranks",
                             f"rank {rank}, {name}: .grad {grad_diff:.1e} apart", "two gradients add alike in any "
                             "order; another order of the other roundings may still move an ulp")


class CheckpointedBlock(Block):
    """A Block whose forward is recomputed in backward (torch.utils.checkpoint): its Linears run again while
    the unit's backward runs, so they must hold the gathered weights then too."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def checkpointed_units_against_fully_shard(width, hidden, reshard):
    data = batches(width, seed=width, dtype=torch.float64)
    trained = []
    for kind in ("ours", "native"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), *[CheckpointedBlock(width, h, device()) for h in hidden],
                              nn.Linear(width, width)).to(device(), torch.float64)
        if kind == "ours":
            model = FSDP(model, wrap=CheckpointedBlock, reshard_after_forward=reshard)
        else:
            model = native_fully_shard(model, [True] * len(hidden), reshard)
        trained.append((train(model, make_optimizer("adam", model.parameters()), data), model))
    (our_losses, ours), (native_losses, native) = trained
    native_state = {n: p.full_tensor() for n, p in native.named_parameters()}
    return our_losses, native_losses, max_diff(ours.state_dict(), native_state)


@pytest.mark.exercise
@settings(max_examples=6)
@given(world=st.integers(1, 5), width=st.integers(1, 6), hidden=st.lists(st.integers(1, 7), min_size=1, max_size=3),
       reshard=st.booleans())
def test_a_unit_recomputed_in_backward_by_activation_checkpointing_trains_like_fully_shard(world, width, hidden,
                                                                                          reshard):
    """a unit recomputed in backward by activation checkpointing trains like fully_shard, within 1e-14

    Every Block checkpointed: its forward runs again inside its backward, on the weights _pre_backward
    gathered; losses and parameters after three Adam steps within FP64_ATOL of fully_shard's."""
    for rank, (ours, native, diff) in enumerate(run(world, checkpointed_units_against_fully_shard, width,
                                                    tuple(hidden), reshard)):
        apart = max(abs(a - b) for a, b in zip(ours, native))
        said = f"rank {rank}: losses {ours}, fully_shard's {native}; parameters {diff:.1e} apart"
        assert apart <= FP64_ATOL and diff <= FP64_ATOL, said
        grading.optional(world > 2 or apart == diff == 0.0, "bit-identical to fully_shard on <= 2 ranks", said,
                         "two gradients add alike in any order; another order of the other roundings may still move "
                         "an ulp")


# ----- parameters left out of sharding (ignored_params): whole on every rank, gradients averaged

VOCAB = 11


class NormBlock(nn.Module):
    """A pre-norm residual MLP: the norm's weight and bias are what a user leaves out of sharding."""

    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width, device=device())
        self.up = nn.Linear(width, hidden, device=device())
        self.down = nn.Linear(hidden, width, device=device())

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def small_transformer(width, hidden, seed=0):
    """Embedding, pre-norm blocks, a final norm and a head: the course's small model."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, width, device=device()), *[NormBlock(width, h) for h in hidden],
                         nn.LayerNorm(width, device=device()), nn.Linear(width, VOCAB, device=device())).to(
        device(), torch.float64)


def norms(model):
    """The norms' parameters, in the module's order (a set's order differs from rank to rank)."""
    return [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]


def token_batches(seed, steps=STEPS):
    g = rank_generator(seed)
    return [(torch.randint(0, VOCAB, (BATCH, 4), generator=g).to(device()),
             torch.randint(0, VOCAB, (BATCH, 4), generator=g).to(device())) for _ in range(steps)]


def cross_entropy(model, ids, targets):
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def ignored_norms_against_fully_shard(width, hidden):
    model = small_transformer(width, hidden)
    ours = FSDP(model, wrap=NormBlock, ignored_params=set(norms(model)))
    native = small_transformer(width, hidden)
    left_out = norms(native)
    mesh = DeviceMesh.from_group(dist.group.WORLD, device().type)
    for block in native[1:-2]:
        fully_shard(block, mesh=mesh, ignored_params=set(left_out))
    fully_shard(native, mesh=mesh, ignored_params=set(left_out))
    losses = {"ours": [], "native": []}
    for m, name in ((ours, "ours"), (native, "native")):
        adam = torch.optim.Adam(m.parameters(), lr=0.01)
        for ids, targets in token_batches(seed=width):
            loss = cross_entropy(m, ids, targets)
            loss.backward()
            if m is native:  # fully_shard leaves ignored parameters' gradients each rank's own: average them
                for p in left_out:
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
            adam.step()
            adam.zero_grad()
            losses[name].append(loss.item())
    whole = [tuple(p.shape) for p in norms(model)] == [(width,)] * len(left_out)
    mine = torch.cat([p.detach().reshape(-1) for p in norms(model)])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    state = ours.state_dict()
    native_state = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                    for n, p in native.named_parameters()}
    return losses, max_diff(state, native_state), whole, all(torch.equal(t, mine) for t in everyone)


@settings(max_examples=6)
@given(world=st.integers(1, 2), width=st.integers(1, 6), hidden=st.lists(st.integers(1, 7), min_size=1, max_size=3))
def test_ignored_params_stay_whole_on_every_rank_and_train_like_fully_shard_with_their_gradients_averaged(
        world, width, hidden):
    # Bit for bit on up to two ranks (the file's header). At K >= 3 the two layouts sum in different orders,
    # and a LayerNorm over a few elements divides by their standard deviation, which can be small: Adam then
    # carries those roundings past FP64_ATOL (3e-14 seen at width 2). The test below checks 3 and 5 ranks
    # against one process, one backward, where nothing amplifies them.
    tol = 0.0
    for rank, (losses, diff, whole, same) in enumerate(run(world, ignored_norms_against_fully_shard, width,
                                                            tuple(hidden))):
        assert whole and same, f"rank {rank}: the norms are not whole, or not the same on every rank"
        assert max(abs(a - b) for a, b in zip(losses["ours"], losses["native"])) <= tol, (rank, losses)
        assert diff <= tol, f"rank {rank}: parameters differ from fully_shard's by {diff}"


def every_gradient_against_one_process(world_seed):
    """The course's check, through the public surface only: after one backward on each rank's own tokens,
    every parameter the module holds has the gradient one process computes on all ranks' tokens."""
    model = small_transformer(5, (7, 4))
    ours = FSDP(model, wrap=NormBlock, ignored_params=set(norms(model)))
    ids, targets = token_batches(seed=world_seed, steps=1)[0]
    wire.LEDGER.reset()
    cross_entropy(ours, ids, targets).backward()
    whole = [p for p in norms(model) if p.requires_grad]  # all-reduced one by one at the end of backward
    books = {"booked": (wire.LEDGER.calls["all_reduce"], wire.LEDGER.bytes["all_reduce"]),
             "whole": (len(whole), sum(p.nbytes for p in whole))}
    (all_ids, all_targets), = gathered_batches([(ids, targets)])
    single = small_transformer(5, (7, 4))
    cross_entropy(single, all_ids, all_targets).backward()
    expected = dict(single.named_parameters())
    where = ours.sharded_state_dict()  # {name: (slice, Slice(shape, start, stop))} of the sharded ones
    compared = []
    for name, p in ours.module.named_parameters():
        want = expected[name].grad
        kind = "ignored" if name not in where else "sharded"
        if kind == "sharded":
            _, (_, start, stop) = where[name]
            want = want.reshape(-1)[start:stop]
        if p.numel():
            compared.append((name, kind, tuple(p.shape) == tuple(want.shape) and (p.grad - want).abs().max().item()))
    return compared, books


@pytest.mark.parametrize("world", [2, 3, 5])
def test_after_backward_every_parameter_the_module_holds_has_one_process_gradient_sharded_and_ignored_alike(world):
    for rank, (compared, books) in enumerate(run(world, every_gradient_against_one_process, world)):
        assert books["booked"] == books["whole"], f"rank {rank}: the wire's LEDGER booked (all-reduces, payload " \
            f"bytes) {books['booked']}; the parameters left whole are {books['whole']}"
        kinds = {kind for _, kind, _ in compared}
        assert kinds == {"sharded", "ignored"}, f"rank {rank} compared {kinds} only"
        wrong = [(name, kind, diff) for name, kind, diff in compared if diff is False or diff > FP64_ATOL]
        assert not wrong, f"rank {rank}: gradients differ from one process's: {wrong}"


def default_units(width, hidden):
    model = build(width, hidden)
    children = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    one_unit = FSDP(build(width, hidden), wrap=())
    return [u.name for u in FSDP(model).units], children, [u.name for u in one_unit.units]


def test_default_wrap_makes_each_child_with_parameters_a_unit_and_an_empty_wrap_one_unit():
    for units, children, one in run(2, default_units, 3, (4, 5)):
        assert units == children == ["0", "1", "2", "3"] and one == ["root"]


def full_state_dicts(to):
    ours = FSDP(build(3, (4, 5), seed=4), wrap=Block)
    reference = {n: p.detach() for n, p in build(3, (4, 5), seed=4).named_parameters()}
    state = ours.full_state_dict(to=to)
    return sorted(state) == sorted(reference) and all(torch.equal(state[n], reference[n]) for n in state), \
        bool(state)


@pytest.mark.parametrize("world,to", [(3, None), (3, 2), (4, 1), (1, None)])
def test_full_state_dict_lands_on_the_chosen_rank_or_on_every_rank(world, to):
    results = run(world, full_state_dicts, to)
    assert [has for _, has in results] == [to is None or r == to for r in range(world)]
    assert all(equal for equal, has in results if has)


def sharded_checkpoint_round_trip(world_seed):
    data = batches(4, seed=world_seed, dtype=torch.float64)
    ours = FSDP(build(4, (3, 6, 2), seed=1))  # default wrap: each child a unit
    opt = make_optimizer("adam", ours.parameters())
    train(ours, opt, data[:2])
    # what each rank writes to disk: copies (state_dict() hands out the live tensors)
    pieces, saved_opt = copy.deepcopy(ours.sharded_state_dict()), copy.deepcopy(opt.state_dict())
    whole = ours.full_state_dict(to=None)
    resumed = FSDP(build(4, (3, 6, 2), seed=99))
    resumed_opt = make_optimizer("adam", resumed.parameters())
    resumed.load_sharded_state_dict(pieces)
    resumed_opt.load_state_dict(saved_opt)
    train(ours, opt, data[2:])
    train(resumed, resumed_opt, data[2:])
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), resumed.parameters()))
    return same, pieces, whole


@pytest.mark.parametrize("world", [1, 3, 4])
def test_sharded_state_dict_with_the_optimizers_state_resumes_training_bit_for_bit_and_tiles_the_full_one(world):
    results = run(world, sharded_checkpoint_round_trip, world)
    assert all(same for same, _, _ in results)
    whole = results[0][2]
    for name, full in whole.items():  # every rank's slice, put at its place, rebuilds every parameter
        rebuilt = torch.full((full.numel(),), float("nan"), dtype=full.dtype)  # cpu: pieces come back .cpu()
        for _, pieces, _ in results:
            piece, (shape, start, stop) = pieces[name]
            assert tuple(shape) == tuple(full.shape) and torch.isnan(rebuilt[start:stop]).all()
            rebuilt[start:stop] = piece.cpu()
        assert torch.equal(rebuilt.view(full.shape), full.cpu())


class Norm(nn.Module):
    """A layer norm with a weight: its unit keeps fp32 while the Blocks compute in bf16."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width, device=device())

    def forward(self, x):
        return self.norm(x)


def mixed_policy_model(width, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), Block(width, 5), Norm(width), Block(width, 3),
                         nn.Linear(width, width)).to(device())


def per_unit_precision(width, opt):
    data = batches(width, seed=width, dtype=torch.float32)
    model = mixed_policy_model(width)
    ours = FSDP(model, wrap={Block: torch.bfloat16, Norm: torch.float32}, param_dtype=torch.bfloat16)
    seen = []  # (module, input dtype, weight dtype) while it computes
    for m in (model[1].up, model[2].norm, model[3].down, model[4]):
        m.register_forward_pre_hook(lambda m, args: seen.append((type(m).__name__, args[0].dtype, m.weight.dtype)))
    our_losses = train(ours, make_optimizer(opt, ours.parameters()), data)
    native = mixed_policy_model(width)
    mesh = DeviceMesh.from_group(dist.group.WORLD, device().type)
    for m, dtype in ((native[1], torch.bfloat16), (native[2], torch.float32), (native[3], torch.bfloat16)):
        fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
    fully_shard(native, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    native_losses = train(native, make_optimizer(opt, native.parameters()), data)
    native_params = {n: p.full_tensor() for n, p in native.named_parameters()}
    return our_losses, native_losses, ours.full_state_dict(to=None), native_params, seen[:4]


@settings(max_examples=4)
@given(world=st.integers(1, 2), width=st.integers(2, 7), opt=st.sampled_from(["sgd", "adam"]))
def test_a_policy_per_unit_keeps_the_norm_in_fp32_while_blocks_compute_in_bf16_equal_to_fully_shard(
        world, width, opt):
    # bit for bit on <= 2 ranks, for the reason of the bf16 test above
    for ours, native, params, native_params, seen in run(world, per_unit_precision, width, opt):
        assert ours == native and max_diff(params, native_params) == 0.0
        assert seen == [("Linear", torch.bfloat16, torch.bfloat16), ("LayerNorm", torch.float32, torch.float32),
                        ("Linear", torch.bfloat16, torch.bfloat16), ("Linear", torch.bfloat16, torch.bfloat16)]
        assert all(p.dtype == torch.float32 for p in params.values())  # the shards stay fp32


def die_in_backward(dying):
    ours = FSDP(build(3, (4, 5)), wrap=Block)
    x, y = batches(3, seed=3, dtype=torch.float64)[0]
    out = ours(x)
    if dist.get_rank() == dying:
        out.register_hook(lambda grad: os._exit(1))  # vanishes as its backward starts
    ((out - y) ** 2).mean().backward()


def test_a_rank_dying_in_backward_makes_the_others_backward_name_the_unit_and_their_rank():
    with pytest.raises(RankFailure) as info:
        run(3, die_in_backward, 2)
    message = str(info.value)
    assert "rank 2 failed: died" in message
    for rank in (0, 1):
        assert re.search(rf"rank {rank} failed: RuntimeError: FSDP unit '[\w.]+': (all-gather for backward|"
                         rf"reduce-scatter of its gradient) failed on rank {rank}", message), message


# ----- bad input: every rank raises the same clear error before anyone blocks

def build_badly(case):
    model = build(3, (4, 5))
    if case == "wrap outside":
        FSDP(model, wrap=[nn.Linear(2, 2, device=device())])
    elif case == "half frozen unit":
        model[1].up.bias.requires_grad_(False)
        FSDP(model, wrap=Block)
    elif case == "other model per rank":
        FSDP(build(3, (4, 5 + dist.get_rank())), wrap=Block)
    elif case == "integer dtype":
        FSDP(model, wrap=Block, param_dtype=torch.int8)
    elif case == "state dict lacks a key":
        ours = FSDP(model, wrap=Block)
        state = ours.full_state_dict()
        state.pop("1.up.weight", None)
        ours.load_full_state_dict(state)
    elif case == "integer dtype for one unit":
        FSDP(model, wrap={Block: torch.bfloat16, nn.Linear: torch.int32})
    elif case == "to is not a rank":
        FSDP(model, wrap=Block).full_state_dict(to=3)
    elif case == "ignored parameter from elsewhere":
        FSDP(model, wrap=Block, ignored_params={nn.Parameter(torch.zeros(2, device=device()))})
    elif case == "sharded state dict of another rank":
        ours = FSDP(model, wrap=Block)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ours.sharded_state_dict())
        ours.load_sharded_state_dict(everyone[0])  # rank 0's slices are not rank 1's or rank 2's


@pytest.mark.parametrize("case,message", [
    ("wrap outside", "not inside the wrapped module"),
    ("half frozen unit", "mixes .* frozen and trainable"),
    ("other model per rank", r"ranks \[1, 2\] built other units than rank 0"),
    ("integer dtype", "param_dtype must be a floating dtype"),
    ("state dict lacks a key", r"lacks or misshapes: rank 0: 1.up.weight \(want shape \(4, 3\)\)"),
    ("integer dtype for one unit", "param_dtype must be a floating dtype .*, not torch.int32"),
    ("to is not a rank", r"to=3 is not a rank of the group \(0..2\), nor None"),
    ("ignored parameter from elsewhere", "ignored_params holds a tensor that is not a parameter of the wrapped"),
    ("sharded state dict of another rank", r"does not fit this sharding \(rank 1: .*; rank 2: .*\): load it with"),
])
def test_bad_input_raises_the_same_clear_error_on_every_rank(case, message):
    with pytest.raises(RankFailure, match=message) as info:
        run(3, build_badly, case)
    assert "no answer" not in str(info.value)  # everyone raised: nobody was left blocking


# ----- GPU: the ledger against the CUDA caching allocator's own peak

def cuda_peak_against_ledger():
    width, depth = 1024, 4  # parameters dominate: 4 units of 2.1M fp32 parameters, activations 2 x 1024
    model = build(width, (width,) * depth, dtype=torch.float32)
    ours = FSDP(model, wrap=Block)
    x = torch.randn(2, width, device=device())
    unit = max(u.full.numel() * 4 for u in ours.units)
    ours(x).square().mean().backward()  # warm-up: cuBLAS takes its workspace from the same allocator
    for shard in ours.parameters():
        shard.grad = None
    peaks = []
    for grad in (False, True):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ours.ledger.reset()
        with torch.set_grad_enabled(grad):
            out = ours(x)
            if grad:
                out.square().mean().backward()
        torch.cuda.synchronize()
        peaks.append((ours.ledger.peak, torch.cuda.max_memory_allocated() - base))
        del out
    return peaks, unit, sum(u.shard_numel * 4 for u in ours.units)


@pytest.mark.skipif(BACKEND != "nccl" or not torch.cuda.is_available(),
                    reason="needs CUDA and MINI_DIST_BACKEND=nccl (./run.sh test --gpu): compares the ledger "
                           "with torch.cuda.max_memory_allocated, which only a GPU allocator reports")
@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameter_peak_matches_torch_cuda_max_memory_allocated(world):
    for peaks, unit, shards in run(world, cuda_peak_against_ledger):
        (forward_ledger, forward_cuda), (step_ledger, step_cuda) = peaks
        # forward under no_grad: beyond the shards only the gathered units and a few 8 KiB activations
        assert forward_ledger <= forward_cuda <= forward_ledger + (1 << 20)
        # a full step adds one unit's full gradient (and its pieces before they are concatenated), the
        # fp32 gradient shards and the saved activations: at most 2 units + shards + 1 MiB
        assert step_ledger <= step_cuda <= step_ledger + 2 * unit + shards + (1 << 20)


def test_a_dropped_fsdp_model_is_freed_with_its_flat_parameters_and_group():
    """The reduce-scatter hook sits on each unit's flat parameter, in C++: held strongly, it would keep the
    wrapper (and everything it shards) alive after the model is dropped."""
    from test_ddp import train_drop_and_collect
    assert run(2, train_drop_and_collect, FSDP) == [True, True]
