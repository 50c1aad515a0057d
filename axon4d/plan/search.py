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
from axon4d.plan.scenario import ZERO_STAGES, Scenario
from axon4d.plan.workload import Workload
from axon4d.recompute_mode import check_recompute
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
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # ``Scenario.options``: recompute, …

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
            words.append("context parallel")
        return ", ".join(words)

    def to_json(self) -> dict[str, Any]:
        t = self.time
        return {
            "grid": list(self.shape.as_tuple()),
            "context_parallel": self.context_parallel,
            **self.options,
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
        least = min(self.candidates, key=lambda c: c.mem.peak)
        m = least.mem
        state = (m.params + m.grads + m.optimizer) / 2**30
        host = ""
        if self.machine.accelerator and m.host > self.machine.host_memory_per_device:
            host = (
                f"; its offloaded activations, {m.host / 2**30:.1f} GiB, exceed the host memory per device "
                f"({self.machine.host_memory_per_device / 2**30:.0f} GiB)"
            )
        searched = "" if self.choices is None else " (every searched option at its most frugal)"
        return (
            f"{model} needs at least {m.peak / 2**30:.1f} GiB per device{searched}, on {least.shape.as_tuple()} with "
            f"{least.options_spec()} — {state:.1f} GiB of parameters, gradients and optimizer state, "
            f"{m.activations / 2**30:.1f} GiB of saved activations — against {limit:.1f} GiB{host}. It would fit with "
            f"--memory-gib {math.ceil(m.peak / 2**30)} (a device with that much memory), with more ranks (the state "
            f"shrinks with each), or with a pinned option left to the search"
        )

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
            "valid": self.valid or len(self.candidates),
            "searched": self.searched,
            "options_searched": self.choices.spec() if self.choices is not None else None,
            "invalid": self.invalid,
            "step_scale_caveat": self.caveat,
            "candidates": [c.to_json() for c in self.candidates[:top]],
        }

    def table(self, top: int = 10) -> str:
        """The top-k candidates as a text table, with the step options each was priced with."""
        head = (
            f"{'grid (x,y,z,d)':<18} {'seq':>5} {'recompute':>9} {'mb':>3} {'zero':>4} {'offl':>4} {'fp8':>3} "
            f"{'step s':>9} {'MFU':>6} {'mem GiB':>8} {'fits':>4} "
            + " ".join(f"{'t_' + a:>8}" for a in TABLE_AXES)
            + f" {'hidden':>7} {'×bound':>7}"
        )
        lines = [head, "-" * len(head)]
        for c in self.candidates[:top]:
            t, o = c.time, c.options
            axes = " ".join(f"{t.comm_by_axis.get(a, 0.0):>8.3g}" for a in TABLE_AXES)
            lines.append(
                f"{str(c.shape.as_tuple()):<18} {'split' if c.context_parallel else 'whole':>5} "
                f"{o.get('recompute', 'none'):>9} {o.get('micro_batches', 1):>3} {o.get('zero', 0):>4} "
                f"{o.get('offload', 0):>4} {'yes' if o.get('fp8_gather') else 'no':>3} "
                f"{t.step_s:>9.4g} {100 * c.mfu:>5.1f}% "
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
    **options: Any,
) -> Candidate:
    """Predicted time, memory and MFU of one valid grid: ``candidate`` of their ``Scenario``
    (``options``: its ``micro_batches``, ``zero``, ``offload``, ``fp8_gather``)."""
    return candidate(Scenario(wl, shape, machine, overlap, recompute, **options), memory_limit)


def scenario_memory(sc: Scenario) -> MemoryEstimate:
    """``memory.memory`` of ``sc``: its workload, grid, recomputation, overlap and options."""
    return memory(
        sc.workload,
        sc.shape,
        sc.recompute,
        sc.overlap,
        staged_reduce_scatter=sc.machine.staged_reduce_scatter,
        micro_batches=sc.micro_batches,
        zero=sc.zero,
        offload=sc.offload,
        fp8_gather=sc.fp8_gather,
        widened_gemms=not sc.machine.accelerator,
    )


def fits(mem: MemoryEstimate, machine: Machine, memory_limit: float | None = None) -> bool:
    """Whether a step of peak ``mem`` fits: its peak within ``memory_limit`` bytes per device (default
    the machine's) and, on an accelerator, its offloaded activations within the host memory per device."""
    limit = machine.memory_per_device if memory_limit is None else memory_limit
    host_ok = not machine.accelerator or mem.host <= machine.host_memory_per_device
    return mem.peak <= limit and host_ok


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
        sc.overlap,
        sc.options(),
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
    sequences must still split over batch (over data with context parallelism). ``pinned``: that one,
    if valid."""
    per = shape.data if wl.context_parallel else shape.size("batch")
    if wl.batch % per:
        return []
    local = wl.batch // per  # sequences per rank (per data rank with context parallelism)
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
    where allowed (G_z > 1, 16-bit weights), move fewer bytes for the same memory, so under auto
    only they are priced; ZeRO stages beyond 0 only where G_data > 1."""
    ks = micro_counts(wl, shape, choices.micro_batches)
    if not ks:
        return None
    fp8_ok = shape.z > 1 and wl.element_size == 2
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
    fp8 = any(choices.fp8_gather) and shape.z > 1 and wl.element_size == 2
    off = min(offload_levels(wl, machine, choices.offload))
    t = step_estimate(Scenario(wl, shape, machine, overlap, rc, ks[0], 0, off, fp8))
    k_c, _, k_w, _ = t.scale
    return t.step_s - k_c * t.optimizer_s - max(k_c, k_w) * t.comm_by_axis.get("data", 0.0)


def plan(
    model: ModelConfig | str,
    world: int,
    machine: Machine | str,
    batch: int,
    *,
    dtype: str = "bfloat16",
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
    top: int | None = 10,
) -> PlanResult:
    """Search every valid grid of ``world`` ranks for ``model`` on ``machine`` with every step
    option — recomputation, micro-batches, ZeRO stage, activation offload, FP8 weight gathers,
    context parallelism — and return the best ``top`` (at least) candidates, fastest fitting first.

    ``batch`` is the global batch in sequences per step (the micro-batches split it).
    ``memory_limit`` (bytes per device) defaults to the machine's device memory. Each option is
    ``AUTO_OPTION`` (searched; the default) or pinned: ``recompute`` a mode, ``micro_batches`` a
    count, ``zero`` 0/1/2, ``offload`` a number of blocks, ``fp8_gather`` True/False,
    ``context_parallel`` True/False. ``optimizer``: "adam" or "sgd" (``Workload``). ``overlap``: a
    policy (``OverlapPolicy.parse``), or "auto": the knobs tuned (``tune_overlap``) for the
    ``TUNE_TOP`` fastest; the result's ``overlap`` is the best candidate's policy.

    Each grid gets its fastest fitting options (``best_options``); grids are searched in the
    order of a time no option beats on them (``lower_bound``), and the search stops once that bound
    is above the ``top``-th fastest fitting step found: ``PlanResult.searched`` says how many grids
    it priced (``top=None``: every grid). A world below 1, a limit that is not a positive number, a bad machine file, model,
    batch or option is refused before anything is priced.
    """
    cp = AUTO_OPTION if context_parallel == "auto" else context_parallel
    if cp not in (False, True, AUTO_OPTION):
        raise ValueError(f"context_parallel = {context_parallel!r}: use False, True or 'auto'")
    rules.count(world, "world (ranks, --gpus)", example=8)
    if top is not None:
        rules.count(top, "top (candidates kept)", example=10)
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and 0 < memory_limit < math.inf):
        raise ValueError(
            f"memory_limit = {memory_limit!r} bytes per device must be a finite number above 0 "
            "(--memory-gib 80 for 80 GiB), or None for the machine's own"
        )
    choices = Choices.parse(recompute, micro_batches, zero, offload, fp8_gather)
    mach = load_machine(machine)
    if workload is None:
        cfg = get_config(model) if isinstance(model, str) else model
        workload = Workload(cfg, batch, dtype, optimizer=optimizer)
    if cp is True and not workload.context_parallel:
        workload = dataclasses.replace(workload, context_parallel=True)
    if choices.offload is not None:
        offload_levels(workload, mach, choices.offload)  # refused here when above n_layers
    auto = overlap == AUTO
    ov = OverlapPolicy() if auto else OverlapPolicy.parse(overlap)
    shapes = factorizations(world)
    arr = np.array([s.as_tuple() for s in shapes], dtype=np.int64)
    mask = valid_mask(workload, arr)
    grids = [(workload, s) for s, ok in zip(shapes, mask) if ok]
    if cp == AUTO_OPTION and not workload.context_parallel and workload.model.seq_len % 2 == 0:
        split = dataclasses.replace(workload, context_parallel=True)
        split_mask = valid_mask(split, arr)
        grids += [(split, s) for s, ok in zip(shapes, split_mask) if ok and s.z > 1]
        mask |= split_mask
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

    def rank(c: Candidate) -> tuple[Any, ...]:
        return not c.fits, c.time.step_s if c.fits else c.mem.peak, c.shape.as_tuple(), c.context_parallel

    cands.sort(key=rank)
    if auto:  # the knobs, for the fastest few grids (each variant is one more pricing)
        for i, c in enumerate(cands[:TUNE_TOP]):
            wl_c = dataclasses.replace(workload, context_parallel=c.context_parallel)
            opts = {k: v for k, v in c.options.items() if k != "recompute"}
            cands[i] = tune_overlap(wl_c, c.shape, mach, ov, c.recompute, memory_limit, **opts)
        cands.sort(key=rank)
        ov = cands[0].overlap if cands else ov
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
        int((~mask).sum()),
        stepfit.caveat(mach, workload, world, ov, chosen),
        choices=choices,
        searched=searched,
        valid=len(grids),
    )
