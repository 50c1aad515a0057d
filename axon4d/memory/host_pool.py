"""A pool of page-locked host memory for buffers whose sizes come one at a time and are given back in
any order (activation offload's host copies, ``axon4d.memory.offload``).

The pool holds few large allocations (``axon4d.device.pinned.pinned_bytes``: exactly their bytes,
page-locked on an accelerator) and hands out views of them at ``ALIGN``-aligned offsets, first fit
in a list of free ranges that merge again as buffers come back. When no free range is large enough
it adds an allocation of just the bytes asked for. Once every buffer has come back (the end of a
step's backward), the next request finds the pool in more than one allocation and replaces them
by a single one of their total: a step that asks for the same buffers as the one before (a training
loop) then fits that one allocation, laid out as ``carve`` lays out the buffers in the order asked
for, and holds ``pinned_footprint`` of Σ the buffers' sizes rounded up to ``ALIGN`` — what the
planner prices (``axon4d.plan.host_memory.offload_pinned``) — where one buffer per tensor from
torch's caching host allocator would hold up to twice as much.

A buffer's range is given to a new one while the copies issued on the pool's stream are still
queued: every copy into and out of the pool runs on that one stream (offload's side stream), so a
later copy into a range starts after the earlier copy out of it. Before an allocation is freed the
device is synchronised, so no copy reads or writes it after.
"""

from __future__ import annotations

import threading

import torch

from axon4d import device as devices
from axon4d.device.pinned import ALIGN, pinned_bytes, pinned_footprint, round_up


class HostPool:
    """Host buffers for copies of ``device``'s tensors, carved from few allocations (module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.accelerator = devices.is_accelerator(device)
        self._chunks: list[torch.Tensor] = []  # flat uint8 allocations
        self._free: list[list[tuple[int, int]]] = []  # per allocation: free (start, end) ranges, sorted
        self._live: dict[int, tuple[int, int, int]] = {}  # id → (allocation, start, bytes reserved)
        self._ids = 0
        self._lock = threading.Lock()  # buffers come back from autograd's threads

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A buffer of ``nbytes``: its id (for ``give``) and a flat uint8 host view of the pool, at an
        ``ALIGN``-aligned offset; its contents are undefined."""
        need = round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            if not self._live and len(self._chunks) > 1:
                self._merge()
            place = self._first_fit(need)
            if place is None:
                self._chunks.append(pinned_bytes(need, self.accelerator))
                self._free.append([(0, need)])
                place = self._first_fit(need)
            assert place is not None
            chunk, start = place
            self._ids += 1
            self._live[self._ids] = (chunk, start, need)
            return self._ids, self._chunks[chunk][start : start + nbytes]

    def give(self, buffer_id: int) -> None:
        """Take back the buffer ``take`` handed out as ``buffer_id`` (its range is free again)."""
        with self._lock:
            chunk, start, need = self._live.pop(buffer_id)
            ranges = self._free[chunk]
            ranges.append((start, start + need))
            ranges.sort()
            merged = [ranges[0]]
            for lo, hi in ranges[1:]:
                if lo == merged[-1][1]:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            self._free[chunk] = merged

    @property
    def chunks(self) -> list[torch.Tensor]:
        """The pool's allocations now (flat uint8 host tensors; to count or track the memory)."""
        return list(self._chunks)

    def footprint(self) -> int:
        """Host bytes the pool's allocations hold (``pinned_footprint`` of each)."""
        return sum(pinned_footprint(c.numel(), self.accelerator) for c in self._chunks)

    def reserved(self) -> int:
        """Bytes of the pool its buffers hold now, each rounded up to ``ALIGN``."""
        return sum(need for _, _, need in self._live.values())

    def _first_fit(self, need: int) -> tuple[int, int] | None:
        """The first free range of at least ``need`` bytes, taken from the free list: (allocation, start)."""
        for c, ranges in enumerate(self._free):
            for k, (lo, hi) in enumerate(ranges):
                if hi - lo >= need:
                    if hi - lo == need:
                        del ranges[k]
                    else:
                        ranges[k] = (lo + need, hi)
                    return c, lo
        return None

    def _merge(self) -> None:
        """Replace the allocations, none of them in use, by one of their total bytes."""
        total = sum(c.numel() for c in self._chunks)
        devices.synchronize(self.device)  # no copy queued on the device still reads or writes them
        self._chunks = []  # the old ones go before the new one is made: the peak stays the total
        self._chunks = [pinned_bytes(total, self.accelerator)]
        self._free = [[(0, total)]]
