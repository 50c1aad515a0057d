"""Protects the fused split norms (axon4d/nn/norm.py, docs/design.md §2 "norms"): LayerNorm and
RMSNorm whose features are split over x equal torch.nn's (dense, single process) in forward,
input gradient and weight/bias gradients, in fp32 (tight) and bf16; each forward issues exactly
one all-reduce over x (the stacked per-token sums) and each backward exactly one more; the forward
saves only the input in its own dtype and the per-token statistics (fp32, (tokens,)) — nothing
activation-sized in fp32 — and the statistics/normalize pair that balanced recomputation uses gives
the same values with the same two collectives."""

import pytest
import torch
from torch import nn

import axon4d
from axon4d.layout.geometry import Op, Term
from axon4d.nn.norm import LayerNorm, RMSNorm

HIDDEN = 32
FP32_TOL = 1e-5  # max abs error relative to the reference's scale
BF16_TOL = {"forward": 1e-2, "input_grad": 1e-2, "weight.grad": 3e-2, "bias.grad": 3e-2}  # as tests/test_linear.py
KINDS = ("layernorm", "rmsnorm")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _pair(kind: str, dtype: torch.dtype):
    """(fp32 dense torch.nn norm with random affine weights, our norm in ``dtype`` holding the same)."""
    if kind == "layernorm":
        dense = nn.LayerNorm(HIDDEN)
        with torch.no_grad():
            dense.weight.uniform_(0.5, 1.5), dense.bias.uniform_(-0.5, 0.5)
        return dense, LayerNorm(HIDDEN, dtype=dtype).load_dense_(dense)
    dense = nn.RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        dense.weight.uniform_(0.5, 1.5)
    return dense, RMSNorm(HIDDEN, dtype=dtype).load_dense_(dense)


def _records(grid):
    return [(r.op, r.axis, str(r.tag)) for r in grid.comm.log.records]


def _check_norm(grid, kind, dtype, offset=0.0):
    """Errors against torch.nn in fp32 on the same (dtype-rounded) input, and the collectives each
    pass logged."""
    torch.manual_seed(3)
    dense, mod = _pair(kind, dtype)
    x_full = (torch.randn(4, 6, HIDDEN) * 2 + offset).to(dtype)  # (batch, seq, hidden)
    v = torch.randn(HIDDEN)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    grid.comm.log.clear()
    y = mod(x)
    forward = _records(grid)
    grid.comm.log.clear()
    (y.float() * axon4d.shard_features(v, "x")).sum().div(y.shape[0] * y.shape[1]).backward()
    backward = _records(grid)
    xr = x_full.float().requires_grad_()
    yr = dense(xr)
    (yr * v).sum().div(yr.shape[0] * yr.shape[1]).backward()
    errs = {
        "forward": _rel(axon4d.gather_batch(axon4d.gather_features(y, "x")), yr),
        "input_grad": _rel(axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch"), xr.grad),
    }
    got = mod.to_dense(grads=True)
    for name, p in dense.named_parameters():
        errs[f"{name}.grad"] = _rel(got.get_parameter(name).grad, p.grad)
    dtypes = {"output": y.dtype, "input_grad": x.grad.dtype}
    return errs, forward, backward, dtypes


def _assert_one_reduce_each_way(forward, backward, label):
    x_reduces = [r for r in forward if r[1] == "x"]
    assert x_reduces == [(Op.ALL_REDUCE, "x", str(Term.NORM_STATS))], f"{label} forward: {forward}"
    assert forward == x_reduces, f"{label}: the forward issues nothing but its statistics' all-reduce: {forward}"
    x_reduces = [r for r in backward if r[1] == "x"]
    assert x_reduces == [(Op.ALL_REDUCE, "x", str(Term.NORM_STATS_GRAD))], f"{label} backward: {backward}"
    # the rest of the backward: the affine gradients averaged over batch (their hooks), nothing else
    assert all(r[2] == str(Term.NORM_GRAD) and r[1] == "batch" for r in backward if r[1] != "x"), backward


@pytest.mark.parametrize(
    "world,grids",
    [
        (2, [(2, 1, 1, 1)]),
        pytest.param(4, [(4, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2)], marks=pytest.mark.slow),
    ],
)
def test_split_norms_equal_torch_with_one_all_reduce_each_way(pools, world, grids):
    for grid in grids:
        for kind in KINDS:
            for dtype in (torch.float32, torch.bfloat16):
                for rank, (errs, fwd, bwd, dtypes) in enumerate(pools(world).run(grid, _check_norm, kind, dtype)):
                    label = f"{kind} {dtype} on {grid} rank {rank}"
                    bad = {
                        k: e for k, e in errs.items() if not e <= (FP32_TOL if dtype == torch.float32 else BF16_TOL[k])
                    }
                    assert not bad, f"{label}: {bad}"
                    assert set(dtypes.values()) == {dtype}, f"{label}: {dtypes}"
                    _assert_one_reduce_each_way(fwd, bwd, label)


def test_layernorm_statistics_stay_exact_when_the_mean_dwarfs_the_spread(pools):
    """Σx and Σx² summed in fp32 give E[x²] − E[x]² off by ~9e-5 of the output at |mean| = 32·std
    (H = 32 here; worse at large H); the per-rank shifted sums combined in fp64 keep LayerNorm within
    FP32_TOL of torch's (whose own error there is ~2e-6)."""
    for rank, (errs, *_rest) in enumerate(pools(2).run((2, 1, 1, 1), _check_norm, "layernorm", torch.float32, 64.0)):
        assert max(errs.values()) <= FP32_TOL, f"rank {rank}: {errs}"


def _saved_by_forward(grid, kind):
    """What autograd keeps from one forward of the split norm on bf16 activations: (dtype, shape,
    whether it is the input itself) of every saved tensor, and the input's shape."""
    torch.manual_seed(0)
    _, mod = _pair(kind, torch.bfloat16)
    x = torch.randn(4, 6, HIDDEN // grid.size("x"), dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        is_param = any(t is p for p in mod.parameters())
        saved.append((str(t.dtype), tuple(t.shape), t.data_ptr() == x.data_ptr(), is_param))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mod(x)
    y.float().sum().backward()  # the saved tensors are enough for the backward
    return saved, tuple(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_split_norm_saves_the_input_and_per_token_statistics_only(pools, kind):
    for saved, shape in pools(2).run((2, 1, 1, 1), _saved_by_forward, kind):
        tokens = shape[0] * shape[1]
        inputs = [s for s in saved if s[2]]
        stats = [s for s in saved if not s[2] and not s[3]]
        assert inputs == [("torch.bfloat16", shape, True, False)], saved
        assert stats == [("torch.float32", (tokens,), False, False)] * (2 if kind == "layernorm" else 1), saved
        assert not [s for s in saved if s[0] == "torch.float32" and len(s[1]) > 1], f"fp32 activations saved: {saved}"


def _balanced_pair(grid, kind):
    """The fused norm against ``normalize(x, statistics(x))`` (balanced recomputation's split of
    it): largest relative difference of output and input gradient, and each one's collectives."""
    torch.manual_seed(1)
    _, mod = _pair(kind, torch.float32)
    x0 = torch.randn(4, 6, HIDDEN // grid.size("x"))
    g = torch.randn_like(x0)
    out, logs = {}, {}
    for how in ("fused", "split"):
        x = x0.clone().requires_grad_()
        grid.comm.log.clear()
        y = mod(x) if how == "fused" else mod.normalize(x, mod.statistics(x))
        fwd = _records(grid)
        grid.comm.log.clear()
        y.backward(g)
        logs[how] = (fwd, _records(grid))
        out[how] = (y.detach(), x.grad)
    diff = max(_rel(a, b) for a, b in zip(out["split"], out["fused"]))
    return diff, logs


@pytest.mark.parametrize("kind", KINDS)
def test_statistics_and_normalize_give_the_fused_norm(pools, kind):
    for diff, logs in pools(2).run((2, 1, 1, 1), _balanced_pair, kind):
        assert diff <= FP32_TOL, diff
        for how, (fwd, bwd) in logs.items():
            _assert_one_reduce_each_way(fwd, bwd, how)
