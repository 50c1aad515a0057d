"""The modules ``auto_parallelize`` puts in place of a model's own (docs/design.md §2).

``ShardedLinear`` wraps an ``axon4d.Linear`` (E2–E7) where the model had an ``nn.Linear`` or Hugging
Face's ``Conv1D``; ``ShardedNorm`` wraps one of the library's norms on x-split features
(``axon4d.nn.norm``) where the model had its own norm class. Each gives back what it replaced
from ``to_dense(grads)``, which is how ``axon4d.to_dense`` undoes the replacement.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.layout import geometry
from axon4d.layout.rectangles import FusedRows
from axon4d.nn.functional import gather_replicated, split_replicated
from axon4d.nn.linear import Linear
from axon4d.nn.norm import LayerNorm, RMSNorm
from axon4d.nn.recompute import Recipes, recomputed


def is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer storing its weight as (in, out)."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


def is_linear(m: nn.Module | None) -> bool:
    """Whether ``m`` is a layer ``ShardedLinear`` can replace (``nn.Linear`` or ``Conv1D``)."""
    return isinstance(m, nn.Linear) or (m is not None and is_conv1d(m))


def owned_by_axon4d(m: nn.Module) -> bool:
    """Modules of this library reduce their own gradients (the 3D Linear, sharded norms, ...)."""
    return type(m).__module__.startswith("axon4d.")


def dense_params(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias (out,) or None) of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(m):
        conv = cast(Any, m)  # Hugging Face's Conv1D: duck-typed, its attributes are unknown to mypy
        return conv.weight.detach().t(), conv.bias.detach()
    lin = cast(nn.Linear, m)  # not a Conv1D, so an nn.Linear (callers pass only what is_linear accepts)
    return lin.weight.detach(), None if lin.bias is None else lin.bias.detach()


def linear_problem(name: str, m: nn.Module, transpose: bool, grid: Grid, users: dict[int, list[str]]) -> str | None:
    """Why the linear layer ``m`` (module ``name``) cannot become a ``ShardedLinear`` (None if it can).

    ``users`` maps id(parameter) to the names of every module holding it (a tied weight has two).
    """
    weight, _ = dense_params(m)
    out_f, in_f = weight.shape
    for p in m.parameters(recurse=False):
        others = [u for u in users[id(p)] if u != name]
        if others:
            return f"weight shared with {', '.join(others)} (tied)"
    in_axis, out_axis = geometry.layer_axes(transpose)
    if in_f % grid.size(in_axis) or out_f % grid.size(out_axis):
        return (
            f"({out_f}, {in_f}) does not split over G_{out_axis} = {grid.size(out_axis)} × "
            f"G_{in_axis} = {grid.size(in_axis)}"
        )
    return None


class ShardedLinear(nn.Module):
    """An ``axon4d.Linear`` that fits where a model had an ``nn.Linear`` or ``Conv1D``.

    Input: (..., in) full features, or — ``input_sharded`` — this rank's chunk over the layer's
    input axis (x normal, y transposed). Output: (..., out) full, gathered over the output axis, or —
    ``output_sharded`` — this rank's chunk. ``fused`` reorders output features before splitting
    (GPT-2's packed q|k|v so each rank gets whole heads of all three); ``to_dense`` undoes it.
    """

    def __init__(
        self,
        dense: nn.Module,
        *,
        grid: Grid,
        transpose: bool = False,
        input_sharded: bool = False,
        output_sharded: bool = False,
        fused: FusedRows | None = None,
    ):
        super().__init__()
        weight, bias = dense_params(dense)
        out_f, in_f = weight.shape
        if fused is not None:
            weight, bias = fused.fuse(weight), None if bias is None else fused.fuse(bias)
        self.inner = Linear(
            in_f, out_f, bias=bias is not None, transpose=transpose, grid=grid, device=weight.device, dtype=weight.dtype
        )
        self.inner.load_dense_(weight, bias)
        # checkpoints save fused rows as each segment's own tensor (param_layout): grid-independent,
        # where the permuted order of one G_y would scramble q|k|v on a grid of another
        self.inner.fused_rows = fused
        self.grid = grid
        self.input_sharded, self.output_sharded = input_sharded, output_sharded
        self.conv1d_class = type(dense) if is_conv1d(dense) else None  # what to_dense gives back, if not nn.Linear
        self.fused = fused

    @property
    def out_perm(self) -> torch.Tensor | None:
        """The output features' permutation (``fused.order()``): output row i is row out_perm[i] of
        the layer it replaced; None when the rows are not fused."""
        return None if self.fused is None else self.fused.order()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)  # (..., out/G_out)
        return y if self.output_sharded else gather_replicated(y, self.inner.out_axis, self.grid)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the output over ``inner.out_axis`` (never gathered), in ``out_perm``'s
        order, of the input ``forward`` takes."""
        if not self.input_sharded:
            x = split_replicated(x, self.inner.in_axis, self.grid)  # (..., in) → (..., in/G_in)
        return self.inner(x)  # (..., out/G_out)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        """The layer it replaced (``nn.Linear`` or ``Conv1D``) with full weight, bias and ``.grad``."""
        lin = self.inner.to_dense(grads=grads)
        if self.fused is not None:
            for p in lin.parameters():
                p.data = self.fused.unfuse(p.data)
                if p.grad is not None:
                    p.grad = self.fused.unfuse(p.grad)
        if self.conv1d_class is None:
            return lin
        # Conv1D(nf, nx): Hugging Face's class, duck-typed (its attributes are unknown to mypy)
        conv: Any = self.conv1d_class(lin.out_features, lin.in_features).to(lin.weight)
        conv.weight.copy_(lin.weight.t())
        conv.bias.copy_(lin.bias)
        if grads:
            conv.weight.grad = None if lin.weight.grad is None else lin.weight.grad.t().contiguous()
            conv.bias.grad = lin.bias.grad
        return conv

    def extra_repr(self) -> str:
        return (
            f"conv1d={self.conv1d_class is not None}, input_sharded={self.input_sharded}, "
            f"output_sharded={self.output_sharded}"
        )


class ShardedNorm(nn.Module):
    """One of the library's norms on x-split features (``axon4d.nn.norm``) standing in for a
    model's own norm class; ``to_dense`` gives back that class with the full weight."""

    def __init__(self, inner: LayerNorm | RMSNorm, original: nn.Module):
        super().__init__()
        self.inner = inner
        self.template = [original]  # the class and settings to_dense returns; in a list: not a submodule
        self.recipes: Recipes | None = None  # set by recompute='balanced' (axon4d.parallelize.recompute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipes is None:
            return self.inner(x)  # (..., hidden/G_x) → (..., hidden/G_x)
        # balanced recomputation: keep the statistics; whoever keeps the output keeps a recipe
        stats = self.inner.statistics(x)
        return self.recipes.keep(recomputed(self.inner.normalize, x, stats), self.inner.normalize, x, stats)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        full = self.inner.to_dense(grads=grads)
        dense = copy.deepcopy(self.template[0])
        if any(p.is_meta for p in dense.parameters()):  # the model was built on meta (loaded by slices)
            dense.to_empty(device=full.weight.device)
        for name, p in dense.named_parameters():
            src = full.get_parameter(name)
            p.copy_(src)
            p.grad = src.grad.clone() if grads and src.grad is not None else None
        return dense


def norms_fit(norms: list[nn.Module]) -> bool:
    """Whether ``sharded_norm_builder`` can replace every one of ``norms`` exactly."""
    return all(
        type(n).__name__ == "LlamaRMSNorm"
        or (isinstance(n, nn.LayerNorm) and n.elementwise_affine and len(n.normalized_shape) == 1)
        for n in norms
    )


def sharded_norm_builder(grid: Grid) -> Callable[[nn.Module], nn.Module]:
    """Builder of a ``ShardedNorm`` (features over x) for a Llama RMSNorm or a ``torch.nn.LayerNorm``."""

    def build(n: nn.Module) -> nn.Module:
        inner: LayerNorm | RMSNorm
        if isinstance(n, nn.LayerNorm):
            w = n.weight
            inner = LayerNorm(w.shape[0], eps=n.eps, bias=n.bias is not None, grid=grid, device=w.device, dtype=w.dtype)
        else:
            llama_norm = cast(Any, n)  # Hugging Face's LlamaRMSNorm: duck-typed, its attributes are unknown to mypy
            w = llama_norm.weight
            inner = RMSNorm(w.shape[0], eps=llama_norm.variance_epsilon, grid=grid, device=w.device, dtype=w.dtype)
        inner.load_dense_(n)  # in place (it returns inner itself)
        return ShardedNorm(inner, n)

    return build
