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


@pytest.mark.exercise
@pytest.mark.single_process
@given(grids())
def test_rank_coords_and_groups_equal_an_enumeration_of_the_grid_with_tp_fastest(drawn):
    """RankGrid.rank, coords and groups (the exercise) against the grid enumerated in (dp, pp, cp, tp) order."""
    grid = mesh.RankGrid(drawn.dp, drawn.pp, drawn.cp, drawn.tp, drawn.ep)  # the module's class, at call time
    places = list(itertools.product(*(range(getattr(grid, a)) for a in AXES)))
    for r, (d, p, c, t) in enumerate(places):
        got = grid.rank(d, p, c, t)
        assert got == r, f"{grid}: rank(dp={d}, pp={p}, cp={c}, tp={t}) = {got}, want {r}"
        f = d * grid.cp + c
        want = {"dp": d, "pp": p, "cp": c, "tp": t, "ep_index": f % grid.ep, "ep_replica": f // grid.ep}
        assert grid.coords(r) == want, f"{grid}: coords({r}) = {grid.coords(r)}, want {want}"
    for name in GROUPS:
        want = sorted({tuple(q for q in range(grid.size) if all(grid.coords(q)[k] == grid.coords(r)[k]
                                                               for k in mesh.SHARED[name])) for r in range(grid.size)})
        got = sorted(tuple(g) for g in grid.groups(name))
        assert got == want, f"{grid}: groups({name!r}) = {got}, want {want}"


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
