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
(``axon4d.device.attention.attention_with_lse``, which picks flash, memory-efficient, the host's or
plain matmuls). Grouped-query heads are read from the shapes and never repeated for a prefix: the
kernel seam runs a group's query heads as one longer query sequence against their shared key/value
head (only a diagonal's C keys are repeated, on kernels without native grouped-query support).
This is why query chunks are made contiguous when there are groups: the fold is then a view.

The keys and values of the prefixes live on other z-ranks. Each rank all-gathers over z the keys
(already rotated at their global positions) and values of its *own* key/value heads — n_kv/G_y
heads, so GQA shrinks the traffic by n/n_kv — in one collective (``Term.CP_KV``, tag ``cp_kv``),
issued as soon as k and v exist and waited on only after the diagonals, which run while it is in
flight. Each rank sends (C, 2, 2, b, n_kv/G_y, d): row l of its head and tail chunk, keys and values;
the gathered buffer (G_z·C, 2, 2, b, n_kv/G_y, d) is read in place (``_GatheredKeys``): its head
slots are chunks 0 … G_z−1 in order, its tail slots chunks 2·G_z−1 … G_z. A head chunk r's prefix
is head rows [0, r·C), one view; a tail chunk 2·G_z−1−r's prefix is every head row plus the tail
rows [(r+1)·C, G_z·C) — two views (unmasked attention does not care about key order; a gather that
concatenates rank by rank cannot make every head and some tails one strided run), merged by their
log-sum-exps like the diagonal. The only copy is the send buffer, of this rank's 2·C tokens::

    forward:   |-- all-gather K,V (z) --|
               |- diag c_r -|- diag c_t -|wait|- prefix c_r -|- prefix c_t -|- merge -|
    backward:  |- prefix c_r -|- prefix c_t -|-- reduce-scatter dK,dV (z) --|
                                             |- diag c_r -|- diag c_t -|wait|- add -|

Backward uses the standard identity of fused attention kernels: a part's backward, given the
*merged* out and lse, yields exactly that part's dq, dk, dv. The prefixes' gradients of the gathered
keys and values are accumulated into one buffer of the gathered layout, which is reduce-scattered
over z as it is (``Term.CP_KV_GRAD``, tag ``cp_kv.grad``), so each rank receives, for its own tokens, the sum of what every rank's queries contributed; the diagonals'
gradients, which stay on this rank, are computed while that reduce-scatter is in flight and added
to its result.

Bytes per layer and rank, each way (forward all-gather, backward reduce-scatter), for b sequences
of S tokens, head_dim d and element size e:  2 · b · S · (n_kv/G_y) · d · e · (G_z−1)/G_z.

This is the default mode (``context_parallel=True`` or "all-gather", ``axon4d.options.context_mode``); "ring"
passes the keys and values around z instead of gathering them (``axon4d.nn.context_ring``).
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.activations import sequence_chunks
from axon4d.device import attention as kernels
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term

Part = tuple[torch.Tensor, torch.Tensor]  # (out (b, hq, C, d), lse (b, hq, C))
Piece = tuple[torch.Tensor, torch.Tensor]  # keys and values (b, hkv, L, d): views of the held ones


class _GlobalKeys:
    """The whole sequence's keys and values (b, hkv, S, d) in global order; this rank's query chunks
    are global chunks ``chunks`` of ``c`` tokens."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, int], c: int):
        self.k, self.v, self.chunks, self.c = k, v, chunks, c

    def zeros(self) -> _GlobalKeys:
        """Zero keys and values of the same layout: where their gradients are accumulated."""
        return _GlobalKeys(torch.zeros_like(self.k), torch.zeros_like(self.v), self.chunks, self.c)

    def own(self, h: int) -> Piece:
        """The keys and values of query chunk ``h`` (0: head, 1: tail) itself: its diagonal."""
        at = self.chunks[h] * self.c
        return self.k.narrow(2, at, self.c), self.v.narrow(2, at, self.c)

    def prefix(self, h: int) -> list[Piece]:
        """The keys before query chunk ``h``: [0, chunk·C), one piece (none for chunk 0)."""
        keys = self.chunks[h] * self.c
        return [(self.k.narrow(2, 0, keys), self.v.narrow(2, 0, keys))] if keys else []


class _GatheredKeys:
    """Every z-rank's keys and values as the all-gather over z leaves them (module docstring):
    ``buf`` (G_z·C, 2, 2, b, hkv, d), row r·C + l holding token l of z-rank r's head (slot 0) and
    tail (slot 1) chunk, keys (0) and values (1). Everything is read through views."""

    def __init__(self, buf: torch.Tensor, z: int, g_z: int):
        self.buf, self.z, self.g_z, self.c = buf, z, g_z, buf.shape[0] // g_z

    def zeros(self) -> _GatheredKeys:
        return _GatheredKeys(torch.zeros_like(self.buf), self.z, self.g_z)

    def _rows(self, slot: int, start: int, stop: int) -> Piece:
        rows = self.buf[start:stop, slot]  # (n, 2, b, hkv, d)
        return rows[:, 0].permute(1, 2, 0, 3), rows[:, 1].permute(1, 2, 0, 3)

    def own(self, h: int) -> Piece:
        return self._rows(h, self.z * self.c, (self.z + 1) * self.c)

    def prefix(self, h: int) -> list[Piece]:
        """Head chunk z: the heads of z-ranks 0 … z−1. Tail chunk 2·G_z−1−z: every head and the
        tails of z-ranks z+1 … G_z−1 (chunks G_z … 2·G_z−2−z)."""
        c, z, g_z = self.c, self.z, self.g_z
        if h == 0:
            spans = [(0, 0, z * c)] if z else []
        else:
            spans = [(0, 0, g_z * c)] + ([(1, (z + 1) * c, g_z * c)] if z + 1 < g_z else [])
        return [self._rows(*span) for span in spans]


Keys = _GlobalKeys | _GatheredKeys


def _send_buffer(k: torch.Tensor, v: torch.Tensor, c: int) -> torch.Tensor:
    """This rank's keys and values (b, hkv, n·C, d) — its n chunks of C, n = 2 here — in the layout the
    all-gather over z concatenates: (C, n chunks, 2 [k, v], b, hkv, d)."""
    b, h, s, d = k.shape
    buf = k.new_empty(c, s // c, 2, b, h, d)
    for i, t in enumerate((k, v)):
        buf[:, :, i] = t.unflatten(2, (s // c, c)).permute(3, 2, 0, 1, 4)
    return buf


def _chunks(t: torch.Tensor, c: int, contiguous: bool) -> list[torch.Tensor]:
    """The head and tail chunks (b, h, C, …) of a rank's (b, h, 2·C, …); contiguous ones (each head's
    C rows after the previous head's) when asked: what the kernel seam folds grouped-query heads of
    with a view instead of a copy."""
    parts = [t.narrow(2, 0, c), t.narrow(2, c, c)]
    return [p.contiguous() for p in parts] if contiguous else parts


def _merge(parts: list[Part]) -> Part:
    """The attention over every part's keys, from each part's out and lse (module docstring)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p[1] for p in parts]).logsumexp(0)
    out = (parts[0][1] - lse).exp().unsqueeze(-1) * parts[0][0].float()
    for part_out, part_lse in parts[1:]:
        out += (part_lse - lse).exp().unsqueeze(-1) * part_out.float()
    return out.to(parts[0][0].dtype), lse


def _attend(q: torch.Tensor, keys: Keys, h: int, diagonal: Part) -> Part:
    """Query chunk ``h``'s attention: its ``diagonal`` merged with every prefix piece's."""
    pieces = [kernels.attention_with_lse(q, k, v, False) for k, v in keys.prefix(h)]
    return _merge([diagonal, *pieces])


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
        axis: Axis,
    ) -> torch.Tensor:
        c, grouped = q.shape[2] // 2, q.shape[1] > k.shape[1]
        qs = _chunks(q, c, grouped)
        keys: Keys
        if grid is None:
            keys = _GlobalKeys(k, v, chunks, c)
            diagonal = [kernels.attention_with_lse(qs[h], *keys.own(h), True) for h in range(2)]
        else:
            gathering = grid.comm.all_gather(_send_buffer(k, v, c), axis, dim=0, tag=Term.CP_KV)
            local = list(zip(_chunks(k, c, False), _chunks(v, c, False)))
            diagonal = [kernels.attention_with_lse(qs[h], *local[h], True) for h in range(2)]  # while in flight
            keys = _GatheredKeys(gathering.wait(), grid.coord(axis), grid.size(axis))
        merged = [_attend(qs[h], keys, h, diagonal[h]) for h in range(2)]
        out = torch.cat([m[0] for m in merged], dim=2)
        ctx.grid, ctx.chunks, ctx.recompute, ctx.c, ctx.grouped, ctx.axis = grid, chunks, recompute, c, grouped, axis
        held = (keys.k, keys.v) if isinstance(keys, _GlobalKeys) else (keys.buf,)
        if recompute:  # selective recomputation: q and the gathered keys and values only
            ctx.save_for_backward(*qs, *held)
        else:
            ctx.save_for_backward(*qs, *held, out, torch.cat([m[1] for m in merged], dim=2))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grid, chunks, c, grouped, axis = ctx.grid, ctx.chunks, ctx.c, ctx.grouped, ctx.axis
        q_head, q_tail, *saved = ctx.saved_tensors
        qs = [q_head, q_tail]
        keys: Keys
        if grid is None:
            keys, kept = _GlobalKeys(saved[0], saved[1], chunks, c), saved[2:]
        else:
            keys, kept = _GatheredKeys(saved[0], grid.coord(axis), grid.size(axis)), saved[1:]
        if ctx.recompute:  # the forward's parts again, from the kept keys and values: no all-gather
            merged = [_attend(qs[h], keys, h, kernels.attention_with_lse(qs[h], *keys.own(h), True)) for h in range(2)]
        else:
            merged = list(zip(_chunks(kept[0], c, grouped), _chunks(kept[1], c, grouped)))
        grads = _chunks(grad, c, True)
        dq = [torch.zeros_like(qh) for qh in qs]
        dkeys = keys.zeros()  # the prefixes' share, in the layout of the held keys and values
        for h in range(2):
            for (k, v), (dk_at, dv_at) in zip(keys.prefix(h), dkeys.prefix(h)):
                dq_p, dk, dv = kernels.attention_with_lse_backward(grads[h], qs[h], k, v, *merged[h], False)
                dq[h] += dq_p
                dk_at.add_(dk)
                dv_at.add_(dv)
        if isinstance(dkeys, _GatheredKeys):  # every rank's share of each rank's tokens: during the diagonals
            assert grid is not None
            scattering = grid.comm.reduce_scatter(dkeys.buf, axis, dim=0, tag=Term.CP_KV_GRAD)
        diagonal_grads = []
        for h in range(2):
            dq_d, dk, dv = kernels.attention_with_lse_backward(grads[h], qs[h], *keys.own(h), *merged[h], True)
            dq[h] += dq_d
            diagonal_grads.append((dk, dv))
        dq_all = torch.cat(dq, dim=2)
        if isinstance(dkeys, _GlobalKeys):  # the whole sequence's keys and values: the diagonals' share
            for h, (dk, dv) in enumerate(diagonal_grads):
                dk_at, dv_at = dkeys.own(h)
                dk_at.add_(dk)
                dv_at.add_(dv)
            return dq_all, dkeys.k, dkeys.v, None, None, None, None
        mine = scattering.wait()  # (C, 2 chunks, 2 [k, v], b, hkv, d): this rank's tokens
        dk_local = torch.cat([g[0] for g in diagonal_grads], dim=2)  # (b, hkv, 2·C, d)
        dv_local = torch.cat([g[1] for g in diagonal_grads], dim=2)
        dk_local.unflatten(2, (2, c)).add_(mine[:, :, 0].permute(2, 3, 1, 0, 4))
        dv_local.unflatten(2, (2, c)).add_(mine[:, :, 1].permute(2, 3, 1, 0, 4))
        return dq_all, dk_local, dv_local, None, None, None, None


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, int]) -> torch.Tensor:
    """Causal attention of a rank's two query chunks q (b, hq, 2·C, d), global chunk indices
    ``chunks``, against the whole sequence's keys and values (b, hkv, S, d) in global order: chunk c
    sees keys [0, (c+1)·C), its own causally — the split attention without its collectives (what one
    rank computes once the keys and values are gathered). Returns (b, hq, 2·C, d); grouped-query
    attention (hkv < hq) is read from the shapes."""
    kernels.query_groups(q, k)
    return _SplitAttention.apply(q, k, v, None, chunks, False, "z")


def split_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, recompute_core: bool = False, axis: Axis = "z"
) -> torch.Tensor:
    """softmax(q kᵀ/√d, causal) v for this rank's tokens of sequences split head–tail over z (or over
    ``axis``: "batch" = z × data, hierarchical context parallelism):
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
    kernels.query_groups(q, k)
    chunks = sequence_chunks(grid.coord(axis), grid.size(axis))
    return _SplitAttention.apply(q, k, v, grid, chunks, recompute_core, axis)
