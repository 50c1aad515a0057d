"""The step options the search varies on one grid — recomputation, micro-batches, ZeRO, offload,
FP8 gathers — and the fastest fitting combination of them (docs/design.md §6)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from axon4d.grid import rules
from axon4d.grid.shape import GridShape
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.recompute_mode import check_recompute
from axon4d.plan.candidate import Candidate, candidate, fits, scenario_memory
from axon4d.plan.cost import step_estimate
from axon4d.plan.machine import Machine
from axon4d.plan.memory import MemoryEstimate
from axon4d.plan.scenario import ZERO_STAGES, Scenario, fp8_gathers_allowed
from axon4d.plan.workload import Workload

#: the value of a step option that lets the search choose it
AUTO_OPTION = "auto"
#: recomputation modes from the least compute to the most (the search's order)
RECOMPUTE_ORDER = ("none", "selective", "balanced", "full")
#: the offload levels the search tries, as shares of the blocks
OFFLOAD_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the most micro-batch counts the search tries per grid (the divisors of a rank's sequences: all
#: of them up to this many, else the powers of two among them and the largest)
MAX_MICRO_COUNTS = 8


@dataclasses.dataclass(frozen=True)
class Choices:
    """The values of each step option the search tries: a pinned option has one; ``micro_batches``
    and ``offload`` None for every valid count and the ``OFFLOAD_SHARES`` levels."""

    recompute: tuple[str, ...] = RECOMPUTE_ORDER
    micro_batches: int | None = None
    zero: tuple[int, ...] = ZERO_STAGES
    offload: int | None = None
    fp8_gather: tuple[bool, ...] = (True, False)

    @classmethod
    def parse(
        cls, recompute: str, micro_batches: int | str, zero: int | str, offload: int | str, fp8_gather: bool | str
    ) -> Choices:
        """Choices from ``plan``'s arguments: ``AUTO_OPTION`` (searched) or a pinned value, each checked."""
        auto = AUTO_OPTION
        if recompute != auto:
            check_recompute(recompute)
        if micro_batches != auto:
            rules.count(micro_batches, "micro_batches (--micro-batches)", example=4)
        if zero != auto and zero not in ZERO_STAGES:
            raise ValueError(f"zero = {zero!r}: use auto or one of {ZERO_STAGES} (--zero)")
        if offload != auto and (isinstance(offload, bool) or not isinstance(offload, int) or offload < 0):
            raise ValueError(f"offload = {offload!r}: use auto or a whole number of blocks ≥ 0 (--offload)")
        if fp8_gather not in (auto, True, False):
            raise ValueError(f"fp8_gather = {fp8_gather!r}: use auto, True or False (--fp8-gather auto|on|off)")
        return cls(
            RECOMPUTE_ORDER if recompute == auto else (str(recompute),),
            None if micro_batches == auto else int(micro_batches),
            ZERO_STAGES if zero == auto else (int(zero),),
            None if offload == auto else int(offload),
            (True, False) if fp8_gather == auto else (bool(fp8_gather),),
        )

    def spec(self) -> dict[str, Any]:
        """What was searched, as ``PlanResult.to_json`` gives it."""
        return {
            "recompute": list(self.recompute),
            "micro_batches": self.micro_batches if self.micro_batches is not None else AUTO_OPTION,
            "zero": list(self.zero),
            "offload": self.offload if self.offload is not None else AUTO_OPTION,
            "fp8_gather": list(self.fp8_gather),
        }


def micro_counts(wl: Workload, shape: GridShape, pinned: int | None = None) -> list[int]:
    """The micro-batch counts k a step of ``wl`` can run on ``shape``: each micro-batch of batch/k
    sequences must still split over batch (over data with context parallelism over z; with it over
    z × data every rank holds every sequence). ``pinned``: that one,
    if valid."""
    # sequences per rank: per data rank with context parallelism over z; hierarchical, every sequence
    per = (1 if wl.context_axis == "batch" else shape.data) if wl.context_parallel else shape.size("batch")
    if wl.batch % per:
        return []
    local = wl.batch // per
    if pinned is not None:
        return [pinned] if local % pinned == 0 else []
    counts = [k for k in range(1, local + 1) if local % k == 0]
    if len(counts) > MAX_MICRO_COUNTS:
        counts = sorted({k for k in counts if k & (k - 1) == 0} | {local})[:MAX_MICRO_COUNTS]
    return counts


def offload_levels(wl: Workload, machine: Machine, pinned: int | None = None) -> list[int]:
    """Blocks whose activations the search may offload, fewest first: ``pinned``, or the
    ``OFFLOAD_SHARES`` of n_layers on an accelerator that can price it (``Machine.can_offload``).
    On a host there is nothing to gain (host memory is the device's), so none unless pinned."""
    n = wl.model.n_layers
    if pinned is not None:
        if pinned > n:
            raise ValueError(f"offload = {pinned} blocks, but the model has {n}; give 0 to {n}")
        return [pinned]
    if not (machine.accelerator and machine.can_offload):
        return [0]
    return sorted({round(share * n) for share in OFFLOAD_SHARES})


def best_options(
    wl: Workload,
    shape: GridShape,
    machine: Machine,
    overlap: OverlapPolicy,
    choices: Choices,
    memory_limit: float | None = None,
) -> Candidate | None:
    """The fastest fitting step options for ``shape`` (``choices``: what may vary), or, when none
    fits, the candidate of least memory (``fits`` False); None when no option is valid on it.

    Dominance keeps the search small: of the offload levels (fewest first) only the first that fits
    is priced — more offload only adds copies; micro-batch counts are tried from 1 up until one fits
    without offload (more micro-batches repeat the weight collectives on smaller GEMMs); FP8 gathers,
    where allowed (G_z > 1, a precision that becomes bf16-fp8-gather with them:
    ``scenario.fp8_gathers_allowed``), move fewer bytes for the same memory, so under auto
    only they are priced; ZeRO stages beyond 0 only where G_data > 1."""
    ks = micro_counts(wl, shape, choices.micro_batches)
    if not ks:
        return None
    fp8_ok = shape.z > 1 and fp8_gathers_allowed(wl)
    fp8s = [f for f in choices.fp8_gather if fp8_ok or not f] or [False]
    if len(fp8s) == 2:
        fp8s = [True]
    zeros = [z for z in choices.zero if z == 0 or shape.data > 1] or [choices.zero[0]]
    offs = offload_levels(wl, machine, choices.offload)
    best: Candidate | None = None
    least: tuple[float, Scenario, MemoryEstimate] | None = None
    for rc in choices.recompute:
        for fp8 in fp8s:
            for zero in zeros:
                for k in ks:
                    fitted_off = None
                    for off in offs:
                        sc = Scenario(wl, shape, machine, overlap, rc, k, zero, off, fp8)
                        mem = scenario_memory(sc)
                        if least is None or mem.peak < least[0]:
                            least = (mem.peak, sc, mem)
                        if fits(mem, machine, memory_limit):
                            c = candidate(sc, memory_limit, mem)
                            if best is None or c.time.step_s < best.time.step_s * (1 - 1e-9):
                                best = c
                            fitted_off = off
                            break
                    if fitted_off == 0:
                        break
    if best is not None:
        return best
    assert least is not None
    return candidate(least[1], memory_limit, least[2])


def lower_bound(wl: Workload, shape: GridShape, machine: Machine, overlap: OverlapPolicy, choices: Choices) -> float:
    """A step time no options of ``choices`` beat on ``shape``: the least recomputation, the fewest
    micro-batches, no offload and FP8 gathers where allowed, less the optimizer and every data-axis
    collective (which ZeRO changes); inf when no micro-batch count is valid."""
    ks = micro_counts(wl, shape, choices.micro_batches)
    if not ks:
        return math.inf
    rc = min(choices.recompute, key=RECOMPUTE_ORDER.index)
    fp8 = any(choices.fp8_gather) and shape.z > 1 and fp8_gathers_allowed(wl)
    off = min(offload_levels(wl, machine, choices.offload))
    t = step_estimate(Scenario(wl, shape, machine, overlap, rc, ks[0], 0, off, fp8))
    k_c, _, k_w, _ = t.scale
    return t.step_s - k_c * t.optimizer_s - max(k_c, k_w) * t.comm_by_axis.get("data", 0.0)
