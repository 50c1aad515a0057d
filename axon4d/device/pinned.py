"""Page-locked host memory carved from few allocations (the host-memory side of the hardware seam).

Activation offload (``axon4d.memory.host_pool``) and the asynchronous checkpoint's snapshot
(``axon4d.memory.host_snapshot``) copy many tensors between a device and host memory. Each tensor's bytes
are a view of a larger allocation made by ``pinned_bytes``, at an offset that ``carve`` lays out:
every piece starts at a multiple of ``ALIGN`` (512 B — a multiple of every dtype's size, so a view
of any dtype starts on an element, and of the 256 B that torch's device allocator aligns to, so a
copy between the two runs at the link's speed).

Why not one ``torch.empty(..., pin_memory=True)`` per tensor: torch's caching host allocator serves
each such request with a block of the next power of two bytes at or above it and keeps freed
blocks cached until the process ends (``at::CachingHostAllocator``: ``PowerOf2Ceil``), so a buffer
of 201 MB holds 256 MiB and a state of many such buffers holds up to twice its bytes
(``power_of_two_footprint``). ``pinned_bytes`` goes around it as torch's own checkpoint stager does
(``torch.distributed.checkpoint``'s ``StateDictStager``): a plain host allocation of exactly the
bytes asked for, page-locked with ``cudaHostRegister`` and unregistered when its storage is freed.
The host memory it holds is ``pinned_footprint``: its bytes, rounded up to whole pages when it is
page-locked. The runtime's counters and the planner's host-memory budget (``axon4d.plan.host_memory``)
both take their figures from ``carve`` and ``pinned_footprint``. A host without accelerators
page-locks nothing: the allocation is a plain host tensor of its bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

#: where each piece of an allocation starts: a multiple of this many bytes (module docstring)
ALIGN = 512
#: page-locking pins whole pages of this many bytes
PAGE = 4096


def round_up(nbytes: int, multiple: int) -> int:
    """The least multiple of ``multiple`` at or above ``nbytes``."""
    return -(-int(nbytes) // multiple) * multiple


def carve(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where pieces of ``sizes`` bytes lie in one allocation, in the given order: each piece's offset
    (a multiple of ``ALIGN``, right after the piece before it rounded up to ``ALIGN``) and the bytes
    the allocation needs (Σ of the sizes, each rounded up to ``ALIGN``)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += round_up(n, ALIGN)
    return offsets, end


def pinned_footprint(nbytes: int, accelerator: bool = True) -> int:
    """Bytes of host memory an allocation of ``nbytes`` from ``pinned_bytes`` holds: ``nbytes`` rounded
    up to whole ``PAGE``\\ s when it is page-locked for an accelerator, else ``nbytes``; 0 for none."""
    n = max(int(nbytes), 0)
    return round_up(n, PAGE) if accelerator else n


def power_of_two_footprint(nbytes: int) -> int:
    """Bytes of host memory one buffer of ``nbytes`` from torch's caching host allocator holds (what
    ``pinned_bytes`` avoids): the next power of two at or above ``nbytes``; 0 for an empty buffer."""
    n = int(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def pinned_bytes(nbytes: int, accelerator: bool) -> torch.Tensor:
    """A flat uint8 host tensor of ``nbytes`` (uninitialised): allocated by torch's host allocator
    at exactly that size and, when ``accelerator``, page-locked with ``cudaHostRegister`` (so copies
    to and from a device run asynchronously at the link's speed) and unregistered when its storage
    is freed. Raises ``RuntimeError`` naming the CUDA error if the memory cannot be page-locked."""
    storage = torch.UntypedStorage(int(nbytes))
    if accelerator and nbytes > 0:
        code = int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0))
        if code != 0:
            raise RuntimeError(
                f"page-locking {nbytes} bytes of host memory failed with CUDA error {code}; the node may be "
                "short of lockable memory (ulimit -l) — lower what the run pins (fewer offloaded blocks, no --async-save)"
            )
        weakref.finalize(storage, _unregister, storage.data_ptr()).atexit = False
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def to_device_queued(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without the host waiting for the device: on an accelerator a
    page-locked copy of it (torch's caching host allocator: small index arrays, whose power-of-two
    rounding does not matter) copied on the current stream with ``non_blocking`` — a copy from
    pageable memory would make the host wait for every queued kernel first. On the host: ``t``."""
    if device.type == "cpu" or device.type == "meta":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
