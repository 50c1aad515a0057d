"""LayerNorm and RMSNorm over activations whose feature dim is split over a grid axis.

Between blocks the residual stream has the layout of a normal layer's input (docs/design.md §2):
(b, hidden/G_x) on each rank, replicated over y. A norm's statistics span all ``hidden``
features, so the per-rank partial sums are all-reduced over x (``sum_partials``); the affine
weight and bias are split over x like the features and replicated elsewhere, with gradients
averaged over batch = data × z.
"""

from __future__ import annotations

import torch
from torch import nn

from axon4d import runtime
from axon4d.grid import Grid
from axon4d import rules
from axon4d.nn.functional import average_grad_over_batch, sum_partials


class ShardedNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, bias: bool, axis: str, grid: Grid | None,
                 device: str | torch.device | None, dtype: torch.dtype | None):
        super().__init__()
        self.grid = runtime.resolve(grid)
        self.hidden, self.eps, self.axis = hidden, eps, axis
        rules.norm(hidden, axis).check(self.grid.shape)
        local = hidden // self.grid.size(axis)
        device = device if device is not None else self.grid.device
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype)) if bias else None
        for p in self.parameters():
            average_grad_over_batch(p, self.grid)

    def _affine(self, x_hat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x̂·w (+ b), computed in fp32 and returned in the activations' dtype."""
        y = x_hat * self.weight.float()
        y = y + self.bias.float() if self.bias is not None else y
        return y.to(dtype)

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        n = self.hidden // self.grid.size(self.axis)
        return full[self.grid.coord(self.axis) * n : (self.grid.coord(self.axis) + 1) * n]

    @torch.no_grad()
    def load_dense_(self, dense: nn.Module) -> "ShardedNorm":
        """Copy this rank's features of a full-width norm's weight (and bias)."""
        self.weight.copy_(self._slice(dense.weight))
        if self.bias is not None:
            self.bias.copy_(self._slice(dense.bias))
        return self

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.grid.comm.all_gather(t.detach().contiguous(), self.axis, tag="dense").wait().clone()


class LayerNorm(ShardedNorm):
    """``torch.nn.LayerNorm(hidden)`` on features split over ``axis`` (default x)."""

    def __init__(self, hidden: int, eps: float = 1e-5, bias: bool = True, *, axis: str = "x",
                 grid: Grid | None = None, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(hidden, eps, bias, axis, grid, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean = sum_partials(xf.sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        centred = xf - mean
        var = sum_partials(centred.square().sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        return self._affine(centred * torch.rsqrt(var + self.eps), x.dtype)

    def to_dense(self, grads: bool = False) -> nn.LayerNorm:
        dense = nn.LayerNorm(self.hidden, eps=self.eps, bias=self.bias is not None,
                             device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(self._gather(self.weight))
            if self.bias is not None:
                dense.bias.copy_(self._gather(self.bias))
        if grads:
            dense.weight.grad = self._gather(self.weight.grad) if self.weight.grad is not None else None
            if self.bias is not None and self.bias.grad is not None:
                dense.bias.grad = self._gather(self.bias.grad)
        return dense


class RMSNorm(ShardedNorm):
    """``torch.nn.RMSNorm(hidden)`` on features split over ``axis`` (default x)."""

    def __init__(self, hidden: int, eps: float = 1e-6, *, axis: str = "x", grid: Grid | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(hidden, eps, False, axis, grid, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ms = sum_partials(xf.square().sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        return self._affine(xf * torch.rsqrt(ms + self.eps), x.dtype)

    def to_dense(self, grads: bool = False) -> nn.RMSNorm:
        dense = nn.RMSNorm(self.hidden, eps=self.eps, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(self._gather(self.weight))
        if grads and self.weight.grad is not None:
            dense.weight.grad = self._gather(self.weight.grad)
        return dense
