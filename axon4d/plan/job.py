"""The training job's one seam into the planner: a ``JobRequest`` in, a ``JobPlan`` out
(``plan_job``; docs/planner.md#using-it).

``axon4d train --grid auto`` builds a ``JobRequest`` from its config (``axon4d.train.planned.request``):
plain data — the model, the world size, the step's batch, the precision it computes in, each step
option (and an MoE model's expert layout) pinned to a value or left ``AUTO_OPTION`` for the search,
the machine and the correction of its prices. ``plan_job`` answers it with one deterministic search
(every rank alike; rank 0 prints the choice, ``axon4d.plan.auto.ranked``), and the job applies the
``JobPlan`` it gets back (``axon4d.train.planned.apply``): its best candidate, or under ``--try N``
the fastest measured of its ``fitting`` ones (``axon4d.train.trial``). Everything the job needs of the planner is on the
plan: the candidates, the machine's own name (``correction.json`` scales its prices), and under
FP8 GEMMs the layer kinds a candidate runs in bf16 (``bf16_layers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from axon4d.config import ModelConfig
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.plan import correction
from axon4d.plan import fp8 as fp8_plan
from axon4d.plan.auto import default_machine, ranked
from axon4d.plan.blocks import layer_kind
from axon4d.plan.candidate import Candidate
from axon4d.plan.machine import Machine
from axon4d.plan.options import AUTO_OPTION
from axon4d.plan.result import PlanResult
from axon4d.plan.scenario import Scenario
from axon4d.plan.search import load_machine
from axon4d.plan.workload import Workload

#: the fastest fitting plans a job that takes the planner's first choice asks for (and rank 0 prints)
FIRST_CHOICE_TOP = 3


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """What a training job asks the planner: plain data, the same on every rank."""

    model: ModelConfig
    """The model to train."""
    world: int
    """The job's ranks."""
    batch: int
    """The step's batch in sequences (the micro-batches split it)."""
    precision: str
    """The precision preset the job computes in: what its collectives move (``Workload.precision``)."""
    recompute: str = AUTO_OPTION
    """Each step option: ``AUTO_OPTION`` for the search to choose, or the value the job pins."""
    micro_batches: int | str = AUTO_OPTION
    zero: int | str = AUTO_OPTION
    offload: int | str = AUTO_OPTION
    context_parallel: bool | str = AUTO_OPTION
    context_parallel_axes: str = AUTO_OPTION
    """The axes a split sequence may span: "z", "z,data" (hierarchical) or ``AUTO_OPTION`` (both)."""
    fp8_gather: bool | str = AUTO_OPTION
    expert_layout: str = AUTO_OPTION
    """An MoE model's expert layout (``axon4d.grid.expert_layout``, e.g. "ep=world,tp=1"): ``AUTO_OPTION``
    searches every layout each grid admits (the chosen one is each candidate's ``expert_layout``)."""
    fp8_dispatch: bool | str = AUTO_OPTION
    """Whether the searched layouts send their rows to the experts in FP8: True, False or
    ``AUTO_OPTION`` (both searched); a pinned layout says it itself."""
    machine: str = ""
    """A shipped machine's name or a machine file's path; "": ``$AXON4D_MACHINE`` (``default_machine``)."""
    correction: str = ""
    """A ``correction.json`` whose factors scale the machine's prices (``axon4d.plan.correction``); "": none."""
    async_save: bool = False
    """The job keeps a pinned host snapshot for asynchronous checkpoints (it counts against the node's host memory)."""
    top: int = FIRST_CHOICE_TOP
    """The fastest fitting plans wanted (``--try N``: N), ranked and printed."""
    rank: int = 0
    """This process's rank: rank 0 prints the plan."""


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The planner's answer to a ``JobRequest``: every grid it priced, ranked, on the machine it priced them on."""

    request: JobRequest
    """The question it answers (which options were the planner's to choose)."""
    result: PlanResult
    """The search's result: the ranked candidates, the machine (with the correction applied), the workload."""

    @property
    def best(self) -> Candidate:
        """The fastest fitting candidate: its ``shape`` and ``overlap`` are the grid to build, its options the step's."""
        return self.result.best

    @property
    def candidates(self) -> list[Candidate]:
        """Every priced candidate: fitting ones by step time, then the others."""
        return self.result.candidates

    @property
    def fitting(self) -> list[Candidate]:
        """The ``request.top`` fastest fitting candidates, fastest first (``--try N``'s plans)."""
        return [c for c in self.candidates if c.fits][: self.request.top]

    @property
    def machine_name(self) -> str:
        """The priced machine's own name, without the correction's mark (what ``correction.json`` scales)."""
        return self.result.machine.name.removesuffix(correction.SUFFIX)

    def bf16_layers(self, choice: Candidate, kinds: Sequence[str]) -> list[str]:
        """Under FP8 GEMMs (precision ``bf16-fp8``): those of the layer ``kinds`` the plan ``choice``
        runs in bf16 — where a layer's block does not fit the FP8 kernel or FP8 with its casts is
        priced slower on its grid (``axon4d.plan.fp8.kind_choices``, on one micro-batch as the step is
        priced)."""
        req = self.request
        cp = bool(choice.context_parallel)
        layout = ExpertLayout.parse(choice.expert_layout or None)
        wl = Workload(
            req.model,
            req.batch,
            "bfloat16",
            precision=fp8_plan.PRESET,
            context_parallel=cp,
            context_mode=choice.context_mode or "all-gather",
            context_axes=choice.context_axes or "z",
            expert_layout=layout,
        )
        opts = choice.options
        sc = Scenario(
            wl,
            choice.shape,
            self.result.machine,
            choice.overlap,
            choice.recompute,
            micro_batches=int(opts["micro_batches"]),
            zero=int(opts["zero"]),
            offload=int(opts["offload"]),
            fp8_gather=bool(opts["fp8_gather"]),
        ).micro()
        chosen = fp8_plan.kind_choices(sc, [s for s in wl.linears() if layer_kind(s.name) in kinds])
        return [name for name in kinds if name in chosen and not chosen[name][0]]


def plan_job(request: JobRequest) -> JobPlan:
    """The planner's plan for ``request``: one search of every grid of ``request.world`` ranks with
    the free step options (an MoE model's expert layouts too, unless pinned) and the overlap knobs
    (``overlap="auto"``), priced on the request's machine (``priced_machine``); rank 0 prints the
    best and the top ``request.top``. The same on every rank; ``ValueError`` (every rank alike) when
    the machine or its correction is refused or no plan fits."""
    result = ranked(
        request.world,
        model=request.model,
        batch=request.batch,
        machine=priced_machine(request),
        precision=request.precision,
        overlap="auto",
        rank=request.rank,
        top=request.top,
        recompute=request.recompute,
        micro_batches=request.micro_batches,
        zero=request.zero,
        offload=request.offload,
        context_parallel=request.context_parallel,
        context_axes=request.context_parallel_axes,
        fp8_gather=request.fp8_gather,
        expert_layout=request.expert_layout,
        fp8_dispatch=request.fp8_dispatch,
        async_save=request.async_save,
    )
    return JobPlan(request, result)


def priced_machine(request: JobRequest) -> Machine | str | None:
    """The machine ``request``'s plans are priced on: ``request.machine`` (None: ``$AXON4D_MACHINE``),
    its prices scaled by the factors of ``request.correction`` where one is given
    (``axon4d.plan.correction``). ``ValueError`` (on every rank alike) when that file is not a
    correction, or was measured on another number of ranks (its factors scale that world's prices
    only)."""
    if not request.correction:
        return request.machine or None
    corr = correction.load(request.correction)
    if corr.world != request.world:
        raise ValueError(
            f"--correction {request.correction!r} was measured on {corr.world} ranks, this job has {request.world}: its "
            f"factors scale the prices of {corr.world}-rank steps only; run --try N on this job to measure one"
        )
    return correction.apply(load_machine(request.machine or default_machine()), corr)
