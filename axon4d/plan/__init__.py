"""The planner (docs/design.md §6): predict step time and memory of any grid, choose the grid.

    from axon4d.plan import plan, step_breakdown
    result = plan("80B", 1024, "perlmutter", batch=2048)
    print(result.table(10)); result.best.shape
    print(step_breakdown(result.best.time))  # where the best step's seconds go

Modules: ``workload`` (the layers a step runs and the §1 rules they set), ``machine`` (measured
or published rates), ``saved`` (what a block keeps for backward, §5), ``backward_walk`` (the
backward pass's live bytes), ``memory`` (bytes per rank), ``scenario`` (one price's inputs:
workload, grid shape, machine, overlap, recompute, step options), ``layers`` (each layer kind's
GEMMs, collectives E8–E13 and non-GEMM work, §3), ``overlap_credit`` (what overlap hides, §4),
``recompute`` (what recomputation runs again, §5), ``cost`` (the step assembled from those),
``stepfit`` (the in-step scale fitted to measured steps), ``candidate`` (one plan priced, and
whether it fits), ``options`` (the step options searched per grid), ``result`` (the table, a step's
parts and the advice when nothing fits), ``search`` (enumeration), ``auto`` (``grid="auto"``), ``job`` (the
training job's one seam: a ``JobRequest`` in, a ``JobPlan`` out), ``cli`` (``axon4d plan``).
Measuring a machine is ``axon4d.measure``'s; this package only reads the machine files it writes.
"""

from axon4d.plan.candidate import Candidate, candidate, evaluate
from axon4d.plan.cost import TimeEstimate, step_estimate, step_time
from axon4d.plan.machine import Machine, available, load
from axon4d.plan.memory import MemoryEstimate, memory
from axon4d.plan.persistent import local_param_count
from axon4d.plan.result import PlanResult, step_breakdown
from axon4d.plan.scenario import Scenario
from axon4d.plan.search import plan
from axon4d.plan.workload import LinearSpec, Workload

__all__ = [
    "Candidate",
    "LinearSpec",
    "Machine",
    "MemoryEstimate",
    "PlanResult",
    "Scenario",
    "TimeEstimate",
    "Workload",
    "available",
    "candidate",
    "evaluate",
    "load",
    "local_param_count",
    "memory",
    "plan",
    "step_estimate",
    "step_breakdown",
    "step_time",
]
