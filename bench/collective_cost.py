"""Wall time and CPU time of each collective (docs/design.md §7).

On one host the CPU that moves bytes is the CPU the ranks compute on, so a collective's CPU cost
bounds what overlap can gain there (docs/results/overlap.md). For the z and x axes of ``--grid`` (default
(2, 2, 2, 1), 8 ranks) and each collective (``axon4d.comm.communicator``: all-gather, reduce-scatter,
all-reduce) of a ``--mib`` payload (the all-gather's output, the other two's input): the median
wall time per call and the CPU seconds per call summed over all ranks (their processes' user +
system time, so the gloo threads and the kernel's work on their behalf are counted). On z it also
times gloo's own reduce-scatter (``torch.distributed.reduce_scatter_tensor`` on the same group),
which axon4d replaces by an exchange of chunks (docs/design.md §7).

    python bench/collective_cost.py --link 1gbit      # emulated cluster (root)
    python bench/collective_cost.py                   # loopback
    python bench/collective_cost.py --grid 1,2,4,1    # a z axis of 4 ranks

Saves bench/results/collective_cost_<where>[_<grid>].json (the grid in the name unless it is the
default; with the result header of bench/common.py); the second-last line is
``reduce_scatter: ranks on z = G, axon4d = A ms, gloo = B ms``, the last
``collectives: all_reduce = A ms / C s CPU, all_gather = ..., reduce_scatter = ...`` (the z axis).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import axon4d

    torch.set_num_threads(1)
    grid = axon4d.init(grid=args.grid, seed=0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for axis in ("z", "x"):
        g = grid.size(axis)
        if g == 1:
            continue
        n = int(args.mib * 2**20) // 4 // g * g  # fp32 elements of the payload, whole chunks
        full, part, chunk = torch.zeros(n), torch.zeros(n // g), torch.empty(n // g)
        calls = {
            "all_reduce": lambda: grid.comm.all_reduce(full, axis).wait(),
            "all_gather": lambda: grid.comm.all_gather(part, axis).wait(),
            "reduce_scatter": lambda: grid.comm.reduce_scatter(full, axis).wait(),
        }
        if axis == "z":  # the collective axon4d's reduce-scatter replaces, on the same group
            group = grid.groups[axis]
            native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch 2.13, 2.11
            calls["reduce_scatter_gloo"] = lambda: native(chunk, full, group=group)
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
            out.setdefault(axis, {})[op] = {"wall_s": common.median(walls), "cpu_s_all_ranks": common.median(cpus)}
    if grid.rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    axon4d.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", help="run on an emulated cluster with this link rate (e.g. 1gbit); needs root")
    p.add_argument("--grid", default="2,2,2,1", help="the grid, x,y,z,data (its product is the rank count)")
    p.add_argument("--mib", type=float, default=24.0, help="payload of each collective in MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mib <= 0:
        p.error(f"--mib {args.mib}: give a positive payload in MiB")
    try:
        args.grid = tuple(int(v) for v in args.grid.split(","))
    except ValueError:
        args.grid = ()
    if len(args.grid) != 4 or min(args.grid) < 1 or args.grid[2] < 2:
        p.error(f"--grid {args.grid}: give four positive sizes x,y,z,data with z >= 2, e.g. 2,2,2,1 or 1,2,4,1")
    ranks = args.grid[0] * args.grid[1] * args.grid[2] * args.grid[3]
    if args.worker:
        worker(args)
        return 0
    head = common.header()
    out = f"/tmp/axon4d_collective_cost_{os.getpid()}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--out",
        out,
        "--grid",
        ",".join(map(str, args.grid)),
        "--mib",
        str(args.mib),
        "--reps",
        str(args.reps),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if args.link:
        sys.path.insert(0, HERE)
        from cluster import Cluster

        with Cluster(ranks, args.link) as cluster:
            code = cluster.run(cmd, env={"PYTHONPATH": ROOT})
        where = {"where": "emulated cluster", **cluster.describe()}
    else:
        code = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *cmd[1:]], env=env
        ).returncode
        where = {"where": "loopback"}
    if code != 0:
        raise SystemExit(f"a rank failed (exit {code}); see the output above")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    tag = f"cluster_{args.link}" if args.link else "loopback"
    if args.grid != (2, 2, 2, 1):
        tag += "_" + "x".join(map(str, args.grid))
    path = os.path.join(HERE, "results", f"collective_cost_{tag}.json")
    setting = {**where, "grid": str(args.grid), "payload_mib": args.mib, "reps": args.reps}
    common.save(path, {"setting": setting, "results": result}, head)
    for axis, ops in result.items():
        for op, r in ops.items():
            print(
                f"{axis} {op:19s} wall {r['wall_s'] * 1e3:7.1f} ms   CPU ({ranks} ranks) {r['cpu_s_all_ranks'] * 1e3:7.1f} ms"
            )
    print(f"saved {path}")
    z = result["z"]
    print(
        f"reduce_scatter: ranks on z = {args.grid[2]}, axon4d = {z['reduce_scatter']['wall_s'] * 1e3:.0f} ms, "
        f"gloo = {z['reduce_scatter_gloo']['wall_s'] * 1e3:.0f} ms"
    )
    print(
        "collectives: "
        + ", ".join(f"{op} = {z[op]['wall_s'] * 1e3:.0f} ms / {z[op]['cpu_s_all_ranks']:.2f} s CPU" for op in OPS)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
