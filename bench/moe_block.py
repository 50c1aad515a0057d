"""One Mixture-of-Experts layer on 8 CPU ranks under each kind of expert layout, against the same
layer in one process (issues 42 and 51; docs/moe.md), and the grouped GEMMs against a loop.

The layer: ``axon4d.nn.moe.MoE`` (hidden 256, 8 experts of FFN 512, top-2, one shared expert,
gated) forward + backward of (y·v).sum() plus its auxiliary loss, on a local gloo world of 8 ranks
for each layout of ``LAYOUTS`` (``axon4d.init(grid, expert_layout=…)``). Every rank also holds the
whole single-process ``DenseMoE`` with the same weights and steps it on all the tokens. Per layout:

- exactness: the output, the input gradient and every parameter's gradient against ``DenseMoE``'s
  (fp32, ≤ 1e-5 relative, or the run fails);
- one step's communication from the comm log (``grid.comm.log.records``): bytes per (axis, tag);
- time: after ``--warmup`` steps, ``--pairs`` grid steps and plain steps in pairs (A B, B A, …,
  ``common.paired``) with every rank stepping at once; a step lasts as long as its slowest rank.
  The median grid step, tokens/s, and the median of the pairs' grid/plain ratios.

Then, in this process, the grouped GEMMs of one expert projection (``grouped_mm_t`` forward +
``grouped_weight_grad``) at one representative size against one matmul per expert, in pairs: the
library's path (``torch._grouped_mm`` on the host) and the padded batched GEMM.

The host has 2 cores shared by 8 ranks (and by other work): CPU timings are noisy and only the
side-by-side ratios mean something; the load average is saved before and after.

    python bench/moe_block.py            # the four layouts; saves bench/results/moe_block.json
    python bench/moe_block.py --quick    # a small correctness run (saves only with --out)
    python bench/moe_block.py --grid 1,1,1,1 --out F   # one grid, --layout's (saves only with --out)
    python bench/moe_block.py --gpu      # one MoE block on one accelerator: tokens/s, MFU, grouped/loop

The last line: ``moe_block: 4 layouts exact on 8 CPU ranks (max rel err E); grouped GEMM R× the loop
(padded P×); grid/plain …``. ``--gpu`` saves ``bench/results/moe_block_gpu_<device>.json`` and ends
with ``moe_block --gpu: …``; without an accelerator it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402
from axon4d.config import ModelConfig  # noqa: E402
from axon4d.device import grouped  # noqa: E402
from axon4d.measure.spawn import run_local  # noqa: E402
from axon4d.nn.moe import MoE  # noqa: E402
from axon4d.nn.moe_dense import DenseMoE  # noqa: E402
from axon4d.train import peak  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "moe_block.json")
#: (expert layout, grid x, y, z, data): one of each kind, then the default
LAYOUTS: list[tuple[str, tuple[int, int, int, int]]] = [
    ("ep=world,tp=1", (2, 2, 2, 1)),
    ("ep=data,tp=x·y", (2, 2, 1, 2)),
    ("ep=z,tp=x·y", (2, 1, 2, 2)),
    ("ep=batch,tp=x·y", (1, 2, 2, 2)),
]
#: sequences the tokens are cut into: divides over every layout's batch ranks (2 or 4)
SEQUENCES = 8
TOL = 1e-5
QUICK = {"tokens": 256, "hidden": 64, "ffn": 64, "pairs": 2, "warmup": 1, "gemm_pairs": 3}
NOISE = (
    "CPU timings are noisy: 8 ranks (or one process) share the host's 2 cores with other work; compare only the "
    "ratios, each measured side by side in alternating pairs; loadavg at start and end is in the header"
)


def _config(args: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        n_layers=1,
        hidden=args["hidden"],
        n_heads=4,
        arch="llama",
        n_experts=args["experts"],
        experts_per_token=args["topk"],
        expert_ffn=args["ffn"],
        shared_experts=1,
        moe_aux_coef=0.01,
    )


def _flops_per_token(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs per token of one gated MoE layer: the router, k routed experts and
    the shared one (3 matrices of hidden × expert FFN each), ×3 for the backward's two products."""
    per_expert = 3 * cfg.hidden * cfg.expert_width
    return 6.0 * (cfg.n_experts * cfg.hidden + (cfg.experts_per_token + cfg.shared_experts) * per_expert)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-3))


def _layer_on_rank(grid: Any, args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: check the grid layer against ``DenseMoE``, read one step's communication,
    then time grid and plain steps in pairs."""
    torch.set_num_threads(1)
    cfg = _config(args)
    torch.manual_seed(0)
    dense = DenseMoE(cfg)
    layer = MoE(cfg).load_dense_(dense)
    tokens = args["tokens"]
    x_full = torch.randn(SEQUENCES, tokens // SEQUENCES, cfg.hidden)  # (b, s, hidden)
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
    errs = {
        "output": _rel(axon4d.gather_batch(axon4d.gather_features(layer(x).detach(), "x")), dense(xr).detach()),
        "input_grad": _rel(axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch"), xr.grad),
    }
    got = dict(layer.to_dense(grads=True).named_parameters())
    for name, p in dense.named_parameters():
        errs[f"{name}.grad"] = _rel(got[name].grad, p.grad)
    sent: dict[str, int] = {}
    for r in records:
        key = f"{r.axis}/{r.tag}"
        sent[key] = sent.get(key, 0) + r.payload_bytes
    for _ in range(args["warmup"]):
        grid_step(), plain_step()
    times = common.paired({"grid": grid_step, "plain": plain_step}, args["pairs"])
    return {"errors": errs, "bytes_per_axis_tag": sent, "grid_s": times["grid"], "plain_s": times["plain"]}


def run_layout(layout: str, shape: tuple[int, ...], args: dict[str, Any]) -> dict[str, Any]:
    """One layout on a spawned local world of ``shape``: errors, bytes, times (module docstring)."""
    world = math.prod(shape)
    ranks = run_local(world, _layer_on_rank, args, grid=shape, init_kwargs={"expert_layout": layout}, every_rank=True)
    errors = {k: max(r["errors"][k] for r in ranks) for k in ranks[0]["errors"]}
    grid_s = [max(ts) for ts in zip(*(r["grid_s"] for r in ranks))]  # a step lasts as long as its slowest rank
    plain_s = [max(ts) for ts in zip(*(r["plain_s"] for r in ranks))]
    ratios = [g / p for g, p in zip(grid_s, plain_s)]
    step = common.median(grid_s)
    return {
        "layout": layout,
        "grid": list(shape),
        "max_rel_err": max(errors.values()),
        "errors": errors,
        "median_step_s": step,
        "tokens_per_s": args["tokens"] / step,
        "plain_median_step_s": common.median(plain_s),
        "plain_tokens_per_s": args["tokens"] / common.median(plain_s),
        "grid_over_plain": common.median(ratios),
        "pair_ratios": ratios,
        "grid_s": grid_s,
        "plain_s": plain_s,
        "bytes_per_axis_tag_rank0": ranks[0]["bytes_per_axis_tag"],
        "bytes_per_axis_tag_per_rank": [r["bytes_per_axis_tag"] for r in ranks],
    }


# -- the grouped GEMMs against a loop, in one process --------------------------------------------


def _loop_projection(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, sizes: list[int]) -> None:
    """One expert projection's forward and weight gradient as one matmul per expert (the reference)."""
    start = 0
    for g, n in enumerate(sizes):
        torch.matmul(x[start : start + n], w[g].t())  # (n, K) @ (K, N)
        torch.matmul(dy[start : start + n].t(), x[start : start + n])  # (N, n) @ (n, K)
        start += n


def _grouped_projection(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, sizes: list[int]) -> None:
    grouped.grouped_mm_t(x, w, sizes)  # (M, K) × (G, N, K) → (M, N)
    grouped.grouped_weight_grad(dy, x, sizes)  # → (G, N, K)


@contextlib.contextmanager
def _padded_only(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """The padded batched GEMM on ``device`` and ``dtype``, as after the kernel refused them once."""
    added = {(device.type, dtype, form) for form in ("2d3d", "2d2d")} - grouped._REFUSED
    grouped._REFUSED.update(added)
    try:
        yield
    finally:
        grouped._REFUSED.difference_update(added)


def grouped_vs_loop(
    rows: int, groups: int, k: int, n: int, device: torch.device, dtype: torch.dtype, pairs: int
) -> dict[str, Any]:
    """``rows`` rows over ``groups`` experts (a seeded uniform routing), (M, K) × (G, N, K) forward and
    weight gradient: seconds of the loop, of the library's path and of the padded GEMM, in pairs."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.bincount(torch.randint(groups, (rows,), generator=gen), minlength=groups).tolist()
    x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(groups, n, k, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(rows, n, generator=gen).to(device=device, dtype=dtype)

    def timed(fn: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            devices.synchronize(device)
            t0 = time.perf_counter()
            fn()
            devices.synchronize(device)
            return time.perf_counter() - t0

        return run

    def padded() -> None:
        with _padded_only(device, dtype):
            _grouped_projection(x, w, dy, sizes)

    steps = {
        "loop": timed(lambda: _loop_projection(x, w, dy, sizes)),
        "grouped": timed(lambda: _grouped_projection(x, w, dy, sizes)),
        "padded": timed(padded),
    }
    for step in steps.values():  # warm-up
        step()
    times = common.paired(steps, pairs)
    ratio = [g / lp for g, lp in zip(times["grouped"], times["loop"])]
    ratio_padded = [p / lp for p, lp in zip(times["padded"], times["loop"])]
    return {
        "rows": rows,
        "groups": groups,
        "k": k,
        "n": n,
        "sizes": sizes,
        "dtype": str(dtype).removeprefix("torch."),
        "device": devices.device_name(device),
        "native": grouped.native_grouped_mm(x, w.transpose(-2, -1)),
        "threads": torch.get_num_threads() if devices.is_host(device) else None,
        "what": "grouped_mm_t forward + grouped_weight_grad of one projection against one matmul per expert",
        "median_s": {name: common.median(ts) for name, ts in times.items()},
        "grouped_over_loop": common.median(ratio),
        "padded_over_loop": common.median(ratio_padded),
        "pair_ratios": ratio,
        "samples_s": times,
    }


# -- one accelerator --------------------------------------------------------------------------------


def run_gpu(args: dict[str, Any]) -> dict[str, Any]:
    """One MoE block in bf16 on one accelerator: tokens/s and MFU of forward + backward, and the
    grouped GEMMs against the loop there."""
    grid = axon4d.init(grid=(1, 1, 1, 1), precision="bf16", device=devices.HOST if args["on_host"] else None)
    device = grid.device
    try:
        cfg = _config(args)
        torch.manual_seed(0)
        layer = MoE(cfg, device=device, dtype=torch.bfloat16)
        x = torch.randn(SEQUENCES, args["tokens"] // SEQUENCES, cfg.hidden, device=device, dtype=torch.bfloat16)
        x.requires_grad_()
        v = torch.randn(cfg.hidden, device=device, dtype=torch.bfloat16)

        def step() -> None:
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            y = layer(x)
            ((y * v).float().sum() / (y.shape[0] * y.shape[1]) + layer.aux_loss).backward()

        for _ in range(args["warmup"]):
            step()
        times = []
        for _ in range(args["pairs"]):
            devices.synchronize(device)
            t0 = time.perf_counter()
            step()
            devices.synchronize(device)
            times.append(time.perf_counter() - t0)
        step_s = common.median(times)
        name = devices.device_name(device)
        known = peak.known_peak(name, torch.bfloat16, tf32=False)
        peak_tflops, source = (
            known if known is not None else (peak.measure_peak_tflops(grid, torch.bfloat16), "measured")
        )
        flops = _flops_per_token(cfg)
        tokens_per_s = args["tokens"] / step_s
        gemm = grouped_vs_loop(
            args["tokens"] * cfg.experts_per_token,
            cfg.n_experts,
            cfg.hidden,
            2 * cfg.expert_width,
            device,
            torch.bfloat16,
            args["gemm_pairs"],
        )
    finally:
        axon4d.shutdown()
    return {
        "device": name,
        "precision": "bf16",
        "median_step_s": step_s,
        "step_s": times,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "peak_tflops": peak_tflops,
        "peak_source": source,
        "mfu": peak.mfu(flops, tokens_per_s, peak_tflops),
        "grouped_gemm": gemm,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help=f"tokens per step (a multiple of {SEQUENCES})")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="each expert's FFN width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=6, help="timed grid/plain pairs per layout")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gemm-pairs", type=int, default=20, help="timed pairs of the grouped GEMM against the loop")
    ap.add_argument("--grid", default=None, help="x,y,z,data: run one grid (under --layout) instead of LAYOUTS")
    ap.add_argument("--layout", default="ep=batch,tp=x·y", help="the expert layout of --grid")
    ap.add_argument("--quick", action="store_true", help="a small correctness run")
    ap.add_argument("--gpu", action="store_true", help="one MoE block on one accelerator instead")
    ap.add_argument("--on-host", action="store_true", help="--gpu's measurement on the host (a check of the script)")
    ap.add_argument("--out", default=None, help=f"result file (default {OUT}; --quick saves only here)")
    ns = ap.parse_args(argv)
    args = vars(ns)
    if ns.quick:
        args.update(QUICK)
    if args["tokens"] % SEQUENCES:
        ap.error(f"--tokens {args['tokens']}: give a multiple of {SEQUENCES} (the sequences it is cut into)")
    head = common.header()
    print(f"moe_block: load average {os.getloadavg()[0]:.2f} at start ({NOISE})", file=sys.stderr)
    if ns.gpu:
        if not (devices.accelerator_available() or ns.on_host):
            raise SystemExit(
                "moe_block --gpu: no accelerator here (axon4d.device.accelerator_available() is False); "
                "run it on a GPU machine, or add --on-host to check the script on the host"
            )
        gpu = run_gpu(args)
        out = ns.out or (
            None
            if ns.quick or ns.on_host
            else os.path.join(ROOT, "bench", "results", f"moe_block_gpu_{gpu['device'].replace(' ', '_')}.json")
        )
        if out:
            common.save(out, {"args": args, **gpu}, head)
        g = gpu["grouped_gemm"]
        print(
            f"moe_block --gpu: one MoE block on {gpu['device']}, bf16: {gpu['tokens_per_s']:.0f} tokens/s, "
            f"MFU {100 * gpu['mfu']:.1f}%; grouped GEMM {g['grouped_over_loop']:.2f}× the loop's time "
            f"(padded {g['padded_over_loop']:.2f}×)"
        )
        return gpu
    runs = LAYOUTS if ns.grid is None else [(ns.layout, tuple(int(g) for g in ns.grid.split(",")))]
    layouts = [run_layout(layout, shape, args) for layout, shape in runs]
    worst = max(r["max_rel_err"] for r in layouts)
    torch.set_num_threads(1)
    cfg = _config(args)
    gemm = grouped_vs_loop(
        args["tokens"] * cfg.experts_per_token,
        cfg.n_experts,
        cfg.hidden,
        2 * cfg.expert_width,
        devices.HOST,
        torch.float32,
        args["gemm_pairs"],
    )
    result = {
        "args": args,
        "note": NOISE,
        "config": {
            "hidden": cfg.hidden,
            "experts": cfg.n_experts,
            "expert_ffn": cfg.expert_width,
            "top_k": cfg.experts_per_token,
            "shared_experts": cfg.shared_experts,
            "gated": cfg.gated,
        },
        "flops_per_token": _flops_per_token(cfg),
        "tolerance": TOL,
        "max_rel_err": worst,
        "layouts": layouts,
        "grouped_gemm": gemm,
    }
    out = ns.out or (None if ns.quick or ns.grid else OUT)
    if out:
        common.save(out, result, head)
    for r in layouts:
        print(
            f"  {r['layout']:<16} on {tuple(r['grid'])}: max rel err {r['max_rel_err']:.1e}, step {1e3 * r['median_step_s']:.0f} ms, "
            f"{r['tokens_per_s']:.0f} tokens/s, grid/plain {r['grid_over_plain']:.2f}×"
        )
    if worst > TOL:
        raise SystemExit(f"moe_block: a layout differs from the single-process layer by {worst:.2e} (> {TOL:g})")
    ratios = [r["grid_over_plain"] for r in layouts]
    print(
        f"moe_block: {len(layouts)} layouts exact on {max(math.prod(r['grid']) for r in layouts)} CPU ranks (max rel err {worst:.1e}); "
        f"grouped GEMM {gemm['grouped_over_loop']:.2f}× the loop's time (padded {gemm['padded_over_loop']:.2f}×); "
        f"grid/plain {min(ratios):.2f}–{max(ratios):.2f}× ({args['tokens']} tokens, {cfg.n_experts} experts top-{cfg.experts_per_token})"
    )
    return result


if __name__ == "__main__":
    main()
