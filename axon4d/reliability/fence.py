"""One trial's failure, seen by every rank within seconds (``axon4d.trials``; docs/planner.md#trying-the-top-plans).

A plan tried by ``--try`` may fail on one rank in the middle of a step (out of memory in one
block's forward): the other ranks are then blocked in a collective that rank will never join. A
``TrialWorld`` keeps that from ending the job:

- **its own world.** While a trial runs, torch.distributed's default group is replaced by a group of
  every rank made for the trial (``enter``), so the trial's grid — its axis groups, and those
  spanning every rank, which torch's DeviceMesh takes from the default group — never uses the job's
  own default group. ``leave`` puts the job's back and destroys the trial's: a failed trial leaves
  the job's world as it was, its collectives in step on every rank. Under NCCL that costs a try one
  communicator more than the run (the job's world's, beside the trial's).
- **the failure on the store.** A rank whose trial failed says so first (``fail``: the job's
  key-value store, the one the watchdog uses; the first to say so is the failure's origin), then
  tears its grid and the trial's world down: on the host backend (gloo) freeing a group closes its
  connections, so a rank blocked in a collective with it gets an error at once, tears its own down,
  and so on to every rank. Under NCCL, whose communicators stay up when freed, each rank's
  ``watch`` thread reads the store every ``POLL_S`` and aborts the trial's groups when another rank
  failed, which ends the collectives it is blocked in.
- **an arrival on the store.** Every rank then counts itself out of the trial (``arrive``) and waits
  for all to be out before any collective of the job's own world: none waits in a collective
  another rank left. O(world) store requests per trial.

``plant`` is a test's hook (``$AXON4D_TRIAL_OOM``): an out-of-memory on one rank mid-step in one plan.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

#: how often the watch thread reads the store for another rank's failure (NCCL only)
POLL_S = 0.5
#: the keys of the trials, under the job's store
PREFIX = "axon4d/trial"
_ids = itertools.count()


def next_id() -> int:
    """A number for the next run of trials: the same on every rank, which all run them in turn."""
    return next(_ids)


class TrialWorld:
    """The trial's world and its failure and arrival keys (module docstring); ``key`` names the
    trial (the same on every rank, unique in the job), ``store`` is the job's."""

    def __init__(self, store: Any, key: str, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.key = f"{PREFIX}/{key}"
        self._job: Any = None  # the job's default group while the trial's stands in
        self._group: Any = None
        self._watch: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- the trial's world -------------------------------------------------------------------
    def enter(self) -> None:
        """Make a group of every rank (a collective of the job's world) and let it stand in for the
        default group until ``leave``."""
        self._job = dist.group.WORLD
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._group = dist.new_group(list(range(self.world)), timeout=timeout, use_local_synchronization=False)
        c10d._world.default_pg = self._group

    def leave(self) -> None:
        """Put the job's default group back and destroy the trial's (its connections closed once
        collected: a rank blocked in it with this one gets an error now)."""
        self.stop_watching()
        if self._job is not None:
            c10d._world.default_pg = self._job
            self._job = None
        if self._group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
            self._group = None
        gc.collect()

    # ---- what the ranks say on the store -----------------------------------------------------
    def fail(self) -> bool:
        """Say this rank's trial failed; whether it is the first to (the failure's origin)."""
        first = self.store.compare_set(f"{self.key}/failed", "", str(self.rank))
        return bytes(first).decode() == str(self.rank)

    def failed(self) -> bool:
        """Whether a rank said its trial failed."""
        return bool(self.store.check([f"{self.key}/failed"]))

    def origin(self) -> int | None:
        """The rank that said first that its trial failed (None: none did)."""
        if not self.failed():
            return None
        return int(bytes(self.store.get(f"{self.key}/failed")).decode())

    def arrive(self) -> bool:
        """Count this rank out of the trial and wait (up to the trial's timeout) until every rank
        is; whether any failed. The last to arrive releases the others: O(world) requests."""
        if self.store.add(f"{self.key}/left", 1) == self.world:
            self.store.set(f"{self.key}/all", "1")
        self.store.wait([f"{self.key}/all"], datetime.timedelta(seconds=self.timeout_s))
        return self.failed()

    # ---- NCCL: abort the trial's groups when another rank failed ----------------------------
    def watch(self, groups: Callable[[], Iterable[Any]], on_host: bool) -> None:
        """Unless the trial's groups are on the host backend (``on_host``: gloo, whose freed groups
        close their connections themselves), start a thread that aborts ``groups()`` and the
        trial's world as soon as another rank says it failed."""
        if on_host:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(POLL_S):
                with contextlib.suppress(Exception):
                    if self.failed() and self.origin() != self.rank:
                        # each group's own abort: torch's _abort_process_group of the group standing
                        # in for the default one would abort every group of the job
                        for group in {id(g): g for g in [*groups(), self._group] if g is not None}.values():
                            with contextlib.suppress(Exception):
                                group.abort()
                        return

        self._watch = threading.Thread(target=run, name=f"axon4d-trial-watch-{self.rank}", daemon=True)
        self._watch.start()

    def stop_watching(self) -> None:
        self._stop.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=2 * POLL_S + 1)
        self._watch = None


# ---- a test's hook: an out-of-memory planted mid-step ----------------------------------------
#: "x,y,z,data@rank": the plan's grid and the rank that runs out of memory (docs/planner.md)
OOM_ENV = "AXON4D_TRIAL_OOM"


class Planted:
    """An out-of-memory planted in a module's forward (``OOM_ENV``), raised once armed."""

    def __init__(self, module: nn.Module, where: str):
        self.armed, self.where = False, where
        self.handle = module.register_forward_pre_hook(self._raise)

    def arm(self) -> None:
        self.armed = True

    def _raise(self, *_: Any) -> None:
        if self.armed:
            self.handle.remove()
            raise torch.OutOfMemoryError(f"out of memory planted by {OOM_ENV} in {self.where}'s forward")


def plant(model: nn.Module, grid: tuple[int, ...], rank: int) -> Planted | None:
    """A test's out-of-memory in the plan on ``grid`` on this ``rank``, where ``$AXON4D_TRIAL_OOM``
    names them ("x,y,z,data@rank"): in the forward of the module halfway down ``model``, raised once
    the caller arms it (``axon4d.trials``: in the first timed step of round 1, a collective of that
    step done, the next one left waiting on the other ranks). None otherwise."""
    spec = os.environ.get(OOM_ENV, "")
    planned, _, where = spec.partition("@")
    if not spec or planned.replace(" ", "") != ",".join(map(str, grid)) or where.strip() != str(rank):
        return None
    named = [(name, m) for name, m in model.named_modules() if name]
    name, module = named[len(named) // 2]
    return Planted(module, name)
