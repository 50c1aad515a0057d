"""Packed documents: sequences made of several documents, and how their attention work is balanced
over z (docs/context.md, "Packed documents").

A packed sequence of S tokens holds documents back to back; a token attends only to the earlier
tokens of its own document (the document mask) and its position (rotary or learned) counts from its
document's first token. ``Documents`` is the layout of a batch of such sequences — per row, its
documents' lengths in order, summing to S — computed once per batch on the host (from the lengths,
or from the EOS tokens that ``axon4d prepare-data`` puts after every document: ``from_eos``).

Under context parallelism a sequence is cut into 2·G_z chunks of C = S/(2·G_z) tokens and each
z-rank holds two (the linear layers need the same token count on every rank). Without documents the
chunks are paired head–tail, (r, 2·G_z−1−r), which gives every rank the same causal work. With
documents the work of a chunk is the number of (query, key) pairs its queries attend to,
Σ_{i in chunk} (i − start of i's document + 1), and the pairs are chosen by it (``chunks``):

    order a row's chunks by (work, index); pair the k-th lightest with the k-th heaviest;
    row by row, give the heaviest pair to the z-rank with the least work so far (ties: the pair
    with the first chunk first, the rank of lowest index); a rank holds its two in global order.

With one document the work grows with the chunk index, every pair carries the same work and the
rule gives head–tail back exactly. Pairing the lightest with the heaviest minimises the largest
pair sum of a row; handing the pairs out by load keeps what is left over from adding up over rows. ``balance``
measures the result: the largest rank's work over the mean.

``spans`` is what the attention kernels run: for one query chunk against one key chunk, the query
rows and key columns that see each other, each a whole block (every key visible) or a causal square
(a document's rows inside the diagonal chunk) — never a mask tensor, so each runs in the fused
kernels of ``axon4d.device.attention``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import cached_property

import torch

#: (first query row, end query row, first key column, end key column, causal): offsets inside a
#: query chunk and a key chunk; a causal span is a square (the same rows and columns)
Span = tuple[int, int, int, int, bool]


class Documents:
    """The document layout of a batch of packed sequences: ``lengths[i]`` are row i's documents'
    lengths, in order, summing to the sequence length S on every row (``ValueError`` otherwise)."""

    def __init__(self, lengths: Sequence[Sequence[int]]):
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        if not len(lengths):
            raise ValueError(
                f"documents: give one list of document lengths per sequence (row), e.g. [[3, 5], [8]]; got {lengths!r}"
            )
        rows: list[tuple[int, ...]] = []
        for i, row in enumerate(lengths):
            try:
                values = tuple(int(n) for n in row)
            except (TypeError, ValueError):
                raise ValueError(f"documents: row {i} is {row!r}, not a list of document lengths") from None
            if not values or any(n <= 0 or n != m for n, m in zip(values, row)):
                raise ValueError(
                    f"documents: row {i} has lengths {list(row)}; each document needs a positive whole number of tokens"
                )
            rows.append(values)
        totals = {sum(r) for r in rows}
        if len(totals) > 1:
            raise ValueError(
                f"documents: the rows' lengths sum to {sorted(totals)}; every row is one sequence of the same "
                "length S, so every row's document lengths must sum to S"
            )
        self.lengths: tuple[tuple[int, ...], ...] = tuple(rows)
        self.seq_len = totals.pop()
        self._chunks: dict[int, tuple[tuple[tuple[int, int], ...], ...]] = {}
        self._cache: dict[tuple[object, ...], torch.Tensor] = {}

    @classmethod
    def from_eos(cls, ids: torch.Tensor, eos: int) -> Documents:
        """The layout of token rows ``ids`` (B, S) where a document ends after each ``eos`` token (and
        at the end of the row): what ``axon4d prepare-data`` writes. One host read of ``ids``."""
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"Documents.from_eos needs token ids (batch, seq), got shape {tuple(ids.shape)}")
        lengths = []
        for row in (ids == eos).cpu().tolist():
            ends = [i + 1 for i, is_eos in enumerate(row) if is_eos]
            if not ends or ends[-1] != len(row):
                ends.append(len(row))
            lengths.append([b - a for a, b in zip([0, *ends], ends)])
        return cls(lengths)

    def __repr__(self) -> str:
        return f"Documents({[list(r) for r in self.lengths]})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Documents) and self.lengths == other.lengths

    __hash__ = None  # type: ignore[assignment]

    @property
    def batch(self) -> int:
        """The number of rows (sequences)."""
        return len(self.lengths)

    def rows(self, lo: int, hi: int) -> Documents:
        """The layout of rows ``lo:hi``."""
        return Documents(self.lengths[lo:hi])

    def check(self, batch: int, seq_len: int, what: str = "the token ids") -> Documents:
        """Itself, when it describes ``batch`` rows of ``seq_len`` tokens; else a ``ValueError``."""
        if self.batch != batch or self.seq_len != seq_len:
            raise ValueError(
                f"documents describe {self.batch} sequences of {self.seq_len} tokens, but {what} hold {batch} "
                f"sequences of {seq_len} tokens: give one row of document lengths per sequence, summing to "
                f"{seq_len} (under context parallelism, the whole sequence's length, not this rank's share)"
            )
        return self

    @cached_property
    def starts(self) -> tuple[tuple[int, ...], ...]:
        """Per row, the first position of each document and then S."""
        out = []
        for row in self.lengths:
            at = [0]
            for n in row:
                at.append(at[-1] + n)
            out.append(tuple(at))
        return tuple(out)

    def positions(self) -> torch.Tensor:
        """(B, S) long: each token's position inside its document (0 at each document's start)."""
        if ("positions",) not in self._cache:
            self._cache[("positions",)] = torch.cat(
                [torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in self.lengths]
            )
        return self._cache[("positions",)]

    def chunk_work(self, row: int, parts: int) -> list[int]:
        """The attention work of each of the ``parts`` equal chunks of row ``row``: the (query, key)
        pairs its queries attend to, causal within their documents."""
        c = self.seq_len // parts
        return (self.positions()[row] + 1).view(parts, c).sum(1).tolist()

    def chunks(self, g_z: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per row, per z-rank, the two chunk indices (of 2·G_z) it holds, in global order, paired by
        their work (module docstring). ``ValueError`` unless 2·G_z divides S."""
        if g_z not in self._chunks:
            parts = 2 * g_z
            if self.seq_len % parts:
                raise ValueError(
                    f"documents of sequences of {self.seq_len} tokens cannot be split over G_z = {g_z}: the sequence "
                    f"is cut into 2·G_z = {parts} equal chunks, so S must be a multiple of {parts}"
                )
            out = []
            load = [0] * g_z  # each rank's work over the rows so far
            for row in range(self.batch):
                work = self.chunk_work(row, parts)
                order = sorted(range(parts), key=lambda k: (work[k], k))
                pairs = [tuple(sorted((order[j], order[parts - 1 - j]))) for j in range(g_z)]
                pairs.sort(key=lambda p: (-(work[p[0]] + work[p[1]]), p[0]))  # heaviest first
                ranks = sorted(range(g_z), key=lambda z: (load[z], z))  # least loaded first
                held: list[tuple[int, int]] = [(0, 0)] * g_z
                for z, (a, b) in zip(ranks, pairs):
                    held[z] = (a, b)
                    load[z] += work[a] + work[b]
                out.append(tuple(held))
            self._chunks[g_z] = tuple(out)
        return self._chunks[g_z]

    def index(self, z: int, g_z: int) -> torch.Tensor:
        """(B, S/G_z) long: the global positions of the tokens z-rank ``z`` holds of each row, in its
        local order (its first chunk, then its second)."""
        key = ("index", z, g_z)
        if key not in self._cache:
            c = self.seq_len // (2 * g_z)
            self._cache[key] = torch.stack(
                [torch.cat([torch.arange(k * c, (k + 1) * c) for k in row[z]]) for row in self.chunks(g_z)]
            )
        return self._cache[key]

    def local_positions(self, z: int, g_z: int, device: torch.device) -> torch.Tensor:
        """(B, S/G_z) long on ``device``: the in-document positions of z-rank ``z``'s tokens (G_z = 1:
        the whole rows'), copied to the device once."""
        key = ("local", z, g_z, str(device))
        if key not in self._cache:
            positions = self.positions() if g_z == 1 else self.positions().gather(1, self.index(z, g_z))
            self._cache[key] = positions.to(device)
        return self._cache[key]

    def spans(self, row: int, q_chunk: int, k_chunk: int, c: int) -> list[Span]:
        """Which rows of query chunk ``q_chunk`` see which keys of key chunk ``k_chunk`` (chunks of
        ``c`` tokens of row ``row``): causally, within documents. A later key chunk: none. The same
        chunk: a causal square per document in it. An earlier one: the queries of the document that
        holds the query chunk's first token, against that document's keys in the key chunk."""
        if k_chunk > q_chunk:
            return []
        starts = self.starts[row]
        q0, q1 = q_chunk * c, (q_chunk + 1) * c
        first = bisect.bisect_right(starts, q0) - 1  # the document holding q0
        if k_chunk == q_chunk:
            out: list[Span] = []
            d = first
            while starts[d] < q1:
                a, b = max(starts[d], q0) - q0, min(starts[d + 1], q1) - q0
                out.append((a, b, a, b, True))
                d += 1
            return out
        k0, k1 = k_chunk * c, (k_chunk + 1) * c
        if starts[first] >= k1:
            return []
        return [(0, min(starts[first + 1], q1) - q0, max(starts[first], k0) - k0, c, False)]


def balance(documents: Documents, g_z: int, head_tail: bool = False) -> float:
    """The largest z-rank's attention work over the mean, summed over the rows: under the work-balanced
    pairing (``Documents.chunks``), or the plain head–tail one with ``head_tail``."""
    parts = 2 * g_z
    per_rank = [0] * g_z
    for row in range(documents.batch):
        work = documents.chunk_work(row, parts)
        pairs = [(z, parts - 1 - z) for z in range(g_z)] if head_tail else documents.chunks(g_z)[row]
        for z, (a, b) in enumerate(pairs):
            per_rank[z] += work[a] + work[b]
    return max(per_rank) / (sum(per_rank) / g_z)


def as_documents(documents: Documents | Sequence[Sequence[int]], batch: int, seq_len: int, what: str) -> Documents:
    """``documents`` (a ``Documents`` or per-row lengths) checked to describe ``batch`` rows of
    ``seq_len`` tokens (``Documents.check``)."""
    if not isinstance(documents, Documents):
        documents = Documents(documents)
    return documents.check(batch, seq_len, what)
