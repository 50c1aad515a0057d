"""Context parallelism over packed documents: attention split over z under a document mask, in both
modes (docs/context.md, "Packed documents").

The layout is the one ``axon4d.data.documents.Documents.chunks`` chose: z-rank r holds, of row i,
n chunks of C = S/(n·G_z) tokens (n = 4, or 2 where 4·G_z does not divide S) handed out by their
attention work, in global order. The keys and values reach the ranks as in the modes without
documents — all-gathered over z (``axon4d.nn.context``: the rank's own chunks attended while the
gather is in flight) or passed around z one rank's at a time (the ring of ``axon4d.nn.ring_loop``,
which ``axon4d.nn.context_ring`` runs too: the next shift issued before each step's kernels) — so
the traffic and the memory are those modes' own.
Hierarchical context parallelism runs the same over batch = z × data instead of z (``axis``).

What a query chunk sees of a key chunk comes from ``Documents.spans`` (host integers, computed
from the batch's document lengths before the step; no device read): a causal square per document
inside its own chunk, one whole block (rows of the document that holds its first token, against
that document's keys) in an earlier chunk, nothing in a later one. Each span runs in the fused
kernel of ``axon4d.device.attention.attention_with_lse`` on views of the query rows and key
columns — no mask tensor on any device — and is merged into the query rows' running output and
log-sum-exp (fp32):

    lse = log(e^lse_run + e^lse_span),  out = e^(lse_run − lse)·out_run + e^(lse_span − lse)·out_span

Rows start at lse = −∞, out = 0, and every row sees at least itself. Rows of a batch have their own
documents, so spans are per row (a kernel call attends one row's span). Backward runs the same spans
from the kept merged output and lse (a part's backward given the merged out and lse is that part's
share of the gradients) and sends the keys' and values' gradients back as the mode does: one
reduce-scatter over z, or an accumulator passed around z with the keys and values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from axon4d.data.documents import Documents
from axon4d.device import attention as kernels
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term
from axon4d.nn.context import _send_buffer
from axon4d.nn.ring_loop import ring_backward, ring_forward

#: one held key chunk of one row: (global chunk index, keys, values (1, hkv, C, d))
Held = tuple[int, torch.Tensor, torch.Tensor]
#: per row, per z-rank, the chunks it holds (``Documents.chunks``)
Layout = tuple[tuple[tuple[int, ...], ...], ...]


class _Running:
    """The running output (b, hq, n·C, d) fp32 and log-sum-exp (b, hq, n·C) of a rank's query rows."""

    def __init__(self, q: torch.Tensor):
        dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (the kernels' lse)
        self.out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)

    def merge(self, i: int, start: int, stop: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a part's (out (1, hq, n, d), lse (1, hq, n)) into row ``i``'s query rows start:stop."""
        run_out, run_lse = self.out[i : i + 1, :, start:stop], self.lse[i : i + 1, :, start:stop]
        new = torch.logaddexp(run_lse, lse)
        run_out.mul_((run_lse - new).exp().unsqueeze(-1)).add_((lse - new).exp().unsqueeze(-1) * out.to(run_out.dtype))
        run_lse.copy_(new)


#: one kernel call: (row, first query row, end query row, keys, values, first key, end key, causal)
Call = tuple[int, int, int, torch.Tensor, torch.Tensor, int, int, bool]


def _parts(docs: Documents, held: list[list[Held]], mine: list[tuple[int, ...]], c: int) -> Iterator[Call]:
    """Every (row, query start, query stop, key chunk's keys and values, span) to attend: row i's
    query chunk h (global index mine[i][h]) against each of its held key chunks."""
    for i, row_held in enumerate(held):
        for h in range(len(mine[i])):
            for chunk, k, v in row_held:
                for qa, qb, ka, kb, causal in docs.spans(i, mine[i][h], chunk, c):
                    yield i, h * c + qa, h * c + qb, k, v, ka, kb, causal


def _attend(
    q: torch.Tensor, docs: Documents, held: list[list[Held]], mine: list[tuple[int, ...]], c: int, run: _Running
) -> None:
    """Merge into ``run`` the attention of q (b, hq, n·C, d) against the ``held`` key chunks."""
    for i, s, e, k, v, ka, kb, causal in _parts(docs, held, mine, c):
        out, lse = kernels.attention_with_lse(q[i : i + 1, :, s:e], k[:, :, ka:kb], v[:, :, ka:kb], causal)
        run.merge(i, s, e, out, lse)


def _attend_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    docs: Documents,
    held: list[list[Held]],
    grads: list[list[Held]],
    mine: list[tuple[int, ...]],
    c: int,
    dq: torch.Tensor,
) -> None:
    """Add to dq and to the ``grads`` views (laid out like ``held``) the held key chunks' share of the
    gradients, from the merged ``out`` and ``lse``."""
    for i, row in enumerate(held):
        for (chunk, k, v), (_, dk, dv) in zip(row, grads[i]):
            for h in range(len(mine[i])):
                for qa, qb, ka, kb, causal in docs.spans(i, mine[i][h], chunk, c):
                    s, e = h * c + qa, h * c + qb
                    rows = (slice(i, i + 1), slice(None), slice(s, e))
                    dq_p, dk_p, dv_p = kernels.attention_with_lse_backward(
                        grad[rows], q[rows], k[:, :, ka:kb], v[:, :, ka:kb], out[rows], lse[rows], causal
                    )
                    dq[rows] += dq_p
                    dk[:, :, ka:kb] += dk_p
                    dv[:, :, ka:kb] += dv_p


def _local(k: torch.Tensor, v: torch.Tensor, chunks: list[tuple[int, ...]], c: int) -> list[list[Held]]:
    """Each row's own chunks ``chunks[i]`` of (b, hkv, n·C, d) keys and values."""
    return [
        [(at, k[i : i + 1, :, h * c : (h + 1) * c], v[i : i + 1, :, h * c : (h + 1) * c]) for h, at in enumerate(row)]
        for i, row in enumerate(chunks)
    ]


def _gathered(buf: torch.Tensor, layout: Layout, ranks: list[int]) -> list[list[Held]]:
    """Each row's chunks of z-ranks ``ranks`` in the all-gather's buffer (G_z·C, n chunks, 2 [k, v],
    b, hkv, d) (``axon4d.nn.context._send_buffer``): views, (1, hkv, C, d) each."""
    c = buf.shape[0] // len(layout[0])
    out: list[list[Held]] = []
    for i, row in enumerate(layout):
        held = []
        for o in ranks:
            for h in range(len(row[o])):
                rows = buf[o * c : (o + 1) * c, h, :, i]  # (C, 2, hkv, d)
                held.append((row[o][h], rows[:, 0].permute(1, 0, 2)[None], rows[:, 1].permute(1, 0, 2)[None]))
        out.append(held)
    return out


def _ring_held(kv: torch.Tensor, layout: Layout, o: int, c: int) -> list[list[Held]]:
    """Each row's chunks of z-rank ``o`` in a travelling (2, b, hkv, n·C, d) buffer."""
    return _local(kv[0], kv[1], [row[o] for row in layout], c)


def _ring_forward(q: torch.Tensor, kv: torch.Tensor, docs: Documents, grid: Grid, c: int, axis: Axis) -> _Running:
    """The attention of q (b, hq, n·C, d) over every z-rank's keys and values, ``kv`` (2 [k, v], b,
    hkv, n·C, d) this rank's, passed around ``axis`` (``axon4d.nn.ring_loop``)."""
    layout = docs.chunks(grid.size(axis))
    mine = [row[grid.coord(axis)] for row in layout]
    run = _Running(q)
    ring_forward(kv, grid, axis, lambda held, o: _attend(q, docs, _ring_held(held, layout, o, c), mine, c, run))
    return run


class _DocumentAttention(torch.autograd.Function):
    """Causal attention within documents of a rank's n query chunks per row (module docstring):
    q (b, hq, n·C, d), k and v (b, hkv, n·C, d), in the layout ``docs.chunks(G_z)``."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grid: Grid,
        docs: Documents,
        ring: bool,
        recompute: bool,
        axis: Axis,
    ) -> torch.Tensor:
        z, g_z = grid.coord(axis), grid.size(axis)
        layout = docs.chunks(g_z)
        c = q.shape[2] // docs.per_rank(g_z)
        mine = [row[z] for row in layout]
        if ring:
            held = torch.stack([k, v])  # (2, b, hkv, n·C, d): what travels
            run = _ring_forward(q, held, docs, grid, c, axis)
        else:
            gathering = grid.comm.all_gather(_send_buffer(k, v, c), axis, dim=0, tag=Term.CP_KV)
            run = _Running(q)
            _attend(q, docs, _local(k, v, mine, c), mine, c, run)  # while in flight
            held = gathering.wait()
            _attend(q, docs, _gathered(held, layout, [o for o in range(g_z) if o != z]), mine, c, run)
        out = run.out.to(q.dtype)
        ctx.grid, ctx.docs, ctx.ring, ctx.recompute, ctx.c, ctx.axis = grid, docs, ring, recompute, c, axis
        if recompute:  # selective recomputation: q and the held keys and values only
            ctx.save_for_backward(q, held)
        else:
            ctx.save_for_backward(q, held, out, run.lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grid, docs, c, axis = ctx.grid, ctx.docs, ctx.c, ctx.axis
        q, held, *kept = ctx.saved_tensors
        z, g_z = grid.coord(axis), grid.size(axis)
        n = docs.per_rank(g_z)
        layout = docs.chunks(g_z)
        mine = [row[z] for row in layout]
        if ctx.recompute:
            if ctx.ring:
                run = _ring_forward(q, held, docs, grid, c, axis)
            else:
                run = _Running(q)
                _attend(q, docs, _gathered(held, layout, list(range(g_z))), mine, c, run)
            out, lse = run.out.to(q.dtype), run.lse
        else:
            out, lse = kept
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        if not ctx.ring:
            dbuf = torch.zeros_like(held)  # the other ranks' chunks' share, in the gathered layout
            others = [o for o in range(g_z) if o != z]
            _attend_backward(
                grad, q, out, lse, docs, _gathered(held, layout, others), _gathered(dbuf, layout, others), mine, c, dq
            )
            scattering = grid.comm.reduce_scatter(dbuf, axis, dim=0, tag=Term.CP_KV_GRAD)
            own = _gathered(held, layout, [z])  # this rank's own chunks, read from the buffer
            dk = torch.zeros(held.shape[3], held.shape[4], n * c, held.shape[5], dtype=held.dtype, device=held.device)
            dv = torch.zeros_like(dk)
            _attend_backward(grad, q, out, lse, docs, own, _local(dk, dv, mine, c), mine, c, dq)
            mine_grads = scattering.wait()  # (C, n chunks, 2 [k, v], b, hkv, d): this rank's tokens
            dk.unflatten(2, (n, c)).add_(mine_grads[:, :, 0].permute(2, 3, 1, 0, 4))
            dv.unflatten(2, (n, c)).add_(mine_grads[:, :, 1].permute(2, 3, 1, 0, 4))
            return dq, dk, dv, None, None, None, None, None

        def attend_backward(kv: torch.Tensor, dkv: torch.Tensor, o: int) -> None:  # z-rank o's, (2, b, hkv, n·C, d)
            held_o, grads_o = _ring_held(kv, layout, o, c), _ring_held(dkv, layout, o, c)
            _attend_backward(grad, q, out, lse, docs, held_o, grads_o, mine, c, dq)

        own_grads = ring_backward(held, grid, axis, attend_backward)  # (2, b, hkv, n·C, d): all ranks' share
        return dq, own_grads[0], own_grads[1], None, None, None, None, None


def document_sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Grid,
    documents: Documents,
    ring: bool = False,
    recompute_core: bool = False,
    axis: Axis = "z",
) -> torch.Tensor:
    """softmax(q kᵀ/√d) v, causal within ``documents``, for this rank's n chunks per row of packed
    sequences split over z in ``documents.chunks(G_z)``'s layout (``shard_sequence(x,
    documents=...)``): q (b, hq, n·C, d), k and v (b, hkv, n·C, d), positions applied (rotary at
    in-document positions); ``documents`` has this rank's b rows. The keys and values are all-gathered
    over z or, with ``ring``, passed around z (module docstring) — over ``axis``: z, or batch = z ×
    data for hierarchical context parallelism. Returns (b, hq, n·C, d)."""
    kernels.query_groups(q, k)
    documents.check(q.shape[0], q.shape[2] * grid.size(axis), "the attention's query rows")
    documents.per_rank(grid.size(axis))  # checks the split, before any collective
    return _DocumentAttention.apply(q, k, v, grid, documents, ring, recompute_core, axis)
