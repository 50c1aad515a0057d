"""When work ran on a device: ``Clock``, the clock of the communication log, its step reports and
timelines (``axon4d.comm.log``) — host seconds on the host, timing events on an accelerator."""

from __future__ import annotations

import time
from typing import Any

import torch

#: a moment on a ``Clock``: host seconds, or a ``DeviceMark`` (read by ``Clock.seconds``)
Mark = Any
#: the host seconds after which a device mark starts a new anchor (``Clock``): CUDA gives the time
#: between two events as a float32 of milliseconds, exact to about 1 µs over 10 s
REANCHOR_S = 10.0


class _Anchor:
    """A timing event whose place on the host's scale is known (``seconds``) or follows from the
    anchor before it (``prev``) and the time between the two, read when first needed."""

    __slots__ = ("event", "host_s", "seconds", "prev")

    def __init__(self, event: Any, host_s: float, seconds: float | None, prev: _Anchor | None):
        self.event, self.host_s, self.seconds, self.prev = event, host_s, seconds, prev


class DeviceMark:
    """A timing event recorded on the current stream, and the anchor it is read against."""

    __slots__ = ("event", "anchor")

    def __init__(self, event: Any, anchor: _Anchor):
        self.event, self.anchor = event, anchor

    def query(self) -> bool:
        """Whether the device has reached it (reading it would not wait)."""
        return bool(self.event.query())


class Clock:
    """When work ran on one device, in seconds on ``time.perf_counter``'s scale — the clock of the
    communication log, its step reports and timelines (axon4d.comm.log).

    The host runs what it issues as it issues it, so there ``mark()`` is ``time.perf_counter()``.
    An accelerator runs its queue later than the host fills it: a NCCL collective is "issued" and
    "waited" in microseconds of host time (the wait only tells the compute stream to wait). There
    ``mark()`` records a timing event on the current stream — the moment the device reaches that
    point of its queue — and ``seconds(mark)`` reads it, blocking until it has happened; marks are
    placed on the host's scale by the first mark, taken as happening when it was made. Reading
    marks is a host synchronisation: do it after the step (``CommLog`` reads them lazily).

    A mark is read against an anchor: an earlier mark whose place is known. CUDA gives the time
    between two events as a float32 of milliseconds, which loses a step's precision when the two
    are hours apart (2⁻²³ of 10 h is 4 ms), so the anchor moves on: the first mark more than
    ``REANCHOR_S`` of host time after the current anchor becomes the next one, placed by the time
    from the one before it (a float32 of at most some 10 s: exact to about 1 µs). A step's times are
    as precise after 10 h as after a minute, with no call to make (``tests/test_clock.py``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on_device = device.type == "cuda"
        self._anchor: _Anchor | None = None

    def mark(self) -> Mark:
        """Now on this clock: a float on the host, a ``DeviceMark`` (an event recorded on the
        current stream) on an accelerator."""
        if not self.on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        now, anchor = time.perf_counter(), self._anchor
        if anchor is None or now - anchor.host_s >= REANCHOR_S:
            # the first anchor is placed at the host's time; a later one by the anchor before it
            anchor = self._anchor = _Anchor(event, now, now if anchor is None else None, anchor)
        return DeviceMark(event, anchor)

    def seconds(self, mark: Mark) -> float:
        """``mark`` in seconds (waits for an accelerator's event to have happened)."""
        if isinstance(mark, float):
            return mark
        mark.event.synchronize()
        return _placed(mark.anchor) + float(mark.anchor.event.elapsed_time(mark.event)) / 1e3


def _placed(anchor: _Anchor) -> float:
    """``anchor``'s place on the host's scale, placing first the anchors before it that are not yet
    (each by the one before it, which it then drops: the chain keeps no old events)."""
    chain, known = [], anchor
    while known.seconds is None and known.prev is not None:
        chain.append(known)
        known = known.prev
    for a in reversed(chain):
        prev = a.prev
        assert prev is not None and prev.seconds is not None
        a.event.synchronize()
        a.seconds, a.prev = prev.seconds + float(prev.event.elapsed_time(a.event)) / 1e3, None
    assert anchor.seconds is not None  # the first anchor is placed when made
    return anchor.seconds
