"""Sharded checkpoints that load onto any grid, written and read piece by piece with DCP.

Every parameter and AdamW moment is a piece of a *global* tensor of the single-process model
(``axon4d.param_layout``; fused q|k|v and gate|up are saved as their parts). A rank saves its piece as it
stores it, cut into rectangles of the global tensors (``ParamLayout.boxes``), each written by
``torch.distributed.checkpoint`` (DCP) from a view of the rank's storage, replicated ones once:
nothing is gathered, and a save holds only DCP's copies of the one file it writes (``_Writer``). A
load cuts this grid's pieces alike, and DCP reads into each, in place, the saved rectangles it
overlaps, one at a time; so a checkpoint loads onto any grid. A directory holds DCP's files and
``meta.json`` (step, grid, model config, each file's sha256 and size, data position, RNG states,
extras), published by one rename (axon4d.ckptfiles). A load reads DCP's index with a restricted
unpickler (a planted directory runs no code) and checks the checksums, and that the index covers
every piece, first; a step whose failure one rank alone could see ends with one all-gather of the
ranks' verdicts, so all raise the same error (``axon4d.agreement``). Files record no device (DCP
writes host copies), so checkpoints move between GPUs and CPUs; a step count goes back where
torch.optim keeps it.

``AsyncSaver`` saves while training goes on: it snapshots a rank's pieces into host memory and
DCP's ``async_save`` writes the snapshot from a background thread; the next save (or the end)
publishes it as ``save`` does, with the same checksums and the same agreement of every rank.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from axon4d import ckptfiles, comm, runtime
from axon4d import device as devices
from axon4d.agreement import SLOT, agree, exchange, on_rank0, raise_first, verdict
from axon4d.config import ModelConfig
from axon4d.grid import Grid
from axon4d.host_snapshot import HostSnapshot
from axon4d.models.transformer import Transformer
from axon4d.param_layout import Box, ParamLayout, param_layouts
from axon4d.zero import ShardedOptimizer, masters_holder

# the file-level API, usable before any process group exists (axon4d.ckptfiles)
CheckpointError = ckptfiles.CheckpointError
RESUMABLE_CHANGES = ckptfiles.RESUMABLE_CHANGES
check_compatible = ckptfiles.check_compatible
latest = ckptfiles.latest
list_checkpoints = ckptfiles.list_checkpoints
read_meta = ckptfiles.read_meta

#: the meta.json key (an extra of ``save``) holding the absolute path of the Hugging Face model a
#: checkpoint fine-tunes (``axon4d train --hf``): a resume checks it, an export reads its config there
HF_PATH = "hf_path"
_MOMENTS = ("exp_avg", "exp_avg_sq")
_FILES = 16  # a rank writes its pieces into about this many files (_Writer)
_Piece = tuple[Box, torch.Tensor]  # a rectangle of a saved tensor, and the view of this rank's storage holding it


def _chunk(box: Box) -> dcp.ChunkStorageMetadata:
    return dcp.ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes))


class _State(NamedTuple):
    """What a save writes or a load fills."""

    parts: list[_Piece]  # of every parameter and AdamW moment: views of this rank's storage
    steps: dict[str, torch.Tensor]  # the optimizer's step counts: DCP's own state dict
    made: list[tuple[torch.Tensor, str, torch.Tensor]]  # (state key, key, tensor) a load puts in optimizer.state
    pads: list[torch.Tensor]  # the z padding past each flat shard's pieces: zeroed by a load


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, grid: Grid, load: bool) -> _State:
    """The pieces of ``model``'s parameters (model.<name>[.<segment>]) and ``optimizer``'s moments
    (optim.<name>.<moment>[.<segment>]); a load makes those the optimizer lacks (zeros like the parameter).
    A ZeRO optimizer (``axon4d.zero``) holds the moments of this data rank's part of each parameter
    only: its pieces are that part's rectangles of the global tensors (``_owned_views``); so are the
    model's pieces of a parameter whose fp32 master is a copy (a 16-bit weight,
    ``ShardedOptimizer.master_copy``): the master, not the rounded parameter, is saved and loaded."""
    layouts = param_layouts(model)
    state = _State([], {}, [], [])
    sharded = optimizer if isinstance(optimizer, ShardedOptimizer) else None
    for name, p in model.named_parameters():
        owned = sharded.owned(p) if sharded is not None else None
        key = owned[1] if owned is not None else p  # what the optimizer keeps p's state under: p, or its part
        master = sharded.master_copy(p) if sharded is not None else None
        tensors: list[tuple[str, torch.Tensor]] = [(f"model.{name}", p if master is None else master)]
        st = optimizer.state.get(key, {}) if optimizer is not None else {}
        for moment in _MOMENTS if optimizer is not None else ():
            t = st.get(moment)
            if load and not (isinstance(t, torch.Tensor) and t.shape == key.shape and t.device == key.device):
                t = torch.zeros_like(key, memory_format=torch.contiguous_format)
                state.made.append((key, moment, t))
            if isinstance(t, torch.Tensor):
                tensors.append((f"optim.{name}.{moment}", t))
        for prefix, t in tensors:
            if owned is not None and t is not p:  # a moment of this rank's part [start, start + t.numel())
                mine, covered = _owned_views(layouts[name], prefix, p.numel(), owned[0], t, grid)
            else:
                mine = layouts[name].views(prefix, t, grid)
                covered = sum(v.numel() for _, v in mine)
            state.parts.extend(mine)
            state.pads.append(t.detach().view(-1)[covered:])
        if optimizer is not None:
            step = torch.zeros(()) if load else torch.as_tensor(st.get("step", 0.0), dtype=torch.float32)
            state.steps[f"optim.{name}.step"] = step = step.to(_step_device(optimizer, key), copy=True)
            state.made.extend([(key, "step", step)] if load else [])
    return state


def _owned_views(
    layout: ParamLayout, prefix: str, numel: int, start: int, t: torch.Tensor, grid: Grid
) -> tuple[list[_Piece], int]:
    """The pieces of ``t``, which holds elements [start, start + t.numel()) of this rank's flat
    stored piece of ``numel`` elements (a ZeRO part): each box of the piece (``ParamLayout.boxes``)
    cut to that range — a run of whole rows, and partial rows at either end — with views of ``t``;
    and how many of ``t``'s elements they cover (the rest is z padding)."""
    stop = start + t.numel()
    flat = t.detach().view(-1)  # (stop - start,)
    out: list[_Piece] = []
    covered = 0
    for b in layout.boxes(prefix, numel, grid):
        for offsets, sizes, at in _cut(b.offsets, b.sizes, start - b.start, stop - b.start):
            first = b.start + at - start  # where the rectangle begins in t
            size = math.prod(sizes)
            box = Box(b.key, b.shape, offsets, sizes, first)
            out.append((box, flat[first : first + size].view(sizes)))
            covered = max(covered, first + size)
    return out, covered


_Rect = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, where it begins in the flat rectangle it cuts)


def _cut(offsets: tuple[int, ...], sizes: tuple[int, ...], lo: int, hi: int) -> list[_Rect]:
    """Rectangles covering the elements [lo, hi) of a row-major rectangle of ``sizes`` at
    ``offsets``: (offsets, sizes, where each begins in it, row-major) — whole rows in one, a partial
    row at either end cut the same way over the remaining dims."""
    total = math.prod(sizes)
    lo, hi = max(lo, 0), min(hi, total)
    if lo >= hi:
        return []
    if (lo, hi) == (0, total):
        return [(offsets, sizes, 0)]
    row = math.prod(sizes[1:])

    def in_row(r: int, a: int, b: int) -> list[_Rect]:
        inner = _cut(offsets[1:], sizes[1:], a, b)
        return [((offsets[0] + r, *o), (1, *s), r * row + at) for o, s, at in inner]

    first, end = -(-lo // row), hi // row  # the whole rows [first, end)
    if first > end:  # lo and hi inside one row
        return in_row(lo // row, lo % row, hi - lo // row * row)
    out = in_row(first - 1, lo - (first - 1) * row, row) if lo < first * row else []
    if end > first:
        out.append(((offsets[0] + first, *offsets[1:]), (end - first, *sizes[1:]), first * row))
    if hi > end * row:
        out += in_row(end, 0, hi - end * row)
    return out


class _SavePieces(dcp.DefaultSavePlanner):
    """DCP's save planner, plus one write of each piece, straight from this rank's storage."""

    def __init__(self, parts: list[_Piece]):
        super().__init__()
        self.parts = {(b.key, b.offsets): (b, view) for b, view in parts}

    def create_local_plan(self) -> dcp.SavePlan:
        plan = super().create_local_plan()
        writes = [
            dcp.WriteItem(
                MetadataIndex(b.key, b.offsets),
                WriteItemType.SHARD,
                tensor_data=TensorWriteData(_chunk(b), TensorProperties.create_from_tensor(view), torch.Size(b.shape)),
            )
            for b, view in self.parts.values()
        ]
        return dataclasses.replace(plan, items=[*plan.items, *writes])

    def resolve_data(self, write_item: dcp.WriteItem) -> torch.Tensor | io.BytesIO:
        part = self.parts.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return part[1] if part is not None else super().resolve_data(write_item)


class _LoadPieces(dcp.DefaultLoadPlanner):
    """DCP's load planner, plus ``reads`` (``_reads``) straight into the pieces' views."""

    def __init__(self, parts: list[_Piece], reads: list[dcp.ReadItem]):
        super().__init__()
        self.parts, self.reads, self.keys = parts, reads, {b.key for b, _ in parts}

    def create_local_plan(self) -> dcp.LoadPlan:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[*plan.items, *self.reads])

    def resolve_tensor(self, read_item: dcp.ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn not in self.keys:
            return super().resolve_tensor(read_item)
        return self.transform_tensor(read_item, self.parts[read_item.dest_index.index or 0][1])


def _reads(path: str, md: dcp.Metadata, parts: list[_Piece]) -> list[dcp.ReadItem]:
    """DCP's reads filling every piece from the checkpoint at ``path`` whose index is ``md``; a
    tensor absent, of another shape, or not wholly covered by the saved chunks is an error."""
    reads: list[dcp.ReadItem] = []
    for i, (b, _) in enumerate(parts):
        entry = md.state_dict_metadata.get(b.key)
        if not isinstance(entry, dcp.TensorStorageMetadata):
            raise ValueError(
                f"{path} holds no tensor {b.key}: it was saved from another model, or without optimizer state (then "
                "load it with optimizer=None)"
            )
        if tuple(entry.size) != b.shape:
            raise ValueError(
                f"{path} holds {b.key} of shape {tuple(entry.size)}, this model's is {b.shape}: it is another model's "
                "checkpoint; load it into a model of the configuration in its meta.json"
            )
        found = create_read_items_for_chunk_list(b.key, entry, [_chunk(b)])
        if sum(math.prod(r.lengths) for r in found) != math.prod(b.sizes):
            raise CheckpointError(
                f"{path}/{ckptfiles.DCP_INDEX} does not cover {b.key} at {b.offsets} (sizes {b.sizes}) with its "
                "chunks: the index is damaged; resume from another checkpoint"
            )
        reads += [dataclasses.replace(r, dest_index=MetadataIndex(b.key, b.offsets, i)) for r in found]
    return reads


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, with this rank's items cut in order into files of about 1/``_FILES``
    of its bytes (an item larger than that alone). DCP keeps each tensor it writes (a copy of a
    view, a host copy of a device tensor) until its file is closed: a file bounds what a save holds.
    Each file is hashed as soon as it is written and synced, by the rank that wrote it, and DCP's
    index by the coordinator (rank 0) once written and read back as a load reads it (``digests``:
    name -> {"sha256", "bytes"}); a background save hashes in the background too."""

    def __init__(self, path: str):
        super().__init__(path)
        self.digests: dict[str, dict[str, Any]] = {}

    def _hash(self, name: str) -> None:
        sha, size = ckptfiles.digest(os.path.join(str(self.path), name))
        self.digests[name] = {"sha256": sha, "bytes": size}

    def write_data(self, plan: dcp.SavePlan, planner: dcp.SavePlanner) -> Future[list[WriteResult]]:
        sizes = [
            math.prod(d.chunk.sizes) * d.properties.dtype.itemsize if (d := i.tensor_data) else 0 for i in plan.items
        ]
        files: dict[int, list[dcp.WriteItem]] = {}
        total = max(sum(sizes), 1)
        for start, item in zip(itertools.accumulate(sizes, initial=0), plan.items):  # file j: those starting in
            files.setdefault(start * _FILES // total, []).append(item)  # the j-th 1/_FILES of the bytes
        results: list[WriteResult] = []
        for k, items in files.items():  # file k of rank r: __<r>_<k>_0.distcp
            prefix = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{k}_")
            written = super().write_data(dataclasses.replace(plan, items=items, storage_data=prefix), planner).wait()
            for name in sorted({r.storage_data.relative_path for r in written}):
                self._hash(name)
            results += written
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: dcp.Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        ckptfiles.read_index(str(self.path))  # what a load will read: no class it refuses, files inside
        self._hash(ckptfiles.DCP_INDEX)


def _step_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.device:
    """Where ``optimizer`` keeps ``p``'s step count: where it is already, else as torch.optim puts it
    (on the parameter's device for fused or capturable AdamW, in host memory otherwise)."""
    step = optimizer.state.get(p, {}).get("step")
    if isinstance(step, torch.Tensor):
        return step.device
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    return p.device if group.get("fused") or group.get("capturable") else devices.HOST


def save(
    path: str,
    model: nn.Module,
    grid: Grid,
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    keep_last: int = 0,
    *,
    data_position: Any = None,
    rng: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Write a sharded checkpoint of ``model`` (and AdamW-style ``optimizer`` state) to ``path``,
    published atomically: every rank returns once ``path`` is complete, or raises the same error.

    meta.json records ``step``, the grid, the model's config, each file's sha256 and size, and (as
    rank 0 passes them) ``data_position`` and ``rng`` (JSON data, e.g. ``axon4d.device.rng_state()``) beside the
    keys of ``extra``. An existing ``path`` is an error unless ``overwrite``. With ``keep_last`` K > 0
    all but the newest K ``step_<N>`` checkpoints beside ``path`` are deleted afterwards.
    """
    path, meta, state = _begin(path, model, grid, optimizer, step, extra, keep_last, data_position, rng, overwrite)
    writer, err = _Writer(ckptfiles.partial_path(path)), None
    try:
        dcp.save(state.steps, storage_writer=writer, planner=_SavePieces(state.parts))
    except dcp.CheckpointException as e:  # raised alike on every rank
        err = _own_failure(e, grid.rank)
    _publish(grid, path, meta, writer, err, overwrite, keep_last)


def _begin(
    path: str,
    model: nn.Module,
    grid: Grid,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict[str, Any] | None,
    keep_last: int,
    position: Any,
    rng: Any,
    overwrite: bool,
) -> tuple[str, dict[str, Any], _State]:
    """The start of a save to ``path``: its meta.json content and the pieces it writes, checked on
    every rank before any collective; then the empty partial directory, made by rank 0 (every rank
    raises its error alike). Returns the absolute path, the meta and the pieces."""
    meta = _new_meta(model, grid, step, extra, keep_last, position, rng)
    state = _state(model, optimizer, grid, load=False)  # views only; raises alike on every rank, before any collective
    path = os.path.abspath(path)
    agree(grid, on_rank0(grid, lambda: ckptfiles.prepare(path, overwrite)), f"preparing {path}")
    return path, meta, state


def _publish(
    grid: Grid,
    path: str,
    meta: dict[str, Any],
    writer: _Writer,
    err: BaseException | None,
    overwrite: bool,
    keep_last: int,
) -> None:
    """The end of a save to ``path`` whose files ``writer`` wrote and hashed (``err``: this rank's
    failure in the write, None if it had none): every rank's digests or error shared (``_digests``),
    then meta.json with them written and the directory published by rank 0; on every rank the same
    error if any rank failed, and then nothing is published."""
    meta["files"] = _digests(grid, path, writer.digests, err)
    agree(grid, on_rank0(grid, lambda: ckptfiles.publish(path, meta, overwrite, keep_last)), f"publishing {path}")


def _own_failure(e: dcp.CheckpointException, rank: int) -> BaseException | None:
    """This rank's own error in the failure DCP raised alike on every rank (None if it had none):
    each rank reports what it raised, and the lowest failing rank's error is raised (``raise_first``)."""
    return e.failures[rank][0] if rank in e.failures else None


class AsyncSaver:
    """Checkpoints written in the background while training goes on, one at a time, on ``grid``.

    ``save`` takes the same arguments as ``save`` above (the grid aside) and blocks only while it
    snapshots the state: host copies of this rank's pieces and step counts (page-locked when they
    live on an accelerator, so the copies run at the link's speed), kept for the next save. DCP's
    ``async_save`` then writes the snapshot from a background thread into the partial directory,
    each file hashed as it is written (``_Writer``); its coordination (DCP's gathers of plans and
    results) runs on a process group of its own on the host backend (``axon4d.comm.host_group``),
    so it never interleaves with the collectives training issues meanwhile. ``wait`` — called by
    the next ``save``, by ``close`` and at the end of a ``with`` block — waits for the write and
    publishes it on the calling thread, as ``save`` does: every rank agrees on the outcome, meta.json
    records the checksums, one rename publishes. A write that failed on any rank is raised there,
    the same error on every rank, and nothing is published: the previous checkpoint stays the newest
    (its leftovers are removed by the next save). At most one save is in flight.

    The snapshot costs host memory of this rank's parameters and AdamW moments, one page-locked
    buffer per tensor (``axon4d.host_snapshot``; the sync ``save`` holds one file's worth at a time); ``timeout_s`` bounds each of the write's collectives.
    """

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
        path, meta, state = _begin(path, model, grid, optimizer, step, extra, keep_last, data_position, rng, overwrite)
        parts, steps = self._snapshot(state)
        if self._group is None:
            self._group = comm.host_group(self.timeout_s)
        writer = _Writer(ckptfiles.partial_path(path))
        future = dcp.async_save(steps, storage_writer=writer, planner=_SavePieces(parts), process_group=self._group)
        self._pending = _InFlight(future, path, meta, writer, overwrite, keep_last)

    def _snapshot(self, state: _State) -> tuple[list[_Piece], dict[str, torch.Tensor]]:
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
            err = _own_failure(e, self.grid.rank)
        except Exception as e:
            err = e
        _publish(self.grid, pending.path, pending.meta, pending.writer, err, pending.overwrite, pending.keep_last)

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
    writer: _Writer
    overwrite: bool
    keep_last: int


_RESERVED = ("step", "grid", "model_config", "files", "data_position", "rng")


def _new_meta(
    model: nn.Module, grid: Grid, step: int, extra: dict[str, Any] | None, keep_last: int, position: Any, rng: Any
) -> dict[str, Any]:
    """meta.json's content for a save, with every argument checked on every rank before any collective."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save: step {step!r} must be an integer >= 0 (the optimizer steps done)")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 0:
        raise ValueError(f"save: keep_last {keep_last!r} must be an integer >= 0 (0 keeps every checkpoint)")
    clash = sorted(set(extra or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"save: extra keys {clash} are reserved by meta.json ({_RESERVED}); rename them")
    meta: dict[str, Any] = {"step": step, "grid": list(grid.shape.as_tuple())}
    cfg = getattr(model, "cfg", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        meta["model_config"] = dataclasses.asdict(cfg)
    for key, value in (("data_position", position), ("rng", rng)):
        if value is not None:
            meta[key] = value
    meta.update(extra or {})
    for key, value in meta.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"save: {key} = {type(value).__name__} cannot be written to meta.json ({e}); pass JSON data "
                "(dicts, lists, numbers, strings; a tensor as .tolist())"
            ) from e
    return meta


def _digests(
    grid: Grid, path: str, mine: dict[str, dict[str, Any]], err: BaseException | None
) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file of the save at ``path`` (DCP's shards and index): ``mine``,
    those this rank wrote and hashed (``_Writer.digests``), shared with all in one all-gather
    over world; if any rank failed (``err`` here), raise the lowest such rank's error on every rank."""
    verdicts = exchange(grid, {"files": mine} if err is None else verdict(err), _DIGESTS_SLOT)
    raise_first(verdicts, err, f"writing {path}")
    return {name: rec for v in verdicts for name, rec in v["files"].items()}


#: bytes each rank contributes to ``_digests``: a verdict, or the records of its files (at most
#: _FILES + 1 shards and the index, each name, sha256 and size well within 256 bytes of JSON)
_DIGESTS_SLOT = SLOT + (_FILES + 2) * 256


@torch.no_grad()
def load(
    path: str,
    model: nn.Module,
    grid: Grid,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    check_model: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written on any grid into ``model`` (and ``optimizer``); return its meta
    (with ``data_position`` and ``rng`` when the save recorded them, for the caller to restore).

    Before DCP reads anything (straight into the parameters and moments), every rank checks
    meta.json, the model config, DCP's index (read without running code from it; it must cover each
    piece) and the shards it names, each file's checksum verified by one rank. All ranks agree: a bad
    checkpoint raises the same error on every rank (``CheckpointError``, ``FileNotFoundError``, or
    ``ValueError`` for another model; with ``check_model=False`` only the tensors' shapes must match).
    """
    err = None
    meta: dict[str, Any] = {}
    state, reads = _State([], {}, [], []), []
    try:
        meta = read_meta(path)
        cfg = getattr(model, "cfg", None)
        if check_model and isinstance(cfg, ModelConfig) and "model_config" in meta:
            check_compatible(meta, model_config=cfg)
        files = meta.get("files")  # absent only in checkpoints written before checksums
        if files is not None:
            ckptfiles.verify(path, files, [ckptfiles.DCP_INDEX])
        index = ckptfiles.read_index(path)
        shards = ckptfiles.check_shards(path, index, files)
        if files is not None:
            ckptfiles.verify(path, files, shards[grid.rank :: grid.size("world")])
        holder = masters_holder(model, grid)
        if holder is not None and optimizer is not holder:
            raise ValueError(
                "the model's Linear weights are stored in bf16 and their fp32 master weights belong to a sharded "
                "optimizer (axon4d.shard_optimizer, training in 16 bits): pass it, load(path, model, grid, "
                "optimizer), or its next step would overwrite what this load wrote"
            )
        state = _state(model, optimizer, grid, load=True)
        reads = _reads(path, index, state.parts)
    except Exception as e:
        err = e
    agree(grid, err, f"checking {path}")
    dcp.load(state.steps, storage_reader=ckptfiles.SafeReader(path), planner=_LoadPieces(state.parts, reads))
    for pad in state.pads:
        pad.zero_()
    states = optimizer.state if optimizer is not None else {}
    for p, key, t in state.made:  # the moments made and the step counts (made where the optimizer keeps them)
        states[p][key] = t
    if isinstance(optimizer, ShardedOptimizer):  # 16-bit weights: DCP filled their masters; round them back
        optimizer.refresh_params()
    return meta


def export_dense(path: str, out_file: str) -> str:
    """Write a checkpoint's model as one plain ``torch.save`` state dict of ``DenseTransformer``.

    Runs in a single process: it loads the checkpoint onto a 1-rank grid (on this machine's
    default device) and converts; the file holds host tensors, so ``torch.load`` needs no
    ``map_location`` anywhere.
    """
    meta = read_meta(path)
    if "model_config" not in meta:
        raise ValueError(f"{path} has no model_config in meta.json; only axon4d models can be exported")
    if HF_PATH in meta:
        raise ValueError(
            f"{path} fine-tunes the Hugging Face model in {meta[HF_PATH]!r} (axon4d train --hf), not one of "
            "axon4d's own models; export it in that model's format (axon4d export-hf)"
        )
    grid = runtime.init(grid=(1, 1, 1, 1))
    try:
        model = Transformer(ModelConfig(**meta["model_config"]), grid=grid)
        load(path, model, grid)
        torch.save({k: devices.to_host(v) for k, v in model.to_dense().state_dict().items()}, out_file)
    finally:
        runtime.shutdown()
    return out_file
