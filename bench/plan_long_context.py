"""A million tokens per sequence priced by the planner, set beside NeMo's measured figure (issue 56).

NeMo reports Llama-2-7B trained on sequences of 1M tokens on 1024 H100s with tensor parallelism 8
and context parallelism 32 at 536 TFLOP/s per GPU (NVIDIA NeMo documentation, "Context
Parallelism"; its FLOP count is NeMo's own). This prices, with the shipped ``h100.json``:

- **llama3-8b**: ``axon4d plan --model llama3-8b --seq-len 1048576 --gpus 1024 --machine h100
  --batch 8`` — every grid, both context-parallel modes and every step option;
- **llama2-7b**: NeMo's model shape (32 layers, hidden 4096, 32 heads without grouped-query
  attention, SwiGLU FFN 11008, vocabulary 32000) at 1M tokens, batch 8: the planner's best, and
  NeMo's layout — x·y = 8 and G_z = 32, so (1, 8, 32, 4) — with its best options on that grid.

Each plan's MFU is the planner's model MFU (``Workload.flops``: 6 FLOPs per matmul parameter and
token, causal attention counted as half the square). Its TFLOP/s per GPU is given twice: in that
count, and counting attention's whole square (``full_attention_tflops``) as NeMo's Llama FLOP
formula did before it halved the attention term for causality — which count produced the 536 is
not stated beside it, so both are shown. These are predictions of the cost model (its GPU figures
are the machine file's published peaks and stated assumptions: attention at FlashAttention-2's 35%
of peak, the kernel torch runs), not GPU runs; nothing is timed.

    .venv/bin/python bench/plan_long_context.py

Saves ``bench/results/plan_long_context.json``; the last lines are, per job,
``plan 1M: <model> on 1024 × h100, batch 8: M% model MFU = T TFLOP/s per GPU (F counting attention's
whole square; NeMo measured 536 for Llama-2-7B), grid G, options O (predicted)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402

from axon4d.config import ModelConfig, get_config  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.plan.candidate import Candidate, device_need  # noqa: E402
from axon4d.plan.search import plan  # noqa: E402
from axon4d.plan.workload import Workload  # noqa: E402

MILLION = 1 << 20
#: NeMo's measured figure for Llama-2-7B at 1M tokens on 1024 H100s (TP 8, CP 32), TFLOP/s per GPU
NEMO_TFLOPS = 536
#: NeMo's layout of that run as an axon4d grid: tensor parallelism 8 over x·y, context parallelism 32 over z
NEMO_GRID = GridShape(1, 8, 32, 4)
#: Llama-2-7B's shape (Touvron et al., arXiv:2307.09288; the Hugging Face config of meta-llama/Llama-2-7b-hf)
LLAMA2_7B = ModelConfig(
    n_layers=32,
    hidden=4096,
    n_heads=32,
    ffn_hidden=11008,
    vocab_size=32000,
    seq_len=MILLION,
    arch="llama",
    name="llama2-7b",
)


def _row(wl: Workload, c: Candidate, machine: Any, gpus: int) -> dict[str, Any]:
    """One candidate's figures: its MFU and TFLOP/s per GPU in both attention counts."""
    t = c.time
    m = wl.model
    causal = wl.flops()
    whole = causal + wl.tokens * 3.0 * 2 * 2 * m.n_layers * m.seq_len * m.hidden / 2  # the other half square
    return {
        "grid": list(c.shape.as_tuple()),
        "options": c.options_spec(),
        "context_mode": c.context_mode,
        "fits": c.fits,
        "device_need_gib": device_need(c.mem, machine) / 2**30,
        "pinned_node_gib": c.mem.pinned_node / 2**30,
        "mfu": c.mfu,
        "tflops_per_gpu": causal / t.step_s / gpus / 1e12,
        "full_attention_tflops_per_gpu": whole / t.step_s / gpus / 1e12,
        "step_s": t.step_s,
        "compute_s": t.compute_s,
        "comm_s": t.comm_s,
        "hidden_s": t.hidden_s,
        "comm_by_axis_s": t.comm_by_axis,
        "attention_share_of_flops": 1
        - (6.0 * sum(s.in_features * s.out_features * s.count for s in wl.linears() if not s.embedding) * wl.tokens)
        / causal,
    }


def price(model: ModelConfig, gpus: int, batch: int, machine: str, grid: GridShape | None) -> dict[str, Any]:
    """The planner's best for ``model`` (``grid`` given: its best on that grid)."""
    wl = Workload(model, batch, context_parallel=True)
    r = plan(model, gpus, machine, batch, workload=wl, context_parallel=True, top=None if grid else 5)
    cands = [c for c in r.candidates if c.fits and (grid is None or c.shape == grid)]
    if not cands:
        return {"grid": list(grid.as_tuple()) if grid else None, "fits": False}
    best = cands[0]
    return _row(dataclasses.replace(wl, context_mode=best.context_mode), best, r.machine, gpus)


def headline(name: str, gpus: int, machine: str, batch: int, row: dict[str, Any]) -> str:
    return (
        f"plan 1M: {name} on {gpus} × {machine}, batch {batch}: {100 * row['mfu']:.1f}% model MFU = "
        f"{row['tflops_per_gpu']:.0f} TFLOP/s per GPU ({row['full_attention_tflops_per_gpu']:.0f} counting attention's "
        f"whole square; NeMo measured {NEMO_TFLOPS} for Llama-2-7B), grid {tuple(row['grid'])}, {row['options']} (predicted)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", default="h100")
    p.add_argument("--gpus", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences of 1M tokens per step")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_long_context.json"))
    args = p.parse_args()
    head = common.header()
    llama3 = get_config("llama3-8b", seq_len=MILLION)
    jobs = {
        "llama3-8b": price(llama3, args.gpus, args.batch, args.machine, None),
        "llama2-7b": price(LLAMA2_7B, args.gpus, args.batch, args.machine, None),
        "llama2-7b on NeMo's layout": price(LLAMA2_7B, args.gpus, args.batch, args.machine, NEMO_GRID),
    }
    common.save(args.out, {"args": vars(args), "nemo_tflops_per_gpu": NEMO_TFLOPS, "jobs": jobs}, head)
    print(f"saved {args.out}")
    for name, row in jobs.items():
        print(
            headline(name, args.gpus, args.machine, args.batch, row)
            if row.get("fits")
            else f"plan 1M: {name}: nothing fits"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
