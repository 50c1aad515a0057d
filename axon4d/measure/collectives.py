"""What collectives cost on this machine, measured on every rank at once (docs/design.md §3, §4, §6, §7).

- every collective (all-reduce, all-gather, reduce-scatter, and the all-to-all of an MoE layer's
  dispatch, §10 E16) through ``axon4d.comm.communicator`` on every axis geometry (group size, rank stride; E1)
  of the world, at several payloads (``comm_curves``): the measured t(payload) that replaces §3's
  α·steps + bytes/β (and E16's pairwise exchange) where a machine has it;
- how much of an asynchronous all-reduce a concurrent GEMM hides (``overlap_efficiency``; §4);
- how much GEMM time each byte of ring traffic of a collective running beside it costs
  (``interference``; on a host whose ranks share cores, §7).

``hidden_share`` and ``interference_per_byte`` turn the timings into those two figures, clamped to
their ranges; they are plain functions so that the clamping can be tested without a grid.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import torch

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridShape
from axon4d.measure.timing import Timer
from axon4d.plan.collective_model import ring_traffic
from axon4d.plan.tables import CommCurve

#: collective payloads (bytes) of the curves
PAYLOADS = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
#: the collectives whose curves are measured (``CommCurve.op``), in the order ``_comm_sweep`` runs them
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: all-reduce payloads (bytes) of the interference probe: large, so per-collective costs are small
#: beside the bytes' and cancel in the difference of the two
INTERFERENCE_PAYLOADS = (4 << 20, 16 << 20)


def geometries(world: int) -> list[tuple[int, int]]:
    """(group size, stride) of every axis a grid of ``world`` ranks can have (E1)."""
    out = []
    for g in range(2, world + 1):
        for s in range(1, world // g + 1):
            if world % (g * s) == 0:
                out.append((g, s))
    return out


def comm_curves(
    timer: Timer, dtype: torch.dtype, passes: int = 1, payloads: Sequence[int] = PAYLOADS
) -> list[CommCurve]:
    """Every collective on every axis geometry; ``passes`` sweeps over all of them, per-point median
    (a shared host's load drifts: spreading the repetitions over time makes the median robust)."""
    sweeps = [_comm_sweep(timer, dtype, payloads) for _ in range(passes)]
    curves = []
    for same in zip(*sweeps):  # one (op, geometry) as measured in every pass
        points = range(len(same[0].payload))
        curves.append(
            dataclasses.replace(same[0], seconds=[statistics.median(c.seconds[i] for c in same) for i in points])
        )
    return curves


def _comm_sweep(timer: Timer, dtype: torch.dtype, payloads: Sequence[int]) -> list[CommCurve]:
    """One pass: each geometry as the y axis of a grid built on the existing ranks, each of ``OPS``
    at each payload (an all-to-all's: ``all_to_all_payload``, the bytes each rank sends)."""
    world = timer.grid.world_size
    curves = []
    elem = dtype.itemsize
    for g, s in geometries(world):
        shape = GridShape(s, g, world // (g * s), 1)  # the y axis: g ranks, stride s = G_x
        grid = Grid(shape, timer.device, timer.grid.comm.transport_name, launcher="existing")
        one_row_each = [1] * g  # the all-to-all's split sizes, sent and received
        try:
            for op in OPS:
                secs = []
                for payload in payloads:
                    n = payload // elem
                    if op == "all_reduce":
                        buf = torch.zeros(n, dtype=dtype, device=timer.device)
                        fn = lambda: grid.comm.all_reduce(buf, "y").wait()  # noqa: E731
                    elif op == "all_gather":
                        buf = torch.zeros(n // g, dtype=dtype, device=timer.device)
                        fn = lambda: grid.comm.all_gather(buf, "y").wait()  # noqa: E731
                    elif op == "reduce_scatter":
                        buf = torch.zeros(n - n % g, dtype=dtype, device=timer.device)
                        fn = lambda: grid.comm.reduce_scatter(buf, "y").wait()  # noqa: E731
                    else:  # (g, n/g): one row to each rank of the axis, this rank's own included
                        buf = torch.zeros(g, n // g, dtype=dtype, device=timer.device)
                        fn = lambda: grid.comm.all_to_all(buf, "y", one_row_each, one_row_each).wait()  # noqa: E731
                    secs.append(timer.measure_collective(fn))
                grid.comm.log.clear()
                sizes = [all_to_all_payload(p, g, elem) for p in payloads] if op == "all_to_all" else list(payloads)
                curves.append(CommCurve(op, g, s, world, sizes, secs))
        finally:
            grid.comm.barrier()
            grid.destroy()
    return curves


def all_to_all_payload(payload: int, group: int, elem: int) -> int:
    """Bytes each rank sends in the sweep's all-to-all of nominal ``payload`` bytes over ``group``
    ranks (what the communication log records for it, E16): one row of ⌊payload/(elem·group)⌋
    elements to every rank, its own included — ``payload`` itself wherever the group divides it
    (every power-of-two group at ``PAYLOADS``)."""
    return group * (payload // elem // group) * elem


def _beside(timer: Timer, buf: torch.Tensor, length: float) -> tuple[float, float, float]:
    """Seconds of an async all-reduce of ``buf`` on the world axis alone, of GEMMs lasting about
    ``length`` times as long alone, and of the two together (issue, GEMMs, wait)."""
    comm = timer.grid.comm
    a = torch.randn(512, 512, dtype=buf.dtype, device=timer.device)
    t_one = timer.measure(lambda: a @ a)
    t_ar = timer.measure_collective(lambda: comm.all_reduce(buf, "world").wait())
    reps = max(1, int(length * t_ar / t_one))  # t_ar and t_one are means over ranks: every rank agrees
    t_mm = timer.measure(lambda: [a @ a for _ in range(reps)])

    def both() -> None:
        h = comm.all_reduce(buf, "world")
        for _ in range(reps):
            a @ a
        h.wait()

    return t_ar, t_mm, timer.measure_collective(both)


def hidden_share(t_ar: float, t_mm: float, t_both: float) -> float:
    """Share of the shorter of an all-reduce (``t_ar`` alone) and GEMMs (``t_mm`` alone) that running
    them together (``t_both``) hid: (t_mm + t_ar − t_both) / min(t_mm, t_ar), clamped to [0, 1]
    (timing noise can make the pair a little faster than perfect overlap, or slower than serial)."""
    hidden = t_mm + t_ar - t_both
    return float(min(max(hidden / min(t_mm, t_ar), 0.0), 1.0))


def overlap_efficiency(timer: Timer, dtype: torch.dtype) -> float:
    """Share of an async all-reduce (world axis) that a concurrent GEMM of similar length hides."""
    if timer.grid.world_size == 1:
        return 1.0
    return hidden_share(*_beside(timer, torch.zeros((4 << 20) // 4, dtype=dtype, device=timer.device), 1.0))


def interference_per_byte(excess: Sequence[float], traffic: Sequence[float]) -> float:
    """Seconds of compute lost per byte of ring traffic, from the GEMMs' excess time beside two
    all-reduces of different size (``excess``) and those all-reduces' ring traffic (``traffic``):
    the slope between the two, so that what every collective costs regardless of its size cancels;
    clamped at 0 (a negative slope is timing noise: moving more bytes cannot give time back)."""
    return max((excess[1] - excess[0]) / (traffic[1] - traffic[0]), 0.0)


def interference(timer: Timer, dtype: torch.dtype) -> float:
    """Seconds of GEMM time lost per byte of ring traffic (``ring_traffic``) of an asynchronous
    all-reduce on the world axis running beside the GEMMs (every rank at once).

    For each of ``INTERFERENCE_PAYLOADS``: GEMMs lasting twice the all-reduce alone, once alone
    and once with the all-reduce issued before them and waited on after (``_beside``). With a
    core per rank the pair would take as long as the GEMMs; the excess is what moving the bytes
    took from them. The excess at the larger payload minus that at the smaller, per byte of
    traffic between them (``interference_per_byte``), leaves out what every collective costs
    regardless of its size (the in-step scale's per-collective term prices that)."""
    world = timer.grid.world_size
    if world == 1:
        return 0.0
    elem = dtype.itemsize
    excess = []
    for payload in INTERFERENCE_PAYLOADS:
        _, t_mm, t_both = _beside(timer, torch.zeros(payload // elem, dtype=dtype, device=timer.device), 2.0)
        excess.append(t_both - t_mm)
    return interference_per_byte(excess, [ring_traffic("all_reduce", world, p) for p in INTERFERENCE_PAYLOADS])
