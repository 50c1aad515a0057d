"""Choosing the grid: enumerate every (G_x, G_y, G_z, G_data) of P ranks, keep the valid ones that
fit in memory, rank them by predicted step time (docs/design.md §6).

The divisibility rules (§1) — the workload's ``axon4d.rules`` objects, the ones the layers check —
are evaluated on all factorisations at once with numpy (``valid_mask``); only valid grids are
priced, each as one ``Scenario`` (``cost.step_estimate``, ``memory.memory``), in well under a
millisecond.
Besides time and memory, each candidate reports its communication words against Agarwal's lower
bound for its GEMMs, Σ 3·(M·K·N/P)^{2/3} per rank (§3).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from axon4d import rules
from axon4d.config import ModelConfig, get_config
from axon4d.overlap_policy import AUTO, OverlapPolicy
from axon4d.plan import stepfit
from axon4d.plan.cost import TimeEstimate, step_estimate
from axon4d.plan.machine import Machine, available, load
from axon4d.plan.memory import MemoryEstimate, memory
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload
from axon4d.shape import ALL_AXES, AXES, GridShape, factorizations

#: the axes the table gives communication time for: every axis but "world", over which no
#: collective of a step runs
TABLE_AXES = tuple(a for a in ALL_AXES if a != "world")
#: with ``overlap="auto"``, the knobs are tuned for this many of the fastest fitting grids
TUNE_TOP = 4


@dataclasses.dataclass
class Candidate:
    """One grid with its predicted time, memory and efficiency."""

    shape: GridShape
    time: TimeEstimate
    mem: MemoryEstimate
    fits: bool
    mfu: float
    bound_ratio: float  # communication words / Agarwal's lower bound
    context_parallel: bool = False  # each sequence's tokens split over z (docs/context.md)
    overlap: OverlapPolicy = OverlapPolicy()  # the policy it was priced with

    def to_json(self) -> dict[str, Any]:
        t = self.time
        return {
            "grid": list(self.shape.as_tuple()),
            "context_parallel": self.context_parallel,
            "overlap": self.overlap.spec(),
            "fits": self.fits,
            "step_s": t.step_s,
            "mfu": self.mfu,
            "compute_s": t.compute_s,
            "matmul_s": t.matmul_s,
            "optimizer_s": t.optimizer_s,
            "comm_s": t.comm_s,
            "hidden_s": t.hidden_s,
            "hidden_pct": t.hidden_pct,
            "traffic_bytes": t.traffic_bytes,
            "interference_s": t.interference_s,
            "comm_by_axis_s": t.comm_by_axis,
            "bytes_by_axis": t.bytes_by_axis,
            "hidden_by_mechanism_s": t.hidden_by_mechanism,
            "memory": self.mem.to_json(),
            "bound_ratio": self.bound_ratio,
            "collectives": t.collectives,
            "step_scale": list(t.scale),
            "layers": t.layers,
        }


@dataclasses.dataclass
class PlanResult:
    """All candidates of one planning run, best first, and what was asked."""

    workload: Workload
    machine: Machine
    world: int
    overlap: OverlapPolicy
    recompute: str
    memory_limit: float
    candidates: list[Candidate]  # valid grids, sorted: fitting ones by time, then the others
    invalid: int  # factorisations that break a divisibility rule
    caveat: str | None = None  # why the machine's in-step scale may not fit this job (stepfit.caveat)

    @property
    def best(self) -> Candidate:
        fitting = [c for c in self.candidates if c.fits]
        if not fitting:
            smallest = min(self.candidates, key=lambda c: c.mem.peak) if self.candidates else None
            need = f"; the smallest needs {smallest.mem.peak / 2**30:.1f} GiB on {smallest.shape}" if smallest else ""
            raise ValueError(
                f"no grid of {self.world} ranks fits {self.workload.model.name or 'the model'} in "
                f"{self.memory_limit / 2**30:.1f} GiB per device{need}; use more ranks, recompute='full', "
                f"or a smaller batch"
            )
        return fitting[0]

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        wl = self.workload
        return {
            "model": dataclasses.asdict(wl.model),
            "batch": wl.batch,
            "dtype": wl.dtype,
            "world": self.world,
            "machine": self.machine.name,
            "overlap": self.overlap.spec(),
            "recompute": self.recompute,
            "memory_limit": self.memory_limit,
            "valid": len(self.candidates),
            "invalid": self.invalid,
            "step_scale_caveat": self.caveat,
            "candidates": [c.to_json() for c in self.candidates[:top]],
        }

    def table(self, top: int = 10) -> str:
        """The top-k candidates as a text table."""
        head = (
            f"{'grid (x,y,z,d)':<18} {'seq':>5} {'step s':>9} {'MFU':>6} {'mem GiB':>8} {'fits':>4} "
            + " ".join(f"{'t_' + a:>8}" for a in TABLE_AXES)
            + f" {'hidden':>7} {'×bound':>7}"
        )
        lines = [head, "-" * len(head)]
        for c in self.candidates[:top]:
            t = c.time
            axes = " ".join(f"{t.comm_by_axis.get(a, 0.0):>8.3g}" for a in TABLE_AXES)
            lines.append(
                f"{str(c.shape.as_tuple()):<18} {'split' if c.context_parallel else 'whole':>5} {t.step_s:>9.4g} {100 * c.mfu:>5.1f}% "
                f"{c.mem.peak / 2**30:>8.2f} {'yes' if c.fits else 'NO':>4} {axes} "
                f"{t.hidden_pct:>6.0f}% {c.bound_ratio:>7.2f}"
            )
        return "\n".join(lines)


def valid_mask(wl: Workload, shapes: np.ndarray) -> np.ndarray:
    """Boolean per row of ``shapes`` (n, 4) = (x, y, z, data): does the grid satisfy every rule of
    ``wl.rules()`` (§1)? Each ``Rule.holds`` is evaluated on the columns of axis sizes at once."""
    sizes = dict(zip(AXES, shapes.T))
    ok = np.ones(len(shapes), dtype=bool)
    for rule in wl.rules():
        ok &= rule.holds(sizes)
    return ok


def agarwal_ratio(sc: Scenario, t: TimeEstimate) -> float:
    """Ring traffic words per rank ÷ Σ over the step's GEMMs of 3·(M·K·N/P)^{2/3} (§3)."""
    wl, shape = sc.workload, sc.shape
    p = sc.world
    bound = sum(
        3 * s.count * 3 * (wl.tokens * s.in_features * s.out_features / p) ** (2 / 3)
        for s in sc.linears
        if not s.embedding
    )
    words = 0.0
    for axis, nbytes in t.bytes_by_axis.items():
        g = shape.size(axis)
        words += nbytes / sc.element_size * (g - 1) / g * 1.5  # ~ AR (2φ) and AG/RS (φ) mixed
    return words / bound if bound else math.nan


def evaluate(
    wl: Workload,
    shape: GridShape,
    machine: Machine,
    overlap: OverlapPolicy = OverlapPolicy(),
    recompute: str = "none",
    memory_limit: float | None = None,
) -> Candidate:
    """Predicted time, memory and MFU of one valid grid: ``candidate`` of their ``Scenario``."""
    return candidate(Scenario(wl, shape, machine, overlap, recompute), memory_limit)


def candidate(sc: Scenario, memory_limit: float | None = None) -> Candidate:
    """Predicted time (recomputation included), memory and MFU of ``sc``; it fits where its peak is
    within ``memory_limit`` bytes (default: the machine's device memory)."""
    wl, machine = sc.workload, sc.machine
    limit = machine.memory_per_device if memory_limit is None else memory_limit
    t = step_estimate(sc)
    mem = memory(wl, sc.shape, sc.recompute, sc.overlap, staged_reduce_scatter=machine.staged_reduce_scatter)
    mfu = wl.flops() / (sc.world * machine.peak(wl.dtype) * t.step_s)
    return Candidate(sc.shape, t, mem, mem.peak <= limit, mfu, agarwal_ratio(sc, t), wl.context_parallel, sc.overlap)


def tune_overlap(
    wl: Workload,
    shape: GridShape,
    machine: Machine,
    base: OverlapPolicy = OverlapPolicy(),
    recompute: str = "none",
    memory_limit: float | None = None,
) -> Candidate:
    """``shape`` priced with the fastest of ``base``'s knob variants that fits in memory
    (``OverlapPolicy.knob_variants``: OAG depth and keep-for-backward, ORS in flight, forward
    chunks); ``base`` itself where no variant fits or none is faster. Ties go to the earlier
    variant (shallower, fewer in flight and chunks: less memory held)."""
    best = evaluate(wl, shape, machine, base, recompute, memory_limit)
    for policy in base.knob_variants():
        if policy == base:
            continue
        c = evaluate(wl, shape, machine, policy, recompute, memory_limit)
        if c.fits and (not best.fits or c.time.step_s < best.time.step_s * (1 - 1e-9)):
            best = c
    return best


def load_machine(machine: Machine | str) -> Machine:
    """``axon4d.plan.machine.load``, with a file that is not a machine description (not JSON, not
    an object, a field missing or of the wrong kind) refused by a ``ValueError`` naming the file and
    what to use instead."""
    if not isinstance(machine, str) or not os.path.isfile(machine):
        return load(machine)
    try:
        return load(machine)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        what = f"lacks the field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(
            f"machine file {machine!r} is not a machine description ({type(e).__name__}: {what}); give a file "
            f"written by `axon4d calibrate` or a shipped machine: {', '.join(available())}"
        ) from e


def plan(
    model: ModelConfig | str,
    world: int,
    machine: Machine | str,
    batch: int,
    *,
    dtype: str = "bfloat16",
    overlap: OverlapPolicy | str | None = None,
    recompute: str = "none",
    memory_limit: float | None = None,
    workload: Workload | None = None,
    optimizer: str = "adam",
    context_parallel: bool | str = False,
) -> PlanResult:
    """Price every valid grid of ``world`` ranks for ``model`` on ``machine``; best first.

    ``batch`` is the global batch in sequences per step. ``memory_limit`` (bytes per device)
    defaults to the machine's device memory. A world below 1, a limit that is not a positive
    number, a bad machine file or model or batch is refused before anything is priced. ``optimizer``: "adam" or "sgd" (``Workload``).
    ``context_parallel``: False (sequences whole), True (each sequence's tokens split over z,
    docs/context.md) or "auto" (both priced for every grid; the table says which each row uses).
    ``overlap``: a policy (``OverlapPolicy.parse``), or "auto": every grid priced with all
    mechanisms on at the default knobs, then the knobs tuned (``tune_overlap``) for the
    ``TUNE_TOP`` fastest that fit; the result's ``overlap`` is the best candidate's policy.
    """
    if context_parallel not in (False, True, "auto"):
        raise ValueError(f"context_parallel = {context_parallel!r}: use False, True or 'auto'")
    rules.count(world, "world (ranks, --gpus)", example=8)
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and 0 < memory_limit < math.inf):
        raise ValueError(
            f"memory_limit = {memory_limit!r} bytes per device must be a finite number above 0 "
            "(--memory-gib 80 for 80 GiB), or None for the machine's own"
        )
    mach = load_machine(machine)
    if workload is None:
        cfg = get_config(model) if isinstance(model, str) else model
        workload = Workload(cfg, batch, dtype, optimizer=optimizer)
    if context_parallel is True and not workload.context_parallel:
        workload = dataclasses.replace(workload, context_parallel=True)
    auto = overlap == AUTO
    ov = OverlapPolicy() if auto else OverlapPolicy.parse(overlap)
    shapes = factorizations(world)
    arr = np.array([s.as_tuple() for s in shapes], dtype=np.int64)
    mask = valid_mask(workload, arr)
    cands = [evaluate(workload, s, mach, ov, recompute, memory_limit) for s, ok in zip(shapes, mask) if ok]
    if context_parallel == "auto" and workload.model.seq_len % 2 == 0:  # the split too, where z > 1
        split = dataclasses.replace(workload, context_parallel=True)
        split_mask = valid_mask(split, arr)
        cands += [
            evaluate(split, s, mach, ov, recompute, memory_limit) for s, ok in zip(shapes, split_mask) if ok and s.z > 1
        ]
        mask |= split_mask

    def rank(c: Candidate) -> tuple[Any, ...]:
        return not c.fits, c.time.step_s if c.fits else c.mem.peak, c.shape.as_tuple(), c.context_parallel

    cands.sort(key=rank)
    if auto:  # the knobs, for the fastest few grids (each variant is one more pricing)
        for i, c in enumerate(cands[:TUNE_TOP]):
            wl_c = dataclasses.replace(workload, context_parallel=c.context_parallel)
            cands[i] = tune_overlap(wl_c, c.shape, mach, ov, recompute, memory_limit)
        cands.sort(key=rank)
        ov = cands[0].overlap if cands else ov
    limit = mach.memory_per_device if memory_limit is None else memory_limit
    return PlanResult(
        workload,
        mach,
        world,
        ov,
        recompute,
        limit,
        cands,
        int((~mask).sum()),
        stepfit.caveat(mach, workload, world, ov, recompute),
    )
