"""MFU's denominator, and a start-up check that the compute dtype is fast here.

``rank_peak_tflops`` is one rank's peak: ``--peak-tflops`` when given; else, on an accelerator
this module knows (``ACCELERATORS``: the vendors' published dense matrix peaks by dtype), the
table's figure for the compute dtype — TF32's for fp32 when torch may use it; else a measured
square matmul after a barrier, so all ranks share the machine as they will while training (512²
on the host; 8192² on an unknown accelerator, where a small matmul is launch-bound and would make
MFU read above 100%). ``world_peak_tflops`` sums it over the grid. ``mfu`` is achieved model
FLOP/s over that peak.

``check_compute_dtype`` times a 512 × 512 matmul in the compute dtype and in fp32 on the grid's
device (``axon4d.device.matmul_seconds``): where the compute dtype is more than ``SLOW_RATIO``
times slower — bf16 on a CPU without AVX-512 BF16 runs some 50× slower than fp32 — rank 0 prints
a warning naming both speeds and suggesting ``--precision fp32``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch

from axon4d import device as devices
from axon4d.grid.mesh import Grid
from axon4d.reliability import watchdog

#: warn when the compute dtype's matmul is this many times slower than fp32's.
SLOW_RATIO = 8.0
#: the matmul size of the dtype check.
CHECK_N = 512


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Published dense (no sparsity) matrix peaks of one accelerator, TFLOP/s, by dtype."""

    name: str  # matched against torch's device name, case-insensitively
    bf16: float
    tf32: float
    fp32: float
    source: str


#: Known accelerators, most specific names first. Per device torch sees (an MI250X is two).
ACCELERATORS = (
    Accelerator("H100 PCIe", 756.0, 378.0, 51.2, "NVIDIA H100 datasheet (PCIe), dense"),
    Accelerator("H100 NVL", 835.0, 417.5, 60.0, "NVIDIA H100 datasheet (NVL), dense"),
    Accelerator("H100", 989.4, 494.7, 66.9, "NVIDIA H100 datasheet (SXM5), dense"),
    Accelerator("GH200", 989.4, 494.7, 66.9, "NVIDIA GH200 datasheet (H100 SXM5 figures), dense"),
    Accelerator("H200", 989.4, 494.7, 66.9, "NVIDIA H200 datasheet (SXM), dense"),
    Accelerator("A100", 312.0, 156.0, 19.5, "NVIDIA A100 datasheet, dense"),
    Accelerator("MI250X", 191.5, 47.9, 47.9, "AMD Instinct MI250X datasheet, per GCD (half the OAM)"),
    Accelerator("MI300X", 1307.4, 653.7, 163.4, "AMD Instinct MI300X datasheet, dense"),
)
#: the matmul size that measures an unknown accelerator (a small one is launch-bound there)
ACCELERATOR_PROBE_N = 8192
HOST_PROBE_N = 512


def known_peak(device_name: str, dtype: torch.dtype, tf32: bool) -> tuple[float, str] | None:
    """(TFLOP/s, where from) for ``dtype`` on the accelerator called ``device_name`` from
    ``ACCELERATORS`` (fp32 at TF32's peak when ``tf32``); None for one it does not know."""
    lowered = device_name.lower()
    for acc in ACCELERATORS:
        if acc.name.lower() in lowered:
            if dtype in (torch.bfloat16, torch.float16):
                return acc.bf16, f"{acc.name} {str(dtype).removeprefix('torch.')}: {acc.source}"
            if tf32:
                return acc.tf32, f"{acc.name} tf32: {acc.source}"
            return acc.fp32, f"{acc.name} float32: {acc.source}"
    return None


def rank_peak_tflops(grid: Grid, dtype: torch.dtype, given: float = 0.0) -> tuple[float, str]:
    """One rank's peak TFLOP/s in ``dtype`` and where it came from (module docstring)."""
    if given > 0:
        return given, "--peak-tflops"
    if not devices.is_host(grid.device):
        tf32 = dtype == torch.float32 and devices.fp32_matmul_uses_tf32(grid.device)
        known = known_peak(devices.device_name(grid.device), dtype, tf32)
        if known is not None:
            return known
        n = ACCELERATOR_PROBE_N
    else:
        n = HOST_PROBE_N
    return measure_peak_tflops(grid, dtype, n=n), f"measured ({n}x{n} matmul)"


def measure_peak_tflops(grid: Grid, dtype: torch.dtype, seconds: float = 0.5, n: int = HOST_PROBE_N) -> float:
    """Matmul TFLOP/s of this rank while every rank measures at once (the machine's shared peak)."""
    a = torch.randn(n, n, dtype=dtype, device=grid.device)
    b = torch.randn(n, n, dtype=dtype, device=grid.device)
    torch.matmul(a, b)
    with watchdog.waiting("the device synchronize before the peak probe"):
        devices.synchronize(grid.device)
    grid.comm.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        count += 1
    with watchdog.waiting("the device synchronize after the peak probe"):
        devices.synchronize(grid.device)  # an accelerator queues the matmuls: count them once they ran
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e12


def world_peak_tflops(grid: Grid, per_rank: float = 0.0) -> tuple[float, str]:
    """Peak TFLOP/s of the whole grid — ``per_rank`` on every rank, or ``rank_peak_tflops`` (at 0),
    summed over the world — and where rank 0's figure came from."""
    peak_rank, source = rank_peak_tflops(grid, grid.precision.compute, per_rank)
    total = torch.tensor([peak_rank], dtype=torch.float64, device=grid.device)
    total = grid.comm.all_reduce(total, "world", tag="peak").wait()
    with watchdog.waiting("the host read of the grid's peak TFLOP/s (its all-reduce over world)"):
        return total.item(), source


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float) -> float:
    """Model FLOP utilisation: model FLOP/s achieved over the peak (``peak_tflops`` in TFLOP/s)."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)


def slow_dtype_warning(name: str, seconds: float, fp32_seconds: float, device: torch.device) -> str | None:
    """The warning for a compute dtype ``name`` whose matmul takes ``seconds`` against fp32's
    ``fp32_seconds``, or None when it is at most ``SLOW_RATIO`` times slower."""
    ratio = seconds / fp32_seconds
    if ratio <= SLOW_RATIO:
        return None
    flops = 2 * CHECK_N**3
    return (
        f"WARNING: {name} matmuls are {ratio:.0f}x slower than fp32 on {device}: "
        f"{flops / seconds / 1e9:.3g} GFLOP/s in {name} against {flops / fp32_seconds / 1e9:.3g} GFLOP/s in fp32 "
        f"({CHECK_N}x{CHECK_N} matmul). This machine has no fast {name} kernels; train with --precision fp32."
    )


def check_compute_dtype(
    grid: Grid, timer: Callable[[torch.device, torch.dtype], float] | None = None, out: TextIO | None = None
) -> str | None:
    """Time the grid's compute dtype against fp32 on rank 0 (``timer(device, dtype)`` → seconds per
    matmul; ``axon4d.device.matmul_seconds`` by default) and print ``slow_dtype_warning``'s text
    there when it is much slower; return that text (None on other ranks, for fp32, or when fast)."""
    compute = grid.precision.compute
    if grid.rank != 0 or compute == torch.float32:
        return None
    timer = timer or (lambda device, dtype: devices.matmul_seconds(device, dtype, n=CHECK_N))
    name = str(compute).removeprefix("torch.")
    with watchdog.waiting(f"the {name} and float32 matmul timings on rank 0 (device synchronize)"):
        seconds, fp32_seconds = timer(grid.device, compute), timer(grid.device, torch.float32)
    warning = slow_dtype_warning(name, seconds, fp32_seconds, grid.device)
    if warning is not None:
        print(warning, file=out or sys.stdout, flush=True)
    return warning
