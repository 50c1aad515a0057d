"""Plan, then measure: build each of the planner's best few plans in turn, time a few steps of each,
tear it down, and take the fastest measured (docs/planner.md#trying-the-top-plans).

``try_plans`` does it for a library user's model: the caller gives a builder that makes the model,
its optimizer and one training step on a plan's grid (a ``Trial``); the training job's ``--try``
(``axon4d.train.trial``) runs the same trials (``run``) with its own model, step and data.

Each plan is built with ``axon4d.init`` on its grid and overlap knobs, stepped ``WARMUP`` times
untimed (the second tracked for its peak memory, ``axon4d.memory.peakmem.peak_bytes``) and ``steps``
times timed, and torn down: ``axon4d.shutdown`` destroys the grid's process groups, the trial's
objects are dropped and collected, the accelerator's cached memory released. A plan whose build
or steps fail (out of memory, a refused option) is skipped with its reason: the ranks agree on each
plan's outcome and times in one all-gather over the world's default group (which outlives the
grids) through the communication layer, so every rank skips and chooses alike. A rank left waiting
in a collective another rank will not join ends by the watchdog's deadline (``timeout_s``). The
host's random state is restored after the trials.
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
from axon4d.reliability import watchdog

#: untimed steps before the timed ones: the first allocates the optimizer's state, the second is
#: tracked for the peak memory
WARMUP = 2
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
    seed: int | None = None,
    precision: str | None = None,
    comm: str = "auto",
    timeout_s: float = 600.0,
) -> Tried:
    """Try the planner's ``top`` fastest fitting plans for ``plan`` (``axon4d.init``'s: {"model",
    "batch", "machine", and the step options, "auto" to let the planner choose}) on this job's
    ranks: each built by ``build(grid, candidate)`` on ``axon4d.init(grid=..., overlap=...,
    expert_layout=..., seed=seed, precision=precision, comm=comm)``, stepped ``WARMUP`` + ``steps`` times and torn down
    (module docstring). The builder applies the candidate's step options it supports
    (``candidate.recompute``, ``candidate.option("zero")``, ...). Returns the fastest measured plan
    and the rows; rank 0 prints them. Call it on every rank, with no grid built; build the chosen
    plan afterwards with ``axon4d.init(**tried.init_args(), ...)``.

    ``ValueError`` (every rank alike, before any plan is built) for a bad ``top``/``steps`` or a
    plan that does not fit; ``RuntimeError`` when a grid is already built, or when no plan ran."""
    for name, value in (("top", top), ("steps", steps)):
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
    result = ranked(info.world_size, **{"overlap": "auto", **plan, "rank": info.rank, "top": top})
    fitting = [c for c in result.candidates if c.fits][:top]
    init = {"seed": seed, "precision": precision, "comm": comm, "timeout_s": timeout_s}

    def built(cand: Candidate) -> dict[str, Any]:  # an MoE model's plan in the layout it was priced with
        return {**init, "expert_layout": cand.expert_layout or None}

    rows = run(fitting, build, steps=steps, init=built, timeout_s=timeout_s, label=f"try_plans(top={top})")
    chosen = fastest(rows, f"try_plans(top={top})", "build a grid of your own with axon4d.init(grid=(x, y, z, data))")
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
) -> list[dict[str, Any]]:
    """Try each of ``plans`` in turn, built on ``axon4d.init(grid, overlap, **init(plan))`` by
    ``build``; their rows, in the given order, the same on every rank. Rank 0 says what the trial
    costs before it starts (led by ``label``) and how each plan went as it ends."""
    info = launch.detect()
    rank0 = info.rank == 0
    if rank0:
        predicted = sum((WARMUP + steps) * c.time.step_s for c in plans)
        say(
            f"{label}: trying the planner's {len(plans)} fastest fitting plans, {WARMUP} warm-up + {steps} timed steps each "
            f"({(WARMUP + steps) * len(plans)} steps, {predicted:.2f} s by the planner's prices, plus building each "
            "plan); none is trained on"
        )
    agreement = devices.rank_device(None, info.local_rank)  # the world group's device, where it is not gloo's
    saved_rng = devices.rng_state()
    rows = []
    for i, cand in enumerate(plans):
        t0 = time.perf_counter()
        rows.append(_try_one(cand, i + 1, build, steps, init(cand), timeout_s, agreement))
        if rank0:
            say(f"trial {i + 1}/{len(plans)} ({time.perf_counter() - t0:.1f} s): {line(rows[-1])}")
    devices.restore_rng(saved_rng)
    return rows


def fastest(rows: list[dict[str, Any]], what: str, hint: str) -> dict[str, Any]:
    """The row of the fastest measured plan (the planner's order breaks ties), marked chosen;
    ``RuntimeError`` listing every plan's reason when none ran (``what`` and ``hint`` say what was
    tried and what to do instead)."""
    ok = [r for r in rows if r["measured_s"] is not None]
    if not ok:
        reasons = "; ".join(f"{r['grid']}: {r['error']}" for r in rows)
        raise RuntimeError(f"{what}: no plan ran ({reasons}); {hint}")
    chosen = min(ok, key=lambda r: (r["measured_s"], r["rank"]))
    chosen["chosen"] = True
    return chosen


def _try_one(
    cand: Candidate,
    rank: int,
    build: Build,
    steps: int,
    init: dict[str, Any],
    timeout_s: float,
    agreement: torch.device,
) -> dict[str, Any]:
    """Build ``cand`` (the ``rank``-th plan tried), measure it, tear it down; its row, the same on every rank."""
    t = cand.time
    compute_s = t.scale[0] * t.parts[0]  # the priced compute, as scaled into the step
    row: dict[str, Any] = {
        "rank": rank,
        "grid": list(cand.shape.as_tuple()),
        "options": cand.options_spec(),
        "predicted_s": t.step_s,
        "predicted_compute_s": compute_s,
        "predicted_comm_s": t.step_s - compute_s,
        "predicted_peak_bytes": int(cand.mem.peak),
        "measured_s": None,
        "measured_peak_bytes": None,
        "error": None,
        "chosen": False,
    }
    measured, err, device = _measure(cand, build, steps, init, timeout_s, agreement)
    verdicts = _agree(err, measured, agreement)
    failed = _failures(verdicts)
    runtime.shutdown(clean=not failed)  # after a failure no barrier and no draining, on every rank alike
    gc.collect()
    if device is not None:
        devices.release_cached_memory(device)
    if failed:
        row["error"] = failed[0][1]  # the lowest failing rank's reason
    else:
        row["measured_s"] = max(v[1][0] for v in verdicts)  # the slowest rank's median sets the step
        row["measured_peak_bytes"] = max(v[1][1] for v in verdicts)
    return row


def _measure(
    cand: Candidate, build: Build, steps: int, init: dict[str, Any], timeout_s: float, agreement: torch.device
) -> tuple[tuple[float, int] | None, str | None, torch.device | None]:
    """((median seconds of the timed steps on this rank, peak bytes of torch tensors — the maximum
    over ranks), None, the grid's device) of the plan ``cand``; (None, why, the device if the grid
    was built) when the build or a step failed. The grid is left built (``_try_one`` shuts it down)."""
    try:
        grid = runtime.init(grid=cand.shape.as_tuple(), overlap=cand.overlap, **init)
    except Exception as e:
        return None, _reason(e, launch.detect().rank), None
    with watchdog.guard(grid.rank, grid.world_size, timeout_s, timeout_s, abort=grid.comm.abort):
        try:
            trial: Trial | None = build(grid, cand)
        except Exception as e:  # a rank that cannot build (out of memory) has joined no step's collective
            built: str | None = _reason(e, grid.rank)
            trial = None
        else:
            built = None
        failed = _failures(_agree(built, None, agreement))
        if failed or trial is None:  # every rank skips the plan before its first step
            return None, failed[0][1], grid.device
        try:
            trial.step()
            if trial.passes is not None:
                peak = peak_bytes(grid, trial.model, trial.optimizer, trial.passes, passes=True)
            else:
                peak = peak_bytes(grid, trial.model, trial.optimizer, trial.step)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                trial.step()
                devices.synchronize(grid.device)
                times.append(time.perf_counter() - t0)
            return (statistics.median(times), peak), None, grid.device
        except Exception as e:  # skipped and reported
            return None, _reason(e, grid.rank), grid.device


def _reason(e: BaseException, rank: int) -> str:
    """Why a plan failed on ``rank``, in a row's few words: the rank, the error's type and message."""
    return f"rank {rank}: {type(e).__name__}: {e}"[:REASON_CHARS]


def _failures(verdicts: list[tuple[str | None, Any]]) -> list[tuple[int, str]]:
    """(rank, reason) of each rank whose verdict (``_agree``) is a failure, lowest rank first."""
    return [(r, v[0]) for r, v in enumerate(verdicts) if v[0] is not None]


def _agree(err: str | None, measured: tuple[float, int] | None, device: torch.device) -> list[tuple[str | None, Any]]:
    """Every rank's (error, measurement), gathered over the world's default group (which outlives
    the trial's grid) through the communication layer, as JSON in a fixed slot per rank: the same
    list on every rank. ``device``: where the default group's collectives take tensors when its
    backend is not the host's."""
    if not dist.is_initialized():
        return [(err, measured)]
    data = json.dumps([err, measured]).encode()
    if len(data) > SLOT:  # a reason of many escaped characters: shortened, still one verdict
        data = json.dumps([err[: SLOT // 8] if err else err, measured]).encode()
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
    return [(e, None if m is None else tuple(m)) for e, m in rows]


def error_pct(row: dict[str, Any], key: str) -> float | None:
    """How far the prediction of ``key`` ("s" or "peak_bytes") was off, in % of the measured value."""
    measured = row[f"measured_{key}"]
    return None if not measured else 100 * (row[f"predicted_{key}"] - measured) / measured


def line(row: dict[str, Any]) -> str:
    """One tried plan in a line: the grid and options, predicted and measured, or why it failed."""
    head = f"{tuple(row['grid'])} {row['options']}: predicted {1e3 * row['predicted_s']:.1f} ms"
    if row["measured_s"] is None:
        return f"{head}; skipped ({row['error']})"
    return f"{head}, measured {1e3 * row['measured_s']:.1f} ms ({error_pct(row, 's'):+.0f}%)"


def table(rows: list[dict[str, Any]]) -> str:
    """The tried plans as the banner and the summary show them: predicted and measured step time and
    peak memory per rank, the error of each prediction, and which plan the run trains with."""
    head = (
        f"{'#':>2} {'grid (x,y,z,d)':<15} {'options':<34} {'pred ms':>8} {'meas ms':>8} {'err':>5} "
        f"{'pred MiB':>9} {'meas MiB':>9} {'err':>5}  "
    )
    out = [head, "-" * len(head)]
    for r in rows:
        mark = "chosen" if r["chosen"] else ("" if r["measured_s"] is not None else f"skipped: {r['error']}")
        if r["measured_s"] is None:
            measured = f"{'-':>8} {'-':>5} {r['predicted_peak_bytes'] / 2**20:>9.1f} {'-':>9} {'-':>5}"
        else:
            measured = (
                f"{1e3 * r['measured_s']:>8.1f} {error_pct(r, 's'):>+4.0f}% "
                f"{r['predicted_peak_bytes'] / 2**20:>9.1f} {r['measured_peak_bytes'] / 2**20:>9.1f} "
                f"{error_pct(r, 'peak_bytes'):>+4.0f}%"
            )
        out.append(
            f"{r['rank']:>2} {str(tuple(r['grid'])):<15} {r['options'][:34]:<34} {1e3 * r['predicted_s']:>8.1f} "
            f"{measured}  {mark}"
        )
    recorded = " (recorded by the first launch; not tried again)" if rows and rows[0].get("recorded") else ""
    return f"plans tried (--try){recorded}; err = (predicted − measured) / measured\n" + "\n".join(out)


def say(text: str) -> None:
    """A line of the trial's progress on stderr, as ``axon4d: ...``."""
    print(f"axon4d: {text}", file=sys.stderr, flush=True)
