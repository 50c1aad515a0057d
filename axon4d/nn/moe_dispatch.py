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
import math
from typing import Any

import numpy as np
import torch

from axon4d import device as devices
from axon4d.comm.communicator import Handle
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import AXES, Axis, GridShape, axis_of
from axon4d.layout.geometry import Term
from axon4d.options import fp8_rows


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
    rows are then moved from features to rows over x first). The counts of every share are
    all-gathered over the **count group** — the expert-parallel axes, z and data, y, and x where
    shares are cut over it (axes of one rank left out) — so that every rank knows the sizes of its
    all-to-alls, of its gather over y, and the micro-batch's tokens per expert (E15)."""

    count_axis: Axis | None
    """The axis (a product of grid axes) the counts are all-gathered over; None: one rank."""
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
        cls, shape: GridShape, rank: int, ep: tuple[str, ...], count: tuple[str, ...], gather_y: bool, n_experts: int
    ) -> Peers:
        """The peers of ``rank`` for experts over the ``ep`` axes (of more than one rank), counts
        gathered over the ``count`` axes, gathered over y at the experts when ``gather_y``."""
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
        return cls(axis_of(count), index(mine, count), members, y_members, index(mine, ep), n_experts // g_ep)


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Who sends how many rows to whom in one chunk, from the counts K[m, e] of the count group's
    member m (its share's assignments to expert e), the same on every rank. The sizes are numpy sums
    on the host, right after the counts' host sync while the device waits."""

    counts: np.ndarray
    """K: (G_count, E) int64 assignments of each count-group member's share per expert."""
    peers: Peers

    @classmethod
    def exchange(cls, counts: torch.Tensor, peers: Peers, grid: Grid) -> list[DispatchPlan]:
        """Gather every rank's (C, E) ``counts`` — its share's assignments per chunk and expert —
        over the count group (E15) and read them on the host: one plan per chunk."""
        flat = counts.reshape(-1).to(torch.int64).contiguous()
        if peers.count_axis is not None:
            flat = grid.comm.all_gather(flat, peers.count_axis, tag=Term.MOE_COUNTS).wait()  # (G_count·C·E,)
        values = flat.to(devices.HOST).numpy()  # the host sync of the layer
        chunks, e = counts.shape
        every = values.reshape(-1, chunks, e)
        return [cls(every[:, c, :], peers) for c in range(chunks)]

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
        return self.counts.sum(axis=0)


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


def _gate_bits(gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n,) fp32 gates as the (n, 4/elem) values of ``dtype`` that hold their bits (a row's tail)."""
    return gates.detach().float().contiguous().view(-1, 1).view(dtype)


def _bits_gates(tail: torch.Tensor) -> torch.Tensor:
    """The (n,) fp32 gates whose bits ``tail`` (n, 4/elem) holds (``_gate_bits`` undone)."""
    return tail.contiguous().view(torch.float32).view(-1)


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
    was made between ``awaited`` and ``adopt`` — the other chunks' experts.

    The dispatch sends its rows with their gates (``dispatch`` in place of ``awaited`` and
    ``issue``; ``adopt`` then takes and returns (rows, gates)): each row carries its gate's four
    bytes after its features, and in backward the gate's gradient after the row's — one exchange
    either way; the expert applies the gate. ``received`` is the payload the forward's exchange
    delivered, made with ``keep`` (what a fully recomputed forward keeps for its re-run); one made
    with ``kept`` (that payload) exchanges nothing and adopts it, and one made ``lazy`` sends at
    ``adopt``, not at ``issue`` (the re-run's combine: torch's checkpoint stops the re-run before
    it, so it never sends)."""

    def __init__(
        self,
        send: list[int],
        recv: list[int],
        axis: Axis | None,
        grid: Grid,
        tag: Term,
        fp8_forward: bool = False,
        fp8_backward: bool = False,
        kept: torch.Tensor | None = None,
        lazy: bool = False,
        keep: bool = False,
    ):
        self.send, self.recv, self.axis, self.grid, self.tag = send, recv, axis, grid, tag
        self.live = axis is not None and grid.size(axis) > 1  # an axis of one rank (or none) exchanges nothing
        #: the rows (``fp8_forward``) or their gradient (``fp8_backward``) travel packed in e4m3 with a
        #: scale per 128 features (``axon4d.options.fp8_rows``) and are restored on arrival
        self.fp8_forward, self.fp8_backward = fp8_forward and self.live, fp8_backward and self.live
        self.forward: Handle | None = None
        self.backward: Handle | None = None
        self.kept, self.lazy = kept, lazy
        self.payload: torch.Tensor | None = None  # a lazy exchange's rows, sent at ``adopt``
        #: the payload the forward's exchange delivered, (Σ recv, W), where ``keep`` asks for it
        self.keep = keep
        self.received: torch.Tensor | None = None

    def awaited(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows``, whose gradient is passed on once the reverse exchange has arrived."""
        return _Awaited.apply(rows, self) if self.live else rows

    def dispatch(
        self, x: torch.Tensor, rows: torch.Tensor, gates: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send ``x``'s rows ``rows`` (n,) with the gates ``gates[slots]`` (n,) — selected straight
        into the payload, no copy of the rows made first — and return (rows, gates) for ``adopt``:
        (n, F) and (n,) stand-ins whose gradients, once the reverse exchange has arrived, go back to
        ``x``'s rows and ``gates``' slots (``_Dispatched``)."""
        if not self.live:
            return x.index_select(0, rows), gates.index_select(0, slots)
        return _Dispatched.apply(x, gates, rows, slots, self)

    def issue(self, rows: torch.Tensor) -> None:
        """Start the exchange of ``rows`` (values only: autograd joins at ``adopt``); a lazy one's at ``adopt``."""
        if not self.live or self.kept is not None:
            return
        assert self.axis is not None  # live
        payload = self._pack(rows, None, self.fp8_forward)
        if self.lazy:
            self.payload = payload
        else:
            self.forward = self.grid.comm.all_to_all(payload, self.axis, self.send, self.recv, tag=self.tag)

    def adopt(self, rows: torch.Tensor, gates: torch.Tensor | None = None) -> Any:
        """The exchanged rows (Σ recv, …) (and their gates), waited for now, differentiable with
        respect to ``rows`` (and ``gates``)."""
        if not self.live:
            return rows if gates is None else (rows, gates)
        if gates is None:
            return _Adopted.apply(rows, None, self)[0]
        return _Adopted.apply(rows, gates, self)

    @staticmethod
    def _pack(
        rows: torch.Tensor, gates: torch.Tensor | None, fp8: bool, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What travels: ``rows`` (n, F) — or, with ``select`` (n,), those rows of ``rows``, selected
        straight into the send buffer — packed in e4m3 where ``fp8``, each followed by its gate's bytes."""
        if fp8:
            picked = rows if select is None else rows.index_select(0, select)
            return fp8_rows.pack(picked, None if gates is None else _gate_bits(gates, torch.uint8))
        if gates is None and select is None:
            return rows.detach()
        n, f = (rows.shape[0] if select is None else select.shape[0]), rows.shape[1]
        out = rows.new_empty(n, f + (0 if gates is None else 4 // rows.element_size()))  # (n, F [+ 4/elem])
        if select is None:
            out[:, :f].copy_(rows.detach())
        else:
            torch.index_select(rows.detach(), 0, select, out=out[:, :f])
        if gates is not None:
            out[:, f:].copy_(_gate_bits(gates, rows.dtype))
        return out

    @staticmethod
    def _unpack(
        got: torch.Tensor, features: int, dtype: torch.dtype, gated: bool, fp8: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_pack``'s rows (Σ recv, ``features``) in ``dtype`` and their gates (Σ recv,) fp32 (None without)."""
        rows = fp8_rows.unpack(got, features, dtype) if fp8 else got[:, :features]
        if not gated:
            return rows, None
        start = fp8_rows.packed_width(features) if fp8 else features
        return rows, _bits_gates(got[:, start:])


class _Dispatched(torch.autograd.Function):
    """Forward: the payload of ``x``'s rows ``rows`` and the gates ``gates[slots]`` packed and put on
    the wire (nothing under a kept payload: the re-run adopts it); returns stand-ins holding no
    memory. Backward: wait for the reverse exchange, then each row's gradient added to its token's
    and each gate's put in its slot. The indices are held by the node, not saved for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, gates: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.ex, ctx.rows, ctx.slots, ctx.shapes = ex, rows, slots, (x.shape, gates.shape)
        n, f = rows.shape[0], x.shape[-1]
        if ex.kept is None:
            payload = Exchange._pack(x, gates.index_select(0, slots), ex.fp8_forward, select=rows)
            assert ex.axis is not None  # live
            ex.forward = ex.grid.comm.all_to_all(payload, ex.axis, ex.send, ex.recv, tag=ex.tag)
        return x.new_zeros(()).expand(n, f), gates.new_zeros(()).expand(n)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, g_gates: torch.Tensor) -> tuple[Any, ...]:
        ex = ctx.ex
        handle, ex.backward = ex.backward, None
        x_shape, gates_shape = ctx.shapes
        if handle is None:  # no gradient came through the exchange
            return g.new_zeros(x_shape), g_gates.new_zeros(gates_shape), None, None, None
        got = handle.wait()
        rows, gates = Exchange._unpack(got, x_shape[-1], g.dtype, True, False)
        assert gates is not None
        dx = rows.new_zeros(x_shape).index_add_(0, ctx.rows, rows)
        return dx, gates.new_zeros(gates_shape).index_add_(0, ctx.slots, gates), None, None, None


class _Adopted(torch.autograd.Function):
    """Forward: wait for the exchange issued earlier (or adopt the kept payload, or exchange a lazy
    one now). Backward: issue the reverse exchange of the gradient (and the gates' gradient) and
    hand stand-ins on, replaced by ``_Awaited`` once it has arrived."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, gates: torch.Tensor | None, ex: Exchange) -> tuple[Any, ...]:
        ctx.ex, ctx.gated = ex, gates is not None
        if ex.kept is not None:
            got = ex.kept
        elif ex.lazy:
            assert ex.payload is not None and ex.axis is not None, "Exchange.adopt before Exchange.issue"
            got = ex.grid.comm.all_to_all(ex.payload, ex.axis, ex.send, ex.recv, tag=ex.tag).wait()
            ex.payload = None
        else:
            assert ex.forward is not None, "Exchange.adopt before Exchange.issue"
            handle, ex.forward = ex.forward, None
            got = handle.wait()
        if ex.keep:
            ex.received = got
        out, g = Exchange._unpack(got, rows.shape[-1], rows.dtype, gates is not None, ex.fp8_forward)
        return out, g

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, g_gates: torch.Tensor | None) -> tuple[Any, ...]:
        ex = ctx.ex
        if ctx.gated and g_gates is None:
            g_gates = g.new_zeros(g.shape[0], dtype=torch.float32)
        payload = Exchange._pack(g, g_gates if ctx.gated else None, ex.fp8_backward)
        ex.backward = ex.grid.comm.all_to_all(payload, ex.axis, ex.recv, ex.send, tag=f"{ex.tag}.grad")
        if ex.fp8_backward or ctx.gated:  # restored by ``_Awaited.backward`` once arrived; stand-ins hold no memory
            stand_in = g.new_zeros(()).expand(sum(ex.send), g.shape[-1])
            return stand_in, (g.new_zeros((), dtype=torch.float32).expand(sum(ex.send)) if ctx.gated else None), None
        return ex.backward.buffer, None, None  # complete once ``_Awaited.backward`` has waited


class _Awaited(torch.autograd.Function):
    """Identity forward; backward: wait for the reverse exchange, then pass the gradient on."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, ex: Exchange) -> torch.Tensor:
        ctx.ex = ex
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        ex = ctx.ex
        handle, ex.backward = ex.backward, None
        if handle is None:
            return g, None
        got = handle.wait()  # ``g`` is its buffer, or under fp8 a stand-in for the packed rows
        return (fp8_rows.unpack(got, g.shape[-1], g.dtype) if ex.fp8_backward else g), None


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


def _transpose(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, to_rows: bool, tag: Term) -> torch.Tensor:
    """One all-to-all over ``axis`` between two layouts of the same rows: split by features — every
    rank of ``axis`` holds all Σ``sizes`` rows, its 1/G of the columns — and split by rows — rank i
    holds block i of ``sizes[i]`` rows, every column. ``to_rows``: the first to the second."""
    g, i = grid.size(axis), grid.coord(axis)
    if to_rows:  # (Σ sizes, c) → (sizes[i], G·c)
        got = grid.comm.all_to_all(x.contiguous(), axis, sizes, [sizes[i]] * g, tag=tag).wait()  # (G·n_i, c)
        return got.view(g, sizes[i], -1).transpose(0, 1).reshape(sizes[i], -1)
    c = x.shape[-1] // g  # (sizes[i], G·c) → (Σ sizes, c)
    parts = x.view(sizes[i], g, c).transpose(0, 1).contiguous().view(g * sizes[i], c)
    return grid.comm.all_to_all(parts, axis, [sizes[i]] * g, sizes, tag=tag).wait()


class _Transposed(torch.autograd.Function):
    """Forward: ``_transpose`` one way; backward: the other way (the gradient has the output's layout)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid, to_rows: bool) -> torch.Tensor:
        ctx.sizes, ctx.axis, ctx.grid, ctx.to_rows = sizes, axis, grid, to_rows
        return _transpose(x, sizes, axis, grid, to_rows, Term.MOE_ROWS_X)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        back = _transpose(g.contiguous(), ctx.sizes, ctx.axis, ctx.grid, not ctx.to_rows, Term.MOE_ROWS_X_GRAD)
        return back, None, None, None, None


def features_to_rows(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid) -> torch.Tensor:
    """(Σ sizes, c) rows whose columns are split over ``axis`` → this rank's block of ``sizes[i]``
    rows with every column, (sizes[i], G·c): an all-to-all over ``axis`` (E16: the move over x), reversed in backward."""
    return x if grid.size(axis) == 1 else _Transposed.apply(x, sizes, axis, grid, True)


def rows_to_features(x: torch.Tensor, sizes: list[int], axis: Axis, grid: Grid) -> torch.Tensor:
    """The inverse of ``features_to_rows``: (sizes[i], G·c) → (Σ sizes, c)."""
    return x if grid.size(axis) == 1 else _Transposed.apply(x, sizes, axis, grid, False)


class _SummedPairs(torch.autograd.Function):
    """Forward: the rows of ``back`` taken in ``index`` order, (T·k, F), summed over each token's k
    consecutive rows: (T, F). Backward: each token's gradient to its k rows, put back where
    ``index`` took them. The index is held by the node, not saved for backward: nothing of the
    gated sum is a saved tensor, so a fully recomputed block's re-run stops before it (and before
    the combines that feed it)."""

    @staticmethod
    def forward(ctx: Any, back: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
        ctx.index, ctx.k = index, k
        pairs = back.index_select(0, index)  # (T·k, F) in token order
        return pairs.view(-1, k, pairs.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        k, index = ctx.k, ctx.index
        each = g.unsqueeze(1).expand(-1, k, -1).reshape(-1, g.shape[-1])  # (T·k, F) in token order
        return torch.empty_like(each).index_copy_(0, index, each), None, None


def summed_pairs(back: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """(T, F): ``back``'s rows in ``index`` order (a permutation of its T·k rows), each token's k
    rows summed — the gated sum of an MoE layer's outputs (``_SummedPairs``)."""
    return _SummedPairs.apply(back, index, k)


class _Gated(torch.autograd.Function):
    """Forward: each of the experts' output rows (n, F) times its gate (n,) fp32, cast to the rows'
    dtype. Backward: the gates' gradient summed over each row's features (rounded as autograd's
    product would, and the single-process reference's), then the rows' gradient scaled in place of
    the incoming one (the combine's reverse exchange's buffer, which nothing else reads): one (n, F)
    tensor fewer than autograd's product makes."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        cast = gates.to(out.dtype)
        ctx.save_for_backward(out, cast)
        ctx.gate_dtype = gates.dtype
        return out * cast.unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        out, cast = ctx.saved_tensors
        d_gates = (g * out).sum(dim=-1)  # (n,): Σ_f g·out per row, summed as a product's broadcast gradient is
        d_out = g.mul_(cast.unsqueeze(-1)) if g.is_contiguous() else g * cast.unsqueeze(-1)
        return d_out, d_gates.to(ctx.gate_dtype)


def gated(out: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """(n, F) rows ``out`` each times its gate of ``gates`` (n,) (``_Gated``)."""
    return _Gated.apply(out, gates)
