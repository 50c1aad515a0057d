"""Grouped GEMMs: one product per expert over its run of rows, in one kernel where the device has one
(docs/moe.md, E18).

The rows of ``a`` are sorted by group (expert) and group g owns the next ``sizes[g]`` rows. Three
products cover an expert layer's forward and backward:

    grouped_mm(a, b, sizes)        out[rows of g] = a[rows of g] @ b[g]           (M, K) × (G, K, N) → (M, N)
    grouped_mm_t(a, b, sizes)      out[rows of g] = a[rows of g] @ b[g]ᵀ          (M, K) × (G, N, K) → (M, N)
    grouped_weight_grad(dy, a, …)  out[g] = dy[rows of g]ᵀ @ a[rows of g]         → (G, N, K)

``torch._grouped_mm`` runs the first two as one kernel (native on an accelerator, a loop inside
torch on the host) where it accepts the operands: a dtype it supports and every stride a multiple
of 16 bytes. Otherwise, and always for the weight gradient on the host (whose torch kernel
refuses 2D × 2D groups there), a Python loop over the groups does the same products; a group of
no rows gives zero rows (and a zero weight gradient). ``native_grouped_mm`` says which one runs.
"""

from __future__ import annotations

import itertools

import torch

from axon4d import device as devices
from axon4d.device.pinned import to_device_queued

#: (device type, dtype) pairs on which torch's kernel failed once: the loop runs from then on
_REFUSED: set[tuple[str, torch.dtype]] = set()


def _aligned(t: torch.Tensor) -> bool:
    """Every stride but a unit one a multiple of 16 bytes (what ``torch._grouped_mm`` asks)."""
    return all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride())


def native_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes (M, K) ``a`` and (G, K, N) ``b`` on their device."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or a.dtype not in devices.SUPPORTED_DTYPES:
        return False
    if (a.device.type, a.dtype) in _REFUSED or a.shape[0] == 0:
        return False
    if devices.is_accelerator(a.device) and a.dtype != torch.bfloat16:
        return False  # the accelerator kernel is bf16's
    return _aligned(a) and _aligned(b)


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative row ends of the groups, int32 (torch's ``offs``), on ``device``. For an accelerator
    they are copied from page-locked host memory without blocking: a copy from pageable memory would
    make the host wait for the device at every grouped GEMM (the layer's one host sync is its
    counts exchange, docs/moe.md)."""
    return to_device_queued(torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32), device)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(M, K) rows sorted by group × (G, K, N) → (M, N): group g's rows times ``b[g]`` (no autograd)."""
    if len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(
            f"grouped_mm: {len(sizes)} group sizes adding to {sum(sizes)} for {b.shape[0]} groups and {a.shape[0]} rows"
        )
    if native_grouped_mm(a, b):
        try:
            return torch._grouped_mm(a, b, offs=_offsets(sizes, a.device))
        except RuntimeError:
            _REFUSED.add((a.device.type, a.dtype))
    out = a.new_empty((a.shape[0], b.shape[2]))  # (M, N)
    start = 0
    for g, n in enumerate(sizes):
        torch.matmul(a[start : start + n], b[g], out=out[start : start + n])  # (n, K) @ (K, N)
        start += n
    return out


def grouped_mm_t(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(M, K) × (G, N, K) → (M, N): group g's rows times ``b[g]ᵀ`` (``b`` in nn.Linear's orientation)."""
    return grouped_mm(a, b.transpose(-2, -1), sizes)


def grouped_weight_grad(dy: torch.Tensor, a: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(M, N) and (M, K) rows sorted by group → (G, N, K): ``dy[rows of g]ᵀ @ a[rows of g]`` per
    group, the weight gradient of ``grouped_mm_t`` in nn.Linear's orientation; zero for an empty group."""
    out = dy.new_empty((len(sizes), dy.shape[1], a.shape[1]))  # (G, N, K)
    start = 0
    for g, n in enumerate(sizes):
        if n == 0:
            out[g].zero_()
        else:
            torch.matmul(dy[start : start + n].t(), a[start : start + n], out=out[g])  # (N, n) @ (n, K)
        start += n
    return out
