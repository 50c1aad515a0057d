"""What one training step spent on communication, from the grid's CommLog (docs/design.md §4).

``StepReport`` holds, for one rank and one step: payload bytes per axis, communication time,
time blocked waiting, the share of communication hidden behind compute, and compute time. Times
are interval unions on this rank's clock, as ``axon4d.comm.log`` defines them for every report.

    with axon4d.stepstats.step(grid) as report:   # clears the log, times the step
        loss = model(batch); loss.backward(); opt.step()
    print(report.line())    # step 3 | 412.0 ms | x=12.00MiB y=12.00MiB z=36.00MiB | comm 230.1 ms, ...
    report.as_dict()        # the structured record (JSON-ready)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from axon4d.comm.log import CommLog, comm_and_blocked, hidden_pct, union_length
from axon4d.grid.mesh import Grid


@dataclasses.dataclass
class StepReport:
    """Communication of one step on one rank (seconds and bytes)."""

    step: int = 0
    rank: int = 0
    wall_s: float = 0.0
    bytes_by_axis: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: int = 0
    comm_s: float = 0.0
    blocked_s: float = 0.0
    compute_s: float = 0.0

    @property
    def hidden_pct(self) -> float:
        """Share of communication time during which this rank was not blocked waiting (axon4d.comm.log)."""
        return hidden_pct(self.comm_s, self.blocked_s)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hidden_pct": self.hidden_pct}

    def line(self) -> str:
        """One line: step, wall time, MiB per axis, communication, blocked, hidden."""
        axes = " ".join(f"{a}={b / 2**20:.2f}MiB" for a, b in sorted(self.bytes_by_axis.items())) or "no comm"
        return (
            f"step {self.step} | {self.wall_s * 1e3:.1f} ms | {axes} | comm {self.comm_s * 1e3:.1f} ms, "
            f"blocked {self.blocked_s * 1e3:.1f} ms, hidden {self.hidden_pct:.0f}% | "
            f"compute {self.compute_s * 1e3:.1f} ms"
        )


def report(log: CommLog, *, step: int = 0, rank: int = 0, wall_s: float = 0.0) -> StepReport:
    """The report of everything ``log`` holds (call ``log.clear()`` at the start of a step);
    raises on an untimed log (axon4d.comm.log)."""
    log.check_timed("a step report")
    out = StepReport(step=step, rank=rank, wall_s=wall_s)
    for r in log.records:
        out.bytes_by_axis[r.axis] = out.bytes_by_axis.get(r.axis, 0) + r.payload_bytes
        out.collectives += 1
    out.comm_s, out.blocked_s = comm_and_blocked(log.records)
    out.compute_s = union_length([(a, b) for _, a, b in log.spans])
    return out


@contextlib.contextmanager
def step(grid: Grid, number: int = 0) -> Iterator[StepReport]:
    """Clear ``grid``'s log, run the enclosed step, then fill the yielded report in."""
    result = StepReport(step=number, rank=grid.rank)
    grid.comm.log.clear()
    start = time.perf_counter()
    yield result
    done = report(grid.comm.log, step=number, rank=grid.rank, wall_s=time.perf_counter() - start)
    for field in dataclasses.fields(StepReport):
        setattr(result, field.name, getattr(done, field.name))
