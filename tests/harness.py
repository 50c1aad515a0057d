"""Runs a function on every rank of a real gloo world, many times, without respawning.

``RankPool(world)`` spawns ``world`` processes once and joins them into one gloo world. Each
``pool.run(grid, fn, *args)`` builds ``axon4d.init(grid)`` on every rank, calls
``fn(grid, *args)``, shuts the grid down (destroying its process groups) and returns the
per-rank results. If any rank fails, the others get a short grace period, the pool is torn down
and the failing rank's traceback is raised here — a failing test never hangs the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from axon4d.launch import free_port

_CTX = mp.get_context("spawn")
_STOP = "stop"


def _worker(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import axon4d

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )
    outbox.put((rank, "ready", None))
    while True:
        task = inbox.get()
        if task == _STOP:
            break
        grid, fn, args, init_kwargs = task
        try:
            if grid is None:
                result = fn(*args)
            else:
                g = axon4d.init(grid=grid, **init_kwargs)
                try:
                    result = fn(g, *args)
                finally:
                    axon4d.shutdown()
            outbox.put((rank, "ok", result))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))
    dist.barrier()
    dist.destroy_process_group()


class RankFailure(AssertionError):
    """A function raised on at least one rank; the message holds the first traceback."""


class RankPool:
    """``world`` gloo ranks kept alive across tests."""

    def __init__(self, world: int, start_timeout: float = 120.0):
        self.world = world
        self.outbox = _CTX.Queue()
        self.inboxes = [_CTX.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            _CTX.Process(target=_worker, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect(start_timeout, expect="ready")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _collect(self, timeout: float, expect: str = "ok") -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            remaining = deadline - time.monotonic()
            if errors:  # give the other ranks a moment to report, then stop waiting
                remaining = min(remaining, 5.0)
            try:
                rank, status, payload = self.outbox.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            if status == expect:
                results[rank] = payload
            else:
                errors[rank] = payload
        if errors or len(results) < self.world:
            missing = sorted(set(range(self.world)) - set(results) - set(errors))
            self.close(force=True)
            if errors:
                first = min(errors)
                raise RankFailure(
                    f"rank {first} of {self.world} failed:\n{errors[first]}"
                    + (f"\n(ranks {missing} did not report)" if missing else "")
                )
            raise RankFailure(f"ranks {missing} of {self.world} did not finish within {timeout:.0f} s")
        return [results[r] for r in range(self.world)]

    def run(
        self, grid: Any, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **init_kwargs: Any
    ) -> list[Any]:
        """``fn(axon4d.init(grid), *args)`` on every rank; returns the results in rank order.

        With ``grid=None`` no grid is built and ``fn(*args)`` runs on the bare world.
        """
        for inbox in self.inboxes:
            inbox.put((grid, fn, args, init_kwargs))
        return self._collect(timeout)

    def close(self, force: bool = False) -> None:
        if not force:
            for inbox in self.inboxes:
                inbox.put(_STOP)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Pools:
    """One lazily started ``RankPool`` per world size; a pool that failed is replaced."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world: int, attempts: int = 3) -> RankPool:
        pool = self._pools.get(world)
        if pool is None or not pool.alive:
            for attempt in range(attempts):  # the free port can be taken before rank 0 binds it
                try:
                    pool = self._pools[world] = RankPool(world)
                    break
                except RankFailure:
                    if attempt == attempts - 1:
                        raise
        assert pool is not None
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            if pool.alive:
                pool.close()
        self._pools.clear()


def value_errors(cases: dict[str, Callable[[], Any]]) -> dict[str, str | None]:
    """Run each case; its ValueError message, or None if it raised nothing."""
    msgs: dict[str, str | None] = {}
    for name, fn in cases.items():
        try:
            fn()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def grids_of(world: int) -> list[tuple[int, int, int, int]]:
    """Every (x, y, z, data) factorisation of ``world``."""
    from axon4d.shape import factorizations

    return [s.as_tuple() for s in factorizations(world)]


if __name__ == "__main__":  # pragma: no cover - manual smoke run
    pool = RankPool(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print(pool.run(None, os.getpid))
    pool.close()
