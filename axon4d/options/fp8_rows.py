"""Rows sent to the experts in FP8: the MoE dispatch's payload cast to float8 e4m3 with one scale per
block of ``BLOCK`` features of a row (docs/moe.md, "FP8 dispatch"; DeepSeek-V3's 1×128 tiles,
arXiv:2412.19437 §3.3).

Under an expert layout with ``dispatch=fp8`` (``axon4d.grid.expert_layout``) the rows an MoE layer
sends toward its experts — the dispatch (E16) in forward and, in backward, the combine's gradient —
travel as ``pack`` makes them and are restored by ``unpack`` on arrival; the rows sent home (the
combine, the dispatch's gradient) stay in the compute dtype, as DeepSeek-V3 keeps them in bf16.

A packed row of F features is F e4m3 bytes followed by the F/``BLOCK`` fp32 scales' bytes:
(n, F) → (n, F + 4·F/BLOCK) uint8, so an all-to-all of whole rows moves it unchanged. Each element is
rounded once: q = round_e4m3(x_fp32 / s) with s = amax(|block|)/448 (``precision.fp8_scale``), the
quotient taken in fp32 whatever the input dtype, and restored as fp32(q)·s rounded once to the
compute dtype. A block's scale depends on its own 128 features only, so a row cut into feature
shards of whole blocks (hidden/G_x over x) packs to the same values as the whole row.
"""

from __future__ import annotations

import torch

from axon4d.device import fp8_fused
from axon4d.options.precision import FP8, FP8_MAX, SCALE_BYTES

#: features per scale: DeepSeek-V3's activation tiles (1 × 128)
BLOCK = 128


def packed_width(features: int) -> int:
    """Bytes of one packed row of ``features`` (a multiple of ``BLOCK``): the e4m3 values and a
    4-byte fp32 scale per block."""
    if features % BLOCK:
        raise ValueError(
            f"an FP8 dispatch row of {features} features: rows are cast in blocks of {BLOCK} features, so the "
            f"features a rank sends (hidden, or hidden/G_x where x splits the experts) must be a multiple of {BLOCK}"
        )
    return features + SCALE_BYTES * (features // BLOCK)


def pack(rows: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` (n, F) of any float dtype as (n, F + 4·F/128) uint8: per row and block of 128 features
    the e4m3 values of x/s, then the blocks' fp32 scales s = amax/448 (module docstring), by the
    fused cast on an accelerator (``axon4d.device.fp8_fused.quantise_rows``), else its eager
    operations — the same bits; ``tail`` (n, t) uint8, bytes that travel with each row unchanged
    (an MoE dispatch's gates), written after them: (n, F + 4·F/128 + t). Nothing is read back to
    the host."""
    n, f = rows.shape
    width = packed_width(f)
    blocks = rows.detach().contiguous().view(n, f // BLOCK, BLOCK)  # (n, F/128, 128)
    made = fp8_fused.quantise_rows(blocks, FP8_MAX, FP8) if fp8_fused.wanted(rows.device) else None
    q, scale = made if made is not None else fp8_fused.quantise_blocks(blocks, FP8_MAX, FP8)
    extra = 0 if tail is None else tail.shape[1]
    out = torch.empty(n, width + extra, dtype=torch.uint8, device=rows.device)  # (n, F + 4·F/128 [+ t])
    out[:, :f].copy_(q.view(n, f).view(torch.uint8))
    out[:, f:width].copy_(scale.view(n, f // BLOCK).view(torch.uint8))  # the scales' bytes
    if tail is not None:
        out[:, width:].copy_(tail)
    return out


def unpack(packed: torch.Tensor, features: int, dtype: torch.dtype) -> torch.Tensor:
    """The (n, ``features``) rows in ``dtype`` from ``pack``'s (n, F + 4·F/128) uint8: q·s per block,
    computed in fp32 and rounded once to ``dtype`` (bytes: the e4m3 values read, the rows written,
    then read and written by the product: 1 + 3·elem per element). Bytes past the scales (``pack``'s
    tail) are left out."""
    n = packed.shape[0]
    nb = features // BLOCK
    scale_bytes = torch.empty(n, SCALE_BYTES * nb, dtype=torch.uint8, device=packed.device)  # aligned
    scale_part = packed[:, features : packed_width(features)]  # the scales' bytes (a tail after them left out)
    scales = scale_bytes.copy_(scale_part).view(torch.float32).view(n, nb, 1)  # (n, F/128, 1) fp32
    rows = packed[:, :features].view(FP8).to(dtype)  # (n, F): exact (e4m3 values are bf16 and fp32 values)
    blocks = rows.view(n, nb, BLOCK)
    torch.mul(blocks, scales, out=blocks)  # q·s in fp32 (promoted), rounded once into the rows
    return rows


def round_trip(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the experts receive them under FP8 dispatch: ``unpack(pack(rows))`` in rows' dtype
    (the single-process reference's cast)."""
    return unpack(pack(rows), rows.shape[-1], rows.dtype)


class _RoundTrip(torch.autograd.Function):
    """Forward: ``round_trip``; backward: the gradient passed through unchanged (it travels home in
    the compute dtype)."""

    @staticmethod
    def forward(ctx: object, rows: torch.Tensor) -> torch.Tensor:
        return round_trip(rows)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g


def cast_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as an FP8 dispatch delivers them (``round_trip``), differentiable: the gradient
    passes straight through, as the dispatch's gradient travels in the compute dtype (the
    reference's cast)."""
    return _RoundTrip.apply(rows)


class _GradRoundTrip(torch.autograd.Function):
    """Identity forward; backward: the gradient as ``round_trip`` casts it (an FP8 combine's gradient)."""

    @staticmethod
    def forward(ctx: object, rows: torch.Tensor) -> torch.Tensor:
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return round_trip(g.contiguous())


def grad_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` unchanged, whose gradient is cast as ``round_trip`` casts rows: what an expert's
    output receives in backward when the combine's gradient travels in FP8 (the reference's cast)."""
    return _GradRoundTrip.apply(rows)
