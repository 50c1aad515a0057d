"""Rows moved over one grid axis, differentiably (docs/moe.md, E16–E17): this rank's share of
rows replicated over an axis (``share_rows``), the shares gathered back (``gather_rows``), partial
sums reduce-scattered by share (``scatter_rows``), a tensor used alike on every rank of an axis
(``use_replicated``), and one all-to-all between rows split by features and split by rows over x
(``features_to_rows``/``rows_to_features``). Each forward collective's reverse runs in backward.
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term


def _gather_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """Every rank's ``x`` of ``sizes[i]`` rows (its index i on ``axis``) stacked in index order:
    one all-gather of blocks padded to the largest."""
    most = max(sizes)
    padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    whole = grid.comm.all_gather(padded.contiguous(), axis, tag=tag).wait()  # (G·most, …)
    if all(n == most for n in sizes):  # no padding to drop: the gathered blocks are the result
        return whole
    return torch.cat([whole[i * most : i * most + n] for i, n in enumerate(sizes)])


def _scatter_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """This rank's block of the rows of ``Σ_axis x`` (``x``: each rank's partial sum of every block,
    blocks of ``sizes`` back to back): one reduce-scatter of blocks padded to the largest, half the
    bytes of an all-reduce."""
    most, start = max(sizes), 0
    padded = x.new_zeros((len(sizes) * most, *x.shape[1:]))  # (G·most, …): block i at i·most
    for i, n in enumerate(sizes):
        padded[i * most : i * most + n] = x[start : start + n]
        start += n
    mine = grid.comm.reduce_scatter(padded, axis, tag=tag).wait()  # (most, …)
    return mine[: sizes[grid.coord(axis)]]


def _own_rows(x: torch.Tensor, sizes: list[int], index: int) -> torch.Tensor:
    """Rows of index ``index``'s block of ``x`` (blocks of ``sizes`` back to back)."""
    start = sum(sizes[:index])
    return x[start : start + sizes[index]]


class _ShareRows(torch.autograd.Function):
    """Forward: this rank's block of rows of a tensor replicated over ``axis`` (local). Backward:
    every rank's block of the gradient gathered over ``axis`` (each block's gradient is its own rank's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid, ctx.tag = sizes, axis, grid, tag
        return _own_rows(x, sizes, grid.coord(axis)).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.axis, ctx.grid, ctx.tag), None, None, None, None


def share_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term = Term.MOE_ROWS_Y) -> torch.Tensor:
    """This rank's block of ``x``'s rows (blocks of ``sizes`` over ``axis``); gathered in backward
    (under ``tag``)."""
    return x if grid.size(axis) == 1 else _ShareRows.apply(x, sizes, axis, grid, tag)


class _ScatterRows(torch.autograd.Function):
    """Forward: ``x``'s rows summed over ``axis`` (each rank holds a partial sum of all of them), and
    this rank's block kept — one reduce-scatter of blocks padded to the largest, half the bytes of
    an all-reduce. Backward: every rank's block of the gradient gathered over ``axis`` (the sum's
    gradient is the same on every rank's partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid = sizes, axis, grid
        return _scatter_rows(x, sizes, axis, grid, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.axis, ctx.grid, Term.MOE_ROWS_Y), None, None, None, None


def scatter_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """This rank's block of the rows of ``Σ_axis x`` (blocks of ``sizes`` over ``axis``; ``x`` is
    each rank's partial sum of every block): a reduce-scatter (``tag``), gathered in backward."""
    return x if grid.size(axis) == 1 else _ScatterRows.apply(x, sizes, axis, grid, tag)


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's block of rows gathered over ``axis`` (E17). Backward: this rank's
    block of the gradient — summed over ``axis`` when the ranks used the whole apart (``summed``:
    each computed a partial gradient, e.g. of its own output features), in one reduce-scatter of
    padded blocks: each rank receives the sum of its own block only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, summed: bool) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid, ctx.summed = sizes, axis, grid, summed
        return _gather_rows(x, sizes, axis, grid, Term.MOE_ROWS_Y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if ctx.summed:
            return _scatter_rows(g, ctx.sizes, ctx.axis, ctx.grid, Term.MOE_ROWS_Y_GRAD), None, None, None, None
        return _own_rows(g, ctx.sizes, ctx.grid.coord(ctx.axis)).contiguous(), None, None, None, None


def gather_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, summed: bool) -> torch.Tensor:
    """Every rank's block of rows (``sizes`` over ``axis``) stacked; see ``_GatherRows`` for ``summed``."""
    return x if grid.size(axis) == 1 else _GatherRows.apply(x, sizes, axis, grid, summed)


class _UseReplicated(torch.autograd.Function):
    """Identity forward for a tensor every rank of ``axis`` holds alike and uses for its own part;
    backward: the partial gradients summed over ``axis`` (Megatron's "f")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
        ctx.axis, ctx.grid, ctx.tag = axis, grid, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return ctx.grid.comm.all_reduce(g.contiguous().clone(), ctx.axis, tag=ctx.tag).wait(), None, None, None


def use_replicated(x: torch.Tensor, axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """``x`` as it is; its gradient is summed over ``axis`` (all-reduce in backward, under ``tag``)."""
    return x if grid.size(axis) == 1 else _UseReplicated.apply(x, axis, grid, tag)


def _transpose(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, to_rows: bool, tag: Term) -> torch.Tensor:
    """One all-to-all over ``axis`` between two layouts of the same rows: split by features — every
    rank of ``axis`` holds all Σ``sizes`` rows, its 1/G of the columns — and split by rows — rank i
    holds block i of ``sizes[i]`` rows, every column. ``to_rows``: the first to the second."""
    g, i = grid.size(axis), grid.coord(axis)
    if to_rows:  # (Σ sizes, c) → (sizes[i], G·c)
        got = grid.comm.all_to_all(x.contiguous(), axis, sizes, [sizes[i]] * g, tag=tag).wait()  # (G·n_i, c)
        return got.view(g, sizes[i], -1).transpose(0, 1).reshape(sizes[i], -1)
    c = x.shape[-1] // g  # (sizes[i], G·c) → (Σ sizes, c)
    parts = x.view(sizes[i], g, c).transpose(0, 1).contiguous().view(g * sizes[i], c)
    return grid.comm.all_to_all(parts, axis, [sizes[i]] * g, sizes, tag=tag).wait()


class _Transposed(torch.autograd.Function):
    """Forward: ``_transpose`` one way; backward: the other way (the gradient has the output's layout)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, to_rows: bool) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid, ctx.to_rows = sizes, axis, grid, to_rows
        return _transpose(x, sizes, axis, grid, to_rows, Term.MOE_ROWS_X)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        back = _transpose(g.contiguous(), ctx.sizes, ctx.axis, ctx.grid, not ctx.to_rows, Term.MOE_ROWS_X_GRAD)
        return back, None, None, None, None


def features_to_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid) -> torch.Tensor:
    """(Σ sizes, c) rows whose columns are split over ``axis`` → this rank's block of ``sizes[i]``
    rows with every column, (sizes[i], G·c): an all-to-all over ``axis`` (E16: the move over x), reversed in backward."""
    return x if grid.size(axis) == 1 else _Transposed.apply(x, sizes, axis, grid, True)


def rows_to_features(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid) -> torch.Tensor:
    """The inverse of ``features_to_rows``: (sizes[i], G·c) → (Σ sizes, c)."""
    return x if grid.size(axis) == 1 else _Transposed.apply(x, sizes, axis, grid, False)
