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
"""

from __future__ import annotations

import torch

from axon4d import device as devices
from axon4d.device.pinned import to_device_queued

#: (device type, dtype, form) on which torch's kernel raised once: the padded GEMM runs from then on
_REFUSED: set[tuple[str, torch.dtype, str]] = set()


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
