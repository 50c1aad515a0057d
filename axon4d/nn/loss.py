"""Vocabulary-parallel cross-entropy: the loss over logits split over an axis, never gathered
(docs/design.md §2, edges: LM head and loss).

Logits arrive as (…, vocab/G) on each rank of ``axis`` (the output of the LM head, a normal
Linear whose output features — the vocabulary — are split over y). Per token:

    lse   = log Σ_ranks exp(lse_local)          (all-gather of one number per token over axis)
    loss  = lse − logit[target]                 (the target's logit lives on one rank: all-reduce)
    dlogits_local = softmax_local − onehot_local

The result is the mean over this rank's tokens (DDP convention: parameter gradients are then
averaged over batch = data × z by the layers). Without a grid the logits hold the whole vocabulary
and nothing is communicated: the same chunked loss over logits a model computed whole (``axon4d
train --hf`` with a tied head).

Memory: the logits are kept for backward in their own dtype, and both passes work through them in
row chunks (``CHUNK_BYTES`` of fp32 per chunk): the forward's local log-sum-exp widens one chunk
at a time, and the backward writes the gradient chunk by chunk into one tensor of the logits'
dtype. Beyond the logits and their gradient the loss holds at most two fp32 chunks at once
(forward: the widened chunk and logsumexp's exp; backward: one chunk, none for fp32 logits, whose
gradient is computed in place in the result) — never a full fp32 copy of the logits.
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term
from axon4d.nn.embedding import check_token_ids

#: fp32 bytes of one row chunk of the logits: bounds the loss's temporaries (two such chunks at most)
CHUNK_BYTES = 32 * 2**20


def chunk_rows(v_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows (tokens) of (n, v_local) logits one chunk holds: ``chunk_bytes`` of fp32, at least one row."""
    return max(1, chunk_bytes // (4 * max(v_local, 1)))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        axis: Axis,
        grid: Grid | None,
        ignore_index: int,
        chunk_bytes: int,
    ) -> torch.Tensor:
        n, v_local = logits.shape  # (n, v_local)
        lo = 0 if grid is None else grid.coord(axis) * v_local
        rows = chunk_rows(v_local, chunk_bytes)
        lse_local = torch.empty(n, dtype=torch.float32, device=logits.device)  # (n,)
        for i in range(0, n, rows):  # one fp32 chunk at a time
            torch.logsumexp(logits[i : i + rows].float(), dim=-1, out=lse_local[i : i + rows])
        lse = lse_local  # (n,): over the whole vocabulary when it is all here
        if grid is not None:
            lse_all = grid.comm.all_gather(lse_local.unsqueeze(0), axis, dim=0, tag=Term.CE_LSE).wait()  # (G, n)
            lse = torch.logsumexp(lse_all, dim=0)
        valid = targets != ignore_index
        mine = valid & (targets >= lo) & (targets < lo + v_local)
        idx = torch.where(mine, targets - lo, torch.zeros_like(targets))
        target_logit = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1).float() * mine  # (n,)
        if grid is not None:
            target_logit = grid.comm.all_reduce(target_logit.contiguous(), axis, tag=Term.CE_TARGET).wait()
        count = valid.sum().clamp_min(1)
        loss = ((lse - target_logit) * valid).sum() / count
        ctx.save_for_backward(logits, lse, idx, mine, valid)
        ctx.count, ctx.rows = count, rows
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, lse, idx, mine, valid = ctx.saved_tensors
        n, rows = logits.shape[0], ctx.rows
        grad = torch.empty_like(logits)  # (n, v_local) in the logits' dtype
        scale = valid.to(torch.float32) * (g.float() / ctx.count)  # (n,): d loss / d logit row
        wide = logits.dtype == torch.float32  # then each chunk is computed in place in ``grad``
        for i in range(0, n, rows):
            j = min(i + rows, n)
            out = grad[i:j] if wide else None
            # softmax over the full vocabulary, this rank's part: exp(logit − lse), fp32 (rows, v_local)
            p = torch.sub(logits[i:j], lse[i:j].unsqueeze(-1), out=out).exp_()
            p.scatter_add_(-1, idx[i:j].unsqueeze(-1), -mine[i:j].unsqueeze(-1).to(p.dtype))  # − onehot
            p.mul_(scale[i:j].unsqueeze(-1))
            if not wide:
                grad[i:j].copy_(p)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grid: Grid | None,
    axis: Axis = "y",
    ignore_index: int = -100,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Mean cross-entropy over this rank's tokens of logits whose last dim is split over ``axis``.

    ``logits``: (…, vocab/G_axis), or (…, vocab) with ``grid`` None (no communication);
    ``targets``: (…) global token ids in [0, vocab) or ``ignore_index`` (checked: one host sync,
    no communication). Equals
    ``F.cross_entropy(full_logits, targets)`` without any rank holding the full logits, nor a
    full fp32 copy of its own: the local logits are processed in row chunks of ``chunk_bytes``
    fp32 bytes (module docstring).
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(
            f"chunk_bytes = {chunk_bytes!r} must be a positive whole number of bytes (fp32 temporaries per row chunk), "
            f"e.g. the default {CHUNK_BYTES}"
        )
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the token dims; "
            "give one target per token: targets.shape == logits.shape[:-1]"
        )
    vocab = logits.shape[-1] * (1 if grid is None else grid.size(axis))
    check_token_ids(targets, vocab, "targets", ignore_index=ignore_index)
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, targets.reshape(-1), axis, grid, ignore_index, chunk_bytes)
