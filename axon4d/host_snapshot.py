"""Host copies of many tensors, one page-locked buffer per storage (the asynchronous checkpoint's
snapshot, ``axon4d.checkpoint.AsyncSaver``).

A checkpoint saves each parameter and optimizer moment as pieces — rectangles of the global tensors,
views of the rank's storage (``axon4d.param_layout``). ``HostSnapshot`` copies the storages under
those views, whole, into host buffers made by ``axon4d.device.pinned_empty_like`` (page-locked on an
accelerator) and hands back each view at the same place in its storage's copy. One buffer per
storage rather than per piece: torch's caching host allocator rounds every page-locked buffer up to
a power of two and keeps it for the run (``axon4d.device.pinned``), so the host memory the snapshot
holds is Σ ``pinned_footprint`` over the storages — a parameter's, each moment's, a ZeRO master
part's — which is what the planner prices (``axon4d.plan.host_memory.snapshot_pinned``). The buffers
are kept and reused while the storages keep their sizes.
"""

from __future__ import annotations

import torch

from axon4d import device as devices
from axon4d.device.pinned import pinned_footprint


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostSnapshot:
    """Page-locked host copies of tensors, kept from one ``take`` to the next."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # one per storage, (storage bytes,) uint8, on the host

    def take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host views holding the values of ``tensors`` now: their storages copied whole, each
        tensor a view of its storage's copy with its own dtype, offset, sizes and strides. Returns
        once the copies are done (an accelerator is synchronised)."""
        storages: dict[int, torch.Tensor] = {}  # the storage's address → its bytes
        for t in tensors:
            storages.setdefault(t.untyped_storage().data_ptr(), _storage_bytes(t))
        sources = list(storages.values())
        if [b.numel() for b in self.buffers] != [s.numel() for s in sources]:
            self.buffers = [devices.pinned_empty_like(s) for s in sources]
        for buf, src in zip(self.buffers, sources):
            buf.copy_(src, non_blocking=True)  # from an accelerator: queued, awaited below
        for device in {s.device for s in sources}:
            devices.synchronize(device)
        copies = dict(zip(storages, self.buffers))
        return [
            torch.empty(0, dtype=t.dtype, device=devices.HOST).set_(
                copies[t.untyped_storage().data_ptr()].untyped_storage(), t.storage_offset(), t.shape, t.stride()
            )
            for t in tensors
        ]

    def footprint(self) -> int:
        """Host bytes the buffers take (``pinned_footprint`` of each; their bytes on the host)."""
        return sum(pinned_footprint(b.numel(), b.is_pinned()) for b in self.buffers)

    def clear(self) -> None:
        """Drop the buffers."""
        self.buffers = []
