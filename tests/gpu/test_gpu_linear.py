"""axon4d.Linear on the GPU equals torch.nn.Linear on the same device, in fp32 and bf16: forward
output, input gradient, weight gradient and bias gradient (normal and transposed layers, 2-D and
3-D input). The loss convention is tests/test_linear.py's: each rank's loss is the mean over its
own tokens, so a rank's input gradient is G_batch times the reference's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import axon4d

pytestmark = pytest.mark.gpu

# max abs error relative to the reference's scale. fp32: both sides run fp32 GEMMs (TF32 off), in
# different but equally exact forms. bf16: both round to bf16 (unit roundoff 3.9e-3) after fp32
# accumulation, in different orders; tests/test_linear.py's bounds.
TOL = {
    torch.float32: {"forward": 1e-5, "input_grad": 1e-5, "weight_grad": 1e-5, "bias_grad": 1e-5},
    torch.bfloat16: {"forward": 1e-2, "input_grad": 1e-2, "weight_grad": 3e-2, "bias_grad": 3e-2},
}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("transpose", [False, True], ids=["normal", "transposed"])
@pytest.mark.parametrize("lead", [(8, 64), (256,)], ids=["3d", "2d"])
def test_linear_matches_torch_linear(grid, dtype, transpose, lead):
    device = grid.device
    gen = torch.Generator(device=device).manual_seed(0)
    dense = nn.Linear(256, 512, device=device, dtype=dtype)
    layer = axon4d.Linear.from_dense(dense, transpose=transpose, grid=grid)
    assert layer.weight.device == device and layer.weight.dtype == dtype
    x_full = torch.randn(*lead, 256, device=device, dtype=dtype, generator=gen)
    v = torch.randn(512, device=device, dtype=dtype, generator=gen)  # the loss: mean of y · v over tokens

    x = axon4d.shard_input(x_full, transpose=transpose).detach().requires_grad_()
    y = layer(x)
    assert y.device == device and y.dtype == dtype
    v_local = axon4d.shard_features(v, layer.out_axis)
    (y * v_local).sum().div(y.numel() // y.shape[-1]).backward()

    xr = x_full.clone().requires_grad_()
    yr = dense(xr)
    (yr * v).sum().div(yr.numel() // yr.shape[-1]).backward()

    tol = TOL[dtype]
    assert rel_err(axon4d.gather_output(y, transpose=transpose), yr) <= tol["forward"]
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, layer.in_axis))
    assert x.grad.device == device and x.grad.dtype == dtype
    assert rel_err(dx / grid.size("batch"), xr.grad) <= tol["input_grad"]
    got = layer.to_dense(grads=True)
    assert torch.equal(got.weight, dense.weight)
    assert rel_err(got.weight.grad, dense.weight.grad) <= tol["weight_grad"]
    assert rel_err(got.bias.grad, dense.bias.grad) <= tol["bias_grad"]
