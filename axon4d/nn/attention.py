"""Causal self-attention on the grid: GQA, rotary embeddings, heads split over y (docs/design.md §2).

The fused QKV projection is a normal Linear (hidden over x → q, k, v features over y) and the
output projection a transposed one (features over y → hidden over x), so the block consumes and
produces the residual-stream layout (b, s, hidden/G_x) with no redistribution. The QKV output
features are ordered so that y-rank j's contiguous chunk holds whole heads:
[q heads of group j | k heads of group j | v heads of group j] (``rectangles.FusedRows``); attention
then runs on this rank's n_heads/G_y query heads and n_kv_heads/G_y key/value heads with no
communication.

``recompute_core`` (selective recomputation, axon4d.nn.recompute): core attention — rotary,
scores, softmax, weighted sum — keeps only q, k, v and runs again in backward.

``context_parallel`` (docs/context.md): the s rows of this rank are its two head–tail chunks of
each sequence, split over z (``axon4d.activations.shard_sequence``); rotary tables are taken at the
tokens' global positions and core attention runs across the split: True or "all-gather" gathers
every rank's keys and values (``axon4d.nn.context``; under selective recomputation they are kept,
so no collective runs twice), "ring" passes them around z one rank's at a time, O(chunk) memory
(``axon4d.nn.context_ring``; selective recomputation runs its ring again in backward).
``context_parallel_axes="z,data"`` splits each sequence over z and data together (the ``batch``
axis; hierarchical, docs/context.md) instead of z alone.

``documents`` (a forward argument, ``axon4d.data.documents.Documents`` of this rank's rows): packed
sequences; a token attends only to its own document's earlier tokens and rotary positions restart at
each document — per document in one process (``causal_attention``), across the split in spans
without a mask tensor under context parallelism (``axon4d.nn.context_documents``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axon4d.activations import sequence_positions
from axon4d.data.documents import Documents
from axon4d.grid import counts, rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import rectangles
from axon4d.nn.context import split_sequence_attention
from axon4d.nn.context_documents import document_sequence_attention
from axon4d.nn.context_ring import ring_sequence_attention
from axon4d.nn.linear import Linear
from axon4d.nn.recompute import recomputed
from axon4d.options.context_mode import context_axis, context_mode


def rotary_tables(
    seq: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (seq, head_dim) of rotary position embeddings (half-split convention)."""
    return rotary_tables_at(torch.arange(seq, device=device), head_dim, theta, dtype)


def rotary_tables_at(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (len(positions), head_dim) of rotary embeddings at the given global
    ``positions`` (half-split convention); row i is row positions[i] of ``rotary_tables``."""
    device = positions.device
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(torch.float32), inv)  # (n, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (b, heads, s, head_dim) by position: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope_theta: float | None, documents: Documents | None = None
) -> torch.Tensor:
    """softmax(q kᵀ/√d, causal) v for (b, s, heads, d) inputs with GQA; returns (b, s, heads·d). With
    ``documents`` (b rows of s tokens) causal within each document, rotary positions counted from
    each document's start: each document of each row attends as a sequence of its own."""
    b, s, hq, d = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    if rope_theta is not None:
        if documents is None:
            cos, sin = rotary_tables(s, d, rope_theta, q.device, q.dtype)
        else:  # (b, 1, s, d): each row's own positions
            positions = documents.local_positions(0, 1, q.device)
            cos, sin = (
                t.unflatten(0, (b, s)).unsqueeze(1)
                for t in rotary_tables_at(positions.flatten(), d, rope_theta, q.dtype)
            )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    gqa = k.shape[1] != hq
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        rows = []
        for i, starts in enumerate(documents.starts):  # each document as a sequence of its own
            parts = []
            for a, e in zip(starts, starts[1:]):
                qd, kd, vd = q[i : i + 1, :, a:e], k[i : i + 1, :, a:e], v[i : i + 1, :, a:e]
                parts.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa))
            rows.append(torch.cat(parts, dim=2))
        out = torch.cat(rows)
    return out.transpose(1, 2).reshape(b, s, hq * d)


class DenseAttention(nn.Module):
    """The single-process reference: separate q, k, v, o projections."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        bias: bool,
        rope_theta: float | None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_theta = (
            n_heads,
            n_kv_heads,
            hidden // n_heads,
            rope_theta,
        )
        kv = n_kv_heads * self.head_dim
        kw: dict[str, Any] = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(hidden, hidden, **kw),
            nn.Linear(hidden, kv, **kw),
            nn.Linear(hidden, kv, **kw),
        )
        self.o_proj = nn.Linear(hidden, hidden, **kw)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        return self.o_proj(causal_attention(q, k, v, self.rope_theta, documents))


class Attention(nn.Module):
    """Causal GQA self-attention on (b, s, hidden/G_x) activations (replicated over y)."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        bias: bool = True,
        rope_theta: float | None = None,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        recompute_core: bool = False,
        context_parallel: bool | str = False,
        context_parallel_axes: str = "z",
    ):
        super().__init__()
        self.grid = grid = runtime.resolve(grid)
        self.recompute_core = recompute_core
        #: None, "all-gather" or "ring" (``axon4d.options.context_mode``)
        self.context_mode = context_mode(context_parallel)
        self.context_parallel = self.context_mode is not None
        #: the axis each sequence is split over: z, or batch (z × data, ``context_parallel_axes="z,data"``)
        self.context_axis = context_axis(context_parallel_axes)
        rules.count(hidden, "hidden", example=1024)
        rules.count(n_heads, "n_heads", example=8)
        n_kv_heads = rules.count(n_kv_heads, "n_kv_heads", example=n_heads) if n_kv_heads is not None else n_heads
        rotary = (
            "rotary embeddings (rope_theta given) rotate pairs of features; choose an even head_dim or rope_theta=None"
        )
        counts.heads(hidden, n_heads, n_kv_heads, rotary=rotary if rope_theta is not None else "")
        rules.check(grid.shape, rules.heads(n_heads, n_kv_heads))
        self.hidden, self.n_heads, self.n_kv_heads, self.head_dim = hidden, n_heads, n_kv_heads, hidden // n_heads
        self.rope_theta = rope_theta
        self.local_heads, self.local_kv_heads = n_heads // grid.size("y"), n_kv_heads // grid.size("y")
        qkv_out = (n_heads + 2 * n_kv_heads) * self.head_dim
        kw: dict[str, Any] = dict(grid=grid, device=device, dtype=dtype)
        self.qkv = Linear(hidden, qkv_out, bias=bias, transpose=False, **kw)
        self.out = Linear(hidden, hidden, bias=bias, transpose=True, **kw)
        # the fused output is q | k | v interleaved by y group: checkpoints store the three apart
        kv = n_kv_heads * self.head_dim
        self.qkv.fused_rows = self.qkv_rows = rectangles.FusedRows(
            (("q", hidden), ("k", kv), ("v", kv)), grid.size("y")
        )

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """(b, s, hidden/G_x) → (b, s, hidden/G_x), causal self-attention over the s positions;
        ``documents``: the packed layout of this rank's b rows (their whole sequences under context
        parallelism), or None (one document per row)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"Attention expects this rank's activations of shape (batch, seq, hidden/G_x), got {shape}; "
                "add a batch dim with x.unsqueeze(0)"
            )
        b, s, _ = x.shape
        qkv = self.qkv(x)  # (b, s, (hq + 2 hkv)·d) of this y group's heads
        hq, hkv, d = self.local_heads, self.local_kv_heads, self.head_dim
        q, k, v = self.qkv_rows.local(qkv, dim=-1)
        q, k, v = q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
        if self.context_parallel:
            return self.out(self._split_sequence_core(q, k, v, documents))
        if self.recompute_core:
            y = recomputed(causal_attention, q, k, v, self.rope_theta, documents)
        else:
            y = causal_attention(q, k, v, self.rope_theta, documents)
        return self.out(y)  # (b, s, hidden/G_x)

    def _split_sequence_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None
    ) -> torch.Tensor:
        """Core attention of (b, s, heads, d) q, k, v whose s rows are this rank's head–tail chunks of
        sequences of s·G_z tokens split over z (with ``documents``, the chunks it chose); returns
        (b, s, hq·d) like ``causal_attention``."""
        b, s, hq, d = q.shape
        z, g_z = self.grid.coord(self.context_axis), self.grid.size(self.context_axis)
        if documents is None:
            positions = sequence_positions(s * g_z, z, g_z, q.device)  # checks 2·G_z | S
        else:
            documents.check(b, s * g_z)
            positions = documents.local_positions(z, g_z, q.device)  # (b, s): in-document positions
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
        if self.rope_theta is not None:
            cos, sin = rotary_tables_at(positions.flatten(), d, self.rope_theta, q.dtype)
            if documents is not None:  # (b, 1, s, d): each row's own positions
                cos, sin = (t.unflatten(0, (b, s)).unsqueeze(1) for t in (cos, sin))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if documents is not None:
            ring = self.context_mode == "ring"
            out = document_sequence_attention(
                q, k, v, self.grid, documents, ring, self.recompute_core, self.context_axis
            )
            return out.transpose(1, 2).reshape(b, s, hq * d)
        attend = ring_sequence_attention if self.context_mode == "ring" else split_sequence_attention
        out = attend(q, k, v, self.grid, recompute_core=self.recompute_core, axis=self.context_axis)
        return out.transpose(1, 2).reshape(b, s, hq * d)

    @torch.no_grad()
    def load_dense_(self, dense: DenseAttention) -> Attention:
        self.qkv.load_dense_(*self.qkv_rows.fuse_dense([dense.q_proj, dense.k_proj, dense.v_proj]))
        self.out.load_dense_(dense.o_proj.weight, dense.o_proj.bias)
        return self

    def to_dense(self, grads: bool = False) -> DenseAttention:
        p = self.qkv.weight
        dense = DenseAttention(
            self.hidden,
            self.n_heads,
            self.n_kv_heads,
            self.qkv.bias is not None,
            self.rope_theta,
            device=p.device,
            dtype=p.dtype,
        )
        self.qkv_rows.split_into_(self.qkv.to_dense(grads), [dense.q_proj, dense.k_proj, dense.v_proj], grads)
        dense.o_proj = self.out.to_dense(grads)
        return dense
