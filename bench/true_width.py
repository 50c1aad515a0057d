"""Where the planner goes wrong on a true-width step: the step's parts timed alone, every rank busy,
against their prices (issue 31, item 6).

A block of the 20B width (hidden 7168) on (2,2,2,1) with 2048 tokens (8 sequences of 256) is what
`bench/gpt.py` measured 131 s per step for against 86 s planned. This bench times, on ``--ranks``
ranks at once (as the step runs them, every rank computing; no collectives), each GEMM of that
step at its local shape and form (forward X·Wᵀ "nt", input gradient dY·W "nn", weight gradient
dYᵀ·X "tn"), and elementwise passes over the step's large activations, and prints each next to the
machine file's price (``Machine.matmul_time``, ``elementwise_time``): which part the model
under-prices, and by how much.

    OMP_NUM_THREADS=1 .venv/bin/python bench/true_width.py --machine bench/results/planner_machine_host_2026-11-24.json

It also prints the whole step's price on the machine file (``--recompute``, overlap "all"), to set
beside `bench/gpt.py`'s measured step. Saves ``bench/results/true_width.json`` (per part: shape,
measured seconds — median over ``--reps`` on the slowest rank — and priced seconds; the step's
price; with the header of bench/common.py); the last
line is ``true_width: GEMMs measured/priced = R (median over shapes; worst W at SHAPE), elementwise = E``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import common  # noqa: E402

from axon4d.config import get_config  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.options.overlap_policy import OverlapPolicy  # noqa: E402
from axon4d.plan import Workload, evaluate, load  # noqa: E402


def gemm_shapes(wl: Workload, shape: GridShape) -> list[tuple[str, str, int, int, int]]:
    """(layer, form, m, k, n) of every GEMM of one step's layer kinds on one rank, as the planner
    prices them (``axon4d.plan.layers._gemms``: forward (b, in)·(out, in)ᵀ, dX (b, out)·(out, in),
    dW (out, b)·(b, in))."""
    b = wl.local_tokens(shape)
    out = []
    for spec in wl.linears():
        if spec.embedding:
            continue
        in_l, out_l = spec.local(shape)
        out += [(spec.name, "nt", b, in_l, out_l), (spec.name, "nn", b, out_l, in_l), (spec.name, "tn", out_l, b, in_l)]
    return out


def _run(grid: Any, shapes: list[tuple[str, str, int, int, int]], ew_sizes: list[int], reps: int) -> dict:
    """On every rank at once: each GEMM and each elementwise pass ``reps`` times; per part the
    slowest rank's median seconds."""
    import torch

    torch.manual_seed(grid.rank)
    results: dict[str, list[float]] = {}

    def timed(key: str, fn: Any) -> None:
        fn()  # warm
        grid.comm.barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        results[key] = times

    for name, form, m, k, n in shapes:
        if form == "nt":
            a, w = torch.randn(m, k), torch.randn(n, k)
            timed(f"{name}/{form}", lambda a=a, w=w: torch.mm(a, w.t()))
        elif form == "nn":
            a, w = torch.randn(m, k), torch.randn(k, n)
            timed(f"{name}/{form}", lambda a=a, w=w: torch.mm(a, w))
        else:
            a, x = torch.randn(k, m), torch.randn(k, n)
            timed(f"{name}/{form}", lambda a=a, x=x: torch.mm(a.t(), x))
    for size in ew_sizes:
        x, y = torch.randn(size), torch.randn(size)
        timed(f"add/{size}", lambda x=x, y=y: torch.add(x, y))
    medians = torch.tensor([statistics.median(v) for v in results.values()], dtype=torch.float64)
    slowest = grid.comm.all_gather(medians.reshape(1, -1), "world").wait().max(dim=0).values
    return dict(zip(results, slowest.tolist()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", default=os.path.join(ROOT, "bench/results/planner_machine_host_2026-11-24.json"))
    p.add_argument("--model", default="20B")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--grid", default="2,2,2,1")
    p.add_argument("--recompute", default="full", help="the step's recomputation (for its whole price)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/true_width.json"))
    args = p.parse_args(argv)
    from harness import RankPool

    head = common.header()
    machine = load(args.machine)
    cfg = get_config(args.model, n_layers=1, seq_len=args.seq_len, vocab_size=args.vocab)
    wl = Workload(cfg, args.batch, "float32")
    shape = GridShape(*(int(v) for v in args.grid.split(",")))
    world = shape.world_size
    shapes = gemm_shapes(wl, shape)
    b = wl.local_tokens(shape)
    ew_sizes = [b * cfg.hidden // shape.x, b * cfg.ffn // shape.y]  # (b, H/G_x), (b, F/G_y)
    pool = RankPool(world, start_timeout=600)
    try:
        measured = pool.run(shape.as_tuple(), _run, shapes, ew_sizes, args.reps, timeout=3000)[0]
    finally:
        pool.close()
    rows = []
    for name, form, m, k, n in shapes:
        priced = machine.matmul_time(form, m, k, n, "float32", world)
        got = measured[f"{name}/{form}"]
        rows.append({"part": f"{name}/{form}", "m": m, "k": k, "n": n, "measured_s": got, "priced_s": priced})
        print(
            f"{name:>9} {form} ({m}×{k})·({k}×{n}): {got:8.3f} s measured, {priced:8.3f} s priced, ×{got / priced:.2f}"
        )
    for size in ew_sizes:
        priced = machine.elementwise_time(3 * size * 4, world)  # two reads and a write, fp32
        got = measured[f"add/{size}"]
        rows.append({"part": f"add/{size}", "elements": size, "measured_s": got, "priced_s": priced})
        print(f"      add {size} elements: {got:8.4f} s measured, {priced:8.4f} s priced, ×{got / priced:.2f}")
    step = evaluate(wl, shape, machine, OverlapPolicy.parse("all"), args.recompute).time
    print(
        f"the whole step priced on this machine (recompute {args.recompute}, overlap all): {step.step_s:.1f} s "
        f"(GEMMs {step.matmul_s:.1f} s, compute {step.compute_s:.1f} s, collectives {step.comm_s:.1f} s)"
    )
    gemm = [r for r in rows if "m" in r]
    ratios = [r["measured_s"] / r["priced_s"] for r in gemm]
    worst = max(gemm, key=lambda r: r["measured_s"] / r["priced_s"])
    ew = [r["measured_s"] / r["priced_s"] for r in rows if "elements" in r]
    total = {"measured_s": sum(r["measured_s"] for r in gemm), "priced_s": sum(r["priced_s"] for r in gemm)}
    common.save(
        args.out,
        {
            "machine": args.machine,
            "model": args.model,
            "grid": list(shape.as_tuple()),
            "tokens": wl.tokens,
            "rows": rows,
            "gemm_total": total,
        },
        head,
    )
    print(
        f"true_width: GEMMs measured/priced = {statistics.median(ratios):.2f} (median over shapes; worst "
        f"{worst['measured_s'] / worst['priced_s']:.2f} at {worst['part']} ({worst['m']}×{worst['k']}×{worst['n']})), "
        f"elementwise = {statistics.median(ew):.2f}; one pass of every GEMM: {total['measured_s']:.1f} s measured, "
        f"{total['priced_s']:.1f} s priced"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
