"""Where a training step's time goes, against the planner's prices (docs/design.md §6).

For each grid, ``axon4d.measure.probe.ProbeModel`` (the planner benchmark's workload, same defaults)
runs ``--steps`` training steps under torch's profiler on every rank, with overlap off and with
the default policy ("all"), alternating, ``--rounds`` times (medians over rounds are kept). Per
step and rank (mean over ranks): the wall time, the time inside GEMMs (``aten::mm``,
``aten::addmm``) and inside every other op the profiler records (which includes waiting for
collectives inside the layers), next to the planner's GEMM price (``matmul_s``) and its whole
prediction for that grid from the machine file. Where ranks share cores, an op's time includes
the time its rank was preempted, as the planner's calibration (run with every rank busy) does.
If the GEMMs of a step take longer than the planner prices them, the calibration tables do not
describe the GEMMs the layers really run; if they take longer with overlap on than off, the
collectives running beside them slow them down.

    python bench/gemm_in_step.py                                  # grids of 2 and 8 ranks
    python bench/gemm_in_step.py --grids "2,2,2,1;1,1,8,1"

Saves bench/results/gemm_in_step.json (with the result header of bench/common.py); the last line is
``gemm_in_step: in-step/priced GEMM = R (median over grids), off/all GEMM = Q``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

GEMMS = ("aten::mm", "aten::addmm")
DEFAULT_GRIDS = "2,1,1,1;1,1,1,2;1,1,2,1;2,2,2,1;2,2,1,2;1,2,1,4;1,1,8,1;1,1,1,8"


def _profiled_steps(grid, wl, steps: int) -> dict:
    """Per-step wall time and profiler CPU time of GEMMs and of all other ops on this rank."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from axon4d.measure.probe import ProbeModel, train_step

    torch.manual_seed(0)
    model = ProbeModel(wl, grid)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    for _ in range(2):
        train_step(model, opt)
    grid.comm.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            train_step(model, opt)
        wall = (time.perf_counter() - start) / steps
    gemm = other = 0.0
    for e in prof.key_averages():
        secs = e.self_cpu_time_total / 1e6 / steps
        if e.key in GEMMS:
            gemm += secs
        elif not e.key.startswith("ProfilerStep"):
            other += secs
    return {"wall_s": wall, "gemm_s": gemm, "other_s": other}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default=DEFAULT_GRIDS, help="semicolon-separated x,y,z,d")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--machine", default=os.path.join(ROOT, "bench/results/planner_machine_local.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/gemm_in_step.json"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import common
    from harness import RankPool
    from planner_accuracy import WORKLOAD, workload

    from axon4d.grid.shape import GridShape
    from axon4d.options.overlap_policy import OverlapPolicy
    from axon4d.plan import evaluate, load

    head = common.header()
    wl = workload(argparse.Namespace(**WORKLOAD))
    machine = load(args.machine)
    grids = [tuple(int(v) for v in g.split(",")) for g in args.grids.split(";")]
    by_world: dict[int, list[tuple[int, ...]]] = {}
    for g in grids:
        by_world.setdefault(GridShape(*g).world_size, []).append(g)
    rows = []
    for world, gs in sorted(by_world.items()):
        pool = RankPool(world, start_timeout=900)
        try:
            for g in gs:
                row: dict = {"grid": list(g), "world": world}
                rounds: dict[str, list[dict[str, float]]] = {"off": [], "all": []}
                for _ in range(args.rounds):
                    for policy in rounds:
                        per_rank = pool.run(g, _profiled_steps, wl, args.steps, timeout=900, overlap=policy)
                        rounds[policy].append(
                            {k: statistics.fmean(r[k] for r in per_rank) for k in ("wall_s", "gemm_s", "other_s")}
                        )
                for policy, got in rounds.items():
                    median = common.medians(got)
                    pred = evaluate(wl, GridShape(*g), machine, OverlapPolicy.parse(policy)).time
                    row[policy] = dict(median, rounds=got, priced_gemm_s=pred.matmul_s, predicted_step_s=pred.step_s)
                row["in_step_over_priced_gemm"] = row["all"]["gemm_s"] / row["all"]["priced_gemm_s"]
                row["off_over_all_gemm"] = row["off"]["gemm_s"] / row["all"]["gemm_s"]
                rows.append(row)
                print(
                    f"{str(g):<14} all: step {row['all']['wall_s'] * 1e3:6.0f} ms (predicted "
                    f"{row['all']['predicted_step_s'] * 1e3:4.0f}), GEMMs {row['all']['gemm_s'] * 1e3:4.0f} ms "
                    f"(priced {row['all']['priced_gemm_s'] * 1e3:4.0f}), other ops {row['all']['other_s'] * 1e3:4.0f} ms"
                    f" | off: GEMMs {row['off']['gemm_s'] * 1e3:4.0f} ms",
                    flush=True,
                )
        finally:
            pool.close()
    ratio = common.median(r["in_step_over_priced_gemm"] for r in rows)
    off_all = common.median(r["off_over_all_gemm"] for r in rows)
    result = {
        "args": vars(args),
        "machine": args.machine,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": rows,
        "summary": {"in_step_over_priced_gemm_median": ratio, "off_over_all_gemm_median": off_all},
    }
    print(f"saved {common.save(args.out, result, head)}")
    print(f"gemm_in_step: in-step/priced GEMM = {ratio:.2f} (median over grids), off/all GEMM = {off_all:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
