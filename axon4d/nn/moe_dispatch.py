"""The all-to-all of an MoE layer's rows to their experts and back (docs/moe.md, E16):
``Exchange``, issued as soon as its rows exist and joined to the autograd graph where its result is
needed, so each chunk's exchange travels while other chunks' expert GEMMs run, in forward and in
backward. The dispatch carries each row's gate with it; under ``dispatch=fp8`` the rows toward the
experts travel in e4m3 (``axon4d.options.fp8_rows``). Who sends how many rows to whom is the plan's
(``axon4d.nn.moe_routes``).
"""

from __future__ import annotations

from typing import Any

import torch

from axon4d.comm.communicator import Handle
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term
from axon4d.options import fp8_rows


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
