"""The DP x PP x CP x TP grid and its EP groups: every kind of group partitions the world, TP is innermost and CP
next to it, and torch's DeviceMesh (with dp x cp flattened and unflattened into edp x ep, as torchtitan builds
them) agrees; degrees left out are filled in, and degrees that cannot fill the world are refused saying which
flags to change."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from grading import mistake
from harness import RankFailure, device, run
from mini_dist import mesh
from mini_dist.kit.launch import UsageError
from mini_dist.mesh import AXES, GROUPS, Mesh, RankGrid, grid_for


@st.composite
def grids(draw):
    dims = {a: draw(st.integers(1, 3)) for a in AXES}
    product = dims["dp"] * dims["cp"]
    ep = draw(st.sampled_from([e for e in range(1, product + 1) if product % e == 0]))
    return RankGrid(**dims, ep=ep)


# ----- the grid's arithmetic, the learner's exercise (./run.sh check mesh), and the mistakes a check names

MISTAKES = {  # each is made by a wrong solution of tests/bank_mesh.py (tests/test_exercise.py holds that)
    "axes in the wrong order": ("RankGrid.coords", "tp varies fastest (ranks r and r+1 differ in tp), then cp, then "
                                "pp, and dp slowest: take the axes in that order"),
    "a stride off by one": ("RankGrid.rank", "an axis's stride, how far apart two ranks one step along it are, is "
                            "the product of the degrees of the axes inside it (a degree counts the places, one more "
                            "than the largest coordinate)"),
    "groups mix coordinates": ("RankGrid.groups", "a group of kind `name` holds the ranks that agree on every "
                               "coordinate SHARED[name] lists, and differ in the others"),
    "ep_index and ep_replica swapped": ("RankGrid.coords", "ep_index says which experts a rank holds, so it changes "
                                       "from one rank of an EP group to the next; ep_replica says which EP group, "
                                       "the same for all of them"),
}
INNER_FIRST = AXES[::-1]  # tp, cp, pp, dp: the order of the strides, the smallest first
PROBE = dict(dp=2, pp=3, cp=2, tp=3, ep=2)  # every axis moves, neighbours of unequal degree: a stride names its axis


def places(grid) -> list[tuple]:
    """Every (dp, pp, cp, tp) of the grid, in the order of the ranks (the enumeration is the contract)."""
    return list(itertools.product(*(range(getattr(grid, a)) for a in AXES)))


def want_coords(grid, r: int) -> dict:
    d, p, c, t = places(grid)[r]
    f = d * grid.cp + c
    return {"dp": d, "pp": p, "cp": c, "tp": t, "ep_index": f % grid.ep, "ep_replica": f // grid.ep}


def place(coords) -> str:
    return "(" + ", ".join(f"{a} {coords[a]}" for a in AXES) + ")"


def strides(grid, order) -> dict:
    """axis -> stride when the axes vary in `order`, the fastest first."""
    found = {}
    step = 1
    for axis in order:
        found[axis] = step
        step *= getattr(grid, axis)
    return found


def one_off(grid, axis, stride) -> bool:
    """The stride of `axis`, off by one: one more or less, or one degree inside it taken one more or less."""
    inside = [getattr(grid, a) for a in INNER_FIRST[:INNER_FIRST.index(axis)]]
    right = math.prod(inside)
    return stride in (right - 1, right + 1) or any(stride == right // d * (d + k) for d in inside for k in (-1, 1))


def stride_mistake(grid, theirs: dict, said, where: str) -> str | None:
    """What is wrong with the strides a learner's function has (theirs: axis -> stride): the axes in another order,
    or one stride off by one. said(axis): the learner's figure that shows that axis's stride."""
    right = strides(grid, INNER_FIRST)
    if theirs == right:
        return None
    for order in itertools.permutations(INNER_FIRST):
        if strides(grid, order) == theirs:
            if order[0] != "tp":
                how = f"{said(order[0])}: {order[0]} varies fastest, tp should"
            else:
                moved = [a for a, b in zip(order, INNER_FIRST) if a != b]
                how = (f"{said(moved[0])}: your ranks count {', '.join(order)} from the fastest to the slowest, "
                       f"{' and '.join(moved)} swapped")
            return mistake(MISTAKES, "axes in the wrong order", f"on {grid_name(grid)}, {how}", where)
    axis = next(a for a in INNER_FIRST if theirs[a] != right[a])
    if one_off(grid, axis, theirs[axis]):
        inside = " x ".join(INNER_FIRST[:INNER_FIRST.index(axis)])
        return mistake(MISTAKES, "a stride off by one", f"on {grid_name(grid)}, {said(axis)}: {axis}'s stride is "
                       f"{theirs[axis]}, it should be {inside} = {right[axis]}", where)
    return None


def grid_name(grid) -> str:
    return "RankGrid(" + ", ".join(f"{a}={getattr(grid, a)}" for a in AXES + ("ep",)) + ")"


def rank_mistake() -> str | None:
    """The strides of the learner's rank() on the probe grid, when it is a sum of coordinates times strides."""
    grid = mesh.RankGrid(**PROBE)
    try:
        got = {p: grid.rank(*p) for p in places(grid)}
    except Exception:  # the failing property already says what it raised
        return None
    unit = {a: tuple(int(b == a) for b in AXES) for a in AXES}
    theirs = {a: got[unit[a]] - got[(0, 0, 0, 0)] for a in AXES}
    if got[(0, 0, 0, 0)] != 0 or any(got[p] != sum(c * theirs[a] for c, a in zip(p, AXES)) for p in got):
        return None

    def said(axis):
        return f"your rank({', '.join(f'{b}={int(b == axis)}' for b in AXES)}) is {theirs[axis]}"
    return stride_mistake(grid, theirs, said, "RankGrid.rank")


def coords_mistake() -> str | None:
    """What the learner's coords() on the probe grid is: the axes peeled in another order, a stride one off, or
    the right coordinates with ep_index and ep_replica exchanged (or f's axes in another order)."""
    grid = mesh.RankGrid(**PROBE)
    try:
        got = [grid.coords(r) for r in range(grid.size)]
        theirs = [tuple(c[a] for a in AXES) for c in got]
    except Exception:  # the failing property already says what it raised, or which key is missing
        return None
    first = {a: next((r for r in range(grid.size) if theirs[r][i] == 1), None) for i, a in enumerate(AXES)}
    decoded = [tuple(r // first[a] % getattr(grid, a) for a in AXES) for r in range(grid.size)] if all(
        first.values()) else None
    if theirs != places(grid) and theirs == decoded:
        return stride_mistake(grid, first, lambda a: f"your coords({first[a]}) is {place(got[first[a]])}",
                              "RankGrid.coords")
    if theirs != places(grid):
        return None
    f = [d * grid.cp + c for d, _, c, _ in theirs]
    ep = [(c["ep_index"], c["ep_replica"]) for c in got]
    if ep == [(x // grid.ep, x % grid.ep) for x in f]:
        r = next(r for r in range(grid.size) if f[r] // grid.ep != f[r] % grid.ep)
        return mistake(MISTAKES, "ep_index and ep_replica swapped", f"on {grid_name(grid)}, your coords({r}) gives "
                       f"ep_index {ep[r][0]}, ep_replica {ep[r][1]}, its place f = dp_index * cp + cp_index = {f[r]} "
                       f"counted the other way round: ranks {f.index(0)} and {f.index(1)}, one EP group, get the "
                       f"same ep_index")
    swapped = [d + c * grid.dp for d, _, c, _ in theirs]
    if ep == [(x % grid.ep, x // grid.ep) for x in swapped]:
        return mistake(MISTAKES, "axes in the wrong order", f"on {grid_name(grid)}, your ep_index and ep_replica "
                       f"number the dp x cp places with dp fastest: cp should vary fastest in f, as in rank()",
                       "RankGrid.coords")
    return None


def groups_mistake(grid, name, got) -> str | None:
    """The learner's groups of one kind, read: tagged by the coordinates their ranks should differ in, or one of
    them holding two ranks that differ in a coordinate the kind's ranks share."""
    c = [want_coords(grid, r) for r in range(grid.size)]
    others = [a for a in AXES if a not in mesh.SHARED[name]]
    tagged = {}
    for r in range(grid.size):
        tagged.setdefault(tuple(c[r][a] for a in others), []).append(r)
    if sorted(map(tuple, got)) == sorted(map(tuple, tagged.values())) and len(tagged) < grid.size:
        return mistake(MISTAKES, "groups mix coordinates", f"your {name} groups, {got}, are the ranks with the same "
                       f"{', '.join(others)}: a {name} group's ranks share {', '.join(mesh.SHARED[name])} and differ "
                       f"in {', '.join(others)}")
    for group in got:
        pairs = [(a, b) for a in group for b in group if any(c[a][k] != c[b][k] for k in mesh.SHARED[name])]
        if pairs:
            a, b = pairs[0]
            differ = [k for k in mesh.SHARED[name] if c[a][k] != c[b][k]]
            return mistake(MISTAKES, "groups mix coordinates", f"your {name} group {group} holds rank {a} "
                           f"{place(c[a])} and rank {b} {place(c[b])}: they differ in {', '.join(differ)}, which "
                           f"the ranks of a {name} group share")
    return None


def also(said: str, found: str | None) -> str:
    """A failure's words, and the mistake behind it on a line of its own where one was recognised."""
    return f"{said}\n{found}" if found else said


def plain_int(value) -> bool:
    return type(value) is int


@pytest.mark.exercise(judges=("RankGrid.rank",))
@pytest.mark.single_process
@given(grids())
def test_rank_numbers_the_places_tp_fastest_then_cp_then_pp_and_dp_slowest(drawn):
    """RankGrid.rank: the grid's places, (dp, pp, cp, tp) with tp fastest and dp slowest, are ranks 0, 1, 2, ... (exact)

    Ranks are integers: exact, whichever way it is written (a sum of coordinates times strides, Horner's form, a
    table of the places)."""
    grid = mesh.RankGrid(drawn.dp, drawn.pp, drawn.cp, drawn.tp, drawn.ep)  # the module's class, at call time
    for r, (d, p, c, t) in enumerate(places(grid)):
        got = grid.rank(d, p, c, t)
        if got != r or not plain_int(got):
            found = rank_mistake()
            assert False, also(f"{grid_name(grid)}: rank(dp={d}, pp={p}, cp={c}, tp={t}) is {got!r}, want {r} "
                               f"(the places counted with tp fastest, then cp, pp, and dp slowest)", found)


@pytest.mark.exercise(judges=("RankGrid.coords",))
@pytest.mark.single_process
@given(grids())
def test_coords_is_the_place_rank_numbers_and_the_ranks_place_in_expert_parallelism(drawn):
    """RankGrid.coords: rank() inverted, and ep_index = f % ep, ep_replica = f // ep of
    f = dp_index * cp + cp_index (exact)

    Six integers per rank, exact, whichever way they are found (divisions and remainders, divmod, a table)."""
    grid = mesh.RankGrid(drawn.dp, drawn.pp, drawn.cp, drawn.tp, drawn.ep)
    for r in range(grid.size):
        got = grid.coords(r)
        want = want_coords(grid, r)
        wrong = not isinstance(got, dict) or got != want or not all(plain_int(v) for v in got.values())
        if wrong:
            found = coords_mistake()
            ints = "" if not isinstance(got, dict) or got != want else ": ints, not floats (// divides to an int)"
            assert False, also(f"{grid_name(grid)}: coords({r}) is {got!r}, want {want}{ints}", found)


@pytest.mark.exercise(judges=("RankGrid.groups",))
@pytest.mark.single_process
@given(grids())
def test_groups_of_a_kind_part_the_world_into_the_ranks_that_share_its_coordinates(drawn):
    """RankGrid.groups: every rank in one group of each kind, with exactly the ranks sharing SHARED[name], in
    increasing order

    Compared as sets of groups: the groups may come in any order, the ranks in each in increasing order (the
    order torch.distributed numbers a process group's ranks)."""
    grid = mesh.RankGrid(drawn.dp, drawn.pp, drawn.cp, drawn.tp, drawn.ep)
    c = [want_coords(grid, r) for r in range(grid.size)]
    for name in GROUPS:
        got = grid.groups(name)
        said = f"{grid_name(grid)}: groups({name!r}) is {got!r}"
        assert isinstance(got, list) and all(isinstance(g, list) and all(plain_int(r) for r in g) for g in got), \
            f"{said}: want a list of lists of ranks (ints)"
        found = groups_mistake(grid, name, got)
        for g in got:
            assert g == sorted(set(g)), f"{said}: the group {g} must list its ranks once each, in increasing order"
            mixed = [a for a in g for k in mesh.SHARED[name] if c[a][k] != c[g[0]][k]]
            assert not mixed, also(f"{said}: rank {g[0]} {place(c[g[0]])} and rank {mixed[0]} "
                                   f"{place(c[mixed[0]])} share a group but not every coordinate of "
                                   f"{mesh.SHARED[name]}", found)
        for r in range(grid.size):
            mine = [g for g in got if r in g]
            want = [q for q in range(grid.size) if all(c[q][k] == c[r][k] for k in mesh.SHARED[name])]
            assert len(mine) == 1, f"{said}: rank {r} is in {len(mine)} of them, want exactly one"
            assert mine[0] == want, also(f"{said}: rank {r} {place(c[r])} is in {mine[0]}, want {want}: every "
                                         f"rank that shares its {', '.join(mesh.SHARED[name])}", found)


def expected_size(grid, name):
    return {"dp_cp": grid.dp * grid.cp, "ep": grid.ep, "edp": grid.dp * grid.cp // grid.ep}.get(
        name, getattr(grid, name, None))


@pytest.mark.single_process
@given(grids())
def test_every_group_kind_partitions_the_world_and_coords_invert_rank(grid):
    for name in GROUPS:
        groups = grid.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(grid.size)), name
        assert all(len(g) == expected_size(grid, name) for g in groups), name
    for axis in AXES:  # the members of an axis's group differ only in that axis's coordinate
        for g in grid.groups(axis):
            for other in AXES:
                assert len({grid.coords(r)[other] for r in g}) == (len(g) if other == axis else 1)
    for g in grid.groups("dp_cp"):  # same weights: same pp and tp, every (dp, cp) pair once
        assert len({(grid.coords(r)["pp"], grid.coords(r)["tp"]) for r in g}) == 1
        assert len({(grid.coords(r)["dp"], grid.coords(r)["cp"]) for r in g}) == grid.dp * grid.cp
    for g in grid.groups("ep"):  # ep consecutive places f = dp_index * cp + cp_index of the dp x cp product
        f = [grid.coords(r)["dp"] * grid.cp + grid.coords(r)["cp"] for r in g]
        assert f == list(range(f[0], f[0] + grid.ep)) and f[0] % grid.ep == 0
    for g in grid.groups("edp"):  # the ranks that hold the same experts: one per EP group
        assert len({grid.coords(r)["ep_index"] for r in g}) == 1
        assert len({grid.coords(r)["ep_replica"] for r in g}) == len(g)
    assert [grid.rank(*(grid.coords(r)[a] for a in AXES)) for r in range(grid.size)] == list(range(grid.size))


@pytest.mark.single_process
@given(grids())
def test_tensor_parallel_ranks_are_adjacent_and_context_parallel_groups_next_to_them(grid):
    for g in grid.groups("tp"):
        assert g == list(range(g[0], g[0] + len(g)))
    for g in grid.groups("cp"):
        assert g == list(range(g[0], g[0] + grid.cp * grid.tp, grid.tp))


def factorisations(n):
    """Every (dp, pp, cp, tp) whose product is n, with every ep that divides dp x cp."""
    result = []
    for dp in range(1, n + 1):
        for pp in range(1, n + 1):
            for cp in range(1, n + 1):
                if n % (dp * pp * cp) == 0:
                    result += [(dp, pp, cp, n // (dp * pp * cp), ep) for ep in range(1, dp * cp + 1)
                               if dp * cp % ep == 0]
    return result


def mesh_vs_device_mesh(dims):
    """Our groups, torch's (built here, independently of mini_dist.mesh), an all-reduce per group, our coords.
    Every group made here is destroyed before returning: gloo gives each group threads of its own, and the
    ranks live on for the rest of the suite."""
    before = set(dist.distributed_c10d._world.pg_map)
    try:
        return compare_groups(dims)
    finally:
        for group in set(dist.distributed_c10d._world.pg_map) - before:
            dist.destroy_process_group(group)


def compare_groups(dims):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = Mesh(*dims)
    dp, pp, cp, tp, ep = dims
    reference = init_device_mesh(device().type, (dp, pp, cp, tp), mesh_dim_names=AXES)
    flat = reference["dp", "cp"]._flatten("dp_cp")
    expert = flat._unflatten(0, (dp * cp // ep, ep), ("edp", "ep"))
    owner = {**{a: reference for a in AXES}, "dp_cp": flat, "ep": expert, "edp": expert}
    sums = {}
    for name in GROUPS:
        t = torch.tensor([float(dist.get_rank())], device=device())
        dist.all_reduce(t, group=mesh.group[name])
        sums[name] = t.item()
    return ({n: dist.get_process_group_ranks(owner[n].get_group(n)) for n in GROUPS}, mesh.ranks, sums,
            (mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mesh_groups_equal_device_mesh_for_every_factorisation(world):
    for dims in factorisations(world):
        for rank, (reference, ours, sums, coords) in enumerate(run(world, mesh_vs_device_mesh, dims)):
            assert ours == reference, dims
            assert sums == {n: float(sum(ours[n])) for n in GROUPS}
            assert coords == tuple(RankGrid(*dims).coords(rank)[a] for a in AXES)


def test_degrees_whose_product_is_not_the_world_are_rejected_on_every_rank():
    with pytest.raises(RankFailure, match=r"dp x pp x cp x tp = 2 x 1 x 1 x 2 = 4 ranks, but the world has 3"):
        run(3, mesh_vs_device_mesh, (2, 1, 1, 2, 1))
    with pytest.raises(ValueError, match="--tp must be at least 1"):
        RankGrid(1, 1, 1, 0)
    with pytest.raises(ValueError, match="--ep 3 must divide dp x cp = 2 x 1 = 2"):
        RankGrid(2, 1, 1, 1, ep=3)


@pytest.mark.single_process
@given(st.integers(1, 16), st.integers(1, 3), st.data())
def test_grid_for_fills_in_the_degrees_left_out_so_that_all_multiply_to_the_world(world, default_pp, data):
    degrees = {axis: data.draw(st.none() | st.integers(1, 8)) for axis in AXES}
    given_ = {a: d for a, d in degrees.items() if d is not None}
    fixed = math.prod(given_.values())
    if world % fixed or (len(given_) == len(AXES) and fixed != world):
        with pytest.raises(UsageError, match=" x ".join(f"--{a} {d}" for a, d in given_.items())):
            grid_for(world, **degrees, default_pp=default_pp)
        return
    grid = grid_for(world, **degrees, default_pp=default_pp)
    assert grid.size == world and all(getattr(grid, a) == d for a, d in given_.items())
    missing = [a for a in AXES if a not in given_]
    if "tp" in missing and len(missing) > 1 and (world // fixed) % 2 == 0:
        assert grid.tp == 2  # the default a missing tp takes where what is left allows it
    if "cp" in missing and ("dp" in missing or "pp" in missing):
        assert grid.cp == 1  # context parallelism only when asked for, or when it is all that is left to fill


@pytest.mark.parametrize("world, degrees, says", [
    (4, dict(pp=3), "--pp 3 does not divide the world of 4 ranks: choose degrees whose product divides 4"),
    (4, dict(dp=3, tp=2), "--dp 3 x --tp 2 = 6 does not divide the world of 4 ranks"),
    (4, dict(dp=1, pp=1, cp=1, tp=2), "--dp 1 x --pp 1 x --cp 1 x --tp 2 = 2 ranks, but the world has 4: choose "
                                      "degrees whose product is 4"),
    (4, dict(dp=2, tp=2, ep=4), "--ep 4 must divide dp x cp = 2 x 1 = 2"),
    (4, dict(dp=0), "--dp must be at least 1, got 0")])
def test_degrees_that_cannot_fill_the_world_name_the_flags_the_user_gave(world, degrees, says):
    with pytest.raises(UsageError) as info:
        grid_for(world, **degrees)
    assert str(info.value).startswith(says)
