"""The device-memory figures of a machine file (``axon4d.plan.device_memory.FIT_FIELDS``), measured
or stated on the device ``axon4d calibrate`` runs on, each with its source (docs/planner.md,
"Memory a job can use").

On an accelerator (``accelerator``): the device's memory is measured (``torch.accelerator``'s
total); the context and libraries are the memory in use on the device less what torch's caching
allocator holds, once the grid is built (the context, the libraries' handles, a communicator of
the calibration's own world where it already exists); the workspaces are what the allocator still
holds allocated after the GEMM and attention tables ran and their tensors were freed; the
fragmentation is the share of the calibration's peak reservation its peak allocation did not use.
One NCCL communicator's buffers are NCCL's defaults (``NCCL_BUFFSIZE``, else 4 MiB Simple, plus
LL's 512 KiB and LL128's 4.69 MiB, per connection, two connections per channel, over
``nccl_channels``): a stated assumption, as the machine file's source says.

On a host (``host``): a process holds no accelerator context, library workspace or NCCL
communicator, so those are 0 by definition; the host allocator is not a caching one, so its
fragmentation is taken as 0 (a stated assumption, said so in the source).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

#: NCCL's buffers per connection at its defaults (LL, LL128, Simple) and connections per channel
NCCL_LL_BYTES, NCCL_LL128_BYTES, NCCL_SIMPLE_BYTES, NCCL_CONNECTIONS = 524288, 4915200, 4 * 2**20, 2


def host() -> dict[str, Any]:
    """The figures and their sources on a host (module docstring)."""
    none = "0 by definition on a host: a process there holds no accelerator context, library workspace or NCCL communicator"
    figures = {"cuda_context_bytes": 0.0, "device_workspace_bytes": 0.0, "nccl_buffer_bytes": 0.0, "fragmentation": 0.0}
    sources = {
        "cuda_context_bytes, device_workspace_bytes, nccl_buffer_bytes": none,
        "fragmentation": "a stated assumption, not measured: 0 (the host's allocator is not a caching allocator)",
    }
    return {"figures": figures, "sources": sources}


def in_use(device: torch.device) -> tuple[float, float, float]:
    """(bytes in use on ``device`` by every user, by the driver's count; bytes torch's caching
    allocator reserves there; the device's total bytes)."""
    free, total = torch.accelerator.get_memory_info(device)
    return float(total - free), float(torch.accelerator.memory_reserved(device)), float(total)


def nccl_buffers(nccl_channels: int) -> tuple[float, str]:
    """One NCCL communicator's buffer bytes at NCCL's defaults over ``nccl_channels`` channels, and
    the source that says it is a stated assumption (module docstring)."""
    buffsize = int(os.environ.get("NCCL_BUFFSIZE", NCCL_SIMPLE_BYTES))
    channels = max(nccl_channels, 1)
    source = (
        "a stated assumption, not measured: NCCL's default buffers (LL 512 KiB + LL128 4.69 MiB + Simple "
        f"{buffsize} B, NCCL_BUFFSIZE's or 4 MiB) per connection, two per channel, {channels} channel(s) (nccl_channels)"
    )
    return float(channels * NCCL_CONNECTIONS * (NCCL_LL_BYTES + NCCL_LL128_BYTES + buffsize)), source


def accelerator(device: torch.device, before: tuple[float, float, float]) -> dict[str, Any]:
    """The figures and their sources on an accelerator (module docstring) but NCCL's buffers
    (``nccl_buffers``, from the machine's channels): ``before`` is ``in_use`` right after the grid
    was built, before any table ran; called after the tables, their tensors freed."""
    gc.collect()
    used, reserved, total = before
    stats = torch.accelerator.memory_stats(device)
    peak_reserved = float(stats.get("reserved_bytes.all.peak", 0))
    peak_allocated = float(stats.get("allocated_bytes.all.peak", 0))
    fragmentation = min(max(1.0 - peak_allocated / peak_reserved, 0.0), 0.5) if peak_reserved > 0 else 0.0
    figures = {
        "memory_per_device": total,
        "cuda_context_bytes": max(used - reserved, 0.0),
        "device_workspace_bytes": float(torch.accelerator.memory_allocated(device)),
        "fragmentation": fragmentation,
    }
    by = "measured by `axon4d calibrate` on this device"
    sources = {
        "memory_per_device": f"{by}: its total memory (torch.accelerator.get_memory_info)",
        "cuda_context_bytes": f"{by}: memory in use (the driver's count) less torch's reservation once the grid was "
        "built: the context, the libraries' handles, any communicator of the calibration's world",
        "device_workspace_bytes": f"{by}: bytes still allocated after the GEMM and attention tables ran and their "
        "tensors were freed (the libraries' workspaces)",
        "fragmentation": f"{by}: the share of the calibration's peak reservation its peak allocation left unused",
    }
    return {"figures": figures, "sources": sources}
