"""Protects the grid (docs/design.md §1): E1 coordinates, the groups of each axis, and validation that
fails early with a useful message on every rank instead of hanging."""

import os

import pytest
import torch.distributed as dist
from harness import grids_of

import axon4d
from axon4d.grid import rules
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridShape, factorizations


@pytest.mark.parametrize("world,count", [(1, 1), (2, 4), (4, 10), (8, 20), (12, 40)])
def test_factorizations_are_complete_and_exact(world, count):
    shapes = factorizations(world)
    assert len(shapes) == count == len(set(shapes))
    assert all(s.world_size == world for s in shapes)


def test_parse_fills_in_minus_one_and_accepts_dicts():
    assert GridShape.parse((2, -1, 1, 2), 8) == GridShape(2, 2, 1, 2)
    assert GridShape.parse({"x": 4, "data": 2}, 8) == GridShape(4, 1, 1, 2)
    assert GridShape.parse((1, 1, 1, -1), 6) == GridShape(1, 1, 1, 6)


@pytest.mark.parametrize(
    "grid,world,needle",
    [
        ((2, 2, 2, 2), 8, "has 16 ranks"),
        ((3, 1, 1, -1), 8, "does not divide the world size 8"),
        ((2, 2, 2), 8, "give 4 as (x, y, z, data)"),
        ((-1, -1, 2, 1), 8, "at most one size may be -1"),
        ((0, 1, 1, 8), 8, "must be positive"),
        ({"w": 8}, 8, "unknown grid axes"),
    ],
)
def test_parse_rejects_bad_grids_with_alternatives(grid, world, needle):
    with pytest.raises(ValueError) as e:
        GridShape.parse(grid, world)
    assert needle in str(e.value)


def test_wrong_product_lists_grids_that_work():
    with pytest.raises(ValueError, match=r"grids \(x, y, z, data\) that work: \(1, 1, 1, 4\)"):
        GridShape.parse((2, 2, 2, 1), 4)


def test_divisibility_rule_names_value_rule_and_alternatives():
    with pytest.raises(ValueError) as e:
        rules.divisible(6, "in_features", ["x"], "normal layers split in over x").check(GridShape(4, 1, 2, 1))
    msg = str(e.value)
    assert "in_features = 6" in msg and "G_x = 4" in msg and "normal layers" in msg
    assert "(1, 1, 8, 1)" in msg and "(2, 1, 4, 1)" in msg and "(4, 1, 2, 1)" not in msg


def _coords_and_groups(grid):
    members = {a: dist.get_process_group_ranks(grid.groups[a]) for a in ("x", "y", "z", "data", "batch")}
    return grid.rank, dict(grid.coords), members, str(grid)


@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_coordinates_follow_e1_and_groups_span_one_axis(pools, world):
    for shape in grids_of(world):
        gx, gy, gz, gd = shape
        for rank, c, members, text in pools(world).run(shape, _coords_and_groups):
            assert rank == ((c["data"] * gz + c["z"]) * gy + c["y"]) * gx + c["x"]  # E1
            assert c["batch"] == c["data"] * gz + c["z"]
            assert members["x"] == [rank - c["x"] + i for i in range(gx)]
            assert members["y"] == [rank + (i - c["y"]) * gx for i in range(gy)]
            assert members["z"] == [rank + (i - c["z"]) * gx * gy for i in range(gz)]
            assert members["data"] == [rank + (i - c["data"]) * gx * gy * gz for i in range(gd)]
            # the batch group orders ranks by d·G_z + z, the token chunk index
            assert members["batch"] == sorted(members["batch"])
            assert members["batch"].index(rank) == c["batch"] and len(members["batch"]) == gz * gd
            assert f"x={c['x']}, y={c['y']}" in text and f"Grid(x={gx}, y={gy}, z={gz}, data={gd})" in text


def _init_bad_grid(grid_arg):
    try:
        axon4d.init(grid=grid_arg)
    except ValueError as e:
        return str(e)
    axon4d.shutdown()
    return None


def test_wrong_grid_raises_on_every_rank_without_hanging(pools):
    msgs = pools(4).run(None, _init_bad_grid, (2, 2, 2, 1))
    assert all(m is not None and "world size is 4" in m for m in msgs)


def _init_twice(grid):
    try:
        axon4d.init(grid=(1, 1, 1, -1))
    except RuntimeError as e:
        return str(e)
    return None


def test_init_twice_is_an_error_that_names_the_grid(pools):
    msgs = pools(2).run((2, 1, 1, 1), _init_twice)
    assert all("already called" in m and "Grid(x=2" in m for m in msgs)


def test_get_grid_without_init_says_what_to_do():
    with pytest.raises(RuntimeError, match="call axon4d.init"):
        axon4d.get_grid()


def _threads():
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _noop(grid):
    return grid.rank


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_shutdown_releases_the_groups_threads(pools):
    pool = pools(4)
    pool.run((2, 1, 2, 1), _noop)
    before = pool.run(None, _threads)
    for _ in range(4):
        pool.run((2, 1, 2, 1), _noop)
    assert pool.run(None, _threads) == before  # gloo threads of destroyed groups do not pile up


def _train_on_grids_and_keep_them(grid):
    from axon4d.measure.probe import ProbeModel, measure_step
    from axon4d.plan.stepfit import parse_model

    wl = parse_model("layers=1,hidden=32,heads=4,vocab=32,seq=8,batch=4")
    before, kept = _threads(), []
    for shape in [(2, 1, 2, 1), (1, 2, 1, 2), (4, 1, 1, 1)]:
        g = Grid(GridShape(*shape), grid.device, launcher="existing")
        model = ProbeModel(wl, g)
        measure_step(model, steps=1, warmup=1)  # layers, optimizer state and autograd graphs on g
        g.destroy()
        kept.append((g, model))  # the caller still holds the grid and its layers
    return before, _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_destroy_releases_the_groups_threads_while_the_grid_and_its_layers_are_still_held(pools):
    # a benchmark or the calibration builds grid after grid in one process: the destroyed groups'
    # transport threads must not pile up and time-slice with later steps
    for before, after in pools(4).run((1, 1, 1, 4), _train_on_grids_and_keep_them):
        assert after == before


def _host_group_timeout(grid):
    """The seconds the grid's host group was made with (``axon4d.comm.communicator.host_group``'s argument)."""
    import axon4d.grid.mesh as grid_module

    made = []
    real = grid_module.host_group
    grid_module.host_group = lambda timeout_s: made.append(timeout_s) or real(timeout_s)
    try:
        grid.host_group()
    finally:
        grid_module.host_group = real
    return grid.timeout_s, made


def test_the_host_group_takes_init_s_timeout(pools):
    for timeout_s, made in pools(2).run((1, 1, 1, 2), _host_group_timeout, timeout_s=77.0):
        assert timeout_s == 77.0 and made == [77.0], (timeout_s, made)
