"""Local worlds for calibration: spawn gloo ranks on this host and run one function on all of them
(docs/design.md §7: one CPU host, ranks that share its cores, one thread each).

``run_local(world, fn, *args)`` starts ``world`` processes, joins them in a gloo process group over
loopback, builds the pure data-parallel grid (1, 1, 1, world) with ``axon4d.runtime.init``, calls
``fn(grid, *args)`` on every rank and returns rank 0's result. ``fn`` must be a module-level
function (it is pickled by reference into the spawned processes).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from axon4d import runtime
from axon4d.launch import free_port


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    grid = runtime.init(grid=(1, 1, 1, world))
    result = fn(grid, *args)
    if rank == 0:
        queue.put(result)
    runtime.shutdown()
    dist.destroy_process_group()


def run_local(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Spawn ``world`` gloo ranks on this host, run ``fn(grid, *args)`` on each, return rank 0's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result
