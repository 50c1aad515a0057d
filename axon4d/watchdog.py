"""Bounded failure (docs/reliability.md): a job whose rank raises, hangs or dies ends within a
deadline, and every rank that is still running says which rank failed and, where it knows, which
collective it was waiting in, on which axis.

One ``Watchdog`` per process, started by the training job (``axon4d.train``; ``guard`` for a loop
of one's own). It keeps a daemon thread and a client of the job's key-value store (the
rendezvous store of torch.distributed: torchrun's agent, or rank 0 for mpirun and plain
launches), and works with three facts:

- **heartbeats**: the thread adds 1 to ``axon4d/beat/<rank>`` every ``beat_s`` seconds. A rank
  whose count stops is hung (stopped, swapping, deadlocked) or dead.
- **failures**: a rank that raises announces it before anything else (``announce``):
  ``axon4d/failed/<rank>`` holds its one-line error and ``axon4d/failures`` counts them. Every
  other rank's thread sees the count within ``beat_s``, prints who failed and why, and ends its
  own process — whatever collective it was blocked in (exit code ``EXIT_PEER_FAILED``).
- **waits**: the communicator (``axon4d.comm.Handle.wait``) and other blocking phases (a
  checkpoint's save) mark what this rank is waiting for (``waiting``). A wait longer than the
  deadline — ``startup_s`` until ``steady()`` is called after the first step, ``timeout_s`` after —
  ends the process (``EXIT_TIMEOUT``) after naming the wait and the ranks whose heartbeat stopped.

Store operations use their own client with a short timeout, so a hung store host makes the
diagnosis say so instead of hanging it. Nothing here calls a collective: after an exception no
rank enters one (``axon4d.runtime.shutdown`` skips its barrier while an exception propagates).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

#: exit code of a rank ended because another rank failed
EXIT_PEER_FAILED = 3
#: exit code of a rank ended because a wait passed its deadline
EXIT_TIMEOUT = 4
#: heartbeats a failing rank waits after announcing its error, before it ends or aborts the job
GRACE_BEATS = 3
_PREFIX = "axon4d/"
_current: Watchdog | None = None


def current() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _current


def _client(store: Any, timeout_s: float) -> Any:
    """A store client of its own with a short timeout (TCPStore), else ``store`` itself."""
    inner = store
    while hasattr(inner, "underlying_store"):  # PrefixStore layers of the default group
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        return dist.TCPStore(
            inner.host,
            inner.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    return inner


def default_store() -> Any | None:
    """The store of torch.distributed's default group, or None without one."""
    if not dist.is_initialized():
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


class Watchdog:
    """Heartbeats, failure announcements and wait deadlines of one rank (module docstring)."""

    def __init__(
        self,
        rank: int,
        world: int,
        store: Any,
        timeout_s: float = 60.0,
        startup_s: float = 300.0,
        beat_s: float = 1.0,
        store_timeout_s: float = 10.0,
        exit: Callable[[int], None] = os._exit,
        out: Any = None,
    ):
        for name, value in (("timeout_s", timeout_s), ("startup_s", startup_s), ("beat_s", beat_s)):
            if not value > 0:
                raise ValueError(f"{name} = {value!r}: a deadline must be a positive number of seconds")
        self.rank, self.world = rank, world
        self.timeout_s, self.startup_s, self.beat_s = timeout_s, startup_s, beat_s
        self._store = _client(store, store_timeout_s)
        self._exit = exit
        self._out = out if out is not None else sys.stderr
        self._steady = False
        self._failing = False
        self._wait: tuple[float, str, float | None] | None = None  # (since, what, its own deadline)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_failures = 0

    # ---- what the job tells it -------------------------------------------------------------
    def start(self) -> Watchdog:
        """Start the heartbeat thread and make this the process's watchdog."""
        global _current
        self._beat()
        self._seen_failures = self._failures()
        self._thread = threading.Thread(target=self._run, name=f"axon4d-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        _current = self
        return self

    def stop(self) -> None:
        """Stop watching (the job ended normally or is raising on this rank)."""
        global _current
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.beat_s + 1)
        if _current is self:
            _current = None

    def steady(self) -> None:
        """Start-up is over (after the first step): waits get ``timeout_s`` from now on."""
        self._steady = True

    @property
    def deadline_s(self) -> float:
        return self.timeout_s if self._steady else self.startup_s

    @contextlib.contextmanager
    def waiting(self, what: str, deadline_s: float | None = None) -> Iterator[None]:
        """Mark this rank as blocked in ``what`` (e.g. "all_gather over z (tag E10f)") meanwhile;
        ``deadline_s`` replaces the phase's deadline for this wait (a checkpoint's save)."""
        outer = self._wait
        self._wait = (time.monotonic(), what, deadline_s)
        try:
            yield
        finally:
            self._wait = outer

    def announce(self, error: BaseException) -> None:
        """Tell every rank that this one failed with ``error`` (first thing after it raised)."""
        self._failing = True
        line = f"{type(error).__name__}: {error}".splitlines()[0][:500] if str(error) else type(error).__name__
        with contextlib.suppress(Exception):
            self._store.set(f"{_PREFIX}failed/{self.rank}", line)
            self._store.add(f"{_PREFIX}failures", 1)

    # ---- diagnosis -------------------------------------------------------------------------
    def failed_ranks(self) -> dict[int, str]:
        """Ranks that announced a failure, with their error line."""
        out = {}
        keys = [f"{_PREFIX}failed/{r}" for r in range(self.world)]
        with contextlib.suppress(Exception):
            for r, key in enumerate(keys):
                if self._store.check([key]):
                    out[r] = self._store.get(key).decode(errors="replace")
        return out

    def stalled_ranks(self) -> list[int] | None:
        """Ranks whose heartbeat did not advance over ~2.5 beats (None: the store did not answer)."""
        try:
            first = self._beats()
            time.sleep(2.5 * self.beat_s)
            second = self._beats()
        except Exception:
            return None
        return [r for r in range(self.world) if r != self.rank and second[r] <= first[r]]

    def diagnose(self, waited: str | None = None, probe: bool = True) -> str:
        """One paragraph: what this rank waited for, who failed and why, and (``probe``: watching
        the heartbeats for a few beats) whose heartbeat stopped."""
        parts = [f"axon4d: rank {self.rank}:"]
        if waited:
            parts.append(waited + ";")
        failed = self.failed_ranks()
        for r, line in sorted(failed.items()):
            parts.append(f"rank {r} failed with {line};")
        if failed and not probe:
            parts.append("ending this rank.")
            return " ".join(parts)
        stalled = self.stalled_ranks()
        if stalled is None:
            parts.append("the job's store does not answer (its host, rank 0 or the launcher's agent, is hung or dead);")
        elif stalled:
            parts.append(f"rank(s) {', '.join(map(str, stalled))} stopped answering (hung or dead);")
        elif not failed:
            parts.append("every other rank is alive and no rank reported an error;")
        parts.append("ending this rank.")
        return " ".join(parts)

    # ---- the thread ------------------------------------------------------------------------
    def _beats(self) -> list[int]:
        return [int(self._store.add(f"{_PREFIX}beat/{r}", 0)) for r in range(self.world)]

    def _beat(self) -> None:
        with contextlib.suppress(Exception):
            self._store.add(f"{_PREFIX}beat/{self.rank}", 1)

    def _failures(self) -> int:
        try:
            return int(self._store.add(f"{_PREFIX}failures", 0))
        except Exception:
            return self._seen_failures

    def _end(self, message: str, code: int) -> None:
        print(message, file=self._out, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self._stop.set()
        self._exit(code)

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            self._beat()
            if self._failing:
                continue
            if self._failures() > self._seen_failures:
                time.sleep(0.2 * self.beat_s)  # this rank's own error, if it has one at once, comes first
                if not self._failing and not self._stop.is_set():
                    wait = self._wait
                    what = f"waiting in {wait[1]}" if wait else None
                    self._end(self.diagnose(what, probe=False), EXIT_PEER_FAILED)
                    return
            wait = self._wait
            limit = self.deadline_s if wait is None or wait[2] is None else wait[2]
            if wait is not None and time.monotonic() - wait[0] > limit:
                phase = (
                    "for this wait"
                    if wait[2] is not None
                    else "after the first step"
                    if self._steady
                    else "during start-up"
                )
                what = f"waited {time.monotonic() - wait[0]:.0f} s in {wait[1]} (deadline {limit:g} s {phase})"
                self._end(self.diagnose(what), EXIT_TIMEOUT)
                return


@contextlib.contextmanager
def waiting(what: str, deadline_s: float | None = None) -> Iterator[None]:
    """``Watchdog.waiting`` of the running watchdog; nothing without one."""
    dog = _current
    if dog is None:
        yield
        return
    with dog.waiting(what, deadline_s):
        yield


def report(error: BaseException, rank: int) -> None:
    """Announce ``error`` to the other ranks (when a watchdog runs) and print it with this rank's
    number, so the original error is never lost among the others' reports."""
    dog = _current
    if dog is not None:
        dog.announce(error)
    tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    print(f"axon4d: rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def guard(
    rank: int,
    world: int,
    timeout_s: float = 60.0,
    startup_s: float = 300.0,
    abort: Callable[[], None] | None = None,
) -> Iterator[Watchdog | None]:
    """Run the body under a watchdog (module docstring). An exception in it is announced to every
    rank and printed, then ``abort`` runs if given (the MPI transport's ``MPI_Abort``, which ends
    the whole job at once; otherwise nothing), else the exception is re-raised. Without a store
    (no process group) or with one rank nothing is watched."""
    store = default_store()
    if store is None or world == 1:
        yield None
        return
    dog = Watchdog(rank, world, store, timeout_s, startup_s).start()
    try:
        yield dog
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (0, None)):
            report(e, rank)
            dog.stop()
            time.sleep(GRACE_BEATS * dog.beat_s)  # the others print who failed before a launcher ends them
            if abort is not None:
                abort()
        raise
    finally:
        dog.stop()
