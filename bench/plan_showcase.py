"""AxoNN's showcase job priced by the planner: before (the options it had) and after (one search over
every option), with an ablation (issues 31 and 39).

For each job — 80B on 1024 Perlmutter GPUs with a batch of 2048, 20B on 512 with 1024 by default —
three searches of ``axon4d.plan.search.plan`` with the shipped machine file's figures:

- **before**: what the planner could choose until now: the grid and one recomputation mode, with one
  micro-batch, the optimizer unsharded over data, no activation offload, bf16 weight gathers and
  whole sequences; the best of the four modes that fits;
- **after**: the defaults of ``axon4d plan`` — every option searched;
- **ablation**: the after search again with one option pinned to its before value at a time
  (recomputation to ``full``, the one mode that fit the 80B job before; micro-batches 1; ZeRO 0;
  no offload; no FP8 gathers; whole sequences), and the MFU lost;
- **sensitivity**: the after plan with every priced compute 10% slower (a correction of the
  machine's in-step scale, ``axon4d.plan.correction``), as it is and searched again;
- **precision**: the after search in each precision preset a GPU job can train in — the default
  ``bf16-fp32-reduce`` (fp32 gradient reductions: dW's reduce-scatters move 4 bytes per element;
  FP8 gathers searched, ``bf16-fp8-gather``) and ``bf16`` (bf16 reductions, as AxoNN reduces;
  no FP8 gathers: no preset joins them).

Every plan is held to what the machine file says a node has: device memory less the CUDA
context, workspaces, NCCL buffers and fragmentation, and host memory per node less its reserve
for what the node's ranks pin (docs/planner.md).

These are predictions of the cost model (its GPU figures are published peaks derated by the stated
assumptions of ``axon4d/plan/machines/perlmutter.json``; the model itself is measured on CPUs,
docs/planner.md), not GPU runs. Nothing is timed: it takes a few seconds.

    .venv/bin/python bench/plan_showcase.py

Saves ``bench/results/plan_showcase.json`` (every search's top candidates with their options, time
parts and memory, and the header of bench/common.py); the last lines are, per job,
``plan: 80B on 1024 × perlmutter, batch 2048: before B% → after A% model-FLOPs MFU (predicted; grid G, options O)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402

from axon4d.options.recompute_mode import RECOMPUTE_MODES  # noqa: E402
from axon4d.plan import correction as corrections  # noqa: E402
from axon4d.plan.candidate import Candidate, evaluate  # noqa: E402
from axon4d.plan.machine import load  # noqa: E402
from axon4d.plan.search import plan  # noqa: E402

#: the options the planner had before, each pinned to the value it then always had
BEFORE = {"micro_batches": 1, "zero": 0, "offload": 0, "fp8_gather": False, "context_parallel": False}
#: each option of the search, and the before value its ablation pins it to
ABLATION = {
    "recompute": "full",
    "micro_batches": 1,
    "zero": 0,
    "offload": 0,
    "fp8_gather": False,
    "context_parallel": False,
}
#: the precision presets the after search is repeated in (the first is the default, ``after``)
PRESETS = ("bf16-fp32-reduce", "bf16")
#: the sensitivity's factor on every priced compute (GEMMs 10% slower, and the rest with them)
SLOWER = 1.1
#: the jobs: (model, GPUs, batch)
JOBS = (("80B", 1024, 2048), ("20B", 512, 1024))


#: the fields of ``Candidate.to_json`` the result file keeps for each plan (with its options and memory)
ROW_FIELDS = (
    "grid",
    "context_parallel",
    "overlap",
    "fits",
    "step_s",
    "mfu",
    "compute_s",
    "optimizer_s",
    "offload_s",
    "comm_s",
    "hidden_s",
    "comm_by_axis_s",
)


def _row(c: Candidate) -> dict[str, Any]:
    """One candidate as the result file keeps it: its grid and options, time parts and memory (GiB)."""
    j = c.to_json()
    return {
        **{k: j[k] for k in ROW_FIELDS[:2]},
        **c.options,
        **{k: j[k] for k in ROW_FIELDS[2:]},
        "memory_gib": {k: v / 2**30 for k, v in j["memory"].items()},
    }


def before(model: str, gpus: int, machine: str, batch: int) -> tuple[Candidate | None, dict[str, Any]]:
    """The best plan of the options the planner had: each recomputation mode alone, the rest pinned."""
    per_mode: dict[str, Any] = {}
    best: Candidate | None = None
    for mode in RECOMPUTE_MODES:
        result = plan(model, gpus, machine, batch, overlap="all", recompute=mode, **BEFORE)
        fitting = [c for c in result.candidates if c.fits]
        per_mode[mode] = _row(fitting[0]) if fitting else {"fits": False, "advice": result.no_fit_advice()}
        if fitting and (best is None or fitting[0].time.step_s < best.time.step_s):
            best = fitting[0]
    return best, per_mode


def job(model: str, gpus: int, machine: str, batch: int, top: int) -> dict[str, Any]:
    """Before, after and the ablation of one job."""
    old, per_mode = before(model, gpus, machine, batch)
    after = plan(model, gpus, machine, batch, overlap="all", top=top)
    new = after.best
    ablation = {}
    for option, value in ABLATION.items():
        pinned = plan(model, gpus, machine, batch, overlap="all", top=top, **{option: value})
        fitting = [c for c in pinned.candidates if c.fits]
        ablation[option] = {
            "pinned_to": value,
            "best": _row(fitting[0]) if fitting else None,
            "mfu": fitting[0].mfu if fitting else None,
            "mfu_lost": new.mfu - fitting[0].mfu if fitting else None,
        }
    # sensitivity: every priced compute (the GEMMs with it) 10% slower, the plan searched again and
    # the chosen plan priced as it is (a correction of the machine's in-step scale, axon4d.plan.correction)
    slower = corrections.apply(load(machine), corrections.Correction(machine, gpus, SLOWER, 1.0))
    replanned = plan(model, gpus, slower, batch, overlap="all", top=top)
    same = evaluate(after.workload, new.shape, slower, new.overlap, new.recompute, **_step_options(new))
    sensitivity = {
        "compute_factor": SLOWER,
        "replanned": _row(replanned.best),
        "replanned_options": replanned.best.options_spec(),
        "same_plan_mfu": same.mfu,
    }
    presets = {}
    for preset in PRESETS[1:]:
        other = plan(model, gpus, machine, batch, overlap="all", top=top, precision=preset)
        fitting = [c for c in other.candidates if c.fits]
        presets[preset] = {
            "best": _row(fitting[0]) if fitting else None,
            "options": fitting[0].options_spec() if fitting else None,
        }
    return {
        "model": model,
        "gpus": gpus,
        "machine": machine,
        "batch": batch,
        "precision": after.workload.preset,
        "other_precisions": presets,
        "before": {"best": _row(old) if old else None, "per_recompute_mode": per_mode},
        "after": {
            "best": _row(new),
            "options": new.options_spec(),
            "searched_grids": after.searched,
            "valid_grids": after.valid,
            "top": [_row(c) for c in after.candidates if c.fits][:top],
        },
        "ablation": ablation,
        "sensitivity": sensitivity,
    }


def _step_options(c: Candidate) -> dict[str, Any]:
    """A candidate's step options as ``evaluate`` takes them (recomputation aside)."""
    return {k: v for k, v in c.options.items() if k != "recompute"}


def headline(r: dict[str, Any]) -> str:
    """``plan: 80B on 1024 × perlmutter, batch 2048: before B% → after A% ...``."""
    old, new = r["before"]["best"], r["after"]["best"]
    was = f"{100 * old['mfu']:.1f}%" if old else "nothing fits"
    return (
        f"plan: {r['model']} on {r['gpus']} × {r['machine']}, batch {r['batch']}: before {was} → after "
        f"{100 * new['mfu']:.1f}% model-FLOPs MFU (predicted; grid {tuple(new['grid'])}, {r['after']['options']})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", default="perlmutter")
    p.add_argument("--top", type=int, default=5, help="fitting candidates kept per search")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_showcase.json"))
    args = p.parse_args(argv)
    head = common.header()
    results = [job(model, gpus, args.machine, batch, args.top) for model, gpus, batch in JOBS]
    for r in results:
        print(f"\n{r['model']} on {r['gpus']}: ablation (each option pinned to its before value; MFU lost):")
        for option, a in r["ablation"].items():
            mfu = f"{100 * a['mfu']:.1f}%" if a["mfu"] is not None else "nothing fits"
            lost = f"{100 * a['mfu_lost']:+.1f} points" if a["mfu_lost"] is not None else ""
            print(f"  {option} = {a['pinned_to']}: {mfu} {lost}")
        sens = r["sensitivity"]
        print(
            f"  compute {sens['compute_factor']:.1f}x slower: the same plan {100 * sens['same_plan_mfu']:.1f}%, "
            f"searched again {100 * sens['replanned']['mfu']:.1f}% on {tuple(sens['replanned']['grid'])}, "
            f"{sens['replanned_options']}"
        )
        for preset, o in r["other_precisions"].items():
            b = o["best"]
            what = f"{100 * b['mfu']:.1f}% on {tuple(b['grid'])}, {o['options']}" if b else "nothing fits"
            print(f"  in precision {preset} instead of {r['precision']}: {what}")
    common.save(args.out, {"jobs": results}, head)
    print()
    for r in results:
        print(headline(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
