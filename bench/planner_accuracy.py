"""How right is the planner? Measure step time and per-rank peak memory of a transformer workload on
many grids of this machine and compare with the planner's predictions (docs/design.md §6).

    .venv/bin/python bench/planner_accuracy.py                 # calibrates first if no machine file
    .venv/bin/python bench/planner_accuracy.py --calibrate     # re-measure the machine

Workload: ``axon4d.measure.probe.ProbeModel`` — transformer blocks of axon4d.Linear layers in the
block's layouts (QKV normal, attention output transposed, MLP up normal, MLP down transposed),
causal attention on the local heads, vocab-parallel head, Adam — at the shapes of
``ModelConfig.linear_shapes()``. Every valid grid of 8 ranks is run, plus some of 4 and 2 ranks,
in ``--rounds`` interleaved rounds (the median over rounds is kept: the host is shared).

Time: ``--steps`` steps back to back between two barriers (as training runs them), the slowest
rank's span divided by the steps; the median over rounds. Memory, in a pass after all timing
(``axon4d.measure.probe.measure_peak``): the peak of live torch allocations over one step, from
torch's MemTracker (parameters, gradients, optimizer state, activations, temporaries, collective
buffers; not gloo's own host buffers), maximum over ranks. The communication log's bytes per axis
are checked against the planner's.

Calibration (``--calibrate``, or no machine file yet) runs ``axon4d calibrate`` (tables,
collectives, interference). The machine's in-step scale (axon4d.plan.stepfit) is then fitted to
steps of this workload on the step-calibration grids (``stepfit.calibration_grids``), timed in
this run's rounds alternating with the grids compared (``--fit-steps run``, the default) and saved
into the machine file: the host's speed drifts between jobs by more than the target error (the
calibration job's steps of a grid and a later job's differed by up to 15%), and steps timed in
the same rounds drift alike. Every grid compared is timed separately from its calibration steps.
``--fit-steps machine`` keeps the machine file's scale (``axon4d calibrate --step-model``, fitted
in its own job). The step-calibration grids are marked in the table; the JSON summary also gives
the error on the other grids (held out) and of the model without the scale.

Saves bench/results/planner_accuracy.json (with the result header of bench/common.py) and
docs/planner_accuracy.png and ends with
``planner: median error = M%, worst = W%, top-1 gap = G%, memory error = E%``.

``--options`` prices the step options instead (``options_accuracy``): micro-batches and ZeRO-1/2
on six 8-rank grids with a data axis, each beside its plain step in the same rounds; the in-step
scale is refitted to the plain steps alone, and the option steps are predicted with it. Saves
bench/results/planner_accuracy_options.json; the last line is
``planner options: median error = M%, worst = W% over N steps with micro-batches or ZeRO ...``.

``--moe`` prices Mixture-of-Experts steps instead (``moe_accuracy``): the probe with an MoE layer in
each block's MLP place (``--experts``, ``--top-k``, ``--expert-ffn``, ``--shared``) on every 8-rank
grid it allows, alternating in the same rounds with the dense probe's step-calibration grids; the
in-step scale is fitted to the dense steps alone, so every MoE step is held out. Each grid is
priced under uniform routing and at the imbalance its steps measured. Saves
bench/results/planner_accuracy_moe.json; the last line is
``planner MoE: median error = M%, worst = W% over N grids (uniform routing; ...), top-1 gap = G%, memory error = E%``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import common  # noqa: E402

from axon4d.grid.shape import GridShape, factorizations  # noqa: E402
from axon4d.options.overlap_policy import OverlapPolicy  # noqa: E402
from axon4d.plan import (  # noqa: E402
    Workload,
    evaluate,
    load,
    stepfit,
)
from axon4d.plan.stepfit import Sample, parse_model  # noqa: E402
from axon4d.plan.stepfit import describe as describe_scale  # noqa: E402

GRIDS_4 = [(2, 2, 1, 1), (1, 1, 1, 4), (2, 1, 2, 1), (1, 2, 1, 2), (4, 1, 1, 1)]
GRIDS_2 = [(2, 1, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1)]


#: the default workload (also the one bench/gemm_in_step.py profiles)
WORKLOAD = {"layers": 2, "hidden": 512, "heads": 8, "vocab": 2048, "seq": 128, "batch": 8, "dtype": "float32"}


def workload_spec(args: argparse.Namespace) -> str:
    """The workload as ``axon4d calibrate --step-model`` takes it (axon4d.plan.stepfit.parse_model)."""
    return (
        f"layers={args.layers},hidden={args.hidden},heads={args.heads},ffn={4 * args.hidden},vocab={args.vocab},"
        f"seq={args.seq},batch={args.batch},dtype={args.dtype}"
    )


def workload(args: argparse.Namespace) -> Workload:
    """The workload ``ProbeModel`` runs (no embedding, no norms)."""
    return parse_model(workload_spec(args), name="probe")


def _time_grid(grid, wl: Workload, steps: int) -> dict:
    import torch

    from axon4d.measure.probe import ProbeModel, measure_step

    torch.manual_seed(0)
    return measure_step(ProbeModel(wl, grid), steps=steps)


def _time_options(grid, wl: Workload, steps: int, options: dict) -> dict:
    """``_time_grid`` with step options: ``micro_batches`` passes of batch/k, Adam sharded over data
    at ZeRO stage ``zero``."""
    import torch

    from axon4d.measure.probe import ProbeModel, measure_step

    k = options.get("micro_batches", 1)
    torch.manual_seed(0)
    micro = dataclasses.replace(wl, batch=wl.batch // k)
    return measure_step(ProbeModel(micro, grid), steps=steps, micro_batches=k, zero=options.get("zero", 0))


#: the step options ``--options`` times on ``OPTION_GRIDS`` (beside each grid's plain step)
OPTION_SETS = {"micro_batches=2": {"micro_batches": 2}, "zero=1": {"zero": 1}, "zero=2": {"zero": 2}}
#: 8-rank grids with a data axis (for ZeRO) and two sequences per rank (for micro-batches)
OPTION_GRIDS = [(2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (1, 4, 1, 2), (4, 1, 1, 2), (2, 1, 1, 4)]


def options_accuracy(args: argparse.Namespace, machine_path: str, head: dict) -> int:
    """``--options``: the step options priced against measured steps. In ``--rounds`` interleaved
    rounds each of ``OPTION_GRIDS`` runs its plain step and each option of ``OPTION_SETS``; the
    machine's in-step scale is refitted to the plain steps of this run (the same grids), and the
    option steps — work it was not fitted to — are predicted with it."""
    from harness import RankPool

    machine = load(machine_path)
    wl = workload(args)
    overlap = OverlapPolicy.parse(args.overlap)
    jobs = [(g, name) for g in OPTION_GRIDS for name in ("plain", *OPTION_SETS)]
    times: dict[tuple, list[float]] = {j: [] for j in jobs}
    start = time.perf_counter()
    pool = RankPool(8, start_timeout=900)
    try:
        for r in range(args.rounds):
            for g, name in jobs if r % 2 == 0 else jobs[::-1]:
                got = pool.run(
                    g, _time_options, wl, args.steps, OPTION_SETS.get(name, {}), timeout=600, overlap=args.overlap
                )
                times[(g, name)].append(got[0]["step_s"])
                print(f"round {r + 1}/{args.rounds} {g} {name}: {got[0]['step_s'] * 1e3:.0f} ms", flush=True)
    finally:
        pool.close()
    samples = [dataclasses.asdict(Sample.of(g, wl, times[(g, "plain")])) for g in OPTION_GRIDS]
    stepfit.store(machine, {8}, samples, "fitted to the plain steps of bench/planner_accuracy.py --options")
    rows = []
    for (g, name), got in times.items():
        options = OPTION_SETS.get(name, {})
        cand = evaluate(wl, GridShape(*g), machine, overlap, **options)
        step = statistics.median(got)
        rows.append(
            {
                "grid": list(g),
                "options": name,
                "measured_step": step,
                "rounds_step": got,
                "predicted_step": cand.time.step_s,
                "time_error": (cand.time.step_s - step) / step,
                "fitted": name == "plain",
            }
        )
        print(
            f"{str(g):<14} {name:<16} {step * 1e3:>8.0f} ms measured {cand.time.step_s * 1e3:>8.0f} ms "
            f"planned {100 * (cand.time.step_s - step) / step:>+6.1f}%"
        )
    held = [abs(r["time_error"]) for r in rows if not r["fitted"]]
    summary = {
        "median_time_error_options": statistics.median(held),
        "worst_time_error_options": max(held),
        "option_steps": len(held),
        "step_scale": machine.step_scale.get("8"),
        "seconds": time.perf_counter() - start,
    }
    out = (
        args.out
        if args.out != os.path.join(ROOT, "bench/results/planner_accuracy.json")
        else os.path.join(ROOT, "bench/results/planner_accuracy_options.json")
    )
    common.save(out, {"args": vars(args), "machine": machine_path, "rows": rows, "summary": summary}, head)
    print(
        f"planner options: median error = {100 * summary['median_time_error_options']:.1f}%, worst = "
        f"{100 * summary['worst_time_error_options']:.1f}% over {len(held)} steps with micro-batches or ZeRO "
        "(scale fitted to the plain steps only)"
    )
    return 0


#: ``--moe``: the MoE layer in each block's MLP's place — 8 experts, top-2, each half the dense
#: MLP's width (a token's k·f = the dense 4·hidden), no shared experts
MOE = {"experts": 8, "top_k": 2, "expert_ffn": 2 * WORKLOAD["hidden"], "shared": 0}


def moe_workload(args: argparse.Namespace) -> Workload:
    """The ``--moe`` workload: ``workload(args)`` with the MoE layer of ``--experts`` experts,
    top-``--top-k``, ``--expert-ffn`` wide, ``--shared`` shared experts in each block's MLP's place."""
    wl = workload(args)
    model = wl.model.replace(
        name="probe-moe",
        n_experts=args.experts,
        experts_per_token=args.top_k,
        expert_ffn=args.expert_ffn,
        shared_experts=args.shared,
    )
    return dataclasses.replace(wl, model=model)


def _time_moe(grid, wl: Workload, steps: int) -> dict:
    """``_time_grid`` of an MoE workload, with the last step's routing imbalance per layer: the
    busiest expert-parallel rank's rows over the mean (``Workload.imbalance``'s ρ; 1 on one rank)."""
    import torch

    from axon4d.measure.probe import ProbeModel, measure_step
    from axon4d.nn.moe import MoE

    torch.manual_seed(0)
    model = ProbeModel(wl, grid)
    got = measure_step(model, steps=steps)
    ep = grid.size("batch")
    rho = []
    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        counts = layer.tokens_per_expert or []
        local = len(counts) // ep
        rows = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]  # rows each ep rank computes
        rho.append(max(rows) / statistics.mean(rows))
    return {**got, "imbalance": rho}


def moe_accuracy(args: argparse.Namespace, machine_path: str, head: dict) -> int:
    """``--moe``: Mixture-of-Experts steps priced against measured ones. In ``--rounds`` interleaved
    rounds every 8-rank grid the MoE workload allows runs its MoE step, alternating with the dense
    workload's step-calibration grids (``stepfit.calibration_grids``); the in-step scale is fitted
    to the dense steps alone, so every MoE step is held out: its router, all-to-alls, grouped GEMMs
    and row copies are priced by ``axon4d.plan.moe_cost`` with weights fitted to steps that had
    none. Each grid is predicted under uniform routing (the planner's default) and at the routing
    imbalance its steps measured (``--imbalance`` = ρ). Peak memory is measured last."""
    from harness import RankPool

    machine = load(machine_path)
    dense, wl = workload(args), moe_workload(args)
    overlap = OverlapPolicy.parse(args.overlap)
    grids = [s.as_tuple() for s in factorizations(8) if not wl.grid_problems(s)]
    if args.only:
        grids = [tuple(int(v) for v in g.split(",")) for g in args.only.split(";")]
    calibration = stepfit.calibration_grids(8, dense)
    jobs = _jobs(grids, calibration)
    times: dict[tuple, list[dict]] = {j: [] for j in jobs}
    start = time.perf_counter()
    pool = RankPool(8, start_timeout=900)
    try:
        for r in range(args.rounds):
            for kind, g in jobs if r % 2 == 0 else jobs[::-1]:
                if kind == "grid":
                    got = pool.run(g, _time_moe, wl, args.steps, timeout=600, overlap=args.overlap)[0]
                else:
                    got = pool.run(g, _time_grid, dense, args.steps, timeout=600, overlap=CALIBRATION_POLICY)[0]
                times[(kind, g)].append(got)
                print(f"round {r + 1}/{args.rounds} {kind} {g}: {got['step_s'] * 1e3:.0f} ms", flush=True)
        peaks = {}
        for g in grids:
            peaks[g] = pool.run(g, _peak_grid, wl, timeout=600, overlap=args.overlap)[0]
            print(f"memory pass grid {g}: peak {peaks[g] / 2**20:.1f} MiB", flush=True)
    finally:
        pool.close()
    samples = [
        dataclasses.asdict(Sample.of(g, dense, [t["step_s"] for t in times[("calibration", g)]])) for g in calibration
    ]
    stepfit.store(machine, {8}, samples, "fitted to the dense steps of bench/planner_accuracy.py --moe")
    rows = []
    for g in grids:
        got = times[("grid", g)]
        step = statistics.median(t["step_s"] for t in got)
        rho = statistics.mean(v for t in got for v in t["imbalance"])
        uniform = evaluate(wl, GridShape(*g), machine, overlap)
        routed = evaluate(dataclasses.replace(wl, imbalance=rho), GridShape(*g), machine, overlap)
        logged = {a: int(v) for a, v in got[0]["bytes_by_axis"].items()}
        rows.append(
            {
                "grid": list(g),
                "measured_step": step,
                "rounds_step": [t["step_s"] for t in got],
                "imbalance": rho,
                "predicted_step": uniform.time.step_s,
                "time_error": (uniform.time.step_s - step) / step,
                "predicted_step_at_imbalance": routed.time.step_s,
                "time_error_at_imbalance": (routed.time.step_s - step) / step,
                "time_error_unscaled": (sum(uniform.time.parts) - step) / step,
                "measured_mem": peaks[g],
                "predicted_mem": uniform.mem.peak,
                "mem_error": (uniform.mem.peak - peaks[g]) / peaks[g],
                "predicted_mem_at_imbalance": routed.mem.peak,
                "mem_error_at_imbalance": (routed.mem.peak - peaks[g]) / peaks[g],
                "collectives_logged": got[0]["collectives"],
                "collectives_predicted": uniform.time.collectives,
                "bytes_logged": logged,
                "bytes_predicted": uniform.time.bytes_by_axis,
                "prediction": uniform.to_json(),
            }
        )
    print(
        f"\n{'grid':<14} {'meas ms':>8} {'pred ms':>8} {'err':>7} {'rho':>5} {'at rho':>7} "
        f"{'meas MiB':>9} {'pred MiB':>9} {'err':>7} {'calls':>11}"
    )
    for r in rows:
        print(
            f"{str(tuple(r['grid'])):<14} {r['measured_step'] * 1e3:>8.0f} {r['predicted_step'] * 1e3:>8.0f} "
            f"{100 * r['time_error']:>+6.1f}% {r['imbalance']:>5.2f} {100 * r['time_error_at_imbalance']:>+6.1f}% "
            f"{r['measured_mem'] / 2**20:>9.1f} {r['predicted_mem'] / 2**20:>9.1f} {100 * r['mem_error']:>+6.1f}% "
            f"{r['collectives_logged']:>5}/{r['collectives_predicted']:<5}"
        )
    errs = [abs(r["time_error"]) for r in rows]
    at_rho = [abs(r["time_error_at_imbalance"]) for r in rows]
    fastest = min(rows, key=lambda r: r["measured_step"])
    chosen = min(rows, key=lambda r: r["predicted_step"])
    gap = (chosen["measured_step"] - fastest["measured_step"]) / fastest["measured_step"]
    summary = {
        "median_time_error": statistics.median(errs),
        "worst_time_error": max(errs),
        "median_time_error_at_imbalance": statistics.median(at_rho),
        "worst_time_error_at_imbalance": max(at_rho),
        "median_time_error_unscaled": statistics.median(abs(r["time_error_unscaled"]) for r in rows),
        "top1_gap": gap,
        "planner_choice": chosen["grid"],
        "fastest_measured": fastest["grid"],
        "median_memory_error": statistics.median(abs(r["mem_error"]) for r in rows),
        "worst_memory_error": max(abs(r["mem_error"]) for r in rows),
        "worst_memory_error_at_imbalance": max(abs(r["mem_error_at_imbalance"]) for r in rows),
        "step_scale": machine.step_scale.get("8"),
        "calibration_grids": [list(g) for g in calibration],
        "round_spread_median": statistics.median(
            (max(r["rounds_step"]) - min(r["rounds_step"])) / r["measured_step"] for r in rows
        ),
        "seconds": time.perf_counter() - start,
    }
    out = (
        args.out
        if args.out != os.path.join(ROOT, "bench/results/planner_accuracy.json")
        else os.path.join(ROOT, "bench/results/planner_accuracy_moe.json")
    )
    result = {
        "args": vars(args),
        "workload": {"model": wl.model.__dict__, "batch": wl.batch, "dtype": wl.dtype},
        "machine": machine_path,
        "overlap": overlap.spec(),
        "calibration_steps": {str(g): [t["step_s"] for t in times[("calibration", g)]] for g in calibration},
        "rows": rows,
        "summary": summary,
    }
    common.save(out, result, head)
    print(f"in-step scale (8 ranks, fitted to the dense steps only): {describe_scale(summary['step_scale'])}")
    print(
        f"the same grid's step time moved by {100 * summary['round_spread_median']:.0f}% (median) between rounds; "
        f"planner's choice {tuple(chosen['grid'])}, fastest measured {tuple(fastest['grid'])}"
    )
    print(f"saved {out}")
    print(
        f"planner MoE: median error = {100 * summary['median_time_error']:.1f}%, worst = "
        f"{100 * summary['worst_time_error']:.1f}% over {len(rows)} grids (uniform routing; at the measured imbalance "
        f"{100 * summary['median_time_error_at_imbalance']:.1f}%, {100 * summary['worst_time_error_at_imbalance']:.1f}%), "
        f"top-1 gap = {100 * gap:.1f}%, memory error = {100 * summary['worst_memory_error']:.1f}%"
    )
    return 0


def _peak_grid(grid, wl: Workload) -> int:
    """Peak bytes of one step, maximum over ranks — only after all timing in the process (see
    ``axon4d.measure.probe.measure_peak``)."""
    import torch

    from axon4d.measure.probe import ProbeModel, measure_peak

    torch.manual_seed(0)
    return measure_peak(ProbeModel(wl, grid))


#: the overlap policy the step calibration times (as ``axon4d calibrate --step-model`` does: the default)
CALIBRATION_POLICY = OverlapPolicy().spec()


def _jobs(grids: list[tuple], calibration: list[tuple]) -> list[tuple[str, tuple]]:
    """The grids to compare ("grid") and the step-calibration grids ("calibration") of one world,
    alternated, so that both see the host's drift alike."""
    a, b = [("grid", g) for g in grids], [("calibration", g) for g in calibration]
    out = []
    for i in range(max(len(a), len(b))):
        out += a[i : i + 1] + b[i : i + 1]
    return out


def measure(
    wl: Workload,
    grids: list[tuple[int, ...]],
    rounds: int,
    steps: int,
    overlap: str,
    calibration: dict[int, list[tuple]],
) -> tuple[dict[tuple, list[dict]], dict[tuple, list[dict]], dict[tuple, int]]:
    """Time every grid and every step-calibration grid ``rounds`` times, interleaved (``_jobs``),
    then measure peak memory in a last pass, each pass in fresh rank processes. Returns (per grid
    rank 0's result of each round, the same for the step-calibration grids, per grid peak bytes)."""
    from harness import RankPool

    times: dict[tuple, list[dict]] = {g: [] for g in grids}
    cal: dict[tuple, list[dict]] = {g: [] for gs in calibration.values() for g in gs}
    peaks: dict[tuple, int] = {}
    by_world: dict[int, list[tuple]] = {}
    for g in grids:
        by_world.setdefault(GridShape(*g).world_size, []).append(g)
    for r in range(rounds + 1):
        for world, gs in sorted(by_world.items(), reverse=True):
            pool = RankPool(world, start_timeout=900)
            try:
                if r == rounds:
                    for g in gs:
                        peaks[g] = pool.run(g, _peak_grid, wl, timeout=600, overlap=overlap)[0]
                        print(f"memory pass grid {g}: peak {peaks[g] / 2**20:.1f} MiB", flush=True)
                    continue
                for kind, g in _jobs(gs, calibration.get(world, [])):
                    policy = overlap if kind == "grid" else CALIBRATION_POLICY
                    got = pool.run(g, _time_grid, wl, steps, timeout=600, overlap=policy)[0]
                    (times if kind == "grid" else cal)[g].append(got)
                    print(f"round {r + 1}/{rounds} {kind} {g}: {got['step_s'] * 1e3:.0f} ms", flush=True)
            finally:
                pool.close()
    return times, cal, peaks


def measure_launched(
    wl: Workload, grids: list[tuple[int, ...]], rounds: int, steps: int, overlap: str, calibration: list[tuple]
) -> tuple[dict[tuple, list[dict]], dict[tuple, list[dict]], dict[tuple, int]] | None:
    """Under torchrun/srun/mpirun (or bench/cluster.py): every grid and step-calibration grid of
    this one world, in this job, timing first and memory last (as ``measure``). Returns the
    results on rank 0, None on the others."""
    import axon4d

    rank = 0

    def run(g: tuple[int, ...], fn: Callable[..., Any], *args: object, policy: str = overlap) -> Any:
        nonlocal rank
        grid = axon4d.init(grid=g, overlap=policy)
        rank = grid.rank
        try:
            return fn(grid, *args)
        finally:
            axon4d.shutdown()

    times: dict[tuple, list[dict]] = {g: [] for g in grids}
    cal: dict[tuple, list[dict]] = {g: [] for g in calibration}
    for r in range(rounds):
        for kind, g in _jobs(grids, calibration):
            got = run(g, _time_grid, wl, steps, policy=overlap if kind == "grid" else CALIBRATION_POLICY)
            (times if kind == "grid" else cal)[g].append(got)
            if rank == 0:
                print(f"round {r + 1}/{rounds} {kind} {g}: {got['step_s'] * 1e3:.0f} ms", flush=True)
    peaks = {g: run(g, _peak_grid, wl) for g in grids}
    return (times, cal, peaks) if rank == 0 else None


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, key, unit, scale in (
        (axes[0], "step", "step time (ms)", 1e3),
        (axes[1], "mem", "peak memory per rank (MiB)", 2**-20),
    ):
        for world, marker in ((8, "o"), (4, "s"), (2, "^")):
            sel = [r for r in rows if r["world"] == world]
            if sel:
                ax.scatter(
                    [r[f"measured_{key}"] * scale for r in sel],
                    [r[f"predicted_{key}"] * scale for r in sel],
                    marker=marker,
                    label=f"{world} ranks",
                )
        lo = min(min(r[f"measured_{key}"], r[f"predicted_{key}"]) for r in rows) * scale * 0.9
        hi = max(max(r[f"measured_{key}"], r[f"predicted_{key}"]) for r in rows) * scale * 1.1
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="exact")
        ax.fill_between([lo, hi], [lo * 0.95, hi * 0.95], [lo * 1.05, hi * 1.05], color="grey", alpha=0.2, label="±5%")
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.legend(fontsize=8)
    axes[0].set_title("planner vs measured: time")
    axes[1].set_title("planner vs measured: memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", default=os.path.join(ROOT, "bench/results/planner_machine_local.json"))
    p.add_argument("--calibrate", action="store_true", help="re-measure the machine before the run")
    p.add_argument(
        "--fit-steps",
        choices=("run", "machine"),
        default="run",
        help="run: fit the machine's in-step scale to steps of the step-calibration grids timed in this "
        "run, interleaved with the grids compared (saved into the machine file); machine: keep the "
        "scale the machine file has (from `axon4d calibrate --step-model`, another job)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=WORKLOAD["layers"])
    p.add_argument("--hidden", type=int, default=WORKLOAD["hidden"])
    p.add_argument("--heads", type=int, default=WORKLOAD["heads"])
    p.add_argument("--vocab", type=int, default=WORKLOAD["vocab"])
    p.add_argument("--seq", type=int, default=WORKLOAD["seq"])
    p.add_argument("--batch", type=int, default=WORKLOAD["batch"], help="sequences per step")
    p.add_argument("--dtype", default=WORKLOAD["dtype"])
    p.add_argument(
        "--overlap", default="all", help="overlap policy for the run and the planner (all, off, oag,oar,...)"
    )
    p.add_argument("--only", default="", help="semicolon-separated grids x,y,z,d to run instead of the default set")
    p.add_argument(
        "--options",
        action="store_true",
        help="price the step options (micro-batches, ZeRO-1/2) against measured steps on 8-rank grids instead "
        "(bench/results/planner_accuracy_options.json)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="price Mixture-of-Experts steps against measured ones on every 8-rank grid, the in-step scale "
        "fitted to dense steps only (bench/results/planner_accuracy_moe.json)",
    )
    p.add_argument("--experts", type=int, default=MOE["experts"], help="--moe: routed experts per block")
    p.add_argument("--top-k", type=int, default=MOE["top_k"], help="--moe: experts per token")
    p.add_argument("--expert-ffn", type=int, default=MOE["expert_ffn"], help="--moe: each expert's FFN width")
    p.add_argument("--shared", type=int, default=MOE["shared"], help="--moe: shared experts per block")
    p.add_argument("--from-json", default=None, help="recompute predictions for the measurements saved in this JSON")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/planner_accuracy.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs/planner_accuracy.png"))
    args = p.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from axon4d.grid import launch

    launched = launch.detect().launcher in ("torchrun", "mpi", "slurm")
    head = common.header()
    if launched and not os.path.exists(args.machine):
        raise SystemExit(
            f"{args.machine} does not exist: calibrate first, in the same kind of job "
            f"(python -m axon4d.measure.calibrate --out {args.machine})"
        )
    if not launched and not args.from_json and (args.calibrate or not os.path.exists(args.machine)):
        if os.path.exists(args.machine):
            os.remove(args.machine)
        steps = ["--step-model", workload_spec(args)] if args.fit_steps == "machine" else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "axon4d.measure.calibrate",
                "--ranks",
                "2,4,8",
                "--dtypes",
                args.dtype,
                *steps,
                "--out",
                args.machine,
            ],
            check=True,
        )
    if args.options:
        return options_accuracy(args, args.machine, head)
    if args.moe:
        return moe_accuracy(args, args.machine, head)
    machine = load(args.machine)
    wl = workload(args)
    overlap = OverlapPolicy.parse(args.overlap)  # the library's policy, given to axon4d.init and to the planner
    world = int(os.environ.get("WORLD_SIZE", "8")) if launched else 8
    if args.only:
        grids = [tuple(int(v) for v in g.split(",")) for g in args.only.split(";")]
    else:
        grids = [s.as_tuple() for s in factorizations(world) if not wl.grid_problems(s)]
        grids += [] if launched else GRIDS_4 + GRIDS_2
    worlds = sorted({GridShape(*g).world_size for g in grids})
    calibration = {w: stepfit.calibration_grids(w, wl) for w in worlds} if args.fit_steps == "run" else {}
    start = time.perf_counter()
    if args.from_json:  # predictions again (new machine file or planner) for measurements already taken
        with open(args.from_json) as f:
            old = json.load(f)
        measured = {
            tuple(r["grid"]): {
                k: r.get(k)
                for k in (
                    "rounds_step",
                    "measured_mem",
                    "bytes_logged",
                    "measured_comm_blocked_s",
                    "collectives_logged",
                )
            }
            for r in old["rows"]
        }
        grids = list(measured)
        # the job that took the measurements (a re-prediction keeps it; its own args say --from-json)
        measured_by = old.get("measured_by", {"args": old["args"], "seconds": old["summary"]["seconds"]})
    else:
        if launched:
            results = measure_launched(wl, grids, args.rounds, args.steps, args.overlap, calibration.get(world, []))
            if results is None:
                return 0
        else:
            results = measure(wl, grids, args.rounds, args.steps, args.overlap, calibration)
        times, cal, peaks = results
        measured = {
            g: {
                "rounds_step": [r["step_s"] for r in times[g]],
                "measured_mem": peaks[g],
                "bytes_logged": times[g][0]["bytes_by_axis"],
                "collectives_logged": times[g][0]["collectives"],
                "measured_comm_blocked_s": statistics.median(r["blocked_s"] for r in times[g]),
            }
            for g in grids
        }
        measured_by = {"args": vars(args), "seconds": time.perf_counter() - start}
        if cal:  # the in-step scale, fitted to this run's steps of the step-calibration grids
            samples = [dataclasses.asdict(Sample.of(g, wl, [r["step_s"] for r in got])) for g, got in cal.items()]
            stepfit.store(
                machine,
                set(worlds),
                samples,
                "fitted to the steps in step_samples (axon4d.plan.stepfit), "
                "timed by bench/planner_accuracy.py interleaved with the grids it compares",
            )
            machine.save(args.machine)

    # grids whose steps of this very workload the machine's in-step scale was fitted to (axon4d.plan.stepfit)
    fitted_on = {tuple(s["grid"]): s["measured_s"] for s in machine.step_samples if Sample(**s).matches(wl)}
    if machine.step_samples and not fitted_on:
        print(f"note: the machine's in-step scale was fitted to another model ({machine.step_samples[0]['model']})")
    rows = []
    for g in grids:
        shape = GridShape(*g)
        cand = evaluate(wl, shape, machine, overlap)
        got = measured[g]
        step = statistics.median(got["rounds_step"])
        peak = got["measured_mem"]
        logged = {a: int(v) for a, v in got["bytes_logged"].items()}
        rows.append(
            {
                "grid": list(g),
                "world": shape.world_size,
                "measured_step": step,
                "rounds_step": got["rounds_step"],
                "predicted_step": cand.time.step_s,
                "time_error": (cand.time.step_s - step) / step,
                # the same model without the machine's in-step scale (axon4d.plan.stepfit), for comparison
                "predicted_step_unscaled": sum(cand.time.parts),
                "time_error_unscaled": (sum(cand.time.parts) - step) / step,
                "collectives_logged": got["collectives_logged"],
                "collectives_predicted": cand.time.collectives,
                "measured_mem": peak,
                "predicted_mem": cand.mem.peak,
                "mem_error": (cand.mem.peak - peak) / peak,
                "bytes_logged": logged,
                "bytes_predicted": cand.time.bytes_by_axis,
                "bytes_match": logged == cand.time.bytes_by_axis,
                "measured_comm_blocked_s": got["measured_comm_blocked_s"],
                "step_calibration_grid": g in fitted_on,
                "prediction": cand.to_json(),
            }
        )
    print(
        f"\n{'grid':<14} {'meas ms':>8} {'pred ms':>8} {'err':>7} {'meas MiB':>9} {'pred MiB':>9} {'err':>7} {'bytes':>5}"
    )
    for r in rows:
        print(
            f"{str(tuple(r['grid'])):<14} {r['measured_step'] * 1e3:>8.0f} {r['predicted_step'] * 1e3:>8.0f} "
            f"{100 * r['time_error']:>+6.1f}% {r['measured_mem'] / 2**20:>9.1f} {r['predicted_mem'] / 2**20:>9.1f} "
            f"{100 * r['mem_error']:>+6.1f}% {'ok' if r['bytes_match'] else 'DIFF':>5}"
            f"{'  (step calibration grid)' if r['step_calibration_grid'] else ''}"
        )
    errs = [abs(r["time_error"]) for r in rows]
    mem_errs = [abs(r["mem_error"]) for r in rows]
    eight = [r for r in rows if r["world"] == max(x["world"] for x in rows)]
    fastest = min(eight, key=lambda r: r["measured_step"])
    chosen = min(eight, key=lambda r: r["predicted_step"])
    gap = (chosen["measured_step"] - fastest["measured_step"]) / fastest["measured_step"]
    unscaled = [abs(r["time_error_unscaled"]) for r in rows]
    held_out = [abs(r["time_error"]) for r in rows if not r["step_calibration_grid"]]
    summary = {
        "median_time_error": statistics.median(errs),
        "worst_time_error": max(errs),
        "top1_gap": gap,
        "step_scale": machine.step_scale,
        "step_calibration_grids": [s["grid"] for s in machine.step_samples],
        "median_time_error_unscaled": statistics.median(unscaled),
        "worst_time_error_unscaled": max(unscaled),
        # the grids the step calibration did not run (its own grids are timed twice: see below)
        "held_out_grids": len(held_out),
        "median_time_error_held_out": statistics.median(held_out) if held_out else None,
        "worst_time_error_held_out": max(held_out) if held_out else None,
        "planner_choice": chosen["grid"],
        "fastest_measured": fastest["grid"],
        "median_memory_error": statistics.median(mem_errs),
        "worst_memory_error": max(mem_errs),
        "bytes_match_all": all(r["bytes_match"] for r in rows),
        "seconds": time.perf_counter() - start,
        # how much the same grid's time moved between rounds: the noise floor of this measurement
        "round_spread_median": statistics.median(
            (max(r["rounds_step"]) - min(r["rounds_step"])) / r["measured_step"] for r in rows
        ),
    }
    # the same grid timed twice: as a step-calibration step and as a grid compared (in this run's
    # rounds with --fit-steps run; in the calibration job and here with --fit-steps machine)
    between = [
        abs(r["measured_step"] - fitted_on[tuple(r["grid"])]) / fitted_on[tuple(r["grid"])]
        for r in rows
        if r["step_calibration_grid"]
    ]
    summary["step_fit"] = "this run" if calibration and not args.from_json else "machine file"
    if between:
        summary.update(
            {
                "calibration_vs_compared_grids": len(between),
                "calibration_vs_compared_median": statistics.median(between),
                "calibration_vs_compared_worst": max(between),
            }
        )
    result = {
        "args": vars(args),
        "workload": {"model": wl.model.__dict__, "batch": wl.batch, "dtype": wl.dtype},
        "machine": args.machine,
        "overlap": overlap.spec(),
        "summary": summary,
        "rows": rows,
        "measured_by": measured_by,
    }
    common.save(args.out, result, head)
    os.makedirs(os.path.dirname(args.plot), exist_ok=True)
    plot(args.plot, rows)
    for w, k in sorted(machine.step_scale.items(), key=lambda kv: int(kv[0])):
        print(f"in-step scale ({w} ranks, fitted to steps on the step-calibration grids): {describe_scale(k)}")
    print(
        f"without it: median error {100 * summary['median_time_error_unscaled']:.1f}%, "
        f"worst {100 * summary['worst_time_error_unscaled']:.1f}%"
    )
    if fitted_on and held_out:
        print(
            f"on the {len(held_out)} grids the step calibration did not run: median error "
            f"{100 * summary['median_time_error_held_out']:.1f}%, worst {100 * summary['worst_time_error_held_out']:.1f}%"
        )
    print(f"\nthe same grid's step time moved by {100 * summary['round_spread_median']:.0f}% (median) between rounds")
    if between:
        print(
            f"the {len(between)} step-calibration grids' calibration steps ({summary['step_fit']}) and their timing "
            f"here differ by {100 * summary['calibration_vs_compared_median']:.1f}% (median), "
            f"{100 * summary['calibration_vs_compared_worst']:.1f}% at most"
        )
    print(
        f"planner's choice {tuple(chosen['grid'])}, fastest measured {tuple(fastest['grid'])}; "
        f"communication bytes per axis equal the planner's on {sum(r['bytes_match'] for r in rows)}/{len(rows)} grids"
    )
    print(f"saved {args.out} and {args.plot}")
    print(
        f"planner: median error = {100 * summary['median_time_error']:.1f}%, worst = "
        f"{100 * summary['worst_time_error']:.1f}%, top-1 gap = {100 * gap:.1f}%, memory error = "
        f"{100 * summary['worst_memory_error']:.1f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
