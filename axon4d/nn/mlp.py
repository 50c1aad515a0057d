"""The transformer MLP on the grid: up-projection normal, down-projection transposed (docs/design.md §2).

GELU: up (hidden → ffn, ffn over y), GELU, down (ffn over y → hidden over x). SwiGLU: the gate
and up projections are fused into one normal Linear whose output features are ordered so that
y-rank j's chunk is [gate_j | up_j]; silu(gate)·up then needs no communication.

``recompute_activation`` (balanced recomputation, axon4d.nn.recompute): the down projection keeps
the up projection's output instead of the activation's, and re-runs the activation in its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axon4d import rules, runtime
from axon4d.grid import Grid
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


def _gated_order(ffn: int, groups: int) -> torch.Tensor:
    """Row permutation taking cat(gate, up) to [gate_0 | up_0 | gate_1 | up_1 | …] by y group."""
    n = ffn // groups
    return torch.cat(
        [torch.cat([torch.arange(j * n, (j + 1) * n), ffn + torch.arange(j * n, (j + 1) * n)]) for j in range(groups)]
    )


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
        if gated:  # gate | up interleaved by y group: checkpoints store the two apart
            self.up.row_segments = (("gate", ffn), ("up", ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (…, ffn/G_y) or (…, 2·ffn/G_y) = [gate_j | up_j]
        if self.recompute_activation:
            with recomputed_input(self.activation, h) as a:
                return self.down(a)  # (…, hidden/G_x)
        return self.down(self.activation(h))  # (…, hidden/G_x)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """GELU of the up projection's output, or silu(gate)·up of its [gate_j | up_j] halves (local)."""
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h)

    @torch.no_grad()
    def load_dense_(self, dense: DenseMLP) -> MLP:
        if self.gated:
            assert dense.gate is not None
            order = _gated_order(self.ffn, self.grid.size("y"))
            w = torch.cat([dense.gate.weight, dense.up.weight])[order]
            b = torch.cat([dense.gate.bias, dense.up.bias])[order] if dense.up.bias is not None else None
            self.up.load_dense_(w, b)
        else:
            self.up.load_dense_(dense.up.weight, dense.up.bias)
        self.down.load_dense_(dense.down.weight, dense.down.bias)
        return self

    def to_dense(self, grads: bool = False) -> DenseMLP:
        p = self.down.weight
        dense = DenseMLP(self.hidden, self.ffn, self.gated, self.down.bias is not None, device=p.device, dtype=p.dtype)
        up = self.up.to_dense(grads)
        if self.gated:
            assert dense.gate is not None
            inverse = torch.argsort(_gated_order(self.ffn, self.grid.size("y")))
            for attr in ("weight", "bias"):
                t = getattr(up, attr)
                if t is None:
                    continue
                gate_part, up_part = t.detach()[inverse].split(self.ffn)
                getattr(dense.gate, attr).data.copy_(gate_part)
                getattr(dense.up, attr).data.copy_(up_part)
                if grads and t.grad is not None:
                    g_gate, g_up = t.grad[inverse].split(self.ffn)
                    getattr(dense.gate, attr).grad, getattr(dense.up, attr).grad = g_gate.clone(), g_up.clone()
        else:
            dense.up = up
        dense.down = self.down.to_dense(grads)
        return dense
