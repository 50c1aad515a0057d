"""``axon4d train --grid auto``: the planner's whole plan, applied to the run (docs/planner.md).

The planner searches the grid and the step options together (``axon4d.plan.search.plan``):
recomputation, micro-batches, ZeRO stage, activation offload, FP8 weight gathers and context
parallelism. With ``--grid auto`` every rank asks it the same question before any process group
exists (``axon4d.plan.auto.choose``: a deterministic search, the same answer everywhere; rank 0
prints it) and the run takes the answer:

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
- the grid and the overlap knobs the planner priced the plan with are the ones built.

On a named grid nothing is chosen: the options are the flags' values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from axon4d.grid import launch
from axon4d.memory.offload import offload_blocks, parse_offload
from axon4d.options.precision import AUTO, resolve
from axon4d.plan import correction
from axon4d.plan import fp8 as fp8_plan
from axon4d.plan.auto import choose, default_machine
from axon4d.plan.candidate import Candidate
from axon4d.plan.fp8 import PRESET as FP8_PRESET
from axon4d.plan.machine import Machine
from axon4d.plan.options import AUTO_OPTION
from axon4d.plan.scenario import Scenario
from axon4d.plan.search import load_machine
from axon4d.plan.workload import Workload
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
        elif getattr(cfg, name) != _DEFAULTS[name]:
            out.add(name)
    return out


def question(cfg: TrainConfig, accelerator: bool) -> dict[str, Any]:
    """``choose``'s step options for this run: ``AUTO_OPTION`` for the planner's, else the pinned value."""
    free = set(PLANNED) - pinned(cfg)
    if cfg.hf:
        free.discard("offload")  # a Hugging Face model has no axon4d blocks to offload from
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
        "context_parallel": ask("context_parallel", cfg.context_parallel),
        "fp8_gather": ask("fp8_gather", fp8),
    }


def _offload_indices(cfg: TrainConfig) -> tuple[int, ...]:
    """The blocks ``--offload`` names (``axon4d.memory.offload``)."""
    return offload_blocks(parse_offload(cfg.offload), cfg.model_config().n_layers)


def request(cfg: TrainConfig, accelerator: bool) -> dict[str, Any]:
    """What this run asks the planner (``axon4d.plan.auto.choose``'s arguments but the world size):
    the model, the step's batch (``--batch-size`` × ``--micro-batches``), the machine, the precision
    the run will compute in, and each step option free (``AUTO_OPTION``) or pinned (``question``)."""
    info = launch.detect()
    return {
        "model": cfg.model_config(),
        "batch": cfg.batch_size * cfg.micro_batches,
        "machine": machine(cfg, info.world_size),
        "precision": resolve(cfg.precision, accelerator),  # what its collectives move (Workload.precision)
        "overlap": "auto",
        "rank": info.rank,
        "async_save": cfg.async_save,
        **question(cfg, accelerator),
    }


def machine(cfg: TrainConfig, world: int) -> Machine | str | None:
    """The planner's machine for this run of ``world`` ranks: ``--machine`` (None: ``$AXON4D_MACHINE``),
    its prices scaled by ``--correction``'s factors where one is given (``axon4d.plan.correction``).
    ``ValueError`` (on every rank alike) when the file is not a correction, or was measured on
    another number of ranks (its factors scale that world's prices only)."""
    if not cfg.correction:
        return cfg.machine or None
    corr = correction.load(cfg.correction)
    if corr.world != world:
        raise ValueError(
            f"--correction {cfg.correction!r} was measured on {corr.world} ranks, this job has {world}: its "
            f"factors scale the prices of {corr.world}-rank steps only; run --try N on this job to measure one"
        )
    return correction.apply(load_machine(cfg.machine or default_machine()), corr)


def plan_run(cfg: TrainConfig, accelerator: bool) -> tuple[TrainConfig, Candidate]:
    """Ask the planner for this run's grid and options (every rank alike; rank 0 prints the
    choice) and return the run's config with the chosen options applied (``apply``), and the choice
    (its ``shape`` and ``overlap`` are the grid to build). ``ValueError`` when no plan fits."""
    best = choose(launch.detect().world_size, **request(cfg, accelerator))
    return apply(cfg, best, accelerator), best


def apply(cfg: TrainConfig, best: Candidate, accelerator: bool) -> TrainConfig:
    """``cfg`` with the grid and the step options of the planner's candidate ``best`` (module
    docstring): k planned micro-batches of batch/k sequences, the first n blocks offloaded, FP8
    gathers as the precision where --precision auto left them free."""
    asked = question(cfg, accelerator)
    step_batch = cfg.batch_size * cfg.micro_batches
    k = int(best.option("micro_batches"))
    blocks = int(best.option("offload"))
    changes: dict[str, Any] = {
        "recompute": best.recompute,
        "zero": int(best.option("zero")),
        "offload": ",".join(str(i) for i in range(blocks)) if blocks else "",
        "context_parallel": bool(best.context_parallel),
        "grid": ",".join(str(s) for s in best.shape.as_tuple()),
        "try_plans": 0,  # a named grid: nothing left to try (axon4d.train.trial) nor to price
        "correction": "",
    }
    if asked["micro_batches"] == AUTO_OPTION:
        changes.update(micro_batches=k, batch_size=step_batch // k)
    if asked["fp8_gather"] == AUTO_OPTION and best.option("fp8_gather"):  # only a free --precision auto
        changes["precision"] = "bf16-fp8-gather"
    if resolve(cfg.precision, accelerator) == FP8_PRESET and not cfg.bf16_layers:
        changes["bf16_layers"] = ",".join(bf16_kinds(cfg, best, accelerator))
    return dataclasses.replace(cfg, **changes)


def bf16_kinds(cfg: TrainConfig, best: Candidate, accelerator: bool) -> list[str]:
    """Under ``--precision bf16-fp8``: the block's layer kinds the plan ``best`` runs in bf16 — where
    a layer's block does not fit the FP8 kernel or FP8 with its casts is priced slower on its grid
    (``axon4d.plan.fp8.fp8_layers``, on one micro-batch as the step is priced)."""
    req = request(cfg, accelerator)
    mach = req["machine"] if isinstance(req["machine"], Machine) else load_machine(req["machine"] or default_machine())
    cp = bool(best.context_parallel)
    wl = Workload(req["model"], req["batch"], "bfloat16", precision=FP8_PRESET, context_parallel=cp)
    opts = best.options
    sc = Scenario(
        wl,
        best.shape,
        mach,
        best.overlap,
        best.recompute,
        micro_batches=int(opts["micro_batches"]),
        zero=int(opts["zero"]),
        offload=int(opts["offload"]),
        fp8_gather=bool(opts["fp8_gather"]),
    ).micro()
    chosen = fp8_plan.fp8_layers(sc, [s for s in wl.linears() if s.name in FP8_KINDS])
    return [name for name in FP8_KINDS if name in chosen and not chosen[name][0]]
