"""Grouped GEMMs: one product per expert over its run of rows, as one batched computation with no
Python loop over the groups (docs/moe.md, E18).

The rows of ``a`` are sorted by group (expert) and group g owns the next ``sizes[g]`` rows. Three
products cover an expert layer's forward and backward:

    grouped_mm(a, b, sizes)        out[rows of g] = a[rows of g] @ b[g]           (M, K) × (G, K, N) → (M, N)
    grouped_mm_t(a, b, sizes)      out[rows of g] = a[rows of g] @ b[g]ᵀ          (M, K) × (G, N, K) → (M, N)
    grouped_weight_grad(dy, a, …)  out[g] = dy[rows of g]ᵀ @ a[rows of g]         → (G, N, K)

Each runs one of two ways (``native_grouped_mm`` says which ``grouped_mm`` takes for its operands):

- ``torch._grouped_mm`` where it accepts the operands: fp32 or bf16 on the host (a loop over the
  groups inside torch's C++), bf16 on an accelerator with its grouped kernel (compute capability
  9.x or 10.x; elsewhere torch's fallback would copy the offsets to the host, a device sync), and
  every stride but a unit one a multiple of 16 bytes (on an accelerator the data's start too). The weight gradient is its 2D × 2D form,
  ``dyᵀ`` (N, M) × ``a`` (M, K) with the offsets along the reduced M, which gives (G, N, K). A
  kernel that raises once is not asked again for that device type, dtype and form.
- Otherwise a padded batched GEMM: each group's rows are scattered by one ``index_copy`` into a
  zero-filled (G, R, ·) tensor, R = max(sizes), one ``torch.bmm`` multiplies every group, and one
  ``index_select`` gathers the rows back. Padding rows are zero, so they add exactly zero: the
  result is each group's own product. **Memory:** this path allocates G·R rows of each operand
  and of the product, up to G times the M rows when one group holds all of them (routing skew).

A group of no rows gives no rows (and a zero weight gradient). The row index is computed on the
operands' device from the G sizes, which reach it from page-locked host memory without the host
waiting for the device (the layer's one host sync is its counts exchange, docs/moe.md).

**FP8** (the experts under ``bf16-fp8``, docs/moe.md "FP8"): ``scaled_grouped_mm`` and
``scaled_grouped_weight_grad`` multiply float8 operands with one fp32 scale per group, sums in
fp32, as ``torch._scaled_grouped_mm`` does on CUDA of compute capability 9.x or 10.x (H100, H200:
its row-wise kernel, given each group's scale repeated over its rows and columns; e4m3 operands,
bf16 output). Elsewhere — the host, whose ``_scaled_grouped_mm`` has no kernel; an Ada GPU; an
operand pair or output the kernel refuses, such as e5m2 gradients — each group runs one
``torch._scaled_mm`` (``device.fp8.scaled_mm``) with its tensorwise scales: the same products, a
Python loop over the groups. k and n are multiples of 16 (``device.fp8.ALIGN``), and in the weight
gradient each group's run of tokens too (``aligned_sizes``: zero-padded, which adds nothing).
"""

from __future__ import annotations

import torch

from axon4d import device as devices
from axon4d.device import fp8
from axon4d.device.pinned import to_device_queued

#: (device type, dtype, form) on which torch's kernel raised once: the padded GEMM runs from then on
_REFUSED: set[tuple[str, torch.dtype, str]] = set()
#: (device type, operands' dtypes, output dtype, form) on which ``torch._scaled_grouped_mm`` raised
#: once: one ``_scaled_mm`` per group runs from then on
_REFUSED_FP8: set[tuple[str, torch.dtype, torch.dtype, torch.dtype, str]] = set()


def _aligned(t: torch.Tensor) -> bool:
    """Every stride but a unit one a multiple of 16 bytes, and on an accelerator the data too
    (what ``torch._grouped_mm`` asks)."""
    if devices.is_accelerator(t.device) and t.data_ptr() % 16:
        return False
    return all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride())


def _native_kernel(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs its own grouped kernel on ``device`` (not a fallback that
    reads the offsets on the host): always on the host; on an accelerator, CUDA of compute
    capability 9.x or 10.x (torch's ``_grouped_mm_cuda``; ROCm's kernel depends on how torch was built)."""
    if not devices.is_accelerator(device):
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] in (9, 10)


def _native(x: torch.Tensor, y: torch.Tensor, form: str) -> bool:
    """Whether ``torch._grouped_mm(x, y, offs=…)`` takes these operands in ``form`` ("2d3d", "2d2d")."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != y.dtype or x.dtype not in devices.SUPPORTED_DTYPES:
        return False
    if (x.device.type, x.dtype, form) in _REFUSED or x.numel() == 0 or y.numel() == 0:
        return False
    if devices.is_accelerator(x.device) and (x.dtype != torch.bfloat16 or not _native_kernel(x.device)):
        return False  # the accelerator kernel is bf16's, on the architectures it is built for
    return _aligned(x) and _aligned(y)


def native_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes (M, K) ``a`` and (G, K, N) ``b`` on their device (else the
    padded batched GEMM runs)."""
    return _native(a, b, "2d3d")


def _sizes(sizes: list[int], device: torch.device) -> torch.Tensor:
    """The group sizes as int64 on ``device``, copied without the host waiting for the device."""
    return to_device_queued(torch.tensor(sizes, dtype=torch.int64), device)


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative row ends of the groups, int32 (torch's ``offs``), on ``device``, from page-locked
    host memory without blocking: a copy from pageable memory would make the host wait for the
    device at every grouped GEMM."""
    return to_device_queued(torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)


def _padded_rows(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Where each of the M rows lies among the G·R rows of the padded tensor, and R = max(sizes):
    row i of group g, the j-th of its group, goes to g·R + j. Computed on ``device`` from the sizes
    (``repeat_interleave`` given its output size, so the device is not asked for it)."""
    m, r = sum(sizes), max(sizes, default=0)
    n = _sizes(sizes, device)
    group = torch.repeat_interleave(torch.arange(len(sizes), device=device), n, output_size=m)  # (M,)
    first = n.cumsum(0) - n  # each group's first row
    return torch.arange(m, device=device) + group * r - first[group], r


def _pad(t: torch.Tensor, place: torch.Tensor, groups: int, r: int) -> torch.Tensor:
    """(M, C) rows sorted by group → (G, R, C): each group's rows first, then zero rows."""
    return t.new_zeros((groups * r, t.shape[1])).index_copy_(0, place, t).view(groups, r, t.shape[1])


def _check(a: torch.Tensor, groups: int, sizes: list[int], name: str) -> None:
    if len(sizes) != groups or sum(sizes) != a.shape[0] or min(sizes, default=0) < 0:
        raise ValueError(
            f"{name}: {len(sizes)} group sizes adding to {sum(sizes)} for {groups} groups and {a.shape[0]} rows; "
            "give one size ≥ 0 per group, adding to the rows"
        )


def grouped_mm(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(M, K) rows sorted by group × (G, K, N) → (M, N): group g's rows times ``b[g]`` (no autograd)."""
    _check(a, b.shape[0], sizes, "grouped_mm")
    if native_grouped_mm(a, b):
        try:
            return torch._grouped_mm(a, b, offs=_offsets(sizes, a.device))
        except (RuntimeError, NotImplementedError):
            _REFUSED.add((a.device.type, a.dtype, "2d3d"))
    if a.shape[0] == 0:
        return a.new_empty((0, b.shape[2]))
    place, r = _padded_rows(sizes, a.device)
    out = torch.bmm(_pad(a, place, len(sizes), r), b)  # (G, R, K) @ (G, K, N) → (G, R, N)
    return out.view(-1, b.shape[2]).index_select(0, place)  # (M, N)


def grouped_mm_t(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(M, K) × (G, N, K) → (M, N): group g's rows times ``b[g]ᵀ`` (``b`` in nn.Linear's orientation)."""
    return grouped_mm(a, b.transpose(-2, -1), sizes)


def grouped_weight_grad(dy: torch.Tensor, a: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """(M, N) and (M, K) rows sorted by group → (G, N, K): ``dy[rows of g]ᵀ @ a[rows of g]`` per
    group, the weight gradient of ``grouped_mm_t`` in nn.Linear's orientation; zero for an empty group."""
    _check(a, len(sizes), sizes, "grouped_weight_grad")
    if dy.shape[0] != a.shape[0]:
        raise ValueError(f"grouped_weight_grad: dy has {dy.shape[0]} rows and a {a.shape[0]}; both need one per row")
    groups, n, k = len(sizes), dy.shape[1], a.shape[1]
    if a.shape[0] == 0:
        return dy.new_zeros((groups, n, k))
    dyt = dy.t()  # (N, M)
    if _native(dyt, a, "2d2d"):
        try:
            out = torch._grouped_mm(dyt, a, offs=_offsets(sizes, a.device))  # (N, M) × (M, K) → (G, N, K)
        except (RuntimeError, NotImplementedError):
            _REFUSED.add((a.device.type, a.dtype, "2d2d"))
        else:
            empty = (torch.tensor(sizes) == 0).nonzero().flatten()  # on the host
            if len(empty):  # a kernel need not write a group that sums over no rows
                out.index_fill_(0, to_device_queued(empty, a.device), 0)
            return out
    place, r = _padded_rows(sizes, a.device)
    # (G, N, R) @ (G, R, K) → (G, N, K); a group's padding rows are zero in both
    return torch.bmm(_pad(dy, place, groups, r).transpose(1, 2), _pad(a, place, groups, r))


# -- FP8: one scale per group ---------------------------------------------------------------------------


def group_ids(sizes: list[int], device: torch.device) -> torch.Tensor:
    """(M,) int64 on ``device``: the group of each row (rows sorted by group), computed there from
    the sizes without the host waiting for the device."""
    n = _sizes(sizes, device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), n, output_size=sum(sizes))


def aligned_sizes(sizes: list[int], align: int = fp8.ALIGN) -> list[int]:
    """Each group's rows rounded up to a multiple of ``align``: the runs of tokens the FP8 weight
    gradient reduces over (each group's start aligned as the kernel needs)."""
    return [-(-m // align) * align for m in sizes]


def aligned_rows(sizes: list[int], device: torch.device, align: int = fp8.ALIGN) -> tuple[torch.Tensor, list[int]]:
    """Where each of the M rows lies when each group's run is zero-padded to ``aligned_sizes``: (M,)
    int64 on ``device`` — row j of group g goes to g's padded start + j — and the padded sizes. Made
    on the host and copied without the host waiting for the device."""
    padded = aligned_sizes(sizes, align)
    n, p = torch.tensor(sizes, dtype=torch.int64), torch.tensor(padded, dtype=torch.int64)
    shift = (p.cumsum(0) - p) - (n.cumsum(0) - n)  # each group's padded start minus its start
    place = torch.arange(sum(sizes)) + torch.repeat_interleave(shift, n, output_size=sum(sizes))
    return to_device_queued(place, device), padded


def native_scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, form: str) -> bool:
    """Whether ``torch._scaled_grouped_mm`` is asked for float8 ``a`` and ``b`` in ``form`` ("2d3d",
    "2d2d"): CUDA of compute capability 9.x or 10.x, bf16 output, e4m3 operands (what its row-wise
    kernel takes), and not refused before on this device."""
    if not hasattr(torch, "_scaled_grouped_mm") or not devices.is_accelerator(a.device):
        return False
    if (a.device.type, a.dtype, b.dtype, out_dtype, form) in _REFUSED_FP8 or out_dtype != torch.bfloat16:
        return False
    return a.dtype == b.dtype == torch.float8_e4m3fn and _native_kernel(a.device)


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    sizes: list[int],
    out_dtype: torch.dtype,
    *,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(M, K) float8 rows sorted by group × (G, N, K) float8 → (M, N) in ``out_dtype``: group g's
    rows (a·s_a[g]) times (b[g]·s_b[g])ᵀ, sums in fp32, ``scale_a`` and ``scale_b`` (G,) fp32.
    ``b`` is row-major in nn.Linear's orientation; K and N are multiples of 16, M is free."""
    _check(a, b.shape[0], sizes, "scaled_grouped_mm")
    m, n = a.shape[0], b.shape[1]
    if m and native_scaled_grouped_mm(a, b, out_dtype, "2d3d"):
        try:  # the row-wise kernel: each row's group scale, each group's scale over its N columns
            rows = scale_a.index_select(0, group_ids(sizes, a.device))  # (M,)
            cols = scale_b.unsqueeze(1).expand(-1, n).contiguous()  # (G, N)
            offs = _offsets(sizes, a.device)
            return torch._scaled_grouped_mm(  # (M, K) × (G, K, N) column-major → (M, N)
                a, b.transpose(-2, -1), rows, cols, offs=offs, out_dtype=out_dtype, use_fast_accum=fast_accum
            )
        except (RuntimeError, NotImplementedError, ValueError):
            _REFUSED_FP8.add((a.device.type, a.dtype, b.dtype, out_dtype, "2d3d"))
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    start = 0
    for g, rows_g in enumerate(sizes):  # one tensorwise GEMM per group: (m_g, K) × (N, K)ᵀ
        if rows_g:
            part = out[start : start + rows_g]
            fp8.scaled_mm(
                a[start : start + rows_g], b[g], scale_a[g], scale_b[g], out_dtype, fast_accum=fast_accum, out=part
            )
        start += rows_g
    return out


def scaled_grouped_weight_grad(
    dy_t: torch.Tensor,
    a_t: torch.Tensor,
    scale_dy: torch.Tensor,
    scale_a: torch.Tensor,
    sizes: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(G, N, K) in ``out_dtype``: out[g] = (dy_t[:, cols of g]·s_dy[g]) (a_t[:, cols of g]·s_a[g])ᵀ
    for float8 ``dy_t`` (N, M') and ``a_t`` (K, M'), row-major, whose columns are the tokens sorted by
    group in runs of ``sizes`` — each a multiple of 16 (``aligned_rows``: padding columns are zero).
    Sums in fp32; zero for a group of no tokens. ``scale_dy`` and ``scale_a``: (G,) fp32."""
    groups, n, k = len(sizes), dy_t.shape[0], a_t.shape[0]
    if sum(sizes) != dy_t.shape[1] or dy_t.shape[1] != a_t.shape[1] or not fp8.aligned(*sizes):
        raise ValueError(
            f"scaled_grouped_weight_grad: group sizes {sizes} for dy_t {tuple(dy_t.shape)} and a_t {tuple(a_t.shape)}; "
            f"give runs that add to both operands' columns, each a multiple of {fp8.ALIGN} (aligned_rows)"
        )
    empty = [g for g, m in enumerate(sizes) if m == 0]
    if sum(sizes) and native_scaled_grouped_mm(dy_t, a_t, out_dtype, "2d2d"):
        try:  # (N, M') × (M', K) column-major, offsets along M' → (G, N, K)
            out = torch._scaled_grouped_mm(
                dy_t,
                a_t.t(),
                scale_dy.repeat_interleave(n),  # (G·N,)
                scale_a.repeat_interleave(k),  # (G·K,)
                offs=_offsets(sizes, dy_t.device),
                out_dtype=out_dtype,
            )
        except (RuntimeError, NotImplementedError, ValueError):
            _REFUSED_FP8.add((dy_t.device.type, dy_t.dtype, a_t.dtype, out_dtype, "2d2d"))
        else:
            if empty:  # a kernel need not write a group that sums over no tokens
                out.index_fill_(0, to_device_queued(torch.tensor(empty), dy_t.device), 0)
            return out
    out = torch.empty((groups, n, k), dtype=out_dtype, device=dy_t.device)
    start = 0
    for g, m in enumerate(sizes):  # one tensorwise GEMM per group: (N, m_g) × (K, m_g)ᵀ
        if m:
            cols = slice(start, start + m)
            fp8.scaled_mm(dy_t[:, cols], a_t[:, cols], scale_dy[g], scale_a[g], out_dtype, out=out[g])
        else:
            out[g].zero_()
        start += m
    return out
