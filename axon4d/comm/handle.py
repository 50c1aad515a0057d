"""An issued collective: ``Handle`` (its wait, timed and watched) and what a transport returns (``Work``).

The communicator (``axon4d.comm.communicator``) issues every collective through a transport and hands back a
``Handle``; the layers and the scheduler wait on it where they need the result. A wait records its
times in the collective's ``CommRecord`` (on an accelerator as device marks, read later) and, under
a watchdog, is marked as a wait that names the collective (``axon4d.reliability.watchdog``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from axon4d.comm.log import CommRecord
from axon4d.device.clock import Clock
from axon4d.reliability import watchdog


class Work(Protocol):
    """What a transport returns for an issued collective."""

    def wait(self) -> Any: ...


class Handle:
    """An issued collective. ``wait()`` blocks until done and returns the result tensor.

    Until then the handle also holds the collective's input (``source``), which the transport is
    still reading: the memory stays accounted to torch — its allocator and memory trackers see
    it as live, which it is — however the caller drops its own references."""

    __slots__ = ("_work", "_clock", "_result", "_record", "_finish", "_done", "_source", "_timed")

    def __init__(
        self,
        work: Work | None,
        result: torch.Tensor,
        record: CommRecord | None,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        source: torch.Tensor | None = None,
        clock: Clock | None = None,  # an accelerator's (Communicator.device_clock); None on the host
        timed: bool = True,  # False: the wait records no times (Communicator(timing=False))
    ):
        self._work = work
        self._timed = timed
        self._clock = clock  # an accelerator's clock, whose marks the wait takes; None: the host's time
        self._result = result
        self._record = record
        self._finish = finish
        self._done = work is None
        self._source = source if work is not None else None

    def wait(self) -> torch.Tensor:
        if self._done:
            return self._result
        record, work = self._record, self._work
        assert record is not None and work is not None  # a handle with work always has its record
        if not self._timed:
            self._wait_on(work)
        elif self._clock is not None:  # an accelerator: where the compute stream waits, and resumes
            record.mark("t_wait_start", self._clock.mark())
            self._wait_on(work)
            record.mark("t_wait_end", self._clock.mark())
        else:  # the host: its own clock
            start = time.perf_counter()
            self._wait_on(work)
            record.waited(start, time.perf_counter())
        self._done = True
        self._work = self._source = None
        if self._finish is not None:
            self._result = self._finish(self._result)
            self._finish = None
        return self._result

    def _wait_on(self, work: Work) -> None:
        """Block until ``work`` is done; under a watchdog, marked as a wait that names the collective."""
        dog = watchdog._current
        if dog is None:  # the common case: nothing to tell, nothing to set up per wait
            work.wait()
            return
        with dog.waiting(self._describe()):
            try:
                work.wait()
            except RuntimeError as e:  # a peer died or the transport timed out: say who
                raise RuntimeError(dog.diagnose(f"{self._describe()} failed ({e})")) from e

    @property
    def done(self) -> bool:
        return self._done

    @property
    def buffer(self) -> torch.Tensor:
        """The tensor the collective writes its result into: before ``wait`` returns its contents
        are not yet the result. ``wait`` returns this same tensor for a collective that reshapes
        nothing afterwards (all-reduce, all-to-all, an all-gather or reduce-scatter along dim 0)."""
        return self._result

    def _describe(self) -> str:
        """What this handle waits for, e.g. "all_gather over z (tag E10f, 1.5 MB)"."""
        r = self._record
        if r is None:
            return "a collective"
        return f"{r.op.value} over {r.axis} (tag {r.tag or '-'}, {r.payload_bytes / 1e6:.3g} MB)"


def stamp_completion(work: Work, record: CommRecord, clock: Clock) -> None:
    """Record the time the transport finished ``work`` (when it can tell us). On an accelerator the
    backend's future (NCCL's is complete as soon as the collective is queued) runs its callbacks on
    streams that wait for the collective's kernels, so a mark taken there happens when it is done.
    A collective already complete when it is issued (a transport that finished it synchronously)
    is stamped at once, without a callback."""
    try:
        future = work.get_future()  # type: ignore[attr-defined]
        if not clock.on_device and future.done():
            record.t_done = time.perf_counter()
        else:
            future.add_done_callback(record.completed_on(clock))
    except AttributeError:  # no future: the MPI transport's requests take a callback themselves
        add_done_callback = getattr(work, "add_done_callback", None)
        if add_done_callback is not None:
            add_done_callback(record.completed_on(clock))
    except RuntimeError:  # a backend without futures
        pass
