"""Under mpirun, does the transport probe pick the transport that steps the job faster? (issue 18, item 5)

Launched by mpiexec on the host with ``comm="auto"`` (the default), ``axon4d.init`` times MPI and
gloo on the world (axon4d.comm.transport.probe_transports) and every rank takes the faster. For each
rank count in ``--ranks`` this bench runs three jobs under ``mpiexec -n R``:

- ``auto``: ``axon4d.init()`` as a user calls it; records the choice, each transport's probe
  figure (the slowest rank's seconds for the probe's collectives) and the probe's cost on rank 0
  (``grid.comm.transport_choice.cost_s``: wall time from the barrier before the probe to the verdict);
- ``torch`` and ``mpi``: the same job with ``AXON4D_COMM`` forcing the transport (no probe).

Each job then steps the same workload: an MLP (Linear H→4H, GELU, Linear 4H→H, biases), fp32,
on grid (1, R/2, 2, 1), so every step runs all-reduces over y, all-gathers and reduce-scatters
over z; ``--steps`` timed steps after one warm-up, each after a barrier, each the slowest rank's
time; the job's figure is the median step. The auto job steps too, which checks that the chosen
transport runs the job.

    python bench/transport.py                    # 2, 4 and 8 ranks; a few minutes
    python bench/transport.py --ranks 4 --hidden 512

Saves ``bench/results/transport.json`` (with the result header of bench/common.py); one line per
rank count:
``transport: ranks = R, chosen = X, probe cost = C s, step torch = T s, step mpi = M s, chosen is faster = yes|no``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOBS = {"auto": {}, "torch": {"AXON4D_COMM": "torch"}, "mpi": {"AXON4D_COMM": "mpi"}}


def worker(args: argparse.Namespace) -> None:
    import torch

    import axon4d
    from axon4d.nn.mlp import MLP

    torch.set_num_threads(1)
    grid = axon4d.init(grid=(1, -1, 2, 1), seed=0)  # y takes the ranks z does not
    h = args.hidden
    model = MLP(h, 4 * h, gated=False, bias=True, grid=grid)
    x = axon4d.shard_input(torch.randn(args.batch, args.seq, h)).requires_grad_()
    v = axon4d.shard_features(torch.randn(h), "x")

    def step() -> float:
        grid.comm.barrier()
        t0 = time.perf_counter()
        y = model(x)
        (y * v).sum().backward()
        for p in model.parameters():
            p.grad = None
        x.grad = None
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        return float(grid.comm.all_gather(dt, "world").wait().max())

    step()  # warm-up: allocations, connections
    steps = [step() for _ in range(args.steps)]
    if grid.rank == 0:
        t = grid.comm.transport_choice
        result = {
            "transport": t.name,
            "why": t.why,
            "probe_s": t.seconds,
            "probe_cost_s": t.cost_s,
            "grid": list(grid.shape.as_tuple()),
            "steps_s": steps,
            "median_step_s": common.median(steps),
        }
        print("RESULT " + json.dumps(result), flush=True)
    axon4d.shutdown()


def run_job(args: argparse.Namespace, ranks: int, job: str) -> dict:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = {k: v for k, v in os.environ.items() if k != "AXON4D_COMM"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **JOBS[job])
    cmd = [mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker"]
    cmd += [
        "--hidden",
        str(args.hidden),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(
            f"{job} at {ranks} ranks failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    return json.loads(lines[0][len("RESULT ") :])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts (even)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--results", default=os.path.join(HERE, "results", "transport.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    head = common.header()
    ranks = [int(r) for r in args.ranks.split(",")]
    for r in ranks:
        if r < 2 or r % 2:
            raise SystemExit(
                f"--ranks {args.ranks}: every count must be even and at least 2 (the grid is (1, R/2, 2, 1))"
            )
    records, lines = [], []
    for r in ranks:
        jobs = {job: run_job(args, r, job) for job in JOBS}
        auto = jobs["auto"]
        faster = min(("torch", "mpi"), key=lambda n: jobs[n]["median_step_s"])
        record = {"ranks": r, "jobs": jobs, "chosen": auto["transport"], "faster_in_step": faster}
        records.append(record)
        cost = auto["probe_cost_s"]
        line = (
            f"transport: ranks = {r}, chosen = {auto['transport']}, probe cost = "
            + ("n/a" if cost is None else f"{cost:.2f} s")
            + f", step torch = {jobs['torch']['median_step_s']:.3f} s, step mpi = {jobs['mpi']['median_step_s']:.3f} s"
            + f", chosen is faster = {'yes' if auto['transport'] == faster else 'no'}"
        )
        lines.append(line)
        print(
            f"  {r} ranks: probe {auto['probe_s']} ({auto['why']}); auto step {auto['median_step_s']:.3f} s", flush=True
        )
    setting = {
        "hidden": args.hidden,
        "ffn": 4 * args.hidden,
        "tokens": args.batch * args.seq,
        "steps": args.steps,
        "dtype": "float32",
        "launcher": "mpiexec (MPICH, from pip mpich)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_end": os.getloadavg(),  # includes this bench's own ranks
    }
    print(f"saved {common.save(args.results, {'setting': setting, 'records': records}, head)}")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
