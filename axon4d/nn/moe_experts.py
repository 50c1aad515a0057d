"""An MoE layer's experts on the grid (docs/moe.md, "Placement and expert layouts"; E18): where
they are under the layer's expert layout, their weights — drawn, loaded and gathered whole as the
layout splits them — and their grouped GEMMs.

Under FP8 GEMMs (``precision="bf16-fp8"``, docs/moe.md "FP8") the experts' grouped GEMMs — forward,
dX and dW of up and down — multiply float8 operands with one scale per expert
(``ExpertFP8GEMM``, ``axon4d.options.fp8_grouped``), where every expert block's dims (hidden/G_tx,
f/G_ty) are multiples of 16; otherwise they run in bf16, and ``gemm_precision`` says why.

Under a layout (``axon4d.grid.expert_layout``) rank i of the expert-parallel axes holds experts
i·E/G_ep … (i+1)·E/G_ep − 1, each split over the tensor-parallel axes as the dense MLP is — up
(hidden/G_x → f/G_y, gate|up by y chunk when gated) then down (f/G_y → hidden/G_x), an axis the
layout does not give to tp splitting nothing — and replicated over the rest. Axes of one rank split
nothing and name no group (``ExpertLayout.ep_axes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from axon4d.config import ModelConfig
from axon4d.device import fp8 as fp8_kernel
from axon4d.device import grouped
from axon4d.grid import rules
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridAxis, axis_of
from axon4d.layout import tiled_init
from axon4d.layout.geometry import Term
from axon4d.nn.moe_dense import DenseExperts, expert_matrices, uniform_for
from axon4d.options import fp8_gemm, fp8_grouped
from axon4d.options.precision import FP8, Precision, gradient_fp8

log = logging.getLogger("axon4d.fp8")


def placement_rules(cfg: ModelConfig, layout: ExpertLayout | str | None = None) -> list[rules.Rule]:
    """The divisibility rules of an MoE layer's placement under ``layout`` (docs/moe.md; None: the
    default, experts over batch = data × z, each split over x·y): E over the expert-parallel axes,
    an expert's FFN width over y where y splits it, the shared experts' over y, hidden over x."""
    layout = ExpertLayout.parse(layout)
    return layout.rules(cfg.n_experts, cfg.expert_width, cfg.shared_experts * cfg.expert_width, cfg.hidden)


def check_layout(cfg: ModelConfig, grid: Grid, layout: ExpertLayout) -> None:
    """``ValueError`` on every rank, before any collective, unless ``layout`` fits ``grid`` for ``cfg``."""
    layout.check(grid.shape, cfg.n_experts, cfg.expert_width, cfg.shared_experts * cfg.expert_width, cfg.hidden)


class GridExperts(nn.Module):
    """This rank's E/G_ep experts under ``layout``: ``up`` (E_l, f_up/G_ty, hidden/G_tx) — for
    gated FFNs each y chunk is [gate_j | up_j] — and ``down`` (E_l, hidden/G_tx, f/G_ty), where
    G_tx, G_ty are G_x, G_y if the layout's tensor parallelism splits experts over them, else 1."""

    def __init__(self, cfg: ModelConfig, grid: Grid, layout: ExpertLayout, device: Any, dtype: Any):
        super().__init__()
        self.layout = layout
        self.n_experts, self.hidden, self.ffn, self.gated = cfg.n_experts, cfg.hidden, cfg.expert_width, cfg.gated
        self.ep_axis = axis_of(layout.ep_axes(grid.shape))  # None: every rank holds every expert
        self.local = cfg.n_experts // (grid.size(self.ep_axis) if self.ep_axis else 1)
        self.first = (grid.coord(self.ep_axis) if self.ep_axis else 0) * self.local  # its first expert's index
        self.g_x = grid.size("x") if layout.splits("x") else 1  # hidden split over x
        self.g_y = grid.size("y") if layout.splits("y") else 1  # FFN width split over y
        self.col = (grid.coord("x") if layout.splits("x") else 0) * (self.hidden // self.g_x)  # its first hidden
        self.row = (grid.coord("y") if layout.splits("y") else 0) * (self.ffn // self.g_y)  # its first FFN row
        f_y, h_x = self.ffn // self.g_y, cfg.hidden // self.g_x
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.up = nn.Parameter(torch.empty(self.local, (2 if self.gated else 1) * f_y, h_x, **kw))
        self.down = nn.Parameter(torch.empty(self.local, h_x, f_y, **kw))
        self.precision: Precision = grid.precision
        #: whether the grouped GEMMs run in FP8 (module docstring); False runs them in bf16
        self.fp8_gemms = self.precision.gemm == FP8 and self._fp8_fits(torch.device(device))

    @property
    def block_shape(self) -> tuple[int, int]:
        """One expert's block of down, (hidden/G_tx, f/G_ty): up's is its transpose (twice the rows
        when gated); every GEMM's k and n is one of these."""
        return self.hidden // self.g_x, self.ffn // self.g_y

    def _fp8_fits(self, device: torch.device) -> bool:
        """Under FP8 GEMMs: the device must have them (else RuntimeError, ``device.fp8.check_gemm``)
        and both dims of an expert's block must be multiples of 16, else the experts run in bf16, logged."""
        fp8_kernel.check_gemm(device)
        if fp8_kernel.aligned(*self.block_shape):
            return True
        log.info(
            "MoE experts: block (hidden/G_tx, f/G_ty) = %s is not a multiple of %d; their grouped GEMMs run in bf16",
            self.block_shape,
            fp8_kernel.ALIGN,
        )
        return False

    @property
    def gemm_precision(self) -> str:
        """What the experts' grouped GEMMs multiply, as ``Linear.gemm_precision`` says it: "fp8", or
        under FP8 GEMMs "bf16 (expert block (24, 8) not a multiple of 16)"."""
        name = str(self.precision.compute).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
        if self.precision.gemm is None:
            return name
        if self.fp8_gemms:
            return "fp8"
        return f"{name} (expert block {self.block_shape} not a multiple of {fp8_kernel.ALIGN})"

    def gemm(self, x: torch.Tensor, w: torch.Tensor, sizes: list[int], scale: float) -> torch.Tensor:
        """Rows ``x`` (M, K) sorted by local expert, in runs of ``sizes``, times each expert's ``w``
        (E_l, N, K) transposed — ``up`` or ``down``, the parameter itself — with autograd: in FP8
        (``ExpertFP8GEMM``) or in x's dtype (``ExpertGEMM``); dW scaled by ``scale``."""
        if self.fp8_gemms:
            return ExpertFP8GEMM.apply(x, w, sizes, scale, gradient_fp8(self.precision))
        return ExpertGEMM.apply(x, w.to(x.dtype), sizes, scale)

    @property
    def hidden_slice(self) -> slice:
        """The hidden features this rank's expert blocks hold."""
        return slice(self.col, self.col + self.hidden // self.g_x)

    @property
    def ffn_slice(self) -> slice:
        """The FFN rows this rank's expert blocks hold (of each of gate and up when gated)."""
        return slice(self.row, self.row + self.ffn // self.g_y)

    @torch.no_grad()
    def reset_(self, seed: int) -> None:
        """This rank's blocks of ``DenseMoE``'s experts drawn from ``seed`` tile by tile
        (``moe_dense.expert_matrices``, ``axon4d.layout.tiled_init``): only the tiles they overlap,
        on any grid and layout the values the dense layer gets."""
        mats = expert_matrices(self.n_experts, self.hidden, self.ffn, self.gated)
        f_y, col, row = self.ffn // self.g_y, self.col, self.row
        for i in range(self.local):
            e = self.first + i  # its global index
            ups = ["experts.gate", "experts.up"] if self.gated else ["experts.up"]  # [gate_j | up_j]
            for j, name in enumerate(ups):
                block = self.up.data[i, j * f_y : (j + 1) * f_y]  # (f/G_ty, hidden/G_tx)
                tiled_init.fill_(block, uniform_for(self.hidden), seed, name, mats[name], e * self.ffn + row, col)
            down = mats["experts.down"]  # rows e·hidden + this rank's hidden/G_tx, columns its f/G_ty
            tiled_init.fill_(
                self.down.data[i], uniform_for(self.ffn), seed, "experts.down", down, e * self.hidden + col, row
            )

    @torch.no_grad()
    def load_dense_(self, dense: DenseExperts) -> None:
        """Take this rank's blocks of ``dense``'s (E, rows, cols) stacks."""
        cols, rows = self.hidden_slice, self.ffn_slice
        mine = slice(self.first, self.first + self.local)
        up = dense.up[mine, rows, cols]  # (E_l, f/G_ty, hidden/G_tx)
        if self.gated:
            assert dense.gate is not None
            up = torch.cat([dense.gate[mine, rows, cols], up], dim=1)  # [gate_j | up_j]
        self.up.copy_(up)
        self.down.copy_(dense.down[mine, cols, rows])

    def gathered(self, pick: Callable[[nn.Parameter], torch.Tensor], grid: Grid) -> dict[str, torch.Tensor]:
        """The whole (E, rows, cols) stacks of ``pick(up)`` and ``pick(down)`` (the values or the
        gradients) on every rank, gathered over the axes this layout splits them over: {"up",
        "down", and "gate" when gated, split from each y chunk's [gate_j | up_j] first}."""
        comm = grid.comm

        def whole(t: torch.Tensor, row_axis: GridAxis, col_axis: GridAxis) -> torch.Tensor:
            for axis, dim in ((row_axis, 1), (col_axis, 2)):
                if self.layout.splits(axis) and grid.size(axis) > 1:
                    t = comm.all_gather(t.contiguous(), axis, dim=dim, tag=Term.DENSE).wait()
            if self.ep_axis is not None:
                t = comm.all_gather(t.contiguous(), self.ep_axis, dim=0, tag=Term.DENSE).wait()
            return t

        up = pick(self.up).detach()
        out = {}
        if self.gated:  # split each y chunk's [gate_j | up_j] before gathering over y
            gate, up = up.chunk(2, dim=1)
            out["gate"] = whole(gate, "y", "x")
        out["up"] = whole(up, "y", "x")
        out["down"] = whole(pick(self.down).detach(), "x", "y")
        return out


class ExpertGEMM(torch.autograd.Function):
    """Grouped GEMM of rows sorted by expert with (G, N, K) weights (E18); the weight gradient is
    scaled by ``scale`` (1/G_batch: the batch average of docs/design.md §2; 1 where the replicas'
    reduction divides it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sizes: list[int], scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.sizes, ctx.scale = sizes, scale
        return grouped.grouped_mm_t(x, w, sizes)  # (M, K) × (G, N, K) → (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped.grouped_mm(dy, w, ctx.sizes) if ctx.needs_input_grad[0] else None  # (M, N) × (G, N, K)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = grouped.grouped_weight_grad(dy, x, ctx.sizes)  # (G, N, K)
            if ctx.scale != 1.0:
                dw.mul_(ctx.scale)
        return dx, dw, None, None


class ExpertFP8GEMM(torch.autograd.Function):
    """``ExpertGEMM`` with float8 operands, one scale per expert (``axon4d.options.fp8_grouped``),
    sums in fp32 and outputs in x's dtype (bf16):

    - forward  Y[g] = (X̂_g s_x[g])(Ŵ_g s_w[g])ᵀ    (m_g, K) × (N, K)ᵀ — X̂, Ŵ e4m3, Ŵ from the fp32 master
    - dX[g]         = (dŶ_g s_dy[g])(Ŵ_g s_w[g])    (m_g, N) × (N, K) — Ŵᵀ's bytes laid out once
    - dW[g]         = (dŶ_g s_dy[g])ᵀ(X̂_g s_x[g])   (N, m'_g) × (K, m'_g)ᵀ — the forward's X̂, each
      expert's tokens zero-padded to a multiple of 16

    The forward keeps X̂ and Ŵ (one byte per element) for the backward; dY is quantised once, in
    the gradients' float8 (``grad``). dW is returned in w's dtype, scaled by ``scale``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, sizes: list[int], scale: float, grad: torch.dtype
    ) -> torch.Tensor:
        xq = fp8_grouped.quantise_grouped(x, sizes)  # (M, K) e4m3, (G,) scales
        wq = fp8_grouped.quantise_grouped(w)  # (G, N, K) e4m3, (G,) scales
        fast = fp8_gemm.FAST_ACCUM["forward"]
        y = grouped.scaled_grouped_mm(xq.data, wq.data, xq.scale, wq.scale, sizes, x.dtype, fast_accum=fast)
        ctx.save_for_backward(xq.data, xq.scale, wq.data, wq.scale)
        ctx.sizes, ctx.scale, ctx.grad, ctx.w_dtype = sizes, scale, grad, w.dtype
        return y  # (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        sizes = ctx.sizes
        dyq = fp8_grouped.quantise_grouped(dy.contiguous(), sizes, dtype=ctx.grad)  # (M, N), (G,) scales
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t = w_data.transpose(1, 2).contiguous()  # (G, K, N): Ŵᵀ row-major, a copy of bytes
            dx = grouped.scaled_grouped_mm(dyq.data, w_t, dyq.scale, w_scale, sizes, dy.dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            place, padded = grouped.aligned_rows(sizes, dy.device)
            dy_t = fp8_grouped.transposed_grouped(dyq, place, sum(padded))  # (N, M')
            x_t = fp8_grouped.transposed_grouped(fp8_gemm.Quantised(x_data, x_scale), place, sum(padded))  # (K, M')
            dw = grouped.scaled_grouped_weight_grad(dy_t.data, x_t.data, dyq.scale, x_scale, padded, dy.dtype)
            dw = dw.to(ctx.w_dtype)  # (G, N, K)
            if ctx.scale != 1.0:
                dw.mul_(ctx.scale)
        return dx, dw, None, None, None


def expert_parameters(module: nn.Module, replicated_over_data: bool | None = None) -> list[nn.Parameter]:
    """Every expert weight of ``module``; with ``replicated_over_data`` False (True), only those of
    layers whose expert layout does not (does) hold replicas over data — the ones ZeRO leaves whole
    on the rank that holds them (shards like any replicated parameter)."""
    return [
        p
        for m in module.modules()
        if isinstance(m, GridExperts) and replicated_over_data in (None, "data" in m.layout.dp)
        for p in m.parameters()
    ]
