"""What a page-locked host buffer really takes (the host-memory side of the hardware seam).

``axon4d.device.pinned_empty_like`` asks torch for page-locked host memory on an accelerator
(activation offload's copies, the asynchronous checkpoint's snapshot). torch's caching host
allocator serves each such request with a block of the next power of two bytes at or above it, and
keeps freed blocks cached for reuse by later requests until the process ends
(``at::CachingHostAllocator``: sizes are rounded with ``PowerOf2Ceil``), so a buffer of 201 MB
holds 256 MiB of the node's memory. ``pinned_footprint`` is that size: the runtime's counters
(``axon4d.offload.OffloadStats.pinned_bytes``) and the planner's host-memory budget
(``axon4d.plan.host_memory``) both take it from here. A plain host tensor (no accelerator: the
staging copy of the host) takes its own bytes.
"""

from __future__ import annotations


def pinned_footprint(nbytes: int, accelerator: bool = True) -> int:
    """Bytes of host memory one buffer of ``nbytes`` from ``pinned_empty_like`` holds: the next
    power of two at or above ``nbytes`` when it is page-locked for an accelerator (torch's caching
    host allocator), else ``nbytes``; 0 for an empty buffer."""
    n = int(nbytes)
    if n <= 0:
        return 0
    if not accelerator:
        return n
    return 1 << (n - 1).bit_length()
