"""Runs a function on every rank of a real gloo world, many times, without respawning.

``RankPool(world)`` keeps a local world of ``world`` gloo ranks (``axon4d.measure.spawn.LocalWorld``,
the spawner of calibration and benches too). Each ``pool.run(grid, fn, *args)`` builds
``axon4d.init(grid)`` on every rank, calls ``fn(grid, *args)``, shuts the grid down (destroying its
process groups) and returns the per-rank results. If any rank fails, the others get a short grace
period, the pool is torn down and the failing rank's traceback (or its exit code) is raised here as
``RankFailure`` — a failing test never hangs the suite. After each run every rank collects that
run's garbage and freezes what survived (``gc.freeze``: imports, caches), so the collection each
grid's teardown makes (``Grid.destroy``) looks only at the objects of one test, not at torch's.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

from axon4d.measure.spawn import LocalWorld, RankFailure

__all__ = ["Pools", "RankFailure", "RankPool", "grids_of", "value_errors"]


class RankPool:
    """``world`` gloo ranks kept alive across tests."""

    def __init__(self, world: int, start_timeout: float = 120.0):
        self.world = world
        self.ranks = LocalWorld(world, backend="gloo", timeout=90.0, start_timeout=start_timeout, daemon=True)

    @property
    def alive(self) -> bool:
        return self.ranks.alive

    def run(
        self, grid: Any, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **init_kwargs: Any
    ) -> list[Any]:
        """``fn(axon4d.init(grid), *args)`` on every rank; returns the results in rank order.

        With ``grid=None`` no grid is built and ``fn(*args)`` runs on the bare world.
        """
        results = self.ranks.run(grid, fn, args, init_kwargs, timeout=timeout)
        self.ranks.run(None, _settle, timeout=timeout)
        return results

    def close(self, force: bool = False) -> None:
        self.ranks.close(force)


def _settle() -> None:
    """On a rank after a run: collect its garbage, then leave what survived out of later collections."""
    gc.collect()
    gc.freeze()


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
        """End every pool's ranks at once (killed: at the end of a session they hold nothing to
        keep, and an orderly stop costs each rank a barrier and torch's teardown, pool after pool)."""
        for pool in self._pools.values():
            pool.close(force=True)
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
    from axon4d.grid.shape import factorizations

    return [s.as_tuple() for s in factorizations(world)]


if __name__ == "__main__":  # pragma: no cover - manual smoke run
    pool = RankPool(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print(pool.run(None, os.getpid))
    pool.close()
