"""A pre-norm transformer block on the grid and its single-process reference.

    x = x + attention(norm1(x));  x = x + mlp(norm2(x))

Everything stays in the residual-stream layout (b, s, hidden/G_x), replicated over y: the QKV and
MLP-up projections are normal layers, the attention-output and MLP-down projections transposed
(docs/design.md §2), so a block issues no redistribution at all.
"""

from __future__ import annotations

import torch
from torch import nn

from axon4d import runtime
from axon4d.grid import Grid
from axon4d.config import ModelConfig
from axon4d.nn.attention import Attention, DenseAttention
from axon4d.nn.mlp import MLP, DenseMLP
from axon4d.nn.norm import LayerNorm, RMSNorm


def _dense_norm(cfg: ModelConfig, device: str | torch.device | None, dtype: torch.dtype | None) -> nn.Module:
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, device=device, dtype=dtype)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, device=device, dtype=dtype)


def _norm(cfg: ModelConfig, grid: Grid, device: str | torch.device | None, dtype: torch.dtype | None) -> nn.Module:
    if cfg.arch == "llama":
        return RMSNorm(cfg.hidden, eps=cfg.norm_eps, grid=grid, device=device, dtype=dtype)
    return LayerNorm(cfg.hidden, eps=cfg.norm_eps, grid=grid, device=device, dtype=dtype)


class DenseBlock(nn.Module):
    """The single-process reference block."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        bias = cfg.arch == "gpt"
        rope = cfg.rope_theta if cfg.arch == "llama" else None
        self.norm1, self.norm2 = _dense_norm(cfg, device, dtype), _dense_norm(cfg, device, dtype)
        self.attn = DenseAttention(cfg.hidden, cfg.n_heads, cfg.kv_heads, bias, rope, device=device, dtype=dtype)
        self.mlp = DenseMLP(cfg.hidden, cfg.ffn, cfg.gated, bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerBlock(nn.Module):
    """One GPT or Llama block on the 4D grid: (b, s, hidden/G_x) → (b, s, hidden/G_x)."""

    def __init__(self, cfg: ModelConfig, *, grid: Grid | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.grid = grid = runtime.resolve(grid)
        self.cfg = cfg
        bias = cfg.arch == "gpt"
        rope = cfg.rope_theta if cfg.arch == "llama" else None
        self.norm1, self.norm2 = _norm(cfg, grid, device, dtype), _norm(cfg, grid, device, dtype)
        self.attn = Attention(cfg.hidden, cfg.n_heads, cfg.kv_heads, bias=bias, rope_theta=rope,
                              grid=grid, device=device, dtype=dtype)
        self.mlp = MLP(cfg.hidden, cfg.ffn, gated=cfg.gated, bias=bias, grid=grid, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    @torch.no_grad()
    def load_dense_(self, dense: DenseBlock) -> "TransformerBlock":
        self.norm1.load_dense_(dense.norm1)
        self.norm2.load_dense_(dense.norm2)
        self.attn.load_dense_(dense.attn)
        self.mlp.load_dense_(dense.mlp)
        return self

    def to_dense(self, grads: bool = False) -> DenseBlock:
        p = self.mlp.down.weight
        dense = DenseBlock(self.cfg, device=p.device, dtype=p.dtype)
        dense.norm1, dense.norm2 = self.norm1.to_dense(grads), self.norm2.to_dense(grads)
        dense.attn, dense.mlp = self.attn.to_dense(grads), self.mlp.to_dense(grads)
        return dense
