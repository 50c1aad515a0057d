"""The peak memory of one training step on every rank (``peak_bytes``): torch's ``MemTracker`` on
the host, the caching allocator's peak on an accelerator; the largest over the ranks. The planner's
memory model is checked against it (``axon4d.measure.probe``), and ``--try`` reports it for each
plan tried (``axon4d.train.trial``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from axon4d import device as devices
from axon4d.grid.mesh import Grid
from axon4d.zero import ShardedOptimizer


def peak_bytes(grid: Grid, model: nn.Module, opt: Any, step: Callable[..., Any], *, passes: bool = False) -> int:
    """Peak bytes of torch tensors on this rank over one ``step()``, maximum over ranks (all ranks
    call it): torch's ``MemTracker`` on the host (see ``measure_peak``), the allocator's peak on an
    accelerator. The communication log is cleared afterwards.

    ``passes``: the step runs the model's forward more than once (micro-batches) and is called as
    ``step(next_pass)``, calling ``next_pass()`` before each forward after the first: the tracker
    follows one module call per iteration, so its per-module records are cleared there (its peak
    is kept).

    A ZeRO optimizer (``axon4d.zero``) is tracked as its inner optimizer (where the state lives)
    and its master parts: copies where the weights are stored in 16 bits, views of the
    parameters (counted once) otherwise."""
    device = grid.device
    grid.comm.barrier()
    if devices.is_host(device):
        # imported here: it pulls in inductor and dynamo, ~1 s of every process's start otherwise
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        external: list[Any] = [opt] if isinstance(opt, torch.optim.Optimizer) else []
        if isinstance(opt, ShardedOptimizer):
            external = [opt.inner, *(m for group in opt.param_groups for m in group["params"])]
        with warnings.catch_warnings():  # it warns of the gradients zero_grad set to None
            warnings.simplefilter("ignore", UserWarning)
            tracker.track_external(model, *external)
            with tracker:
                step(tracker.reset_mod_stats) if passes else step()
        peak = float(tracker.get_tracker_snapshot("peak")[device]["Total"])
    else:
        devices.synchronize(device)
        devices.reset_peak_memory(device)
        step(lambda: None) if passes else step()
        devices.synchronize(device)
        peak = float(devices.peak_memory_allocated(device) or 0)
    grid.comm.log.clear()
    peaks = grid.comm.all_gather(torch.tensor([peak], dtype=torch.float64, device=device), "world").wait()
    return int(peaks.max())
