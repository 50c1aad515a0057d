"""One transformer block of the 20B width on one GPU: axon4d against plain PyTorch, in the precision
each runs by default.

The headline row is bf16 compute over fp32 weights. axon4d's ``TransformerBlock`` on a grid of one
rank (``axon4d.init(grid=(1, 1, 1, 1), precision="bf16-fp32-reduce")``, the preset an accelerator
gets by default: fp32 parameters and gradients, bf16 GEMMs, fp32 dW sums) against the block a
PyTorch user writes: ``nn.LayerNorm``, one ``nn.Linear`` producing q, k and v (fused QKV),
``F.scaled_dot_product_attention``, the output projection and the GELU MLP — ``FusedQKVBlock``,
fp32 parameters, forward and loss under ``torch.autocast(device_type, dtype=torch.bfloat16)``.
Both hold the weights of one ``DenseBlock`` (the fused QKV weight is its q, k and v weights
stacked, q | k | v rows; bias likewise).

The FP8 row (issue 44) is the headline row's axon4d block under ``precision="bf16-fp8"`` — its
Linear GEMMs in e4m3 with one tensorwise scale per block (docs/design.md §2 "FP8 GEMMs"), norms and
attention in bf16 — against the same autocast baseline; its outputs agree within 2⁻³ (two e4m3
operands' rounding). It runs where the device has FP8 GEMMs (H100, H200; the host, which checks the
script but times nothing of interest), and is left out elsewhere (A100). Its step over the headline
row's axon4d step is ``fp8_speedup`` (both rows paired with the same baseline).

The FP8 sweep (``--sweep`` widths, heads of ``--head-dim``): per width one axon4d block under
``bf16-fp8`` stepped with every layer in bf16, every layer in FP8 and each layer kind alone in FP8,
``--sweep-pairs`` alternating rounds; each kind's measured saving (median over rounds of the
all-bf16 step less the step with that kind in FP8) beside the planner's (``axon4d.plan.fp8.
kind_choices`` on ``--machine``'s file), and the width from which each says FP8 wins. ``--profile W``
records where three all-FP8 steps at width W spend their time (``torch.profiler``: the top ops by
device and by host time, per step) as ``fp8_profile``.

The second row is pure bf16: axon4d under ``precision="bf16"`` with bf16 parameters against the
reference ``DenseBlock`` itself (separate q, k and v ``nn.Linear``) in bf16 parameters.

The block is a GPT block of the 20B width (``axon4d.config.SIZES["20B"]``: hidden 7168, 56 heads,
ffn 28672, biases), on ``--tokens`` tokens as one sequence; both blocks of a row take the same bf16
input (the residual stream's dtype under axon4d's mixed precision; under autocast it keeps the
baseline's residual adds in bf16 too). Outputs are compared first (within 5e-2 of the output's
scale). One step is forward and backward of ``(y · v).sum()``, the gradients set to None after.
A row's two steps are timed alternately (A B, B A, …: ``bench/common.paired``), each ending on a
device synchronize; the step times are the medians and the ratio is axon4d's median over the
baseline's. Each pair's own ratio (axon4d's step over the baseline's beside it) is recorded with
their spread: min, quartiles, median, max. MFU is the headline row's: the model FLOPs of a step
(``axon4d.plan.Workload.flops``: 6 per matmul parameter per token plus causal attention) over its
step time and the accelerator's dense bf16 peak from axon4d.train.peak's table (a measured matmul
peak for a device it does not list).

    python bench/gpu_block.py                        # on the GPU machine (make gpu-check runs it)
    python bench/gpu_block.py --on-host --hidden 256 --heads 4 --tokens 128 --pairs 3   # checks the script

Saves ``bench/results/gpu_block_<device>.json``: ``precision``, ``baseline``, ``agreement``,
``samples_s`` and ``median_s`` (keys ``axon4d``, ``torch``), ``ratio``, ``pair_ratios``,
``pair_spread`` (``min``, ``q1``, ``median``, ``q3``, ``max``) of the headline row; the same
under ``pure_bf16`` for the second and under ``fp8`` for the FP8 row (null without FP8 GEMMs); ``fp8_speedup``,
``fp8_cast`` (fused or not, and why not), ``fp8_sweep`` (per width: samples, medians, per kind the
measured and planned savings and the planner's choice), ``fp8_first_win``; ``step_flops``,
``peak_tflops``, ``peak_source``, ``mfu``. It prints a line per sweep width, the FP8 rows, the
second row, then, last, the headline:

    gpu fp8 GEMMs: step S ms, plain PyTorch (fused QKV, autocast) P ms (ratio R), pair ratios A-B
    gpu fp8: bf16-fp8 step S ms against bf16-fp32-reduce M ms: X× (fused casts: True|False)
    gpu fp8 sweep: FP8 wins from width (measured / planner): qkv W/W, attn_out W/W, mlp_up W/W, mlp_down W/W
    gpu pure bf16: step S ms, plain PyTorch (unfused QKV, bf16 weights) P ms (ratio R), pair ratios A-B
    gpu: 20B width 7168, 1 rank, bf16 over fp32 weights: step S ms, plain PyTorch (fused QKV, autocast) P ms (ratio R), pair ratios A-B, MFU M%

(A-B: the smallest and largest pair ratio; "width W" for another width than 20B's.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402
from axon4d.config import SIZES, ModelConfig  # noqa: E402
from axon4d.device import fp8 as fp8_kernel  # noqa: E402
from axon4d.device import fp8_fused  # noqa: E402
from axon4d.grid.mesh import Grid  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.models.transformer import Transformer  # noqa: E402
from axon4d.nn.attention import causal_attention  # noqa: E402
from axon4d.nn.block import DenseBlock, TransformerBlock  # noqa: E402
from axon4d.plan import Workload  # noqa: E402
from axon4d.plan import fp8 as fp8_plan  # noqa: E402
from axon4d.plan.machine import load as load_machine  # noqa: E402
from axon4d.plan.scenario import Scenario  # noqa: E402
from axon4d.train import peak  # noqa: E402

#: the headline row's precision preset, and the pure-bf16 row's
MIXED, PURE = "bf16-fp32-reduce", "bf16"
#: the FP8 row's preset (issue 44)
FP8 = "bf16-fp8"
BASELINE = "plain PyTorch block, fused QKV nn.Linear, fp32 parameters under torch.autocast(bfloat16)"
PURE_BASELINE = "axon4d.nn.block.DenseBlock (q, k, v separate nn.Linear), bf16 parameters"
#: the largest difference of the outputs allowed, relative to the output's largest magnitude
AGREEMENT = 5e-2
#: ... for the FP8 row: two e4m3 operands, each rounded within 2⁻⁴
FP8_AGREEMENT = 2.0**-3


class FusedQKVBlock(nn.Module):
    """``DenseBlock`` with q, k and v made by one ``nn.Linear``: its weight is the dense q, k and v
    weights stacked (q | k | v rows, bias likewise), split after the GEMM. The norms, the output
    projection and the MLP are the dense block's own modules (shared, not copied)."""

    def __init__(self, dense: DenseBlock):
        super().__init__()
        attn = dense.attn
        self.norm1, self.norm2, self.mlp, self.o_proj = dense.norm1, dense.norm2, dense.mlp, attn.o_proj
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.rope_theta = attn.rope_theta
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.splits = [p.out_features for p in parts]
        w = attn.q_proj.weight
        bias = attn.q_proj.bias is not None
        self.qkv = nn.Linear(w.shape[1], sum(self.splits), bias=bias, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([p.weight for p in parts]))  # (hq·d + 2·hkv·d, hidden)
            if bias:
                self.qkv.bias.copy_(torch.cat([p.bias for p in parts]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def _attention(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).split(self.splits, dim=-1)  # (b, s, hq·d), (b, s, hkv·d) twice
        q = q.view(b, s, self.heads, self.head_dim)
        k, v = k.view(b, s, self.kv_heads, self.head_dim), v.view(b, s, self.kv_heads, self.head_dim)
        return self.o_proj(causal_attention(q, k, v, self.rope_theta))  # (b, s, hidden)


def step_of(
    block: nn.Module, x: torch.Tensor, v: torch.Tensor, device: torch.device, autocast: bool = False
) -> Callable[[], float]:
    """One timed step of ``block``: forward and backward of ``(block(x) · v).sum()``, seconds; with
    ``autocast`` the forward and the loss run under ``torch.autocast`` to bf16."""

    def step() -> float:
        devices.synchronize(device)
        start = time.perf_counter()
        with _autocast(device, autocast):
            loss = (block(x) * v).sum()
        loss.backward()
        devices.synchronize(device)
        seconds = time.perf_counter() - start
        x.grad = None
        for p in block.parameters():
            p.grad = None
        return seconds

    return step


def _autocast(device: torch.device, on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def spread(values: list[float]) -> dict[str, float]:
    """min, quartiles (inclusive), median and max of ``values``."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"min": min(values), "q1": q1, "median": statistics.median(values), "q3": q3, "max": max(values)}


def timed_row(
    ours: nn.Module,
    theirs: nn.Module,
    autocast: bool,
    x: torch.Tensor,
    v: torch.Tensor,
    args: argparse.Namespace,
    bound: float = AGREEMENT,
) -> dict[str, Any]:
    """One row: the blocks' outputs compared, then ``args.pairs`` alternating pairs of steps after
    ``args.warmup`` of each (``theirs`` under autocast when ``autocast``)."""
    device = x.device
    with torch.no_grad(), _autocast(device, autocast):
        ref = theirs(x)
    with torch.no_grad():
        got = ours(x)
    agreement = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    if agreement > bound:
        raise SystemExit(f"gpu_block: axon4d's block differs from the baseline by {agreement:.2e} (> {bound})")
    steps = {"axon4d": step_of(ours, x, v, device), "torch": step_of(theirs, x, v, device, autocast)}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    samples = common.paired(steps, args.pairs)
    med = {k: common.median(s) for k, s in samples.items()}
    pairs = [a / t for a, t in zip(samples["axon4d"], samples["torch"])]
    return {
        "agreement": agreement,
        "samples_s": samples,
        "median_s": med,
        "ratio": med["axon4d"] / med["torch"],
        "pair_ratios": pairs,
        "pair_spread": spread(pairs),
    }


def width_config(width: int, head_dim: int) -> ModelConfig:
    """One block of the 20B model's kind at ``width``: heads of ``head_dim``, ffn 4·width."""
    return dataclasses.replace(SIZES["20B"], hidden=width, n_heads=width // head_dim, ffn_hidden=4 * width, n_layers=1)


@contextlib.contextmanager
def fp8_block(cfg: ModelConfig, args: argparse.Namespace) -> Iterator[tuple[TransformerBlock, Callable[[], float]]]:
    """A one-rank grid under ``bf16-fp8`` holding one axon4d block of ``cfg`` (fp32 weights, seed 0)
    and its timed step on ``args.tokens`` tokens of bf16 input (``step_of``); shut down on exit."""
    grid = _init(FP8, args.on_host)
    try:
        device = grid.device
        torch.manual_seed(0)
        block = TransformerBlock(cfg, device=device, dtype=torch.float32)
        x = torch.randn(1, args.tokens, cfg.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(cfg.hidden, device=device, dtype=torch.bfloat16)
        yield block, step_of(block, x, v, device)
    finally:
        axon4d.shutdown()


def fp8_sweep(widths: list[int], head_dim: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Where FP8 starts to win, per width and layer kind: for each hidden width W (heads W/head_dim,
    ffn 4W, ``args.tokens`` tokens) one axon4d block under ``bf16-fp8``, stepped with every layer in
    bf16 (``fp8_gemms`` off: the GEMMs of ``bf16-fp32-reduce``), with every layer that fits in FP8,
    and with each layer kind alone in FP8 (``Transformer.LAYER_KINDS``), ``args.sweep_pairs``
    alternating rounds of all of them. Each kind's measured saving (ms) is the median over rounds of
    the all-bf16 step less the step with that kind in FP8, beside the planner's (``axon4d.plan.fp8.
    kind_choices`` on ``args.machine``'s file, one rank: bf16 seconds less FP8 seconds, casts
    included) and the planner's choice."""
    rows = []
    machine = load_machine(args.machine)
    for width in widths:
        cfg = width_config(width, head_dim)
        with fp8_block(cfg, args) as (block, step):
            layers = dict(zip(Transformer.LAYER_KINDS, block.linears()))
            fits = {k: layer.fp8_gemms for k, layer in layers.items()}

            def with_fp8(kinds: tuple[str, ...]) -> Callable[[], float]:
                def run() -> float:
                    for k, layer in layers.items():
                        layer.fp8_gemms = fits[k] and k in kinds
                    return step()

                return run

            kinds = tuple(k for k in layers if fits[k])
            steps = {"bf16": with_fp8(()), "fp8": with_fp8(kinds), **{k: with_fp8((k,)) for k in kinds}}
            for run in steps.values():
                for _ in range(args.warmup):
                    run()
            samples = common.paired(steps, args.sweep_pairs)
        wl = Workload(
            dataclasses.replace(cfg, seq_len=args.tokens), batch=1, embedding=False, head=False, precision=FP8
        )
        priced = fp8_plan.kind_choices(Scenario(wl, GridShape(1, 1, 1, 1), machine))
        med = {k: common.median(s) for k, s in samples.items()}
        per_kind = {}
        for k in layers:
            saved = [b - f for b, f in zip(samples["bf16"], samples[k])] if k in samples else None
            choice, bf16_s, fp8_s = priced.get(k, (False, float("nan"), float("inf")))
            per_kind[k] = {
                "fits": fits[k],
                "measured_saving_ms": None if saved is None else 1e3 * common.median(saved),
                "planned_saving_ms": 1e3 * (bf16_s - fp8_s) if fp8_s != float("inf") else None,
                "planner_fp8": choice,
            }
        rows.append(
            {
                "hidden": width,
                "heads": cfg.n_heads,
                "samples_s": samples,
                "median_s": med,
                "bf16_over_fp8": med["bf16"] / med["fp8"],
                "kinds": per_kind,
            }
        )
        print(
            f"fp8 sweep width {width}: all bf16 {med['bf16'] * 1e3:.2f} ms, all fp8 {med['fp8'] * 1e3:.2f} ms "
            f"({med['bf16'] / med['fp8']:.3f}×); saved ms measured/planned "
            + ", ".join(
                f"{k} {r['measured_saving_ms']:.3f}/{r['planned_saving_ms']:.3f}{'*' if r['planner_fp8'] else ''}"
                for k, r in per_kind.items()
                if r["measured_saving_ms"] is not None and r["planned_saving_ms"] is not None
            ),
            flush=True,
        )
    return rows


def fp8_profile(width: int, head_dim: int, args: argparse.Namespace, top: int = 20) -> dict[str, Any]:
    """Where an all-FP8 step's time goes at ``width``: ``torch.profiler`` over three steps of one
    axon4d block under ``bf16-fp8`` (after ``args.warmup``), the ``top`` ops by device time and by
    host time (name, calls, self device µs, self host µs, per step), and both totals per step."""
    with fp8_block(width_config(width, head_dim), args) as (block, step):
        for _ in range(max(1, args.warmup)):
            step()
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if devices.is_accelerator(block.attn.qkv.weight.device) else []
        )
        steps = 3
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    def row(e: Any) -> dict[str, Any]:
        return {
            "name": e.key,
            "calls_per_step": e.count / steps,
            "self_device_us_per_step": device_us(e) / steps,
            "self_host_us_per_step": e.self_cpu_time_total / steps,
        }

    return {
        "width": width,
        "tokens": args.tokens,
        "by_device": [row(e) for e in sorted(events, key=device_us, reverse=True)[:top]],
        "by_host": [row(e) for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]],
        "device_us_per_step": sum(device_us(e) for e in events) / steps,
        "host_us_per_step": sum(e.self_cpu_time_total for e in events) / steps,
    }


def first_win(rows: list[dict[str, Any]], kind: str, key: str) -> int | None:
    """The smallest width of ``rows`` from which on ``kind``'s ``key`` (a saving in ms, or the
    planner's choice) says FP8 wins at every larger width too; None if it never does."""
    win = None
    for r in sorted(rows, key=lambda r: r["hidden"]):
        value = r["kinds"][kind][key]
        won = bool(value) if key == "planner_fp8" else value is not None and value > 0
        win = (win or r["hidden"]) if won else None
    return win


def _init(precision: str, on_host: bool) -> Grid:
    return axon4d.init(grid=(1, 1, 1, 1), precision=precision, device=devices.HOST if on_host else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    width = SIZES["20B"]
    p.add_argument("--hidden", type=int, default=width.hidden)
    p.add_argument("--heads", type=int, default=width.n_heads)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=20, help="timed A/B pairs per row")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--sweep",
        default="1024,2048,3072,4096,5120,6144,7168",
        help="hidden widths of the FP8 sweep, comma-separated ('' skips it)",
    )
    p.add_argument("--head-dim", type=int, default=128, help="the sweep's head width (20B's: 128)")
    p.add_argument("--sweep-pairs", type=int, default=8, help="alternating rounds per width of the sweep")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="profile three all-FP8 steps at this width (0: none); saved as fp8_profile",
    )
    p.add_argument("--machine", default="h100", help="the planner's machine file the sweep compares with")
    p.add_argument("--on-host", action="store_true", help="run on the host without an accelerator")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/gpu_block_<device>.json)")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: give at least one pair of steps per row")
    if not (devices.accelerator_available() or args.on_host):
        print("gpu_block: no accelerator here; --on-host runs it on the host", file=sys.stderr)
        return 1
    cfg = dataclasses.replace(width, hidden=args.hidden, n_heads=args.heads, ffn_hidden=4 * args.hidden, n_layers=1)
    bf16 = torch.bfloat16
    grid = _init(MIXED, args.on_host)
    device = grid.device
    try:
        torch.manual_seed(0)
        dense = DenseBlock(cfg, device=device, dtype=torch.float32)
        x = torch.randn(1, args.tokens, cfg.hidden, device=device, dtype=bf16, requires_grad=True)
        v = torch.randn(cfg.hidden, device=device, dtype=bf16)
        ours = TransformerBlock(cfg, device=device, dtype=torch.float32).load_dense_(dense)
        mixed = timed_row(ours, FusedQKVBlock(dense), True, x, v, args)
        del ours
        name = devices.device_name(device)
        known = peak.known_peak(name, bf16, tf32=False)
        peak_tflops, source = known if known is not None else (peak.measure_peak_tflops(grid, bf16), "measured")
    finally:
        axon4d.shutdown()
    fp8 = None
    if fp8_kernel.gemm_available(device):  # H100/H200 (and the host); not an A100
        _init(FP8, args.on_host)
        try:
            ours8 = TransformerBlock(cfg, device=device, dtype=torch.float32).load_dense_(dense)
            fp8 = timed_row(ours8, FusedQKVBlock(dense), True, x, v, args, bound=FP8_AGREEMENT)
            del ours8
        finally:
            axon4d.shutdown()
    widths = [int(w) for w in args.sweep.split(",") if w.strip()]
    sweep = fp8_sweep(widths, args.head_dim, args) if fp8 is not None and widths else []
    profiled = fp8_profile(args.profile, args.head_dim, args) if fp8 is not None and args.profile else None
    _init(PURE, args.on_host)
    try:
        dense16 = copy.deepcopy(dense).to(bf16)
        del dense
        pure = timed_row(
            TransformerBlock(cfg, device=device, dtype=bf16).load_dense_(dense16), dense16, False, x, v, args
        )
    finally:
        axon4d.shutdown()
    flops = _flops(cfg, args.tokens)
    mfu = flops / mixed["median_s"]["axon4d"] / (peak_tflops * 1e12)
    label = "host" if args.on_host else name.replace(" ", "_")
    out = args.out or os.path.join(ROOT, "bench", "results", f"gpu_block_{label}.json")
    result: dict[str, Any] = {
        "args": vars(args),
        "device": name,
        "config": dataclasses.asdict(cfg),
        "precision": MIXED,
        "baseline": BASELINE,
        **mixed,
        "pure_bf16": {"precision": PURE, "baseline": PURE_BASELINE, **pure},
        "fp8": None if fp8 is None else {"precision": FP8, "baseline": BASELINE, **fp8},
        # axon4d's bf16-fp32-reduce step over its bf16-fp8 step, each the median of its row (both
        # rows paired with the same baseline; the sweep pairs the two directly)
        "fp8_speedup": None if fp8 is None else mixed["median_s"]["axon4d"] / fp8["median_s"]["axon4d"],
        "fp8_cast": {"fused": fp8_fused.wanted(device), "failure": fp8_fused.failure()},
        "fp8_sweep": sweep,
        "fp8_profile": profiled,
        "fp8_first_win": {
            k: {"measured": first_win(sweep, k, "measured_saving_ms"), "planner": first_win(sweep, k, "planner_fp8")}
            for k in Transformer.LAYER_KINDS
        }
        if sweep
        else None,
        "planner_machine": args.machine,
        "step_flops": flops,
        "peak_tflops": peak_tflops,
        "peak_source": source,
        "mfu": mfu,
    }
    print(f"saved {common.save(out, result)}")
    if fp8 is not None:
        print(f"gpu fp8 GEMMs: {_row(fp8, 'fused QKV, autocast')}")
        print(
            f"gpu fp8: bf16-fp8 step {fp8['median_s']['axon4d'] * 1e3:.2f} ms against bf16-fp32-reduce "
            f"{mixed['median_s']['axon4d'] * 1e3:.2f} ms: {result['fp8_speedup']:.3f}× "
            f"(fused casts: {result['fp8_cast']['fused']})"
        )
    if profiled is not None:
        print(
            f"gpu fp8 profile width {profiled['width']}: device {profiled['device_us_per_step'] / 1e3:.2f} ms, "
            f"host {profiled['host_us_per_step'] / 1e3:.2f} ms a step; most device time: "
            + ", ".join(f"{r['name']} {r['self_device_us_per_step'] / 1e3:.2f}" for r in profiled["by_device"][:4])
        )
    if sweep:
        wins = result["fp8_first_win"]
        print(
            "gpu fp8 sweep: FP8 wins from width (measured / planner): "
            + ", ".join(f"{k} {w['measured']}/{w['planner']}" for k, w in wins.items())
        )
    print(f"gpu pure bf16: {_row(pure, 'unfused QKV, bf16 weights')}")
    what = "20B width" if cfg.hidden == width.hidden else "width"
    print(
        f"gpu: {what} {cfg.hidden}, 1 rank, bf16 over fp32 weights: {_row(mixed, 'fused QKV, autocast')}, MFU {100 * mfu:.1f}%"
    )
    return 0


def _row(row: dict[str, Any], baseline: str) -> str:
    """``step S ms, plain PyTorch (baseline) P ms (ratio R), pair ratios A-B`` of one row."""
    med, pairs = row["median_s"], row["pair_spread"]
    return (
        f"step {med['axon4d'] * 1e3:.2f} ms, plain PyTorch ({baseline}) {med['torch'] * 1e3:.2f} ms "
        f"(ratio {row['ratio']:.3f}), pair ratios {pairs['min']:.3f}-{pairs['max']:.3f}"
    )


def _flops(cfg: ModelConfig, tokens: int) -> float:
    """The model FLOPs of one step as the planner counts them: the block's matmuls and causal attention."""
    return Workload(dataclasses.replace(cfg, seq_len=tokens), batch=1, embedding=False, head=False).flops()


if __name__ == "__main__":
    raise SystemExit(main())
