"""LayerNorm and RMSNorm over activations whose feature dim is split over a grid axis.

Between blocks the residual stream has the layout of a normal layer's input (docs/design.md §2):
(b, hidden/G_x) on each rank, replicated over y. A norm's statistics span all ``hidden``
features, so the per-rank partial sums are all-reduced over x (``sum_partials``); the affine
weight and bias are split over x like the features and replicated elsewhere, with gradients
averaged over batch = data × z. Each norm is ``normalize(x, statistics(x))``: the per-token
statistics need the all-reduce, the normalisation is elementwise — so balanced recomputation
(axon4d.nn.recompute) keeps the statistics and re-runs only ``normalize``. Where the axis has one
rank (G_x = 1: the features are whole) the forward is torch.nn's norm itself (``whole``), for
LayerNorm one fused kernel each way. ``norm_for(cfg)`` / ``dense_norm_for(cfg)`` pick the norm of a
model configuration's architecture (RMSNorm for Llama, LayerNorm for GPT), on the grid or plain.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from axon4d import rules, runtime
from axon4d.config import ModelConfig
from axon4d.geometry import Term
from axon4d.grid import Grid
from axon4d.nn.functional import average_grad_over_batch, sum_partials
from axon4d.shape import GridAxis


class SplitFeatureNorm(nn.Module):
    """What LayerNorm and RMSNorm share: ``hidden`` features split over ``axis``, this rank's slice
    of the affine weight (and bias), gradients averaged over batch."""

    def __init__(
        self,
        hidden: int,
        eps: float,
        bias: bool,
        axis: GridAxis,
        grid: Grid | None,
        device: str | torch.device | None,
        dtype: torch.dtype | None,
    ):
        super().__init__()
        self.grid = runtime.resolve(grid)
        self.hidden, self.eps, self.axis = hidden, eps, axis
        rules.count(hidden, "hidden (the normalised features)", example=1024)
        if not eps > 0:
            raise ValueError(f"eps = {eps} must be above 0 (it keeps the norm finite), e.g. 1e-5")
        rules.norm(hidden, axis).check(self.grid.shape)
        local = hidden // self.grid.size(axis)
        device = device if device is not None else self.grid.device
        self.weight = nn.Parameter(torch.ones(local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype)) if bias else None
        for p in self.parameters():
            average_grad_over_batch(p, self.grid, Term.NORM_GRAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid.size(self.axis) == 1:
            self.check_input(x)
            return self.whole(x)
        return self.normalize(x, self.statistics(x))

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of (…, hidden) activations whole on this rank (G_axis = 1): torch.nn's own —
        for LayerNorm one fused kernel each way instead of the split path's elementwise chain —
        computed in fp32 like the split path and returned in ``x``'s dtype."""
        raise NotImplementedError

    def _fp32(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float()

    def check_input(self, x: torch.Tensor) -> None:
        """Raise unless ``x`` is a floating tensor whose last dim is this rank's hidden/G_axis features
        (checked before the statistics' all-reduce, so every rank refuses alike)."""
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{type(self).__name__} normalises a floating tensor, got {kind}; convert with x.float()")
        local = self.hidden // self.grid.size(self.axis)
        if x.dim() < 1 or x.shape[-1] != local:
            raise ValueError(
                f"{type(self).__name__}({self.hidden}) expects this rank's features, last dim hidden/G_{self.axis} = "
                f"{self.hidden}/{self.grid.size(self.axis)} = {local}, got shape {tuple(x.shape)}; "
                f"shard a full tensor with axon4d.shard_features(x, {self.axis!r})"
            )

    def statistics(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token statistics over all ``hidden`` features, fp32 (…, k) — all-reduce over the axis."""
        raise NotImplementedError

    def normalize(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """The normalised, scaled (…, hidden/G_axis) activations from ``x`` and its ``statistics``
        (elementwise: no communication)."""
        raise NotImplementedError

    def to_dense(self, grads: bool = False) -> nn.Module:
        """The full-width ``torch.nn`` norm (with ``.grad`` if ``grads``), on every rank of the axis."""
        raise NotImplementedError

    def _affine(self, x_hat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x̂·w (+ b), computed in fp32 and returned in the activations' dtype."""
        y = x_hat * self.weight.float()
        y = y + self.bias.float() if self.bias is not None else y
        return y.to(dtype)

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        n = self.hidden // self.grid.size(self.axis)
        return full[self.grid.coord(self.axis) * n : (self.grid.coord(self.axis) + 1) * n]

    @torch.no_grad()
    def load_dense_(self, dense: nn.Module) -> SplitFeatureNorm:
        """Copy this rank's features of a full-width norm's weight (and bias)."""
        self.weight.copy_(self._slice(cast(torch.Tensor, dense.weight)))
        if self.bias is not None:
            self.bias.copy_(self._slice(cast(torch.Tensor, dense.bias)))
        return self

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.grid.comm.all_gather(t.detach().contiguous(), self.axis, tag=Term.DENSE).wait().clone()


class LayerNorm(SplitFeatureNorm):
    """``torch.nn.LayerNorm(hidden)`` on features split over ``axis`` (default x)."""

    def __init__(
        self,
        hidden: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        axis: GridAxis = "x",
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(hidden, eps, bias, axis, grid, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``normalize(x, statistics(x))`` with the centred input made once (it is kept for backward);
        ``whole(x)`` where the features are not split."""
        self.check_input(x)
        if self.grid.size(self.axis) == 1:
            return self.whole(x)
        xf = x.float()
        mean = sum_partials(xf.sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        centred = xf - mean
        var = sum_partials(centred.square().sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        return self._affine(centred * torch.rsqrt(var + self.eps), x.dtype)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (self.hidden,), self._fp32(self.weight), self._fp32(self.bias), self.eps)
        return y.to(x.dtype)

    def statistics(self, x: torch.Tensor) -> torch.Tensor:
        """(…, 2) fp32: the mean and 1/√(var + eps) of each token (all-reduces over the axis)."""
        self.check_input(x)
        xf = x.float()
        mean = sum_partials(xf.sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        var = sum_partials((xf - mean).square().sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        return torch.cat([mean, torch.rsqrt(var + self.eps)], dim=-1)

    def normalize(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        mean, rstd = stats.split(1, dim=-1)
        return self._affine((x.float() - mean) * rstd, x.dtype)

    def to_dense(self, grads: bool = False) -> nn.LayerNorm:
        dense = nn.LayerNorm(
            self.hidden, eps=self.eps, bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype
        )
        with torch.no_grad():
            dense.weight.copy_(self._gather(self.weight))
            if self.bias is not None:
                dense.bias.copy_(self._gather(self.bias))
        if grads:
            dense.weight.grad = self._gather(self.weight.grad) if self.weight.grad is not None else None
            if self.bias is not None and self.bias.grad is not None:
                dense.bias.grad = self._gather(self.bias.grad)
        return dense


class RMSNorm(SplitFeatureNorm):
    """``torch.nn.RMSNorm(hidden)`` on features split over ``axis`` (default x)."""

    def __init__(
        self,
        hidden: int,
        eps: float = 1e-6,
        *,
        axis: GridAxis = "x",
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(hidden, eps, False, axis, grid, device, dtype)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.hidden,), self._fp32(self.weight), self.eps).to(x.dtype)

    def statistics(self, x: torch.Tensor) -> torch.Tensor:
        """(…, 1) fp32: 1/√(mean square + eps) of each token (an all-reduce over the axis)."""
        self.check_input(x)
        ms = sum_partials(x.float().square().sum(-1, keepdim=True), self.axis, self.grid) / self.hidden
        return torch.rsqrt(ms + self.eps)

    def normalize(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        return self._affine(x.float() * stats, x.dtype)

    def to_dense(self, grads: bool = False) -> nn.RMSNorm:
        dense = nn.RMSNorm(self.hidden, eps=self.eps, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(self._gather(self.weight))
        if grads and self.weight.grad is not None:
            dense.weight.grad = self._gather(self.weight.grad)
        return dense


def norm_for(
    cfg: ModelConfig, *, grid: Grid, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> SplitFeatureNorm:
    """The norm of ``cfg``'s architecture on features split over x: RMSNorm (Llama) or LayerNorm (GPT)."""
    if cfg.arch == "llama":
        return RMSNorm(cfg.hidden, eps=cfg.norm_eps, grid=grid, device=device, dtype=dtype)
    return LayerNorm(cfg.hidden, eps=cfg.norm_eps, grid=grid, device=device, dtype=dtype)


def dense_norm_for(
    cfg: ModelConfig, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The single-process norm of ``cfg``'s architecture: ``torch.nn.RMSNorm`` (Llama) or ``LayerNorm`` (GPT)."""
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, device=device, dtype=dtype)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, device=device, dtype=dtype)
