"""Do non-blocking collectives progress while compute runs? MPI progress modes vs gloo.

Each rank issues an all-reduce of ``--mb`` MiB over a ``--ranks``-rank world through axon4d's
Communicator, runs matmuls for about as long as the all-reduce takes alone, then waits. The share
hidden is 1 − (time blocked in wait) / (time of the all-reduce alone). Modes:

- ``mpi-thread``: axon4d's progress thread tests outstanding MPI requests every 200 µs;
- ``mpi-mpich``: MPICH's own progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``);
- ``mpi-none``: MPI progresses only inside ``wait()`` — the collective stalls during compute;
- ``gloo``: torch.distributed gloo (its own background threads).

    python bench/mpi_progress.py          # all four, 4 ranks, 16 MiB; saves bench/results/mpi_progress.json

The JSON carries the result header of bench/common.py (command, commit, host, date).
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
MODES = {
    "mpi-thread": {"AXON4D_MPI_PROGRESS": "thread"},
    "mpi-mpich": {"AXON4D_MPI_PROGRESS": "mpich", "MPIR_CVAR_ASYNC_PROGRESS": "1"},
    "mpi-none": {"AXON4D_MPI_PROGRESS": "none"},
    "gloo": {"AXON4D_COMM": "torch"},
}


def worker(args: argparse.Namespace) -> None:
    import torch

    import axon4d

    torch.set_num_threads(1)
    grid = axon4d.init(grid=(1, 1, 1, -1))
    buf = torch.ones(int(args.mb * 2**20) // 4)
    a = torch.randn(256, 256)

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    def timed(fn) -> float:
        grid.comm.barrier()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    comm_alone = common.median(timed(lambda: grid.comm.all_reduce(buf, "data").wait()) for _ in range(args.reps))
    per_mm = timed(lambda: matmuls(50)) / 50
    n = max(1, int(comm_alone / per_mm))
    compute_alone = common.median(timed(lambda: matmuls(n)) for _ in range(args.reps))
    rows = []
    for _ in range(args.reps):
        grid.comm.barrier()
        t0 = time.perf_counter()
        h = grid.comm.all_reduce(buf, "data")
        matmuls(n)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        rows.append((t2 - t1, t2 - t0))
    blocked = common.median(r[0] for r in rows)
    total = common.median(r[1] for r in rows)
    if grid.rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "backend": grid.comm.transport_name,
                    "comm_alone_s": comm_alone,
                    "compute_alone_s": compute_alone,
                    "overlapped_total_s": total,
                    "blocked_s": blocked,
                    "hidden_pct": 100.0 * max(0.0, 1 - blocked / comm_alone),
                    "speedup_vs_serial": (comm_alone + compute_alone) / total,
                }
            ),
            flush=True,
        )
    axon4d.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mb", type=float, default=16.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    head = common.header()
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    results = {}
    for mode in args.modes.split(","):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **MODES[mode])
        cmd = [
            mpiexec,
            "-n",
            str(args.ranks),
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--mb",
            str(args.mb),
            "--reps",
            str(args.reps),
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"{mode} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        results[mode] = json.loads(lines[0][7:])
        r = results[mode]
        print(
            f"{mode:11s} all-reduce alone {r['comm_alone_s'] * 1e3:7.1f} ms, blocked after compute "
            f"{r['blocked_s'] * 1e3:7.1f} ms, hidden {r['hidden_pct']:5.1f}%, speedup vs serial {r['speedup_vs_serial']:.2f}",
            flush=True,
        )
    result = {"ranks": args.ranks, "mb": args.mb, "reps": args.reps, "results": results}
    print(f"saved {common.save(os.path.join(HERE, 'results', 'mpi_progress.json'), result, head)}")
    print("mpi progress: hidden " + ", ".join(f"{m}={r['hidden_pct']:.0f}%" for m, r in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
