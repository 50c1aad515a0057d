"""The expert layouts the search prices for an MoE model (docs/planner.md "Mixture of Experts";
``axon4d.grid.expert_layout``).

Every grid admits several layouts — up to 36 for four live axes — and pricing each with every step
option would multiply the search by as many. Most cannot win: a layout whose MoE layer is slower
*and* holds at least as much on the rank as another layout's of the same grid loses to it under
every step option, since the rest of the step (attention, the dense layers, the embedding) is the
same under both. ``undominated`` keeps, per grid, the layouts on the Pareto front of

- the MoE layers' compute seconds (``moe_cost``) and, apart, their collectives' seconds (with the
  expert replicas' gradient reductions) — overlap can hide the one behind the other, so neither
  alone orders the steps; a layout's ``dispatch=fp8`` variant is a layout of its own — and
- their bytes on the rank: the experts' weights with and without ZeRO (replicas over data are
  sharded by it, experts held by one data rank are not) and what the layers keep for backward
  (``moe_memory``).
"""

from __future__ import annotations

import dataclasses

from axon4d.grid.expert_layout import ExpertLayout, candidates
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Term
from axon4d.options.fp8_rows import BLOCK
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan import moe_memory
from axon4d.plan.cost import moe_seconds
from axon4d.plan.layers import priced
from axon4d.plan.machine import Machine
from axon4d.plan.options import AUTO_OPTION
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload


def with_layouts(
    workload: Workload, shapes: list[GridShape], fp8_dispatch: bool | str = AUTO_OPTION
) -> tuple[list[tuple[Workload, GridShape]], int]:
    """Each of ``shapes`` with ``workload`` under each expert layout it admits
    (``axon4d.grid.expert_layout.candidates``: one per distinct placement; ``with_fp8_dispatch``)
    where every other rule holds too, and how many shapes admit none."""
    out: list[tuple[Workload, GridShape]] = []
    invalid = 0
    variants: dict[str, Workload] = {}
    for s in shapes:
        pairs = []
        for layout in with_fp8_dispatch(workload, s, fp8_dispatch):
            wl = variants.setdefault(str(layout), dataclasses.replace(workload, expert_layout=layout))
            if all(rule.holds(s) for rule in wl.rules()):
                pairs.append((wl, s))
        out += pairs
        invalid += not pairs
    return out, invalid


def with_fp8_dispatch(
    workload: Workload, shape: GridShape, fp8_dispatch: bool | str = AUTO_OPTION
) -> list[ExpertLayout]:
    """The layouts ``shape`` admits for ``workload``'s model (``candidates``), each with its
    ``dispatch=fp8`` variant where that is a different step: rows cross an expert-parallel axis,
    the model computes in 16 bits (as FP8 weight gathers, a numerics choice the search makes under
    bf16; an fp32 run stays exact) and every rank's features are whole blocks of 128.
    ``fp8_dispatch``: ``AUTO_OPTION`` both (the plain one first), True the variant in place of the
    plain one where there is one, False the plain ones only."""
    m = workload.model
    out = []
    for layout in candidates(shape, m.n_experts, m.expert_width, m.shared_experts * m.expert_width, m.hidden):
        fp8 = dataclasses.replace(layout, fp8_dispatch=True)
        offered = (
            fp8_dispatch is not False
            and workload.element_size == 2
            and m.hidden % BLOCK == 0
            and fp8.fp8_dispatches(shape)
            and layout.dispatched_features(shape, m.hidden) % BLOCK == 0
        )
        if not offered or fp8_dispatch == AUTO_OPTION:
            out.append(layout)
        if offered:
            out.append(fp8)
    return out


def moe_costs(wl: Workload, shape: GridShape, machine: Machine, overlap: OverlapPolicy) -> tuple[float, ...]:
    """(compute seconds, communication seconds, expert bytes unsharded, expert bytes under ZeRO,
    saved bytes) of the MoE layers of one step of ``wl`` on ``shape``: what the layouts of one grid
    differ in. Compute and communication apart: overlap may hide the one behind the other, so a
    layout that moves fewer bytes for more compute (FP8 dispatch) beats another on neither alone."""
    sc = Scenario(wl, shape, machine, overlap)
    m, layout = wl.model, wl.expert_layout
    moe = moe_seconds(sc)
    compute = m.moe_layers * (moe.fwd + moe.bwd)
    seconds = m.moe_layers * sum(priced(c, sc)[0] for c in sc.moe_collectives)
    seconds += sum(priced(c, sc)[0] for c in sc.edge_collectives if c.term == Term.MOE_EXPERT_WEIGHT_GRAD)
    experts = moe_memory.expert_elements(m, shape, layout)
    sharded = experts if moe_memory.experts_whole_under_zero(layout) else experts / shape.data
    elem = sc.element_size
    saved = moe_memory.saved_bytes(m, wl.local_tokens(shape), shape, elem, wl.dtype != "float32", wl.imbalance, layout)
    return compute, seconds, float(experts), float(sharded), m.moe_layers * saved


def undominated(
    grids: list[tuple[Workload, GridShape]], machine: Machine, overlap: OverlapPolicy
) -> list[tuple[Workload, GridShape]]:
    """``grids`` without the (workload, grid) pairs of an MoE model whose layout another layout of the
    same grid beats or equals on every one of ``moe_costs`` (and beats on one); the first of equal
    ones is kept. Pairs of a dense model, and a grid's only layout, are kept as they are."""
    by_grid: dict[tuple[GridShape, bool], list[tuple[int, tuple[float, ...]]]] = {}
    for i, (wl, s) in enumerate(grids):
        if wl.model.moe:
            by_grid.setdefault((s, wl.context_parallel), []).append((i, moe_costs(wl, s, machine, overlap)))
    dropped: set[int] = set()
    for members in by_grid.values():
        for i, a in members:
            for j, b in members:
                if j != i and j not in dropped and all(y <= x for x, y in zip(a, b)) and (b != a or j < i):
                    dropped.add(i)
                    break
    return [pair for i, pair in enumerate(grids) if i not in dropped]
