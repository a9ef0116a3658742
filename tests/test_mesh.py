"""The DP x PP x TP grid: groups partition the world, TP is innermost, and torch's DeviceMesh agrees; degrees
left out are filled in, and degrees that cannot fill the world are refused saying which flags to change."""
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from harness import RankFailure, device, run
from mini_dist.launch import UsageError
from mini_dist.mesh import AXES, Mesh, RankGrid, grid_for

degrees = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))


@given(degrees)
def test_each_axis_partitions_the_world_and_coords_invert_rank(dims):
    grid = RankGrid(*dims)
    for axis in AXES:
        groups = grid.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(grid.size))
        assert all(len(g) == getattr(grid, axis) for g in groups)
        for g in groups:  # the members differ only in this axis's coordinate
            for other in AXES:
                assert len({grid.coords(r)[other] for r in g}) == (len(g) if other == axis else 1)
    assert [grid.rank(**grid.coords(r)) for r in range(grid.size)] == list(range(grid.size))


@given(degrees)
def test_tensor_parallel_ranks_are_adjacent_so_they_share_a_node(dims):
    for g in RankGrid(*dims).groups("tp"):
        assert g == list(range(g[0], g[0] + len(g)))


def factorisations(n):
    return [(d, p, n // (d * p)) for d in range(1, n + 1) for p in range(1, n + 1) if n % (d * p) == 0]


def mesh_vs_device_mesh(dims):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = Mesh(*dims)
    reference = init_device_mesh(device().type, dims, mesh_dim_names=AXES)
    sums = {}
    for axis in AXES:
        t = torch.tensor([float(dist.get_rank())], device=device())
        dist.all_reduce(t, group=mesh.group[axis])
        sums[axis] = t.item()
    return ({a: dist.get_process_group_ranks(reference.get_group(a)) for a in AXES}, mesh.ranks, sums,
            (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mesh_groups_equal_device_mesh_for_every_factorisation(world):
    for dims in factorisations(world):
        for rank, (reference, ours, sums, coords) in enumerate(run(world, mesh_vs_device_mesh, dims)):
            assert ours == reference, dims
            assert sums == {a: float(sum(ours[a])) for a in AXES}
            assert coords == tuple(RankGrid(*dims).coords(rank)[a] for a in AXES)


def test_degrees_whose_product_is_not_the_world_are_rejected_on_every_rank():
    with pytest.raises(RankFailure, match=r"dp x pp x tp = 2 x 1 x 2 = 4 ranks, but the world has 3"):
        run(3, mesh_vs_device_mesh, (2, 1, 2))
    with pytest.raises(ValueError, match="--tp must be at least 1"):
        RankGrid(1, 1, 0)


@given(st.integers(1, 16), st.integers(1, 3), st.data())
def test_grid_for_fills_in_the_degrees_left_out_so_that_all_multiply_to_the_world(world, default_pp, data):
    degrees = {axis: data.draw(st.none() | st.integers(1, 8)) for axis in AXES}
    given_ = {a: d for a, d in degrees.items() if d is not None}
    fixed = math.prod(given_.values())
    if world % fixed or (len(given_) == 3 and fixed != world):
        with pytest.raises(UsageError, match=" x ".join(f"--{a} {d}" for a, d in given_.items())):
            grid_for(world, **degrees, default_pp=default_pp)
        return
    grid = grid_for(world, **degrees, default_pp=default_pp)
    assert grid.size == world and all(getattr(grid, a) == d for a, d in given_.items())
    if degrees["tp"] is None and (degrees["pp"] is None or degrees["dp"] is None) and (world // fixed) % 2 == 0:
        assert grid.tp == 2  # the default a missing tp takes where what is left allows it


@pytest.mark.parametrize("world, degrees, says", [
    (4, dict(pp=3), "--pp 3 does not divide the world of 4 ranks: choose degrees whose product divides 4"),
    (4, dict(dp=3, tp=2), "--dp 3 x --tp 2 = 6 does not divide the world of 4 ranks"),
    (4, dict(dp=1, pp=1, tp=2), "--dp 1 x --pp 1 x --tp 2 = 2 ranks, but the world has 4: choose degrees whose "
                                "product is 4"),
    (4, dict(dp=0), "--dp must be at least 1, got 0")])
def test_degrees_that_cannot_fill_the_world_name_the_flags_the_user_gave(world, degrees, says):
    with pytest.raises(UsageError) as info:
        grid_for(world, **degrees)
    assert str(info.value).startswith(says)
