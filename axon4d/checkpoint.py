"""Sharded checkpoints that load onto any grid, with ``torch.distributed.checkpoint``.

Each parameter (and each AdamW moment) is saved as a DTensor describing *its piece of the global
tensor* of the single-process model (``axon4d.params``): the piece's (x, y) block, gathered over
z for flat Linear shards, with Shard/Replicate placements on the grid's DeviceMesh. Fused tensors
(q|k|v, gate|up) are saved as their separate parts. A checkpoint is therefore independent of the
grid that wrote it: loading builds the same description for the current grid and DCP reads the
overlapping regions (resharding), and replicated pieces are written once.

Layout of a checkpoint directory: DCP's files plus ``meta.json`` (step, grid, model config, the
sha256 and size of every DCP file, data position, RNG states, free-form extras) written by rank 0.
A save is written into a hidden sibling and published by one rename, with ``latest`` pointing at
it (axon4d.ckptfiles). Loading reads DCP's index with a restricted unpickler, so a planted
directory runs no code, and verifies the checksums first; every step whose failure one rank alone
could see ends with one all-gather of the ranks' verdicts, so all ranks raise the same error
instead of some waiting in a collective.

Devices: the DTensors wrap the tensors where they live (``grid.device``), DCP writes their bytes,
and loading reads the bytes into buffers made on the loading grid's device; a file records no
device, so a checkpoint saved on GPUs loads on CPUs and the other way round. An optimizer's step
count goes back where torch.optim keeps it (with the parameter for fused or capturable AdamW, in
host memory otherwise). ``export_dense`` writes host tensors, which ``torch.load`` reads anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from axon4d import ckptfiles, runtime
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.grid import Grid
from axon4d.models.transformer import Transformer
from axon4d.params import ParamLayout, param_layouts

# the file-level API, usable before any process group exists (axon4d.ckptfiles)
CheckpointError = ckptfiles.CheckpointError
RESUMABLE_CHANGES = ckptfiles.RESUMABLE_CHANGES
check_compatible = ckptfiles.check_compatible
latest = ckptfiles.latest
list_checkpoints = ckptfiles.list_checkpoints
read_meta = ckptfiles.read_meta

_MESH_AXES = ("data", "z", "y", "x")  # the DeviceMesh's dims, outermost first (grid.py)
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _placements(layout: ParamLayout) -> list:
    split = dict(layout.split)
    return [Shard(split[a]) if a in split else Replicate() for a in _MESH_AXES]


def _to_dtensors(prefix: str, piece: torch.Tensor, layout: ParamLayout, grid: Grid) -> dict[str, DTensor]:
    """DTensors (one per segment) for this rank's stored ``piece`` of a parameter-shaped tensor."""
    return _block_dtensors(prefix, layout.to_block(piece, grid).contiguous(), layout, grid)


def _block_dtensors(prefix: str, block: torch.Tensor, layout: ParamLayout, grid: Grid) -> dict[str, DTensor]:
    """DTensors (one per segment) describing this rank's (x, y) ``block`` of the global tensor."""
    out = {}
    for seg, rows, shape, _ in layout.segment_views(block, grid):
        key = f"{prefix}.{seg}" if seg else prefix
        rows = rows.contiguous()
        out[key] = DTensor.from_local(
            rows,
            grid.mesh,
            _placements(layout),
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
    return out


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _empty_dtensors(prefix: str, layout: ParamLayout, like: torch.Tensor, grid: Grid) -> dict[str, DTensor]:
    """Zero DTensors with this grid's description of the tensor, for DCP to load into."""
    block = torch.zeros(layout.block_shape(grid), dtype=like.dtype, device=like.device)
    return _block_dtensors(prefix, block, layout, grid)


def _from_dtensors(prefix: str, loaded: dict[str, Any], layout: ParamLayout, grid: Grid) -> torch.Tensor:
    """This rank's stored piece rebuilt from loaded segment DTensors."""
    keys = [f"{prefix}.{seg}" for seg, _ in layout.segments] or [prefix]
    block = torch.cat([loaded[k].to_local() for k in keys], dim=0)
    return layout.from_block(block, grid)


def _step_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.device:
    """Where ``optimizer`` keeps ``p``'s step count: where it is already, else as torch.optim puts it
    (on the parameter's device for fused or capturable AdamW, in host memory otherwise)."""
    step = optimizer.state.get(p, {}).get("step")
    if isinstance(step, torch.Tensor):
        return step.device
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    return p.device if group.get("fused") or group.get("capturable") else devices.HOST


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, grid: Grid, empty: bool) -> dict[str, Any]:
    layouts = param_layouts(model)
    make = (
        (lambda pre, t, lay: _empty_dtensors(pre, lay, t, grid))
        if empty
        else (lambda pre, t, lay: _to_dtensors(pre, t, lay, grid))
    )
    state: dict[str, Any] = {}
    for name, p in model.named_parameters():
        state.update(make(f"model.{name}", p.detach(), layouts[name]))
    if optimizer is not None:
        for name, p in model.named_parameters():
            st = optimizer.state.get(p, {})
            for moment in _MOMENTS:
                if empty or moment in st:
                    state.update(make(f"optim.{name}.{moment}", st.get(moment, p.detach()), layouts[name]))
            where = _step_device(optimizer, p)
            state[f"optim.{name}.step"] = (
                torch.zeros((), device=where)
                if empty
                else torch.as_tensor(st.get("step", 0.0), dtype=torch.float32, device=where).clone()
            )
    return state


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
    meta = _new_meta(model, grid, step, extra, keep_last, data_position, rng)
    path = os.path.abspath(path)
    _agree(grid, _on_rank0(grid, lambda: ckptfiles.prepare(path, overwrite)), f"preparing {path}")
    partial = ckptfiles.partial_path(path)
    written = dcp.save(_state(model, optimizer, grid, empty=False), storage_writer=FileSystemWriter(partial))
    meta["files"] = _digests(grid, partial, written)
    _agree(grid, _on_rank0(grid, lambda: ckptfiles.publish(path, meta, overwrite, keep_last)), f"publishing {path}")


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


def _on_rank0(grid: Grid, work: Callable[[], object]) -> BaseException | None:
    """Run ``work`` on rank 0 only; the exception it raised, if any."""
    if grid.rank != 0:
        return None
    try:
        work()
    except Exception as e:
        return e
    return None


_KINDS: dict[str, type[Exception]] = {
    k.__name__: k
    for k in (CheckpointError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, OSError)
}
_KINDS["ValueError"] = ValueError
_SLOT = 4096  # bytes each rank contributes to an exchange: a verdict, or a few file digests


def _exchange(grid: Grid, payload: dict[str, Any], width: int = _SLOT) -> list[dict[str, Any]]:
    """Every rank's JSON ``payload``, in rank order (one all-gather over the world)."""
    data = json.dumps(payload).encode()
    if len(data) > width:
        raise AssertionError(f"checkpoint exchange payload of {len(data)} bytes exceeds its {width}-byte slot")
    mine = torch.zeros((1, width), dtype=torch.uint8)
    mine[0, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = grid.comm.all_gather(mine.to(grid.device), "world", tag="checkpoint").wait()
    return [json.loads(row.cpu().numpy().tobytes().rstrip(b"\0")) for row in rows]


def _verdict(err: BaseException | None) -> dict[str, Any]:
    """A rank's outcome as JSON: {} for success, else the error's type name and message."""
    if err is None:
        return {}
    kind = next((k.__name__ for k in type(err).__mro__ if k.__name__ in _KINDS), "RuntimeError")
    message = str(err) if kind != "RuntimeError" else f"{type(err).__name__}: {err}"
    while len(json.dumps([kind, message])) > _SLOT - 64:  # a message fits its slot, cut if it must
        message = message[: len(message) * 3 // 4]
    return {"error": [kind, message]}


def _agree(grid: Grid, err: BaseException | None, doing: str) -> None:
    """Share each rank's outcome of a step (``err``: None if it succeeded); if any rank failed,
    raise the lowest such rank's error, with the same type and message on every rank."""
    _raise_first(_exchange(grid, _verdict(err)), err, doing)


def _digests(grid: Grid, path: str, written: Metadata) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file of the DCP index ``written`` (and the index itself), each
    file hashed by one rank, shared with all."""
    names = sorted({info.relative_path for info in written.storage_data.values()} | {ckptfiles.DCP_INDEX})
    world = grid.size("world")
    mine: dict[str, Any] = {}
    err = None
    try:
        for name in names[grid.rank :: world]:
            sha, size = ckptfiles.digest(os.path.join(path, name))
            mine[name] = {"sha256": sha, "bytes": size}
    except Exception as e:
        err = e
    width = _SLOT + -(-len(names) // world) * (160 + max(len(n) for n in names))
    verdicts = _exchange(grid, {"files": mine} if err is None else _verdict(err), width)
    _raise_first(verdicts, err, f"hashing the files of {path}")
    return {name: rec for v in verdicts for name, rec in v["files"].items()}


def _raise_first(verdicts: list[dict[str, Any]], err: BaseException | None, doing: str) -> None:
    """Raise the error of the lowest rank whose verdict holds one (nothing if none does)."""
    for r, v in enumerate(verdicts):
        if "error" in v:
            kind, message = v["error"]
            where = f" (rank {r} of {len(verdicts)}, {doing})" if len(verdicts) > 1 else ""
            raise _KINDS.get(kind, RuntimeError)(message + where) from err


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

    Before DCP reads anything, every rank checks meta.json, the model config, DCP's index (read
    without running code from it) and the shards it names; the files' checksums are verified, each
    file by one rank. All ranks agree on the outcome: a bad checkpoint raises the same error on every
    rank (``CheckpointError``, ``FileNotFoundError``, or ``ValueError`` for another model; with
    ``check_model=False`` the model config is not compared, and only the tensors' shapes must match).
    """
    err = None
    meta: dict[str, Any] = {}
    try:
        meta = read_meta(path)
        cfg = getattr(model, "cfg", None)
        if check_model and isinstance(cfg, ModelConfig) and "model_config" in meta:
            check_compatible(meta, model_config=cfg)
        files = meta.get("files")  # absent only in checkpoints written before checksums
        if files is not None:
            ckptfiles.verify(path, files, [ckptfiles.DCP_INDEX])
        shards = ckptfiles.check_shards(path, ckptfiles.read_index(path), files)
        if files is not None:
            ckptfiles.verify(path, files, shards[grid.rank :: grid.size("world")])
    except Exception as e:
        err = e
    _agree(grid, err, f"checking {path}")
    state = _state(model, optimizer, grid, empty=True)
    dcp.load(state, storage_reader=ckptfiles.SafeReader(path))
    layouts = param_layouts(model)
    for name, p in model.named_parameters():
        p.copy_(_from_dtensors(f"model.{name}", state, layouts[name], grid))
        if optimizer is not None:
            st = optimizer.state[p]
            for moment in _MOMENTS:
                st[moment] = _from_dtensors(f"optim.{name}.{moment}", state, layouts[name], grid).clone()
            st["step"] = state[f"optim.{name}.step"].clone()  # made where the optimizer keeps it
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
    grid = runtime.init(grid=(1, 1, 1, 1))
    try:
        model = Transformer(ModelConfig(**meta["model_config"]), grid=grid)
        load(path, model, grid)
        torch.save({k: devices.to_host(v) for k, v in model.to_dense().state_dict().items()}, out_file)
    finally:
        runtime.shutdown()
    return out_file
