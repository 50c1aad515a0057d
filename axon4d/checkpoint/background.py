"""Checkpoints written in the background while training goes on: ``AsyncSaver``.

A save snapshots a rank's pieces into host memory (``axon4d.memory.host_snapshot``) and DCP's
``async_save`` writes the snapshot from a background thread, coordinated on a host group of its
own; the next save (or the end) publishes it as the blocking ``save`` does, with the same
checksums and the same agreement of every rank (``axon4d.checkpoint.publish``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from axon4d import device as devices
from axon4d.checkpoint.pieces import Piece, State
from axon4d.checkpoint.planners import SavePieces
from axon4d.checkpoint.publish import begin, own_failure, publish
from axon4d.checkpoint.writer import Writer
from axon4d.comm import communicator as comm
from axon4d.files import ckptfiles
from axon4d.grid.mesh import Grid
from axon4d.memory.host_snapshot import HostSnapshot


class AsyncSaver:
    """Checkpoints written in the background while training goes on, one at a time, on ``grid``.

    ``save`` takes the same arguments as ``save`` above (the grid aside) and blocks only while it
    snapshots the state: host copies of this rank's pieces and step counts (page-locked when they
    live on an accelerator, so the copies run at the link's speed), kept for the next save. DCP's
    ``async_save`` then writes the snapshot from a background thread into the partial directory,
    each file hashed as it is written (``axon4d.checkpoint.writer``); its coordination (DCP's gathers of plans and
    results) runs on a process group of its own on the host backend (``axon4d.comm.communicator.host_group``,
    whose pairs connect at their first message — in the background thread, for the first save — so
    it costs O(world) store requests on rank 0 and a few on the others, no full mesh), so it never
    interleaves with the collectives training issues meanwhile. ``wait`` — called by
    the next ``save``, by ``close`` and at the end of a ``with`` block — waits for the write and
    publishes it on the calling thread, as ``save`` does: every rank agrees on the outcome, meta.json
    records the checksums, one rename publishes. A write that failed on any rank is raised there,
    the same error on every rank, and nothing is published: the previous checkpoint stays the newest
    (its leftovers are removed by the next save). At most one save is in flight.

    The snapshot costs host memory of the pieces of this rank's parameters and AdamW moments that
    it writes (``axon4d.checkpoint.pieces.writes``), carved from one page-locked allocation
    (``axon4d.memory.host_snapshot``; the sync ``save`` holds one file's worth at a time); ``timeout_s``
    bounds each of the write's collectives."""

    def __init__(self, grid: Grid, timeout_s: float = 600.0):
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"AsyncSaver: timeout_s {timeout_s!r} must be a number of seconds above 0, e.g. 600")
        self.grid, self.timeout_s = grid, float(timeout_s)
        self._group: Any = None  # made by the first save, on every rank at once
        self._snapshots = HostSnapshot()  # the snapshot's host buffers, reused while the sizes stay
        self._pending: _InFlight | None = None

    def save(
        self,
        path: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int = 0,
        extra: dict[str, Any] | None = None,
        keep_last: int = 0,
        *,
        data_position: Any = None,
        rng: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        """Wait for the save in flight (``wait``), then snapshot ``model`` and ``optimizer`` and
        start writing them to ``path`` in the background; the arguments are ``save``'s."""
        self.wait()
        grid = self.grid
        path, meta, state = begin(path, model, grid, optimizer, step, extra, keep_last, data_position, rng, overwrite)
        parts, steps = self._snapshot(state)
        if self._group is None:
            self._group = comm.host_group(self.timeout_s)
        writer = Writer(ckptfiles.partial_path(path), grid.device, sources=devices.HOST)
        future = dcp.async_save(steps, storage_writer=writer, planner=SavePieces(parts), process_group=self._group)
        self._pending = _InFlight(future, path, meta, writer, overwrite, keep_last)

    def _snapshot(self, state: State) -> tuple[list[Piece], dict[str, torch.Tensor]]:
        """Host copies of ``state``'s pieces and step counts (``HostSnapshot``: one page-locked buffer
        per storage, reused from the previous save while the sizes stay); returns once they hold the
        values."""
        sources = [view for _, view in state.parts] + list(state.steps.values())
        copies = self._snapshots.take(sources)
        n = len(state.parts)
        return [(box, buf) for (box, _), buf in zip(state.parts, copies)], dict(zip(state.steps, copies[n:]))

    @property
    def in_flight(self) -> str | None:
        """The path of the save in flight (written, or waiting to be published), or None."""
        return self._pending.path if self._pending is not None else None

    @property
    def written(self) -> bool:
        """Whether the write in flight has ended (``wait`` then only publishes it); True if none is."""
        return self._pending is None or self._pending.future.done()

    def wait(self) -> None:
        """Wait for the save in flight, if any, and publish it (every rank must call this at the
        same point; ``save`` does); raise its error, the same on every rank, if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        err: BaseException | None = None
        try:
            pending.future.result()
        except dcp.CheckpointException as e:  # raised alike on every rank
            err = own_failure(e, self.grid.rank)
        except Exception as e:
            err = e
        publish(self.grid, pending.path, pending.meta, pending.writer, err, pending.overwrite, pending.keep_last)

    def close(self, abandon: bool = False) -> None:
        """Publish the save in flight (``wait``) and release the saver's process group. With
        ``abandon`` (after an error, when other ranks may never reach the same point) a save in
        flight is left unpublished and nothing waits: its write ends on its own, and the group
        goes with the process."""
        if abandon and self._pending is not None:
            self._pending = None
            return
        try:
            self.wait()
        finally:
            if self._group is not None:
                comm.close_group(self._group)
                self._group = None
            self._snapshots.clear()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(abandon=kind is not None)


class _InFlight(NamedTuple):
    """A save being written in the background, and what publishing it needs."""

    future: Any  # DCP's future of the write
    path: str
    meta: dict[str, Any]
    writer: Writer
    overwrite: bool
    keep_last: int
