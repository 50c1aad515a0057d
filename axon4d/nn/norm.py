"""LayerNorm and RMSNorm over activations whose feature dim is split over a grid axis.

Between blocks the residual stream has the layout of a normal layer's input (docs/design.md §2):
(b, hidden/G_x) on each rank, replicated over y. A norm's statistics span all ``hidden``
features; the affine weight and bias are split over x like the features and replicated elsewhere,
with gradients averaged over batch = data × z (``average_grad_over_batch``).

Split over x, each norm is one autograd Function (``_SplitNorm``, docs/design.md §2 "norms"):

- forward: every rank sums its features per token — [Σx, Σx²] for LayerNorm, [Σx²] for RMSNorm,
  fp32, (tokens, k) — and ONE all-reduce over x (``Term.NORM_STATS``) gives the totals, from which
  mean = Σx/H, var = max(Σx²/H − mean², 0) and rstd = 1/√(var + eps) (RMSNorm: 1/√(Σx²/H + eps));
  then y = (x − mean)·rstd·w + b, computed in fp32 and returned in ``x``'s dtype.
- saved for backward: ``x`` itself (its dtype) and the per-token mean and rstd (fp32, (tokens,)) —
  nothing activation-sized in fp32.
- backward: with x̂ = (x − mean)·rstd and ĝ = g·w, ONE all-reduce over x (``Term.NORM_STATS_GRAD``)
  of the per-token sums [Σĝ, Σĝ·x̂] (RMSNorm: [Σĝ·x̂]) gives
  dx = rstd·(ĝ − Σĝ/H − x̂·Σĝx̂/H) (RMSNorm: rstd·(ĝ − x̂·Σĝx̂/H)); dw = Σ_tokens g·x̂ and
  db = Σ_tokens g stay local (they are issued while that all-reduce runs).

Balanced recomputation (axon4d.nn.recompute) splits the same computation in two: ``statistics(x)``
(the per-token statistics, one all-reduce each way: ``_Statistics``), kept, and
``normalize(x, stats)`` (elementwise, no communication), which the consuming GEMM re-runs in its
backward. Where the axis has one rank (G_x = 1: the features are whole) the forward is torch.nn's
norm itself (``whole``), for LayerNorm one fused kernel each way. ``norm_for(cfg)`` /
``dense_norm_for(cfg)`` pick the norm of a model configuration's architecture (RMSNorm for Llama,
LayerNorm for GPT), on the grid or plain.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from axon4d.config import ModelConfig
from axon4d.grid import rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridAxis
from axon4d.layout.geometry import Term, norm_statistics_wire
from axon4d.nn.functional import average_grad_over_batch


def _local_sums(x: torch.Tensor, centred: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's per-token sums over its h features, ready for the all-reduce over the axis, from
    ``x`` (n, h) in any float dtype (widened inside the reductions).

    RMSNorm (not ``centred``): [Σx²], fp32 (n, 1). LayerNorm: [Σx, Σx²], fp64 (n, 2), formed
    about this rank's mean c so that E[x²] − E[x]² does not cancel in fp32 when |mean| ≫ std:
    with d = x − c (fp32), Σx = h·c + Σd and Σx² = Σd² + 2c·Σd + h·c², the large terms exact in
    fp64. Returns (sums, d, c): d (n, h) fp32 and c (n,) fp32 for LayerNorm's forward to reuse
    (None for RMSNorm)."""
    _, wide = norm_statistics_wire(Term.NORM_STATS, centred)  # what the all-reduce moves: fp32, fp64
    if not centred:
        return torch.linalg.vector_norm(x, dim=-1, dtype=wide).square().unsqueeze(-1), None, None
    h = x.shape[-1]
    c = x.sum(-1, dtype=torch.float32) / h  # (n,)
    d = torch.sub(x, c.unsqueeze(-1))  # (n, h) fp32, transient
    d_sum = d.sum(-1).to(wide)
    d_squares = torch.linalg.vector_norm(d, dim=-1).square().to(wide)
    c64 = c.to(wide)
    sums = torch.stack([h * c64 + d_sum, d_squares + 2 * c64 * d_sum + h * c64.square()], dim=-1)  # (n, 2) fp64
    return sums, d, c


def _statistics(sums: torch.Tensor, hidden: int, eps: float, centred: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(mean, rstd), each fp32 (n,), from the all-reduced sums of ``_local_sums`` (mean None for
    RMSNorm). LayerNorm's variance E[x²] − E[x]² is formed in fp64 and clamped at 0."""
    if not centred:
        return None, torch.rsqrt(sums[:, 0] / hidden + eps)
    mean = sums[:, 0] / hidden
    var = (sums[:, 1] / hidden - mean.square()).clamp_min_(0.0)
    return mean.float(), torch.rsqrt(var + eps).float()


def _x_hat(x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor) -> torch.Tensor:
    """x̂ = (x − mean)·rstd, a new fp32 (n, h) tensor (``x`` is never written)."""
    if mean is None:
        return torch.mul(x, rstd.unsqueeze(-1).to(torch.promote_types(x.dtype, torch.float32)))
    return torch.sub(x, mean.unsqueeze(-1)).mul_(rstd.unsqueeze(-1))


def _into(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a pointwise op on the fp32 ``t`` may write its result: ``t`` itself in fp32, else a new
    tensor of ``dtype`` (the op computes in fp32 and rounds once on store)."""
    return t if t.dtype == dtype else torch.empty_like(t, dtype=dtype)


class _SplitNorm(torch.autograd.Function):
    """LayerNorm (``norm.centred``) or RMSNorm of (…, h) features split over ``norm.axis``: one
    all-reduce of the per-token sums in forward, one in backward (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: SplitFeatureNorm
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (n, h)
        sums, d, c = _local_sums(x2, norm.centred)
        norm.grid.comm.all_reduce(sums, norm.axis, tag=Term.NORM_STATS).wait()  # (n, k), in place
        mean, rstd = _statistics(sums, norm.hidden, norm.eps, norm.centred)
        if d is None or c is None or mean is None:
            x_hat = _x_hat(x2, mean, rstd)  # (n, h) fp32, transient
        else:  # x − mean = d + (c − mean), in d's buffer
            x_hat = d.add_((c - mean).unsqueeze(-1)).mul_(rstd.unsqueeze(-1))
        w = weight.float()
        y = _into(x_hat, x.dtype)
        if bias is None:
            torch.mul(x_hat, w, out=y)
        else:
            torch.addcmul(bias.float(), x_hat, w, out=y)
        kept = (rstd,) if mean is None else (mean, rstd)
        ctx.save_for_backward(x, weight, *kept)  # x in its own dtype, the statistics fp32 (n,)
        ctx.norm, ctx.has_bias = norm, bias is not None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, *kept = ctx.saved_tensors
        norm: SplitFeatureNorm = ctx.norm
        mean, rstd = (None, kept[0]) if len(kept) == 1 else kept
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, x.shape[-1])  # (n, h)
        x_hat = _x_hat(x2, mean, rstd)  # (n, h) fp32
        handle = None
        if ctx.needs_input_grad[0]:
            g_w = torch.mul(g2, weight.float())  # ĝ = g·w, (n, h) fp32
            gx = g_w * x_hat
            sums = gx.sum(-1) if mean is None else torch.stack([g_w.sum(-1), gx.sum(-1)], dim=-1)
            del gx
            sums = sums.reshape(x2.shape[0], -1)  # (n, k): [Σĝ, Σĝx̂] or [Σĝx̂]
            handle = norm.grid.comm.all_reduce(sums, norm.axis, tag=Term.NORM_STATS_GRAD)
        # the affine gradients are local (averaged over batch by their hooks) and run while it reduces
        dw = torch.mul(g2, x_hat).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = g2.sum(0, dtype=torch.float32).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dx = None
        if handle is not None:
            sums = handle.wait() / norm.hidden
            g_w.addcmul_(x_hat, sums[:, -1:], value=-1.0)
            if mean is not None:
                g_w.sub_(sums[:, :1])
            dx = torch.mul(g_w, rstd.unsqueeze(-1), out=_into(g_w, x.dtype)).view(x.shape)
        return dx, dw, db, None


class _Statistics(torch.autograd.Function):
    """``SplitFeatureNorm.statistics``: the per-token statistics (…, k) fp32 of (…, h) features
    split over ``norm.axis`` — [mean, rstd] or [rstd] — with one all-reduce of the per-token sums
    in forward and one of the statistics' partial gradients in backward (each rank's
    ``normalize`` sees only its own features, so the gradient reaching the statistics is partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, norm: SplitFeatureNorm) -> torch.Tensor:
        sums = _local_sums(x.reshape(-1, x.shape[-1]), norm.centred)[0]  # (n, k)
        norm.grid.comm.all_reduce(sums, norm.axis, tag=Term.NORM_STATS).wait()
        mean, rstd = _statistics(sums, norm.hidden, norm.eps, norm.centred)
        stats = rstd.unsqueeze(-1) if mean is None else torch.stack([mean, rstd], dim=-1)  # (n, k)
        ctx.save_for_backward(x, stats)
        ctx.norm = norm
        return stats.view(*x.shape[:-1], stats.shape[-1])

    @staticmethod
    def backward(ctx: Any, d_stats: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, stats = ctx.saved_tensors
        norm: SplitFeatureNorm = ctx.norm
        x2 = x.reshape(-1, x.shape[-1])
        d = norm.grid.comm.all_reduce(
            d_stats.reshape(x2.shape[0], -1)
            .to(norm_statistics_wire(Term.NORM_STATS_GRAD, norm.centred)[1])
            .contiguous(),
            norm.axis,
            tag=Term.NORM_STATS_GRAD,
        ).wait()  # (n, k): the gradient of every token's statistics, summed over the axis
        mean = stats[:, 0] if norm.centred else None
        rstd = stats[:, -1]
        # rstd = (E[x²] − mean² + eps)^(−1/2): ∂rstd/∂x = −rstd³·(x − mean)/H = −rstd²·x̂/H
        dx = _x_hat(x2, mean, rstd).mul_((-d[:, -1] * rstd.square() / norm.hidden).unsqueeze(-1))
        if mean is not None:
            dx.add_(d[:, :1] / norm.hidden)  # ∂mean/∂x = 1/H
        return dx.to(x.dtype).view(x.shape), None


class SplitFeatureNorm(nn.Module):
    """What LayerNorm and RMSNorm share: ``hidden`` features split over ``axis``, this rank's slice
    of the affine weight (and bias), gradients averaged over batch."""

    centred = True  # LayerNorm subtracts the mean; RMSNorm does not

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
        """(…, hidden/G_axis) → (…, hidden/G_axis) in ``x``'s dtype: ``whole(x)`` where the features
        are not split, else the fused split norm (one all-reduce over the axis each way)."""
        self.check_input(x)
        if self.grid.size(self.axis) == 1:
            return self.whole(x)
        return cast(torch.Tensor, _SplitNorm.apply(x, self.weight, self.bias, self))

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of (…, hidden) activations whole on this rank (G_axis = 1): torch.nn's own —
        for LayerNorm one fused kernel each way — computed in fp32 like the split path and
        returned in ``x``'s dtype."""
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
        """Per-token statistics over all ``hidden`` features, fp32 (…, k): [mean, rstd] for
        LayerNorm, [rstd] for RMSNorm — one all-reduce over the axis forward, one backward."""
        self.check_input(x)
        return cast(torch.Tensor, _Statistics.apply(x, self))

    def normalize(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """The normalised, scaled (…, hidden/G_axis) activations from ``x`` and its ``statistics``
        (elementwise: no communication), computed in fp32 and returned in ``x``'s dtype."""
        x_hat = (x.float() - stats[..., :1]) * stats[..., -1:] if self.centred else x.float() * stats
        y = x_hat * self.weight.float()
        y = y + self.bias.float() if self.bias is not None else y
        return y.to(x.dtype)

    def to_dense(self, grads: bool = False) -> nn.Module:
        """The full-width ``torch.nn`` norm (with ``.grad`` if ``grads``), on every rank of the axis."""
        raise NotImplementedError

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

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (self.hidden,), self._fp32(self.weight), self._fp32(self.bias), self.eps)
        return y.to(x.dtype)

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

    centred = False

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
