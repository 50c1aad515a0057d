"""``axon4d.init(grid="auto", plan={...})``: the planner chooses the grid and says why (docs/design.md §6);
``overlap="auto"`` (``init``'s default): it chooses the overlap knobs too (``choose_overlap``).

Every rank runs the same deterministic search on the same inputs, so all ranks pick the same grid
and policy without communicating. Rank 0 prints the choice, its predicted time, MFU and memory,
and the runners-up.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from axon4d.config import ModelConfig, get_config
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan import correction as corrections
from axon4d.plan.candidate import Candidate, tune_overlap
from axon4d.plan.machine import Machine, available
from axon4d.plan.options import AUTO_OPTION
from axon4d.plan.result import PlanResult, step_breakdown
from axon4d.plan.search import load_machine, plan
from axon4d.plan.workload import Workload

#: the environment variable naming the planner's machine when ``plan`` gives none
MACHINE_ENV = "AXON4D_MACHINE"


def default_machine() -> str:
    """The machine named by ``$AXON4D_MACHINE`` (a shipped name or a file's path); ValueError when it
    is unset. No file is looked for implicitly: a machine file reaches the planner only by name."""
    env = os.environ.get(MACHINE_ENV)
    if env:
        return env
    raise ValueError(
        f"grid='auto' needs a machine description: pass plan={{'machine': NAME or PATH}} (--machine), or set "
        f"{MACHINE_ENV}=NAME or PATH (a file from `axon4d calibrate --out FILE`); shipped machines: "
        f"{', '.join(available())}"
    )


def _workload(
    world: int,
    model: ModelConfig | str | None,
    batch: int | None,
    dtype: str,
    optimizer: str,
    what: str,
    precision: str = "",
) -> Workload:
    """The workload of ``model`` (a batch of one sequence per rank by default) in ``precision`` (a
    preset name; "": by ``dtype``, ``Workload``)."""
    if model is None:
        raise ValueError(f"{what} needs the model: axon4d.init({what}, plan={{'model': cfg_or_name, 'batch': B}})")
    cfg = get_config(model) if isinstance(model, str) else model
    return Workload(cfg, batch if batch is not None else world, dtype, optimizer=optimizer, precision=precision)


def choose_overlap(
    shape: GridShape,
    *,
    model: ModelConfig | str | None = None,
    batch: int | None = None,
    machine: str | None = None,
    dtype: str = "",
    precision: str = "",
    recompute: str = "none",
    optimizer: str = "adam",
    memory_gib: float | None = None,
    workload: Workload | None = None,
    rank: int = 0,
    micro_batches: int | str = 1,
    zero: int | str = 0,
    offload: int | str = 0,
    fp8_gather: bool | str = False,
    context_parallel: bool | str = False,
    expert_layout: ExpertLayout | str | None = None,
) -> OverlapPolicy:
    """The overlap policy ``overlap="auto"`` gives a job on the given grid: all mechanisms on, with
    the knobs the planner predicts fastest among those that fit (``candidate.tune_overlap``), where the
    model and a machine description are known; else all mechanisms at the default knobs. Rank 0
    prints the choice. The step options (``choose``'s) are priced as given; one left "auto" is
    priced at its default (1 micro-batch, no ZeRO, no offload, bf16 gathers, whole sequences): on a
    named grid nothing chooses them. An MoE model's experts are priced in ``expert_layout`` (None:
    the default layout, as ``axon4d.init`` builds it)."""
    if workload is None and model is None:
        return OverlapPolicy()
    try:
        name = machine or default_machine()
    except ValueError:
        return OverlapPolicy()
    wl = workload or _workload(shape.world_size, model, batch, dtype, optimizer, "overlap='auto'", precision)
    limit = memory_gib * 2**30 if memory_gib is not None else None
    if context_parallel is True and not wl.context_parallel:
        wl = dataclasses.replace(wl, context_parallel=True)
    if expert_layout is not None and wl.model.moe:
        wl = dataclasses.replace(wl, expert_layout=ExpertLayout.parse(expert_layout))
    given = {"micro_batches": micro_batches, "zero": zero, "offload": offload, "fp8_gather": fp8_gather}
    defaults = {"micro_batches": 1, "zero": 0, "offload": 0, "fp8_gather": False}
    options = {k: defaults[k] if v == "auto" else v for k, v in given.items()}
    rc = "none" if recompute == "auto" else recompute
    best = tune_overlap(wl, shape, load_machine(name), OverlapPolicy(), rc, limit, **options)
    if rank == 0:
        print(
            f"axon4d: overlap='auto' chose {best.overlap.spec()} on {shape.as_tuple()} (predicted "
            f"{best.time.step_s * 1e3:.1f} ms/step, {best.time.hidden_pct:.0f}% of communication hidden)",
            file=sys.stderr,
            flush=True,
        )
    return best.overlap


def choose_grid(world: int, **options: Any) -> GridShape:
    """The fastest grid of ``world`` ranks that fits, by the planner; rank 0 prints why.

    ``options`` are ``choose``'s: ``model`` (a ModelConfig or a size name), ``batch`` (the global
    batch in sequences per step; default one per rank), ``machine``, ``dtype`` and ``precision``
    (the compute dtype and the precision preset, ``Workload``: by default bfloat16 and
    "bf16-fp32-reduce"; either alone sets the other), ``overlap`` (a
    policy, or "auto": the knobs tuned too, ``search.plan``), ``recompute``, ``optimizer`` ("adam"
    or "sgd"), ``memory_gib``, ``workload``, ``rank``, ``top``, and the step options
    ``micro_batches``, ``zero``, ``offload``, ``fp8_gather``, ``context_parallel``, ``fp8_dispatch``
    (each pinned by default to what a model built without them runs; "auto" lets the search choose,
    and the choice is the returned candidate's ``options``, or for FP8 dispatch its ``expert_layout``), and ``async_save`` (the job keeps a pinned host snapshot
    for asynchronous checkpoints: it counts against the node's host memory). Raises ``ValueError`` (on every rank alike) when no
    grid fits."""
    return choose(world, **options).shape


def choose(world: int, **options: Any) -> Candidate:
    """``choose_grid``'s whole choice: the best candidate of ``ranked(world, **options)`` (the same
    keywords), with the overlap policy and the step options (``Candidate.options``; "auto" ones
    chosen by the search) it was priced with. Raises ``ValueError`` (on every rank alike) when no
    grid fits."""
    return ranked(world, **options).best


def corrected(machine: Machine | str, correction: corrections.Correction | str | None, world: int) -> Machine | str:
    """``machine`` (a name, a file's path or a loaded one), its in-step scale multiplied by
    ``correction``'s factors where one is given (``axon4d.plan.correction.apply``; a path is
    loaded). ``ValueError`` when the correction was measured on another number of ranks than
    ``world``: its factors scale that world's prices only."""
    if correction is None:
        return machine
    corr = corrections.load(correction) if isinstance(correction, str) else correction
    if corr.world != world:
        raise ValueError(
            f"correction {correction if isinstance(correction, str) else corr.machine!r} was measured on "
            f"{corr.world} ranks, this job has {world}: its factors scale the prices of {corr.world}-rank steps "
            "only; measure one on this job (axon4d.try_plans, or axon4d train --try N)"
        )
    return corrections.apply(load_machine(machine) if isinstance(machine, str) else machine, corr)


def ranked(
    world: int,
    *,
    model: ModelConfig | str | None = None,
    batch: int | None = None,
    machine: Machine | str | None = None,
    dtype: str = "",
    precision: str = "",
    overlap: Any = None,
    recompute: str = "none",
    optimizer: str = "adam",
    memory_gib: float | None = None,
    workload: Workload | None = None,
    rank: int = 0,
    top: int = 3,
    micro_batches: int | str = 1,
    zero: int | str = 0,
    offload: int | str = 0,
    fp8_gather: bool | str = False,
    context_parallel: bool | str = False,
    async_save: bool = False,
    expert_layout: ExpertLayout | str = AUTO_OPTION,
    correction: corrections.Correction | str | None = None,
    context_axes: str = AUTO_OPTION,
    fp8_dispatch: bool | str = False,
) -> PlanResult:
    """``choose``'s search (its arguments), every priced candidate ranked (``PlanResult``: at least
    the ``top`` fastest fitting ones, where so many fit); rank 0 prints the best, its step in parts
    (``result.step_breakdown``) and the top ``top``.
    ``expert_layout``: an MoE model's expert layout, pinned, or ``AUTO_OPTION`` (searched with each
    grid; the chosen one is the candidate's ``expert_layout``); ``fp8_dispatch``: the searched layouts'
    rows travel to the experts in FP8 (True), not (False, the default: as a layout built without it), or
    either (``AUTO_OPTION``). ``context_axes``: the axes a split
    sequence may span, "z", "z,data" or ``AUTO_OPTION`` (both; ``search.plan``). ``correction``: a correction
    (``axon4d.plan.correction``; a loaded one or its file's path, as ``axon4d plan --correction``)
    whose factors scale the machine's prices first (``corrected``).
    Raises ``ValueError`` (on every rank alike) when no grid fits, or when the correction is not
    one or was measured on another number of ranks."""
    if workload is None:
        workload = _workload(world, model, batch, dtype, optimizer, "grid='auto'", precision)
    result = plan(
        workload.model,
        world,
        corrected(machine or default_machine(), correction, world),
        workload.batch,
        overlap=overlap,
        recompute=recompute,
        memory_limit=memory_gib * 2**30 if memory_gib is not None else None,
        workload=workload,
        micro_batches=micro_batches,
        zero=zero,
        offload=offload,
        fp8_gather=fp8_gather,
        context_parallel=context_parallel,
        async_save=async_save,
        expert_layout=expert_layout,
        context_axes=context_axes,
        fp8_dispatch=fp8_dispatch if expert_layout == AUTO_OPTION else AUTO_OPTION,
        top=max(top, 1),
    )
    best = result.best
    if rank == 0:
        t = best.time
        m = workload.model
        print(
            f"axon4d: grid='auto' chose {best.shape.as_tuple()} (x, y, z, data) for {m.name or 'the model'} "
            f"(batch {workload.batch} × {m.seq_len}, {workload.preset}) on {world} × {result.machine.name}: predicted "
            f"{t.step_s * 1e3:.1f} ms/step with {best.options_spec()}, MFU {100 * best.mfu:.1f}%, "
            f"{best.mem.peak / 2**30:.2f} GiB per rank "
            f"(limit {result.memory_limit / 2**30:.1f}), communication {t.comm_s * 1e3:.1f} ms of which "
            f"{t.hidden_pct:.0f}% hidden (overlap {result.overlap.spec()}); "
            f"{sum(c.fits for c in result.candidates)} of the {result.searched} searched grids fit. Top {top}:",
            file=sys.stderr,
            flush=True,
        )
        print(f"axon4d: {step_breakdown(t)}", file=sys.stderr, flush=True)
        print(result.table(top), file=sys.stderr, flush=True)
        if result.caveat:
            print(f"axon4d: warning: {result.caveat}", file=sys.stderr, flush=True)
    return result
