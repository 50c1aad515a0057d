"""``axon4d train --grid auto``: the run's ends of the planner's one seam (docs/planner.md).

The planner searches the grid and the step options together (``axon4d.plan.search.plan``):
recomputation, micro-batches, ZeRO stage, activation offload, FP8 weight gathers and context
parallelism. With ``--grid auto`` every rank builds the same question from the run's config before
any process group exists — a plain ``axon4d.plan.job.JobRequest`` (``request``) — and asks it once
(``axon4d.plan.job.plan_job``: a deterministic search, the same answer everywhere; rank 0 prints
it); the run takes the ``JobPlan`` that comes back (``apply``):

- an option left at its default is the planner's to choose; one given on the command line with
  another value is pinned, and ``--pin`` pins named options at whatever value they have, defaults
  included (``--pin recompute,zero`` keeps ``none`` and 0);
- the step's batch is ``--batch-size`` × ``--micro-batches``; when the planner chooses k
  micro-batches, the run accumulates k micro-batches of batch/k sequences (the same batch per step);
- offloading n blocks offloads the first n (``axon4d.memory.offload``: their backward comes last);
- FP8 gathers are chosen only under ``--precision auto`` on an accelerator (they need 16-bit
  weights; the run's precision becomes ``bf16-fp8-gather``);
- under ``--precision bf16-fp8`` (FP8 GEMMs, chosen by the user) the layer kinds the plan runs in
  bf16 — where FP8 does not fit or is priced slower on the chosen grid — become ``--bf16-layers``;
- an MoE model's expert layout (``--expert-layout``; ``axon4d.grid.expert_layout``) is searched with
  the grid unless given, and the layout the plan was priced with is the one the run builds;
- the grid and the overlap knobs the planner priced the plan with are the ones built.

Which of the plan's candidates the run applies — its best, or under ``--try N`` the fastest
measured of its N fastest fitting ones — is ``axon4d.train.trial``'s. On a named grid nothing is
chosen: the options are the flags' values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from axon4d.grid import launch
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.memory.offload import offload_blocks, parse_offload
from axon4d.options.precision import AUTO, resolve
from axon4d.plan.candidate import Candidate
from axon4d.plan.fp8 import PRESET as FP8_PRESET
from axon4d.plan.job import FIRST_CHOICE_TOP, JobPlan, JobRequest
from axon4d.plan.options import AUTO_OPTION
from axon4d.train.config import TrainConfig
from axon4d.train.fields import FP8_KINDS, PLANNED

#: what a field holds when the user gave nothing (TrainConfig's defaults)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def pinned(cfg: TrainConfig) -> set[str]:
    """The options the planner may not choose: those named by ``--pin`` and those given a value
    other than their default (fp8 gathers: pinned unless --precision is auto)."""
    out = {name.strip().replace("-", "_") for name in cfg.pin.split(",") if name.strip()}
    for name in PLANNED:
        if name == "fp8_gather":
            if cfg.precision != AUTO:
                out.add(name)
        elif name == "fp8_dispatch":  # a given layout says how its rows travel
            if cfg.expert_layout:
                out.add(name)
        elif getattr(cfg, name) != _DEFAULTS[name]:
            out.add(name)
    return out


def question(cfg: TrainConfig, accelerator: bool) -> dict[str, Any]:
    """The step options this run asks the planner for (``JobRequest``'s): ``AUTO_OPTION`` for the
    planner's, else the pinned value."""
    free = set(PLANNED) - pinned(cfg)
    if cfg.hf:
        free.discard("offload")  # a Hugging Face model has no axon4d blocks to offload from
        free.discard("context_parallel_axes")  # and splits its sequences over z only
    if not accelerator:
        free.discard("fp8_gather")  # on the host the run computes in fp32: no 16-bit weights to gather in FP8

    def ask(name: str, value: Any) -> Any:
        return AUTO_OPTION if name in free else value

    offload = len(_offload_indices(cfg)) if cfg.offload else 0
    fp8 = cfg.precision == "bf16-fp8-gather"
    return {
        "recompute": ask("recompute", cfg.recompute),
        "micro_batches": ask("micro_batches", cfg.micro_batches),
        "zero": ask("zero", cfg.zero),
        "offload": ask("offload", offload),
        # pinned on: the mode --context-parallel-mode names, or both searched where it was left at its default
        "context_parallel": ask("context_parallel", _split(cfg)),
        "context_parallel_axes": ask("context_parallel_axes", cfg.context_parallel_axes),
        "fp8_gather": ask("fp8_gather", fp8),
        "expert_layout": ask("expert_layout", cfg.expert_layout or str(ExpertLayout())),  # pinned "": the default
        # the layout's own (given, or the default's: no FP8) unless the planner may choose it
        "fp8_dispatch": ask("fp8_dispatch", ExpertLayout.parse(cfg.expert_layout or None).fp8_dispatch),
    }


def _split(cfg: TrainConfig) -> bool | str:
    """What a pinned ``--context-parallel`` asks the planner (``plan(context_parallel=)``): False; the
    mode ``--context-parallel-mode`` names when given; True (either mode) when it was left as it is."""
    if not cfg.context_parallel:
        return False
    return cfg.context_parallel_mode if cfg.context_parallel_mode != _DEFAULTS["context_parallel_mode"] else True


def _offload_indices(cfg: TrainConfig) -> tuple[int, ...]:
    """The blocks ``--offload`` names (``axon4d.memory.offload``)."""
    return offload_blocks(parse_offload(cfg.offload), cfg.model_config().n_layers)


def request(cfg: TrainConfig, accelerator: bool, top: int = FIRST_CHOICE_TOP) -> JobRequest:
    """What this run asks the planner: the model, the job's world size, the step's batch
    (``--batch-size`` × ``--micro-batches``), the precision the run will compute in, each step option
    free (``AUTO_OPTION``) or pinned (``question``), the machine and the correction of its prices
    (``--machine``, ``--correction``), ``--async-save``, and the ``top`` fastest fitting plans it
    wants (``axon4d.train.trial.plans_wanted``)."""
    info = launch.detect()
    return JobRequest(
        model=cfg.model_config(),
        world=info.world_size,
        batch=cfg.batch_size * cfg.micro_batches,
        precision=resolve(cfg.precision, accelerator),  # what its collectives move (Workload.precision)
        machine=cfg.machine,
        correction=cfg.correction,
        async_save=cfg.async_save,
        top=top,
        rank=info.rank,
        **question(cfg, accelerator),
    )


def apply(cfg: TrainConfig, job: JobPlan, choice: Candidate | None = None) -> TrainConfig:
    """``cfg`` with the grid and the step options of the plan ``job``'s candidate ``choice`` (None:
    its best) (module docstring): k planned micro-batches of batch/k sequences, the first n blocks
    offloaded, FP8 gathers as the precision where --precision auto left them free, and under FP8
    GEMMs the plan's bf16 layer kinds unless --bf16-layers names some; an MoE model's expert layout
    the plan's."""
    best = job.best if choice is None else choice
    asked = job.request  # which options were the planner's to choose
    step_batch = cfg.batch_size * cfg.micro_batches
    k = int(best.option("micro_batches"))
    blocks = int(best.option("offload"))
    changes: dict[str, Any] = {
        "recompute": best.recompute,
        "zero": int(best.option("zero")),
        "offload": ",".join(str(i) for i in range(blocks)) if blocks else "",
        "context_parallel": bool(best.context_parallel),
        "context_parallel_mode": best.context_mode or _DEFAULTS["context_parallel_mode"],
        "context_parallel_axes": best.context_axes or _DEFAULTS["context_parallel_axes"],
        "grid": ",".join(str(s) for s in best.shape.as_tuple()),
        "try_plans": 0,  # a named grid: nothing left to try (axon4d.train.trial) nor to price
        "correction": "",
    }
    if asked.micro_batches == AUTO_OPTION:
        changes.update(micro_batches=k, batch_size=step_batch // k)
    if asked.fp8_gather == AUTO_OPTION and best.option("fp8_gather"):  # only a free --precision auto
        changes["precision"] = "bf16-fp8-gather"
    if best.expert_layout:  # an MoE model: the layout the plan was priced with (the pinned one, if pinned)
        changes["expert_layout"] = best.expert_layout
    if asked.precision == FP8_PRESET and not cfg.bf16_layers:
        changes["bf16_layers"] = ",".join(job.bf16_layers(best, FP8_KINDS))
    return dataclasses.replace(cfg, **changes)
