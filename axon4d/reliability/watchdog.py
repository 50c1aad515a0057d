"""Bounded failure (docs/reliability.md): a job whose rank raises, hangs or dies ends within a
deadline, and every rank that is still running says which rank failed and, where it knows, which
collective it was waiting in, on which axis.

One ``Watchdog`` per process, started by the training job (``axon4d.train``; ``guard`` for a loop
of one's own). It keeps a daemon thread and a client of the job's key-value store (the
rendezvous store of torch.distributed: torchrun's agent, or rank 0 for mpirun and plain
launches; after a torchrun restart, that attempt's keys: ``axon4d.grid.launch.attempt_store``), and
works with three facts:

- **heartbeats**: the thread adds 1 to ``axon4d/beat/<rank>`` every ``beat_s`` seconds. A rank
  whose count stops is hung (stopped, swapping, deadlocked) or dead. A rank that ends on its own
  (its deadline, another's failure) first sets ``axon4d/ending/<rank>``: not hung, ending.
- **failures**: a rank that raises announces it before anything else (``announce``):
  ``axon4d/failed/<rank>`` holds its one-line error and ``axon4d/failures`` counts them. Every
  other rank's thread sees the count within ``beat_s``, prints who failed and why, and ends its
  own process — whatever collective it was blocked in (exit code ``EXIT_PEER_FAILED``).
- **waits**: the communicator (``axon4d.comm.communicator.Handle.wait``) and the places where the host blocks
  under NCCL (the training loop's loss and gradient-norm reads, device synchronisations, a
  checkpoint's save) mark what this rank is waiting for (``waiting``). A wait longer than the
  deadline — ``startup_s`` until ``steady()`` is called after the first step, ``timeout_s`` after —
  ends the process (``EXIT_TIMEOUT``) after naming the wait and the ranks whose heartbeat stopped.
  From ``steady()`` on, the process groups' own timeout follows (``pg_timeout_s``).
- **steps**: on an accelerator the host queues a whole step and then blocks at its host reads
  (``step_waiting``: the loss and gradient norm, the device synchronize) for as long as the device
  takes — a step, not a collective. Their deadline follows the measured step time: the job reports
  each step's seconds (``step_took``) and ``step_deadline_s`` is ``STEP_DEADLINE_FACTOR`` × the
  median of the last ``STEP_WINDOW`` steps, never less than the phase's deadline; torch.distributed's
  own timeout (NCCL's, counted from each collective's enqueue) is raised with it, so a step of
  many times ``--timeout`` finishes. A rank that stopped mid-step is named as before: the heartbeats
  come from this thread, not from the step, so the diagnosis at the deadline finds it.

The keys, and how one rank finds who stopped for all (store requests O(world) in all, not
O(world²)), are ``axon4d.reliability.diagnosis``'s. Store operations use their own client with a short
timeout, so a hung store host makes the diagnosis say so instead of hanging it. Nothing here calls a collective: after an exception no
rank enters one (``axon4d.grid.runtime.shutdown`` skips its barrier while an exception propagates).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from axon4d.grid import launch
from axon4d.reliability import diagnosis, errors

#: exit code of a rank ended because another rank failed
EXIT_PEER_FAILED = 3
#: exit code of a rank ended because a wait passed its deadline
EXIT_TIMEOUT = 4
#: heartbeats a failing rank waits after announcing its error, before it ends or aborts the job
GRACE_BEATS = 3
#: torch.distributed's timeout after the first step is the watchdog's deadline plus this (or 5 beats
#: if longer): the watchdog names the stopped rank first (a beat's check, 2.5 beats of watching), and
#: NCCL's clock starts when a collective is queued, maybe a while before the host blocks on it
PG_MARGIN_S = 10.0
#: a step's host reads may wait this many times the median of the recent steps' seconds (when that is
#: longer than the phase's deadline): a step three times slower than usual is still a step, not a hang
STEP_DEADLINE_FACTOR = 3.0
#: the recent steps whose median sets that deadline
STEP_WINDOW = 16
_current: Watchdog | None = None


def current() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _current


def _client(store: Any, timeout_s: float) -> Any:
    """A store client of its own with a short timeout (TCPStore), else ``store`` itself, seen
    through this launch attempt's keys (``axon4d.grid.launch.attempt_store``)."""
    inner = store
    while hasattr(inner, "underlying_store"):  # PrefixStore layers of the default group
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        inner = dist.TCPStore(
            inner.host,
            inner.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    return launch.attempt_store(inner)


def _timeout_of(group: Any) -> datetime.timedelta | None:
    """A process group's timeout now, read from its backend's options (None where it cannot be)."""
    for device in getattr(group, "_device_types", ()):
        with contextlib.suppress(Exception):
            return group._get_backend(device).options._timeout
    return None


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
        sleep: Callable[[float], None] | None = None,
    ):
        for name, value in (("timeout_s", timeout_s), ("startup_s", startup_s), ("beat_s", beat_s)):
            if not value > 0:
                raise ValueError(f"{name} = {value!r}: a deadline must be a positive number of seconds")
        self.rank, self.world = rank, world
        self.timeout_s, self.startup_s, self.beat_s = timeout_s, startup_s, beat_s
        self._store = _client(store, store_timeout_s)
        self._exit = exit
        # how the diagnosis waits between heartbeat reads (default: this module's clock, read at the call)
        self._sleep = sleep if sleep is not None else (lambda seconds: time.sleep(seconds))
        #: how long the claimant of a diagnosis may leave its heartbeat standing before one waiting rank
        #: takes the claim over and watches (``diagnosis.shared_stalled``)
        self.publish_wait_s = 5 * beat_s + store_timeout_s
        self._out = out if out is not None else sys.stderr
        self._steady = False
        self._failing = False
        #: (since, what, its own deadline, why that deadline: None for the phase's or "for this wait")
        self._wait: tuple[float, str, float | None, str | None] | None = None
        self._steps: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)  # recent steps' seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_failures = 0
        #: id -> (process group whose timeout follows the deadline after steady(), its timeout before)
        self._groups: dict[int, tuple[Any, datetime.timedelta | None]] = {}
        self._groups_timeout_s: float | None = None  # their timeout now, once steady() set it
        self._stalled: list[int] = []  # the ranks the last diagnosis found stopped

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
        for group, timeout in self._groups.values() if self._groups_timeout_s is not None else ():
            if timeout is not None:  # back as they were: the groups may outlive the job
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._set_pg_timeout(timeout, group)
        self._groups_timeout_s = None

    def steady(self, groups: Iterable[Any] = ()) -> None:
        """Start-up is over (after the first step): waits get ``timeout_s`` from now on, and so do
        torch.distributed's collectives: the timeout of the default process group and of ``groups``
        (the grid's: ``grid.groups.values()``) becomes ``pg_timeout_s``. Where this torch cannot
        set it, rank 0 says so once and the start-up timeout stays."""
        self._steady = True
        for group in [dist.group.WORLD if dist.is_initialized() else None, *groups]:
            if group is not None and id(group) not in self._groups:
                self._groups[id(group)] = (group, _timeout_of(group))
        if self._groups and self._set_group_timeouts(self.pg_timeout_s(self.step_deadline_s)):
            self._groups_timeout_s = self.pg_timeout_s(self.step_deadline_s)

    def step_took(self, seconds: float) -> None:
        """The job's last step took ``seconds`` (its host time, start to end): the deadline of the
        next steps' host reads follows (``step_deadline_s``), and after ``steady`` so does the
        process groups' timeout: raised as soon as the deadline needs it, lowered only once the
        deadline needs less than half of it (not a call per step), never within a wait that lifted
        it."""
        self._steps.append(seconds)
        now, target = self._groups_timeout_s, self.pg_timeout_s(self.step_deadline_s)
        if now is not None and self._wait is None and (target > now or target < now / 2):
            if self._set_group_timeouts(target):
                self._groups_timeout_s = target

    @property
    def step_deadline_s(self) -> float:
        """The deadline of a step's host reads: ``STEP_DEADLINE_FACTOR`` × the median of the last
        ``STEP_WINDOW`` steps' seconds (``step_took``), never less than the phase's (``deadline_s``)."""
        if not self._steps:
            return self.deadline_s
        return max(self.deadline_s, STEP_DEADLINE_FACTOR * statistics.median(self._steps))

    def pg_timeout_s(self, deadline_s: float) -> float:
        """The process groups' timeout (NCCL's watchdog, gloo's) that goes with a deadline of
        ``deadline_s``: after ``steady``, ``timeout_s``'s, or a longer one of the wait in progress."""
        return deadline_s + max(PG_MARGIN_S, 5 * self.beat_s)

    def _set_group_timeouts(self, seconds: float) -> bool:
        """Set the timeout of every group ``steady`` was given to ``seconds`` (not a collective:
        each rank sets its own); False, after saying why on rank 0, where torch cannot."""
        setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        why = f"torch {torch.__version__} has no torch.distributed.distributed_c10d._set_pg_timeout"
        if setter is not None:
            try:
                for group, _ in self._groups.values():
                    setter(datetime.timedelta(seconds=seconds), group)
                return True
            except (AttributeError, AssertionError, RuntimeError, TypeError, ValueError) as e:
                why = f"setting a process group's timeout failed ({type(e).__name__}: {e})"
        stays = "torch.distributed's own timeout stays at its start-up value (--startup-timeout)"
        if self.rank == 0:
            print(f"axon4d: {why}; {stays}, the watchdog's is {self.timeout_s:g} s", file=self._out, flush=True)
        self._groups = {}  # say it once
        return False

    @property
    def deadline_s(self) -> float:
        return self.timeout_s if self._steady else self.startup_s

    @contextlib.contextmanager
    def waiting(self, what: str, deadline_s: float | None = None, why: str | None = None) -> Iterator[None]:
        """Mark this rank as blocked in ``what`` (e.g. "all_gather over z (tag E10f)") meanwhile.
        ``deadline_s`` replaces the phase's deadline for this wait and the waits inside it (a
        checkpoint's save and its collectives), and lifts torch.distributed's timeout to match
        while it lasts (after ``steady``); ``why`` says where it comes from (the message at the
        deadline; "for this wait" when not given)."""
        outer = self._wait
        if deadline_s is None and outer is not None:
            deadline_s, why = outer[2], outer[3]
        restore = self._groups_timeout_s  # lifted for a longer deadline of its own, then restored
        if deadline_s is None or restore is None or self.pg_timeout_s(deadline_s) <= restore:
            restore = None
        elif self._set_group_timeouts(self.pg_timeout_s(deadline_s)):
            self._groups_timeout_s = self.pg_timeout_s(deadline_s)
        self._wait = (time.monotonic(), what, deadline_s, why)
        try:
            yield
        finally:
            self._wait = outer
            if restore is not None and self._set_group_timeouts(restore):
                self._groups_timeout_s = restore

    def announce(self, error: BaseException) -> None:
        """Tell every rank that this one failed with ``error`` (first thing after it raised)."""
        self._failing = True
        line = f"{type(error).__name__}: {error}".splitlines()[0][:500] if str(error) else type(error).__name__
        with contextlib.suppress(Exception):
            diagnosis.announce(self._store, self.rank, line)

    # ---- diagnosis -------------------------------------------------------------------------
    def failed_ranks(self) -> dict[int, str]:
        """Ranks that announced a failure, with their error line (the first ``SHOWN_FAILURES``)."""
        with contextlib.suppress(Exception):
            return diagnosis.failed_ranks(self._store)[0]
        return {}

    def stalled_ranks(self, shared: bool = False) -> list[int] | None:
        """Ranks whose heartbeat did not advance over ~2.5 beats, less those that said they are
        ending or failed (None: the store did not answer). This rank beats on while it watches:
        every rank blocked with a hung one reaches its deadline at about the same time — were their
        beats silent meanwhile, each would name the others. ``shared``: found once for the whole
        job, by the first rank to ask (``axon4d.reliability.diagnosis.shared_stalled``)."""
        try:
            if shared:
                args = (self._store, self.rank, self.world, self.beat_s, self.publish_wait_s, self._sleep)
                self._stalled = diagnosis.shared_stalled(*args)
            else:
                self._stalled = diagnosis.watch(self._store, self.rank, self.world, self.beat_s, self._sleep)
        except Exception:
            return None
        return self._stalled

    def diagnose(self, waited: str | None = None, probe: bool = True) -> str:
        """One paragraph: what this rank waited for, who failed and why, and (``probe``: watching
        the heartbeats for a few beats, once for the whole job) whose heartbeat stopped."""
        parts = [f"axon4d: rank {self.rank}:"]
        if waited:
            parts.append(waited + ";")
        try:
            failed, count = diagnosis.failed_ranks(self._store)
        except Exception:
            failed, count = {}, 0
        for r, line in sorted(failed.items()):
            parts.append(f"rank {r} failed with {line};")
        if count > len(failed):
            parts.append(f"{count - len(failed)} more rank(s) failed;")
        if count and not probe:
            parts.append("ending this rank.")
            return " ".join(parts)
        stalled = self.stalled_ranks(shared=True)
        if stalled is None:
            parts.append("the job's store does not answer (its host, rank 0 or the launcher's agent, is hung or dead);")
        elif stalled:
            parts.append(f"rank(s) {', '.join(map(str, stalled))} stopped answering (hung or dead);")
        elif not count:
            parts.append("every other rank is alive and no rank reported an error;")
        parts.append("ending this rank.")
        return " ".join(parts)

    # ---- the thread ------------------------------------------------------------------------
    def _beat(self) -> None:
        with contextlib.suppress(Exception):
            diagnosis.beat(self._store, self.rank)

    def _failures(self) -> int:
        try:
            return diagnosis.failures(self._store)
        except Exception:
            return self._seen_failures

    def _end(self, message: str, code: int) -> None:
        """Say ``message``, tell the others this rank is ending (not hung), and end with ``code``."""
        with contextlib.suppress(Exception):
            diagnosis.say_ending(self._store, self.rank, code)
        print(message, file=self._out, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        if self.rank == 0:
            self._linger()
        self._stop.set()
        self._exit(code)

    def _linger(self) -> None:
        """Rank 0 hosts the job's store under plain and MPI launches: keep it up until as many ranks
        as were not found stopped said they are ending or failed (one more deadline at most), so
        that those that reach their deadline after this one can still watch the heartbeats."""
        until = time.monotonic() + self.deadline_s
        while time.monotonic() < until:
            try:
                if diagnosis.gone(self._store) >= self.world - len(self._stalled):
                    return
            except Exception:
                return
            self._beat()
            self._sleep(self.beat_s)

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            self._beat()
            if self._failing:
                continue
            if self._failures() > self._seen_failures:
                self._sleep(0.2 * self.beat_s)  # this rank's own error, if it has one at once, comes first
                if not self._failing and not self._stop.is_set():
                    wait = self._wait
                    what = f"waiting in {wait[1]}" if wait else None
                    self._end(self.diagnose(what, probe=False), EXIT_PEER_FAILED)
                    return
            wait = self._wait
            limit = self.deadline_s if wait is None or wait[2] is None else wait[2]
            if wait is not None and time.monotonic() - wait[0] > limit:
                phase = (
                    (wait[3] or "for this wait")
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


@contextlib.contextmanager
def step_waiting(what: str) -> Iterator[None]:
    """``waiting`` for one of a step's host reads: under the running watchdog's ``step_deadline_s``
    where the measured steps make it longer than the phase's deadline; nothing without a watchdog."""
    dog = _current
    if dog is None:
        yield
        return
    deadline = dog.step_deadline_s
    if deadline <= dog.deadline_s:
        with dog.waiting(what):
            yield
        return
    median = statistics.median(dog._steps)
    why = f"for a step's host read: {STEP_DEADLINE_FACTOR:g} × the median step of {median:.3g} s"
    with dog.waiting(what, deadline, why):
        yield


def report(error: BaseException, rank: int) -> None:
    """Announce ``error`` to the other ranks (when a watchdog runs) and print it with this rank's
    number, so the original error is never lost among the others' reports."""
    dog = _current
    if dog is not None:
        dog.announce(error)
    # a refusal (bad input) as its one message, anything else with its traceback (axon4d.reliability.errors)
    print(errors.format_error(error, "axon4d", rank), file=sys.stderr, flush=True)
    errors.mark_reported(error)


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
