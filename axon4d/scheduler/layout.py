"""Persistent E12 buckets: where each weight shard's reduced gradient lands in its bucket's flat
buffer (docs/design.md §4, ODP).

With buckets on (``OverlapPolicy.bucket_bytes`` > 0) a reducing backward flushes its weight shards'
gradients (E12, over data) in buckets. ``BucketLayout`` remembers which shard went where — param
id → (bucket, offset, numel) — and, in the next reducing backward, hands each shard a slice of its
bucket's flat buffer (``slot``): the reduce-scatter over z (E11), or with G_z = 1 the dW GEMM, writes
there, and the bucket is all-reduced as it stands (``in_place``) — no concatenation, and its slices
become the gradients. A shard the layout does not place (the first backward, changed control flow)
gets no slot and its bucket is concatenated as before.
"""

from __future__ import annotations

import torch

#: a gradient waiting in a bucket: (parameter, flat gradient in the reduction dtype, scale)
Item = tuple[torch.Tensor, torch.Tensor, float]


class BucketLayout:
    """The E12 buckets' layout learned from the previous reducing backward, and this backward's buffers."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[int, int, int]] = {}  # param id -> (bucket, offset, numel)
        self._sizes: list[int] = []  # each bucket's elements
        self._learning: list[list[tuple[int, int]]] = []  # this backward's buckets: (param id, numel)
        self._flats: dict[int, torch.Tensor] = {}  # bucket -> this backward's flat buffer

    def slot(self, param: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The slice of this backward's buffer that takes ``param``'s reduced shard of ``numel``
        elements, or None where the layout does not place it (or places it with another size). A
        bucket's buffer is made when its first shard asks."""
        where = self._where.get(id(param))
        if where is None or where[2] != numel:
            return None
        bucket, offset, _ = where
        flat = self._flats.get(bucket)
        if flat is None or flat.dtype != dtype or flat.device != device:
            flat = self._flats[bucket] = torch.empty(self._sizes[bucket], dtype=dtype, device=device)
        return flat[offset : offset + numel]

    def learn(self, items: list[Item]) -> None:
        """Note a flushed E12 bucket's members, in order: the next reducing backward's layout."""
        self._learning.append([(id(p), g.numel()) for p, g, _ in items])

    @staticmethod
    def in_place(items: list[Item]) -> torch.Tensor | None:
        """The flat buffer ``items`` fill exactly, in order (all written through ``slot``), or None."""
        first = items[0][1]
        flat = first._base
        if flat is None or first.data_ptr() != flat.data_ptr() or sum(g.numel() for _, g, _ in items) != flat.numel():
            return None
        ptr, size = flat.data_ptr(), flat.element_size()
        for _, g, _ in items:
            if g._base is not flat or g.data_ptr() != ptr:
                return None
            ptr += g.numel() * size
        return flat

    def relearn(self) -> None:
        """After a reducing backward: the E12 buckets it flushed become the layout of the next one
        (its buffers now belong to the gradients they became)."""
        if self._learning:
            self._where, self._sizes = {}, []
            for b, members in enumerate(self._learning):
                offset = 0
                for pid, numel in members:
                    self._where[pid] = (b, offset, numel)
                    offset += numel
                self._sizes.append(offset)
        self._learning = []
        self._flats = {}
