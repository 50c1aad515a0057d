"""The pieces a rank saves or loads: views of its storage, each a rectangle of a global tensor.

Every parameter and AdamW moment is a piece of a *global* tensor of the single-process model
(``axon4d.layout.param_layout``; fused q|k|v and gate|up are saved as their parts). ``rank_state`` lists a
rank's pieces as it stores them, cut into rectangles of the global tensors (``ParamLayout.boxes``),
each with the view of the rank's storage that holds it (nothing is copied); a ZeRO optimizer's
parts (``axon4d.zero``) are cut further to the rows of this data rank's part (``_owned_views``).
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from axon4d import device as devices
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import AXES, GridAxis
from axon4d.layout.param_layout import Box, ParamLayout, param_layouts
from axon4d.zero import ShardedOptimizer, settle

MOMENTS = ("exp_avg", "exp_avg_sq")
Piece = tuple[Box, torch.Tensor]  # a rectangle of a saved tensor, and the view of this rank's storage holding it


def chunk(box: Box) -> dcp.ChunkStorageMetadata:
    """DCP's description of ``box``: its offsets and sizes in the saved tensor."""
    return dcp.ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes))


class State(NamedTuple):
    """What a save writes or a load fills."""

    parts: list[Piece]  # of every parameter and AdamW moment: views of this rank's storage
    steps: dict[str, torch.Tensor]  # the optimizer's step counts and MoE balancing biases: DCP's own state dict
    made: list[tuple[torch.Tensor, str, torch.Tensor]]  # (state key, key, tensor) a load puts in optimizer.state
    pads: list[torch.Tensor]  # the z padding past each flat shard's pieces: zeroed by a load


def rank_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, grid: Grid, load: bool) -> State:
    """The pieces of ``model``'s parameters (model.<name>[.<segment>]) and ``optimizer``'s moments
    (optim.<name>.<moment>[.<segment>]); a load makes those the optimizer lacks (zeros like the parameter).
    A ZeRO optimizer (``axon4d.zero``) holds the moments of this data rank's part of each parameter
    only: its pieces are that part's rectangles of the global tensors (``_owned_views``); so are the
    model's pieces of a parameter whose fp32 master is a copy (a 16-bit weight,
    ``ShardedOptimizer.master_copy``): the master, not the rounded parameter, is saved and loaded.

    A save lists only the pieces this rank writes: of the ranks holding the same piece (those that
    differ from it only along the axes the piece is replicated over, ``replicated_axes``) one
    writes it (``writes``), and one rank of the world each step count; a load lists every piece.

    The all-gathers over data a sharded step left in flight (``overlap_gathers``) are completed
    first: a save reads whole parameters, and a load's writes are not overwritten by a late gather."""
    settle(grid)
    layouts = param_layouts(model)
    state = State([], {}, [], [])
    sharded = optimizer if isinstance(optimizer, ShardedOptimizer) else None
    for name, p in model.named_parameters():
        owned = sharded.owned(p) if sharded is not None else None
        key = owned[1] if owned is not None else p  # what the optimizer keeps p's state under: p, or its part
        master = sharded.master_copy(p) if sharded is not None else None
        tensors: list[tuple[str, torch.Tensor]] = [(f"model.{name}", p if master is None else master)]
        st = optimizer.state.get(key, {}) if optimizer is not None else {}
        for moment in MOMENTS if optimizer is not None else ():
            t = st.get(moment)
            if load and not (isinstance(t, torch.Tensor) and t.shape == key.shape and t.device == key.device):
                t = torch.zeros_like(key, memory_format=torch.contiguous_format)
                state.made.append((key, moment, t))
            if isinstance(t, torch.Tensor):
                tensors.append((f"optim.{name}.{moment}", t))
        for prefix, t in tensors:
            start = owned[0] if owned is not None and t is not p else None  # t: elements [start, start + t.numel())
            if start is not None:  # of this rank's part
                mine, covered = _owned_views(layouts[name], prefix, p.numel(), start, t, grid)
            else:
                mine = layouts[name].views(prefix, t, grid)
                covered = sum(v.numel() for _, v in mine)
            if load or writes(prefix, grid, replicated_axes(layouts[name], part=start is not None)):
                state.parts.extend(mine)
            state.pads.append(t.detach().view(-1)[covered:])
        if optimizer is not None and (load or writes(f"optim.{name}.step", grid, AXES)):
            step = torch.zeros(()) if load else torch.as_tensor(st.get("step", 0.0), dtype=torch.float32)
            state.steps[f"optim.{name}.step"] = step = step.to(_step_device(optimizer, key), copy=True)
            state.made.extend([(key, "step", step)] if load else [])
    for name, b in model.named_buffers():
        # an MoE layer's balancing bias (E,): whole and alike on every rank, written by one, read in place by all
        if name.endswith("expert_bias") and (load or writes(f"model.{name}", grid, AXES)):
            state.steps[f"model.{name}"] = b
    return state


def replicated_axes(layout: ParamLayout, part: bool) -> tuple[GridAxis, ...]:
    """The axes along which every rank holds the same pieces of a tensor laid out as ``layout``:
    those it is replicated over, less data for a tensor of a ZeRO part (each data rank's own)."""
    return tuple(a for a in layout.replicated_over() if not (part and a == "data"))


def writes(key: str, grid: Grid, axes: tuple[GridAxis, ...]) -> bool:
    """Whether this rank writes its pieces of saved tensor ``key``, which the ranks differing from
    it only along ``axes`` hold alike: one of them does, the one at index crc32(key) mod their
    number (row-major over ``axes``), so the tensors' writes spread over the replicas and every
    rank names the same writer without a collective."""
    index, count = place(grid, axes)
    return index == writer(key, count)


def place(grid: Grid, axes: tuple[GridAxis, ...]) -> tuple[int, int]:
    """(this rank's index among the ranks differing from it only along ``axes``, row-major over
    ``axes``; their number)."""
    index, count = 0, 1
    for axis in axes:
        index, count = index * grid.size(axis) + grid.coord(axis), count * grid.size(axis)
    return index, count


def writer(key: str, count: int) -> int:
    """The index (``place``) of the one of ``count`` ranks holding ``key`` alike that writes it."""
    return zlib.crc32(key.encode()) % count


def _owned_views(
    layout: ParamLayout, prefix: str, numel: int, start: int, t: torch.Tensor, grid: Grid
) -> tuple[list[Piece], int]:
    """The pieces of ``t``, which holds elements [start, start + t.numel()) of this rank's flat
    stored piece of ``numel`` elements (a ZeRO part): each box of the piece (``ParamLayout.boxes``)
    cut to that range — a run of whole rows, and partial rows at either end — with views of ``t``;
    and how many of ``t``'s elements they cover (the rest is z padding)."""
    stop = start + t.numel()
    flat = t.detach().view(-1)  # (stop - start,)
    out: list[Piece] = []
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


def _step_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.device:
    """Where ``optimizer`` keeps ``p``'s step count: where it is already, else as torch.optim puts it
    (on the parameter's device for fused or capturable AdamW, in host memory otherwise)."""
    step = optimizer.state.get(p, {}).get("step")
    if isinstance(step, torch.Tensor):
        return step.device
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    return p.device if group.get("fused") or group.get("capturable") else devices.HOST
