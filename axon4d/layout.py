"""Moving between full tensors and the grid's layouts (docs/design.md §2).

Tokens (dim 0: the batch, or the token count of a 2-D input) are split over batch = data × z,
chunk index d·G_z + z. Features (the last dim) of a normal layer's input are split over x and its
output over y; a transposed layer swaps the two. ``shard_*`` functions slice locally (no
communication, differentiable); ``gather_*`` functions all-gather through the communication layer
and return full tensors on every rank, detached from autograd.
"""

from __future__ import annotations

import torch

from axon4d import geometry, rules, runtime
from axon4d.grid import Grid

#: the attribute a layer sets on its output tensor: the axis that output's features are split over
#: (``mark_features``); ``gather_output`` compares it with the layout it is asked to gather
FEATURES_AXIS = "_axon4d_features_axis"


def mark_features(y: torch.Tensor, axis: str) -> torch.Tensor:
    """``y``, noted as a tensor whose last dim is split over ``axis`` (a layer's output)."""
    setattr(y, FEATURES_AXIS, axis)
    return y


def _chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    n = x.shape[dim] // parts
    return x.narrow(dim, index * n, n)


def shard_batch(x: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """This rank's part of a full global batch: dim 0 split over batch = data × z."""
    grid = runtime.resolve(grid)
    if x.dim() == 0:
        raise ValueError("shard_batch needs a tensor with a batch dim (dim 0), got a scalar")
    rules.batch(x.shape[0]).check(grid.shape)
    return _chunk(x, 0, grid.size("batch"), grid.coord("batch"))


def gather_batch(x: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """The full batch from every rank's dim-0 part (all-gather over batch = data × z)."""
    grid = runtime.resolve(grid)
    return grid.comm.all_gather(x.detach().contiguous(), "batch", dim=0, tag="gather_batch").wait()


def shard_features(x: torch.Tensor, axis: str, grid: Grid | None = None) -> torch.Tensor:
    """This rank's part of the last dim of ``x``, split over ``axis``."""
    grid = runtime.resolve(grid)
    rules.features(x.shape[-1], axis).check(grid.shape)
    return _chunk(x, x.dim() - 1, grid.size(axis), grid.coord(axis))


def gather_features(x: torch.Tensor, axis: str, grid: Grid | None = None) -> torch.Tensor:
    """The full last dim from every rank's part (all-gather over ``axis``)."""
    grid = runtime.resolve(grid)
    return grid.comm.all_gather(x.detach().contiguous(), axis, dim=-1, tag="gather_features").wait()


def shard_input(x: torch.Tensor, transpose: bool = False, grid: Grid | None = None) -> torch.Tensor:
    """This rank's part of a full input (N, ..., in) for a normal (or ``transpose``d) Linear.

    Dim 0 is split over batch (data × z); the last dim over x (normal) or y (transposed).
    """
    grid = runtime.resolve(grid)
    in_axis, _ = geometry.layer_axes(transpose)
    return shard_features(shard_batch(x, grid=grid), in_axis, grid=grid)


def gather_output(y: torch.Tensor, transpose: bool = False, grid: Grid | None = None) -> torch.Tensor:
    """The full output (N, ..., out) of a normal (or ``transpose``d) Linear, on every rank.

    ``ValueError`` (before any communication) when ``y`` is a layer's output of the other layout."""
    grid = runtime.resolve(grid)
    _, out_axis = geometry.layer_axes(transpose)
    split = getattr(y, FEATURES_AXIS, None)
    if split is not None and split != out_axis:
        made_by = "a transposed" if split == geometry.layer_axes(True)[1] else "a normal"
        raise ValueError(
            f"gather_output(transpose={transpose}) gathers features split over {out_axis}, but this tensor is the "
            f"output of {made_by} layer (features split over {split}); call gather_output(y, transpose={not transpose})"
        )
    return gather_batch(gather_features(y, out_axis, grid=grid), grid=grid)
