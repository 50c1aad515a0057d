"""How calibration times one piece of work on every rank at once (docs/design.md §6, §7).

``timeit`` is the sample loop: a median over repetitions, each repetition a mean over a window of
back-to-back calls (where ranks share cores, §7: a single short call is either not preempted or
preempted for several time slices). ``Timer`` runs it on every rank of a grid between barriers and
averages the result over the ranks through ``axon4d.comm.communicator``, so every rank gets the same figure;
work of ``LOCKSTEP_S`` or more per call is timed again with a barrier around every call
(``Timer.lockstep``: the contention a step sees). ``Timer.stage`` draws a progress bar on rank 0 for
a stage of measurements (each ``measure`` and ``measure_collective`` advances it: calibration takes
minutes, and says where it is).
The measurements themselves are in ``axon4d.measure.kernels`` and ``axon4d.measure.collectives``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tqdm import tqdm

from axon4d import device as devices
from axon4d.grid.mesh import Grid


def timeit(
    fn: Callable[[], Any],
    reps: int,
    sync: Callable[[], None],
    budget_s: float | None = 1.0,
    window_s: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median over ``reps`` samples of the seconds per call of ``fn``, after a warm-up; with
    ``budget_s``, fewer samples once they exceed it. Collectives must pass ``budget_s=None`` and
    ``window_s=0``: every rank has to run them equally often.

    With ``window_s`` a sample is the mean over as many back-to-back calls as fill that window.
    Where ranks share cores (more ranks than cores on one host) the scheduler runs each for a
    time slice of a few milliseconds: a single short call is then either not preempted at all or
    preempted for several slices, and the median of single calls measures an unshared core. A
    window of several slices measures the share of the core a rank really gets.

    Within a window the calls are issued in batches (at first 1, 2, 4, … calls; then as many as the
    last sample's rate says fill the window) with ``sync`` after each batch, not after each call: on an
    accelerator a synchronize per call adds its round trip (~10–20 µs) to every call, as if each
    kernel ran alone, where a step queues kernels back to back. On a host ``sync`` does nothing and
    the windows are the same. ``clock`` reads the seconds (the host's ``time.perf_counter``)."""
    fn()
    sync()
    times: list[float] = []
    batch = 1
    for _ in range(reps):
        calls = 0
        t = clock()
        while True:
            for _ in range(batch):
                fn()
            calls += batch
            sync()
            elapsed = clock() - t
            if elapsed >= window_s:
                break
            per_call = max(elapsed / calls, 1e-9)  # the calls left to fill the window, at most doubling
            batch = max(1, min(2 * calls, math.ceil((window_s - elapsed) / per_call)))
        times.append(elapsed / calls)
        batch = max(1, math.ceil(window_s / max(elapsed / calls, 1e-9))) if window_s > 0 else 1
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
        self._bar: tqdm | None = None

    @contextlib.contextmanager
    def stage(self, what: str, total: int | None = None) -> Iterator[None]:
        """A progress bar on rank 0 for a stage of ``total`` measurements (None: a count without an
        end), named ``[N ranks] what``, with tqdm's rate and estimate of the time left."""
        bar = tqdm(
            total=total,
            desc=f"[{self.grid.world_size} ranks] {what}",
            disable=self.grid.rank != 0,
            unit="point",
            dynamic_ncols=True,
        )
        self._bar = bar
        try:
            yield
        finally:
            self._bar = None
            bar.close()

    def _advance(self) -> None:
        if self._bar is not None:
            self._bar.update()

    def sync(self) -> None:
        """Wait for the work queued on this rank's device."""
        devices.synchronize(self.device)

    def mean(self, value: float) -> float:
        """Mean of ``value`` over all ranks (through axon4d.comm.communicator on the world axis)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(self.grid.comm.all_reduce(t, "world").wait()) / self.grid.world_size

    def measure(self, fn: Callable[[], Any], budget_s: float | None = 1.0) -> float:
        """Seconds per call of local work ``fn``, mean over ranks (windowed: see ``timeit``); for
        work of ``LOCKSTEP_S`` or more per call, in lockstep (``lockstep``)."""
        self.grid.comm.barrier()
        t = self.mean(timeit(fn, self.reps, self.sync, budget_s, self.window_s))
        if t >= LOCKSTEP_S and self.grid.world_size > 1:
            t = self.lockstep(fn)
        self._advance()
        return t

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
        t = self.mean(timeit(fn, self.reps, self.sync, None))
        self._advance()
        return t
