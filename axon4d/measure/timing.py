"""How calibration times one piece of work on every rank at once (docs/design.md §6, §7).

``timeit`` is the sample loop: a median over repetitions, each repetition a mean over a window of
back-to-back calls (where ranks share cores, §7: a single short call is either not preempted or
preempted for several time slices). ``Timer`` runs it on every rank of a grid between barriers and
averages the result over the ranks through ``axon4d.comm``, so every rank gets the same figure;
work of ``LOCKSTEP_S`` or more per call is timed again with a barrier around every call
(``Timer.lockstep``: the contention a step sees).
The measurements themselves are in ``axon4d.measure.kernels`` and ``axon4d.measure.collectives``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from axon4d import device as devices
from axon4d.grid import Grid


def timeit(
    fn: Callable[[], Any], reps: int, sync: Callable[[], None], budget_s: float | None = 1.0, window_s: float = 0.0
) -> float:
    """Median over ``reps`` samples of the seconds per call of ``fn``, after a warm-up; with
    ``budget_s``, fewer samples once they exceed it. Collectives must pass ``budget_s=None`` and
    ``window_s=0``: every rank has to run them equally often.

    With ``window_s`` a sample is the mean over as many back-to-back calls as fill that window.
    Where ranks share cores (more ranks than cores on one host) the scheduler runs each for a
    time slice of a few milliseconds: a single short call is then either not preempted at all or
    preempted for several slices, and the median of single calls measures an unshared core. A
    window of several slices measures the share of the core a rank really gets."""
    fn()
    sync()
    times: list[float] = []
    for _ in range(reps):
        calls = 0
        t = time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - t
            if elapsed >= window_s:
                break
        times.append(elapsed / calls)
        if budget_s is not None and sum(times) > budget_s and len(times) >= 2:
            break
    return statistics.median(times)


#: local work that takes this long per call or more is timed again in lockstep (``Timer.lockstep``)
LOCKSTEP_S = 0.05


class Timer:
    """Times work on every rank of ``grid`` at once: ``reps`` samples, local work in windows of
    ``window_s`` (``timeit``), each figure the mean over ranks."""

    def __init__(self, grid: Grid, reps: int, window_s: float = 0.0):
        self.grid, self.reps, self.window_s = grid, reps, window_s
        self.device = grid.device

    def sync(self) -> None:
        """Wait for the work queued on this rank's device."""
        devices.synchronize(self.device)

    def mean(self, value: float) -> float:
        """Mean of ``value`` over all ranks (through axon4d.comm on the world axis)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(self.grid.comm.all_reduce(t, "world").wait()) / self.grid.world_size

    def measure(self, fn: Callable[[], Any], budget_s: float | None = 1.0) -> float:
        """Seconds per call of local work ``fn``, mean over ranks (windowed: see ``timeit``); for
        work of ``LOCKSTEP_S`` or more per call, in lockstep (``lockstep``)."""
        self.grid.comm.barrier()
        t = self.mean(timeit(fn, self.reps, self.sync, budget_s, self.window_s))
        if t < LOCKSTEP_S or self.grid.world_size == 1:
            return t
        return self.lockstep(fn)

    def lockstep(self, fn: Callable[[], Any], samples: int = 2) -> float:
        """Seconds per call of long local work ``fn`` run by every rank at once, as a step runs it:
        each sample starts all ranks together (a barrier) and ends when the slowest is done (a
        barrier); the median of ``samples``, mean over ranks. Timed freely, ranks that share cores
        drift apart over calls of seconds, and those that finish first leave the cores to the rest,
        whose calls then run faster than any call of a step, where every rank computes until the
        next collective."""
        times = []
        for _ in range(samples):
            self.grid.comm.barrier()
            t = time.perf_counter()
            fn()
            self.sync()
            self.grid.comm.barrier()
            times.append(time.perf_counter() - t)
        return self.mean(statistics.median(times))

    def measure_collective(self, fn: Callable[[], Any]) -> float:
        """Seconds of one collective ``fn`` that every rank runs the same number of times."""
        self.grid.comm.barrier()
        return self.mean(timeit(fn, self.reps, self.sync, None))
