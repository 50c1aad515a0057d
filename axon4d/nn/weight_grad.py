"""The 3D Linear's weight gradient GEMM and its kept block (docs/design.md §2, E11's input; §2 "FP8 GEMMs").

``dw_padded`` computes dW = dYᵀX straight into the zero-padded flat buffer E11 reduce-scatters over
z — in the reduction dtype (fp32 sums under bf16-fp32-reduce), and under FP8 GEMMs from the e4m3
operands (``axon4d.options.fp8_gemm``); ``kept_tensors`` splits a kept weight block into what autograd saves.
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d import device as devices
from axon4d.layout import geometry
from axon4d.options import fp8_gemm


def kept_tensors(kept: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A kept block as the two tensors autograd saves: (block, None), or (e4m3 data, scale) under FP8."""
    return (kept.data, kept.scale) if isinstance(kept, fp8_gemm.Quantised) else (kept, None)


def dw_padded(dy2: Any, x2: Any, g_z: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """dW = dYᵀ X (out_l, b) @ (b, in_l), flat and zero-padded to ``g_z`` equal shards (the layout
    E11 reduce-scatters over z, ``geometry.z_padded``), in ``dtype``: the gradient-reduction dtype,
    so under ``bf16-fp32-reduce`` the GEMM's fp32 sums are reduced as they are, never rounded to
    bf16 first (``device.mm_widening``). The product is written straight into the padded buffer:
    no copy of the block, and none at all when out_l·in_l divides by G_z. ``out``: a flat
    (out_l·in_l,) tensor to write an unpadded product into (a slice of an E12 bucket,
    ``Scheduler.weight_grad_slot``), used when its dtype is the product's. Under FP8 GEMMs ``dy2`` and
    ``x2`` are ``fp8_gemm.Quantised`` dŶᵀ (out_l, b') and X̂ᵀ (in_l, b'), and the fp32 sums are
    written the same way (``fp8_gemm.grad_weight``)."""
    fp8 = isinstance(dy2, fp8_gemm.Quantised)
    rows, cols = (dy2.data.shape[0], x2.data.shape[0]) if fp8 else (dy2.shape[1], x2.shape[1])
    numel = rows * cols
    padded = geometry.z_padded_numel(numel, g_z)
    device = dy2.data.device if fp8 else dy2.device
    if not fp8:
        dtype = torch.promote_types(torch.promote_types(dy2.dtype, x2.dtype), dtype)

    def product(into: torch.Tensor | None) -> torch.Tensor:  # (out_l, in_l) in dtype
        if fp8:
            into = into if into is not None else torch.empty((rows, cols), dtype=dtype, device=device)
            return fp8_gemm.grad_weight(dy2, x2, into)  # (out_l, b') @ (b', in_l)
        return devices.mm_widening(dy2.t(), x2, dtype, out=into)  # (out_l, b) @ (b, in_l)

    if padded == numel:
        into = out.view(rows, cols) if out is not None and out.dtype == dtype else None
        return product(into).view(-1)  # (out_l·in_l,)
    dw = torch.empty(padded, dtype=dtype, device=device)
    product(dw[:numel].view(rows, cols))
    dw[numel:].zero_()
    return dw
