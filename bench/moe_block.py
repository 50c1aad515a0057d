"""One Mixture-of-Experts layer on the grid against a plain single-process PyTorch MoE of the same
shape (issue 42; docs/moe.md).

Every rank of a local gloo world of ``--grid`` holds ``axon4d.nn.moe.MoE`` (its part of the
experts, split over batch = data × z and x·y) and a whole ``DenseMoE`` with the same weights — the
reference: fp32 router, top-k, a Python loop over experts with ``index_add``. One step is forward
+ backward of (y·v).sum() plus the auxiliary loss: the grid layer on this rank's share of the
``--tokens`` tokens, the plain one on all of them. The two steps run in pairs, A B, B A, …
(``common.paired``) after ``--warmup`` steps each, every rank at once, so each pair's ratio is
taken with the host at one speed. Before timing, the outputs and every gradient are compared
(fp32, ≤ 1e-5 relative). One grid step's communication is read from the comm log: bytes per
axis, and the all-to-all's alone (``Op.ALL_TO_ALL``: dispatch and combine, and their gradients);
the tokens each expert received (the dispatch plan's counts) and their imbalance max/mean.

    python bench/moe_block.py                          # 2 ranks (z = 2), 4096 tokens, 8 experts top-2
    python bench/moe_block.py --grid 1,1,1,1           # one rank: the machinery against the plain loop
    python bench/moe_block.py --quick                  # a few small steps (a correctness run)

Saves ``bench/results/moe_block.json`` (``--quick``: only with ``--out``); the last line is
``moe_block: grid/plain = R× (median of P pairs, spread S) on G, T tokens, E experts top-k;
all-to-all B MiB/step over batch; imbalance I``.
"""

from __future__ import annotations

import argparse
import math
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
from axon4d.layout.geometry import Op  # noqa: E402
from axon4d.measure.spawn import run_local  # noqa: E402
from axon4d.nn.moe import MoE  # noqa: E402
from axon4d.nn.moe_dense import DenseMoE  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "moe_block.json")
QUICK = {"tokens": 256, "hidden": 64, "ffn": 64, "experts": 4, "pairs": 3, "warmup": 1}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-3))


def _bench(grid: Any, args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: check, then time the grid layer against the plain one in pairs."""
    torch.set_num_threads(1)
    cfg = ModelConfig(
        n_layers=1,
        hidden=args["hidden"],
        n_heads=4,
        arch="llama",
        n_experts=args["experts"],
        experts_per_token=args["topk"],
        expert_ffn=args["ffn"],
        moe_aux_coef=0.01,
    )
    torch.manual_seed(0)
    dense = DenseMoE(cfg)
    layer = MoE(cfg).load_dense_(dense)
    g_batch = grid.size("batch")
    if args["tokens"] % g_batch:
        raise ValueError(f"--tokens {args['tokens']} must divide over G_batch = {g_batch} ranks")
    x_full = torch.randn(g_batch, args["tokens"] // g_batch, cfg.hidden)  # (G_batch, T/G_batch, hidden)
    v = torch.randn(cfg.hidden)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    xr = x_full.clone().requires_grad_()
    v_x = axon4d.shard_features(v, "x")

    def grid_step() -> float:
        t0 = time.perf_counter()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        y = layer(x)
        ((y * v_x).sum() / (y.shape[0] * y.shape[1]) + layer.aux_loss).backward()
        return time.perf_counter() - t0

    def plain_step() -> float:
        t0 = time.perf_counter()
        xr.grad = None
        for p in dense.parameters():
            p.grad = None
        y = dense(xr)
        ((y * v).sum() / (y.shape[0] * y.shape[1]) + dense.aux_loss).backward()
        return time.perf_counter() - t0

    grid.comm.log.clear()
    grid_step()
    records = list(grid.comm.log.records)
    plain_step()
    got = layer.to_dense(grads=True)
    errs = {"forward": _rel(axon4d.gather_batch(axon4d.gather_features(layer(x).detach(), "x")), dense(xr).detach())}
    for name, p in dense.named_parameters():
        errs[f"{name}.grad"] = _rel(dict(got.named_parameters())[name].grad, p.grad)
    by_axis: dict[str, int] = {}
    for r in records:
        by_axis[r.axis] = by_axis.get(r.axis, 0) + r.payload_bytes
    a2a = sum(r.payload_bytes for r in records if r.op == Op.ALL_TO_ALL)
    for _ in range(args["warmup"]):
        grid_step(), plain_step()
    times = common.paired({"grid": grid_step, "plain": plain_step}, args["pairs"])
    ratios = [g / p for g, p in zip(times["grid"], times["plain"])]
    counts = list(layer.tokens_per_expert or ())
    return {
        "max_rel_err": max(errs.values()),
        "errors": errs,
        "grid_s": times["grid"],
        "plain_s": times["plain"],
        "ratios": ratios,
        "bytes_per_axis": by_axis,
        "all_to_all_bytes": a2a,
        "tokens_per_expert": counts,
        "imbalance": max(counts) * len(counts) / max(sum(counts), 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="1,1,2,1", help="x,y,z,data of the grid layer's world")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="each expert's FFN width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a few small steps: a correctness run")
    ap.add_argument("--out", default=None, help=f"result file (default {OUT}; --quick saves only here)")
    ns = ap.parse_args(argv)
    args = vars(ns)
    if ns.quick:
        args.update(QUICK)
    head = common.header()
    shape = tuple(int(g) for g in ns.grid.split(","))
    results = run_local(math.prod(shape), _bench, args, grid=shape, every_rank=True, timeout=1200)
    worst = max(r["max_rel_err"] for r in results)
    if worst > 1e-5:
        raise SystemExit(f"moe_block: the grid layer differs from the plain one by {worst:.2e} (> 1e-5)")
    ratios = [max(rs) for rs in zip(*(r["ratios"] for r in results))]  # a pair lasts as long as its slowest rank
    ratio = common.median(ratios)
    spread = (min(ratios), max(ratios))
    result = {"args": args, "grid": shape, "ratio": ratio, "ratio_spread": spread, "ranks": results}
    out = ns.out or (None if ns.quick else OUT)
    if out:
        common.save(out, result, head)
    r0 = results[0]
    print(
        f"moe_block: grid/plain = {ratio:.2f}× (median of {len(ratios)} pairs, spread {spread[0]:.2f}–{spread[1]:.2f}) "
        f"on {ns.grid}, {args['tokens']} tokens, {args['experts']} experts top-{args['topk']}; "
        f"all-to-all {sum(r['all_to_all_bytes'] for r in results) / len(results) / 2**20:.3f} MiB/step per rank "
        f"over batch; imbalance {r0['imbalance']:.2f}"
    )
    return result


if __name__ == "__main__":
    main()
