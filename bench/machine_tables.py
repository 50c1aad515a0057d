"""Write the shipped GPU machine files' GEMM tables and SM counts from stated assumptions (docs/planner.md).

The files in ``axon4d/plan/machines/`` give published figures, not measurements. Two of their
parts are derived here rather than typed in, so that the assumptions are in one place and the
tables can be written again when one changes:

- ``matmul``: GEMM throughput on the lattice an accelerator calibrates (``axon4d.measure.kernels.
  ACCELERATOR_DIMS``, 16 … 16384), one table per dtype for all three forms, from the tile and wave
  quantization of NVIDIA's "Matrix Multiplication Background User's Guide": the output is cut into
  tiles of 128 × 256 (or 256 × 128, whichever is faster), one thread block per tile, and the tiles
  run in waves of one per SM; a wave runs at ``LARGE`` × the dense peak. Where there are fewer
  tiles than SMs, k is split over up to SMs/tiles blocks (cuBLAS's split-K; at least 512 of k each),
  their fp32 partial sums written and read once more. No GEMM runs faster than its operands and
  output stream through HBM at 80% of the datasheet bandwidth (the roofline of small and skinny
  shapes).
- ``compute_units``: the device's SMs (CUs). An NCCL kernel holds one SM per channel while it runs,
  so the GEMMs overlapped with it run at (1 − channels/SMs) of their rate for the overlapped time
  (``Machine.overlap_slowdown``; the planner charges it on the time overlap hides, not on
  collectives left exposed, beside which nothing computes).

    .venv/bin/python bench/machine_tables.py            # rewrites the four shipped files' tables
    .venv/bin/python bench/machine_tables.py --check    # exit 1 if a file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from axon4d.measure.kernels import ACCELERATOR_DIMS  # noqa: E402
from axon4d.plan.machine import FORMS, MACHINE_DIR  # noqa: E402

#: the GPU (one device as a rank sees it) of each shipped file: SMs (CUs), HBM bytes/s, and the share of
#: the dense peak one full wave of large tiles reaches
GPUS: dict[str, dict[str, Any]] = {
    "perlmutter": {
        "sms": 108,
        "hbm_Bps": 1555e9,
        "large": 0.80,
        "source": "NVIDIA A100 datasheet and whitepaper: 108 SMs, 1555 GB/s HBM2 (40 GB); a full wave of large "
        "bf16 tiles assumed at 80% of the 312 TFLOP/s peak (assumption)",
    },
    "h100": {
        "sms": 132,
        "hbm_Bps": 3.35e12,
        "large": 0.75,
        "source": "NVIDIA H100 SXM datasheet and whitepaper: 132 SMs, 3.35 TB/s HBM3; a full wave at 75% of the "
        "989 TFLOP/s peak: an H200 (the same GH100 die, 132 SMs) measured 657 TFLOP/s at 4096^3 in bf16 including "
        "~18 us of launch and synchronize per call (bench/results/machine_h200_one_gpu.json), ~720 TFLOP/s "
        "without, in 4 waves of which 97% is filled",
    },
    "h800": {
        "sms": 132,
        "hbm_Bps": 3.35e12,
        "large": 0.75,
        "source": "H800 SXM: the H100 SXM's die, 132 SMs, 3.35 TB/s HBM3; a full wave at 75% of peak as the h100 "
        "file (assumption)",
    },
    "frontier": {
        "sms": 110,
        "hbm_Bps": 1.6e12,
        "large": 0.60,
        "source": "AMD MI250X: 110 CUs and 1.6 TB/s HBM2E per GCD; a full wave at 60% of the 191.5 TFLOP/s "
        "bf16 peak per GCD (assumption, the file's matmul_efficiency)",
    },
}
#: output tile shapes (rows × columns of C) a large GEMM runs with, either way round
TILE = (128, 256)
#: the least k one split-K block takes
SPLIT_K_MIN = 512
#: share of the HBM datasheet bandwidth a GEMM's operands stream at (as the files' elementwise_Bps)
HBM_SHARE = 0.8
#: bytes per element of each dtype's operands
ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4}


def gemm_seconds(m: int, k: int, n: int, peak: float, sms: int, large: float, hbm_Bps: float, elem: int) -> float:
    """Seconds of one (m × k)·(k × n) GEMM: waves of tiles at ``large`` × ``peak``, split-K where the
    tiles are fewer than the SMs, and no faster than its bytes through HBM."""
    best = math.inf
    for tm, tn in (TILE, TILE[::-1]):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        split = max(1, min(sms // tiles, k // SPLIT_K_MIN)) if tiles < sms else 1
        waves = math.ceil(tiles * split / sms)
        compute = waves * 2.0 * tm * tn * math.ceil(k / split) / (large * peak / sms)
        partials = 2 * 4 * m * n * split if split > 1 else 0  # fp32 partial sums written and read
        stream = (elem * (m * k + k * n + m * n) + partials) / (HBM_SHARE * hbm_Bps)
        best = min(best, max(compute, stream))
    return best


def table(peak: float, gpu: dict[str, Any], elem: int) -> dict[str, Any]:
    """The GEMM table on ``ACCELERATOR_DIMS`` (FLOP/s, 4 significant digits) for one dtype."""
    dims = list(ACCELERATOR_DIMS)
    rates = [
        [
            [
                float(
                    f"{2.0 * m * k * n / gemm_seconds(m, k, n, peak, gpu['sms'], gpu['large'], gpu['hbm_Bps'], elem):.4g}"
                )
                for n in dims
            ]
            for k in dims
        ]
        for m in dims
    ]
    return {"dims": dims, "rates": rates}


def derived(d: dict[str, Any], name: str) -> dict[str, Any]:
    """``d`` (a shipped file as a dict) with its matmul tables, κ and their sources written."""
    gpu = GPUS[name]
    key = str(d["devices_per_node"])
    d = dict(d)
    # FP8 has no table of its own: axon4d.plan.fp8 prices it from bf16's and fp8_gemm_speedup
    d["matmul"] = {
        dt: {key: {f: table(peak, gpu, ELEMENT[dt]) for f in FORMS}}
        for dt, peak in d["peak_flops"].items()
        if dt in ELEMENT
    }
    d["compute_units"] = gpu["sms"]
    d.pop("comm_interference_s_per_byte", None)  # a host's measure; a GPU's is compute_units (below)
    sources = dict(d["sources"])
    sources["matmul"] = (
        f"derived by bench/machine_tables.py on calibrate's accelerator lattice {ACCELERATOR_DIMS}, the same "
        f"table for the three forms: tiles of {TILE[0]}x{TILE[1]} (either way round) in waves over "
        f"{gpu['sms']} SMs (NVIDIA, Matrix Multiplication Background User's Guide: tile and wave quantization), "
        f"split-K to fill the SMs where the tiles are fewer (at least {SPLIT_K_MIN} of k per block), no faster than "
        f"operands and output through HBM at {HBM_SHARE:.0%} of {gpu['hbm_Bps'] / 1e12:.3g} TB/s. {gpu['source']}. "
        "Assumptions: one tile shape, no per-kernel fixed cost beyond op_overhead_s, the planner interpolates "
        "between lattice points (the quantization of sizes between them is smoothed)"
    )
    sources.pop("comm_interference_s_per_byte", None)
    sources["compute_units"] = (
        f"{gpu['sms']} SMs ({gpu['source']}). With nccl_channels, what the GEMMs beside a collective lose: an NCCL "
        f"kernel holds one SM per channel ({d['nccl_channels']} of {gpu['sms']}) while it runs, so compute "
        "overlapped with it runs at (1 - channels/SMs) of its rate for the overlapped time "
        "(Machine.overlap_slowdown; a collective left exposed slows nothing). Assumption: GEMM time scales with "
        "the SMs left to it"
    )
    d["sources"] = sources
    return d


def dumps(d: dict[str, Any]) -> str:
    """JSON as the shipped files are laid out: one-space indent, lists of numbers on one line."""
    text = json.dumps(d, indent=1)

    def one_line(mo: re.Match[str]) -> str:
        return "[" + ", ".join(x.strip() for x in mo.group(1).split(",")) + "]"

    return re.sub(r"\[\s+([-0-9.e+,\s]+?)\s+\]", one_line, text) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 where a file differs from what would be written")
    args = p.parse_args(argv)
    stale = []
    for name in GPUS:
        path = os.path.join(MACHINE_DIR, f"{name}.json")
        with open(path) as f:
            before = f.read()
        after = dumps(derived(json.loads(before), name))
        if after != before:
            stale.append(name)
            if not args.check:
                with open(path, "w") as f:
                    f.write(after)
    print(f"machine tables: {'stale' if args.check else 'rewrote'} {stale or 'none'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
