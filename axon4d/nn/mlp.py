"""The transformer MLP on the grid: up-projection normal, down-projection transposed (docs/design.md §2).

GELU: up (hidden → ffn, ffn over y), GELU, down (ffn over y → hidden over x). SwiGLU: the gate
and up projections are fused into one normal Linear whose output features are ordered so that
y-rank j's chunk is [gate_j | up_j] (``rectangles.FusedRows``); silu(gate)·up then needs no communication.

``recompute_activation`` (balanced recomputation, axon4d.nn.recompute): the down projection keeps
the up projection's output instead of the activation's, and re-runs the activation in its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axon4d.grid import rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import rectangles
from axon4d.nn.linear import Linear
from axon4d.nn.recompute import recomputed_input


class DenseMLP(nn.Module):
    """The single-process reference MLP."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        gated: bool,
        bias: bool,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        kw: dict[str, Any] = dict(bias=bias, device=device, dtype=dtype)
        self.gated = gated
        self.up = nn.Linear(hidden, ffn, **kw)
        self.gate = nn.Linear(hidden, ffn, **kw) if gated else None
        self.down = nn.Linear(ffn, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class MLP(nn.Module):
    """GELU or SwiGLU MLP on (…, hidden/G_x) activations replicated over y."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        *,
        gated: bool = False,
        bias: bool = True,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        recompute_activation: bool = False,
    ):
        super().__init__()
        self.grid = grid = runtime.resolve(grid)
        rules.count(hidden, "hidden", example=1024)
        rules.count(ffn, "ffn", example=4096)
        rules.mlp(ffn).check(grid.shape)
        self.hidden, self.ffn, self.gated = hidden, ffn, gated
        self.recompute_activation = recompute_activation
        kw: dict[str, Any] = dict(grid=grid, device=device, dtype=dtype)
        self.up = Linear(hidden, 2 * ffn if gated else ffn, bias=bias, transpose=False, **kw)
        self.down = Linear(ffn, hidden, bias=bias, transpose=True, **kw)
        #: gate | up interleaved by y group (checkpoints store the two apart); None for GELU
        self.up_rows = rectangles.FusedRows((("gate", ffn), ("up", ffn)), grid.size("y")) if gated else None
        self.up.fused_rows = self.up_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (…, ffn/G_y) or (…, 2·ffn/G_y) = [gate_j | up_j]
        if self.recompute_activation:
            with recomputed_input(self.activation, h) as a:
                return self.down(a)  # (…, hidden/G_x)
        return self.down(self.activation(h))  # (…, hidden/G_x)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """GELU of the up projection's output, or silu(gate)·up of its [gate_j | up_j] halves (local)."""
        if self.up_rows is not None:
            gate, up = self.up_rows.local(h, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h)

    @torch.no_grad()
    def load_dense_(self, dense: DenseMLP) -> MLP:
        if self.up_rows is not None:
            assert dense.gate is not None
            self.up.load_dense_(*self.up_rows.fuse_dense([dense.gate, dense.up]))
        else:
            self.up.load_dense_(dense.up.weight, dense.up.bias)
        self.down.load_dense_(dense.down.weight, dense.down.bias)
        return self

    def to_dense(self, grads: bool = False) -> DenseMLP:
        p = self.down.weight
        dense = DenseMLP(self.hidden, self.ffn, self.gated, self.down.bias is not None, device=p.device, dtype=p.dtype)
        up = self.up.to_dense(grads)
        if self.up_rows is not None:
            assert dense.gate is not None
            self.up_rows.split_into_(up, [dense.gate, dense.up], grads)
        else:
            dense.up = up
        dense.down = self.down.to_dense(grads)
        return dense
