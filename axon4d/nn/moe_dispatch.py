"""Moving tokens to their experts and back over the grid (docs/moe.md, E15–E17): the dispatch plan
sized by one exchange of counts, and the differentiable collectives it runs.

Layout (docs/design.md §2): an MoE layer's input is (T, hidden/G_x) on every rank, split over x by
features, replicated over y; tokens differ over batch = data × z, the expert-parallel axis ``ep``.
Every y rank of a group holds the same tokens, so each sends only its **share** — the token rows
``share_sizes`` gives index j of y — and the experts' ranks gather the shares over y (E17): a
token crosses the expert-parallel axis once, not G_y times.

**The plan** (``DispatchPlan.exchange``, E15). Every rank counts its (T, k) assignments per y share,
chunk of the share and expert, (G_y, C, E), and all-gathers the counts over ``ep``, read on the
host — the one host synchronisation of an MoE layer, G_ep·G_y·C·E int64 values — from which every
rank derives the same split sizes for both all-to-alls (E16) and the y gathers of each chunk, the
rows per local expert, and the micro-batch's tokens per expert for the balance loss. A recomputed
forward (docs/design.md §5) reuses the plan of its first forward: no routing decision and no host
sync runs again.

**The exchanges** (``Exchange``): an all-to-all issued as soon as its rows exist and joined to the
autograd graph where its result is needed, so the C chunks' exchanges travel while other chunks'
expert GEMMs run, in forward and in backward; ``share_rows``/``gather_rows`` move rows over y.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from axon4d import device as devices
from axon4d.comm.communicator import Handle
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term


def share_sizes(tokens: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` contiguous shares of ``tokens`` rows, the first ones a row longer."""
    base, extra = divmod(tokens, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Who sends how many rows to whom, from the counts C[s, j, e] of source rank s (index on
    ``ep``), y share j and expert e (the same on every rank). The sizes are numpy sums over the
    part of C each needs, on the host, right after the counts' host sync while the device waits: a
    layer's counts are G_ep·G_y·E values per chunk (≈ 10⁵ at moe-1t's placement)."""

    counts: np.ndarray
    """C: (G_ep, G_y, E) int64 assignments per source rank, y share and expert."""
    ep_index: int
    y_index: int
    local_experts: int
    """E/G_ep: experts held by each rank of ``ep``."""

    @classmethod
    def exchange(cls, counts: torch.Tensor, ep: Axis, grid: Grid, local_experts: int) -> list[DispatchPlan]:
        """Gather every rank's (G_y, C, E) ``counts`` — assignments per y share, chunk of the share
        and expert — over ``ep`` (E15) and read them on the host: one plan per chunk."""
        g_ep = grid.size(ep)
        flat = counts.reshape(-1).to(torch.int64).contiguous()
        gathered = grid.comm.all_gather(flat, ep, tag=Term.MOE_COUNTS).wait()  # (G_ep·G_y·C·E,)
        values = gathered.to(devices.HOST).numpy()  # the host sync of the layer
        g_y, chunks, e = counts.shape
        every = values.reshape(g_ep, g_y, chunks, e)
        return [cls(every[:, :, c, :], grid.coord(ep), grid.coord("y"), local_experts) for c in range(chunks)]

    @functools.cached_property
    def _local(self) -> np.ndarray:
        """(G_ep, G_y, E/G_ep): the assignments to this rank's experts."""
        lo = self.ep_index * self.local_experts
        return self.counts[:, :, lo : lo + self.local_experts]

    @property
    def send_rows(self) -> list[int]:
        """Rows this rank's share sends to each rank of ``ep`` (E16): its counts summed over each
        rank's experts."""
        return self.counts[self.ep_index, self.y_index].reshape(-1, self.local_experts).sum(axis=1).tolist()

    @property
    def recv_rows(self) -> list[int]:
        """Rows this rank receives from each rank of ``ep`` for its y index (E16)."""
        return self._local[:, self.y_index].sum(axis=1).tolist()

    @property
    def y_rows(self) -> list[int]:
        """Rows each y index of this expert group received: the sizes of the gather over y (E17)."""
        return self._local.sum(axis=(0, 2)).tolist()

    def runs(self) -> tuple[list[int], list[int]]:
        """(local expert, rows) of each run of the gathered rows, in their order: y index, then
        source rank, then expert."""
        rows = self._local.transpose(1, 0, 2).reshape(-1)  # (G_y·G_ep·E_l,) y index, source, expert
        experts = np.tile(np.arange(self.local_experts), rows.size // max(self.local_experts, 1))
        return experts.tolist(), rows.tolist()

    @property
    def group_rows(self) -> list[int]:
        """Rows each local expert computes (its group of the grouped GEMM)."""
        return self._local.sum(axis=(0, 1)).tolist()

    def tokens_per_expert(self) -> np.ndarray:
        """The chunk's assignments per expert, every rank's (E,)."""
        return self.counts.sum(axis=(0, 1))


def _gather_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """Every rank's ``x`` of ``sizes[i]`` rows (its index i on ``axis``) stacked in index order:
    one all-gather of blocks padded to the largest."""
    most = max(sizes)
    padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    whole = grid.comm.all_gather(padded.contiguous(), axis, tag=tag).wait()  # (G·most, …)
    if all(n == most for n in sizes):  # no padding to drop: the gathered blocks are the result
        return whole
    return torch.cat([whole[i * most : i * most + n] for i, n in enumerate(sizes)])


def _own_rows(x: torch.Tensor, sizes: list[int], index: int) -> torch.Tensor:
    """Rows of index ``index``'s block of ``x`` (blocks of ``sizes`` back to back)."""
    start = sum(sizes[:index])
    return x[start : start + sizes[index]]


class Exchange:
    """One all-to-all of rows over ``axis`` (E16) whose communication is issued as soon as its
    rows exist and joined to the autograd graph later, where its result is needed — so it travels
    while other work runs, in forward and in backward (docs/moe.md, "Overlap"):

        ex = Exchange(send, recv, axis, grid, tag)
        rows = ex.awaited(rows)   # backward: the reverse exchange is waited for here, last
        ex.issue(rows)            # forward: on the wire from now
        ...                       # other chunks' work
        got = ex.adopt(rows)      # forward: waited here; backward: the reverse exchange issued here

    Autograd runs a node's backward after those of every node made later in the forward, so the
    reverse exchange, issued by ``adopt``'s backward, is in flight during the backward of whatever
    was made between ``awaited`` and ``adopt`` — the other chunks' experts."""

    def __init__(self, send: list[int], recv: list[int], axis: Axis, grid: Grid, tag: Term):
        self.send, self.recv, self.axis, self.grid, self.tag = send, recv, axis, grid, tag
        self.live = grid.size(axis) > 1  # an axis of one rank exchanges nothing
        self.forward: Handle | None = None
        self.backward: Handle | None = None

    def awaited(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows``, whose gradient is passed on once the reverse exchange has arrived."""
        return _Awaited.apply(rows, self) if self.live else rows

    def issue(self, rows: torch.Tensor) -> None:
        """Start the exchange of ``rows`` (values only: autograd joins at ``adopt``)."""
        if self.live:
            self.forward = self.grid.comm.all_to_all(rows.detach(), self.axis, self.send, self.recv, tag=self.tag)

    def adopt(self, rows: torch.Tensor) -> torch.Tensor:
        """The exchanged rows (Σ recv, …), waited for now, differentiable with respect to ``rows``."""
        return _Adopted.apply(rows, self) if self.live else rows


class _Adopted(torch.autograd.Function):
    """Forward: wait for the exchange issued earlier. Backward: issue the reverse exchange of the
    gradient and hand its buffer on, to be waited for by ``_Awaited``."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, ex: Exchange) -> torch.Tensor:
        ctx.ex = ex
        assert ex.forward is not None, "Exchange.adopt before Exchange.issue"
        handle, ex.forward = ex.forward, None
        return handle.wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        ex = ctx.ex
        ex.backward = ex.grid.comm.all_to_all(g.contiguous(), ex.axis, ex.recv, ex.send, tag=f"{ex.tag}.grad")
        return ex.backward.buffer, None  # complete once ``_Awaited.backward`` has waited


class _Awaited(torch.autograd.Function):
    """Identity forward; backward: wait for the reverse exchange, then pass the gradient on."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, ex: Exchange) -> torch.Tensor:
        ctx.ex = ex
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        handle, ctx.ex.backward = ctx.ex.backward, None
        if handle is not None:
            handle.wait()  # ``g`` is its buffer
        return g, None


class _ShareRows(torch.autograd.Function):
    """Forward: this rank's block of rows of a tensor replicated over ``axis`` (local). Backward:
    every rank's block of the gradient gathered over ``axis`` (each block's gradient is its own rank's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid, ctx.tag = sizes, axis, grid, tag
        return _own_rows(x, sizes, grid.coord(axis)).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.axis, ctx.grid, ctx.tag), None, None, None, None


def share_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term = Term.MOE_ROWS_Y) -> torch.Tensor:
    """This rank's block of ``x``'s rows (blocks of ``sizes`` over ``axis``); gathered in backward
    (under ``tag``)."""
    return x if grid.size(axis) == 1 else _ShareRows.apply(x, sizes, axis, grid, tag)


class _ScatterRows(torch.autograd.Function):
    """Forward: ``x``'s rows summed over ``axis`` (each rank holds a partial sum of all of them), and
    this rank's block kept — one reduce-scatter of blocks padded to the largest, half the bytes of
    an all-reduce. Backward: every rank's block of the gradient gathered over ``axis`` (the sum's
    gradient is the same on every rank's partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid = sizes, axis, grid
        most, start = max(sizes), 0
        padded = x.new_zeros((len(sizes) * most, *x.shape[1:]))  # (G·most, …): block i at i·most
        for i, n in enumerate(sizes):
            padded[i * most : i * most + n] = x[start : start + n]
            start += n
        mine = grid.comm.reduce_scatter(padded, axis, tag=tag).wait()  # (most, …)
        return mine[: sizes[grid.coord(axis)]]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.axis, ctx.grid, Term.MOE_ROWS_Y), None, None, None, None


def scatter_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """This rank's block of the rows of ``Σ_axis x`` (blocks of ``sizes`` over ``axis``; ``x`` is
    each rank's partial sum of every block): a reduce-scatter (``tag``), gathered in backward."""
    return x if grid.size(axis) == 1 else _ScatterRows.apply(x, sizes, axis, grid, tag)


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's block of rows gathered over ``axis`` (E17). Backward: this rank's
    block of the gradient, summed over ``axis`` first when the ranks used the whole apart
    (``summed``: each computed a partial gradient, e.g. of its own output features)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, summed: bool) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid, ctx.summed = sizes, axis, grid, summed
        return _gather_rows(x, sizes, axis, grid, Term.MOE_ROWS_Y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if ctx.summed:
            g = ctx.grid.comm.all_reduce(g.contiguous().clone(), ctx.axis, tag=Term.MOE_ROWS_Y_GRAD).wait()
        return _own_rows(g, ctx.sizes, ctx.grid.coord(ctx.axis)).contiguous(), None, None, None, None


def gather_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, summed: bool) -> torch.Tensor:
    """Every rank's block of rows (``sizes`` over ``axis``) stacked; see ``_GatherRows`` for ``summed``."""
    return x if grid.size(axis) == 1 else _GatherRows.apply(x, sizes, axis, grid, summed)


class _UseReplicated(torch.autograd.Function):
    """Identity forward for a tensor every rank of ``axis`` holds alike and uses for its own part;
    backward: the partial gradients summed over ``axis`` (Megatron's "f")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
        ctx.axis, ctx.grid, ctx.tag = axis, grid, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return ctx.grid.comm.all_reduce(g.contiguous().clone(), ctx.axis, tag=ctx.tag).wait(), None, None, None


def use_replicated(x: torch.Tensor, axis: Axis, grid: Grid, tag: Term) -> torch.Tensor:
    """``x`` as it is; its gradient is summed over ``axis`` (all-reduce in backward, under ``tag``)."""
    return x if grid.size(axis) == 1 else _UseReplicated.apply(x, axis, grid, tag)
