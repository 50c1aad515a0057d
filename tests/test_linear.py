"""Protects axon4d.Linear (docs/design.md §2): on every grid of 1, 2, 4 and 8 ranks it must equal the
plain single-process torch.nn.Linear in forward output, input gradient, weight gradient and bias
gradient — normal, transposed, chained, with padding over z, in fp32 and bf16.

Loss convention (DDP-like, see axon4d/nn/linear.py): each rank's loss is the mean over its own
tokens, so parameter gradients equal the reference's gradient of the global mean, and the input
gradient of a rank is G_batch times the reference's (it is the gradient of the local mean)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from harness import grids_of, value_errors
from torch import nn

import axon4d

FP32_TOL = 1e-5  # max abs error relative to the reference tensor's scale
# bf16 keeps 8 significant bits (unit roundoff 2⁻⁸ ≈ 3.9e-3); the reductions over the grid add a
# few roundings. Measured on the four bf16 grids below: forward 5.4e-3, input gradient 5.9e-3,
# weight gradient 1.9e-2 and bias gradient 1.3e-2 (both worst on (1, 1, 8, 1): 8-way sums in bf16);
# the weights round-trip exactly. Each bound is under 2× its measured worst, so a layer that
# computes wrongly (an error of a few per cent or more) fails.
BF16_TOL = {"forward": 1e-2, "input_grad": 1e-2, "weight": 0.0, "weight_grad": 3e-2, "bias_grad": 3e-2}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _loss_weights(out_features, seed):
    return torch.randn(out_features, generator=torch.Generator().manual_seed(seed))


def _run_chain(grid, specs, lead, dtype, seed):
    """Apply layers given by ``specs`` = [(in, out, bias, transpose), ...] and compare everything.

    Returns ({name: relative error}, {name: dtype of that tensor on this rank, as a string}).
    Consecutive specs must chain (normal → transposed or vice versa).
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
    dtypes = {"forward": str(y.dtype), "input_grad": str(x.grad.dtype)}
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, layers[0].in_axis))
    errs["input_grad"] = rel_err(dx / grid.size("batch"), xr.grad)
    for k, (layer, d) in enumerate(zip(layers, denses)):
        dtypes[f"weight{k}"], dtypes[f"weight_grad{k}"] = str(layer.weight.dtype), str(layer.weight.grad.dtype)
        got = layer.to_dense(grads=True)
        errs[f"weight{k}"] = rel_err(got.weight, d.weight)
        errs[f"weight_grad{k}"] = rel_err(got.weight.grad, d.weight.grad)
        if d.bias is not None:
            dtypes[f"bias_grad{k}"] = str(layer.bias.grad.dtype)
            errs[f"bias_grad{k}"] = rel_err(got.bias.grad, d.bias.grad)
    return errs, dtypes


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
    """{case: ({what: relative error}, {what: dtype})} for every case of CASES."""
    dtype = getattr(torch, dtype_name)
    return {name: _run_chain(grid, specs, lead, dtype, 17 + i) for i, (name, (specs, lead)) in enumerate(CASES.items())}


def _assert_within(results, tol, grid):
    """Every error of every case on every rank within ``tol`` (one bound, or one per kind of tensor)."""
    for rank, per_case in enumerate(results):
        for case, (errs, _dtypes) in per_case.items():
            for what, err in errs.items():
                bound = tol if isinstance(tol, float) else tol[what.rstrip("0123456789")]
                assert err <= bound, f"grid {grid} rank {rank} {case}: {what} error {err:.2e} > {bound:.0e}"


@pytest.mark.parametrize(
    "world", [1, 2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_every_grid_matches_torch_linear_fp32(pools, world):
    for grid in grids_of(world):
        _assert_within(pools(world).run(grid, _all_cases, "float32"), FP32_TOL, grid)


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 1, 4), (1, 1, 8, 1)])
@pytest.mark.slow
def test_bf16_matches_within_documented_tolerance(pools, grid):
    results = pools(8).run(grid, _all_cases, "bfloat16")
    _assert_within(results, BF16_TOL, grid)
    # the parameters really are bf16, and so are the activations and every gradient
    for rank, per_case in enumerate(results):
        for case, (_errs, dtypes) in per_case.items():
            assert set(dtypes.values()) == {"torch.bfloat16"}, f"grid {grid} rank {rank} {case}: {dtypes}"


def _padded(grid):
    # 6·5 = 30 weight elements per (x, y) block do not split evenly over z: shards are padded
    errs, _ = _run_chain(grid, [(6, 5, True, False), (5, 6, True, True)], (8,), torch.float32, 3)
    layer = axon4d.Linear(6, 5)
    return errs, layer.weight.numel(), layer.shard_numel * grid.size("z")


@pytest.mark.parametrize("grid", [(1, 1, 8, 1), (1, 1, 4, 2)])
@pytest.mark.slow
def test_weight_blocks_that_do_not_split_over_z_are_padded(pools, grid):
    for errs, numel, padded in pools(8).run(grid, _padded):
        assert numel == -(-30 // grid[2]) and padded >= 30
        assert max(errs.values()) <= FP32_TOL, errs


def _replicas_agree(grid):
    torch.manual_seed(5)
    layer = axon4d.Linear(16, 32, transpose=True)
    return grid.coords, layer.weight.detach().clone(), layer.bias.detach().clone()


@pytest.mark.slow
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
    return value_errors(
        {
            "in_features": lambda: axon4d.Linear(6, 8),
            "out_features": lambda: axon4d.Linear(8, 6, transpose=True),
            "input_shape": lambda: axon4d.Linear(8, 8)(torch.randn(4, 8)),
            "tokens": lambda: axon4d.shard_input(torch.randn(3, 8)),
            "dense_shape": lambda: axon4d.Linear(8, 8).load_dense_(torch.randn(8, 4)),
            "dtype": lambda: axon4d.Linear(8, 8, dtype=torch.int32),
        }
    )


@pytest.mark.slow
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


# One rank (7) of a 1024-rank grid (8, 8, 16, 1), in one process on torch's fake process group: it
# builds axon4d.Linear layers on the meta device and reports what each holds, and by how much
# building them raised the peak resident memory. The last layer's block would be 1 GiB in fp32 if it were materialised.
_META_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=7, world_size=1024)
import axon4d

axon4d.init(grid=(8, 8, 16, 1))


def peak_resident() -> int:  # peak resident bytes (VmHWM): memory allocated and freed again counts too
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak to the current resident size
before = peak_resident()
out = []
for fan_in, fan_out, transpose in json.loads(sys.argv[1]):
    layer = axon4d.Linear(fan_in, fan_out, transpose=transpose, device="meta")
    out.append({"weight": list(layer.weight.shape), "bias": list(layer.bias.shape), "shard_numel": layer.shard_numel,
                "devices": sorted({p.device.type for p in layer.parameters()})})
print("RESULT", json.dumps({"layers": out, "grown": peak_resident() - before}))
"""

META_GRID = (8, 8, 16, 1)
META_LAYERS = [
    (7168, 4 * 7168, False),  # a 20B model's MLP up-projection: 4·7168·7168/1024 = 200704 per rank
    (4 * 7168, 7168, True),  # its down-projection (transposed: output features over x)
    (24, 40, False),  # a (5, 3) block: 15 elements over G_z = 16, so one padded element per rank
    (131072, 131072, False),  # a 1 GiB fp32 block per (x, y) position, 64 MiB per rank
]


@pytest.mark.slow
def test_large_layers_build_on_the_meta_device_without_memory():
    # docs/design.md §2: a rank stores ⌈out·in / (G_x·G_y·G_z)⌉ weight elements (its flat, padded
    # z shard of the (out/G_out, in/G_in) block) and the bias slice out/G_out; on the meta device
    # none of it is allocated
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-c", _META_SCRIPT, json.dumps(META_LAYERS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.split("RESULT", 1)[1])
    gx, gy, gz, _ = META_GRID
    for (fan_in, fan_out, transpose), layer in zip(META_LAYERS, got["layers"]):
        shard = math.ceil(fan_out * fan_in / (gx * gy * gz))
        assert layer["weight"] == [shard] and layer["shard_numel"] == shard, (fan_in, fan_out, layer)
        assert layer["bias"] == [fan_out // (gx if transpose else gy)], (fan_in, fan_out, layer)
        assert layer["devices"] == ["meta"], layer
    assert got["layers"][2]["weight"] == [1]  # 15 elements padded to 16 over z
    # the last layer alone would take 64 MiB for its shard (and 1 GiB for its block while initialising)
    assert got["grown"] < 16 * 2**20, f"building on the meta device raised peak memory by {got['grown']} bytes"


# -- a grid of one rank: nothing to communicate, nothing more to do than torch.nn.Linear (issue 18) --


def _aten_ops_and_nodes(module, x, v):
    """(aten ops torch's profiler records, autograd nodes of the graph) of one forward + backward
    of ``module`` on ``x`` with loss (y·v).sum(), and the gradients it gave (input, weight, bias)."""
    from torch.profiler import ProfilerActivity, profile

    x = x.detach().clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = (module(x) * v).sum()
        nodes, todo = set(), [loss.grad_fn]
        while todo:  # every node backward will run, AccumulateGrad included
            node = todo.pop()
            if node is not None and node not in nodes:
                nodes.add(node)
                todo.extend(f for f, _ in node.next_functions)
        loss.backward()
    ops = sum(e.name.startswith("aten::") for e in prof.events())
    grads = (x.grad, module.weight.grad.view(module.out_features, module.in_features), module.bias.grad)
    module.zero_grad(set_to_none=True)
    return ops, len(nodes), grads


def _no_grad_equal(layer, ref, x):
    with torch.no_grad():
        return torch.equal(layer(x), ref(x))


def _one_rank_work(grid):
    """For 2D and 3D inputs: (aten ops, autograd nodes) of axon4d.Linear and of torch.nn.Linear,
    whether their output and gradients are bitwise equal, and what the grid's comm log and
    scheduler hold afterwards."""
    torch.manual_seed(0)
    out = {}
    for lead in ((32,), (4, 8)):
        ref = nn.Linear(48, 40)
        layer = axon4d.Linear.from_dense(ref)
        x, v = torch.randn(*lead, 48), torch.randn(40)
        for module in (ref, layer):  # warm-up: first calls may set things up
            _aten_ops_and_nodes(module, x, v)
        grid.comm.log.clear()
        ops, nodes, grads = _aten_ops_and_nodes(layer, x, v)
        ref_ops, ref_nodes, ref_grads = _aten_ops_and_nodes(ref, x, v)
        sched = grid.scheduler
        out[len(lead)] = {
            "ops": (ops, ref_ops),
            "nodes": (nodes, ref_nodes),
            "equal": all(torch.equal(a, b) for a, b in zip(grads, ref_grads)) and torch.equal(layer(x), ref(x)),
            "equal_no_grad": _no_grad_equal(layer, ref, x),
            "records": len(grid.comm.log.records),
            "spans": len(grid.comm.log.spans),
            "scheduler": [len(sched._scattering), len(sched._buckets), len(sched._reducing), len(sched._prefetched)],
            "order_learned": len(sched._next) + len(sched._prev),
        }
    return out


def test_one_rank_grid_does_no_more_than_torch_linear(pools):
    # the machinery costs nothing where nothing is communicated: no collective and no compute span
    # in the comm log, nothing left with the scheduler, no more aten ops or autograd nodes than
    # torch.nn.Linear, and the very same bits (bench/overhead.py times it)
    for ndim, got in pools(1).run((1, 1, 1, 1), _one_rank_work)[0].items():
        assert got["equal"], f"{ndim}D input: axon4d.Linear is not bitwise torch.nn.Linear on one rank"
        assert got["equal_no_grad"], f"{ndim}D input: axon4d.Linear under no_grad is not torch.nn.Linear"
        assert got["records"] == 0 and got["spans"] == 0, got
        assert got["scheduler"] == [0, 0, 0, 0] and got["order_learned"] == 0, got
        assert got["ops"][0] <= got["ops"][1], f"{ndim}D input: aten ops (axon4d, torch) = {got['ops']}"
        assert got["nodes"][0] <= got["nodes"][1], f"{ndim}D input: autograd nodes (axon4d, torch) = {got['nodes']}"


def _one_rank_mixed(grid):
    """bf16 compute on one rank: dtypes, and errors against the fp32 nn.Linear."""
    torch.manual_seed(1)
    ref = nn.Linear(24, 40)
    layer = axon4d.Linear.from_dense(ref)
    x, v = torch.randn(8, 24), torch.randn(40)
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xa)
    (y.float() * v).sum().backward()
    (ref(xr) * v).sum().backward()
    errs = {
        "forward": rel_err(y, ref(x)),
        "input_grad": rel_err(xa.grad, xr.grad),
        "weight_grad": rel_err(layer.weight.grad.view(40, 24), ref.weight.grad),
        "bias_grad": rel_err(layer.bias.grad, ref.bias.grad),
    }
    with torch.no_grad():
        y_no_grad = layer(x)
    errs["forward_no_grad"] = rel_err(y_no_grad, ref(x))
    dtypes = {"output": y.dtype, "output_no_grad": y_no_grad.dtype, "weight": layer.weight.dtype}
    dtypes["weight_grad"] = layer.weight.grad.dtype
    return {k: str(d) for k, d in dtypes.items()}, errs, len(grid.comm.log.records)


@pytest.mark.parametrize("precision", ["bf16", "bf16-fp32-reduce"])
def test_one_rank_grid_still_computes_in_the_compute_dtype(pools, precision):
    dtypes, errs, records = pools(1).run((1, 1, 1, 1), _one_rank_mixed, precision=precision)[0]
    assert dtypes == {
        "output": "torch.bfloat16",
        "output_no_grad": "torch.bfloat16",
        "weight": "torch.float32",
        "weight_grad": "torch.float32",
    }
    assert records == 0
    for what, err in errs.items():  # bf16 rounding, and more than fp32's: the compute really is bf16
        assert 1e-5 < err <= BF16_TOL[what.removesuffix("_no_grad")], f"{precision}: {what} error {err:.2e}"


@pytest.mark.slow
def test_overhead_bench_quick_prints_its_headline(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "overhead.json"
    run = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "overhead.py"), "--quick", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"overhead: worst = \d+\.\d{3}× at \(\d+×\d+, \d+ tokens\), median = \d+\.\d{3}×", last), last
    saved = json.loads(out.read_text())
    assert [(p["in"], p["tokens"]) for p in saved["points"]] == [(512, 256), (1024, 256)]
    for p in saved["points"]:
        assert max(p["agreement"][k] for k in ("output", "input_grad", "weight_grad", "bias_grad")) <= FP32_TOL
        assert len(p["samples_s"]["axon4d"]) == len(p["samples_s"]["torch"]) == p["reps"] >= 5
        assert p["ratio"] == p["median_s"]["axon4d"] / p["median_s"]["torch"]
    assert saved["host"]["cpu_model"] and saved["threads"] == 1


def _block_sized_copies(grid, in_features, out_features):
    """aten ops of one Linear's backward that make a new tensor from existing data (pad, clone,
    copy, cat) of at least the (x, y) weight block's size, with the block's and the padded size."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copying = {"constant_pad_nd", "clone", "copy_", "cat", "_to_copy", "contiguous"}
    torch.manual_seed(0)
    layer = axon4d.Linear(in_features, out_features)
    n_w = math.prod(layer.block_shape)
    x = torch.randn(3, in_features // grid.size("x"), requires_grad=True)
    loss = layer(x).sum()
    seen = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in copying and isinstance(out, torch.Tensor) and out.numel() >= n_w:
                seen.append(name)
            return out

    with Copies():
        loss.backward()
    return seen, n_w, layer.shard_numel * grid.size("z")


@pytest.mark.parametrize("shape", [(16, 12), (5, 7)], ids=["divides", "padded"])
def test_the_weight_gradient_is_reduce_scattered_without_a_copy(pools, shape):
    """E11's input at G_z > 1 is dW computed straight into the zero-padded flat buffer: no copy of
    the block (a pad or clone) per layer and step, whether or not out·in divides by G_z."""
    for seen, n_w, padded in pools(2).run((1, 1, 2, 1), _block_sized_copies, *shape):
        assert n_w == shape[0] * shape[1] and padded == n_w + (n_w % 2)
        assert seen == [], f"copies of the {n_w}-element block in backward: {seen}"
