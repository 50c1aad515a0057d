"""FP8 grouped GEMMs of an MoE layer's experts (precision ``bf16-fp8``, docs/moe.md "FP8"): the
operands quantised with one scale per expert, and the dequantised references the GEMMs equal.

The weights (G, N, K) take one scale per expert, from the fp32 master. The activations X and the
output gradients dY — rows sorted by expert — take one scale per expert too, from the amax of that
expert's rows, rather than one for the whole tensor: an expert whose rows are small (for dY, one
whose gates are small) keeps its own range instead of being flushed toward zero by another's
largest value; and the weight gradient dŶᵀX̂ sums over an expert's tokens, so a scale along the
tokens must be constant within each expert — per-expert scales are, per-token scales would not be.
The GEMMs take them as they are (``device.grouped.scaled_grouped_mm``,
``scaled_grouped_weight_grad``). X and W are e4m3, dY the gradients' format
(``precision.gradient_fp8``: e5m2 by default).
"""

from __future__ import annotations

import torch

from axon4d.device import grouped
from axon4d.options.fp8_gemm import DTYPE, Quantised
from axon4d.options.precision import fp8_scale


def quantise_grouped(t: torch.Tensor, sizes: list[int] | None = None, *, dtype: torch.dtype = DTYPE) -> Quantised:
    """``t`` as ``dtype`` with one scale per group, each ``fp8_scale`` of its own amax: rows (M, c)
    sorted by group in runs of ``sizes``, or with ``sizes`` None a stack (G, r, c) whose g-th matrix
    is group g. The quotient is formed in fp32 and rounded once. Returns the data in t's shape,
    row-major, and the (G,) fp32 scales (fp32's smallest normal for a group of no rows or all zeros).
    Computed on t's device; nothing is read back."""
    t = t.detach()
    fmax = float(torch.finfo(dtype).max)
    if sizes is None:  # (G, r, c): one amax per matrix
        scale = fp8_scale(torch.linalg.vector_norm(t, float("inf"), dim=(1, 2), dtype=torch.float32), fmax=fmax)  # (G,)
        quotient = torch.div(t, scale.view(-1, 1, 1))  # (G, r, c) fp32
    else:  # (M, c): each row's amax, the largest per group, each row divided by its group's scale
        ids = grouped.group_ids(sizes, t.device)  # (M,)
        rows = torch.linalg.vector_norm(t, float("inf"), dim=1, dtype=torch.float32)  # (M,)
        amaxes = rows.new_zeros(len(sizes)).scatter_reduce_(0, ids, rows, "amax")  # (G,)
        scale = fp8_scale(amaxes, fmax=fmax)  # (G,)
        quotient = torch.div(t, scale.index_select(0, ids).unsqueeze(1))  # (M, c) fp32
    return Quantised(quotient.to(dtype), scale)


def transposed_grouped(q: Quantised, place: torch.Tensor, padded: int) -> Quantised:
    """``q``'s (M, c) rows laid out transposed, (c, padded) row-major, row i as column ``place[i]``
    (``device.grouped.aligned_rows``) and every other column zero: a copy of bytes under the same
    scales — the layout the experts' FP8 weight gradient takes (``grouped.scaled_grouped_weight_grad``)."""
    m, c = q.data.shape
    data = torch.zeros((c, padded), dtype=torch.uint8, device=q.data.device)  # the byte 0 is +0
    data.index_copy_(1, place, q.data.view(torch.uint8).t())
    return Quantised(data.view(q.data.dtype), q.scale)


def dequantise_grouped(q: Quantised, sizes: list[int] | None = None) -> torch.Tensor:
    """``quantise_grouped``'s q in fp32: each group's data times its scale (exact, as ``dequantise``)."""
    if sizes is None:
        return q.data.float() * q.scale.view(-1, 1, 1)
    return q.data.float() * q.scale.repeat_interleave(torch.tensor(sizes, device=q.scale.device)).unsqueeze(1)


def grouped_reference(a: Quantised, b: Quantised, sizes: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """The dequantised reference of ``grouped.scaled_grouped_mm`` for rows ``a`` (M, K) and the stack
    ``b`` (G, N, K): each group's fp32 product (â s_a[g])(b̂[g] s_b[g])ᵀ, rounded once to ``out_dtype``."""
    x, w = dequantise_grouped(a, sizes), dequantise_grouped(b)
    parts = [x[rows] @ w[g].t() for g, rows in enumerate(_runs(sizes))]  # (m_g, K) @ (K, N)
    return torch.cat(parts).to(out_dtype) if parts else x.new_empty((0, w.shape[1]), dtype=out_dtype)


def grouped_weight_reference(dy: Quantised, x: Quantised, sizes: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """The dequantised reference of the experts' FP8 weight gradient for rows ``dy`` (M, N) and ``x``
    (M, K) sorted by group: (G, N, K), each group's fp32 dŶᵀX̂ product, rounded once to ``out_dtype``."""
    d, a = dequantise_grouped(dy, sizes), dequantise_grouped(x, sizes)
    return torch.stack([d[rows].t() @ a[rows] for rows in _runs(sizes)]).to(out_dtype)


def _runs(sizes: list[int]) -> list[slice]:
    """Each group's rows, as slices of the sorted rows."""
    ends = [sum(sizes[: g + 1]) for g in range(len(sizes))]
    return [slice(end - m, end) for end, m in zip(ends, sizes)]
