"""Local worlds: spawn ranks on this host and run one function on all of them (docs/design.md §7:
one host, ranks that share its cores — and its one accelerator, if it has one — one thread each).

``run_local(world, fn, *args)`` starts ``world`` processes, joins them in a gloo process group over
loopback, builds the pure data-parallel grid (1, 1, 1, world) with ``axon4d.runtime.init``, calls
``fn(grid, *args)`` on every rank and returns rank 0's result. Options: another ``grid`` (or
``grid=None``: ``fn(None, *args)`` on the bare world), ``init_kwargs`` for ``init``, another
``backend`` (NCCL, with ``device_per_rank``: rank r on accelerator r), ``every_rank`` (every rank's
result, in rank order) and a ``timeout``. With gloo on a host with an accelerator, every rank
computes on that one device and gloo stages the collectives through host memory: the distributed
code runs on device tensors with one GPU (bench/gpu_check.py). ``fn`` must be a module-level
function (it is pickled by reference into the spawned processes) returning plain data. A rank ends
when the process that spawned it is gone (a rank left behind, blocked in a collective, would hold
its memory forever), and ``run_local`` raises when a rank ends with an error (killed for memory,
say) instead of waiting for a result that will not come.
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

from axon4d import device as devices
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
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    parent: int,
    how: dict[str, Any],
) -> None:
    _exit_with_parent(parent)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if how["device_per_rank"]:
        os.environ["LOCAL_RANK"] = str(rank)  # runtime.init's default device: accelerator ``rank``
    torch.set_num_threads(1)
    dist.init_process_group(
        how["backend"],
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=how["timeout"]),
    )
    if how["grid"] is None:
        result = fn(None, *args)
    else:
        grid = runtime.init(grid=how["grid"], **how["init_kwargs"])
        result = fn(grid, *args)
        runtime.shutdown()
    if rank == 0 or how["every_rank"]:
        queue.put((rank, result))
    dist.destroy_process_group()


def run_local(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    grid: tuple[int, ...] | None | str = "data",
    init_kwargs: dict[str, Any] | None = None,
    backend: str | None = None,
    device_per_rank: bool = False,
    every_rank: bool = False,
    timeout: float = 600.0,
) -> Any:
    """Spawn ``world`` ranks on this host, run ``fn(grid, *args)`` on each, return rank 0's result
    (every rank's, in rank order, with ``every_rank``). ``grid``: "data" for (1, 1, 1, world), a
    shape, or None for no grid; ``backend``: gloo unless given. Raises ``RuntimeError`` when a rank
    ends with an error or the results are not in after ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    how = {
        "grid": (1, 1, 1, world) if grid == "data" else grid,
        "init_kwargs": init_kwargs or {},
        "backend": backend or devices.default_backend(devices.HOST),
        "device_per_rank": device_per_rank,
        "every_rank": every_rank,
        "timeout": timeout,
    }
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue, os.getpid(), how)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        results = _collect(procs, queue, world if every_rank else 1, time.monotonic() + timeout)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.join()
    return [results[r] for r in range(world)] if every_rank else results[0]


def _collect(procs: list[Any], queue: Any, count: int, deadline: float) -> dict[int, Any]:
    """``count`` (rank, result) pairs from ``queue``; raises when a rank failed or time ran out."""
    results: dict[int, Any] = {}
    while len(results) < count:
        try:
            rank, result = queue.get(timeout=1.0)
            results[rank] = result
        except queues.Empty:
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                rank, code = failed[0]
                why = " (killed: out of memory?)" if code == -9 else ""
                raise RuntimeError(
                    f"rank {rank} of the local {len(procs)}-rank world ended with exit code {code}{why}"
                ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(results))
                raise RuntimeError(
                    f"ranks {missing} of the local {len(procs)}-rank world sent no result in time"
                ) from None
    return results
