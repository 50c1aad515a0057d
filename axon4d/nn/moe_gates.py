"""The gate arithmetic of an MoE layer's combine (docs/moe.md, "The exchange"): the experts
multiply each output row by its gate before it travels home (``gated``), and the home rank sums
each token's k gated rows (``summed_pairs``) — custom autograd functions that keep less for
backward than autograd's own product and sum would.
"""

from __future__ import annotations

from typing import Any

import torch


class _SummedPairs(torch.autograd.Function):
    """Forward: the rows of ``back`` taken in ``index`` order, (T·k, F), summed over each token's k
    consecutive rows: (T, F). Backward: each token's gradient to its k rows, put back where
    ``index`` took them. The index is held by the node, not saved for backward: nothing of the
    gated sum is a saved tensor, so a fully recomputed block's re-run stops before it (and before
    the combines that feed it)."""

    @staticmethod
    def forward(ctx: Any, back: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
        ctx.index, ctx.k = index, k
        pairs = back.index_select(0, index)  # (T·k, F) in token order
        return pairs.view(-1, k, pairs.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        k, index = ctx.k, ctx.index
        each = g.unsqueeze(1).expand(-1, k, -1).reshape(-1, g.shape[-1])  # (T·k, F) in token order
        return torch.empty_like(each).index_copy_(0, index, each), None, None


def summed_pairs(back: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """(T, F): ``back``'s rows in ``index`` order (a permutation of its T·k rows), each token's k
    rows summed — the gated sum of an MoE layer's outputs (``_SummedPairs``)."""
    return _SummedPairs.apply(back, index, k)


class _Gated(torch.autograd.Function):
    """Forward: each of the experts' output rows (n, F) times its gate (n,) fp32, cast to the rows'
    dtype. Backward: the gates' gradient summed over each row's features (rounded as autograd's
    product would, and the single-process reference's), then the rows' gradient scaled in place of
    the incoming one (the combine's reverse exchange's buffer, which nothing else reads): one (n, F)
    tensor fewer than autograd's product makes."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        cast = gates.to(out.dtype)
        ctx.save_for_backward(out, cast)
        ctx.gate_dtype = gates.dtype
        return out * cast.unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        out, cast = ctx.saved_tensors
        d_gates = (g * out).sum(dim=-1)  # (n,): Σ_f g·out per row, summed as a product's broadcast gradient is
        d_out = g.mul_(cast.unsqueeze(-1)) if g.is_contiguous() else g * cast.unsqueeze(-1)
        return d_out, d_gates.to(ctx.gate_dtype)


def gated(out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """(n, F) rows ``out`` each times its gate of ``gates`` (n,) (``_Gated``)."""
    return _Gated.apply(out, gates)
