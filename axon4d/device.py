"""The one seam between axon4d and the hardware: devices, backends and dtypes.

Nothing else in the library names ``cuda`` or ``cpu``. On a GPU node every rank uses
``cuda:<local_rank>`` and NCCL; on a CPU-only machine every rank uses the CPU and gloo. Both
can be overridden (``axon4d.init(device=..., backend=...)``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: dtypes a layer may hold its parameters in.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def accelerator_available() -> bool:
    """True when a CUDA (or ROCm, which torch exposes as cuda) device is present."""
    return torch.cuda.is_available()


def default_device(local_rank: int = 0) -> torch.device:
    """The device a rank computes on: its local accelerator when there is one, else the host."""
    if accelerator_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    """The torch.distributed backend that fits ``device``: NCCL for accelerators, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def mesh_device_type(device: torch.device) -> str:
    """The ``device_type`` string DeviceMesh wants for ``device``."""
    return device.type


def bind(device: torch.device) -> None:
    """Make ``device`` the current device of this process (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return ``dtype`` if axon4d layers can hold parameters in it; raise ``ValueError`` otherwise."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported for parameters; use one of {names}")
    return dtype


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (accelerators run asynchronously; the host does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Run the enclosed work on a secondary stream of ``device`` (host work runs inline)."""
    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(device).wait_stream(stream)
    else:
        yield
