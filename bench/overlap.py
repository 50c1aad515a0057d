"""Overlap off vs each mechanism alone vs all on, on a transformer-shaped workload (docs/design.md §4).

The workload: ``--layers`` blocks, each an attention-shaped pair (QKV h→3h normal, a cheap
elementwise mix standing in for attention, output projection h→h transposed) and an MLP (h→4h
normal, GELU, 4h→h transposed), with residuals — all ``axon4d.Linear`` — on an 8-rank grid. One
step = forward, backward, SGD update. Configurations run interleaved (off, oag, oar, ors, odp,
chunks, all; then again) ``--reps`` times, ``--steps`` timed steps each after one warm-up step; the
step time is the slowest rank's, and each configuration reports the median step time, its ratio to
"off", and the median share of communication hidden (axon4d.stepstats), with the CPU-seconds the
ranks used (all their threads, and their main threads alone) and the host's busy share.

The knobs (OAG depth and keep-for-backward, ORS in flight, forward chunks) are what a user gets by
default: ``axon4d.init``'s ``overlap="auto"``, the planner's choice for this model (its linear
layers, fp32, SGD) on ``--machine`` — a machine file measured where the bench runs (the default
file of each setting is named in ``--help``). ``--knobs`` sets them by hand instead.

    python bench/overlap.py --link 1gbit     # emulated cluster of 8 namespaces at 1 Gbit/s (root)
    python bench/overlap.py --link 1gbit --nodes 2 --intra 10gbit   # two nodes of 4, 1 Gbit/s between
    python bench/overlap.py --backend gloo   # loopback, gloo
    python bench/overlap.py --backend mpi    # loopback, MPI (mpiexec -n 8)

Loopback gloo ranks are spawned by bench/common.py's ``spawn``, MPI ranks by mpiexec, the emulated
cluster's by bench/cluster.py. Results go to ``bench/results/overlap_<where>.json`` (with the result
header of bench/common.py); ``--trace DIR`` also dumps one step with overlap off and one with all
on (axon4d.trace) and draws ``--png``. The last line is ``overlap: all-on/off = R, hidden = H%``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import common

from axon4d.measure.spawn import run_local

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = ["off", "oag", "oar", "ors", "odp", "chunks", "all"]
#: what ``summarize`` reports as the median over a configuration's steps
MEDIANS = ("comm_s", "blocked_s", "compute_s", "cpu_s_all_ranks", "main_cpu_s_all_ranks", "host_busy")


# -- the worker: runs on every rank ---------------------------------------------------------------
def _policy(name: str, knobs: str = "", base=None):
    """The policy of configuration ``name``; ``knobs`` ("ors_inflight=2,bucket_mb=4") tune every
    configuration but "off" (the mechanisms themselves are chosen by ``name``). With no ``knobs``,
    the knobs of ``base`` (the policy ``axon4d.init``'s ``overlap="auto"`` chose) apply."""
    import dataclasses

    from axon4d.options.overlap_policy import MECHANISMS, OverlapPolicy

    if name == "off":
        return OverlapPolicy.off()
    if not knobs and base is not None:
        on = set(MECHANISMS) if name == "all" else {name}
        flags = {m: m in on for m in MECHANISMS if m != "chunks"}
        return dataclasses.replace(base, **flags, forward_chunks=base.forward_chunks if "chunks" in on else 1)
    bad = [k for k in filter(None, knobs.split(",")) if "=" not in k or k.partition("=")[0] in MECHANISMS]
    if bad:
        raise SystemExit(
            f"--knobs {knobs}: {bad} — give policy knobs as key=value (oag_depth=3, "
            f"forward_chunks=8); the configuration chooses the mechanisms"
        )
    try:
        return OverlapPolicy.parse(",".join(filter(None, [name, knobs])))
    except ValueError as e:
        raise SystemExit(f"--knobs {knobs}: {e}") from None


def _model(hidden: int, layers: int):
    import torch

    import axon4d

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = axon4d.Linear(hidden, 3 * hidden)
            self.proj = axon4d.Linear(hidden, hidden, transpose=True)
            self.up = axon4d.Linear(hidden, 4 * hidden)
            self.down = axon4d.Linear(4 * hidden, hidden, transpose=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # (b, h/G_y) each: an elementwise stand-in for attention
            x = x + self.proj(q * torch.sigmoid(k) + v)
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    return torch.nn.Sequential(*[Block() for _ in range(layers)])


def _plan(args: argparse.Namespace) -> dict:
    """What the planner is told of this job for ``overlap="auto"`` (axon4d.init's ``plan``): the
    blocks' four linear layers as a model without attention compute, norms, embedding or head
    (the elementwise mix is not priced), fp32, plain SGD, on ``--machine``."""
    from axon4d.config import ModelConfig
    from axon4d.plan.workload import Workload

    h = args.hidden
    cfg = ModelConfig(n_layers=args.layers, hidden=h, n_heads=1, ffn_hidden=4 * h, vocab_size=128, seq_len=args.seq)
    wl = Workload(
        cfg, args.batch, dtype="float32", optimizer="sgd", attention=False, norms=False, embedding=False, head=False
    )
    return {"workload": wl, "machine": args.machine}


def worker(args: argparse.Namespace) -> None:
    import torch

    import axon4d
    from axon4d import stepstats, trace

    torch.set_num_threads(1)
    if args.pin_nodes:  # before any thread exists: every thread of the rank inherits the core
        cores = sorted(os.sched_getaffinity(0))
        node = int(os.environ["RANK"]) // int(os.environ["LOCAL_WORLD_SIZE"])  # set by bench/cluster.py
        os.sched_setaffinity(0, {cores[node % len(cores)]})
    shape = tuple(int(s) for s in args.grid.split(","))
    if args.knobs:
        grid = axon4d.init(grid=shape, comm=args.comm, seed=0, overlap="all")
    else:  # the library's default, overlap="auto": the planner's knobs for this model on --machine
        grid = axon4d.init(grid=shape, comm=args.comm, seed=0, plan=_plan(args))
    chosen = grid.scheduler.policy
    if args.nice_compute:  # this thread only: the communication threads made above keep nice 0
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.nice_compute)
    model = _model(args.hidden, args.layers)
    params = list(model.parameters())
    x = axon4d.shard_input(torch.randn(args.batch, args.seq, args.hidden))
    v = torch.randn(x.shape[-1])
    sched = grid.scheduler

    def step() -> None:
        y = model(x)
        (y * v).sum().div(y.numel() // y.shape[-1]).backward()
        with torch.no_grad():
            for p in params:
                p -= 1e-3 * p.grad
                p.grad = None

    def host_busy() -> tuple[float, float]:  # (busy, total) jiffies of the host's CPUs
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)

    def timed(n: int) -> tuple[stepstats.StepReport, float, float, float]:
        """The step's report, this process's CPU seconds in it (all threads; the main thread —
        the matmuls, autograd and the Python around them), and the host's busy share."""
        grid.comm.barrier()
        cpu0, main0, (busy0, tot0) = os.times(), time.thread_time(), host_busy()
        with stepstats.step(grid, n) as rep:
            step()
        cpu1, main1, (busy1, tot1) = os.times(), time.thread_time(), host_busy()
        cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
        return rep, cpu, main1 - main0, (busy1 - busy0) / max(tot1 - tot0, 1.0)

    def gather(values: list[float]) -> list[list[float]]:  # every rank's values, rank order
        t = torch.tensor(values, dtype=torch.float64)
        return grid.comm.all_gather(t.view(1, -1), "world").wait().tolist()

    sched.configure(_policy("all", args.knobs, chosen))
    step()  # warm up allocations and the OAG order
    configs = args.configs.split(",")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(args.reps):
        for name in configs:
            sched.configure(_policy(name, args.knobs, chosen))
            step()
            for s in range(args.steps):
                r, cpu, main_cpu, busy = timed(s)
                per_rank = gather([r.wall_s, r.comm_s, r.blocked_s, r.compute_s, cpu, busy, main_cpu])
                results[name].append(
                    {
                        "rep": rep,
                        "step_s": max(p[0] for p in per_rank),
                        "comm_s": statistics.mean(p[1] for p in per_rank),
                        "blocked_s": statistics.mean(p[2] for p in per_rank),
                        "compute_s": statistics.mean(p[3] for p in per_rank),
                        "cpu_s_all_ranks": sum(p[4] for p in per_rank),  # CPU seconds the ranks used
                        "main_cpu_s_all_ranks": sum(p[6] for p in per_rank),  # of which in their main threads
                        "host_busy": per_rank[0][5],  # share of the host's cores busy during the step
                        "bytes_by_axis": r.bytes_by_axis,
                    }
                )
                if grid.rank == 0:
                    print(f"rep {rep} {name:6s} {r.line()}", flush=True)
    if args.trace:
        for name in ("off", "all"):
            sched.configure(_policy(name, args.knobs, chosen))
            step()
            grid.comm.barrier()
            t0 = time.perf_counter()
            grid.comm.log.clear()
            step()
            trace.dump(grid, os.path.join(args.trace, name), t0=t0, label=name)
    if grid.rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {"grid": str(grid.shape), "comm": grid.comm.transport_name, "policy": chosen.spec(), "runs": results}, f
            )
    axon4d.shutdown()


def _spawned(_grid: None, args: argparse.Namespace) -> None:
    """A loopback gloo rank started by ``run_local`` (its world is up; ``worker`` builds the grid)."""
    worker(args)


# -- the driver: starts the ranks, collects, prints -----------------------------------------------
def _worker_cmd(args: argparse.Namespace, out: str, comm: str) -> list[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--out",
        out,
        "--comm",
        comm,
        "--grid",
        args.grid,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--reps",
        str(args.reps),
        "--steps",
        str(args.steps),
        "--configs",
        args.configs,
        "--knobs",
        args.knobs,
    ]
    cmd += ["--machine", args.machine] if args.machine else []
    cmd += ["--nice-compute", str(args.nice_compute)] + (["--pin-nodes"] if args.pin_nodes else [])
    return cmd + (["--trace", args.trace] if args.trace else [])


def run_ranks(args: argparse.Namespace, out: str) -> dict:
    """Start 8 (``--ranks``) ranks where asked; return the setting that was measured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if args.link:
        sys.path.insert(0, HERE)
        from cluster import Cluster

        with Cluster(args.ranks, args.link, args.nodes, args.intra) as cluster:
            code = cluster.run(_worker_cmd(args, out, "torch"), env={"PYTHONPATH": ROOT}, timeout=args.timeout)
        where = {"where": "emulated cluster", **cluster.describe(), "backend": "gloo"}
    elif args.backend == "mpi":
        env["AXON4D_MPI_PROGRESS"] = args.mpi_progress
        if args.mpi_progress == "mpich":
            env["MPIR_CVAR_ASYNC_PROGRESS"] = "1"
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        code = subprocess.run(
            [mpiexec, "-n", str(args.ranks), *_worker_cmd(args, out, "mpi")], env=env, timeout=args.timeout
        ).returncode
        where = {"where": "loopback", "backend": "mpi", "mpi_progress": args.mpi_progress}
    else:
        os.environ["OMP_NUM_THREADS"] = "1"
        run_local(
            args.ranks,
            _spawned,
            argparse.Namespace(**{**vars(args), "out": out, "comm": "torch"}),
            grid=None,
            timeout=args.timeout,
        )
        code, where = 0, {"where": "loopback", "backend": "gloo"}
    if code != 0:
        raise SystemExit(f"a rank failed (exit {code}); see the output above")
    return where


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: median step time and its ratio to off's median; the median over
    repetitions of the ratio to off *within* each repetition (runs next to each other in time,
    so less exposed to the load of a shared machine); medians of hidden share and times."""
    off = common.median(r["step_s"] for r in runs["off"])

    def rep_means(rows: list[dict]) -> dict[int, float]:
        return {rep: statistics.mean(r["step_s"] for r in rows if r["rep"] == rep) for rep in {r["rep"] for r in rows}}

    off_reps = rep_means(runs["off"])
    out = {}
    for name, rows in runs.items():
        med = common.median(r["step_s"] for r in rows)
        hidden = [100.0 * (1 - r["blocked_s"] / r["comm_s"]) if r["comm_s"] else 0.0 for r in rows]
        paired = common.median(m / off_reps[rep] for rep, m in rep_means(rows).items())
        out[name] = {
            "median_step_s": med,
            "ratio_to_off": med / off,
            "paired_ratio_to_off": paired,
            "hidden_pct": common.median(hidden),
            **common.medians(rows, MEDIANS),
            "steps_s": [r["step_s"] for r in rows],
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", help="run on an emulated cluster with this link rate (e.g. 1gbit); needs root")
    p.add_argument(
        "--nodes", type=int, default=1, help="emulated cluster: group ranks into nodes (--link is then the uplink)"
    )
    p.add_argument("--intra", default=None, help="emulated cluster: rank link rate inside a node (default uncapped)")
    p.add_argument("--backend", choices=["gloo", "mpi"], default="gloo", help="loopback transport when no --link")
    p.add_argument("--mpi-progress", choices=["thread", "mpich", "none"], default="thread")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--grid", default="2,2,2,1", help="x,y,z,data")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--knobs",
        default="",
        help="policy knobs for every configuration but off, e.g. ors_inflight=2 (default: the knobs "
        "axon4d.init's overlap='auto' chooses for this model on --machine)",
    )
    p.add_argument(
        "--machine",
        help="planner machine file for overlap='auto' (default: bench/results/planner_machine_<where>.json "
        "of the setting: cluster_2node_1gbit, cluster_1gbit, or host_2026-11-24 on loopback)",
    )
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated configurations to run, 'off' and 'all' among them (default: {','.join(CONFIGS)})",
    )
    p.add_argument("--steps", type=int, default=1, help="timed steps per configuration per repetition")
    p.add_argument(
        "--nice-compute",
        type=int,
        default=10,
        help="nice value of each rank's compute thread (0: off). Its communication threads keep "
        "nice 0, so on an oversubscribed CPU they are not starved by the other ranks' matmuls "
        "(on a real cluster the NIC moves the bytes)",
    )
    p.add_argument(
        "--pin-nodes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="emulated cluster with --nodes > 1: run each node's ranks on one core of this host "
        "(node i on the i-th core, round robin), as a node's ranks share its own CPUs and no other "
        "node's (default: on with --nodes > 1; --no-pin-nodes lets every rank use every core)",
    )
    p.add_argument("--trace", help="dump one step with overlap off and one with all on into this directory")
    p.add_argument("--png", help="draw the traced steps into this PNG (needs --trace)")
    p.add_argument("--results", help="JSON to write (default bench/results/overlap_<where>.json)")
    p.add_argument("--timeout", type=float, default=3000)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--comm", default="torch", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown or not {"off", "all"} <= set(args.configs.split(",")):
        p.error(f"--configs {args.configs}: choose from {','.join(CONFIGS)}, including off and all")
    if args.worker:
        worker(args)
        return 0
    if args.pin_nodes is None:
        args.pin_nodes = bool(args.link) and args.nodes > 1 and args.ranks % args.nodes == 0
    if args.pin_nodes and (not args.link or args.nodes < 2 or args.ranks % args.nodes):
        p.error(
            f"--pin-nodes needs an emulated cluster of several nodes (--link, --nodes > 1 dividing "
            f"--ranks); got --link {args.link}, --nodes {args.nodes}, --ranks {args.ranks}"
        )
    if not args.knobs and not args.machine:
        where = f"cluster_{args.nodes}node_{args.link}" if args.nodes > 1 else f"cluster_{args.link}"
        args.machine = os.path.join(
            HERE, "results", f"planner_machine_{where if args.link else 'host_2026-11-24'}.json"
        )
        if not os.path.exists(args.machine):
            p.error(
                f"no machine file {args.machine} for overlap='auto' on this setting: calibrate it (docs/planner.md), "
                "give one with --machine, or set the knobs with --knobs"
            )
    tag = f"cluster_{args.link}" if args.link else args.backend
    if args.nodes > 1:
        tag += f"_{args.nodes}nodes"
    results_path = args.results or os.path.join(HERE, "results", f"overlap_{tag}.json")
    head = common.header()
    out = os.path.join("/tmp", f"axon4d_overlap_{os.getpid()}.json")
    where = run_ranks(args, out)
    with open(out) as f:
        raw = json.load(f)
    os.remove(out)
    summary = summarize(raw["runs"])
    setting = {
        **where,
        "knobs": args.knobs or f"overlap='auto' on {os.path.relpath(args.machine, ROOT)}",
        "policy": raw["policy"],
        "nice_compute": args.nice_compute,
        "pin_nodes": args.pin_nodes,
        "grid": raw["grid"],
        "comm": raw["comm"],
        "hidden": args.hidden,
        "layers": args.layers,
        "tokens": args.batch * args.seq,
        "reps": args.reps,
        "steps_per_rep": args.steps,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"\n{setting}")
    print(
        f"{'config':8s} {'median step':>12s} {'/off':>6s} {'paired':>6s} {'hidden':>7s} {'comm':>9s} "
        f"{'blocked':>9s} {'compute':>9s} {'CPU s':>7s} {'main':>6s} {'busy':>5s}"
    )
    for name, s in summary.items():
        print(
            f"{name:8s} {s['median_step_s'] * 1e3:10.1f}ms {s['ratio_to_off']:6.3f} {s['paired_ratio_to_off']:6.3f} "
            f"{s['hidden_pct']:6.1f}% "
            f"{s['comm_s'] * 1e3:7.1f}ms {s['blocked_s'] * 1e3:7.1f}ms {s['compute_s'] * 1e3:7.1f}ms "
            f"{s['cpu_s_all_ranks']:7.2f} {s['main_cpu_s_all_ranks']:6.2f} {100 * s['host_busy']:4.0f}%"
        )
    record = {"setting": setting, "summary": summary, "runs": raw["runs"]}
    if args.trace:
        sys.path.insert(0, ROOT)
        from axon4d import trace

        runs = [
            ("overlap off", trace.load(os.path.join(args.trace, "off"))),
            ("overlap all on", trace.load(os.path.join(args.trace, "all"))),
        ]
        with open(os.path.join(args.trace, "trace.json"), "w") as f:
            json.dump(trace.chrome_trace(runs), f)
        record["trace"] = os.path.join(args.trace, "trace.json")
        if args.png:
            trace.plot(runs, args.png, ranks=(0, 1))
            record["png"] = args.png
    print(f"saved {common.save(results_path, record, head)}")
    print(f"overlap: all-on/off = {summary['all']['ratio_to_off']:.2f}, hidden = {summary['all']['hidden_pct']:.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
