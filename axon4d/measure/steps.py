"""Whole training steps timed on every calibration grid, for the planner's in-step scale
(docs/design.md §6; axon4d.plan.stepfit fits it; ``axon4d calibrate --step-model`` and the
planner bench run this).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridShape
from axon4d.measure.probe import ProbeModel, measure_step
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.stepfit import Sample, calibration_grids
from axon4d.plan.workload import Workload


def measure(
    world_grid: Any, wl: Workload, rounds: int = 3, steps: int = 6, log: Callable[[str], None] = print
) -> list[Sample]:
    """Time ``wl`` on every ``calibration_grids`` grid of this world (every rank calls this; all get
    the same samples): ``rounds`` interleaved rounds of ``steps`` back-to-back steps
    (``axon4d.measure.probe.measure_step``), the median over rounds."""
    grids = calibration_grids(world_grid.world_size, wl)
    log(f"[{world_grid.world_size} ranks] timing whole steps: {len(grids)} grids × {rounds} rounds of {steps} steps")
    times: dict[tuple, list[float]] = {g: [] for g in grids}
    for _ in range(rounds):
        for g in grids:
            grid = Grid(GridShape(*g), world_grid.device, world_grid.comm.transport_name, launcher="existing")
            grid.scheduler.configure(OverlapPolicy())
            try:
                torch.manual_seed(0)
                times[g].append(measure_step(ProbeModel(wl, grid), steps=steps)["step_s"])
            finally:
                grid.comm.barrier()
                grid.destroy()
    for g in grids:
        log(f"[{world_grid.world_size} ranks] calibration step {g}: {statistics.median(times[g]) * 1e3:.0f} ms")
    return [Sample.of(g, wl, times[g]) for g in grids]
