"""Wall time and CPU time of each collective on 8 ranks (docs/design.md §7).

On one host the CPU that moves bytes is the CPU the ranks compute on, so a collective's CPU cost
bounds what overlap can gain there (docs/overlap.md). For each axis of the (2, 2, 2, 1) grid and
each collective (``axon4d.comm``: all-gather, reduce-scatter, all-reduce) of a ``--mib`` payload
(the all-gather's output, the other two's input): the median wall time per call and the CPU
seconds per call summed over all 8 ranks (their processes' user + system time, so the gloo
threads and the kernel's work on their behalf are counted).

    python bench/collective_cost.py --link 1gbit      # emulated cluster (root)
    python bench/collective_cost.py                   # loopback

Saves bench/results/collective_cost_<where>.json; the last line is
``collectives: all_reduce = A ms / C s CPU, all_gather = ..., reduce_scatter = ...``
(the z axis).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def worker(args: argparse.Namespace) -> None:
    import torch

    import axon4d

    torch.set_num_threads(1)
    grid = axon4d.init(grid=(2, 2, 2, 1), seed=0)
    n = int(args.mib * 2**20) // 4  # fp32 elements of the payload
    out: dict[str, dict[str, dict[str, float]]] = {}
    for axis in ("z", "x"):
        full, part = torch.zeros(n), torch.zeros(n // grid.size(axis))
        calls = {
            "all_reduce": lambda: grid.comm.all_reduce(full, axis).wait(),
            "all_gather": lambda: grid.comm.all_gather(part, axis).wait(),
            "reduce_scatter": lambda: grid.comm.reduce_scatter(full, axis).wait(),
        }
        for op, fn in calls.items():
            fn()  # warm up the connections
            walls, cpus = [], []
            for _ in range(args.reps):
                grid.comm.barrier()
                c0, t0 = os.times(), time.perf_counter()
                fn()
                grid.comm.barrier()
                wall, c1 = time.perf_counter() - t0, os.times()
                cpu = torch.tensor([c1.user + c1.system - c0.user - c0.system], dtype=torch.float64)
                walls.append(wall)
                cpus.append(float(grid.comm.all_reduce(cpu, "world").wait()))
            out.setdefault(axis, {})[op] = {
                "wall_s": statistics.median(walls),
                "cpu_s_all_ranks": statistics.median(cpus),
            }
    if grid.rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    axon4d.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", help="run on an emulated cluster with this link rate (e.g. 1gbit); needs root")
    p.add_argument("--mib", type=float, default=24.0, help="payload of each collective in MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mib <= 0:
        p.error(f"--mib {args.mib}: give a positive payload in MiB")
    if args.worker:
        worker(args)
        return 0
    out = f"/tmp/axon4d_collective_cost_{os.getpid()}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--out",
        out,
        "--mib",
        str(args.mib),
        "--reps",
        str(args.reps),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if args.link:
        sys.path.insert(0, HERE)
        from cluster import Cluster

        with Cluster(8, args.link) as cluster:
            code = cluster.run(cmd, env={"PYTHONPATH": ROOT})
        where = {"where": "emulated cluster", **cluster.describe()}
    else:
        code = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", *cmd[1:]], env=env
        ).returncode
        where = {"where": "loopback"}
    if code != 0:
        raise SystemExit(f"a rank failed (exit {code}); see the output above")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    tag = f"cluster_{args.link}" if args.link else "loopback"
    path = os.path.join(HERE, "results", f"collective_cost_{tag}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "setting": {**where, "grid": "(2, 2, 2, 1)", "payload_mib": args.mib, "reps": args.reps},
                "results": result,
            },
            f,
            indent=1,
        )
    for axis, ops in result.items():
        for op, r in ops.items():
            print(
                f"{axis} {op:15s} wall {r['wall_s'] * 1e3:7.1f} ms   CPU (8 ranks) {r['cpu_s_all_ranks'] * 1e3:7.1f} ms"
            )
    print(f"saved {path}")
    z = result["z"]
    print(
        "collectives: "
        + ", ".join(f"{op} = {z[op]['wall_s'] * 1e3:.0f} ms / {z[op]['cpu_s_all_ranks']:.2f} s CPU" for op in OPS)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
