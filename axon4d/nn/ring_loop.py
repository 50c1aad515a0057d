"""The ring of context parallelism's ring mode (pass-KV, docs/context.md): one home for the loop that
passes a rank's keys and values around ``axis`` (z, or batch = z × data for hierarchical context
parallelism), read by the plain mode (``axon4d.nn.context_ring``) and the packed-documents mode
(``axon4d.nn.context_documents``), which supply the attention of one held buffer.

Forward (``ring_forward``): G − 1 shifts of the travelling buffer (2 [k, v], ...) to the next rank of
``axis``; at ring step s a rank holds rank o = (z − s) mod G's keys and values, and the shift that
brings step s+1's is issued before step s's attention, so it travels while the rank computes. Two
buffers are alive at a time (the one read, the one arriving).

Backward (``ring_backward``): the same ring again, passing with the keys and values an accumulator of
their gradients: at step s a rank adds what its queries contribute to the gradients of rank o's keys
and values to the accumulator it received from z − 1 (which holds what the ranks before it
contributed to the same o) and passes it on. The accumulator arriving after step G − 1 is this
rank's own, complete. Each step's accumulator shift travels while the next step's gradients are
computed (they are added to it only afterwards). Shifts go through the grid's communicator
(``Term.CP_KV_RING`` for the keys and values, ``Term.CP_KV_RING_GRAD`` for the accumulator).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term

#: one forward step: (held keys and values of rank o, o) -> None; merges their attention into the
#: caller's running output
Attend = Callable[[torch.Tensor, int], None]
#: one backward step: (held keys and values of rank o, their gradients' buffer of the same shape
#: (zeros), o) -> None; adds the rank's queries' share of those gradients into the buffer
AttendBackward = Callable[[torch.Tensor, torch.Tensor, int], None]


def ring_forward(kv: torch.Tensor, grid: Grid, axis: Axis, attend: Attend) -> None:
    """Call ``attend(held, o)`` for every rank o of ``axis``, this rank's own first: ``kv`` is this
    rank's keys and values (2 [k, v], ...), passed to the next rank of ``axis`` G − 1 times, the next
    step's shift in flight during each step's ``attend`` (module docstring)."""
    z, g = grid.coord(axis), grid.size(axis)
    for s in range(g):
        arriving = grid.comm.shift(kv, axis, tag=Term.CP_KV_RING) if s + 1 < g else None  # in flight meanwhile
        attend(kv, (z - s) % g)
        if arriving is not None:
            kv = arriving.wait()


def ring_backward(kv: torch.Tensor, grid: Grid, axis: Axis, attend_backward: AttendBackward) -> torch.Tensor:
    """The gradients of this rank's keys and values ``kv`` (2 [k, v], ...) summed over every rank of
    ``axis``: ``attend_backward(held, dheld, o)`` adds this rank's queries' share for rank o's keys
    and values into ``dheld``, and the accumulator goes around the ring with the keys and values
    (module docstring). Returns a tensor shaped like ``kv``."""
    z, g = grid.coord(axis), grid.size(axis)
    carried = None  # the accumulator of the held keys' gradients, arriving from z − 1
    for s in range(g):
        arriving = grid.comm.shift(kv, axis, tag=Term.CP_KV_RING) if s + 1 < g else None
        dkv = torch.zeros_like(kv)
        attend_backward(kv, dkv, (z - s) % g)
        if carried is not None:
            dkv += carried.wait()
        carried = grid.comm.shift(dkv, axis, tag=Term.CP_KV_RING_GRAD)  # the last one goes home
        if arriving is not None:
            kv = arriving.wait()
    assert carried is not None
    return carried.wait()  # every rank's contributions to this rank's keys and values
