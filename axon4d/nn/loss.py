"""Vocabulary-parallel cross-entropy: the loss over logits split over an axis, never gathered
(docs/design.md §2, edges: LM head and loss).

Logits arrive as (…, vocab/G) on each rank of ``axis`` (the output of the LM head, a normal
Linear whose output features — the vocabulary — are split over y). Per token:

    lse   = log Σ_ranks exp(lse_local)          (all-gather of one number per token over axis)
    loss  = lse − logit[target]                 (the target's logit lives on one rank: all-reduce)
    dlogits_local = softmax_local − onehot_local

The result is the mean over this rank's tokens (DDP convention: parameter gradients are then
averaged over batch = data × z by the layers).
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.geometry import Term
from axon4d.grid import Grid
from axon4d.nn.embedding import check_token_ids
from axon4d.shape import Axis


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, axis: Axis, grid: Grid, ignore_index: int
    ) -> torch.Tensor:
        comm = grid.comm
        v_local = logits.shape[-1]
        lo = grid.coord(axis) * v_local
        lf = logits.float()  # (n, v_local)
        lse_local = torch.logsumexp(lf, dim=-1)  # (n,)
        lse_all = comm.all_gather(lse_local.unsqueeze(0).contiguous(), axis, dim=0, tag=Term.CE_LSE).wait()  # (G, n)
        lse = torch.logsumexp(lse_all, dim=0)  # (n,)
        valid = targets != ignore_index
        mine = valid & (targets >= lo) & (targets < lo + v_local)
        idx = torch.where(mine, targets - lo, torch.zeros_like(targets))
        target_logit = lf.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        target_logit = comm.all_reduce(target_logit.contiguous(), axis, tag=Term.CE_TARGET).wait()
        count = valid.sum().clamp_min(1)
        loss = ((lse - target_logit) * valid).sum() / count
        ctx.save_for_backward(logits, lse, idx, mine, valid)
        ctx.count = count
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, lse, idx, mine, valid = ctx.saved_tensors
        grad = torch.exp(logits.float() - lse.unsqueeze(-1))  # softmax over the full vocabulary, local part
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad *= (valid.to(grad.dtype) * (g / ctx.count)).unsqueeze(-1)
        return grad.to(logits.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, grid: Grid, axis: Axis = "y", ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over this rank's tokens of logits whose last dim is split over ``axis``.

    ``logits``: (…, vocab/G_axis); ``targets``: (…) global token ids in [0, vocab) or
    ``ignore_index`` (checked: one host sync, no communication). Equals
    ``F.cross_entropy(full_logits, targets)`` without any rank holding the full logits.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the token dims; "
            "give one target per token: targets.shape == logits.shape[:-1]"
        )
    check_token_ids(targets, logits.shape[-1] * grid.size(axis), "targets", ignore_index=ignore_index)
    return _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), axis, grid, ignore_index)
