"""Packed documents: sequences made of several documents, and how their attention work is balanced
over z (docs/context.md, "Packed documents").

A packed sequence of S tokens holds documents back to back; a token attends only to the earlier
tokens of its own document (the document mask) and its position (rotary or learned) counts from its
document's first token. ``Documents`` is the layout of a batch of such sequences — per row, its
documents' lengths in order, summing to S — computed once per batch on the host (from the lengths,
or from the EOS tokens that ``axon4d prepare-data`` puts after every document: ``from_eos``).

Under context parallelism without documents a sequence is cut into 2·G_z chunks paired head–tail,
(r, 2·G_z−1−r), which gives every z-rank the same causal work. With documents the work of a chunk is
the number of (query, key) pairs its queries attend to, Σ_{i in chunk} (i − start of i's document
+ 1), and the chunks are handed out by it (``chunks``); every rank still holds as many tokens (the
linear layers need it):

    cut each row into n·G_z chunks of C = S/(n·G_z) tokens, n = 4 when 4·G_z divides S, else 2;
    take a row's chunks heaviest first (ties: lower index first) and give each to the z-rank with
    the least work so far, rows before included, among those holding fewer than n (ties: lower z);
    a rank holds its n chunks in global order.

With n = 2 and one document this is head–tail (the k-th heaviest chunk goes with the k-th lightest).
Four chunks per rank give the rule room where one row's documents make a few chunks heavy.
``balance`` measures the result: the largest rank's work over the mean.

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
        self._chunks: dict[int, tuple[tuple[tuple[int, ...], ...], ...]] = {}
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

    def per_rank(self, g_z: int) -> int:
        """How many chunks each of ``g_z`` z-ranks holds of a row: 4 when 4·G_z divides S (finer
        chunks balance better), else 2 (``ValueError`` unless 2·G_z divides S)."""
        for n in (4, 2):
            if self.seq_len % (n * g_z) == 0:
                return n
        raise ValueError(
            f"documents of sequences of {self.seq_len} tokens cannot be split over G_z = {g_z}: the sequence is cut "
            f"into 2·G_z = {2 * g_z} equal chunks or more, so S must be a multiple of {2 * g_z}"
        )

    def chunks(self, g_z: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per row, per z-rank, the ``per_rank(G_z)`` chunk indices it holds, in global order, chosen by
        their attention work (module docstring)."""
        if g_z not in self._chunks:
            n = self.per_rank(g_z)
            load = [0] * g_z  # each rank's work over the rows so far
            out = []
            for row in range(self.batch):
                work = self.chunk_work(row, n * g_z)
                held: list[list[int]] = [[] for _ in range(g_z)]
                for k in sorted(range(n * g_z), key=lambda k: (-work[k], k)):  # heaviest first
                    z = min((z for z in range(g_z) if len(held[z]) < n), key=lambda z: (load[z], z))
                    held[z].append(k)
                    load[z] += work[k]
                out.append(tuple(tuple(sorted(h)) for h in held))
            self._chunks[g_z] = tuple(out)
        return self._chunks[g_z]

    def index(self, z: int, g_z: int) -> torch.Tensor:
        """(B, S/G_z) long: the global positions of the tokens z-rank ``z`` holds of each row, in its
        local order (its chunks in global order)."""
        key = ("index", z, g_z)
        if key not in self._cache:
            c = self.seq_len // (self.per_rank(g_z) * g_z)
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
    """The largest z-rank's attention work over the mean, summed over the rows: under the layout
    ``Documents.chunks`` chooses, or the plain head–tail one (2·G_z chunks) with ``head_tail``."""
    per_rank = [0] * g_z
    held: list[tuple[int, ...]]
    for row in range(documents.batch):
        if head_tail:
            work, held = documents.chunk_work(row, 2 * g_z), [(z, 2 * g_z - 1 - z) for z in range(g_z)]
        else:
            work, held = documents.chunk_work(row, documents.per_rank(g_z) * g_z), list(documents.chunks(g_z)[row])
        for z, chunks in enumerate(held):
            per_rank[z] += sum(work[k] for k in chunks)
    return max(per_rank) / (sum(per_rank) / g_z)


def as_documents(documents: Documents | Sequence[Sequence[int]], batch: int, seq_len: int, what: str) -> Documents:
    """``documents`` (a ``Documents`` or per-row lengths) checked to describe ``batch`` rows of
    ``seq_len`` tokens (``Documents.check``)."""
    if not isinstance(documents, Documents):
        documents = Documents(documents)
    return documents.check(batch, seq_len, what)
