"""Differentiable collectives and gradient synchronisation for modules built on the grid.

The 3D Linear hides its own communication (docs/design.md §2); the modules around it — norms over
sharded features, the vocabulary-parallel embedding and loss — need a few collectives inside
autograd. Each is a tiny ``torch.autograd.Function`` that calls the communication layer.

Naming follows the role of the result:
- ``sum_partials``: every rank holds a partial sum and uses the total for *its own* features, so
  the backward sums the incoming gradients too (all-reduce forward and backward).
- ``sum_to_replicas``: partial sums whose total is then used *identically* on every rank of the
  axis (replicated), so the gradient flowing back is already complete (all-reduce forward,
  identity backward) — Megatron's "g".
- ``split_replicated``: an input replicated over the axis, of which each rank keeps its own chunk
  of features; each rank's gradient is exact for its chunk only (local slice forward, all-gather
  backward).
- ``gather_replicated``: every rank's chunk of features, gathered into a result every rank of the
  axis uses identically (all-gather forward, local slice backward).
- ``gather_shared``: every rank's part gathered into a whole that each rank of the axis then uses
  in its own way (context parallelism: every rank's queries read the gathered keys), so each part's
  gradient is the sum over the axis of the gradients reaching the whole (all-gather forward,
  reduce-scatter backward).

``split_replicated``/``gather_replicated`` are the differentiable counterparts of
``axon4d.activations.shard_features``/``gather_features``, which move tensors outside autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term


def _summed(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid, tag: Term | str, reuse: bool) -> torch.Tensor:
    """Σ over ``axis`` of ``x``: in place when ``reuse`` says nothing else reads ``x`` (marked dirty
    for autograd), else of a copy."""
    if reuse and x.is_contiguous():
        ctx.mark_dirty(x)
        return grid.comm.all_reduce(x, axis, tag=tag).wait()
    return grid.comm.all_reduce(x.contiguous().clone(), axis, tag=tag).wait()


class _SumPartials(torch.autograd.Function):
    """All-reduce over an axis, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid, reuse: bool) -> torch.Tensor:
        ctx.axis, ctx.grid = axis, grid
        return _summed(ctx, x, axis, grid, f"sum_partials.{axis}", reuse)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # the incoming gradient may be shared with other branches of the graph: reduce a copy
        summed = ctx.grid.comm.all_reduce(g.contiguous().clone(), ctx.axis, tag=f"sum_partials.bwd.{ctx.axis}").wait()
        return summed, None, None, None


class _SumToReplicas(torch.autograd.Function):
    """All-reduce over an axis forward; identity backward (the result is used replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid, tag: Term | str, reuse: bool) -> torch.Tensor:
        return _summed(ctx, x, axis, grid, tag, reuse)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return g, None, None, None, None


def sum_partials(x: torch.Tensor, axis: Axis, grid: Grid, in_place: bool = False) -> torch.Tensor:
    """Σ over ``axis`` of every rank's ``x``; gradients are summed over ``axis`` as well.
    ``in_place``: ``x`` is a temporary nothing else reads (not saved for backward, not used
    again): it is summed in place, no copy."""
    if grid.size(axis) == 1:
        return x
    return _SumPartials.apply(x, axis, grid, in_place)


def sum_to_replicas(
    x: torch.Tensor, axis: Axis, grid: Grid, tag: Term | None = None, in_place: bool = False
) -> torch.Tensor:
    """Σ over ``axis`` of every rank's ``x``, for a result every rank of ``axis`` uses identically
    (``tag``: the collective's name in the comm log, ``sum_to_replicas.<axis>`` when None;
    ``in_place``: as for ``sum_partials``)."""
    if grid.size(axis) == 1:
        return x
    return _SumToReplicas.apply(x, axis, grid, f"sum_to_replicas.{axis}" if tag is None else tag, in_place)


def average_grad_over_batch(param: nn.Parameter, grid: Grid, tag: Term = Term.REPLICATED_GRAD) -> None:
    """Make ``param``'s gradient the DDP average over batch = data × z (as E13 does for a bias),
    all-reduced under ``tag`` (the embedding's, a norm's: their own ``Term``).

    For a parameter every rank of the batch axis holds a copy of (norm weights, embeddings). The
    grid's scheduler reduces it (``Scheduler.track_replicated``): bucketed with the gradients of its
    kind and launched as they arrive under ODP, added into ``.grad`` divided by G_batch before the
    backward returns, held over micro-batches inside ``Scheduler.accumulating`` — so gradient
    accumulation stays correct and the data axis moves each gradient once per step.
    """
    grid.scheduler.track_replicated(param, tag)


class _SplitReplicated(torch.autograd.Function):
    """Forward: this rank's chunk of the last dim over ``axis`` (local). Backward: all-gather over ``axis``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid) -> torch.Tensor:
        ctx.axis, ctx.grid = axis, grid
        n = x.shape[-1] // grid.size(axis)
        return x.narrow(-1, grid.coord(axis) * n, n).contiguous()  # (..., f/G_axis)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = ctx.grid.comm.all_gather(g.contiguous(), ctx.axis, dim=-1, tag=f"split_replicated.grad.{ctx.axis}")
        return full.wait(), None, None  # (..., f)


class _GatherReplicated(torch.autograd.Function):
    """Forward: all-gather the last dim over ``axis``. Backward: keep this rank's chunk (local)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid) -> torch.Tensor:
        ctx.axis, ctx.grid, ctx.n = axis, grid, x.shape[-1]
        return grid.comm.all_gather(x.contiguous(), axis, dim=-1, tag=f"gather_replicated.{axis}").wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g.narrow(-1, ctx.grid.coord(ctx.axis) * ctx.n, ctx.n).contiguous(), None, None


def split_replicated(x: torch.Tensor, axis: Axis, grid: Grid) -> torch.Tensor:
    """This rank's chunk of ``x``'s last dim over ``axis`` (``x`` replicated over ``axis``); the
    backward all-gathers the gradient over ``axis``."""
    return x if grid.size(axis) == 1 else _SplitReplicated.apply(x, axis, grid)


def gather_replicated(x: torch.Tensor, axis: Axis, grid: Grid) -> torch.Tensor:
    """The full last dim from every rank's chunk over ``axis``, used identically on every rank of
    ``axis``; the backward keeps this rank's chunk of the gradient."""
    return x if grid.size(axis) == 1 else _GatherReplicated.apply(x, axis, grid)


class _GatherShared(torch.autograd.Function):
    """Forward: all-gather ``dim`` over ``axis``. Backward: reduce-scatter (sum) ``dim`` over ``axis``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid, dim: int, tag: str) -> torch.Tensor:
        ctx.axis, ctx.grid, ctx.dim, ctx.tag = axis, grid, dim, tag
        return grid.comm.all_gather(x.contiguous(), axis, dim=dim, tag=tag).wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        part = ctx.grid.comm.reduce_scatter(g.contiguous(), ctx.axis, dim=ctx.dim, tag=f"{ctx.tag}.grad").wait()
        return part, None, None, None, None


def gather_shared(x: torch.Tensor, axis: Axis, grid: Grid, dim: int = 0, tag: str = "gather_shared") -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in ``axis`` order, for a whole that each rank of
    ``axis`` uses differently; the gradient of this rank's ``x`` is its part of the sum over ``axis``
    of the gradients of the whole (reduce-scatter). ``tag`` names both collectives in the comm log
    (the backward's as ``tag.grad``)."""
    return x if grid.size(axis) == 1 else _GatherShared.apply(x, axis, grid, dim, tag)
