"""Overlap controls for users (docs/design.md §4): set or temporarily change a grid's policy.

    axon4d.overlap.configure("all,oag_depth=3")       # the current grid's policy from now on
    with axon4d.overlap.using("off"):                  # a region under another policy
        loss = model(batch); loss.backward()
    with axon4d.overlap.accumulating():                # a micro-batch whose data-axis reductions wait
        loss = model(batch); loss.backward()           # for the last one's backward

The policy itself is data (``axon4d.options.overlap_policy.OverlapPolicy``: mechanisms and knobs, parsed from the
same strings); the scheduler that acts on it is ``axon4d.scheduler``. These functions take the
grid explicitly or fall back to the one ``axon4d.init()`` built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from axon4d.grid.mesh import Grid
from axon4d.grid.runtime import resolve
from axon4d.options.overlap_policy import MECHANISMS, OverlapPolicy
from axon4d.scheduler import Scheduler

__all__ = ["MECHANISMS", "OverlapPolicy", "accumulating", "configure", "scheduler", "using"]


def scheduler(grid: Grid | None = None) -> Scheduler:
    """The scheduler of ``grid`` (default: the current grid)."""
    return resolve(grid).scheduler


def configure(spec: Any, grid: Grid | None = None) -> OverlapPolicy:
    """Set the overlap policy of ``grid`` (default: the current grid); see ``OverlapPolicy.parse``."""
    return scheduler(grid).configure(spec)


@contextlib.contextmanager
def using(spec: Any, grid: Grid | None = None) -> Iterator[OverlapPolicy]:
    """``with axon4d.overlap.using("off"): ...`` runs a region under another overlap policy."""
    with scheduler(grid).using(spec) as policy:
        yield policy


@contextlib.contextmanager
def accumulating(grid: Grid | None = None) -> Iterator[None]:
    """``with axon4d.overlap.accumulating(): loss.backward()`` for every micro-batch but the last:
    the data-axis gradient reductions are held and the next backward outside reduces the step's
    sums once (``Scheduler.accumulating``, docs/design.md §4)."""
    with scheduler(grid).accumulating():
        yield
