"""The outcome of one search: every candidate priced, best first, as a table, as JSON, and — when
nothing fits — what would (docs/design.md §6)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from axon4d.grid.shape import ALL_AXES
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.candidate import Candidate, device_need
from axon4d.plan.cost import TimeEstimate
from axon4d.plan.machine import UNSCALED, Machine
from axon4d.plan.moe_placement import placement
from axon4d.plan.options import Choices
from axon4d.plan.workload import Workload

#: the table's "seq" column for a sequence split over z, by context parallelism's mode ("whole"
#: without); split over z × data (hierarchical) they end in "+d"
SPLITS = {"all-gather": "split", "ring": "ring"}
#: the axes the table gives communication time for: every axis but "world", over which no
#: collective of a step runs
TABLE_AXES = tuple(a for a in ALL_AXES if a != "world")


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
    choices: Choices | None = None  # the step options searched (None: only the given ones)
    searched: int = 0  # grids priced (the rest: bounded out, ``plan``)
    valid: int = 0  # valid (grid, sequence split) pairs

    @property
    def best(self) -> Candidate:
        """The fastest fitting candidate; ``ValueError`` saying what would make one fit when none does."""
        fitting = [c for c in self.candidates if c.fits]
        if not fitting:
            raise ValueError(f"no plan of {self.world} ranks fits: {self.no_fit_advice()}")
        return fitting[0]

    def no_fit_advice(self) -> str:
        """Why nothing fits and what would: the smallest plan found, where its memory goes, and the
        limit, rank count or options that would hold it."""
        model = self.workload.model.name or "the model"
        limit = self.memory_limit / 2**30
        if not self.candidates:
            return (
                f"no grid of {self.world} ranks can split {model}'s batch of {self.workload.batch} sequences and layers "
                "(every grid breaks a divisibility rule, or no micro-batch count divides the batch per rank); "
                "try another rank count or batch"
            )
        least = min(self.candidates, key=lambda c: (c.mem.pinned_node > self.machine.pinned_host_per_node, c.mem.peak))
        m, mach = least.mem, self.machine
        state = (m.params + m.grads + m.optimizer) / 2**30
        need = device_need(m, mach) / 2**30
        taken = ""
        if m.reserved or mach.fragmentation:
            taken = (
                f" ({m.peak / 2**30:.1f} GiB of tensors, {100 * mach.fragmentation:.0f}% for fragmentation and "
                f"{m.reserved / 2**30:.1f} GiB taken by the CUDA context, workspaces and NCCL buffers)"
            )
        host = ""
        if mach.accelerator and m.pinned_node > mach.pinned_host_per_node:
            host = (
                f"; its node's ranks pin {m.pinned_node / 2**30:.1f} GiB of host memory, more than the node's "
                f"{mach.pinned_host_per_node / 2**30:.1f} GiB less its reserve (host_memory_per_node − "
                "host_reserve_per_node)"
            )
        searched = "" if self.choices is None else " (every searched option at its most frugal)"
        return (
            f"{model} needs at least {need:.1f} GiB per device{taken}{searched}, on {least.shape.as_tuple()} with "
            f"{least.options_spec()} — {state:.1f} GiB of parameters, gradients and optimizer state, "
            f"{m.activations / 2**30:.1f} GiB of saved activations — against {limit:.1f} GiB{host}. It would fit with "
            f"--memory-gib {math.ceil(need)} (a device with that much memory), with more ranks (the state "
            f"shrinks with each), or with a pinned option left to the search"
        )

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        wl = self.workload
        return {
            "model": dataclasses.asdict(wl.model),
            "batch": wl.batch,
            "dtype": wl.dtype,
            "precision": wl.preset,
            "world": self.world,
            "machine": self.machine.name,
            "overlap": self.overlap.spec(),
            "recompute": self.recompute,
            "memory_limit": self.memory_limit,
            "valid": self.valid or len(self.candidates),
            "searched": self.searched,
            "options_searched": self.choices.spec() if self.choices is not None else None,
            "invalid": self.invalid,
            "step_scale_caveat": self.caveat,
            "candidates": [{**c.to_json(), **self._placement(c)} for c in self.candidates[:top]],
        }

    def _placement(self, c: Candidate) -> dict[str, Any]:
        """An MoE model's expert placement on ``c``'s grid and the routing assumed (none for a dense model)."""
        wl = self.workload
        if not wl.model.moe:
            return {}
        layout = c.expert_layout or wl.expert_layout
        return {"expert_placement": placement(wl.model, c.shape, layout).to_json(), "imbalance": wl.imbalance}

    def table(self, top: int = 10) -> str:
        """The top-k candidates as a text table, with the step options each was priced with (``seq``:
        whole sequences per rank, or split over z with keys and values all-gathered, "split", or
        passed around a ring, "ring": ``SPLITS``; "+d" when split over z × data); for an
        MoE model also each one's expert layout and the seconds on products of axes an expert
        layout adds (``t_prod``: its all-to-alls, counts and replicas' reductions over y·z, world, …)."""
        moe = self.workload.model.moe
        shown = self.candidates[:top]
        wide = max([20, *(len(c.expert_layout) for c in shown)]) if moe else 0  # the experts column
        head = (
            f"{'grid (x,y,z,d)':<18} {'seq':>7} {'recompute':>9} {'mb':>3} {'zero':>4} {'offl':>4} {'fp8':>3} "
            + (f"{'experts':<{wide}} " if moe else "")
            + f"{'step s':>9} {'MFU':>6} {'mem GiB':>8} {'pin GiB':>7} {'fits':>4} "
            + " ".join(f"{'t_' + a:>8}" for a in TABLE_AXES + (("prod",) if moe else ()))
            + f" {'hidden':>7} {'×bound':>7}"
        )
        lines = [head, "-" * len(head)]
        for c in shown:
            t, o = c.time, c.options
            seconds = [t.comm_by_axis.get(a, 0.0) for a in TABLE_AXES]
            if moe:
                seconds.append(sum(v for a, v in t.comm_by_axis.items() if a not in TABLE_AXES))
            axes = " ".join(f"{v:>8.3g}" for v in seconds)
            lines.append(
                f"{str(c.shape.as_tuple()):<18} {_seq(c):>7} "
                f"{o.get('recompute', 'none'):>9} {o.get('micro_batches', 1):>3} {o.get('zero', 0):>4} "
                f"{o.get('offload', 0):>4} {'yes' if o.get('fp8_gather') else 'no':>3} "
                + (f"{c.expert_layout:<{wide}} " if moe else "")
                + f"{t.step_s:>9.4g} {100 * c.mfu:>5.1f}% "
                f"{c.mem.peak / 2**30:>8.2f} {c.mem.pinned_node / 2**30:>7.1f} {'yes' if c.fits else 'NO':>4} {axes} "
                f"{t.hidden_pct:>6.0f}% {c.bound_ratio:>7.2f}"
            )
        return "\n".join(lines)


def step_breakdown(t: TimeEstimate) -> str:
    """Where one step's predicted seconds go (``TimeEstimate.parts``): compute (its GEMMs outside
    recomputation, the offload copies left exposed, the optimizer), the collectives overlap leaves
    exposed of those issued, and the compute lost to their traffic — which add up to the step
    unless the machine's in-step scale (``axon4d.plan.stepfit``) weights them, as the line then says."""
    _, activation, weight = t.parts
    within = [f"GEMMs {t.matmul_s:.3g} s outside recomputation"]
    if t.offload_s:
        within.append(f"offload copies left exposed {t.offload_s:.3g} s")
    within.append(f"optimizer {t.optimizer_s:.3g} s")
    # without a step calibration the parts add up to the step; with one, its scale weights them
    joined = " = " if t.scale == UNSCALED else ", weighted by the machine's in-step scale, from "
    return (
        f"step {t.step_s:.4g} s (predicted, one rank){joined}compute {t.compute_s:.4g} s ({', '.join(within)}) + "
        f"collectives left exposed {activation + weight:.3g} s (of {t.comm_s:.3g} s issued; overlap hides "
        f"{t.hidden_s:.3g} s) + compute lost to their traffic {t.interference_s:.3g} s"
    )


def _seq(c: Candidate) -> str:
    """The table's "seq" column of ``c``: whole, or its split's mode (``SPLITS``), "+d" over z × data."""
    if not c.context_parallel:
        return "whole"
    return SPLITS[c.context_mode] + ("+d" if c.context_axes == "z,data" else "")
