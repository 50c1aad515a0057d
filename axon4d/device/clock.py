"""When work ran on a device: ``Clock``, the clock of the communication log, its step reports and
timelines (``axon4d.comm.log``) — host seconds on the host, timing events on an accelerator."""

from __future__ import annotations

import time
from typing import Any

import torch

#: a moment on a ``Clock``: host seconds, or an accelerator's timing event (read by ``Clock.seconds``)
Mark = Any


class Clock:
    """When work ran on one device, in seconds on ``time.perf_counter``'s scale — the clock of the
    communication log, its step reports and timelines (axon4d.comm.log).

    The host runs what it issues as it issues it, so there ``mark()`` is ``time.perf_counter()``.
    An accelerator runs its queue later than the host fills it: a NCCL collective is "issued" and
    "waited" in microseconds of host time (the wait only tells the compute stream to wait). There
    ``mark()`` records a timing event on the current stream — the moment the device reaches that
    point of its queue — and ``seconds(mark)`` reads it, blocking until it has happened; marks are
    placed on the host's scale by the first mark, taken as happening when it was made. Reading
    marks is a host synchronisation: do it after the step (``CommLog`` reads them lazily)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on_device = device.type == "cuda"
        self._anchor: Mark = None
        self._anchor_s = 0.0

    def mark(self) -> Mark:
        """Now on this clock: a float on the host, an event recorded on the current stream on an accelerator."""
        if not self.on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._anchor is None:
            self._anchor, self._anchor_s = event, time.perf_counter()
        return event

    def seconds(self, mark: Mark) -> float:
        """``mark`` in seconds (waits for an accelerator's event to have happened)."""
        if isinstance(mark, float):
            return mark
        mark.synchronize()
        return self._anchor_s + float(self._anchor.elapsed_time(mark)) / 1e3
