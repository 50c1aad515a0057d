"""``axon4d train --grid auto --try N``: plan, then measure (docs/planner.md#trying-the-top-plans).

No cost model is right on every cluster. With ``--try N`` the run asks the planner for its N
fastest fitting plans (``plans_wanted``: the ``top`` of the run's one ``JobRequest``) and tries
each of the ``JobPlan``'s ``fitting`` ones in turn on the job's ranks (``choose``,
``axon4d.trials.run``): ``axon4d.init`` with the
plan's grid, overlap knobs and (an MoE model's) expert layout, the model with its step options, the optimizer, the data (``_trial``);
``axon4d.trials.WARMUP`` untimed steps (the second tracked for its peak memory) and ``--try-steps``
timed ones; torn down (the model, the optimizer and their buffers dropped, the grid's process groups
destroyed, the allocator's cache released); ``--try-rounds`` rounds of that, round-robin over
the plans. The run trains with the plan ``axon4d.trials.choose`` picks (the planner's first, unless
another is faster beyond the rounds' spread), built afresh by the training loop. A plan whose build
or steps fail on any rank (out of memory mid-step, a refused option) is skipped with its reason, on
every rank alike, within seconds (``axon4d.reliability.fence``); when no plan runs, every rank
raises the same error listing the reasons.

The trial trains nothing the run keeps: the run's data is indexed by step from 0, ``axon4d.init``
seeds it afresh and the host's random state is restored after the trial, so its loss curve is the
one a run pinned to the chosen grid and options draws.

Rank 0 prints the trial's cost before it starts (plans, steps, predicted seconds) and a line per
try as it ends, and writes ``trials.json`` (the rows: predicted and measured step time — each
round's and their median — and peak memory, the error, the choice; the rule; the interleaved repeat
table, ``axon4d.trials.repeats``) and ``correction.json`` (``axon4d.plan.correction``, for ``axon4d
plan --correction`` and ``axon4d train --correction``) to the output directory. A resumed run
takes the plan recorded in ``trials.json`` (``--retry``: tries again).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable
from typing import Any

from axon4d import checkpoint, trials
from axon4d.plan import correction
from axon4d.plan.candidate import Candidate
from axon4d.plan.job import FIRST_CHOICE_TOP, JobPlan
from axon4d.train import outdir, planned
from axon4d.train.batches import accumulate_one, make_data, step_batches
from axon4d.train.config import TrainConfig
from axon4d.train.optim import clip, make_optimizer

TRIALS_FILE = "trials.json"
CORRECTION_FILE = "correction.json"

Build = Callable[[TrainConfig, Any, Any], Any]  # (cfg, model config, grid) -> model
Step = Callable[..., tuple[dict[str, Any], bool, str | None]]  # the loop's step: (record, finite, first bad)


def plans_wanted(cfg: TrainConfig) -> int:
    """How many of the planner's fastest fitting plans the run asks for (``JobRequest.top``):
    ``--try N``'s N where it tries them, or takes the one its first launch tried and recorded
    (``trials.json``); else — no ``--try``, or a resumed run whose first launch did not try —
    ``FIRST_CHOICE_TOP``, as that launch asked."""
    if cfg.try_plans and (not _takes_record(cfg) or os.path.exists(_record_path(cfg))):
        return cfg.try_plans
    return FIRST_CHOICE_TOP


def choose(
    cfg: TrainConfig, job: JobPlan, resolve: Callable[[TrainConfig], str], build: Build, step: Step
) -> tuple[Candidate, list[dict[str, Any]]]:
    """Which candidate of the planner's ``job`` the run applies (``planned.apply``), and the rows
    of the plans tried: without ``--try`` the plan's best and no rows; a resumed run (a checkpoint
    in the output directory, not ``--retry``) the plan ``trials.json`` records (``_recorded``); else
    the fastest measured of ``job.fitting``, each built, stepped and torn down (``_try_all``), the
    rows written to ``trials.json`` and the correction they fit to ``correction.json``.

    ``resolve`` gives a config's precision as the run will compute it; ``build`` and ``step`` are
    the training loop's model and step. ``ValueError`` when the recorded plan is no longer among
    the planner's; ``RuntimeError`` when every tried plan failed."""
    if not cfg.try_plans:
        return job.best, []
    if _takes_record(cfg):
        return _recorded(cfg, job)
    fitting = job.fitting
    first = planned.apply(cfg, job, fitting[0])
    outdir.check_out_dir(dataclasses.replace(first, precision=resolve(first)), first.model_config())  # refused now
    rows = _try_all(cfg, job, fitting, resolve, build, step)
    chosen = trials.choose(rows, f"--try {cfg.try_plans}", "pin a grid with --grid x,y,z,data")
    if job.request.rank == 0:
        prior = correction.load(cfg.correction) if cfg.correction else None
        _write(cfg.out_dir, rows, job.machine_name, job.request.world, prior)
    return fitting[chosen["rank"] - 1], rows


def _takes_record(cfg: TrainConfig) -> bool:
    """Whether the run takes the plan its first launch chose rather than trying again: it resumes
    (``--resume`` not never, a checkpoint in the output directory) and ``--retry`` is not given."""
    resumed = cfg.resume != "never" and checkpoint.latest(os.path.join(cfg.out_dir, "checkpoints")) is not None
    return resumed and not cfg.retry


def _record_path(cfg: TrainConfig) -> str:
    """Where the run's ``trials.json`` lies."""
    return os.path.join(cfg.out_dir, TRIALS_FILE)


def _try_all(
    cfg: TrainConfig,
    job: JobPlan,
    fitting: list[Candidate],
    resolve: Callable[[TrainConfig], str],
    build: Build,
    step: Step,
) -> list[dict[str, Any]]:
    """Try each plan of ``fitting`` (candidates of ``job``) in turn (``axon4d.trials.run``: built on
    its grid with the run's seed, transport and the plan's precision and expert layout, stepped, torn
    down); their rows, in the planner's order."""

    def planned_cfg(cand: Candidate) -> TrainConfig:
        run = planned.apply(cfg, job, cand)
        return dataclasses.replace(run, precision=resolve(run))

    def init(cand: Candidate) -> dict[str, Any]:
        run = planned_cfg(cand)
        layout = run.expert_layout or None  # an MoE model's: the layout the plan was priced with
        init = {"seed": run.seed, "precision": run.precision_spec(), "comm": run.comm, "timeout_s": run.startup_timeout}
        return {**init, "expert_layout": layout}

    def built(grid: Any, cand: Candidate) -> trials.Trial:
        return _trial(planned_cfg(cand), grid, build, step)

    label = f"--try {cfg.try_plans}"
    steps, rounds = cfg.try_steps, cfg.try_rounds
    return trials.run(fitting, built, steps=steps, rounds=rounds, init=init, timeout_s=cfg.startup_timeout, label=label)


def _trial(cfg: TrainConfig, grid: Any, build: Build, step: Step) -> trials.Trial:
    """The run's model, optimizer and data for ``cfg`` on ``grid``, stepped as the run steps: step
    i of the trial (counted from 0) on the data and learning rate of the run's step i; the tracked
    step (``Trial.passes``) accumulates its micro-batches as the run does."""
    model = build(cfg, cfg.model_config(), grid)
    opt = make_optimizer(model, cfg, grid)
    data = make_data(cfg, cfg.model_config(), grid)
    counter = itertools.count()

    def one() -> None:
        step(model, opt, data, grid, cfg, next(counter), 1.0)

    def passes(next_pass: Callable[[], None]) -> None:
        batches = step_batches(data, next(counter), cfg)
        for i, full in enumerate(batches):
            if i:
                next_pass()
            accumulate_one(model, full, grid, last=i == len(batches) - 1, parts=len(batches))
        clip(model, cfg, grid)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return trials.Trial(model, opt, one, passes)


def _recorded(cfg: TrainConfig, job: JobPlan) -> tuple[Candidate, list[dict[str, Any]]]:
    """The plan the first launch of a resumed run chose (``trials.json``), among ``job``'s
    candidates, and its rows marked as recorded; without a record (that launch did not try: its
    plan was the planner's first) ``job``'s best. ``ValueError`` when the recorded plan is not
    among the candidates."""
    path = _record_path(cfg)
    if not os.path.exists(path):
        return job.best, []
    with open(path) as f:
        rows = json.load(f)["trials"]
    chosen = next(r for r in rows if r["chosen"])
    for c in job.candidates:
        if list(c.shape.as_tuple()) == chosen["grid"] and c.options_spec() == chosen["options"]:
            if job.request.rank == 0:
                trials.say(f"resumed: the plan tried and chosen before ({path}), not tried again (--retry tries again)")
            return c, [{**r, "recorded": True} for r in rows]
    raise ValueError(
        f"--resume with --try: the plan chosen before ({chosen['grid']}, {chosen['options']}; {path}) is no longer "
        "among the planner's (another machine file or options?); pass --retry to try again, or --grid "
        f"{','.join(str(s) for s in chosen['grid'])} with those options"
    )


def _write(
    out_dir: str, rows: list[dict[str, Any]], machine: str, world: int, prior: correction.Correction | None
) -> None:
    """``trials.json`` and, from the measured plans, ``correction.json`` in ``out_dir``: factors on
    ``machine``'s own prices (with ``prior``, the --correction the plans were priced with, composed
    in: ``correction.compose``)."""
    with open(os.path.join(out_dir, TRIALS_FILE), "w") as f:
        record = {"world": world, "machine": machine, "rule": trials.RULE, "trials": rows}
        json.dump({**record, "repeats": trials.repeats(rows)}, f, indent=1)
    ok = [r for r in rows if r["measured_s"] is not None]
    fitted = correction.fit(machine, world, ok)
    correction.write(os.path.join(out_dir, CORRECTION_FILE), correction.compose(fitted, prior) if prior else fitted)
