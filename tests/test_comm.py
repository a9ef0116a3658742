"""The collectives with gradients (mini_dist/comm.py) equal the one-process computation they stand for.

Each operator runs on every rank, each rank backpropagates its own output weights, and the same thing is redone
in one process with autograd on everyone's inputs and weights (comm.check_operator). The data are small
integers in fp64, so every sum is exact whatever order the ranks add in: outputs and gradients must be equal,
not close. The all-to-alls comm imports (mini_dist/all_to_all.py) are tests/test_all_to_all.py's.
Debug mode (MINI_DIST_DEBUG, on in the pools) must name the rank that disagrees, on every rank, and issue no
collective at all when off.
"""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from grading import mistake
from harness import RankFailure, device, rank_generator, run, subgroup
from mini_dist import comm
from mini_dist.kit import debug


def check_all(shape_per_rank, seed, group_size):
    """Every operator on a subgroup of the first group_size ranks (the others idle)."""
    group = subgroup(range(group_size))
    if dist.get_rank() >= group_size:
        return {}
    b, s, h = shape_per_rank
    T = group_size
    return {name: comm.check_operator(name, comm.input_shape(name, b, s * T, h * T, T), seed, group)
            for name in comm.CASES}


@given(world=st.integers(1, 5), data=st.data(), b=st.integers(1, 2), s=st.integers(1, 3), h=st.integers(1, 3),
       seed=st.integers(0, 50))
def test_every_operator_equals_its_one_process_meaning_exactly(world, data, b, s, h, seed):
    group_size = data.draw(st.integers(1, world))
    results = run(world, check_all, (b, s, h), seed, group_size)
    D = b * s * group_size * h * group_size * 8  # bytes of the full fp64 tensor
    T = group_size
    payload = {"f": D, "g": D, "gather_from_tp": D, "split_to_tp": D, "gather_from_sp": 2 * D,
               "reduce_scatter_to_sp": 2 * D}
    assert sorted(payload) == sorted(comm.CASES)
    for rank, per_op in enumerate(results[:group_size]):
        for name, (diff, nbytes) in per_op.items():
            assert diff == 0.0, (rank, name)
            assert nbytes == (payload[name] if T > 1 else 0), (rank, name, nbytes)


# ----- Megatron's f and g, the learner's exercise (./run.sh check comm), and the mistakes a check names

MISTAKES = {  # each is made by a wrong solution of tests/bank_comm.py (tests/test_exercise.py holds that)
    "f's backward does not reduce": ("CopyToParallelRegion.backward", "each rank's grad is only its share of "
                                     "dL/dx: sum it over the ranks (all_reduce)"),
    "reduced twice": ("ReduceFromParallelRegion.backward", "grad is already the whole dL/dy on every rank: g's "
                      "backward passes it on as it is"),
    "forward and backward swapped": ("CopyToParallelRegion.forward", "f is the identity forward and sums "
                                     "backward; g sums forward and is the identity backward"),
    "an average for a sum": ("ReduceFromParallelRegion.forward", "y is the sum of the partial results, not "
                             "their mean: no division by the group's size"),
}


def f_and_g(seed, shape):
    """Megatron's f and g on integer fp64 data (every sum exact), each beside what it must equal:
    ([(what, ours, the one-process value)], this rank's own tensor, the replicated one)."""
    g = rank_generator(seed)
    replicated = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(seed)).double().to(device())
    own = torch.randint(-8, 8, shape, generator=g).double().to(device())
    a, b = replicated.clone().requires_grad_(), own.clone().requires_grad_()
    y = comm.f(a)                      # forward identity
    (y * own).sum().backward()         # each rank's loss weighs y by its own tensor: a partial gradient
    z = comm.g(b)                      # forward: the sum of the ranks' partial results
    (z * replicated).sum().backward()  # one loss, the same on every rank
    total = own.clone()
    dist.all_reduce(total)
    return [("f forward", y.detach(), replicated), ("f backward", a.grad, total),
            ("g forward", z.detach(), total), ("g backward", b.grad, replicated)], own, replicated


def f_and_g_mistake(world, checks, own, replicated) -> str | None:
    """The classic mistake behind f's and g's results, read from them: each is a multiple of a known tensor."""
    got = {what: ours for what, ours, _ in checks}
    total = checks[2][2]

    def equal(what, value):
        return got[what] is not None and got[what].shape == value.shape and torch.equal(got[what], value)
    if world < 2:
        return None
    swapped = []
    if equal("f forward", world * replicated):
        swapped.append(f"f's forward summed x over the ranks (its output is {world} x its input)")
    if equal("g forward", own) and equal("g backward", world * replicated):
        swapped.append("g's forward returned each rank's own x and its backward summed dy")
    if swapped:
        return mistake(MISTAKES, "forward and backward swapped", " and ".join(swapped))
    if equal("f backward", own):
        return mistake(MISTAKES, "f's backward does not reduce", "dx from f is each rank's own grad, not the sum "
                       f"over the {world} ranks")
    if equal("g backward", world * replicated):
        return mistake(MISTAKES, "reduced twice", f"dx from g is {world} (T) times dL/dy: dy was summed over the "
                       f"ranks again")
    for what, where in (("g forward", "ReduceFromParallelRegion.forward"), ("f backward",
                                                                         "CopyToParallelRegion.backward")):
        if equal(what, total / world):
            return mistake(MISTAKES, "an average for a sum", f"{what} is the mean over the {world} ranks, {world} "
                           f"(T) times too small", where)
    return None


@pytest.mark.exercise(judges=("CopyToParallelRegion.backward", "ReduceFromParallelRegion.forward",
                              "CopyToParallelRegion.forward", "ReduceFromParallelRegion.backward"))
@given(world=st.integers(1, 5), shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
       seed=st.integers(0, 100))
def test_f_is_identity_then_all_reduce_and_g_is_all_reduce_then_identity(world, shape, seed):
    """f: x as it is forward, dx summed over the ranks backward; g: the ranks' x summed forward, dy as it is backward

    Small integers in fp64: every sum exact in any order, so every rank's outputs and gradients must equal the
    one-process values exactly."""
    for rank, (checks, own, replicated) in enumerate(run(world, f_and_g, seed, shape)):
        for what, ours, want in checks:
            assert ours is not None and ours.shape == want.shape, f"rank {rank} {what}: got {ours}, want shape " \
                                                                  f"{tuple(want.shape)}"
        for what, ours, want in checks:
            off = (ours != want).reshape(-1).nonzero()
            i = off[0].item() if len(off) else None
            found = f_and_g_mistake(world, checks, own, replicated) if i is not None else None
            assert i is None, f"rank {rank} {what} element {i}: got {ours.reshape(-1)[i].item():g}, want " \
                              f"{want.reshape(-1)[i].item():g}" + (f"\n{found}" if found else "")


def mismatched_all_reduce(bad_rank):
    shape = (3, 2, 6) if dist.get_rank() == bad_rank else (2, 3, 6)  # same numel: a plain all-reduce would "work"
    x = torch.ones(shape, device=device())
    return comm.g(x).shape


@pytest.mark.parametrize("world", [2, 3, 5])
def test_debug_mode_names_the_rank_whose_shape_differs_on_every_rank(world):
    bad = world - 1
    with pytest.raises(RankFailure) as failure:
        run(world, mismatched_all_reduce, bad)
    text = str(failure.value)
    for rank in range(world):  # every rank raised the same named error (no one hung, no one returned)
        assert f"rank {rank} failed: Disagreement" in text
    assert f"rank {bad} calls all_reduce ((3, 2, 6)" in text and "rank 0 calls all_reduce ((2, 3, 6)" in text
    assert run(world, mismatched_all_reduce, -1)[0] == (2, 3, 6)  # the pool is usable afterwards


def count_collectives_with_debug(on):
    """How many torch.distributed calls one f/g/gather round issues, with debug mode on or off."""
    calls = []
    names = ("all_reduce", "all_gather", "all_gather_single", "all_gather_object", "reduce_scatter_single",
             "all_to_all_single", "broadcast")
    originals = {n: getattr(dist, n) for n in names}

    def counting(n):
        def call(*args, **kwargs):
            calls.append(n)
            return originals[n](*args, **kwargs)
        return call
    before, debug.DEBUG = debug.DEBUG, on
    for n in names:
        setattr(dist, n, counting(n))
    try:
        x = torch.ones(2, 4, 6, device=device(), requires_grad=True)
        y = comm.gather_from_sp(comm.g(comm.f(x)))
        comm.all_to_all(comm.reduce_scatter_to_sp(y), -1, 1).sum().backward()
    finally:
        debug.DEBUG = before
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return calls


def test_debug_mode_off_issues_no_extra_collective():
    off, on = run(2, count_collectives_with_debug, False)[0], run(2, count_collectives_with_debug, True)[0]
    # forward: g all-reduce, gather all-gather, reduce-scatter, all-to-all; backward: the four conjugates
    # (all-to-all, all-gather, reduce-scatter, f's all-reduce; g's backward is free)
    assert off == ["all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single",
                   "all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce"]
    assert len(on) > len(off) and "all_gather_object" in on
