"""The communication log: every collective a rank issued, and how much of it was hidden (docs/design.md §4).

``CommRecord`` is one collective as it happened (op, axis, payload bytes, issue time, time blocked
waiting, completion); ``CommLog`` holds a rank's records and compute spans. Hidden communication
has one definition, used by the log's summary, the per-step report (axon4d.stepstats), the
training job's progress line and the benches: on this rank's clock,

    comm    = | ∪ [issue, done] |                   over the collectives
    blocked = | ∪ [wait start, min(wait end, done)] |
    hidden  = 1 − blocked / comm

so collectives that run at once (a prefetch beside an all-reduce) are not counted twice.

A collective still in flight when the log is read — issued, not yet waited for: ZeRO's all-gathers
over data, left to finish under the next forward (axon4d.zero.gathers) — is never waited for by the
read, which would cancel that overlap: its bytes count in the read of the step that issued it, its
times (and the time blocked when it is finally waited for) in the first read after its wait.
``clear()`` carries the records not waited for by then over to the next read (``carried``), for one
clear: a collective's times count in one read at most (in none when it was waited for between a
read and the clear — a checkpoint's ``settle``, outside any step).

Times are on the grid device's ``Clock`` (axon4d.device): on the host, when the host issued, waited
and saw completion; on an accelerator, when the device reached each point — the compute stream's
position at issue and at the wait, the collective's completion on its own stream — from timing
events read when the log is (``records``/``spans`` settle them), so "blocked" is the time the
compute stream stalled on the collective, the same meaning under NCCL as under gloo.

Timing can be switched off (``Communicator(timing=False)``, ``axon4d.init(comm_timing=False)``,
or ``AXON4D_COMM_TIMING=0`` for the default): an accelerator then records no timing events — some
four per collective and two per compute span — and the log holds what each collective moved (op,
axis, bytes, tag) but no times and no compute spans. What needs the times (``summary``,
``axon4d.stepstats``, ``axon4d.trace.dump``) raises a ``RuntimeError`` saying so; ``summary`` gives
the bytes and counts without times, and the training job reports "not timed". It is on by default.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from axon4d.device import HOST
from axon4d.device.clock import Clock, Mark
from axon4d.layout.geometry import Op, Term

#: the environment variable that sets whether collectives are timed by default ("0" or "off": not)
TIMING_ENV = "AXON4D_COMM_TIMING"


def timing_default() -> bool:
    """Whether collectives are timed when the caller does not say: unless ``AXON4D_COMM_TIMING``
    is "0", "off", "false" or "no"."""
    return os.environ.get(TIMING_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def comm_and_blocked(records: Iterable[CommRecord]) -> tuple[float, float]:
    """(communication seconds, seconds blocked waiting) of ``records``, each an interval union."""
    comm, blocked = [], []
    for r in records:
        if r.duration > 0:
            comm.append((r.t_issue, r.t_issue + r.duration))
        if r.blocked > 0 and r.t_wait_start is not None:
            blocked.append((r.t_wait_start, r.t_wait_start + r.blocked))
    return union_length(comm), union_length(blocked)


def happened(mark: Mark) -> bool:
    """Whether reading ``mark`` would not wait: a host time, or a device event that ``query()``
    reports complete (the device has reached it)."""
    query = getattr(mark, "query", None)
    return query is None or bool(query())


def hidden_pct(comm_s: float, blocked_s: float) -> float:
    """Share of communication time during which the rank was not blocked waiting, in percent."""
    return 100.0 * (1.0 - blocked_s / comm_s) if comm_s > 0 else 0.0


#: guards a record's completion and device marks between the transport's completion thread and
#: the rank's own (its wait, the log's reader)
_MARKS = threading.Lock()


@dataclasses.dataclass(slots=True)
class CommRecord:
    """One collective as it happened on this rank (times from ``time.perf_counter``)."""

    op: Op
    axis: str
    group_size: int
    payload_bytes: int
    tag: Term | str  # a Term for a collective with an equation or a fixed role, else a free label
    t_issue: float
    t_wait_start: float | None = None
    t_wait_end: float | None = None
    t_done: float | None = None
    #: device marks of the times above not read yet (an accelerator's clock); ``CommLog`` settles them
    marks: dict[str, Mark] | None = None
    #: its marks were read after its wait ended (``settle``): a completion reported later changes nothing
    settled: bool = False
    #: the part of the step it was issued in: "forward", "backward" (inside autograd's backward pass,
    #: a recomputed forward included) or "optimizer" (``Communicator.in_phase``)
    phase: str = "forward"

    def completed_on(self, clock: Clock) -> Callable[[Any], None]:
        """A callback for the transport's completion of this collective: stamps ``t_done`` on
        ``clock`` (a device mark, read later, or the host's time; the earliest completion wins).
        The transport may run it on its own thread after the wait has returned, even after the log
        was read: a record already settled keeps its times (a completion marked then is later than
        the wait's end, to which ``settle`` clamps it anyway)."""

        def done(_: Any = None) -> None:
            if clock.on_device:
                with _MARKS:
                    if not self.settled:
                        self._mark("t_done", clock.mark(), True)
                return
            now = time.perf_counter()
            with _MARKS:  # the wait may be stamping its end meanwhile (``waited``)
                if self.t_done is None or self.t_done > now:
                    self.t_done = now

        return done

    def waited(self, start: float, end: float) -> None:
        """Stamp a host wait from ``start`` to ``end`` (``time.perf_counter``): the collective was
        complete by its end. A completion the transport's thread reports, before or after, keeps
        the earlier of the two times (``completed_on``)."""
        with _MARKS:
            self.t_wait_start, self.t_wait_end = start, end
            if self.t_done is None or self.t_done > end:
                self.t_done = end

    def mark(self, field: str, mark: Mark, first: bool = False) -> None:
        """Set time ``field`` to device ``mark`` (read later); with ``first``, only if not set yet."""
        with _MARKS:
            self._mark(field, mark, first)

    def _mark(self, field: str, mark: Mark, first: bool) -> None:
        if self.marks is None:
            self.marks = {}
        if not (first and field in self.marks):
            self.marks[field] = mark

    @property
    def waited_for(self) -> bool:
        """Whether this rank has waited for the collective (its wait's end is stamped or marked)."""
        return self.t_wait_end is not None or bool(self.marks and "t_wait_end" in self.marks)

    def settle(self, clock: Clock) -> None:
        """Read the pending device marks into the times. A collective waited for: all of them (this
        blocks until the compute stream reached its wait's end), and the record is ``settled``:
        later completion reports are dropped. One still in flight: only the marks that have
        ``happened`` — never waiting for the collective — the rest kept for a later read."""
        with _MARKS:  # the transport's thread may report completion meanwhile (``completed_on``)
            marks, self.marks = self.marks, None
            waited = self.t_wait_end is not None or bool(marks and "t_wait_end" in marks)
            for field, mark in (marks or {}).items():
                if waited or happened(mark):
                    setattr(self, field, clock.seconds(mark))
                else:
                    self._mark(field, mark, False)
            self.settled = self.t_wait_end is not None
        if self.t_done is not None and self.t_wait_end is not None and self.t_done > self.t_wait_end:
            self.t_done = self.t_wait_end  # the compute stream resumed only after completion

    @property
    def blocked(self) -> float:
        """Seconds this rank spent blocked in ``wait()`` before the collective completed."""
        if self.t_wait_start is None or self.t_wait_end is None:
            return 0.0
        end = self.t_wait_end if self.t_done is None else min(self.t_wait_end, self.t_done)
        return max(0.0, end - self.t_wait_start)

    @property
    def duration(self) -> float:
        """Seconds from issue to completion (as far as this rank could observe it)."""
        end = self.t_done if self.t_done is not None else self.t_wait_end
        return 0.0 if end is None else max(0.0, end - self.t_issue)

    @property
    def traffic_bytes(self) -> float:
        """Bytes a ring algorithm sends per rank for this collective (docs/design.md §3); a shift to
        the next rank sends its whole payload."""
        phi = (self.group_size - 1) / self.group_size
        factor = 2 * phi if self.op == Op.ALL_REDUCE else 1.0 if self.op == Op.SHIFT else phi
        return factor * self.payload_bytes


class CommLog:
    """All collectives this rank issued since the last ``clear()``, timed on ``clock``."""

    def __init__(self, clock: Clock | None = None, timed: bool = True) -> None:
        self.clock = clock if clock is not None else Clock(HOST)
        #: whether its collectives and compute spans carry times (module docstring)
        self.timed = timed
        self._records: list[CommRecord] = []
        self._spans: list[tuple[str, Mark, Mark]] = []  # (name, start, end): compute, for timelines
        #: collectives issued before the last ``clear()`` and not waited for then (module docstring)
        self._carried: list[CommRecord] = []
        self._lock = threading.Lock()

    @property
    def records(self) -> list[CommRecord]:
        """The collectives issued since ``clear()``, their times read: on an accelerator this waits
        for those waited for to have run, never for one still in flight (``CommRecord.settle``)."""
        self._settle()
        return self._records

    @property
    def carried(self) -> list[CommRecord]:
        """The collectives issued before the last ``clear()`` that were still in flight then (not
        waited for), their times read like ``records``': whose times the next read counts."""
        self._settle()
        return self._carried

    def timed_records(self) -> list[CommRecord]:
        """The collectives whose times this read counts (``summary``): those of ``records`` and
        ``carried`` that have been waited for."""
        return [r for r in self.carried + self.records if r.waited_for]

    @property
    def spans(self) -> list[tuple[str, float, float]]:
        """The compute spans (name, start, end), their times read like ``records``'."""
        self._settle()
        return self._spans

    def _settle(self) -> None:
        if not self.clock.on_device:  # host times are read as they happen
            return
        with self._lock:
            for r in self._carried + self._records:  # a wait or completion may have marked one since the last read
                r.settle(self.clock)
            self._spans = [(name, self.clock.seconds(a), self.clock.seconds(b)) for name, a, b in self._spans]

    def add(self, record: CommRecord) -> None:
        self._records.append(record)  # one list append: atomic, no lock per collective

    def add_span(self, name: str, start: Mark, end: Mark) -> None:
        """Record a stretch of compute between two marks of ``clock`` (``Scheduler.compute``);
        nothing in an untimed log."""
        if self.timed:
            self._spans.append((name, start, end))

    def check_timed(self, what: str) -> None:
        """Raise ``RuntimeError`` naming ``what`` when this log holds no times."""
        if not self.timed:
            raise RuntimeError(
                f"{what} needs the collectives' times, and this communicator does not time them "
                f"({TIMING_ENV}=0 or timing=False): leave timing on (the default) where the log's times are read"
            )

    def clear(self) -> None:
        """Start a new read: forget the collectives and compute spans, except the collectives still
        in flight (not waited for), carried to the next read for their times (``carried``)."""
        with self._lock:
            self._carried = [r for r in self._records if self.timed and not r.waited_for]
            self._records = []
            self._spans = []

    def bytes_by_axis(self, op: Op | None = None) -> dict[str, int]:
        """Total payload bytes per axis, optionally for one kind of collective."""
        out: dict[str, int] = {}
        for r in self.records:
            if op is None or r.op == op:
                out[r.axis] = out.get(r.axis, 0) + r.payload_bytes
        return out

    def summary(self) -> dict[str, Any]:
        """Per-axis bytes and counts of ``records``; communication time and blocked time, and the
        share hidden, of the collectives waited for among them and ``carried`` (times as interval
        unions: see the module docstring); an untimed log gives the bytes and counts, its times and
        share None."""
        records = list(self.records)
        axes: dict[str, dict[str, Any]] = {}
        for r in records:
            a = axes.setdefault(r.axis, {"count": 0, "bytes": 0, "comm_s": None, "blocked_s": None})
            a["count"] += 1
            a["bytes"] += r.payload_bytes
        if not self.timed:
            return {"axes": axes, "comm_s": None, "blocked_s": None, "hidden_pct": None}
        timed = self.timed_records()
        for r in timed:  # a carried collective's axis may have none of this read's records
            axes.setdefault(r.axis, {"count": 0, "bytes": 0, "comm_s": None, "blocked_s": None})
        for axis, a in axes.items():
            a["comm_s"], a["blocked_s"] = comm_and_blocked(r for r in timed if r.axis == axis)
        comm, blocked = comm_and_blocked(timed)
        return {"axes": axes, "comm_s": comm, "blocked_s": blocked, "hidden_pct": hidden_pct(comm, blocked)}

    def format_summary(self) -> str:
        """One line: bytes per axis, communication time, time blocked and the share hidden."""
        s = self.summary()
        parts = [f"{a}={v['bytes'] / 2**20:.2f}MiB" for a, v in sorted(s["axes"].items())]
        if not self.timed:
            return f"comm {' '.join(parts) or 'none'} | not timed ({TIMING_ENV}=0)"
        return (
            f"comm {' '.join(parts) or 'none'} | time {s['comm_s'] * 1e3:.1f} ms, "
            f"blocked {s['blocked_s'] * 1e3:.1f} ms, hidden {s['hidden_pct']:.0f}%"
        )
