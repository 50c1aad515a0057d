"""A pre-norm transformer block on the grid and its single-process reference.

    x = x + attention(norm1(x));  x = x + mlp(norm2(x))

``recompute`` chooses what the block keeps for backward (axon4d.nn.recompute, docs/design.md §5):
"none", "selective" (core attention re-run from q, k, v), "balanced" (the norms' normalisation and
the MLP activation re-run inside the backward of the GEMM that consumes them; statistics kept), or
"full" (only the block input kept; the whole forward, collectives included, re-run in backward).

``context_parallel`` (docs/context.md): the block's rows are head–tail chunks of sequences split
over z; only attention differs (``axon4d.nn.context``; "ring": ``axon4d.nn.context_ring``), norms
and MLP are untouched.

Everything stays in the residual-stream layout (b, s, hidden/G_x), replicated over y: the QKV and
MLP-up projections are normal layers, the attention-output and MLP-down projections transposed
(docs/design.md §2), so a block issues no redistribution at all.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from axon4d.config import ModelConfig
from axon4d.data.documents import Documents
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.nn.attention import Attention, DenseAttention
from axon4d.nn.linear import Linear
from axon4d.nn.mlp import MLP, DenseMLP
from axon4d.nn.moe import MoE
from axon4d.nn.moe_dense import DenseMoE
from axon4d.nn.norm import SplitFeatureNorm, dense_norm_for, norm_for
from axon4d.nn.recompute import recompute_block, recomputed_input
from axon4d.options.context_mode import context_mode
from axon4d.options.precision import compute_dtype
from axon4d.options.recompute_mode import Recompute, check_recompute


class DenseBlock(nn.Module):
    """The single-process reference block; ``moe`` says whether its FFN is ``DenseMoE`` (None: when
    ``cfg.moe``; a model passes ``cfg.moe_block(i)``, so the first ``cfg.first_k_dense`` stay dense)."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        moe: bool | None = None,
    ):
        super().__init__()
        bias = cfg.arch == "gpt"
        rope = cfg.rope_theta if cfg.arch == "llama" else None
        self.norm1 = dense_norm_for(cfg, device=device, dtype=dtype)
        self.norm2 = dense_norm_for(cfg, device=device, dtype=dtype)
        self.attn = DenseAttention(cfg.hidden, cfg.n_heads, cfg.kv_heads, bias, rope, device=device, dtype=dtype)
        self.mlp: nn.Module = (
            DenseMoE(cfg, device=device, dtype=dtype)
            if (cfg.moe if moe is None else moe)
            else DenseMLP(cfg.hidden, cfg.ffn, cfg.gated, bias, device=device, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), documents)
        return x + self.mlp(self.norm2(x))


class TransformerBlock(nn.Module):
    """One GPT or Llama block on the 4D grid: (b, s, hidden/G_x) → (b, s, hidden/G_x). ``moe``: whether
    its FFN is an MoE layer (None: when ``cfg.moe``; a model passes ``cfg.moe_block(i)``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        recompute: str = "none",
        context_parallel: bool | str = False,
        context_parallel_axes: str = "z",
        moe: bool | None = None,
    ):
        super().__init__()
        self.grid = grid = runtime.resolve(grid)
        self.cfg = cfg
        moe = cfg.moe if moe is None else moe
        if moe and context_parallel and cfg.moe_seq_aux_coef:  # the same ValueError on every rank
            raise ValueError(
                "moe_seq_aux_coef > 0 (the sequence-wise balance loss) needs whole sequences on a rank; "
                "under context parallelism z splits them: use context_parallel=False or moe_seq_aux_coef=0"
            )
        self.recompute = check_recompute(recompute)
        self.context_parallel = context_mode(context_parallel) is not None  # True, "all-gather" or "ring"
        bias = cfg.arch == "gpt"
        rope = cfg.rope_theta if cfg.arch == "llama" else None
        self.norm1 = norm_for(cfg, grid=grid, device=device, dtype=dtype)
        self.norm2 = norm_for(cfg, grid=grid, device=device, dtype=dtype)
        self.attn = Attention(
            cfg.hidden,
            cfg.n_heads,
            cfg.kv_heads,
            bias=bias,
            rope_theta=rope,
            grid=grid,
            device=device,
            dtype=dtype,
            recompute_core=self.recompute == Recompute.SELECTIVE,
            context_parallel=context_parallel,
            context_parallel_axes=context_parallel_axes,
        )
        #: the FFN sublayer: the dense MLP, or with ``cfg.n_experts`` a Mixture-of-Experts (docs/moe.md)
        self.mlp: MLP | MoE = (
            MoE(cfg, grid=grid, device=device, dtype=dtype, recompute_activation=self.recompute == Recompute.BALANCED)
            if moe
            else MLP(
                cfg.hidden,
                cfg.ffn,
                gated=cfg.gated,
                bias=bias,
                grid=grid,
                device=device,
                dtype=dtype,
                recompute_activation=self.recompute == Recompute.BALANCED,
            )
        )

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``documents``: the packed layout of this rank's rows (``axon4d.nn.attention.Attention``)."""
        fn = self._forward if documents is None else partial(self._forward, documents=documents)
        if self.recompute == Recompute.FULL:
            return recompute_block(fn, x, scheduler=self.grid.scheduler, layers=self.linears())
        return fn(x)

    def linears(self) -> list[Linear]:
        """The block's 3D layers, in forward order."""
        if isinstance(self.mlp, MoE):
            shared = self.mlp.shared
            return [self.attn.qkv, self.attn.out] + ([shared.up, shared.down] if shared is not None else [])
        return [self.attn.qkv, self.attn.out, self.mlp.up, self.mlp.down]

    def _forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        attn = self.attn if documents is None else partial(self.attn, documents=documents)
        x = x + self._sublayer(self.norm1, attn, self.attn.qkv.weight, x)
        first = self.mlp.router.weight if isinstance(self.mlp, MoE) else self.mlp.up.weight
        return x + self._sublayer(self.norm2, self.mlp, first, x)

    def _sublayer(
        self, norm: SplitFeatureNorm, body: Callable[[torch.Tensor], torch.Tensor], first: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """``body(norm(x))``; under balanced recomputation ``body``'s first GEMM (of weight ``first``)
        keeps ``x`` and the norm's statistics instead of the normalised activations."""
        if self.recompute != Recompute.BALANCED:
            return body(norm(x))
        dtype = compute_dtype(self.grid.precision, first)  # what ``first``'s GEMM multiplies in

        def normalize(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
            return norm.normalize(x, stats).to(dtype)

        with recomputed_input(normalize, x, norm.statistics(x)) as h:
            return body(h)

    @torch.no_grad()
    def load_dense_(self, dense: DenseBlock) -> TransformerBlock:
        self.norm1.load_dense_(dense.norm1)
        self.norm2.load_dense_(dense.norm2)
        self.attn.load_dense_(dense.attn)
        self.mlp.load_dense_(dense.mlp)  # type: ignore[arg-type]
        return self

    def to_dense(self, grads: bool = False) -> DenseBlock:
        p = self.attn.qkv.weight
        dense = DenseBlock(self.cfg, device=p.device, dtype=p.dtype, moe=isinstance(self.mlp, MoE))
        dense.norm1, dense.norm2 = self.norm1.to_dense(grads), self.norm2.to_dense(grads)
        dense.attn, dense.mlp = self.attn.to_dense(grads), self.mlp.to_dense(grads)
        return dense
