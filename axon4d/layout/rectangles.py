"""Where a rank's part of a global tensor lies in it: rectangles of the global tensor.

Every parameter is a piece of a *global* tensor, the one the single-process model holds
(axon4d.layout.param_layout). Building or loading a model that never fits on one host means filling each
rank's piece straight from its source — a seeded initialisation (axon4d.layout.tiled_init) or a
checkpoint — without ever holding the global tensor. This module says which elements of the global
tensor a piece holds, as plain data (docs/design.md §2):

- **Rectangles.** A global tensor is seen as a matrix (``matrix_shape``): dim 0 are its rows, the
  other dims flattened its columns (a vector is one column). A rank's piece is the flat, row-major
  range ``[start, stop)`` of its block (an axon4d.Linear's z shard, §2; the whole block otherwise);
  ``pieces`` cuts that range into at most three rectangles per row source (a partial first row,
  whole rows, a partial last row), each landing contiguously in the local tensor. The block's rows
  may come from several global tensors (``Rows``): the fused q|k|v and gate|up layers, or a row
  permutation (GPT-2's packed q|k|v), are runs of rows of their sources.
- **Fused rows.** ``FusedRows`` is the one description of a fused layer's rows — q | k | v
  (attention, GPT-2's packed c_attn) or gate | up (SwiGLU) interleaved by y group: the permutation,
  fusing and splitting back, a rank's chunk per segment, and its rows in each segment's tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn


def matrix_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """A global tensor seen as a matrix: (dim 0, product of the other dims); a vector is one column."""
    shape = tuple(shape)
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows [start, start + count) of a block are rows [row0, row0 + count) of global matrix ``name``."""

    start: int
    count: int
    name: str
    shape: tuple[int, int]
    row0: int


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """The rows (dim 0) of a fused layer: several global tensors stacked — ``segments``, q | k | v or
    gate | up — and permuted so that each of the ``groups`` equal chunks the splitting axis gives a
    rank holds its chunk of every segment: [a_0 | b_0 | … | a_1 | b_1 | …] (docs/design.md §2).

    Everything about such rows lives here: the permutation (``order``) and its inverse, fusing
    the segments' dense tensors (``fuse``, ``fuse_dense``), splitting full fused rows back into
    them (``split``, ``split_into_``: a layer's ``to_dense``), a rank's chunk seen per segment
    (``local``), and where that chunk's rows lie in each segment's own tensor (``sources``: the
    rectangles of checkpoints and sharded initialisation, axon4d.layout.param_layout)."""

    segments: tuple[tuple[str, int], ...]
    """(name, global rows) of each stacked tensor, in stacking order."""
    groups: int
    """Chunks dim 0 is split into (G_y of a normal layer); each segment's rows divide by it."""

    def __post_init__(self) -> None:
        uneven = [f"{name} ({rows} rows)" for name, rows in self.segments if self.groups < 1 or rows % self.groups]
        if not self.segments or uneven:
            raise ValueError(
                f"fused rows {self.segments}: every segment must split into {self.groups} equal chunks; "
                f"{', '.join(uneven) or 'no segment is given'}"
            )

    @property
    def local_rows(self) -> list[int]:
        """Rows of each segment in one chunk (a rank's block), in segment order."""
        return [rows // self.groups for _, rows in self.segments]

    def order(self) -> torch.Tensor:
        """The permutation: fused row i is row ``order()[i]`` of the segments stacked (torch.cat)."""
        starts = [0]
        for _, rows in self.segments:
            starts.append(starts[-1] + rows)
        return torch.cat(
            [
                torch.arange(start + j * n, start + (j + 1) * n)
                for j in range(self.groups)
                for start, n in zip(starts, self.local_rows)
            ]
        )

    def fuse(self, stacked: torch.Tensor) -> torch.Tensor:
        """The fused rows of ``stacked`` (the segments concatenated along dim 0, in order)."""
        return stacked[self.order()]

    def unfuse(self, fused: torch.Tensor) -> torch.Tensor:
        """The segments concatenated along dim 0 from full ``fused`` rows (the inverse of ``fuse``)."""
        return fused[torch.argsort(self.order())]

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Full ``fused`` rows back as each segment's own tensor, in segment order."""
        return self.unfuse(fused).split([rows for _, rows in self.segments])

    def local(self, chunk: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
        """A rank's ``chunk`` of the fused rows (along ``dim``) as each segment's part: views, no copy."""
        return chunk.split(self.local_rows, dim)

    def fuse_dense(self, layers: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused (weight, bias) of the segments' dense linear layers (bias None where they have none)."""
        weight = self.fuse(torch.cat([layer.weight for layer in layers]))
        if layers[0].bias is None:
            return weight, None
        return weight, self.fuse(torch.cat([layer.bias for layer in layers]))

    @torch.no_grad()
    def split_into_(self, fused: nn.Module, layers: list[nn.Module], grads: bool = False) -> None:
        """Copy the full fused linear layer ``fused`` into the segments' dense ``layers`` (in segment
        order): weight and bias, and with ``grads`` their ``.grad``."""
        for attr in ("weight", "bias"):
            t = getattr(fused, attr)
            if t is None:
                continue
            for part, layer in zip(self.split(t.detach()), layers):
                getattr(layer, attr).copy_(part)
            if grads and t.grad is not None:
                for part, layer in zip(self.split(t.grad), layers):
                    getattr(layer, attr).grad = part.clone()

    def sources(self, group: int, cols: int, name: Callable[[str], str]) -> list[Rows]:
        """Chunk ``group`` of the fused rows (the block of the rank at that index of the splitting
        axis) as a run of rows of each segment's own global matrix (its rows, ``cols``), named
        ``name(segment)``."""
        out, start = [], 0
        for (seg, rows), n in zip(self.segments, self.local_rows):
            out.append(Rows(start, n, name(seg), (rows, cols), group * n))
            start += n
        return out


@dataclasses.dataclass(frozen=True)
class Piece:
    """A rectangle of global matrix ``name`` and the offset where it lands, row-major and
    contiguous, in a rank's flat local tensor."""

    name: str
    shape: tuple[int, int]
    row0: int
    col0: int
    rows: int
    cols: int
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(start, count, first value) of each run of consecutive values in ``rows``."""
    out: list[tuple[int, int, int]] = []
    for k, r in enumerate(rows):
        if out and r == out[-1][2] + out[-1][1]:
            start, count, first = out[-1]
            out[-1] = (start, count + 1, first)
        else:
            out.append((k, 1, r))
    return out


def pieces(sources: list[Rows], col0: int, width: int, start: int, stop: int) -> list[Piece]:
    """The rectangles making up elements [start, stop) of a block stored row-major, ``width``
    columns wide (global columns [col0, col0 + width)) and whose rows come from ``sources``;
    offsets are relative to ``start``."""
    out: list[Piece] = []
    if stop <= start:
        return out
    first, last = start // width, (stop - 1) // width  # block rows touched
    spans = []  # (block row, rows, first col in block, cols): partial first row, whole rows, partial last row
    if first == last:
        spans.append((first, 1, start - first * width, stop - start))
    else:
        spans.append((first, 1, start - first * width, (first + 1) * width - start))
        if last > first + 1:
            spans.append((first + 1, last - first - 1, 0, width))
        spans.append((last, 1, 0, stop - last * width))
    for row, count, c0, cols in spans:
        for src in sources:  # split the span at the sources' row boundaries
            lo, hi = max(row, src.start), min(row + count, src.start + src.count)
            if lo >= hi:
                continue
            offset = lo * width + c0 - start
            out.append(Piece(src.name, src.shape, src.row0 + lo - src.start, col0 + c0, hi - lo, cols, offset))
    covered = sum(p.numel for p in out)
    if covered != stop - start:
        raise ValueError(f"the row sources cover {covered} of the {stop - start} elements asked for")
    return out
