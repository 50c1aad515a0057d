"""Context-parallel attention's kernels on the GPU (axon4d.device.attention, docs/context.md): every
z-rank's two query chunks against the whole sequence's keys (``prefix_attention``, the split
attention once the keys are gathered) equal causal attention of the whole sequence (fp32 SDPA of the
same bf16 inputs on the same device) in out, dq, dk and dv — on torch's flash kernel and, with flash
SDPA switched off, on the memory-efficient kernel, for GQA ratios 1 and 4 — and the kernel that ran
is the one the chooser names for this GPU."""

from __future__ import annotations

import pytest
import torch

from axon4d import activations
from axon4d.device import attention as kernels
from axon4d.nn.context import prefix_attention

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 inputs and outputs (unit roundoff 3.9e-3), fp32 accumulation in other orders
SEQ, G_Z, HEAD_DIM = 256, 4, 64


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-3))


def _expected_kernel(device: torch.device, flash: bool) -> str:
    if device.type != "cuda":
        return kernels.HOST_KERNEL
    return kernels.FLASH if flash and torch.cuda.get_device_capability(device) >= (8, 0) else kernels.EFFICIENT


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "flash-off"])
@pytest.mark.parametrize("groups", [1, 4])
def test_split_attention_on_the_device_equals_causal_attention(grid, monkeypatch, flash, groups):
    device = grid.device
    gen = torch.Generator(device=device).manual_seed(groups)
    q = torch.randn(2, 2 * groups, SEQ, HEAD_DIM, device=device, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, SEQ, HEAD_DIM, device=device, generator=gen).bfloat16().requires_grad_() for _ in "kv")
    grad = torch.randn(q.shape, device=device, generator=gen).bfloat16()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q32, k32.repeat_interleave(groups, 1), v32.repeat_interleave(groups, 1), is_causal=True
    )
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad.float())

    flash_before = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(flash)
    ran: set[str] = set()
    choose = kernels.kernel_for

    def recording(*args):
        ran.add(choose(*args))
        return choose(*args)

    monkeypatch.setattr(kernels, "kernel_for", recording)
    try:
        got = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
        for z in range(G_Z):
            at = activations.sequence_positions(SEQ, z, G_Z, device)
            out = prefix_attention(q.index_select(2, at), k, v, activations.sequence_chunks(z, G_Z))
            assert out.dtype == torch.bfloat16
            assert rel_err(out, ref.index_select(2, at)) <= TOL, f"rank {z}: out"
            for acc, g in zip(got, torch.autograd.grad(out, (q, k, v), grad.index_select(2, at))):
                acc += g.float()
    finally:
        torch.backends.cuda.enable_flash_sdp(flash_before)
    for name, g, want in zip("qkv", got, ref_grads):
        assert rel_err(g, want) <= TOL, f"d{name}"
    assert ran == {_expected_kernel(device, flash)}
