"""FP8 GEMM against bf16 GEMM by size on one accelerator: the table the planner's ``fp8_gemm_speedup``
takes (``axon4d.plan.fp8.speedup``: rows [GEMM FLOPs, speed-up]).

For each layer of a GPT block at each width W of ``--widths`` (qkv W→3W, attention out W→W, MLP up
W→4W, MLP down 4W→W) on ``--tokens`` tokens, the three GEMMs a Linear runs — forward (b, in)·(in,
out), dX (b, out)·(out, in), dW (out, b)·(b, in) — each timed as a bf16 ``torch.matmul`` and as
``axon4d.device.fp8.scaled_mm`` of e4m3 operands with tensorwise scales (the GEMM alone: no casts,
which the planner prices itself). A GEMM's time is the median of ``--reps`` runs, each timed by
device events; the two kinds alternate run by run. Speed-up = bf16 seconds / FP8 seconds.

    python bench/fp8_gemm_speed.py                 # on a GPU with FP8 tensor cores
    python bench/fp8_gemm_speed.py --on-host --widths 256 --tokens 64 --reps 2   # checks the script

Saves ``bench/results/fp8_gemm_speed_<device>.json`` (every GEMM's shape, FLOPs, seconds both ways
and speed-up; ``rows``: [FLOPs, speed-up] sorted by FLOPs) and ends with
``fp8_gemm_speed: <device>: FP8 over bf16 S1× at F1 GFLOP … S2× at F2 GFLOP (median of N GEMMs: M×)``.
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

import common  # noqa: E402
import torch  # noqa: E402

from axon4d import device as devices  # noqa: E402
from axon4d.device import fp8  # noqa: E402

E4M3 = torch.float8_e4m3fn


def shapes(width: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of the three GEMMs of each of a block's four layers at ``width``."""
    out = []
    for layer, (fan_in, fan_out) in {
        "qkv": (width, 3 * width),
        "attn_out": (width, width),
        "mlp_up": (width, 4 * width),
        "mlp_down": (4 * width, width),
    }.items():
        out += [
            (f"{layer} forward", tokens, fan_in, fan_out),
            (f"{layer} dX", tokens, fan_out, fan_in),
            (f"{layer} dW", fan_out, tokens, fan_in),
        ]
    return out


def _timer(device: torch.device, fn: Any) -> float:
    """Seconds of one ``fn()``: device events on an accelerator, the wall clock on the host."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def time_gemm(device: torch.device, m: int, k: int, n: int, reps: int) -> tuple[float, float]:
    """(bf16 seconds, FP8 seconds) of one (m, k)·(k, n) GEMM, medians of ``reps`` alternating runs."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)  # the second operand as (n, k), row-major
    bt = b.t()  # (k, n)
    a8, b8 = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device=device, dtype=torch.float32)

    def bf16() -> None:
        torch.matmul(a, bt)

    def f8() -> None:
        fp8.scaled_mm(a8, b8, one, one, torch.bfloat16)

    for _ in range(3):
        bf16(), f8()
    samples = common.paired({"bf16": lambda: _timer(device, bf16), "fp8": lambda: _timer(device, f8)}, reps)
    return statistics.median(samples["bf16"]), statistics.median(samples["fp8"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="1024,2048,4096,7168,8192", help="hidden widths, comma-separated")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--on-host", action="store_true", help="run on the host (checks the script; no speed-up there)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not (devices.accelerator_available() or args.on_host):
        print("fp8_gemm_speed: no accelerator here; --on-host runs it on the host", file=sys.stderr)
        return 1
    device = devices.HOST if args.on_host else devices.default_device(0)
    if not fp8.gemm_available(device):
        print(f"fp8_gemm_speed: {devices.device_name(device)} has no FP8 GEMMs", file=sys.stderr)
        return 1
    gemms = []
    for width in (int(w) for w in args.widths.split(",")):
        for name, m, k, n in shapes(width, args.tokens):
            bf16_s, fp8_s = time_gemm(device, m, k, n, args.reps)
            flops = 2.0 * m * k * n
            gemms.append(
                {
                    "width": width,
                    "gemm": name,
                    "m": m,
                    "k": k,
                    "n": n,
                    "flops": flops,
                    "bf16_s": bf16_s,
                    "fp8_s": fp8_s,
                    "speedup": bf16_s / fp8_s,
                }
            )
    rows = sorted([g["flops"], g["speedup"]] for g in gemms)
    name = "host" if args.on_host else devices.device_name(device)
    out = args.out or os.path.join(ROOT, "bench", "results", f"fp8_gemm_speed_{name.replace(' ', '_')}.json")
    print(f"saved {common.save(out, {'args': vars(args), 'device': name, 'gemms': gemms, 'rows': rows})}")
    for g in gemms:
        print(f"  {g['width']:>5} {g['gemm']:<18} {g['flops'] / 1e9:9.1f} GFLOP  {g['speedup']:.3f}×")
    med = statistics.median(g["speedup"] for g in gemms)
    print(
        f"fp8_gemm_speed: {name}: FP8 over bf16 {rows[0][1]:.2f}× at {rows[0][0] / 1e9:.1f} GFLOP … "
        f"{rows[-1][1]:.2f}× at {rows[-1][0] / 1e9:.1f} GFLOP (median of {len(gemms)} GEMMs: {med:.2f}×)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
