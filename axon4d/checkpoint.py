"""Sharded checkpoints that load onto any grid, with ``torch.distributed.checkpoint``.

Each parameter (and each AdamW moment) is saved as a DTensor describing *its piece of the global
tensor* of the single-process model (``axon4d.params``): the piece's (x, y) block, gathered over
z for flat Linear shards, with Shard/Replicate placements on the grid's DeviceMesh. Fused tensors
(q|k|v, gate|up) are saved as their separate parts. A checkpoint is therefore independent of the
grid that wrote it: loading builds the same description for the current grid and DCP reads the
overlapping regions (resharding), and replicated pieces are written once.

Layout of a checkpoint directory: DCP's files plus ``meta.json`` (step, model config, free-form
extras) written by rank 0.

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
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from axon4d import device as devices
from axon4d import runtime
from axon4d.config import ModelConfig
from axon4d.grid import Grid
from axon4d.models.transformer import Transformer
from axon4d.params import ParamLayout, param_layouts

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
) -> None:
    """Write a sharded checkpoint of ``model`` (and AdamW-style ``optimizer`` state) to ``path``."""
    os.makedirs(path, exist_ok=True)
    dcp.save(_state(model, optimizer, grid, empty=False), checkpoint_id=path)
    if grid.rank == 0:
        meta = {"step": step, "grid": list(grid.shape.as_tuple()), **(extra or {})}
        cfg = getattr(model, "cfg", None)
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            meta["model_config"] = dataclasses.asdict(cfg)
        with open(os.path.join(path, "meta.json.tmp"), "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(os.path.join(path, "meta.json.tmp"), os.path.join(path, "meta.json"))
    grid.comm.barrier()


def read_meta(path: str) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint (step, grid it was written on, model config, extras)."""
    meta_file = os.path.join(path, "meta.json")
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"{path} is not a complete axon4d checkpoint (no meta.json)")
    with open(meta_file) as f:
        return json.load(f)


@torch.no_grad()
def load(path: str, model: nn.Module, grid: Grid, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written on any grid into ``model`` (and ``optimizer``); return its meta."""
    meta = read_meta(path)
    state = _state(model, optimizer, grid, empty=True)
    dcp.load(state, checkpoint_id=path)
    layouts = param_layouts(model)
    for name, p in model.named_parameters():
        p.copy_(_from_dtensors(f"model.{name}", state, layouts[name], grid))
        if optimizer is not None:
            st = optimizer.state[p]
            for moment in _MOMENTS:
                st[moment] = _from_dtensors(f"optim.{name}.{moment}", state, layouts[name], grid).clone()
            st["step"] = state[f"optim.{name}.step"].clone()  # made where the optimizer keeps it
    return meta


def latest(directory: str) -> str | None:
    """The newest complete checkpoint ``step_<N>`` under ``directory``, or None."""
    if not os.path.isdir(directory):
        return None
    steps = [
        d
        for d in os.listdir(directory)
        if d.startswith("step_") and os.path.exists(os.path.join(directory, d, "meta.json"))
    ]
    if not steps:
        return None
    return os.path.join(directory, max(steps, key=lambda d: int(d.split("_")[1])))


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
