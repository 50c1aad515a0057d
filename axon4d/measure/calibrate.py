"""Measure this machine for the planner and save a machine file (docs/design.md §6, §7).

    axon4d calibrate --ranks 2,4,8 --out local.json        # spawns local gloo worlds of 2, 4, 8 ranks
    torchrun --nproc-per-node 8 -m axon4d.measure.calibrate    # or: srun / mpirun, one world
    torchrun ... -m axon4d.measure.calibrate --parts network --out copy.json   # re-measure the links only

Every rank measures at the same time as the others, so the numbers include the contention of a
real step (on a CPU host the ranks share cores; on a GPU node each has its own device):

- GEMM throughput of the three forms a linear layer runs (X·Wᵀ, dY·W, dYᵀ·X) on a lattice of
  (m, k, n), per dtype: 16 … 4096 on a host, 16 … 16384 on an accelerator (``kernels.gemm_dims``);
- causal attention forward + backward per (sequence, head), unmasked attention per (query, key)
  pair at long key runs (context parallelism's prefix), elementwise streaming bandwidth, the
  MLP activation forward/backward per element, one Adam step per parameter, a framework op
  (axon4d.measure.kernels);
- every collective (all-reduce, all-gather, reduce-scatter, all-to-all) through ``axon4d.comm.communicator`` on
  every axis geometry (group size, rank stride; E1) of the world, at several payloads; how much of an
  asynchronous all-reduce a concurrent GEMM hides (``overlap_efficiency``, §4), and how much GEMM
  time each byte of a collective running beside it costs (``comm_interference_s_per_byte``)
  (axon4d.measure.collectives);
- with ``--step-model``, whole training steps of that model on a few grids, to which the
  planner's in-step scale is fitted (axon4d.measure.steps, axon4d.plan.stepfit).

Times are the mean over ranks of each rank's median over repetitions (axon4d.measure.timing). The
results of several worlds are merged into one file, tables keyed by the number of ranks that ran
at once (axon4d.measure.merge); local worlds are spawned by axon4d.measure.spawn. ``--parts network``
measures the collectives alone and merges them into the machine file already at ``--out``, whose
compute tables it keeps: the same hosts behind another network (e.g. bench/cluster.py's emulation).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from axon4d.device import DTYPES
from axon4d.grid import launch, runtime
from axon4d.grid.mesh import Grid
from axon4d.measure import collectives, kernels, memory_figures
from axon4d.measure import steps as step_probe
from axon4d.measure.merge import host_memory, merge
from axon4d.measure.spawn import run_local
from axon4d.measure.timing import Timer
from axon4d.plan import stepfit
from axon4d.plan.machine import FORMS, Machine, load

#: What a calibration can measure (``--parts``).
PARTS = ("compute", "kernels", "network")


def measure_world(
    grid: Grid,
    dtypes: list[str],
    reps: int,
    log: Callable[[str], None] = print,
    passes: int = 1,
    window_s: float = 0.03,
    step_model: str | None = None,
    step_rounds: int = 3,
    dims: Sequence[int] | None = None,
    payloads: Sequence[int] = collectives.PAYLOADS,
    attention_seqs: Sequence[int] = kernels.ATTENTION_SEQS,
    prefix_keys: Sequence[int] = kernels.PREFIX_KEYS,
    parts: Sequence[str] = PARTS,
) -> dict[str, Any]:
    """All measurements on the current world (every rank calls this); the result on every rank.
    ``window_s``: each sample of local work is a mean over this long (``axon4d.measure.timing``);
    ``step_model``: a ``stepfit.parse_model`` spec whose steps the in-step scale is fitted to
    (``step_rounds`` rounds on ``stepfit.calibration_grids``; None: no step calibration);
    ``dims``, ``payloads``, ``attention_seqs``, ``prefix_keys``: the GEMM lattice (None: the
    device's, ``kernels.gemm_dims``), the collective payloads, the causal attention's sequence lengths and the prefix attention's key lengths;
    ``parts``: which of ``PARTS`` to measure ("compute": GEMMs, attention, elementwise work and the
    optimizer; "kernels": the elementwise work and the optimizer alone; "network": the collectives,
    their overlap and interference)."""
    step_wl = stepfit.parse_model(step_model) if step_model else None  # a bad spec fails before measuring
    if step_wl is not None:
        stepfit.check_grids(grid.world_size, step_wl)
    timer = Timer(grid, reps, window_s)
    world = grid.world_size
    # the grid's device: on an accelerator the planner leaves forward chunking to the device and
    # prices offload's copies over the host link (whatever part is measured)
    out: dict[str, Any] = {"world": world, "accelerator": timer.grid.scheduler.accelerator}
    before = memory_figures.in_use(timer.device) if out["accelerator"] else None  # the grid built, no table yet
    if "compute" in parts:
        lattice = kernels.gemm_dims(timer.device) if dims is None else dims
        out.update(_measure_compute(timer, dtypes, attention_seqs, prefix_keys, lattice, log))
    elif "kernels" in parts:
        out.update(_measure_kernels(timer))
        log(f"[{world} ranks] elementwise, activation, optimizer done")
    if "compute" in parts or "kernels" in parts:  # the device-memory figures the fit test needs, with their sources
        figures = memory_figures.accelerator(timer.device, before) if before else memory_figures.host()
        out["device_memory"] = figures
    if "network" in parts:
        out.update(_measure_network(timer, passes, payloads, log))
    samples = step_probe.measure(grid, step_wl, rounds=step_rounds, log=log) if step_wl and world > 1 else []
    out["step_samples"] = [dataclasses.asdict(s) for s in samples]
    return out


def _measure_compute(
    timer: Timer,
    dtypes: list[str],
    attention_seqs: Sequence[int],
    prefix_keys: Sequence[int],
    dims: Sequence[int],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """GEMM tables, attention rows, elementwise, activation, optimizer and op costs (``measure_world``)."""
    world = timer.grid.world_size
    out: dict[str, Any] = {"matmul": {}, "attention": {}, "attention_prefix": {}}
    for name in dtypes:
        dt = DTYPES[name]
        with timer.stage(f"{name} GEMMs", len(FORMS) * len(dims) ** 3):
            out["matmul"][name] = {f: kernels.matmul_table(timer, dt, f, dims) for f in FORMS}
        log(f"[{world} ranks] {name} GEMM tables done")
        with timer.stage(f"{name} attention", (len(attention_seqs) + len(prefix_keys)) * len(kernels.HEAD_DIMS)):
            out["attention"][name] = kernels.attention_rows(timer, dt, attention_seqs)
            out["attention_prefix"][name] = kernels.prefix_rows(timer, dt, prefix_keys)
    out.update(_measure_kernels(timer))
    log(f"[{world} ranks] attention, elementwise, optimizer done")
    return out


def _measure_kernels(timer: Timer) -> dict[str, Any]:
    """Elementwise streaming (at one size, and as a curve over sizes), the MLP activation, one Adam
    step per element, a framework op's cost and a small read's to the host (the "kernels" part;
    "compute" includes it)."""
    with timer.stage("elementwise, activation, optimizer"):
        return _kernels(timer)


def _kernels(timer: Timer) -> dict[str, Any]:
    bps, act, adam = kernels.elementwise(timer, torch.float32)
    out = {
        "elementwise_Bps": bps,
        "activation_s": act,
        "adam_s": adam,
        "elementwise_curve": kernels.elementwise_curve(timer),
        "op_overhead_s": kernels.op_overhead(timer),
        "host_sync_s": kernels.host_sync(timer),
    }
    if timer.grid.scheduler.accelerator:  # offload's copies: the slower direction of the host link
        out["host_link_Bps"] = min(kernels.host_link(timer).values())
    return out


def _measure_network(timer: Timer, passes: int, payloads: Sequence[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Collective curves, overlap efficiency and interference (``measure_world``)."""
    world = timer.grid.world_size
    out: dict[str, Any] = {}
    points = max(passes, 1) * len(collectives.geometries(world)) * len(collectives.OPS) * len(payloads)
    with timer.stage("collectives", points):
        out["comm"] = collectives.comm_curves(timer, torch.float32, passes, payloads) if world > 1 else []
    out["staged_reduce_scatter"] = timer.grid.comm.transport.stages_reduce_scatter
    with timer.stage("overlap and interference"):
        out["overlap_efficiency"] = statistics.median(
            collectives.overlap_efficiency(timer, torch.float32) for _ in range(max(passes, 1))
        )
        out["comm_interference_s_per_byte"] = statistics.median(
            collectives.interference(timer, torch.float32) for _ in range(max(passes, 1))
        )
    log(
        f"[{world} ranks] collectives done; overlap efficiency {out['overlap_efficiency']:.2f}, "
        f"interference {out['comm_interference_s_per_byte'] * 1e9:.2f} s per GB of collective traffic"
    )
    return out


def _measure_spawned(
    grid: Grid, dtypes: list[str], reps: int, passes: int, step_model: str | None, parts: Sequence[str]
) -> dict[str, Any]:
    """``measure_world`` on one rank of a world ``run_local`` spawned; rank 0 logs."""
    log = (lambda s: print(s, flush=True)) if grid.rank == 0 else (lambda s: None)
    return measure_world(grid, dtypes, reps, log=log, passes=passes, step_model=step_model, parts=parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ranks",
        default="1,2,4,8",
        help="comma-separated world sizes to spawn on this host (ignored under torchrun/srun/mpirun)",
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="GEMM dtypes to measure")
    p.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median)")
    p.add_argument("--passes", type=int, default=3, help="sweeps over all collectives (per-point median)")
    p.add_argument(
        "--step-model",
        default=None,
        metavar="SPEC",
        help="also time whole steps of this model on a few grids and fit the planner's in-step scale to "
        "them (axon4d.plan.stepfit), e.g. layers=2,hidden=512,heads=8,vocab=2048,seq=128,batch=8",
    )
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="what to measure: compute (GEMMs, attention, elementwise, optimizer), network (collectives); "
        "'network' alone re-measures the links of a machine file whose compute is already in --out",
    )
    p.add_argument("--name", default="local", help="machine name stored in the file")
    p.add_argument("--memory-gib", type=float, default=None, help="memory per device (default: host RAM / ranks)")
    p.add_argument("--out", default="local.json", help="machine file to write (merged into if it exists)")


def main(args: argparse.Namespace) -> int:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtypes: {unknown} unknown; use some of {sorted(DTYPES)}")
    if args.step_model:
        stepfit.parse_model(args.step_model)  # a bad spec fails now, not after the tables
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts {args.parts}: choose some of {', '.join(PARTS)}")
    if "compute" not in parts and not os.path.exists(args.out):  # "kernels" or "network" alone: the rest from --out
        raise SystemExit(
            f"--parts {args.parts} measures no compute, and --out {args.out} does not exist to take it from: "
            "calibrate with --parts compute,network, or copy a machine file of this host to --out first"
        )
    machine = load(args.out) if os.path.exists(args.out) else None

    def memory(result: dict[str, Any]) -> float:
        return args.memory_gib * 2**30 if args.memory_gib else host_memory() / max(result["world"], 1)

    start = time.perf_counter()
    if launch.detect().launcher in ("torchrun", "mpi", "slurm"):
        grid = runtime.init(grid=(1, 1, 1, -1))
        result = measure_world(
            grid,
            dtypes,
            args.reps,
            log=print if grid.rank == 0 else (lambda s: None),
            passes=args.passes,
            step_model=args.step_model,
            parts=parts,
        )
        rank = grid.rank
        runtime.shutdown()
        if rank != 0:
            return 0
        machine = merge(machine, result, args.name, memory(result))
        machine.save(args.out)
    else:
        for w in args.ranks.split(","):
            result = run_local(int(w), _measure_spawned, dtypes, args.reps, args.passes, args.step_model, parts)
            machine = merge(machine, result, args.name, memory(result))
            machine.save(args.out)  # after every world: a later failure keeps what was measured
    assert machine is not None
    _summarise(machine, args, time.perf_counter() - start)
    return 0


def _summarise(machine: Machine, args: argparse.Namespace, elapsed: float) -> None:
    print(f"calibrated {args.name} in {elapsed:.0f} s: {args.out}")
    for c in machine.comm:
        if c.op == "all_reduce":
            a, b = c.alpha_beta()
            print(
                f"  all_reduce group {c.group} stride {c.stride} ({c.world} ranks): α {a * 1e6:.0f} µs, β {b / 1e9:.2f} GB/s"
            )
    for w, scale in sorted(machine.step_scale.items(), key=lambda kv: int(kv[0])):
        print(f"  in-step scale ({w} ranks): {stepfit.describe(scale)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
