"""Local worlds: spawn ranks on this host and run functions on all of them (docs/design.md §7:
one host, ranks that share its cores — and its one accelerator, if it has one — one thread each).

The one spawner of local worlds: the tests' pool of ranks (tests/harness.py), the calibration
(axon4d.measure.calibrate), bench/gpu_check.py and the benches start their ranks here.

``LocalWorld(world)`` starts ``world`` processes — forked from a fork server that imported torch
once (``_context``), each with the environment, stdout and stderr of the process that starts it —
that join one process group over loopback (gloo
unless ``backend`` is given; NCCL with ``device_per_rank``: rank r on accelerator r) and then serve
tasks until ``close()``: ``run(grid, fn, args)`` builds ``axon4d.init(grid)`` on every rank, calls
``fn(grid, *args)`` (``fn(*args)`` with ``grid=None``), shuts the grid down and returns the results
in rank order. A rank ends when the process that spawned it is gone (a rank left behind, blocked in
a collective, would hold its memory forever). A failure is raised as ``RankFailure`` — a rank's
function raised (its traceback; the others get a few seconds to report), a rank ended (its exit
code: killed for memory, say) or results did not come in time — after the world is torn down,
instead of waiting for a result that will not come.

``run_local(world, fn, *args)`` runs one function on a fresh world and returns rank 0's result: on
the pure data-parallel grid (1, 1, 1, world) built with ``axon4d.grid.runtime.init``, or another
``grid`` (or ``grid=None``: ``fn(None, *args)`` on the bare world), with ``init_kwargs`` for
``init``, another ``backend``, ``device_per_rank``, ``every_rank`` (every rank's result, in rank
order) and a ``timeout``. With gloo on a host with an accelerator, every rank computes on that one
device and gloo stages the collectives through host memory: the distributed code runs on device
tensors with one GPU (bench/gpu_check.py). ``fn`` must be a module-level function (it is pickled
by reference into the spawned processes) returning plain data.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue as queues
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist

from axon4d import device as devices
from axon4d.grid import runtime
from axon4d.grid.launch import free_port

#: seconds the other ranks get to report once one has failed
GRACE_S = 5.0
_READY, _OK, _ERROR, _STOP = "ready", "ok", "error", "stop"


class RankFailure(RuntimeError):
    """A rank of a local world failed: its function raised (the message holds the first
    traceback), it ended, or the results did not come in time."""


def _context() -> Any:
    """How local worlds start their ranks: forked from a fork server that imported torch and this
    module once (a rank then starts without importing torch again), where the platform has one;
    else spawned. The server never touches an accelerator (importing torch initialises no CUDA), so
    every rank still initialises its own, as a spawned one would."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class _Streams:
    """The starting process's stdout and stderr as a rank receives them: pickled at the rank's start
    as duplicates of file descriptors 1 and 2 (``multiprocessing.reduction.DupFd``, passed to the
    child as its start method passes descriptors), made the rank's own by ``adopt``. A spawned rank
    inherits them anyway; a forked one would otherwise write where its fork server's pointed when
    the server started (another command's, or a test's captured output)."""

    fds: tuple[int, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        sent: list[Any] = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed here: the rank keeps what it has
                sent.append(None)
                continue
            sent.append(reduction.DupFd(fd))
        return (_Streams._received, tuple(sent))

    @staticmethod
    def _received(*sent: Any) -> _Streams:
        streams = _Streams()
        streams.fds = tuple(-1 if s is None else s.detach() for s in sent)
        return streams

    def adopt(self) -> None:
        """Make the received descriptors this process's stdout and stderr."""
        for fd, target in zip(self.fds, (1, 2)):
            if fd >= 0 and fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _exit_with_parent(parent: int) -> None:
    """End this process as soon as ``parent`` — the process that started the world, whose child it
    is when spawned and whose fork server's child it is when forked — ends or is killed: when its
    own parent changes (the fork server ends with the process that started it) or ``parent`` is gone."""
    own = os.getppid()

    def gone() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of another user took the number: ours is gone
            return True
        return False

    def watch() -> None:
        while os.getppid() == own and not gone():
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="axon4d-parent-watch").start()


def _serve(rank: int, world: int, port: int, how: dict[str, Any], inbox: Any, outbox: Any, parent: int) -> None:
    """One rank: join the world, then run the tasks from ``inbox`` until told to stop."""
    _exit_with_parent(parent)
    # the environment of the process that started the world, as a spawned rank would have it (a
    # forked one has its fork server's, from when that started)
    os.environ.clear()
    os.environ.update(how["environ"])
    how["streams"].adopt()  # ... and its stdout and stderr
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if how["device_per_rank"]:
        os.environ["LOCAL_RANK"] = str(rank)  # runtime.init's default device: accelerator ``rank``
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            how["backend"],
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=how["timeout"]),
        )
    except BaseException:
        outbox.put((rank, _ERROR, traceback.format_exc()))
        raise
    outbox.put((rank, _READY, None))
    while (task := inbox.get()) != _STOP:
        grid, fn, args, init_kwargs, every_rank = task
        try:
            result = _call(grid, fn, args, init_kwargs)
            outbox.put((rank, _OK, result if every_rank or rank == 0 else None))
        except BaseException:
            outbox.put((rank, _ERROR, traceback.format_exc()))
    dist.barrier()
    dist.destroy_process_group()


def _call(grid: Any, fn: Callable[..., Any], args: tuple[Any, ...], init_kwargs: dict[str, Any]) -> Any:
    """``fn(axon4d.init(grid), *args)``, the grid shut down afterwards; ``fn(*args)`` without a grid."""
    if grid is None:
        return fn(*args)
    g = runtime.init(grid=grid, **init_kwargs)
    try:
        return fn(g, *args)
    finally:
        runtime.shutdown()


class LocalWorld:
    """``world`` ranks on this host, joined in one process group, serving tasks until closed.

    ``timeout``: the process group's (a collective waits that long); ``start_timeout``: for every
    rank to join; ``daemon``: ranks the spawning process ends when it exits (they can then start no
    processes of their own)."""

    def __init__(
        self,
        world: int,
        *,
        backend: str | None = None,
        device_per_rank: bool = False,
        timeout: float = 90.0,
        start_timeout: float = 120.0,
        daemon: bool = False,
    ):
        ctx = _context()
        self.world = world
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        how = {
            "environ": dict(os.environ),
            "streams": _Streams(),
            "backend": backend or devices.default_backend(devices.HOST),
            "device_per_rank": device_per_rank,
            "timeout": timeout,
        }
        port, parent = free_port(), os.getpid()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, port, how, self.inboxes[r], self.outbox, parent), daemon=daemon)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect(_READY, start_timeout)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(
        self,
        grid: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        init_kwargs: dict[str, Any] | None = None,
        *,
        timeout: float = 120.0,
        every_rank: bool = True,
    ) -> list[Any]:
        """``fn(axon4d.init(grid, **init_kwargs), *args)`` on every rank (``fn(*args)`` with
        ``grid=None``); the results in rank order (without ``every_rank``, None but rank 0's).
        Raises ``RankFailure`` when a rank fails or the results are not in after ``timeout`` seconds."""
        for inbox in self.inboxes:
            inbox.put((grid, fn, args, init_kwargs or {}, every_rank))
        return self._collect(_OK, timeout)

    def _collect(self, expect: str, timeout: float) -> list[Any]:
        """Every rank's ``expect`` report, in rank order; else the world is torn down and the first
        failure raised."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                report = self.outbox.get(timeout=min(remaining, 1.0))
            except queues.Empty:
                if any(self.procs[r].exitcode is not None for r in self._missing(results, errors)):
                    # a rank ended: what it sent before it did (its traceback) is in the pipe by now
                    with contextlib.suppress(queues.Empty):
                        while not self.outbox.empty():
                            self._take(self.outbox.get(timeout=1.0), expect, results, errors)
                    break
                continue
            if self._take(report, expect, results, errors):
                deadline = min(deadline, time.monotonic() + GRACE_S)  # the others may be stuck waiting for it
        if len(results) == self.world:
            return [results[r] for r in range(self.world)]
        why = self._failure(results, errors, timeout)  # before the ranks are killed: their exit codes
        self.close(force=True)
        raise RankFailure(why)

    @staticmethod
    def _take(report: tuple[int, str, Any], expect: str, results: dict[int, Any], errors: dict[int, str]) -> bool:
        """File one rank's report as a result or an error; True for an error."""
        rank, status, payload = report
        if status == expect:
            results[rank] = payload
            return False
        errors[rank] = payload
        return True

    def _missing(self, results: dict[int, Any], errors: dict[int, str]) -> list[int]:
        return sorted(set(range(self.world)) - set(results) - set(errors))

    def _failure(self, results: dict[int, Any], errors: dict[int, str], timeout: float) -> str:
        """What went wrong: the first rank that ended (the others' collectives then fail too), the
        first rank's traceback, and the ranks that did not report, or the lateness."""
        where = f"of the local {self.world}-rank world"
        missing = self._missing(results, errors)
        ended = [(r, self.procs[r].exitcode) for r in missing if self.procs[r].exitcode is not None]
        parts = []
        if ended:
            rank, code = ended[0]
            why = " (killed: out of memory?)" if code == -9 else ""
            parts.append(f"rank {rank} {where} ended with exit code {code}{why}")
        if errors:
            first = min(errors)
            parts.append(f"rank {first} {where} failed:\n{errors[first]}")
            if len(missing) > len(ended):
                parts.append(f"(ranks {missing} did not report)")
        return "\n".join(parts) or f"ranks {missing} {where} sent no result within {timeout:.0f} s"

    def close(self, force: bool = False) -> None:
        """Stop every rank (``force``: kill them, as after a failure, when some may be stuck)."""
        if not force and self.alive:
            for inbox in self.inboxes:
                inbox.put(_STOP)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_local(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    grid: tuple[int, ...] | None | str = "data",
    init_kwargs: dict[str, Any] | None = None,
    backend: str | None = None,
    device_per_rank: bool = False,
    every_rank: bool = False,
    timeout: float = 600.0,
) -> Any:
    """Spawn ``world`` ranks on this host, run ``fn(grid, *args)`` on each, return rank 0's result
    (every rank's, in rank order, with ``every_rank``). ``grid``: "data" for (1, 1, 1, world), a
    shape, or None for no grid; ``backend``: gloo unless given. Raises ``RankFailure`` (a
    ``RuntimeError``) when a rank ends with an error or the results are not in after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    local = LocalWorld(world, backend=backend, device_per_rank=device_per_rank, timeout=timeout, start_timeout=timeout)
    shape = (1, 1, 1, world) if grid == "data" else grid
    try:
        results = local.run(
            shape,
            fn,
            args if shape is not None else (None, *args),
            init_kwargs,
            timeout=max(deadline - time.monotonic(), 1.0),
            every_rank=every_rank,
        )
    except BaseException:
        local.close(force=True)
        raise
    local.close()
    return results if every_rank else results[0]
