"""The small modules the Hugging Face MoE families add around attention and the experts, on the
grid's layouts (docs/parallelize.md, "Mixture-of-Experts models"): Qwen3-MoE's per-head q/k norms
(``HeadNorm``), OLMoE's q/k norms over all heads' features (``FeatureNorm``), Qwen2-MoE's sigmoid
gate on its shared expert (``SharedGate``). Each keeps its weight whole on every rank and gives
back the Hugging Face module with ``to_dense``.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.layout.geometry import Term
from axon4d.nn.functional import average_grad_over_batch, sum_partials, sum_to_replicas
from axon4d.nn.moe_rows import use_replicated


class HeadNorm(nn.Module):
    """A per-head RMSNorm (Qwen3-MoE's q_norm, k_norm: over head_dim) on this rank's heads; the
    weight is whole on every rank and its gradient, partial over y (each y rank holds other heads),
    is summed over y and averaged over batch = data × z."""

    def __init__(self, original: nn.Module, grid: Grid):
        super().__init__()
        norm = cast(Any, original)  # Hugging Face's RMSNorm: duck-typed
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.grid = grid
        self.template = [original]  # what to_dense returns; in a list: not a submodule
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # (..., heads/G_y, head_dim)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return use_replicated(self.weight, "y", self.grid, Term.REPLICATED_GRAD) * h.to(dtype)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        dense = copy.deepcopy(self.template[0])
        weight = cast(nn.Parameter, dense.weight)  # Hugging Face's RMSNorm weight
        if weight.is_meta:
            dense.to_empty(device=self.weight.device)
            weight = cast(nn.Parameter, dense.weight)
        weight.copy_(self.weight)
        weight.grad = self.weight.grad.clone() if grads and self.weight.grad is not None else None
        return dense


class SharedGate(nn.Module):
    """Qwen2-MoE's ``shared_expert_gate`` (Linear hidden → 1, no bias) followed by the sigmoid the
    block applies, on the residual layout (…, hidden/G_x): the weight is whole on every rank, each
    x rank's partial dot product is summed over x, and the gate (used by every x rank on its own
    features) has its gradient summed over x; the weight's gradient is summed over x (each rank
    has its columns') and averaged over batch."""

    def __init__(self, original: nn.Module, grid: Grid):
        super().__init__()
        self.weight = cast(nn.Parameter, original.weight)
        self.grid = grid
        self.template = [original]
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.grid
        cols = x.shape[-1]
        start = grid.coord("x") * cols
        w = use_replicated(self.weight, "x", grid, Term.REPLICATED_GRAD)[:, start : start + cols]
        logit = sum_to_replicas(x @ w.t().to(x.dtype), "x", grid)  # (…, 1), the same on every x rank
        return use_replicated(torch.sigmoid(logit), "x", grid, Term.REPLICATED_GRAD)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        return _dense_copy(self.template[0], self.weight, grads)


class FeatureNorm(nn.Module):
    """An RMSNorm over all heads' features (OLMoE's q_norm, k_norm over heads·head_dim) of this
    rank's heads (…, heads/G_y · head_dim): the sum of squares is summed over y; the whole weight
    on every rank, this rank's slice used, its gradient summed over y and averaged over batch."""

    def __init__(self, original: nn.Module, grid: Grid):
        super().__init__()
        norm = cast(Any, original)
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.grid = grid
        self.template = [original]
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid, dtype, n = self.grid, x.dtype, self.weight.shape[0]
        h = x.float()
        squares = sum_partials(h.pow(2).sum(-1, keepdim=True), "y", grid)
        h = h * torch.rsqrt(squares / n + self.eps)
        start = grid.coord("y") * x.shape[-1]
        w = use_replicated(self.weight, "y", grid, Term.REPLICATED_GRAD)[start : start + x.shape[-1]]
        return w * h.to(dtype)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        return _dense_copy(self.template[0], self.weight, grads)


def _dense_copy(template: nn.Module, weight: torch.Tensor, grads: bool) -> nn.Module:
    """A copy of ``template`` (a module with one parameter, ``weight``) holding ``weight`` (and its gradient)."""
    dense = copy.deepcopy(template)
    target = cast(nn.Parameter, cast(Any, dense).weight)
    if target.is_meta:
        dense.to_empty(device=weight.device)
        target = cast(nn.Parameter, cast(Any, dense).weight)
    target.copy_(weight)
    target.grad = weight.grad.clone() if grads and weight.grad is not None else None
    return dense
