"""The planner (docs/design.md §6): predict step time and memory of any grid, choose the grid.

    from axon4d.plan import plan
    result = plan("80B", 1024, "perlmutter", batch=2048)
    print(result.table(10)); result.best.shape

Modules: ``workload`` (the layers a step runs and the §1 rules they set), ``machine`` (measured
or published rates), ``cost`` (step time: compute + E8–E13, §3), ``schedule`` (what overlap hides,
§4), ``memory`` (bytes per rank, §5), ``stepfit`` (the in-step scale fitted to measured steps),
``search`` (enumeration), ``auto`` (``grid="auto"``), ``cli`` (``axon4d plan``). Measuring a
machine is ``axon4d.measure``'s; this package only reads the machine files it writes.
"""

from axon4d.plan.cost import Overlap, TimeEstimate, describe, step_time
from axon4d.plan.machine import Machine, available, load
from axon4d.plan.memory import MemoryEstimate, local_param_count, memory
from axon4d.plan.search import Candidate, PlanResult, evaluate, plan
from axon4d.plan.workload import LinearSpec, Workload

__all__ = [
    "Candidate",
    "LinearSpec",
    "Machine",
    "MemoryEstimate",
    "Overlap",
    "PlanResult",
    "TimeEstimate",
    "Workload",
    "available",
    "describe",
    "evaluate",
    "load",
    "local_param_count",
    "memory",
    "plan",
    "step_time",
]
