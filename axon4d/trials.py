"""Plan, then measure: build each of the planner's best few plans in turn, time a few steps of each,
tear it down, and take the planner's first unless another is faster beyond the measured spread
(docs/planner.md#trying-the-top-plans).

``try_plans`` does it for a library user's model: the caller gives a builder that makes the model,
its optimizer and one training step on a plan's grid (a ``Trial``); the training job's ``--try``
(``axon4d.train.trial``) runs the same trials (``run``) with its own model, step and data.

Plans are timed in interleaved repeats: ``rounds`` rounds, each trying every plan in the planner's
order. Each try builds the plan with ``axon4d.init`` on its grid and overlap knobs, steps it
untimed (round 1: ``WARMUP`` steps, the second tracked for its peak memory,
``axon4d.memory.peakmem.peak_bytes``; later rounds one) and ``steps`` times timed, and tears it
down: ``axon4d.shutdown`` destroys the grid's process groups, the trial's objects are dropped and
collected, the accelerator's cached memory released. A plan's time is the median of its rounds
(each round's: the slowest rank's median step); ``choose`` keeps the planner's first plan that ran
unless another's slowest round beat its fastest.

Each try runs in a world of its own (``axon4d.reliability.fence``): a plan whose build or steps fail
on any rank (out of memory mid-step, a refused option) is skipped with the reason of the rank that
failed first, and not tried again. That rank says so on the job's store and tears its grid down,
which frees every rank blocked in a collective with it within seconds; all count themselves out
on the store, then agree on each try's outcome and times in one all-gather over the job's default
group (which outlives the grids and never carries a trial's collectives) through the
communication layer, so every rank skips and chooses alike. The host's random state is restored
after the trials. ``$AXON4D_TRIAL_OOM`` (a test's hook) plants an out-of-memory mid-step.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axon4d import device as devices
from axon4d.comm.communicator import Communicator, TorchTransport
from axon4d.grid import launch, runtime
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridShape
from axon4d.memory.peakmem import peak_bytes
from axon4d.plan.auto import ranked
from axon4d.plan.candidate import Candidate
from axon4d.plan.correction import Correction
from axon4d.reliability import fence, watchdog
from axon4d.trial_table import RULE, error_pct, line, say, table

__all__ = [
    "RULE",
    "Build",
    "Trial",
    "Tried",
    "choose",
    "error_pct",
    "line",
    "repeats",
    "run",
    "say",
    "table",
    "try_plans",
]

#: untimed steps before the timed ones: the first allocates the optimizer's state, the second is
#: tracked for the peak memory
WARMUP = 2
#: rounds of the plans' tries, round-robin (``run``)
ROUNDS = 3
#: a test's hook: "x,y,z,data@rank" plants an out-of-memory on that rank mid-step in that plan (``fence.plant``)
OOM_ENV = fence.OOM_ENV
#: the characters of a failed plan's reason kept in its row
REASON_CHARS = 300
#: bytes each rank contributes to the agreement on a plan (its verdict and measurement as JSON)
SLOT = 2048


@dataclasses.dataclass
class Trial:
    """One plan built for its trial on its grid: what a ``Build`` returns."""

    model: nn.Module
    """The model on the plan's grid (its parameters are counted in the peak memory)."""
    optimizer: Any
    """Its optimizer (a ``torch.optim.Optimizer`` or ``axon4d.ShardedOptimizer``): its state is counted too."""
    step: Callable[[], Any]
    """One training step: forward, backward, optimizer step, gradients zeroed."""
    passes: Callable[[Callable[[], None]], Any] | None = None
    """For a step that runs the model's forward more than once (micro-batches): the same step,
    called with ``next_pass``, to call before each forward after the first (the host's memory
    tracker follows one forward at a time); None: ``step`` runs it once."""


#: (the plan's grid, the plan) -> the plan built on it
Build = Callable[[Grid, Candidate], Trial]


@dataclasses.dataclass
class Tried:
    """What ``try_plans`` found: the fastest measured plan and a row per plan tried."""

    best: Candidate
    """The chosen plan: its ``shape`` and ``overlap`` are the grid to build, its options the step's."""
    rows: list[dict[str, Any]]
    """Per plan, in the planner's order: predicted and measured step time and peak memory, the error, the choice."""

    def init_args(self) -> dict[str, Any]:
        """``axon4d.init``'s ``grid`` and ``overlap`` for the chosen plan, and an MoE model's
        ``expert_layout`` (the one the plan was priced with)."""
        layout = {"expert_layout": self.best.expert_layout} if self.best.expert_layout else {}
        return {"grid": self.best.shape.as_tuple(), "overlap": self.best.overlap, **layout}


def try_plans(
    build: Build,
    *,
    plan: dict[str, Any],
    top: int = 3,
    steps: int = 3,
    rounds: int | None = None,
    seed: int | None = None,
    precision: str | None = None,
    comm: str = "auto",
    timeout_s: float = 600.0,
    correction: Correction | str | None = None,
) -> Tried:
    """Try the planner's ``top`` fastest fitting plans for ``plan`` (``axon4d.init``'s: {"model",
    "batch", "machine", and the step options, "auto" to let the planner choose}) on this job's
    ranks, priced with ``correction`` (``axon4d.plan.correction``: a file's path or a loaded one;
    ``axon4d.plan.auto.ranked``): each built by ``build(grid, candidate)`` on ``axon4d.init(grid=...,
    overlap=..., expert_layout=..., seed=seed, precision=precision, comm=comm)``, stepped and torn
    down, ``rounds`` times round-robin (module docstring). The builder applies the candidate's step
    options it supports (``candidate.recompute``, ``candidate.option("zero")``, ...). Returns the
    chosen plan (``choose``) and the rows; rank 0 prints them. Call it on every rank, with no grid
    built; build the chosen plan afterwards with ``axon4d.init(**tried.init_args(), ...)``.

    ``ValueError`` (every rank alike, before any plan is built) for a bad ``top``/``steps``/``rounds``,
    a correction of another world, or a plan that does not fit; ``RuntimeError`` when a grid is
    already built, or when no plan ran."""
    rounds = ROUNDS if rounds is None else rounds
    for name, value in (("top", top), ("steps", steps), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"try_plans({name}={value!r}): must be a whole number ≥ 1, e.g. {name}=3")
    try:
        runtime.get_grid()
    except RuntimeError:
        pass  # none: the trials build theirs
    else:
        raise RuntimeError(
            "try_plans builds each plan's grid itself, but a grid is already built: call axon4d.shutdown() first"
        )
    info = launch.detect()
    if isinstance(precision, str) and "precision" not in plan and "workload" not in plan:
        plan = {**plan, "precision": precision}  # the planner prices what the grid's collectives move
    asked = {"overlap": "auto", **plan, "rank": info.rank, "top": top, "correction": correction}
    result = ranked(info.world_size, **asked)
    fitting = [c for c in result.candidates if c.fits][:top]
    init = {"seed": seed, "precision": precision, "comm": comm, "timeout_s": timeout_s}

    def built(cand: Candidate) -> dict[str, Any]:  # an MoE model's plan in the layout it was priced with
        return {**init, "expert_layout": cand.expert_layout or None}

    label = f"try_plans(top={top})"
    rows = run(fitting, build, steps=steps, rounds=rounds, init=built, timeout_s=timeout_s, label=label)
    chosen = choose(rows, label, "build a grid of your own with axon4d.init(grid=(x, y, z, data))")
    if info.rank == 0:
        print(table(rows), file=sys.stderr, flush=True)
    return Tried(fitting[chosen["rank"] - 1], rows)


def run(
    plans: list[Candidate],
    build: Build,
    *,
    steps: int,
    init: Callable[[Candidate], dict[str, Any]],
    timeout_s: float,
    label: str = "try_plans",
    rounds: int | None = None,
) -> list[dict[str, Any]]:
    """Try each of ``plans``, built on ``axon4d.init(grid, overlap, **init(plan))`` by ``build``,
    ``rounds`` times round-robin (round 1: every plan in the planner's order, then round 2, ...; a
    plan that failed is not tried again); their rows, in the given order, the same on every rank.
    Rank 0 says what the trial costs before it starts (led by ``label``) and how each try went.
    ``rounds``: None for ``ROUNDS``."""
    rounds = ROUNDS if rounds is None else rounds
    info = launch.detect()
    rank0 = info.rank == 0
    if rank0:
        n = len(plans) * (WARMUP + steps + (rounds - 1) * (1 + steps))
        predicted = n * sum(c.time.step_s for c in plans) / max(len(plans), 1)
        say(
            f"{label}: trying the planner's {len(plans)} fastest fitting plans in {rounds} interleaved round(s), "
            f"{WARMUP} warm-up (1 in later rounds) + {steps} timed steps each ({n} steps, {predicted:.2f} s by the "
            "planner's prices, plus building each plan each round); none is trained on"
        )
    agreement = devices.rank_device(None, info.local_rank)  # the world group's device, where it is not gloo's
    saved_rng = devices.rng_state()
    rows = [_row(cand, i + 1) for i, cand in enumerate(plans)]
    job = fence.next_id()
    for r in range(rounds):
        for i, cand in enumerate(plans):
            row = rows[i]
            if row["error"] is not None:
                continue
            t0 = time.perf_counter()
            key = f"{job}/{r}/{i}"
            seconds, peak, err, kind = _try_one(cand, build, steps, init(cand), timeout_s, agreement, r, key)
            row["rounds_s"].append(seconds)
            if err is not None:
                row["error"], row["failure"] = err, kind
            elif r == 0:
                row["measured_peak_bytes"] = peak
            if rank0:
                say(
                    f"round {r + 1}/{rounds}, plan {i + 1}/{len(plans)} ({time.perf_counter() - t0:.1f} s): {line(row)}"
                )
    for row in rows:
        ok = row["error"] is None and row["rounds_s"]
        row["measured_s"] = statistics.median(row["rounds_s"]) if ok else None
        row["spread_s"] = max(row["rounds_s"]) - min(row["rounds_s"]) if ok else None
        if not ok:
            row["measured_peak_bytes"] = None
    devices.restore_rng(saved_rng)
    return rows


def choose(rows: list[dict[str, Any]], what: str, hint: str) -> dict[str, Any]:
    """The row of the plan to train with, marked chosen: the planner's first plan that ran (the
    reference), unless another's slowest round was faster than the reference's fastest round — then
    the one of those with the fastest median (the planner's order breaks ties). ``RuntimeError``
    listing every plan's reason when none ran (``what`` and ``hint`` say what was tried and what to
    do instead)."""
    ok = [r for r in rows if r["measured_s"] is not None]
    if not ok:
        reasons = "; ".join(f"{r['grid']}: {r['error']}" for r in rows)
        raise RuntimeError(f"{what}: no plan ran ({reasons}); {hint}")
    reference = min(ok, key=lambda r: r["rank"])
    beyond = [r for r in ok if max(r["rounds_s"]) < min(reference["rounds_s"])]
    chosen = min(beyond, key=lambda r: (r["measured_s"], r["rank"])) if beyond else reference
    chosen["chosen"] = True
    return chosen


def repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The interleaved repeat table: one entry per try, in the order they ran (round by round, the
    plans in the planner's order), with its seconds (None: it failed)."""
    out = []
    for r in range(max((len(row["rounds_s"]) for row in rows), default=0)):
        for row in rows:
            if r < len(row["rounds_s"]):
                out.append({"round": r + 1, "plan": row["rank"], "grid": row["grid"], "measured_s": row["rounds_s"][r]})
    return out


def _row(cand: Candidate, rank: int) -> dict[str, Any]:
    """The row of ``cand``, the ``rank``-th plan tried, before it is tried."""
    t = cand.time
    compute_s = t.scale[0] * t.parts[0]  # the priced compute, as scaled into the step
    return {
        "rank": rank,
        "grid": list(cand.shape.as_tuple()),
        "options": cand.options_spec(),
        "predicted_s": t.step_s,
        "predicted_compute_s": compute_s,
        "predicted_comm_s": t.step_s - compute_s,
        "predicted_peak_bytes": int(cand.mem.peak),
        "measured_s": None,
        "rounds_s": [],
        "spread_s": None,
        "measured_peak_bytes": None,
        "error": None,
        "failure": None,
        "chosen": False,
    }


def _try_one(
    cand: Candidate,
    build: Build,
    steps: int,
    init: dict[str, Any],
    timeout_s: float,
    agreement: torch.device,
    round_: int,
    key: str,
) -> tuple[float | None, int | None, str | None, str | None]:
    """Build ``cand`` in its own world (``axon4d.reliability.fence``), measure it, tear it down:
    (the slowest rank's median step seconds, the largest peak bytes — round 0 only —, None, None), or
    (None, None, the failure's origin's reason, "out of memory" or "error"); the same on every rank."""
    info = launch.detect()
    store = watchdog.default_store()
    trial_world = fence.TrialWorld(store, key, info.rank, info.world_size, timeout_s) if store is not None else None
    with watchdog.guard(info.rank, info.world_size, timeout_s, timeout_s):
        if trial_world is not None:
            trial_world.enter()
        measured, err, kind, device = _measure(cand, build, steps, init, round_, trial_world)
        origin = err is not None and (trial_world is None or trial_world.fail())
        if err is not None:  # torn down now: a rank blocked in a collective with this one gets an error
            _teardown(device, clean=False, trial_world=trial_world)
        failed = trial_world.arrive() if trial_world is not None else err is not None
        if err is None:
            _teardown(device, clean=not failed, trial_world=trial_world)
    verdicts = _agree(err, measured, origin, kind, agreement)
    failures = [v for v in verdicts if v[0] is not None]
    if failures:
        first = next((v for v in failures if v[2]), failures[0])  # the origin's reason
        return None, None, first[0], first[3]
    return max(v[1][0] for v in verdicts), max(v[1][1] for v in verdicts), None, None


def _teardown(device: torch.device | None, clean: bool, trial_world: fence.TrialWorld | None) -> None:
    """The trial's grid shut down (``clean``: with a barrier and its reductions drained), the
    trial's world left, the objects collected, the accelerator's cache released."""
    runtime.shutdown(clean=clean)
    if trial_world is not None:
        trial_world.leave()
    gc.collect()
    if device is not None:
        devices.release_cached_memory(device)


def _measure(
    cand: Candidate, build: Build, steps: int, init: dict[str, Any], round_: int, trial_world: fence.TrialWorld | None
) -> tuple[tuple[float, int] | None, str | None, str | None, torch.device | None]:
    """((median seconds of the timed steps on this rank, peak bytes of torch tensors — the maximum
    over ranks, tracked in round 0 only), None, None, the grid's device) of the plan ``cand``;
    (None, why, "out of memory" or "error", the device if the grid was built) when the build or a
    step failed. The grid is left built (``_try_one`` shuts it down)."""
    try:
        grid = runtime.init(grid=cand.shape.as_tuple(), overlap=cand.overlap, **init)
    except Exception as e:
        return None, _reason(e, launch.detect().rank), _kind(e), None
    built: tuple[str, str] | None = None
    try:
        trial: Trial | None = build(grid, cand)
    except Exception as e:  # a rank that cannot build (out of memory) has joined no step's collective
        built, trial = (_reason(e, grid.rank), _kind(e)), None
    verdicts = _agree(built[0] if built else None, None, True, built[1] if built else None, grid.device)
    failed = [v for v in verdicts if v[0] is not None]
    if failed or trial is None:  # every rank skips the plan before its first step (the lowest failing rank's reason)
        return None, failed[0][0], failed[0][3], grid.device
    try:
        if trial_world is not None:
            on_host = dist.get_backend() == devices.default_backend(devices.HOST)  # the trial's world
            trial_world.watch(lambda: list(grid.groups.values()), on_host)
        planted = fence.plant(trial.model, cand.shape.as_tuple(), grid.rank) if round_ == 0 else None
        trial.step()
        peak = 0
        if round_ == 0:
            if trial.passes is not None:
                peak = peak_bytes(grid, trial.model, trial.optimizer, trial.passes, passes=True)
            else:
                peak = peak_bytes(grid, trial.model, trial.optimizer, trial.step)
        if planted is not None:
            planted.arm()  # mid-step, in the first timed step
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trial.step()
            devices.synchronize(grid.device)
            times.append(time.perf_counter() - t0)
        return (statistics.median(times), peak), None, None, grid.device
    except Exception as e:  # skipped and reported
        return None, _reason(e, grid.rank), _kind(e), grid.device
    finally:
        if trial_world is not None:
            trial_world.stop_watching()


def _kind(e: BaseException) -> str:
    """ "out of memory" for an accelerator's (or a host's) allocation failure, else "error"."""
    return "out of memory" if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower() else "error"


def _reason(e: BaseException, rank: int) -> str:
    """Why a plan failed on ``rank``, in a row's few words: the rank, the error's type and message."""
    return f"rank {rank}: {type(e).__name__}: {e}"[:REASON_CHARS]


def _agree(
    err: str | None, measured: tuple[float, int] | None, origin: bool, kind: str | None, device: torch.device
) -> list[tuple[Any, ...]]:
    """Every rank's (error, measurement, whether it failed first, the failure's kind), gathered over
    the world's default group (the job's, after a trial: every rank has left the trial's) through
    the communication layer, as JSON in a fixed slot per rank: the same list on every rank.
    ``device``: where the default group's collectives take tensors when its backend is not the
    host's."""
    if not dist.is_initialized():
        return [(err, measured, origin, kind)]
    data = json.dumps([err, measured, origin, kind]).encode()
    if len(data) > SLOT:  # a reason of many escaped characters: shortened, still one verdict
        data = json.dumps([err[: SLOT // 8] if err else err, measured, origin, kind]).encode()
    if dist.get_backend() == devices.default_backend(devices.HOST):
        device = devices.HOST
    mine = torch.zeros((1, SLOT), dtype=torch.uint8)  # (1, SLOT) bytes, zero-padded
    mine[0, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = dist.group.WORLD
    assert world is not None
    comm = Communicator(GridShape(1, 1, 1, dist.get_world_size()), TorchTransport({"world": world}))
    try:
        table = devices.to_host(comm.all_gather(mine.to(device), "world").wait())  # (world, SLOT)
    finally:
        comm.close()
    rows = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in table]
    return [(e, None if m is None else tuple(m), o, k) for e, m, o, k in rows]
