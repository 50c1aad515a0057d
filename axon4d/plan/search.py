"""Choosing the grid: enumerate every (G_x, G_y, G_z, G_data) of P ranks, keep the valid ones that
fit in memory, rank them by predicted step time (docs/design.md §6).

The divisibility rules (§1) — the workload's ``axon4d.grid.rules`` objects, the ones the layers check —
are evaluated on all factorisations at once with numpy (``valid_mask``, ``valid_grids``); only valid
grids are priced (``search_grids``), each as one ``Scenario`` (``cost.step_estimate``,
``memory.memory``), in well under a millisecond.
The step options of each grid are ``axon4d.plan.options``'s; one priced plan is
``axon4d.plan.candidate``'s; the result ``axon4d.plan.result``'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from axon4d.config import ModelConfig, get_config
from axon4d.grid import rules
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import AXES, GridShape, factorizations
from axon4d.options.context_mode import MODES, context_axis
from axon4d.options.overlap_policy import AUTO, OverlapPolicy
from axon4d.plan import stepfit
from axon4d.plan.candidate import Candidate, tune_overlap
from axon4d.plan.expert_layouts import undominated, with_layouts
from axon4d.plan.machine import Machine, available, load
from axon4d.plan.options import AUTO_OPTION, Choices, best_options, lower_bound, offload_levels
from axon4d.plan.result import PlanResult
from axon4d.plan.workload import Workload

#: with ``overlap="auto"``, the knobs are tuned for this many of the fastest fitting grids
TUNE_TOP = 4


def valid_mask(wl: Workload, shapes: np.ndarray) -> np.ndarray:
    """Boolean per row of ``shapes`` (n, 4) = (x, y, z, data): does the grid satisfy every rule of
    ``wl.rules()`` (§1)? Each ``Rule.holds`` is evaluated on the columns of axis sizes at once."""
    sizes = dict(zip(AXES, shapes.T))
    ok = np.ones(len(shapes), dtype=bool)
    for rule in wl.rules():
        ok &= rule.holds(sizes)
    return ok


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
    dtype: str = "",
    precision: str = "",
    overlap: OverlapPolicy | str | None = None,
    recompute: str = AUTO_OPTION,
    memory_limit: float | None = None,
    workload: Workload | None = None,
    optimizer: str = "adam",
    context_parallel: bool | str = AUTO_OPTION,
    micro_batches: int | str = AUTO_OPTION,
    zero: int | str = AUTO_OPTION,
    offload: int | str = AUTO_OPTION,
    fp8_gather: bool | str = AUTO_OPTION,
    async_save: bool = False,
    top: int | None = 10,
    expert_layout: ExpertLayout | str = AUTO_OPTION,
    context_axes: str = AUTO_OPTION,
    fp8_dispatch: bool | str = AUTO_OPTION,
) -> PlanResult:
    """Search every valid grid of ``world`` ranks for ``model`` on ``machine`` with every step
    option — recomputation, micro-batches, ZeRO stage, activation offload, FP8 weight gathers,
    context parallelism — and return the best ``top`` (at least) candidates, fastest fitting first.

    ``batch`` is the global batch in sequences per step (the micro-batches split it). ``dtype`` and
    ``precision`` are the workload's (``Workload``: the compute dtype and the precision preset, which
    sets what each collective moves; neither given: bfloat16 with "bf16-fp32-reduce").
    ``memory_limit`` (bytes per device) defaults to the machine's device memory. Each option is
    ``AUTO_OPTION`` (searched; the default) or pinned: ``recompute`` a mode, ``micro_batches`` a
    count, ``zero`` 0/1/2, ``offload`` a number of blocks, ``fp8_gather`` True/False,
    ``context_parallel`` True/False or a mode ("all-gather", "ring"), ``context_axes`` "z" or "z,data"
    (hierarchical: each sequence over z × data; ``AUTO_OPTION``: both searched), ``expert_layout`` an MoE model's expert layout
    (``axon4d.grid.expert_layout``: e.g. "ep=world,tp=1"; searched: every layout each grid admits),
    ``fp8_dispatch`` True/False: the searched layouts send their rows to the experts in FP8 or not
    (``AUTO_OPTION``: each layout both ways where the model computes in 16 bits; a pinned layout
    says it itself, ``dispatch=fp8``).
    ``optimizer``: "adam" or "sgd" (``Workload``). ``async_save``: the
    job checkpoints asynchronously, and its host snapshot counts against the node's host memory. ``overlap``: a
    policy (``OverlapPolicy.parse``), or "auto": the knobs tuned (``tune_overlap``) for the
    ``TUNE_TOP`` fastest; the result's ``overlap`` is the best candidate's policy.

    Each grid gets its fastest fitting options (``best_options``); grids are searched in the
    order of a time no option beats on them (``lower_bound``), and the search stops once that bound
    is above the ``top``-th fastest fitting step found: ``PlanResult.searched`` says how many grids
    it priced (``top=None``: every grid). A world below 1, a limit that is not a positive number, a bad machine file, model,
    batch or option is refused before anything is priced.
    """
    cp = _checked_inputs(context_parallel, world, top, memory_limit)
    choices = Choices.parse(recompute, micro_batches, zero, offload, fp8_gather)
    mach = load_machine(machine)
    workload = _workload(
        workload, model, batch, dtype, optimizer, precision, cp not in (False, AUTO_OPTION), async_save
    )
    if fp8_dispatch not in (AUTO_OPTION, True, False):
        raise ValueError(f"fp8_dispatch = {fp8_dispatch!r}: use auto, True or False (--fp8-dispatch auto|on|off)")
    if expert_layout != AUTO_OPTION:  # pinned: refused here when it is not a layout
        workload = dataclasses.replace(workload, expert_layout=ExpertLayout.parse(expert_layout))
        if fp8_dispatch not in (AUTO_OPTION, workload.expert_layout.fp8_dispatch):
            raise ValueError(
                f"fp8_dispatch = {fp8_dispatch} with the pinned expert layout {workload.expert_layout}: a pinned "
                "layout says how its rows travel; write dispatch=fp8 in it (or leave it out), or leave fp8_dispatch auto"
            )
    if choices.offload is not None:
        offload_levels(workload, mach, choices.offload)  # refused here when above n_layers
    auto = overlap == AUTO
    ov = OverlapPolicy() if auto else OverlapPolicy.parse(overlap)
    if context_axes != AUTO_OPTION:
        context_axis(context_axes)  # refused here when it names no axes context parallelism splits over
    layouts = AUTO_OPTION if expert_layout == AUTO_OPTION else ""
    grids, invalid = valid_grids(workload, world, cp, layouts, context_axes, fp8_dispatch)
    grids = undominated(grids, mach, ov)  # an MoE model's layouts no option could make the fastest: dropped
    cands, searched = search_grids(grids, mach, ov, choices, memory_limit, top)
    if auto:  # the knobs, for the fastest few grids (each variant is one more pricing)
        cands, ov = _tune_fastest(cands, workload, mach, ov, memory_limit)
    limit = mach.memory_per_device if memory_limit is None else memory_limit
    chosen = cands[0].recompute if cands else (choices.recompute[0] if len(choices.recompute) == 1 else "none")
    return PlanResult(
        workload,
        mach,
        world,
        ov,
        recompute if recompute != AUTO_OPTION else AUTO_OPTION,
        limit,
        cands,
        invalid,
        stepfit.caveat(mach, workload, world, ov, chosen),
        choices=choices,
        searched=searched,
        valid=len(grids),
    )


def _checked_inputs(
    context_parallel: bool | str, world: int, top: int | None, memory_limit: float | None
) -> bool | str:
    """``plan``'s ``context_parallel`` as True, False, a mode (``axon4d.options.context_mode.MODES``)
    or ``AUTO_OPTION``, after refusing (``ValueError``)
    any other value, a world or ``top`` that is not a whole number ≥ 1 and a memory limit that is
    not a finite number of bytes above 0."""
    cp = AUTO_OPTION if context_parallel == "auto" else context_parallel
    if cp not in (False, True, AUTO_OPTION, *MODES):
        raise ValueError(
            f"context_parallel = {context_parallel!r}: use False, True (either mode), "
            f"{', '.join(repr(m) for m in MODES)} or 'auto' (docs/context.md)"
        )
    rules.count(world, "world (ranks, --gpus)", example=8)
    if top is not None:
        rules.count(top, "top (candidates kept)", example=10)
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and 0 < memory_limit < math.inf):
        raise ValueError(
            f"memory_limit = {memory_limit!r} bytes per device must be a finite number above 0 "
            "(--memory-gib 80 for 80 GiB), or None for the machine's own"
        )
    return cp


def _workload(
    workload: Workload | None,
    model: ModelConfig | str,
    batch: int,
    dtype: str,
    optimizer: str,
    precision: str,
    split: bool,
    async_save: bool,
) -> Workload:
    """The workload ``plan`` prices: ``workload``, else ``model``'s (a ``ModelConfig`` or a size
    name) step of ``batch`` sequences in ``dtype`` and ``precision`` with ``optimizer``; its
    sequences split over z where ``split`` (context parallelism pinned on) and a host snapshot
    kept where ``async_save``."""
    if workload is None:
        cfg = get_config(model) if isinstance(model, str) else model
        workload = Workload(cfg, batch, dtype, optimizer=optimizer, precision=precision)
    if split and not workload.context_parallel:
        workload = dataclasses.replace(workload, context_parallel=True)  # its mode: ``valid_grids``'s
    if async_save and not workload.async_save:
        workload = dataclasses.replace(workload, async_save=True)
    return workload


def valid_grids(
    workload: Workload,
    world: int,
    cp: bool | str,
    expert_layouts: str = "",
    context_axes: str = AUTO_OPTION,
    fp8_dispatch: bool | str = AUTO_OPTION,
) -> tuple[list[tuple[Workload, GridShape]], int]:
    """The (workload, grid) pairs ``plan`` prices, and how many factorisations of ``world`` break a
    divisibility rule (§1) under every sequence split priced: each valid grid with ``workload`` as
    it is — with context parallelism pinned, in each mode ``cp`` names (True: both) — and with ``cp``
    ``AUTO_OPTION`` each valid grid of G_z > 1 with the sequences split over z too, in each mode (and
    each grid with G_data > 1 split over z × data, hierarchical),
    where the sequence length is even and the model has no MoE layers (context parallelism with MoE
    layers is not priced: ``Workload``). An MoE model with ``expert_layouts`` ``AUTO_OPTION``: each
    grid with each expert layout it admits (``expert_layouts.with_layouts``; ``fp8_dispatch``: with
    FP8 dispatch, without, or each both ways)."""
    shapes = factorizations(world)
    arr = np.array([s.as_tuple() for s in shapes], dtype=np.int64)
    if workload.model.moe and expert_layouts == AUTO_OPTION:  # every layout each grid admits
        return with_layouts(workload, shapes, fp8_dispatch)
    modes = [cp] if cp in MODES else list(MODES)
    if workload.context_parallel:  # pinned on: the modes asked for (the workload's own unless named)
        modes = modes if cp is True or cp in MODES else [workload.context_mode]
        splits, whole = [dataclasses.replace(workload, context_mode=m) for m in modes], []
    else:
        whole = [workload]
        moe = workload.model.moe  # context parallelism with MoE layers is not priced (``Workload``)
        searched = cp == AUTO_OPTION and workload.model.seq_len % 2 == 0 and not moe
        splits = (
            [dataclasses.replace(workload, context_parallel=True, context_mode=m) for m in modes] if searched else []
        )
    # each split over z, and over z × data together (hierarchical) where the grid has data ranks
    # (``context_axes``: both, or the one pinned)
    if context_axes != AUTO_OPTION:
        splits = [dataclasses.replace(wl, context_axes=context_axes) for wl in splits]
    else:
        splits += [dataclasses.replace(wl, context_axes="z,data") for wl in splits if wl.context_axes == "z"]
    grids: list[tuple[Workload, GridShape]] = []
    mask = np.zeros(len(shapes), dtype=bool)
    for wl in whole:
        ok = valid_mask(wl, arr)
        grids += [(wl, s) for s, good in zip(shapes, ok) if good]
        mask |= ok
    for wl in splits:  # the rules do not depend on the mode
        ok = valid_mask(wl, arr)
        # a split over one rank splits nothing: priced once, as the whole sequences or in the first mode;
        # z × data with G_data = 1 is the split over z
        for s, good in zip(shapes, ok):
            if not good or (wl.context_axis == "batch" and s.data == 1):
                continue
            if wl.context_group(s) > 1 or (not whole and wl is splits[0]):
                grids.append((wl, s))
        mask |= ok
    return grids, int((~mask).sum())


def search_grids(
    grids: list[tuple[Workload, GridShape]],
    mach: Machine,
    ov: OverlapPolicy,
    choices: Choices,
    memory_limit: float | None,
    top: int | None,
) -> tuple[list[Candidate], int]:
    """Each of ``grids`` with its fastest fitting options (``best_options``), priced in the order of
    a time no option beats on it (``lower_bound``) until that bound is above the ``top``-th fastest
    fitting step found (``top=None``: every grid): the candidates in ``candidate_order``, and how many
    grids were priced."""
    bounds = sorted(((lower_bound(wl, s, mach, ov, choices), i) for i, (wl, s) in enumerate(grids)), key=lambda b: b[0])
    cands: list[Candidate] = []
    fastest: list[float] = []  # fitting step times found, ascending
    searched = 0
    for bound, i in bounds:
        if bound == math.inf or (top is not None and len(fastest) >= top and bound >= fastest[top - 1]):
            break
        searched += 1
        c = best_options(*grids[i], mach, ov, choices, memory_limit)
        if c is None:
            continue
        cands.append(c)
        if c.fits:
            fastest = sorted([*fastest, c.time.step_s])
    return sorted(cands, key=candidate_order), searched


def candidate_order(c: Candidate) -> tuple[Any, ...]:
    """The candidates' order: fitting ones first by step time, then the others by peak memory;
    ties by grid and sequence split."""
    split = (c.context_parallel, c.context_mode, c.context_axes)
    return not c.fits, c.time.step_s if c.fits else c.mem.peak, c.shape.as_tuple(), split


def _tune_fastest(
    cands: list[Candidate], workload: Workload, mach: Machine, ov: OverlapPolicy, memory_limit: float | None
) -> tuple[list[Candidate], OverlapPolicy]:
    """``overlap="auto"``: the ranked ``cands`` with the knobs tuned (``tune_overlap``) for the
    ``TUNE_TOP`` fastest, in ``candidate_order`` again; and the best one's
    policy (``ov`` when there is none)."""
    cands = list(cands)
    for i, c in enumerate(cands[:TUNE_TOP]):
        mode, axes = c.context_mode or workload.context_mode, c.context_axes or workload.context_axes
        wl_c = dataclasses.replace(workload, context_parallel=c.context_parallel, context_mode=mode, context_axes=axes)
        if c.expert_layout:
            wl_c = dataclasses.replace(wl_c, expert_layout=ExpertLayout.parse(c.expert_layout))
        opts = {k: v for k, v in c.options.items() if k != "recompute"}
        cands[i] = tune_overlap(wl_c, c.shape, mach, ov, c.recompute, memory_limit, **opts)
    cands.sort(key=candidate_order)
    return cands, cands[0].overlap if cands else ov
