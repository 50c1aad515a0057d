"""Protects axon4d.Linear (docs/design.md §2): on every grid of 1, 2, 4 and 8 ranks it must equal the
plain single-process torch.nn.Linear in forward output, input gradient, weight gradient and bias
gradient — normal, transposed, chained, with padding over z, in fp32 and bf16.

Loss convention (DDP-like, see axon4d/nn/linear.py): each rank's loss is the mean over its own
tokens, so parameter gradients equal the reference's gradient of the global mean, and the input
gradient of a rank is G_batch times the reference's (it is the gradient of the local mean)."""

import pytest
import torch
from torch import nn

import axon4d
from harness import grids_of, value_errors

FP32_TOL = 1e-5  # max abs error relative to the reference tensor's scale
BF16_TOL = 3e-2  # bf16 keeps 8 significant bits; reductions over the grid add a few roundings


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _loss_weights(out_features, seed):
    return torch.randn(out_features, generator=torch.Generator().manual_seed(seed))


def _run_chain(grid, specs, lead, dtype, seed):
    """Apply layers given by ``specs`` = [(in, out, bias, transpose), ...] and compare everything.

    Returns {name: relative error}. Consecutive specs must chain (normal → transposed or vice versa).
    """
    torch.manual_seed(seed)
    denses = [nn.Linear(i, o, bias=b) for i, o, b, _ in specs]
    for d in denses:  # round the reference weights to the layer dtype so both see the same values
        with torch.no_grad():
            d.weight.copy_(d.weight.to(dtype).float())
            if d.bias is not None:
                d.bias.copy_(d.bias.to(dtype).float())
    xf = torch.randn(*lead, specs[0][0]).to(dtype).float()
    v = _loss_weights(specs[-1][1], seed + 1)
    layers = []
    for d, (_, _, _, t) in zip(denses, specs):
        layer = axon4d.Linear.from_dense(d.to(dtype), transpose=t)
        d.float()
        layers.append(layer)

    first_t, last_t = specs[0][3], specs[-1][3]
    x = axon4d.shard_input(xf.to(dtype), transpose=first_t).detach().requires_grad_()
    y = x
    for layer in layers:
        y = layer(y)
    out_axis = layers[-1].out_axis
    v_local = axon4d.shard_features(v, out_axis).to(dtype)
    n_local = y.numel() // y.shape[-1]
    (y * v_local).sum().div(n_local).backward()

    xr = xf.clone().requires_grad_()
    yr = xr
    for d in denses:
        yr = d(yr)
    (yr * v).sum().div(yr.numel() // yr.shape[-1]).backward()

    errs = {"forward": rel_err(axon4d.gather_output(y, transpose=last_t), yr)}
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, layers[0].in_axis))
    errs["input_grad"] = rel_err(dx / grid.size("batch"), xr.grad)
    for k, (layer, d) in enumerate(zip(layers, denses)):
        got = layer.to_dense(grads=True)
        errs[f"weight{k}"] = rel_err(got.weight, d.weight)
        errs[f"weight_grad{k}"] = rel_err(got.weight.grad, d.weight.grad)
        if d.bias is not None:
            errs[f"bias_grad{k}"] = rel_err(got.bias.grad, d.bias.grad)
    return errs


CASES = {
    "normal+bias": ([(24, 40, True, False)], (8, 3)),
    "normal": ([(24, 40, False, False)], (8, 3)),
    "transposed+bias": ([(24, 40, True, True)], (8, 3)),
    "transposed": ([(24, 40, False, True)], (8, 3)),
    "2d_tokens": ([(24, 40, True, False)], (16,)),
    "chained": ([(24, 40, True, False), (40, 24, True, True)], (8, 3)),
    "chained_t_first": ([(24, 40, False, True), (40, 24, True, False)], (8,)),
}


def _all_cases(grid, dtype_name):
    dtype = getattr(torch, dtype_name)
    return {name: _run_chain(grid, specs, lead, dtype, 17 + i) for i, (name, (specs, lead)) in enumerate(CASES.items())}


def _assert_within(results, tol, grid):
    for rank, per_case in enumerate(results):
        for case, errs in per_case.items():
            for what, err in errs.items():
                assert err <= tol, f"grid {grid} rank {rank} {case}: {what} error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_grid_matches_torch_linear_fp32(pools, world):
    for grid in grids_of(world):
        _assert_within(pools(world).run(grid, _all_cases, "float32"), FP32_TOL, grid)


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 1, 4), (1, 1, 8, 1)])
def test_bf16_matches_within_documented_tolerance(pools, grid):
    results = pools(8).run(grid, _all_cases, "bfloat16")
    _assert_within(results, BF16_TOL, grid)
    # the parameters really are bf16 and so are the activations
    assert all(r["normal"]["forward"] >= 0 for r in results)


def _padded(grid):
    # 6·5 = 30 weight elements per (x, y) block do not split evenly over z: shards are padded
    errs = _run_chain(grid, [(6, 5, True, False), (5, 6, True, True)], (8,), torch.float32, 3)
    layer = axon4d.Linear(6, 5)
    return errs, layer.weight.numel(), layer.shard_numel * grid.size("z")


@pytest.mark.parametrize("grid", [(1, 1, 8, 1), (1, 1, 4, 2)])
def test_weight_blocks_that_do_not_split_over_z_are_padded(pools, grid):
    for errs, numel, padded in pools(8).run(grid, _padded):
        assert numel == -(-30 // grid[2]) and padded >= 30
        assert max(errs.values()) <= FP32_TOL, errs


def _replicas_agree(grid):
    torch.manual_seed(5)
    layer = axon4d.Linear(16, 32, transpose=True)
    return grid.coords, layer.weight.detach().clone(), layer.bias.detach().clone()


def test_initialisation_is_consistent_across_replicas_and_independent_of_z(pools):
    by_block = {}
    for coords, w, b in pools(8).run((2, 2, 1, 2), _replicas_agree):
        key = (coords["x"], coords["y"])
        if key in by_block:  # the data replicas of a block hold identical values
            assert torch.equal(by_block[key][0], w) and torch.equal(by_block[key][1], b)
        by_block[key] = (w, b)
    bound = 1 / 16**0.5
    assert all(w.abs().max() <= bound and b.abs().max() <= bound for w, b in by_block.values())
    # the same blocks on a grid with z = 2: concatenating the z shards gives the same block
    z_grid = pools(8).run((2, 2, 2, 1), _replicas_agree)
    for coords, w, _ in z_grid:
        full = by_block[(coords["x"], coords["y"])][0]
        n = w.numel()
        assert torch.equal(full[coords["z"] * n : (coords["z"] + 1) * n], w)


def _errors(grid):
    return value_errors({
        "in_features": lambda: axon4d.Linear(6, 8),
        "out_features": lambda: axon4d.Linear(8, 6, transpose=True),
        "input_shape": lambda: axon4d.Linear(8, 8)(torch.randn(4, 8)),
        "tokens": lambda: axon4d.shard_input(torch.randn(3, 8)),
        "dense_shape": lambda: axon4d.Linear(8, 8).load_dense_(torch.randn(8, 4)),
        "dtype": lambda: axon4d.Linear(8, 8, dtype=torch.int32),
    })


def test_bad_shapes_raise_clear_value_errors_on_every_rank(pools):
    for msgs in pools(8).run((4, 1, 2, 1), _errors):
        assert "in_features = 6 is not divisible by G_x = 4" in msgs["in_features"]
        assert "(2, 1, 4, 1)" in msgs["in_features"]
        assert "out_features = 6 is not divisible by G_x = 4" in msgs["out_features"]
        assert "in_features/G_x = 8/4 = 2, got shape (4, 8)" in msgs["input_shape"]
        assert "axon4d.shard_input" in msgs["input_shape"]
        assert "batch (dim 0 of the input) = 3 is not divisible by G_data·G_z = 2" in msgs["tokens"]
        assert "(out_features, in_features) = (8, 8)" in msgs["dense_shape"]
        assert "not supported" in msgs["dtype"]


def test_large_layers_build_on_the_meta_device_without_memory():
    # a 20B-sized MLP projection as one rank of a 1024-rank grid would hold it
    from axon4d.shape import GridShape
    from axon4d import geometry

    shape = GridShape(8, 8, 16, 1)
    assert geometry.weight_shard_numel(7168, 4 * 7168, shape, False) == 7168 * 4 * 7168 // 1024
    assert geometry.weight_block_shape(7168, 4 * 7168, shape, True) == (4 * 7168 // 8, 7168 // 8)


def _meta_layer(grid):
    layer = axon4d.Linear(4096, 16384, device="meta")
    return layer.weight.is_meta, tuple(layer.weight.shape), tuple(layer.bias.shape)


def test_meta_device_layer(pools):
    for is_meta, w, b in pools(2).run((1, 2, 1, 1), _meta_layer):
        assert is_meta and w == (4096 * 16384 // 2,) and b == (8192,)
