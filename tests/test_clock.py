"""The device clock stays exact on long runs (axon4d.device.clock.Clock): CUDA gives the time
between two timing events as a float32 of milliseconds, so marks read against one anchor made at
the start of a run lose a step's precision after hours. With a stand-in accelerator — timing
events on a simulated device timeline, their elapsed times rounded to float32 milliseconds as
CUDA's are — a step's times read after 10 h of steps are as precise as after a minute, where one
anchor for the whole run would be off by milliseconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from axon4d.device import clock as clocks

#: the device runs this far behind the host that queues its work
LAG_S = 0.004
#: a step's marks, in seconds from its start (a collective's issue, wait start, wait end, completion)
STEP_MARKS = (0.0, 0.000137, 0.004211, 0.004263, 0.31)


class _Time:
    """The simulated host clock (``time.perf_counter`` of ``axon4d.device.clock``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class _Event:
    """A stand-in for ``torch.cuda.Event``: recorded at the simulated device's time, its elapsed
    time to another a float32 of milliseconds, as CUDA's."""

    host: _Time

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.host.now + LAG_S  # where the device reaches it

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _Event) -> float:
        assert self.t is not None and other.t is not None
        return float(np.float32((other.t - self.t) * 1e3))


@pytest.fixture
def device(monkeypatch) -> tuple[clocks.Clock, _Time]:
    host = _Time()
    monkeypatch.setattr(clocks, "time", host)
    monkeypatch.setattr(_Event, "host", host, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return clocks.Clock(torch.device("cuda")), host


def _run(clock: clocks.Clock, host: _Time, hours: float, step_s: float = 1.7) -> list[float]:
    """Steps of ``step_s`` for ``hours``, each with the marks of ``STEP_MARKS`` read after it (as
    the comm log reads them); the errors of the last step's times from its first mark, in seconds."""
    end = host.now + hours * 3600
    while True:
        start = host.now
        marks = []
        for offset in STEP_MARKS:
            host.now = start + offset
            marks.append(clock.mark())
        read = [clock.seconds(m) for m in marks]
        if start + step_s > end:
            return [abs((r - read[0]) - offset) for r, offset in zip(read, STEP_MARKS)]
        host.now = start + step_s


def test_a_step_s_times_are_as_precise_after_10_hours_as_after_a_minute(device):
    clock, host = device
    after_a_minute = max(_run(clock, host, 1 / 60))
    after_10_hours = max(_run(clock, host, 10 - 1 / 60))
    assert after_a_minute < 2e-6 and after_10_hours < 2e-6, (after_a_minute, after_10_hours)


def test_one_anchor_for_the_whole_run_would_lose_milliseconds(device, monkeypatch):
    clock, host = device
    monkeypatch.setattr(clocks, "REANCHOR_S", float("inf"))
    assert max(_run(clock, host, 1 / 60)) < 2e-6
    assert max(_run(clock, host, 10 - 1 / 60)) > 2e-4  # the float32's step at 10 h: 4 ms


def test_marks_read_late_or_out_of_order_keep_their_places(device):
    clock, host = device
    marks = []
    for _ in range(40):  # none read for 40 anchors' time
        host.now += 3.1
        marks.append((host.now + LAG_S, clock.mark()))
    first = clock.seconds(marks[0][1])
    for true, mark in reversed(marks):
        assert abs((clock.seconds(mark) - first) - (true - marks[0][0])) < 1e-6
    assert clock._anchor is not None and clock._anchor.prev is None  # placed: no old events kept


def test_on_the_host_a_mark_is_the_host_s_time(monkeypatch):
    clock = clocks.Clock(torch.device("cpu"))
    assert not clock.on_device and isinstance(clock.mark(), float) and clock.seconds(2.5) == 2.5
