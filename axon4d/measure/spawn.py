"""Local worlds for calibration: spawn gloo ranks on this host and run one function on all of them
(docs/design.md §7: one CPU host, ranks that share its cores, one thread each).

``run_local(world, fn, *args)`` starts ``world`` processes, joins them in a gloo process group over
loopback, builds the pure data-parallel grid (1, 1, 1, world) with ``axon4d.runtime.init``, calls
``fn(grid, *args)`` on every rank and returns rank 0's result. ``fn`` must be a module-level
function (it is pickled by reference into the spawned processes). A rank ends when the process
that spawned it is gone (a rank left behind, blocked in a collective, would hold its memory
forever), and ``run_local`` raises when a rank ends with an error (killed for memory, say) instead
of waiting for a result that will not come.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queues
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from axon4d import runtime
from axon4d.launch import free_port


def _exit_with_parent(parent: int) -> None:
    """End this process as soon as ``parent`` is no longer its parent (it was killed or ended)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="axon4d-parent-watch").start()


def _rank_main(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any, parent: int
) -> None:
    _exit_with_parent(parent)
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
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue, os.getpid())) for r in range(world)]
    for p in procs:
        p.start()
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except queues.Empty:
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                rank, code = failed[0]
                why = " (killed: out of memory?)" if code == -9 else ""
                raise RuntimeError(
                    f"rank {rank} of the local {world}-rank world ended with exit code {code}{why}"
                ) from None
    for p in procs:
        p.join()
    return result
