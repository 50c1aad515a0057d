"""What one price is of: a workload on one grid shape of one machine, with an overlap policy, a
recomputation mode and the memory options of a step (docs/design.md §6).

The options besides the grid, each priced where its cost lands:

- ``micro_batches`` k: the step's batch runs as k micro-batches accumulated into one update (the
  training job's ``--micro-batches``; ``axon4d.overlap.accumulating``): activations of one
  micro-batch are live at a time; every collective of the layers and context parallelism runs once
  per micro-batch except the data-axis gradient reductions (``walk.ONCE_PER_STEP``), which run
  once per step, as does the optimizer (``cost``; ``memory``), and, under keep-for-backward, the
  weight all-gathers over z (E10f) of the layers outside blocks under full recomputation: the
  first micro-batch's blocks are carried to the others (``layers.carried``).
- ``zero``: the optimizer sharded over data (``axon4d.shard_optimizer``, ``--zero``): 1 shards
  the optimizer state and fp32 master weights; 2 also the gradients, reduce-scattered over data
  instead of all-reduced; both all-gather the updated parameters over data once per step.
- ``offload``: how many blocks' saved activations move to host memory during the forward and
  come back for their backward (``Transformer(offload=)``, ``--offload``).
- ``fp8_gather``: the weight all-gathers over z (E10) move e4m3 bytes and a scale per shard
  (``precision="bf16-fp8-gather"``). The step's precision is the workload's with FP8 gathers
  (``step_precision``): "bf16-fp32-reduce" becomes "bf16-fp8-gather"; "bf16", whose gradient
  reductions are bf16, has no preset with FP8 gathers and a float32 workload no 16-bit weights to
  gather (ValueError for both: ``fp8_gathers_allowed``). A workload whose precision is
  "bf16-fp8-gather" gathers FP8 already: its scenarios on G_z > 1 have ``fp8_gather`` True
  whatever was given (False is the default, not a request; ``axon4d plan`` refuses
  ``--fp8-gather off`` with it).

A ``Scenario`` is built once per candidate grid (``candidate.evaluate``) and every pricing function
takes it (``layers``, ``recompute``, ``cost``) instead of the five values it is made of. It also
holds what every price of it needs from the workload — the tokens on a rank, the layer kinds, the
collectives outside them, the rank's parameter count — computed on first use and kept.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from axon4d.config import ModelConfig
from axon4d.grid import rules
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Collective
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import FP8, NAMED, Precision
from axon4d.options.recompute_mode import check_recompute
from axon4d.plan import fp8 as fp8_plan
from axon4d.plan import moe_cost, moe_placement
from axon4d.plan.machine import Machine
from axon4d.plan.persistent import local_param_count
from axon4d.plan.workload import LinearSpec, Workload

#: ZeRO stages the planner prices (``Scenario.zero``)
ZERO_STAGES = (0, 1, 2)


def check_options(wl: Workload, micro_batches: int, zero: int, offload: int, fp8_gather: bool) -> None:
    """Refuse options no step of ``wl`` can take, naming the value and what would work."""
    rules.count(micro_batches, "micro_batches", example=4)
    if wl.batch % micro_batches:
        raise ValueError(
            f"micro_batches = {micro_batches} does not divide the batch of {wl.batch} sequences; use a divisor "
            f"of it, e.g. {max(d for d in range(1, micro_batches + 1) if wl.batch % d == 0)}"
        )
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero = {zero!r}: use one of {ZERO_STAGES} (0: the optimizer unsharded)")
    if isinstance(offload, bool) or not isinstance(offload, int) or not 0 <= offload <= wl.model.n_layers:
        raise ValueError(
            f"offload = {offload!r} blocks: give a whole number of blocks from 0 to n_layers = {wl.model.n_layers}"
        )
    if fp8_gather and wl.element_size != 2:
        raise ValueError(
            f"fp8_gather with dtype {wl.dtype}: FP8 weight gathers restore 16-bit weights; use dtype bfloat16"
        )
    if fp8_gather:
        step_precision(wl, fp8_gather)  # refuses a preset no FP8-gathering preset is made from


def step_precision(wl: Workload, fp8_gather: bool) -> Precision:
    """The precision a step of ``wl`` runs in (what its collectives move): the workload's, with FP8
    weight gathers where ``fp8_gather`` (module docstring: "bf16-fp32-reduce" becomes
    "bf16-fp8-gather"); FP8 gathers in a precision that computes in fp32 are a ValueError naming it."""
    precision = wl.dtypes
    if not fp8_gather:
        return precision
    if not precision.mixed:  # check_options refuses it first, naming the dtype
        raise ValueError(f"fp8_gather with precision {wl.preset!r}: FP8 gathers restore 16-bit weights")
    if not fp8_gathers_allowed(wl):
        raise ValueError(
            f"fp8_gather with precision {wl.preset!r}: FP8 weight gathers are the preset bf16-fp8-gather, which "
            "reduces gradients in fp32; no preset gathers in FP8 beside bf16 reductions. Use precision "
            "bf16-fp32-reduce (FP8 gathers searched) or bf16-fp8-gather, or fp8_gather=False"
        )
    return dataclasses.replace(precision, gather=FP8)


#: the presets a step may run with FP8 weight gathers (what they become: "bf16-fp8-gather"; "bf16-fp8",
#: whose GEMMs are FP8 too, gathers in FP8 already)
FP8_GATHER_PRESETS = ("bf16-fp32-reduce", "bf16-fp8-gather", "bf16-fp8")


def fp8_gathers_allowed(wl: Workload) -> bool:
    """Whether a step of ``wl`` may gather its weights in FP8: its preset becomes the runnable
    ``bf16-fp8-gather`` with them (``FP8_GATHER_PRESETS``); not fp32 (nothing to restore to 16
    bits) nor bf16 (its gradient reductions are bf16: no preset joins them with FP8 gathers)."""
    return wl.preset in FP8_GATHER_PRESETS


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One price's inputs: ``workload`` on ``shape`` of ``machine``, with the ``overlap`` policy the
    scheduler runs and the ``recompute`` mode (docs/design.md §5) of the blocks."""

    workload: Workload
    shape: GridShape
    machine: Machine
    overlap: OverlapPolicy = OverlapPolicy()
    recompute: str = "none"
    micro_batches: int = 1
    zero: int = 0
    offload: int = 0  # blocks whose saved activations live in host memory
    fp8_gather: bool = False

    def __post_init__(self) -> None:
        if self.workload.accelerator != self.machine.accelerator:  # torch's kernels are the machine's device's
            object.__setattr__(
                self, "workload", dataclasses.replace(self.workload, accelerator=self.machine.accelerator)
            )
        check_recompute(self.recompute)
        check_options(self.workload, self.micro_batches, self.zero, self.offload, self.fp8_gather)
        fp8_plan.check(self.machine, self.workload.preset)  # FP8 GEMMs only where the machine has them
        if self.workload.dtypes.gather == FP8 and self.shape.z > 1:  # the precision gathers in FP8
            object.__setattr__(self, "fp8_gather", True)  # frozen: set once, here

    @cached_property
    def precision(self) -> Precision:
        """What the step's collectives move (``step_precision``: the workload's, FP8 gathers or not)."""
        return step_precision(self.workload, self.fp8_gather)

    @property
    def precision_name(self) -> str:
        """``precision``'s name in ``axon4d.options.precision.NAMED``; "bf16 + fp8 gathers" for the one
        combination without a name (bf16 reductions with FP8 gathers)."""
        return next((n for n, p in NAMED.items() if p == self.precision), "bf16 + fp8 gathers")

    def micro(self) -> Scenario:
        """One micro-batch of this step as a step of its own: the workload's batch divided by
        ``micro_batches`` (which the validity rules then see), every other input the same."""
        if self.micro_batches == 1:
            return self
        wl = dataclasses.replace(self.workload, batch=self.workload.batch // self.micro_batches)
        return dataclasses.replace(self, workload=wl, micro_batches=1)

    def kinds(self) -> list[tuple[Scenario, float]]:
        """This step as steps of one block kind each, with each kind's share of the blocks
        (``Workload.kinds``): [(self, 1.0)] where every block is of one kind. Under FP8 GEMMs each
        layer kind runs FP8 in every block or in none (the runtime's ``--bf16-layers``): the kinds'
        steps take the choice of the whole model's layers of that kind (``fp8.kind_choices`` on one
        micro-batch, as the step is priced)."""
        kinds = self.workload.kinds()
        if len(kinds) == 1:
            return [(self if kinds[0][0] is self.workload else dataclasses.replace(self, workload=kinds[0][0]), 1.0)]
        decided: tuple[tuple[str, bool], ...] = ()
        if self.workload.preset == fp8_plan.PRESET:
            decided = tuple((k, c[0]) for k, c in fp8_plan.kind_choices(self.micro()).items())
        return [
            (dataclasses.replace(self, workload=dataclasses.replace(wl, decided_kinds=decided)), share)
            for wl, share in kinds
        ]

    def options(self) -> dict[str, object]:
        """The step's options as the planner shows them (``candidate.Candidate.to_json``)."""
        return {
            "recompute": self.recompute,
            "micro_batches": self.micro_batches,
            "zero": self.zero,
            "offload": self.offload,
            "fp8_gather": self.fp8_gather,
        }

    @property
    def model(self) -> ModelConfig:
        return self.workload.model

    @property
    def world(self) -> int:
        return self.shape.world_size

    @property
    def element_size(self) -> int:
        return self.workload.element_size

    @cached_property
    def tokens(self) -> int:
        """b: tokens on one rank (``Workload.local_tokens``)."""
        return self.workload.local_tokens(self.shape)

    @cached_property
    def linears(self) -> tuple[LinearSpec, ...]:
        """Every linear layer kind of a step, in forward order (``Workload.linears``)."""
        return tuple(self.workload.linears())

    @cached_property
    def edge_collectives(self) -> tuple[Collective, ...]:
        """The step's collectives outside the linear layers (``Workload.edge_collectives``)."""
        return tuple(self.workload.edge_collectives(self.shape, self.zero))

    @cached_property
    def context_collectives(self) -> tuple[Collective, ...]:
        """Context parallelism's key/value collectives (``Workload.context_collectives``)."""
        return tuple(self.workload.context_collectives(self.shape))

    @cached_property
    def moe_chunks(self) -> int:
        """Chunks each y share of an MoE layer is dispatched in (``moe_placement.moe_chunks``; 1 without MoE)."""
        if not self.model.moe:
            return 1
        return moe_placement.moe_chunks(
            self.model,
            self.tokens,
            self.shape,
            self.element_size,
            self.overlap,
            self.machine.accelerator,
            self.workload.expert_layout,
        )

    @cached_property
    def moe_collectives(self) -> tuple[Collective, ...]:
        """One MoE layer's collectives in a forward + backward (``moe_cost.layer_collectives``; none
        without MoE): every block issues them."""
        if not self.model.moe:
            return ()
        wl = self.workload
        return tuple(
            moe_cost.layer_collectives(
                self.model, self.tokens, self.shape, self.element_size, self.moe_chunks, wl.imbalance, wl.expert_layout
            )
        )

    @cached_property
    def params(self) -> int:
        """Parameter elements one rank holds (``persistent.local_param_count``)."""
        return local_param_count(self.workload, self.shape)
