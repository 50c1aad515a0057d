"""How each parameter of a model is laid out on the grid, in one table.

Every parameter is a piece of a *global* tensor (the one the single-process model holds). A
``ParamLayout`` says which tensor dim each grid axis splits, whether the piece is stored as a flat
z-shard of its (x, y) block (axon4d.Linear weights, docs/design.md §2), and over which axes the piece is
replicated. Checkpoints use it to save each rank's piece as it is stored, as rectangles of the
global tensors (``ParamLayout.boxes``), and to load them onto any other grid; the whole-model
gradient operations (axon4d.grads) use it to count every element exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import AXES, Axis, GridAxis
from axon4d.layout import geometry
from axon4d.layout.rectangles import FusedRows, Piece, Rows, matrix_shape, pieces
from axon4d.nn.embedding import PositionEmbedding, VocabParallelEmbedding
from axon4d.nn.linear import Linear
from axon4d.nn.moe import Router
from axon4d.nn.moe_experts import GridExperts
from axon4d.nn.norm import SplitFeatureNorm


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangle of a tensor a checkpoint saves, held by one rank."""

    key: str
    """The saved tensor: a parameter-shaped tensor's prefix, or ``<prefix>.<segment>`` of fused rows."""
    shape: tuple[int, ...]
    """The saved tensor's (global) shape."""
    offsets: tuple[int, ...]
    """Where the rectangle lies in it (one offset per dim)."""
    sizes: tuple[int, ...]
    """The rectangle's shape."""
    start: int
    """Where the rectangle begins, row-major and contiguous, in the rank's flat stored piece."""


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one parameter's local piece sits in its global tensor."""

    global_shape: tuple[int, ...]
    """Shape of the full tensor of the single-process model."""
    split: tuple[tuple[GridAxis, int], ...] = ()
    """(axis, dim) pairs: the grid axis splits that tensor dim into equal contiguous chunks."""
    z_flat: bool = False
    """Stored as this rank's flat, zero-padded 1/G_z of the block: an axon4d.Linear weight, whose
    block and z shards are the layer's own (``geometry.weight_block_shape``, ``geometry.z_shard``)."""
    fused: FusedRows | None = None
    """Dim 0 of the global tensor is really several tensors stacked (fused q|k|v, gate|up) whose
    chunks are interleaved by the axis splitting dim 0. A checkpoint stores each segment as its own
    tensor, so it does not depend on the grid that wrote it."""
    transpose: bool = False
    """For an axon4d.Linear's weight or bias: the layer is transposed (``geometry.layer_axes``)."""

    @classmethod
    def linear(cls, layer: Linear, name: str) -> ParamLayout:
        """The layout of ``layer``'s parameter ``name`` ("weight" or "bias"): output features
        split over the layer's output axis, input features over its input axis (docs/design.md §2)."""
        in_axis, out_axis = geometry.layer_axes(layer.transpose)
        fused = layer.fused_rows
        if name == "weight":
            return cls(
                (layer.out_features, layer.in_features),
                ((out_axis, 0), (in_axis, 1)),
                z_flat=True,
                fused=fused,
                transpose=layer.transpose,
            )
        return cls((layer.out_features,), ((out_axis, 0),), fused=fused, transpose=layer.transpose)

    def block_shape(self, grid: Grid) -> tuple[int, ...]:
        """Shape of this rank's (x, y) block of the global tensor."""
        if self.z_flat:  # a Linear weight (out, in): the block the layer holds
            out_features, in_features = self.global_shape
            return geometry.weight_block_shape(in_features, out_features, grid.shape, self.transpose)
        shape = list(self.global_shape)
        for axis, dim in self.split:
            shape[dim] //= grid.size(axis)
        return tuple(shape)

    def block_offsets(self, grid: Grid) -> tuple[int, ...]:
        """Offset of this rank's block in the global tensor."""
        offsets = [0] * len(self.global_shape)
        block = self.block_shape(grid)
        for axis, dim in self.split:
            offsets[dim] = grid.coord(axis) * block[dim]
        return tuple(offsets)

    def replicated_over(self) -> tuple[GridAxis, ...]:
        """Axes over which every rank holds the same piece."""
        used = {a for a, _ in self.split} | ({"z"} if self.z_flat else set())
        return tuple(a for a in AXES if a not in used)

    def saved_tensors(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """{key: global shape} of the tensors a checkpoint stores this parameter as: ``prefix``, or
        ``prefix.<segment>`` for each segment of fused rows."""
        if self.fused is None:
            return {prefix: self.global_shape}
        return {f"{prefix}.{name}": (rows, *self.global_shape[1:]) for name, rows in self.fused.segments}

    def boxes(self, prefix: str, numel: int, grid: Grid) -> list[Box]:
        """The rectangles of the saved tensors (``saved_tensors(prefix)``) that this rank's stored
        piece of ``numel`` elements holds, each contiguous in it; z padding lies in none."""
        shapes = self.saved_tensors(prefix)
        named = self.rectangles(numel, grid, lambda segment: f"{prefix}.{segment}" if segment else prefix)
        return [_box(shapes[p.name], p) for p in named]

    def rectangles(self, numel: int, grid: Grid, name: Callable[[str], str]) -> list[Piece]:
        """This rank's stored piece of ``numel`` elements as rectangles of global matrices, each
        contiguous in it (``axon4d.layout.rectangles.pieces``, runs of whole rows merged); z padding lies in none. The
        global tensor is named ``name("")``, or each segment's own ``name(segment)`` for fused rows:
        ``boxes`` names them as a checkpoint saves them, axon4d.materialize as the dense model does."""
        block = self.block_shape(grid)
        rows, cols = matrix_shape(block)
        offsets = self.block_offsets(grid)
        row0, global_cols = offsets[0] if offsets else 0, matrix_shape(self.global_shape)[1]
        if self.fused is None:
            sources = [Rows(0, rows, name(""), matrix_shape(self.global_shape), row0)]
        else:  # fused rows: a run of rows of each segment's own tensor
            sources = self.fused.sources(row0 // rows, global_cols, name)
        start, stop = 0, rows * cols
        if self.z_flat:  # this rank's flat z shard of the block; past the block's end it is padding
            start = grid.coord("z") * numel
            stop = min(start + numel, rows * cols)
        merged: list[Piece] = []
        for p in pieces(sources, offsets[1] if len(offsets) > 1 else 0, cols, start, stop):
            last = merged[-1] if merged else None
            if (  # whole rows of the same tensor, following on: one rectangle
                last is not None
                and last.name == p.name
                and last.cols == p.cols == cols
                and (last.row0 + last.rows, last.offset + last.numel) == (p.row0, p.offset)
            ):
                merged[-1] = dataclasses.replace(last, rows=last.rows + p.rows)
            else:
                merged.append(p)
        return merged

    def views(self, prefix: str, t: torch.Tensor, grid: Grid) -> list[tuple[Box, torch.Tensor]]:
        """Each of ``boxes`` of this rank's stored ``t`` (the parameter, or a tensor of its shape such
        as an AdamW moment) with the view of ``t`` that holds it: no copy."""
        block = math.prod(self.block_shape(grid))
        if not t.is_contiguous() or (not self.z_flat and t.numel() != block):
            raise ValueError(
                f"{prefix} is a {'' if t.is_contiguous() else 'non-contiguous '}tensor of {t.numel()} elements; this "
                f"rank's piece is a contiguous block of {block} elements or a Linear's flat z shard: pass the module's "
                "own parameter, or a tensor made like it (torch.zeros_like)"
            )
        flat = t.detach().view(-1)  # (numel,)
        return [
            (b, flat[b.start : b.start + math.prod(b.sizes)].view(b.sizes)) for b in self.boxes(prefix, t.numel(), grid)
        ]


def _box(shape: tuple[int, ...], p: Piece) -> Box:
    """Matrix rectangle ``p`` of the saved tensor of ``shape``, in that tensor's dims."""
    if len(shape) == 2:
        return Box(p.name, shape, (p.row0, p.col0), (p.rows, p.cols), p.offset)
    if len(shape) == 0:  # a scalar: one element
        return Box(p.name, shape, (), (), p.offset)
    if p.col0 != 0 or p.cols != math.prod(shape[1:]):
        raise ValueError(
            f"{p.name} of shape {shape}: its piece is columns {p.col0}..{p.col0 + p.cols} of the flattened trailing "
            "dims; a layout may split only dims 0 and 1 of a tensor of more than two dims"
        )
    return Box(p.name, shape, (p.row0, *[0] * (len(shape) - 1)), (p.rows, *shape[1:]), p.offset)


@dataclasses.dataclass(frozen=True)
class ExpertWeightLayout(ParamLayout):
    """A stacked expert weight of an MoE layer (axon4d.nn.moe, docs/moe.md): global (E, rows, cols),
    dim 0 split over the layer's expert-parallel axis ``ep_axis`` (None: every rank holds every
    expert), rows over ``row_axis`` and columns over ``col_axis`` where the expert layout splits
    experts over them (``axon4d.grid.expert_layout``) — up: (E, f, hidden) over (y, x); down:
    (E, hidden, f) over (x, y). A gated up weight stores [gate_j | up_j] per y chunk, saved as the
    two tensors ``<prefix>.gate`` and ``<prefix>.up`` (``segments``). Replicated over the layout's
    expert data-parallel axes ``dp``."""

    row_axis: GridAxis = "y"
    col_axis: GridAxis = "x"
    segments: tuple[str, ...] = ()
    ep_axis: Axis | None = "batch"
    tp: tuple[GridAxis, ...] = ("x", "y")
    dp: tuple[GridAxis, ...] = ()

    @classmethod
    def of(cls, experts: GridExperts, name: str) -> ExpertWeightLayout:
        e, h, f = experts.n_experts, experts.hidden, experts.ffn
        ep, tp, dp = experts.ep_axis, experts.layout.tp, experts.layout.dp
        if name == "down":
            return cls((e, h, f), row_axis="x", col_axis="y", ep_axis=ep, tp=tp, dp=dp)
        return cls((e, f, h), segments=("gate", "up") if experts.gated else (), ep_axis=ep, tp=tp, dp=dp)

    def _size(self, grid: Grid, axis: GridAxis) -> int:
        return grid.size(axis) if axis in self.tp else 1

    def _coord(self, grid: Grid, axis: GridAxis) -> int:
        return grid.coord(axis) if axis in self.tp else 0

    def block_shape(self, grid: Grid) -> tuple[int, ...]:
        e, rows, cols = self.global_shape
        g_ep = grid.size(self.ep_axis) if self.ep_axis else 1
        local = (e // g_ep, rows // self._size(grid, self.row_axis), cols // self._size(grid, self.col_axis))
        return (local[0], local[1] * max(len(self.segments), 1), local[2])

    def block_offsets(self, grid: Grid) -> tuple[int, ...]:
        e, rows, cols = self.block_shape(grid)
        rows //= max(len(self.segments), 1)
        first = grid.coord(self.ep_axis) * e if self.ep_axis else 0
        return (first, self._coord(grid, self.row_axis) * rows, self._coord(grid, self.col_axis) * cols)

    def replicated_over(self) -> tuple[GridAxis, ...]:
        return self.dp

    def saved_tensors(self, prefix: str) -> dict[str, tuple[int, ...]]:
        if not self.segments:
            return {prefix: self.global_shape}
        return {f"{prefix}.{s}": self.global_shape for s in self.segments}

    def boxes(self, prefix: str, numel: int, grid: Grid) -> list[Box]:
        block, offsets = self.block_shape(grid), self.block_offsets(grid)
        if not self.segments:
            return [Box(prefix, self.global_shape, offsets, block, 0)]
        rows = block[1] // len(self.segments)
        out, start = [], 0
        for e in range(block[0]):
            for s in self.segments:
                out.append(
                    Box(f"{prefix}.{s}", self.global_shape, (offsets[0] + e, *offsets[1:]), (1, rows, block[2]), start)
                )
                start += rows * block[2]
        return out

    def rectangles(self, numel: int, grid: Grid, name: Callable[[str], str]) -> list[Piece]:
        """This rank's experts as rectangles of the stacked tensors drawn as (E·rows, cols) matrices
        (``tiled_init.init_shape``): one per local expert (and segment, the gated up weight's
        ``<tensor>.gate`` and ``.up`` beside ``name("")``), each contiguous in the stored piece."""
        local, rows, cols = self.block_shape(grid)
        rows //= max(len(self.segments), 1)
        first, row0, col0 = self.block_offsets(grid)
        e, g_rows, g_cols = self.global_shape
        base = name("")
        out, start = [], 0
        for i in range(local):
            for segment in self.segments or ("",):
                tensor = f"{base.rpartition('.')[0]}.{segment}" if segment else base
                out.append(Piece(tensor, (e * g_rows, g_cols), (first + i) * g_rows + row0, col0, rows, cols, start))
                start += rows * cols
        return out


def layout_of(module: nn.Module, name: str, param: torch.Tensor) -> ParamLayout:
    """The layout of ``module``'s parameter ``name`` (fully replicated unless the module is ours)."""
    if isinstance(module, Linear):
        return ParamLayout.linear(module, name)
    if isinstance(module, SplitFeatureNorm):
        return ParamLayout((module.hidden,), ((module.axis, 0),))
    if isinstance(module, VocabParallelEmbedding):
        return ParamLayout((module.vocab_size, module.hidden), (("y", 0), ("x", 1)))
    if isinstance(module, Router):
        return ParamLayout((module.n_experts, module.hidden), (("x", 1),))
    if isinstance(module, GridExperts):
        return ExpertWeightLayout.of(module, name)
    if isinstance(module, PositionEmbedding):
        return ParamLayout((module.seq_len, module.hidden), (("x", 1),))
    return ParamLayout(tuple(param.shape))


def param_layouts(model: nn.Module) -> dict[str, ParamLayout]:
    """``{qualified parameter name: layout}`` for every parameter of ``model``."""
    out = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            out[f"{mod_name}.{p_name}" if mod_name else p_name] = layout_of(module, p_name, p)
    return out
