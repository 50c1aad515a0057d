"""Host copies of many tensors, carved from one page-locked allocation (the asynchronous checkpoint's
snapshot, ``axon4d.checkpoint.AsyncSaver``).

A checkpoint saves each parameter and optimizer moment as pieces — rectangles of the global tensors,
views of the rank's storage (``axon4d.layout.param_layout``). ``HostSnapshot`` copies the storages under
those views, whole, into one host allocation (``axon4d.device.pinned.pinned_bytes``: exactly its
bytes, page-locked when a storage lies on an accelerator), each storage at the offset
``axon4d.device.pinned.carve`` gives it (a multiple of ``ALIGN``), and hands back each view at the
same place in its storage's copy. One allocation rather than one buffer per storage: torch's caching
host allocator would round every buffer up to a power of two and keep it for the run, up to twice
the state's bytes. The host memory the snapshot holds is ``pinned_footprint`` of Σ the storages'
bytes, each rounded up to ``ALIGN`` — what the planner prices
(``axon4d.plan.host_memory.snapshot_pinned``). The allocation is kept and reused while the storages
keep their sizes.
"""

from __future__ import annotations

import torch

from axon4d import device as devices
from axon4d.device.pinned import carve, pinned_bytes, pinned_footprint


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostSnapshot:
    """Page-locked host copies of tensors in one allocation, kept from one ``take`` to the next."""

    def __init__(self) -> None:
        self.memory: torch.Tensor | None = None  # (allocation bytes,) uint8 on the host
        self.accelerator = False  # whether ``memory`` is page-locked
        self.sizes: list[int] = []  # bytes of each storage it holds, in order
        self.offsets: list[int] = []  # where each lies in ``memory``

    def take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host views holding the values of ``tensors`` now: their storages copied whole, each
        tensor a view of its storage's copy with its own dtype, offset, sizes and strides. Returns
        once the copies are done (an accelerator is synchronised)."""
        storages: dict[int, torch.Tensor] = {}  # the storage's address → its bytes
        for t in tensors:
            storages.setdefault(t.untyped_storage().data_ptr(), _storage_bytes(t))
        sources = list(storages.values())
        sizes = [s.numel() for s in sources]
        if self.memory is None or sizes != self.sizes:
            self.memory = None  # the old allocation goes before the new one is made
            self.offsets, total = carve(sizes)
            self.accelerator = any(devices.is_accelerator(s.device) for s in sources)
            self.memory, self.sizes = pinned_bytes(total, self.accelerator), sizes
        for src, at in zip(sources, self.offsets):
            self.memory[at : at + src.numel()].copy_(src, non_blocking=True)  # from an accelerator: awaited below
        for device in {s.device for s in sources}:
            devices.synchronize(device)
        base = dict(zip(storages, self.offsets))  # the storage's address → its copy's byte offset
        out = []
        for t in tensors:
            at = base[t.untyped_storage().data_ptr()] // t.element_size()  # ALIGN: a whole number of elements
            view = torch.empty(0, dtype=t.dtype, device=devices.HOST)
            out.append(view.set_(self.memory.untyped_storage(), at + t.storage_offset(), t.shape, t.stride()))
        return out

    def footprint(self) -> int:
        """Host bytes the allocation takes (``pinned_footprint`` of its bytes)."""
        return 0 if self.memory is None else pinned_footprint(self.memory.numel(), self.accelerator)

    def clear(self) -> None:
        """Drop the allocation."""
        self.memory, self.sizes, self.offsets = None, [], []
