"""The planner against what one GPU measured (docs/design.md §6): step times and activation offload.

``make gpu-check`` times, on one GPU, a training step of two Llamas with and without half their
blocks offloaded (``bench/gpu_cases.py``'s ``OFFLOAD_SPEED`` and ``OFFLOAD_WIDE``, bf16 compute),
and ``bench/gpu_block.py`` one block of the 20B width (forward and backward, pure bf16, no
optimizer). ``axon4d calibrate --ranks 1 --parts compute --dtypes bfloat16`` on the same kind of
GPU measured a machine file (``bench/results/machine_h200_one_gpu.json``: its GEMM lattice, attention,
elementwise work and host link). This bench prices the same steps with the planner, on that file
and on the shipped datasheet file ``h100`` (the H200's compute is the H100's), and prints each
beside the measurement: the step without offload, and what offload adds
(``TimeEstimate.offload_s``, ``axon4d.plan.offload_cost.copy_queue``).

    .venv/bin/python bench/gpu_price.py

Saves ``bench/results/gpu_price.json`` (with the header of bench/common.py); the last line is
``gpu price: on the calibrated file steps off by A / B (offload cases), C (20B block); offload +D / +E ms priced, +F / +G ms measured``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import gpu_cases  # noqa: E402

from axon4d.config import ModelConfig  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.plan import Machine, Workload, load  # noqa: E402
from axon4d.plan.cost import step_estimate  # noqa: E402
from axon4d.plan.scenario import Scenario  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
#: the offload timings of gpu_check and the model each ran
CASES = {
    "offload speed x1y1z1d1": gpu_cases.OFFLOAD_SPEED["accelerator"],
    "offload speed wide x1y1z1d1": gpu_cases.OFFLOAD_WIDE["accelerator"],
}
ONE = GridShape(1, 1, 1, 1)


def _error(priced: float, measured: float) -> float:
    return priced / measured - 1.0


def price_offload(cfg: ModelConfig, sequences: int, measured: dict[str, Any], m: Machine) -> dict[str, Any]:
    """One gpu_check offload case priced on ``m`` beside its measurement (seconds)."""
    wl = Workload(cfg, sequences, optimizer="sgd")  # the case steps SGD without momentum
    blocks = round(measured["offload"] * cfg.n_layers)  # axon4d.memory.offload.offload_blocks: the first ⌊f·L + ½⌋
    plain = step_estimate(Scenario(wl, ONE, m))
    offloaded = step_estimate(Scenario(wl, ONE, m, offload=blocks))
    added = measured["offloaded"]["step_s"] - measured["plain"]["step_s"]
    return {
        "blocks": blocks,
        "measured_plain_s": measured["plain"]["step_s"],
        "priced_plain_s": plain.step_s,
        "plain_error": _error(plain.step_s, measured["plain"]["step_s"]),
        "measured_offload_s": added,
        "priced_offload_s": offloaded.offload_s,
        "offload_error": _error(offloaded.offload_s, added),
    }


def price_block(measured: dict[str, Any], m: Machine) -> dict[str, Any]:
    """bench/gpu_block.py's step (one block, forward and backward, no optimizer) priced on ``m``."""
    cfg = ModelConfig(**measured["config"])
    wl = Workload(cfg, 1, embedding=False, head=False, optimizer="sgd")
    est = step_estimate(Scenario(wl, ONE, m))
    priced = est.step_s - est.optimizer_s  # the bench times no optimizer step
    # the pure-bf16 step: files from the fair-baseline bench keep it apart from their headline
    # (bf16 over fp32 weights); older files hold only it
    step = measured.get("pure_bf16", measured)["median_s"]["axon4d"]
    return {"measured_s": step, "priced_s": priced, "error": _error(priced, step)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", default=os.path.join(RESULTS, "gpu_check_nvidia_h200.json"))
    p.add_argument("--block", default=os.path.join(RESULTS, "gpu_block_NVIDIA_H200.json"))
    p.add_argument("--machine", default=os.path.join(RESULTS, "machine_h200_one_gpu.json"))
    p.add_argument("--datasheet", default="h100", help="the shipped file to set beside the calibrated one")
    p.add_argument("--out", default=os.path.join(RESULTS, "gpu_price.json"))
    args = p.parse_args(argv)
    head = common.header(argv)
    with open(args.check) as f:
        checked = json.load(f)
    with open(args.block) as f:
        block = json.load(f)
    runs = {c["name"]: c["metrics"][0] for c in checked["cases"] if c["name"] in CASES and c["status"] == "passed"}
    if set(runs) != set(CASES):
        missing = sorted(set(CASES) - set(runs))
        print(f"gpu_price: {args.check} has no passed {missing}: run make gpu-check first", file=sys.stderr)
        return 1
    result: dict[str, Any] = {"check": os.path.relpath(args.check, ROOT), "device": checked["device"], "machines": {}}
    for label, path in (("calibrated", args.machine), ("datasheet", args.datasheet)):
        m = load(path)
        rows: dict[str, Any] = {name: price_offload(*CASES[name], runs[name], m) for name in CASES}
        rows["20B block"] = price_block(block, m)
        result["machines"][label] = {"machine": m.name, "rows": rows}
        print(f"{label} ({m.name}):")
        for name, r in rows.items():
            if "blocks" in r:
                print(
                    f"  {runs[name]['model']}: step {r['measured_plain_s'] * 1e3:.1f} ms measured, "
                    f"{r['priced_plain_s'] * 1e3:.1f} ms priced ({r['plain_error']:+.1%}); {r['blocks']} blocks "
                    f"offloaded add {r['measured_offload_s'] * 1e3:.1f} ms measured, "
                    f"{r['priced_offload_s'] * 1e3:.1f} ms priced ({r['offload_error']:+.1%})"
                )
            else:
                print(
                    f"  {name}: {r['measured_s'] * 1e3:.2f} ms measured, {r['priced_s'] * 1e3:.2f} ms priced "
                    f"({r['error']:+.1%})"
                )
    common.save(args.out, result, head)
    rows = result["machines"]["calibrated"]["rows"]
    a, b = (rows[name] for name in CASES)
    print(
        f"gpu price: on the calibrated file steps off by {a['plain_error']:+.1%} / {b['plain_error']:+.1%} (offload "
        f"cases), {rows['20B block']['error']:+.1%} (20B block); offload +{a['priced_offload_s'] * 1e3:.1f} / "
        f"+{b['priced_offload_s'] * 1e3:.1f} ms priced, +{a['measured_offload_s'] * 1e3:.1f} / "
        f"+{b['measured_offload_s'] * 1e3:.1f} ms measured"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
