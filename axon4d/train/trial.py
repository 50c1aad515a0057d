"""``axon4d train --grid auto --try N``: plan, then measure (docs/planner.md#trying-the-top-plans).

No cost model is right on every cluster. With ``--try N`` the run builds each of the planner's N
fastest fitting plans in turn on the job's ranks — ``axon4d.init`` with the plan's grid and overlap
knobs, the model with its step options, the optimizer, the data — runs ``WARMUP`` untimed steps
(the second tracked for its peak memory, ``axon4d.measure.probe.peak_bytes``) and ``--try-steps``
timed ones, tears it down (the model, the optimizer and their buffers dropped, the grid's process
groups destroyed, the allocator's cache released), and trains with the fastest measured plan, built
afresh by the training loop. A plan whose build or steps fail (out of memory, a refused option) is
skipped with its reason; the ranks agree on each plan's outcome and times in one gather over the
world (``_agree``), so every rank skips and chooses alike. When no plan runs, every rank raises
the same error listing the reasons.

The trial trains nothing the run keeps: the run's data is indexed by step from 0, ``axon4d.init``
seeds it afresh and the host's random state is restored after the trial, so its loss curve is the
one a run pinned to the chosen grid and options draws.

Rank 0 prints the trial's cost before it starts (plans, steps, predicted seconds) and a line per
plan as it ends, and writes ``trials.json`` (the rows: predicted and measured step time and peak
memory, the error, the choice) and ``correction.json`` (``axon4d.plan.correction``, for ``axon4d
plan --correction``) to the output directory. A resumed run takes the plan recorded in
``trials.json`` (``--retry``: tries again).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from axon4d import checkpoint, launch, runtime, watchdog
from axon4d import device as devices
from axon4d.peakmem import peak_bytes
from axon4d.plan import correction
from axon4d.plan.auto import ranked
from axon4d.plan.candidate import Candidate
from axon4d.train import outdir, planned
from axon4d.train.batches import accumulate_one, make_data, step_batches
from axon4d.train.config import TrainConfig
from axon4d.train.optim import clip, make_optimizer

#: untimed steps before the timed ones: the first allocates the optimizer's state, the second is
#: tracked for the peak memory
WARMUP = 2
TRIALS_FILE = "trials.json"
CORRECTION_FILE = "correction.json"
#: the characters of a failed plan's reason kept in its row
REASON_CHARS = 300

Build = Callable[[TrainConfig, Any, Any], Any]  # (cfg, model config, grid) -> model
Step = Callable[..., tuple[dict[str, Any], bool, str | None]]  # the loop's step: (record, finite, first bad)


def choose(
    cfg: TrainConfig, accelerator: bool, resolve: Callable[[TrainConfig], str], build: Build, step: Step
) -> tuple[TrainConfig, Candidate, list[dict[str, Any]]]:
    """The run's config with the plan applied (``planned.apply``), the plan, and the rows of the
    plans tried (none without ``--try``: the planner's first choice, ``planned.plan_run``).

    ``resolve`` gives a config's precision as the run will compute it; ``build`` and ``step`` are
    the training loop's model and step. A resumed run (a checkpoint in the output directory, not
    ``--retry``) takes the plan ``trials.json`` records. ``ValueError`` when no plan fits, or the
    recorded plan is no longer among the planner's; ``RuntimeError`` when every tried plan failed."""
    if not cfg.try_plans:
        run, best = planned.plan_run(cfg, accelerator)
        return run, best, []
    world = launch.detect().world_size
    result = ranked(world, **planned.request(cfg, accelerator), top=cfg.try_plans)
    fitting = [c for c in result.candidates if c.fits][: cfg.try_plans]
    resumed = cfg.resume != "never" and checkpoint.latest(os.path.join(cfg.out_dir, "checkpoints")) is not None
    if resumed and not cfg.retry:
        return _recorded(cfg, accelerator, result.candidates)
    first = planned.apply(cfg, fitting[0], accelerator)
    outdir.check_out_dir(dataclasses.replace(first, precision=resolve(first)), first.model_config())  # refused now
    rows = _try_all(cfg, fitting, accelerator, resolve, build, step)
    ok = [r for r in rows if r["measured_s"] is not None]
    if not ok:
        reasons = "; ".join(f"{r['grid']}: {r['error']}" for r in rows)
        raise RuntimeError(f"--try {cfg.try_plans}: no plan ran ({reasons}); pin a grid with --grid x,y,z,data")
    chosen = min(ok, key=lambda r: (r["measured_s"], r["rank"]))
    chosen["chosen"] = True
    best = fitting[chosen["rank"] - 1]
    if launch.detect().rank == 0:
        _write(cfg.out_dir, rows, result.machine.name, world)
    return planned.apply(cfg, best, accelerator), best, rows


def _try_all(
    cfg: TrainConfig,
    fitting: list[Candidate],
    accelerator: bool,
    resolve: Callable[[TrainConfig], str],
    build: Build,
    step: Step,
) -> list[dict[str, Any]]:
    """Try each plan of ``fitting`` in turn (``_try_one``); their rows, in the planner's order."""
    rank0 = launch.detect().rank == 0
    steps = WARMUP + cfg.try_steps
    if rank0:
        predicted = sum(steps * c.time.step_s for c in fitting)
        _say(
            f"--try {cfg.try_plans}: trying the planner's {len(fitting)} fastest fitting plans, {WARMUP} warm-up + "
            f"{cfg.try_steps} timed steps each ({steps * len(fitting)} steps, {predicted:.2f} s by the planner's "
            "prices, plus building each plan); none is trained on"
        )
    saved_rng = devices.rng_state()
    rows = []
    for i, cand in enumerate(fitting):
        run = planned.apply(cfg, cand, accelerator)
        run = dataclasses.replace(run, precision=resolve(run))
        t0 = time.perf_counter()
        row = _try_one(run, cand, i + 1, build, step)
        rows.append(row)
        if rank0:
            _say(f"trial {i + 1}/{len(fitting)} ({time.perf_counter() - t0:.1f} s): {line(row)}")
    devices.restore_rng(saved_rng)
    return rows


def _try_one(cfg: TrainConfig, cand: Candidate, rank: int, build: Build, step: Step) -> dict[str, Any]:
    """Build ``cand`` (the planner's ``rank``-th plan; ``cfg`` applies it), measure it, tear it
    down; its row, the same on every rank."""
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
    measured, err, device = _measure(cfg, cand, build, step)
    verdicts = _agree(err, measured)
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
    cfg: TrainConfig, cand: Candidate, build: Build, step: Step
) -> tuple[tuple[float, int] | None, str | None, torch.device | None]:
    """((median seconds of the timed steps on this rank, peak bytes of torch tensors — the maximum
    over ranks), None, the grid's device) of the plan ``cand`` built from ``cfg``; (None, why, the
    device if the grid was built) when the build or a step failed: a plan that fails is skipped,
    never fatal. The grid is left built (``_try_one`` shuts it down)."""
    try:
        grid = runtime.init(
            grid=cand.shape.as_tuple(),
            seed=cfg.seed,
            precision=cfg.precision,
            comm=cfg.comm,
            overlap=cand.overlap,
            timeout_s=cfg.startup_timeout,
        )
    except Exception as e:
        return None, _reason(e, launch.detect().rank), None
    # a rank left waiting in a collective another rank will not join ends by the watchdog's deadline
    with watchdog.guard(grid.rank, grid.world_size, cfg.startup_timeout, cfg.startup_timeout, abort=grid.comm.abort):
        try:
            model = build(cfg, cfg.model_config(), grid)
            opt = make_optimizer(model, cfg, grid)
            data = make_data(cfg, cfg.model_config(), grid)
        except Exception as e:  # a rank that cannot build (out of memory) has joined no step's collective
            built: str | None = _reason(e, grid.rank)
        else:
            built = None
        failed = _failures(_agree(built, None))
        if failed:  # every rank skips the plan before its first step
            return None, failed[0][1], grid.device
        try:
            step(model, opt, data, grid, cfg, 0, 1.0)

            def tracked(next_pass: Callable[[], None]) -> None:
                batches = step_batches(data, 1, cfg)
                for i, full in enumerate(batches):
                    if i:
                        next_pass()
                    accumulate_one(model, full, grid, last=i == len(batches) - 1, parts=len(batches))
                clip(model, cfg, grid)
                opt.step()
                opt.zero_grad(set_to_none=True)

            peak = peak_bytes(grid, model, opt, tracked, passes=True)
            times = [step(model, opt, data, grid, cfg, WARMUP + s, 1.0)[0]["step_s"] for s in range(cfg.try_steps)]
            return (statistics.median(times), peak), None, grid.device
        except Exception as e:  # skipped and reported
            return None, _reason(e, grid.rank), grid.device


def _reason(e: BaseException, rank: int) -> str:
    """Why a plan failed on ``rank``, in a row's few words: the rank, the error's type and message."""
    return f"rank {rank}: {type(e).__name__}: {e}"[:REASON_CHARS]


def _failures(verdicts: list[tuple[str | None, Any]]) -> list[tuple[int, str]]:
    """(rank, reason) of each rank whose verdict (``_agree``) is a failure, lowest rank first."""
    return [(r, v[0]) for r, v in enumerate(verdicts) if v[0] is not None]


def _agree(err: str | None, measured: tuple[float, int] | None) -> list[tuple[str | None, Any]]:
    """Every rank's (error, measurement), gathered over the world (the default group, which
    outlives the trial's grid): the same list on every rank."""
    mine = (err, measured)
    if not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [tuple(v) for v in out]


def _recorded(
    cfg: TrainConfig, accelerator: bool, candidates: list[Candidate]
) -> tuple[TrainConfig, Candidate, list[dict[str, Any]]]:
    """The plan the first launch of a resumed run chose (``trials.json``), among the planner's
    ``candidates``; without a record (that launch did not try: its plan was the planner's first),
    ``planned.plan_run``'s."""
    path = os.path.join(cfg.out_dir, TRIALS_FILE)
    if not os.path.exists(path):
        run, best = planned.plan_run(cfg, accelerator)
        return run, best, []
    with open(path) as f:
        rows = json.load(f)["trials"]
    chosen = next(r for r in rows if r["chosen"])
    for c in candidates:
        if list(c.shape.as_tuple()) == chosen["grid"] and c.options_spec() == chosen["options"]:
            if launch.detect().rank == 0:
                _say(f"resumed: the plan tried and chosen before ({path}), not tried again (--retry tries again)")
            return planned.apply(cfg, c, accelerator), c, [{**r, "recorded": True} for r in rows]
    raise ValueError(
        f"--resume with --try: the plan chosen before ({chosen['grid']}, {chosen['options']}; {path}) is no longer "
        "among the planner's (another machine file or options?); pass --retry to try again, or --grid "
        f"{','.join(str(s) for s in chosen['grid'])} with those options"
    )


def _write(out_dir: str, rows: list[dict[str, Any]], machine: str, world: int) -> None:
    """``trials.json`` and, from the measured plans, ``correction.json`` in ``out_dir``."""
    with open(os.path.join(out_dir, TRIALS_FILE), "w") as f:
        json.dump({"world": world, "machine": machine, "trials": rows}, f, indent=1)
    ok = [r for r in rows if r["measured_s"] is not None]
    correction.write(os.path.join(out_dir, CORRECTION_FILE), correction.fit(machine, world, ok))


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


def _say(text: str) -> None:
    print(f"axon4d: {text}", file=sys.stderr, flush=True)
