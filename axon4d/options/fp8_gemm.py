"""FP8 GEMMs of the 3D Linear (precision ``bf16-fp8``, docs/design.md §2 "FP8 GEMMs", E2f–E2w).

Each operand of a GEMM is quantised on its own rank with one tensorwise scale (current scaling:
the scale of the values being multiplied, ``precision.fp8_scale``), so no scale needs a
collective: X and dY per micro-batch from their amax, the weight block once per step
(``axon4d.scheduler.fp8_copies``). X and the weight are e4m3; dY is e5m2 by default
(``Precision.grad``, ``precision.gradient_fp8``): a gradient's entries span a wider range than one
scale serves in e4m3, whose smallest subnormal is 2⁻⁹ of a unit where e5m2's is 2⁻¹⁶ — on a small
Llama's real layer gradients e4m3 flushed up to 4.5% of dY's non-zero entries to zero, e5m2 0.04% (``bench/fp8_underflow.py``).
``count_flushes`` measures that share as training runs. The GEMMs (``device.fp8.scaled_mm``) sum in fp32:

- forward  Y  = (X̂ s_x)(Ŵ s_w)ᵀ + b   (b, in_l) × (out_l, in_l)ᵀ → bf16, fast accumulation
- dX          = (dŶ s_dy)(Ŵ s_w)       (b, out_l) × (out_l, in_l) → bf16
- dW          = (dŶ s_dy)ᵀ(X̂ s_x)      (out_l, b) × (b, in_l) → fp32 (E11's sums, as bf16-fp32-reduce)

A weight block is quantised once per optimizer step, from the fp32 master shards, with one
power-of-two scale its z ranks share (``axon4d.scheduler.fp8_copies``): E10 moves those e4m3 bytes
and their result is the block, fed to the GEMM as gathered — a view, no pass over it, no bf16 copy.

A layer runs in FP8 only where its local block's dims are multiples of 16 (``layer_fits``;
the token dim of dW is zero-padded to 16, which adds nothing to the sums); otherwise in bf16.
``reference`` is the dequantised product every FP8 GEMM is compared with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from axon4d.device import fp8 as kernel
from axon4d.device import fp8_fused
from axon4d.options.precision import FP8, fp8_scale

#: the float8 format of every operand (weights, activations and gradients): e4m3
DTYPE = FP8
#: ``use_fast_accum`` per GEMM: the forward's (its output is an activation), not the gradients'
FAST_ACCUM = {"forward": True, "dX": False, "dW": False}


class Quantised(NamedTuple):
    """A float8 matrix and its () fp32 scale: it stands for ``data``·``scale``."""

    data: torch.Tensor
    scale: torch.Tensor


def layer_fits(rows: int, cols: int) -> bool:
    """Whether a local weight block (rows, cols) = (out_l, in_l) can run its three GEMMs in FP8:
    both dims are a GEMM's k or n somewhere, so both must be multiples of 16 (``device.fp8.ALIGN``)."""
    return kernel.aligned(rows, cols)


def amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a () fp32 tensor on t's device: one reduction kernel (nothing read back)."""
    return torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)


def quantise(
    t: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    pow2: bool = False,
    transpose: bool = False,
    pad_to: int = 1,
    dtype: torch.dtype = DTYPE,
) -> Quantised:
    """``t`` (r, c) — or tᵀ (c, r) with ``transpose`` — as ``dtype`` with the tensorwise scale
    ``scale``, by default ``fp8_scale`` of t's own amax (``pow2``: a power of two): q = round(t/s),
    the quotient formed in fp32 and rounded once. A given ``scale`` may be smaller than t's own, so
    the quotient is then clamped to the format's largest value (a cast past it would be NaN on
    CUDA); t's own scale keeps it there already. The columns are zero-padded to a multiple of
    ``pad_to``; the result is row-major. Computed on t's device; nothing is read back.

    Kernels, t's own scale (not ``pow2``), row-major and unpadded: on an accelerator the fused cast
    (``axon4d.device.fp8_fused``: the amax, then scale and cast in one pass, the same bits); on the
    host, or where compiling fails, the eager path — amax, two for the scale (``fp8_scale``), the
    division and the cast: five passes, of which two read t. With ``pow2`` and t's own scale (a
    weight's copy), the amax and ``cast_weight``'s one pass."""
    t = t.detach()
    fmax = float(torch.finfo(dtype).max)
    given = scale is not None
    if fused(t, given, pow2, transpose, pad_to):
        made = fp8_fused.quantise(t, fmax, dtype)
        if made is not None:
            return Quantised(*made)
    if scale is None:
        scale = fp8_scale(amax(t), pow2, fmax)  # () fp32
        if pow2 and not transpose and pad_to == 1:  # at or above t's own: one exact pass (``cast_weight``)
            return Quantised(cast_weight(t, scale, dtype), scale)
    src = t.t() if transpose else t  # (r, c)
    r, c = src.shape
    # a (1,) scale takes part in type promotion as a tensor (a () one would not): the quotient is fp32
    quotient = torch.div(src, scale.reshape(1))  # (r, c) fp32
    if given:
        quotient.clamp_(-fmax, fmax)
    padded = -(-c // pad_to) * pad_to
    if padded == c and quotient.is_contiguous():
        return Quantised(quotient.to(dtype), scale)  # (r, c) row-major: one cast
    data = torch.empty((r, padded), dtype=dtype, device=t.device)  # (r, c'), row-major
    if padded != c:
        data[:, c:].view(torch.uint8).zero_()  # the byte 0 is +0 in both formats
    data[:, :c].copy_(quotient)
    return Quantised(data, scale)


def cast_weight(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """``t`` (any shape, contiguous) as ``dtype`` under ``scale``, a () fp32 power of two at or above
    t's own (``quantise(t, pow2=True)``'s, or a larger one its block shares): round(t/s), the
    fp32 quotient exact and rounded once, never past the format's largest value. On an accelerator
    one fused pass (``fp8_fused.cast_scaled``: t read, one byte written); on the host, or where
    compiling fails, the division and the cast (``fp8_fused.cast_scaled_eager``)."""
    if fp8_fused.wanted(t.device) and t.is_contiguous():
        made = fp8_fused.cast_scaled(t, scale, dtype)
        if made is not None:
            return made
    return fp8_fused.cast_scaled_eager(t, scale, dtype)


def fused(t: torch.Tensor, given: bool, pow2: bool, transpose: bool, pad_to: int) -> bool:
    """Whether ``quantise`` takes the fused cast (``axon4d.device.fp8_fused.wanted``): for t's own
    tensorwise scale (not a power of two) of a contiguous 2-D t, untransposed and unpadded — X and dY."""
    plain = not given and not pow2 and not transpose and pad_to == 1
    return plain and t.dim() == 2 and t.is_contiguous() and fp8_fused.wanted(t.device)


def transposed(q: Quantised, pad_to: int = 1) -> Quantised:
    """``q``'s values laid out transposed, (c, r') row-major with the columns zero-padded to a multiple
    of ``pad_to``: a copy of bytes under the same scale — no amax, no rounding (the layout dW's
    GEMM takes, from the copies the forward and dX made)."""
    r, c = q.data.shape
    padded = -(-r // pad_to) * pad_to
    if fp8_fused.wanted(q.data.device) and q.data.is_contiguous():  # one tiled kernel on an accelerator
        made = fp8_fused.transpose_padded(q.data, padded)
        if made is not None:
            return Quantised(made, q.scale)
    return Quantised(fp8_fused.transpose_padded_eager(q.data, padded), q.scale)  # (c, r')


def count_flushes(t: torch.Tensor, q: Quantised, into: torch.Tensor) -> None:
    """Add to ``into`` (2,) int64 [entries of ``t`` that are non-zero but whose float8 code ``q`` is
    ±0, entries of ``t`` that are non-zero]: the underflow of one quantisation, counted on the
    device (nothing read back). ``q`` is ``quantise(t)``, unpadded and in t's layout."""
    nonzero = t != 0
    flushed = nonzero & ((q.data.view(torch.uint8) & 0x7F) == 0)  # the codes of +0 and −0 in both formats
    into += torch.stack([flushed.sum(), nonzero.sum()])


def dequantise(q: Quantised) -> torch.Tensor:
    """q.data·q.scale in fp32 (exact: e4m3 values and a product by a power of two are fp32 values)."""
    return q.data.float() * q.scale


def forward(
    x: Quantised, w: Quantised, bias: torch.Tensor | None, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Y = X Wᵀ (+ b) for X̂ (b, in_l) and Ŵ (out_l, in_l): (b, out_l) in ``out_dtype``, into ``out``."""
    return kernel.scaled_mm(
        x.data, w.data, x.scale, w.scale, out_dtype, bias=bias, fast_accum=FAST_ACCUM["forward"], out=out
    )


def grad_input(dy: Quantised, w: Quantised, out_dtype: torch.dtype) -> torch.Tensor:
    """dX = dY W for dŶ (b, out_l) and Ŵ (out_l, in_l): (b, in_l) in ``out_dtype``. The kernel takes
    W as its column-major second operand, so Ŵᵀ is laid out row-major once (``transposed``: a read
    and a write per element)."""
    w_t = transposed(w).data  # (in_l, out_l)
    return kernel.scaled_mm(dy.data, w_t, dy.scale, w.scale, out_dtype, fast_accum=FAST_ACCUM["dX"])


def grad_weight(dy_t: Quantised, x_t: Quantised, out: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ X for dŶᵀ (out_l, b') and X̂ᵀ (in_l, b') — quantised transposed, tokens zero-padded to
    b' (a multiple of 16) — written into ``out`` (out_l, in_l), whose dtype (fp32) the sums keep."""
    return kernel.scaled_mm(dy_t.data, x_t.data, dy_t.scale, x_t.scale, out.dtype, fast_accum=FAST_ACCUM["dW"], out=out)


def reference(a: Quantised, b: Quantised, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantised reference of ``device.fp8.scaled_mm(a, b)``: (â s_a)(b̂ s_b)ᵀ (+ bias) in fp32,
    rounded once to ``out_dtype``."""
    y = dequantise(a) @ dequantise(b).t()  # (m, k) @ (k, n)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
