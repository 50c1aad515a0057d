"""FP8 dispatch on CPU ranks, measured against the planner's price of it (issue 51; docs/moe.md
"FP8 dispatch").

One MoE layer (hidden 512, 8 experts of FFN 1024, top-2, one shared expert, gated; fp32 compute)
on a local gloo world of 4 ranks, grid (1, 1, 2, 2) with whole experts over z·data, built twice
on the same grid: ``ep=batch,tp=1`` (rows in fp32) and ``ep=batch,tp=1,dispatch=fp8`` (rows toward
the experts packed in e4m3, a scale per 128 features). After ``--warmup`` steps, ``--pairs`` steps
of each in alternating pairs (A B, B A, …, ``common.paired``), every rank stepping at once; a step
lasts as long as its slowest rank. Per variant the median step, and the median of the pairs'
fp8/fp32 ratios; the comm log's bytes of one step per tag.

The planner's price of the same layer on this host's machine file
(``bench/results/planner_machine_local.json``, measured by ``axon4d calibrate`` on this host): the
MoE layer's compute seconds (its casts included, eager on the host: ``moe_cost.pack_passes``) and
its collectives' seconds (``expert_layouts.moe_costs``), per variant, and their ratio.

The host has 2 cores shared by 4 ranks (and by other work): only the side-by-side ratio means
something; the load average is saved before and after.

    python bench/moe_fp8_dispatch.py     # saves bench/results/moe_fp8_dispatch.json

The last line: ``moe_fp8_dispatch: measured fp8/fp32 step R× (dispatch bytes D×); planner P× on the
host's machine file``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

import axon4d  # noqa: E402
from axon4d.config import ModelConfig  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.measure.spawn import run_local  # noqa: E402
from axon4d.nn.moe import MoE  # noqa: E402
from axon4d.options.overlap_policy import OverlapPolicy  # noqa: E402
from axon4d.plan.expert_layouts import moe_costs  # noqa: E402
from axon4d.plan.machine import load  # noqa: E402
from axon4d.plan.workload import Workload  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "moe_fp8_dispatch.json")
MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
GRID = (1, 1, 2, 2)
VARIANTS = {"fp32": "ep=batch,tp=1", "fp8": "ep=batch,tp=1,dispatch=fp8"}
SEQ = 128


def _config(args: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        n_layers=1,
        hidden=args["hidden"],
        n_heads=4,
        vocab_size=256,
        seq_len=SEQ,
        arch="llama",
        n_experts=8,
        experts_per_token=2,
        expert_ffn=args["ffn"],
        shared_experts=1,
        moe_aux_coef=0.01,
    )


def _on_rank(grid: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Both layers on this rank: one step's bytes per tag, then the steps' seconds in pairs."""
    torch.set_num_threads(1)
    cfg = _config(args)
    layers = {}
    for name, layout in VARIANTS.items():
        torch.manual_seed(0)
        layers[name] = MoE(cfg, layout=layout)
    x_full = torch.randn(args["tokens"] // SEQ, SEQ, cfg.hidden)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    v = axon4d.shard_features(torch.randn(cfg.hidden), "x")

    def step(layer: MoE) -> float:
        grid.comm.barrier()  # every rank starts together: the step is the slowest rank's
        t0 = time.perf_counter()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        y = layer(x)
        ((y * v).sum() / (y.shape[0] * y.shape[1]) + layer.aux_loss).backward()
        return time.perf_counter() - t0

    sent: dict[str, dict[str, int]] = {}
    for name, layer in layers.items():
        grid.comm.log.clear()
        step(layer)
        sent[name] = {}
        for r in grid.comm.log.records:
            sent[name][str(r.tag)] = sent[name].get(str(r.tag), 0) + r.payload_bytes
    for _ in range(args["warmup"]):
        for layer in layers.values():
            step(layer)
    times = common.paired({n: (lambda layer=layer: step(layer)) for n, layer in layers.items()}, args["pairs"])
    return {"bytes": sent, "seconds": times}


def predicted(args: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The planner's compute and collective seconds of the layer per variant on the host's file."""
    machine = load(MACHINE)
    cfg = _config(args)
    out = {}
    for name, layout in VARIANTS.items():
        wl = Workload(cfg, args["tokens"] // SEQ, precision="fp32", expert_layout=layout)
        compute, comm, *_ = moe_costs(wl, GridShape(*GRID), machine, OverlapPolicy())
        out[name] = {"compute_s": compute, "comm_s": comm, "step_s": compute + comm}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=OUT)
    ns = ap.parse_args(argv)
    args = {k: getattr(ns, k) for k in ("tokens", "hidden", "ffn", "pairs", "warmup")}
    head = common.header()
    ranks = run_local(4, _on_rank, args, grid=GRID, every_rank=True)
    assert ranks[0]["bytes"]["fp8"].get("moe.dispatch"), "no dispatch: the layout did not exchange rows"
    steps = {n: [max(r["seconds"][n][i] for r in ranks) for i in range(ns.pairs)] for n in VARIANTS}
    ratios = [a / b for a, b in zip(steps["fp8"], steps["fp32"])]
    price = predicted(args)
    dispatch = {n: ranks[0]["bytes"][n].get("moe.dispatch", 0) for n in VARIANTS}
    result = {
        "args": args,
        "grid": list(GRID),
        "variants": VARIANTS,
        "note": "CPU timings are noisy: 4 ranks share the host's 2 cores; compare only the paired ratio",
        "step_s": steps,
        "median_step_s": {n: common.median(v) for n, v in steps.items()},
        "fp8_over_fp32_pairs": ratios,
        "fp8_over_fp32": common.median(ratios),
        "bytes_rank0": ranks[0]["bytes"],
        "dispatch_bytes_ratio": dispatch["fp8"] / dispatch["fp32"],
        "planner": price,
        "planner_fp8_over_fp32": price["fp8"]["step_s"] / price["fp32"]["step_s"],
    }
    common.save(ns.out, result, head)
    print(
        f"moe_fp8_dispatch: measured fp8/fp32 step {result['fp8_over_fp32']:.2f}× (dispatch bytes "
        f"{result['dispatch_bytes_ratio']:.2f}×); planner {result['planner_fp8_over_fp32']:.2f}× on the host's "
        "machine file"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
