"""FP8 GEMMs on each device: which devices have them and the one call that runs them
(``torch._scaled_mm``, tensorwise scales; docs/design.md §2 "FP8 GEMMs").

CUDA runs e4m3 GEMMs on FP8 tensor cores from compute capability 8.9 (Ada, Hopper: H100/H200);
an A100 (8.0) has none, and asking for FP8 GEMMs there is refused (``check_gemm``). The host's
``_scaled_mm`` takes fp8 operands with singleton fp32 scales and computes the fp32 product of the
dequantised operands (no speed-up: it checks numerics, not time). The kernel's rules, which the
host does not enforce but the layers keep everywhere so a host run takes the path a GPU run takes:
the first operand row-major (m, k), the second column-major (k, n) — given here as its transpose
(n, k), row-major — with k and n multiples of ``ALIGN`` (16); m is free.
"""

from __future__ import annotations

import torch

#: k and n of an FP8 GEMM must be multiples of this (cuBLASLt's rule for ``_scaled_mm``)
ALIGN = 16
#: the compute capability from which CUDA has FP8 tensor cores (Ada 8.9, Hopper 9.0)
CUDA_FP8_CAPABILITY = (8, 9)


def gemm_available(device: torch.device) -> bool:
    """Whether ``device`` runs FP8 GEMMs: the host (emulated: exact numerics, no speed) and CUDA
    devices of compute capability ≥ 8.9; nothing else."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= CUDA_FP8_CAPABILITY
    return False


def check_gemm(device: torch.device) -> None:
    """Raise ``RuntimeError`` when ``device`` has no FP8 GEMMs, naming what would work."""
    if not gemm_available(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise RuntimeError(
            f"precision bf16-fp8 runs the Linear GEMMs in FP8, but {name} ({device}) has no FP8 tensor cores "
            f"(CUDA needs compute capability ≥ {CUDA_FP8_CAPABILITY[0]}.{CUDA_FP8_CAPABILITY[1]}: H100, H200); "
            "use bf16-fp8-gather or bf16-fp32-reduce"
        )


def aligned(*dims: int) -> bool:
    """Whether every one of ``dims`` (an FP8 GEMM's k and n) is a multiple of ``ALIGN``."""
    return all(d % ALIGN == 0 for d in dims)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(a·s_a) @ (b·s_b)ᵀ in ``out_dtype`` (+ ``bias``) for fp8 ``a`` (m, k) and ``b`` (n, k), both
    row-major, with () fp32 scales: one ``torch._scaled_mm`` (b passed as the column-major (k, n)
    it takes), sums in fp32 (``fast_accum``: Hopper's faster, less exact accumulation, per GEMM).
    Returns (m, n), written into ``out`` when given."""
    kwargs = {"out": out} if out is not None else {}
    return torch._scaled_mm(  # (m, k) @ (k, n) = (m, n)
        a, b.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum, **kwargs
    )
