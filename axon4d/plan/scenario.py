"""What one price is of: a workload on one grid shape of one machine, with an overlap policy and a
recomputation mode (docs/design.md §6).

A ``Scenario`` is built once per candidate grid (``search.evaluate``) and every pricing function
takes it (``layers``, ``recompute``, ``cost``) instead of the five values it is made of. It also
holds what every price of it needs from the workload — the tokens on a rank, the layer kinds, the
collectives outside them, the rank's parameter count — computed on first use and kept.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from axon4d.config import ModelConfig
from axon4d.geometry import Collective
from axon4d.overlap_policy import OverlapPolicy
from axon4d.plan.machine import Machine
from axon4d.plan.memory import local_param_count
from axon4d.plan.workload import LinearSpec, Workload
from axon4d.recompute_mode import check_recompute
from axon4d.shape import GridShape


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One price's inputs: ``workload`` on ``shape`` of ``machine``, with the ``overlap`` policy the
    scheduler runs and the ``recompute`` mode (docs/design.md §5) of the blocks."""

    workload: Workload
    shape: GridShape
    machine: Machine
    overlap: OverlapPolicy = OverlapPolicy()
    recompute: str = "none"

    def __post_init__(self) -> None:
        check_recompute(self.recompute)

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
        return tuple(self.workload.edge_collectives(self.shape))

    @cached_property
    def context_collectives(self) -> tuple[Collective, ...]:
        """Context parallelism's key/value collectives (``Workload.context_collectives``)."""
        return tuple(self.workload.context_collectives(self.shape))

    @cached_property
    def params(self) -> int:
        """Parameter elements one rank holds (``memory.local_param_count``)."""
        return local_param_count(self.workload, self.shape)
