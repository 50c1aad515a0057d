"""One plan priced: a grid with its step options, its predicted time, memory and MFU, and whether
it fits (docs/design.md §6).

``candidate`` prices one ``Scenario`` (``cost.step_estimate``, ``memory.memory``); ``fits`` is the
test every plan must pass to be shown or run; ``tune_overlap`` tries the overlap knobs on one grid.
Besides time and memory, each candidate reports its communication words against Agarwal's lower
bound for its GEMMs, Σ 3·(M·K·N/P)^{2/3} per rank (§3).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from axon4d.grid.shape import GridShape
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.cost import TimeEstimate, step_estimate
from axon4d.plan.device_memory import grid_communicators
from axon4d.plan.host_memory import pinned_per_node, pinned_per_rank
from axon4d.plan.machine import Machine
from axon4d.plan.memory import MemoryEstimate, memory
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload


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
    context_mode: str = ""  # with it, how keys and values travel: "all-gather" or "ring" ("" without)
    context_axes: str = ""  # with it, the axes each sequence is split over: "z" or "z,data" ("" without)
    overlap: OverlapPolicy = OverlapPolicy()  # the policy it was priced with
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # ``Scenario.options``: recompute, …
    expert_layout: str = ""  # an MoE model's expert layout (axon4d.grid.expert_layout), "" for a dense one

    @property
    def recompute(self) -> str:
        return str(self.options.get("recompute", "none"))

    def option(self, name: str) -> Any:
        """The value of one step option (``Scenario.options``) it was priced with."""
        return self.options[name]

    def options_spec(self) -> str:
        """Its options in a few words: "balanced, 2 micro-batches, ZeRO-1, offload 10 blocks, fp8 gathers"."""
        o = self.options
        words = [f"recompute {o.get('recompute', 'none')}"]
        if o.get("micro_batches", 1) > 1:
            words.append(f"{o['micro_batches']} micro-batches")
        if o.get("zero"):
            words.append(f"ZeRO-{o['zero']}")
        if o.get("offload"):
            words.append(f"offload {o['offload']} blocks")
        if o.get("fp8_gather"):
            words.append("fp8 gathers")
        if self.context_parallel:
            over = "z·data" if self.context_axes == "z,data" else "z"
            words.append(f"context parallel ({self.context_mode} over {over})")
        if self.expert_layout:
            words.append(f"experts {self.expert_layout}")
        return ", ".join(words)

    def to_json(self) -> dict[str, Any]:
        t = self.time
        return {
            "grid": list(self.shape.as_tuple()),
            "context_parallel": self.context_parallel,
            **({"context_mode": self.context_mode, "context_axes": self.context_axes} if self.context_parallel else {}),
            **self.options,
            **({"expert_layout": self.expert_layout} if self.expert_layout else {}),
            "overlap": self.overlap.spec(),
            "fits": self.fits,
            "step_s": t.step_s,
            "mfu": self.mfu,
            "compute_s": t.compute_s,
            "matmul_s": t.matmul_s,
            "optimizer_s": t.optimizer_s,
            "offload_s": t.offload_s,
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
    **options: Any,
) -> Candidate:
    """Predicted time, memory and MFU of one valid grid: ``candidate`` of their ``Scenario``
    (``options``: its ``micro_batches``, ``zero``, ``offload``, ``fp8_gather``). A grid that breaks
    one of the job's divisibility rules (``Workload.grid_problems``) is refused with each rule it
    breaks."""
    problems = wl.grid_problems(shape)
    if problems:
        layout = f" with experts {wl.expert_layout}" if wl.model.moe else ""
        raise ValueError(
            f"grid {shape.as_tuple()} cannot run {wl.model.name or 'this model'}{layout}: {'; '.join(problems)}; "
            "choose sizes that divide them (`axon4d plan` searches only the grids that do)"
        )
    return candidate(Scenario(wl, shape, machine, overlap, recompute, **options), memory_limit)


def scenario_memory(sc: Scenario) -> MemoryEstimate:
    """``memory.memory`` of ``sc``: its workload, grid, recomputation, overlap and options, with the
    host memory its buffers pin per rank and per node (``host_memory``) and the device memory its
    grid's communicators, the CUDA context and the libraries' workspaces take before the first
    tensor (``Machine.usable_device_memory``, ``device_memory.grid_communicators``). An MoE layout
    with FP8 dispatch is priced as its twin without (docs/moe.md "FP8 dispatch"), from one walk."""
    wl = sc.workload
    if wl.expert_layout.fp8_dispatch:
        wl = dataclasses.replace(wl, expert_layout=dataclasses.replace(wl.expert_layout, fp8_dispatch=False))
    m = sc.machine
    mem = _memory(
        wl,
        sc.shape,
        sc.recompute,
        sc.overlap,
        m.staged_reduce_scatter,
        sc.micro_batches,
        sc.zero,
        sc.offload,
        sc.fp8_gather,
        m.accelerator,
    )
    return dataclasses.replace(
        mem,
        pinned=pinned_per_rank(sc),
        pinned_node=pinned_per_node(sc),
        reserved=m.memory_per_device - m.usable_device_memory(grid_communicators(sc.shape)),
    )


@functools.lru_cache(maxsize=16384)
def _memory(
    wl: Workload,
    shape: GridShape,
    recompute: str,
    overlap: OverlapPolicy,
    staged: bool,
    micro_batches: int,
    zero: int,
    offload: int,
    fp8_gather: bool,
    accelerator: bool,
) -> MemoryEstimate:
    """``memory.memory`` of these arguments (cached: FP8 dispatch's twins ask for the same walks)."""
    return memory(
        wl,
        shape,
        recompute,
        overlap,
        staged_reduce_scatter=staged,
        micro_batches=micro_batches,
        zero=zero,
        offload=offload,
        fp8_gather=fp8_gather,
        widened_gemms=not accelerator,
        accelerator=accelerator,
    )


def device_need(mem: MemoryEstimate, machine: Machine) -> float:
    """Bytes of device memory a step of ``mem`` needs: its peak with the allocator's fragmentation
    (``Machine.fragmentation``) and what is taken before the first tensor (``mem.reserved``)."""
    return mem.peak * (1 + machine.fragmentation) + mem.reserved


def fits(mem: MemoryEstimate, machine: Machine, memory_limit: float | None = None) -> bool:
    """Whether a step of ``mem`` fits: on the device, its peak with fragmentation and the memory
    taken before the first tensor within ``memory_limit`` bytes (default: the machine's device
    memory; ``device_need``); on an accelerator, the host memory its node's ranks pin within the
    node's memory less its reserve (``Machine.pinned_host_per_node``)."""
    limit = machine.memory_per_device if memory_limit is None else memory_limit
    host_ok = not machine.accelerator or mem.pinned_node <= machine.pinned_host_per_node
    return device_need(mem, machine) <= limit and host_ok


def candidate(sc: Scenario, memory_limit: float | None = None, mem: MemoryEstimate | None = None) -> Candidate:
    """Predicted time (recomputation included), memory and MFU of ``sc``; it fits where its peak is
    within ``memory_limit`` bytes (default: the machine's device memory) and its offloaded
    activations within the machine's host memory per device."""
    wl, machine = sc.workload, sc.machine
    t = step_estimate(sc)
    mem = mem if mem is not None else scenario_memory(sc)
    mfu = wl.flops() / (sc.world * machine.peak(wl.dtype) * t.step_s)
    return Candidate(
        sc.shape,
        t,
        mem,
        fits(mem, machine, memory_limit),
        mfu,
        agarwal_ratio(sc, t),
        wl.context_parallel,
        wl.context_mode if wl.context_parallel else "",
        wl.context_axes if wl.context_parallel else "",
        sc.overlap,
        sc.options(),
        str(wl.expert_layout) if wl.model.moe else "",
    )


def tune_overlap(
    wl: Workload,
    shape: GridShape,
    machine: Machine,
    base: OverlapPolicy = OverlapPolicy(),
    recompute: str = "none",
    memory_limit: float | None = None,
    **options: Any,
) -> Candidate:
    """``shape`` priced with the fastest of ``base``'s knob variants that fits in memory
    (``OverlapPolicy.knob_variants``: OAG depth and keep-for-backward, ORS in flight, forward
    chunks); ``base`` itself where no variant fits or none is faster. Ties go to the earlier
    variant (shallower, fewer in flight and chunks: less memory held). ``options``: the step's
    (``Scenario``: micro_batches, zero, offload, fp8_gather), kept as they are."""
    best = evaluate(wl, shape, machine, base, recompute, memory_limit, **options)
    for policy in base.knob_variants():
        if policy == base:
            continue
        c = evaluate(wl, shape, machine, policy, recompute, memory_limit, **options)
        if c.fits and (not best.fits or c.time.step_s < best.time.step_s * (1 - 1e-9)):
            best = c
    return best
