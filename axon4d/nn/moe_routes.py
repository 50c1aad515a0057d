"""Who sends which rows where in an MoE layer (docs/moe.md, E15): every rank's share of the
plane's tokens and the dispatch plan sized by one exchange of counts.

Layout (docs/design.md §2): an MoE layer's input is (T, hidden/G_x) on every rank, split over x by
features, replicated over y; tokens differ over batch = data × z, and the expert layout's
expert-parallel axes ``ep`` hold different experts. Every y rank of a group holds the same tokens,
so each sends only its **share** — the token rows ``share_sizes`` gives index j of y — and the
experts' ranks gather the shares over y (E17): a token crosses the expert-parallel axes once, not
G_y times.

**The plan** (``DispatchPlan.exchange``, E15). Every rank counts its (T, k) assignments per share,
chunk of the share and expert, (C, E), all-gathers the counts over the count group (``Peers``:
the ranks its dispatch exchanges rows with, and their y-neighbours where y splits the experts)
and, at the same time, sums them over the total group (every share of the micro-batch once),
both read on the host in one copy — the one host synchronisation of an MoE layer. From them every
rank derives the same split sizes for both all-to-alls (E16, ``axon4d.nn.moe_dispatch``) and the
y gathers of each chunk, the rows per local expert, and the micro-batch's tokens per expert for
the balance loss. A recomputed forward (docs/design.md §5) reuses the plan of its first forward: no
routing decision and no host sync runs again.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from axon4d import device as devices
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import AXES, Axis, GridShape, axis_of
from axon4d.layout.geometry import Term


def share_sizes(tokens: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` contiguous shares of ``tokens`` rows, the first ones a row longer."""
    base, extra = divmod(tokens, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclasses.dataclass(frozen=True)
class Peers:
    """An MoE layer's ranks as its dispatch sees them, from the grid and the expert layout (built
    once per layer; numpy on the host, nothing communicated).

    Every (x, y) plane holds the same tokens; each rank dispatches its own **share** of them: the
    y-th contiguous share, cut again into G_x sub-shares where x does not split the experts (the
    rows are then moved from features to rows over x first). The counts are all-gathered over the
    **count group** — the expert-parallel axes, and y where it splits the experts (axes of one rank
    left out) — so that every rank knows the sizes of its all-to-alls and of its gather over y, and
    summed over the **total group** — the expert-parallel axes, z and data, y, and x where shares
    are cut over it: every share of the micro-batch once — for the micro-batch's tokens per expert
    (E15). Where the two groups are one, the gathered counts hold every share and nothing is summed."""

    count_axis: Axis | None
    """The axis (a product of grid axes) the counts are all-gathered over; None: one rank."""
    total_axis: Axis | None
    """The axis the counts are summed over besides (the total group); None: the count group's
    gathered counts hold every share of the micro-batch already."""
    me: int
    """This rank's index in the count group."""
    members: tuple[int, ...]
    """(G_ep,) the count-group index of each rank of the expert-parallel group, in its order."""
    y_members: tuple[tuple[int, ...], ...] | None
    """(G_y, G_ep) where y splits the experts: the count-group index of the rank that sends to this
    rank's y-neighbour y′ from expert-parallel rank q; None: no gather over y."""
    ep_index: int
    local_experts: int
    """E/G_ep: experts held by each rank of the expert-parallel group."""

    @classmethod
    def of(
        cls,
        shape: GridShape,
        rank: int,
        ep: tuple[str, ...],
        count: tuple[str, ...],
        gather_y: bool,
        n_experts: int,
        summed: tuple[str, ...] = (),
    ) -> Peers:
        """The peers of ``rank`` for experts over the ``ep`` axes (of more than one rank), counts
        gathered over the ``count`` axes and summed over the ``summed`` axes (none: the count axes
        hold every share; ``ExpertLayout.summed_axes``), gathered over y at the experts when ``gather_y``."""
        mine: dict[str, int] = {a: shape.coordinate(rank, a) for a in AXES}
        radix = [shape.size(a) for a in count]

        def index(coords: dict[str, int], axes: tuple[str, ...]) -> int:
            out, step = 0, 1
            for a in axes:
                out += coords[a] * step
                step *= shape.size(a)
            return out

        every = []  # (count-group index, coordinates) of each member
        for m in range(math.prod(radix)):
            coords: dict[str, int] = dict(mine)
            rest = m
            for a, n in zip(count, radix):
                coords[a], rest = rest % n, rest // n
            every.append(coords)
        fixed = [a for a in count if a not in ep]
        peers = sorted((index(c, ep), m) for m, c in enumerate(every) if all(c[a] == mine[a] for a in fixed))
        members = tuple(m for _, m in peers)
        y_members = None
        if gather_y:
            y_members = tuple(
                tuple(index({**every[m], "y": y}, count) for m in members) for y in range(shape.size("y"))
            )
        g_ep = math.prod(shape.size(a) for a in ep)
        return cls(
            axis_of(count), axis_of(summed), index(mine, count), members, y_members, index(mine, ep), n_experts // g_ep
        )


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Who sends how many rows to whom in one chunk, from the counts K[m, e] of the count group's
    member m (its share's assignments to expert e), the same on every rank. The sizes are numpy sums
    on the host, right after the counts' host sync while the device waits."""

    counts: np.ndarray
    """K: (G_count, E) int64 assignments of each count-group member's share per expert."""
    peers: Peers
    totals: np.ndarray | None = None
    """(E,) int64 assignments per expert of every share of the micro-batch; None: ``counts``' sums."""

    @classmethod
    def exchange(cls, counts: torch.Tensor, peers: Peers, grid: Grid) -> list[DispatchPlan]:
        """Gather every rank's (C, E) ``counts`` — its share's assignments per chunk and expert —
        over the count group and sum them over the total group (E15), both issued at once, and
        read them on the host in one copy: one plan per chunk."""
        chunks, e = counts.shape
        flat = counts.reshape(-1).to(torch.int64).contiguous()  # (C·E,)
        summed = None
        if peers.total_axis is not None:  # in flight with the gather: the sums need no other rank's counts
            summed = grid.comm.all_reduce(flat.clone(), peers.total_axis, tag=Term.MOE_COUNTS)
        gathered = flat
        if peers.count_axis is not None:
            gathered = grid.comm.all_gather(flat, peers.count_axis, tag=Term.MOE_COUNTS).wait()  # (G_count·C·E,)
        both = gathered if summed is None else torch.cat([gathered, summed.wait()])
        values = both.to(devices.HOST).numpy()  # the host sync of the layer
        every = values[: gathered.numel()].reshape(-1, chunks, e)
        totals = values[gathered.numel() :].reshape(chunks, e) if summed is not None else every.sum(axis=0)
        return [cls(every[:, c, :], peers, totals[c]) for c in range(chunks)]

    @functools.cached_property
    def _local(self) -> np.ndarray:
        """(G_y′, G_ep, E_l): the rows of this rank's experts from each source, by y-neighbour
        (one where nothing is gathered over y) — the order the gathered rows come in."""
        p = self.peers
        lo = p.ep_index * p.local_experts
        mine = self.counts[:, lo : lo + p.local_experts]
        if p.y_members is None:
            return mine[list(p.members)][None]
        return np.stack([mine[list(row)] for row in p.y_members])

    @property
    def send_rows(self) -> list[int]:
        """Rows this rank's share sends to each rank of the expert-parallel group (E16)."""
        p = self.peers
        return self.counts[p.me].reshape(-1, p.local_experts).sum(axis=1).tolist()

    @property
    def recv_rows(self) -> list[int]:
        """Rows this rank receives from each rank of the expert-parallel group (E16)."""
        p = self.peers
        lo = p.ep_index * p.local_experts
        return self.counts[list(p.members), lo : lo + p.local_experts].sum(axis=1).tolist()

    @property
    def y_rows(self) -> list[int]:
        """Rows each y-neighbour of this rank's experts received: the sizes of the gather over y (E17)."""
        return self._local.sum(axis=(1, 2)).tolist()

    def runs(self) -> tuple[list[int], list[int]]:
        """(local expert, rows) of each run of the gathered rows, in their order: y-neighbour, then
        source rank, then expert."""
        rows = self._local.reshape(-1)
        experts = np.tile(np.arange(self.peers.local_experts), rows.size // max(self.peers.local_experts, 1))
        return experts.tolist(), rows.tolist()

    @property
    def group_rows(self) -> list[int]:
        """Rows each local expert computes (its group of the grouped GEMM)."""
        return self._local.sum(axis=(0, 1)).tolist()

    def tokens_per_expert(self) -> np.ndarray:
        """The chunk's assignments per expert over the micro-batch (every share counted once), (E,)."""
        return self.counts.sum(axis=0) if self.totals is None else self.totals
