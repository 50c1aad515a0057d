"""Causal attention across a sequence split over z: context parallelism (docs/context.md).

Under context parallelism (``axon4d.activations.shard_sequence``) a sequence of S tokens is cut into
2·G_z chunks of C = S/(2·G_z) and z-rank r holds chunks r and 2·G_z−1−r, head then tail. Every
linear layer, norm and MLP works on those 2·C rows unchanged; only attention needs the keys and
values of earlier positions, which live on other z-ranks.

Query chunk c attends to keys [0, (c+1)·C) in two parts, merged exactly by their log-sum-exps:

- the **diagonal**: chunk c against its own keys, causal within the C × C square — both of a rank's
  chunks are local, so this needs nothing from other ranks;
- the **prefix**: chunk c against keys [0, c·C), every one visible (no mask); chunk 0 has none.

    out = e^(lse_d − lse)·out_d + e^(lse_p − lse)·out_p,   lse = log(e^lse_d + e^lse_p)

Rank r's parts read C + C + r·C + (2·G_z−1−r)·C = (2·G_z+1)·C keys: the causal balance. Neither
part needs a mask tensor, so every device runs them in its fused kernel
(``axon4d.device.attention.attention_with_lse``); grouped-query heads are repeated for it and their
gradients summed back.

The keys and values of the prefixes live on other z-ranks. Each rank all-gathers over z the keys
(already rotated at their global positions) and values of its *own* key/value heads — n_kv/G_y
heads, so GQA shrinks the traffic by n/n_kv — in one collective (``Term.CP_KV``, tag ``cp_kv``),
issued as soon as k and v exist and waited on only after the diagonals, which run while it is in
flight::

    forward:   |-- all-gather K,V (z) --|
               |- diag c_r -|- diag c_t -|wait|- prefix c_r -|- prefix c_t -|- merge -|
    backward:  |- prefix c_r -|- prefix c_t -|-- reduce-scatter dK,dV (z) --|
                                             |- diag c_r -|- diag c_t -|wait|- add -|

Backward uses the standard identity of fused attention kernels: a part's backward, given the
*merged* out and lse, yields exactly that part's dq, dk, dv. The prefixes' gradients of the gathered
keys and values are reduce-scattered over z (``Term.CP_KV_GRAD``, tag ``cp_kv.grad``), so each rank
receives, for its own tokens, the sum of what every rank's queries contributed; the diagonals'
gradients, which stay on this rank, are computed while that reduce-scatter is in flight and added
to its result.

Bytes per layer and rank, each way (forward all-gather, backward reduce-scatter), for b sequences
of S tokens, head_dim d and element size e:  2 · b · S · (n_kv/G_y) · d · e · (G_z−1)/G_z.
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.activations import sequence_chunks, sequence_order
from axon4d.device import attention as kernels
from axon4d.geometry import Term
from axon4d.grid import Grid

Part = tuple[torch.Tensor, torch.Tensor]  # (out (b, hq, C, d), lse (b, hq, C))


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads (b, hkv, L, d) repeated for their ``groups`` query heads each: (b, hkv·groups, L, d)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat``: (b, hkv·groups, L, d) summed over each group → (b, hkv, L, d)."""
    return g if groups == 1 else g.unflatten(1, (-1, groups)).sum(2)


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Part:
    """One part's attention and log-sum-exp, k and v of their own (fewer) heads."""
    groups = q.shape[1] // k.shape[1]
    return kernels.attention_with_lse(q, _repeat(k, groups), _repeat(v, groups), causal)


def _part_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, merged: Part, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This part's (dq, dk, dv) from the merged out and lse of its query chunk (module docstring)."""
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = kernels.attention_with_lse_backward(
        grad, q, _repeat(k, groups), _repeat(v, groups), merged[0], merged[1], causal
    )
    return dq, _fold(dk, groups), _fold(dv, groups)


def _merge(diagonal: Part, prefix: Part | None) -> Part:
    """The attention over both parts' keys, from each part's out and lse (module docstring)."""
    if prefix is None:
        return diagonal
    (out_d, lse_d), (out_p, lse_p) = diagonal, prefix
    lse = torch.logaddexp(lse_d, lse_p)
    out = (lse_d - lse).exp().unsqueeze(-1) * out_d.float() + (lse_p - lse).exp().unsqueeze(-1) * out_p.float()
    return out.to(out_d.dtype), lse


def _prefixes(
    q: list[torch.Tensor], k_full: torch.Tensor, v_full: torch.Tensor, chunks: tuple[int, int]
) -> list[Part | None]:
    """Each query chunk's prefix part (None for chunk 0), keys (b, hkv, S, d) in global order."""
    c = q[0].shape[2]
    return [
        _part(qh, k_full.narrow(2, 0, chunk * c), v_full.narrow(2, 0, chunk * c), False) if chunk else None
        for qh, chunk in zip(q, chunks)
    ]


def _diagonals(q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor]) -> list[Part]:
    return [_part(qh, kh, vh, True) for qh, kh, vh in zip(q, k, v)]


class _SplitAttention(torch.autograd.Function):
    """Causal attention of a rank's two query chunks in diagonal and prefix parts (module docstring).
    With a ``grid``, k and v are this rank's (b, hkv, 2·C, d) and are all-gathered over z, overlapped
    with the diagonals; without one, they are the whole sequence's (b, hkv, S, d) in global order."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: Grid | None,
        chunks: tuple[int, int],
        recompute: bool,
    ) -> torch.Tensor:
        c = q.shape[2] // 2
        qs = [q.narrow(2, 0, c), q.narrow(2, c, c)]
        if grid is None:
            k_full, v_full = k, v
            diagonal = _diagonals(qs, *_chunk_slices(k_full, v_full, chunks, c))
        else:
            kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)  # (2·C, 2, b, hkv, d): tokens first
            gathering = grid.comm.all_gather(kv, "z", dim=0, tag=Term.CP_KV)  # in flight during the diagonals
            diagonal = _diagonals(qs, [k.narrow(2, 0, c), k.narrow(2, c, c)], [v.narrow(2, 0, c), v.narrow(2, c, c)])
            full = gathering.wait()  # (S, 2, b, hkv, d), z-rank order
            order = sequence_order(full.shape[0], grid.size("z"), full.device)
            k_full, v_full = full.permute(1, 2, 3, 0, 4).index_select(3, order).unbind(0)  # global order
        merged = [_merge(d, p) for d, p in zip(diagonal, _prefixes(qs, k_full, v_full, chunks))]
        out = torch.cat([m[0] for m in merged], dim=2)
        ctx.grid, ctx.chunks, ctx.recompute = grid, chunks, recompute
        if recompute:  # selective recomputation: q and the gathered keys and values only
            ctx.save_for_backward(q, k_full, v_full)
        else:
            ctx.save_for_backward(q, k_full, v_full, out, torch.cat([m[1] for m in merged], dim=2))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_full, v_full, *kept = ctx.saved_tensors
        grid, chunks = ctx.grid, ctx.chunks
        c = q.shape[2] // 2
        qs = [q.narrow(2, 0, c), q.narrow(2, c, c)]
        ks, vs = _chunk_slices(k_full, v_full, chunks, c)
        if ctx.recompute:  # the forward's parts again, from the kept keys and values: no all-gather
            diagonal = _diagonals(qs, ks, vs)
            merged = [_merge(d, p) for d, p in zip(diagonal, _prefixes(qs, k_full, v_full, chunks))]
        else:
            out, lse = kept
            merged = [(out.narrow(2, h * c, c), lse.narrow(2, h * c, c)) for h in range(2)]
        grads = [g.contiguous() for g in (grad.narrow(2, 0, c), grad.narrow(2, c, c))]
        dq: list[torch.Tensor] = [torch.zeros_like(qh) for qh in qs]
        dk_full, dv_full = torch.zeros_like(k_full), torch.zeros_like(v_full)  # the prefixes' share
        for h, chunk in enumerate(chunks):
            if chunk:
                keys = chunk * c
                dq_p, dk, dv = _part_backward(
                    grads[h], qs[h], k_full.narrow(2, 0, keys), v_full.narrow(2, 0, keys), merged[h], False
                )
                dq[h] += dq_p
                dk_full.narrow(2, 0, keys).add_(dk)
                dv_full.narrow(2, 0, keys).add_(dv)
        if grid is not None:  # back to z-rank order, reduce-scattered over z during the diagonals
            order = sequence_order(k_full.shape[2], grid.size("z"), k_full.device)
            dkv = torch.stack([dk_full, dv_full]).index_select(3, torch.argsort(order)).permute(3, 0, 1, 2, 4)
            scattering = grid.comm.reduce_scatter(dkv, "z", dim=0, tag=Term.CP_KV_GRAD)
        diagonal_grads = []
        for h in range(2):
            dq_d, dk, dv = _part_backward(grads[h], qs[h], ks[h], vs[h], merged[h], True)
            dq[h] += dq_d
            diagonal_grads.append((dk, dv))
        dq_all = torch.cat(dq, dim=2)
        if grid is None:  # the whole sequence's keys and values: the diagonals' share at their chunks
            for (dk, dv), chunk in zip(diagonal_grads, chunks):
                dk_full.narrow(2, chunk * c, c).add_(dk)
                dv_full.narrow(2, chunk * c, c).add_(dv)
            return dq_all, dk_full, dv_full, None, None, None
        mine = scattering.wait().permute(1, 2, 3, 0, 4)  # (2, b, hkv, 2·C, d): this rank's tokens
        dk_local = mine[0] + torch.cat([g[0] for g in diagonal_grads], dim=2)
        dv_local = mine[1] + torch.cat([g[1] for g in diagonal_grads], dim=2)
        return dq_all, dk_local, dv_local, None, None, None


def _chunk_slices(
    k_full: torch.Tensor, v_full: torch.Tensor, chunks: tuple[int, int], c: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The keys and values of global chunks ``chunks`` (each ``c`` tokens) of the whole sequence's."""
    return [k_full.narrow(2, ch * c, c) for ch in chunks], [v_full.narrow(2, ch * c, c) for ch in chunks]


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, int]) -> torch.Tensor:
    """Causal attention of a rank's two query chunks q (b, hq, 2·C, d), global chunk indices
    ``chunks``, against the whole sequence's keys and values (b, hkv, S, d) in global order: chunk c
    sees keys [0, (c+1)·C), its own causally — the split attention without its collectives (what one
    rank computes once the keys and values are gathered). Returns (b, hq, 2·C, d); grouped-query
    attention (hkv < hq) is read from the shapes."""
    _check_heads(q, k)
    return _SplitAttention.apply(q, k, v, None, chunks, False)


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads and {k.shape[1]} key/value heads: each key/value head serves a whole "
            "group of query heads, so the query heads must be a multiple of the key/value heads"
        )


def split_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, recompute_core: bool = False
) -> torch.Tensor:
    """softmax(q kᵀ/√d, causal) v for this rank's tokens of sequences split head–tail over z:
    q (b, hq, 2·C, d), k and v (b, hkv, 2·C, d), positions already applied (rotary at global
    positions). Returns (b, hq, 2·C, d). Communicates over z: the all-gather of k and v (overlapped
    with the diagonal parts) and, in backward, the reduce-scatter of their gradients (overlapped with
    the diagonals' backward). With ``recompute_core`` only q and the gathered keys and values are
    kept; the attention is recomputed in backward (the all-gather is not run again)."""
    if q.shape[2] % 2:
        raise ValueError(
            f"a rank holds {q.shape[2]} tokens per sequence, but under context parallelism it holds two equal "
            "chunks (an even count): shard the sequences with axon4d.activations.shard_sequence"
        )
    _check_heads(q, k)
    chunks = sequence_chunks(grid.coord("z"), grid.size("z"))
    return _SplitAttention.apply(q, k, v, grid, chunks, recompute_core)
