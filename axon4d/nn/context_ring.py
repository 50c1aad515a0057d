"""Context parallelism's ring mode (pass-KV): keys and values stream around z, one rank's at a time.

The layout is the all-gather mode's (``axon4d.nn.context``, docs/context.md): z-rank r holds the
head and tail chunks r and 2·G_z−1−r of C = S/(2·G_z) tokens. Instead of gathering every rank's keys
and values, each rank packs its own (2 [k, v], b, hkv, 2·C, d) and passes it to the next z-rank,
G_z − 1 times: at ring step s a rank holds the keys and values of z-rank o = (z − s) mod G_z, its
chunks o and 2·G_z−1−o, and the shift that brings step s+1's is issued before step s's attention,
so it travels while the rank computes (the loop: ``axon4d.nn.ring_loop``, which the packed-documents
mode runs too). A rank holds two such buffers (the one it reads, the one arriving), whatever the
sequence's length: O(C), not O(S).

Which keys a query chunk sees follows from global chunk indices alone: query chunk q against key
chunk k is every key when k < q, causal when k = q, nothing when k > q. On step 0 (its own keys) a
rank's head chunk attends to its head causally, its tail to its head wholly and to its tail causally;
on every later step exactly two C × C blocks are visible — the head and the tail query against the
other rank's head when o < z, the tail query against both of its chunks (one kernel call of 2·C
keys) when o > z — so every rank does the same (2·G_z+1)·C keys' work, the all-gather mode's
balance. Each part runs in the fused kernel (``device.attention.attention_with_lse``, grouped-query
heads read from the shapes) and is merged into its query chunk's running output and log-sum-exp:

    lse = log(e^lse_run + e^lse_part),  out = e^(lse_run − lse)·out_run + e^(lse_part − lse)·out_part

kept in fp32, exact whatever order the parts come in.

Backward keeps no gathered keys either: from the saved merged output and lse (the fused kernels'
identity: a part's backward given the merged out and lse yields that part's dq, dk, dv) it runs the
ring again, passing with the keys and values an accumulator of their gradients: at step s a rank adds
what its queries contribute to the gradients of z-rank o's keys and values to the accumulator it
received from z−1 (which holds what the ranks before it contributed to the same o) and passes it on.
The accumulator arriving after step G_z − 1 is this rank's own, complete. Each step's accumulator
shift travels while the next step's gradients are computed (they are added to it only afterwards).

Bytes per layer and rank: forward G_z − 1 shifts of 2·b·(S/G_z)·hkv·d·e (``Term.CP_KV_RING``);
backward G_z − 1 of the keys and values again and G_z of their gradients (``Term.CP_KV_RING_GRAD``)
— the all-gather mode's (G_z−1)/G_z·2·b·S·hkv·d·e each way, plus one more pass of the keys and values
in backward and the last accumulator's trip home. Under selective recomputation the backward runs
the forward's ring once more first.
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.activations import sequence_chunks
from axon4d.device import attention as kernels
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.nn.context import Part, _chunks, _merge
from axon4d.nn.ring_loop import ring_backward, ring_forward

Span = tuple[int, int, bool]  # (first key chunk slot, how many slots, causal)


def visible(query_chunk: int, key_chunks: tuple[int, int]) -> list[Span]:
    """The parts of a z-rank's held key chunks ``key_chunks`` (global indices, head then tail) that
    global query chunk ``query_chunk`` attends to: earlier chunks wholly, its own causally, later
    ones not at all; adjacent whole slots form one span (one kernel call)."""
    spans: list[Span] = []
    for slot, key in enumerate(key_chunks):
        if key > query_chunk:
            continue
        causal = key == query_chunk
        if spans and not causal and not spans[-1][2] and spans[-1][0] + spans[-1][1] == slot:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1, False)
        else:
            spans.append((slot, 1, causal))
    return spans


def _keys(kv: torch.Tensor, span: Span, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a held (2, b, hkv, 2·C, d) buffer's keys and values of ``span``."""
    start, n, _ = span
    return kv[0].narrow(2, start * c, n * c), kv[1].narrow(2, start * c, n * c)


def _ring_forward(qs: list[torch.Tensor], kv: torch.Tensor, grid: Grid, c: int, axis: Axis) -> list[Part]:
    """Each query chunk's attention over the whole ring (module docstring): (out in fp32, lse)."""
    g_z = grid.size(axis)
    mine = sequence_chunks(grid.coord(axis), g_z)
    running: list[Part | None] = [None, None]

    def attend(held_kv: torch.Tensor, o: int) -> None:  # held_kv (2, b, hkv, 2·C, d): z-rank o's
        held = sequence_chunks(o, g_z)
        for h in range(2):
            for span in visible(mine[h], held):
                out, lse = kernels.attention_with_lse(qs[h], *_keys(held_kv, span, c), span[2])
                part = (out.float(), lse)
                now = running[h]
                running[h] = part if now is None else _merge([now, part])

    ring_forward(kv, grid, axis, attend)
    assert running[0] is not None and running[1] is not None  # step 0 always has the diagonals
    return [running[0], running[1]]


class _RingAttention(torch.autograd.Function):
    """Causal attention of a rank's two query chunks, keys and values passed around z (module
    docstring). k and v are this rank's (b, hkv, 2·C, d)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, recompute: bool, axis: Axis
    ) -> torch.Tensor:
        c, grouped = q.shape[2] // 2, q.shape[1] > k.shape[1]
        qs = _chunks(q, c, grouped)
        kv = torch.stack([k, v])  # (2, b, hkv, 2·C, d): what travels
        merged = _ring_forward(qs, kv, grid, c, axis)
        out = torch.cat([m[0] for m in merged], dim=2).to(q.dtype)
        ctx.grid, ctx.recompute, ctx.c, ctx.grouped, ctx.axis = grid, recompute, c, grouped, axis
        if recompute:  # selective recomputation: q and this rank's keys and values only
            ctx.save_for_backward(*qs, kv)
        else:
            ctx.save_for_backward(*qs, kv, out, torch.cat([m[1] for m in merged], dim=2))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grid, c, grouped, axis = ctx.grid, ctx.c, ctx.grouped, ctx.axis
        q_head, q_tail, kv, *kept = ctx.saved_tensors
        qs = [q_head, q_tail]
        if ctx.recompute:  # the forward's ring once more
            merged = [(out.to(q_head.dtype), lse) for out, lse in _ring_forward(qs, kv, grid, c, axis)]
        else:
            merged = list(zip(_chunks(kept[0], c, grouped), _chunks(kept[1], c, grouped)))
        g_z = grid.size(axis)
        mine = sequence_chunks(grid.coord(axis), g_z)
        grads = _chunks(grad, c, True)
        dq = [torch.zeros_like(qh) for qh in qs]

        def attend_backward(held_kv: torch.Tensor, dkv: torch.Tensor, o: int) -> None:
            held = sequence_chunks(o, g_z)  # held_kv and dkv (2, b, hkv, 2·C, d): z-rank o's
            for h in range(2):
                for span in visible(mine[h], held):
                    k, v = _keys(held_kv, span, c)
                    dq_p, dk, dv = kernels.attention_with_lse_backward(grads[h], qs[h], k, v, *merged[h], span[2])
                    dq[h] += dq_p
                    dk_at, dv_at = _keys(dkv, span, c)
                    dk_at.add_(dk)
                    dv_at.add_(dv)

        own = ring_backward(kv, grid, axis, attend_backward)  # (2, b, hkv, 2·C, d): all ranks' share
        return torch.cat(dq, dim=2), own[0], own[1], None, None, None


def ring_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, recompute_core: bool = False, axis: Axis = "z"
) -> torch.Tensor:
    """``axon4d.nn.context.split_sequence_attention``'s result (around ``axis``: z, or batch = z ×
    data for hierarchical context parallelism), the keys and values passed around z
    one rank's at a time instead of all-gathered (module docstring): q (b, hq, 2·C, d), k and v
    (b, hkv, 2·C, d) this rank's head–tail chunks, positions applied. Returns (b, hq, 2·C, d). With
    ``recompute_core`` only q, k and v are kept, and backward runs the forward's ring again."""
    if q.shape[2] % 2:
        raise ValueError(
            f"a rank holds {q.shape[2]} tokens per sequence, but under context parallelism it holds two equal "
            "chunks (an even count): shard the sequences with axon4d.activations.shard_sequence"
        )
    kernels.query_groups(q, k)
    return _RingAttention.apply(q, k, v, grid, recompute_core, axis)
