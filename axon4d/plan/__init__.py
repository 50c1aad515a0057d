"""The planner (docs/design.md §6): predict step time and memory of any grid, choose the grid.

    from axon4d.plan import plan
    result = plan("80B", 1024, "perlmutter", batch=2048)
    print(result.table(10)); result.best.shape

Modules: ``workload`` (the layers a step runs), ``machine`` (measured or published rates),
``cost`` (time, E8–E13 + overlap), ``memory`` (bytes per rank), ``search`` (enumeration),
``calibrate`` (measure this machine), ``cli`` (``axon4d plan``).
"""

from axon4d.plan.cost import Overlap, TimeEstimate, describe, step_time
from axon4d.plan.machine import Machine, available, load
from axon4d.plan.memory import MemoryEstimate, local_param_count, memory
from axon4d.plan.search import Candidate, PlanResult, evaluate, plan
from axon4d.plan.workload import LinearSpec, Workload

__all__ = [
    "Candidate", "LinearSpec", "Machine", "MemoryEstimate", "Overlap", "PlanResult", "TimeEstimate", "Workload",
    "available", "describe", "evaluate", "load", "local_param_count", "memory", "plan", "step_time",
]
