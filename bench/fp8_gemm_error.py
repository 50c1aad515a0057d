"""Per-layer error of the FP8 GEMMs against the bf16 GEMMs (issue 44 item 3): a numerics result, not a timing.

For Linear shapes of the tiny and of wider models, one process, seeded Gaussian X (bf16), an fp32
weight with nn.Linear's init and dY (bf16, scaled 1e-3 like a loss gradient): the relative
Frobenius error of Y, dX and dW computed by ``axon4d.options.fp8_gemm`` (e4m3 operands, one tensorwise scale
each, the weight's a power of two) against the same GEMMs on the bf16 operands with fp32 sums —
with dY in e4m3 (the library's choice) and in e5m2 (the usual alternative for gradients).

    .venv/bin/python bench/fp8_gemm_error.py

Saves ``bench/results/fp8_gemm_error.json``; the last line is
``fp8 gemm error: Y ≤ a, dX ≤ b, dW ≤ c (e4m3 gradients); e5m2 gradients: dX ≤ d, dW ≤ e``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

from axon4d.options import fp8_gemm  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "fp8_gemm_error.json")
#: (tokens, in, out)
SHAPES = [(256, 64, 128), (256, 64, 256), (256, 256, 64), (512, 1024, 1024), (512, 1024, 4096), (512, 4096, 1024)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def measure(tokens: int, fin: int, fout: int, seed: int = 0) -> dict[str, Any]:
    """The relative errors of one shape's three GEMMs (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, fin, generator=g).bfloat16()
    w = (torch.rand(fout, fin, generator=g) * 2 - 1) / fin**0.5
    dy = (torch.randn(tokens, fout, generator=g) * 1e-3).bfloat16()
    wb = w.bfloat16().float()
    ref = {"Y": x.float() @ wb.t(), "dX": dy.float() @ wb, "dW": dy.float().t() @ x.float()}
    xq, wq = fp8_gemm.quantise(x), fp8_gemm.quantise(w, pow2=True)
    out: dict[str, Any] = {
        "shape": [tokens, fin, fout],
        "Y": _rel(fp8_gemm.forward(xq, wq, None, torch.float32), ref["Y"]),
    }
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        dyq = fp8_gemm.quantise(dy, dtype=dtype)
        out[f"dX {name}"] = _rel(fp8_gemm.dequantise(dyq) @ fp8_gemm.dequantise(wq), ref["dX"])
        out[f"dW {name}"] = _rel(fp8_gemm.dequantise(dyq).t() @ fp8_gemm.dequantise(xq), ref["dW"])
    return out


def main() -> int:
    rows = [measure(*s) for s in SHAPES]
    result = {"rows": rows, "metric": "‖fp8 − bf16‖_F / ‖bf16‖_F per GEMM; bf16 operands, fp32 sums as reference"}
    print(f"saved {common.save(OUT, result, common.header())}")
    worst = {k: max(r[k] for r in rows) for k in rows[0] if k != "shape"}
    print(
        f"fp8 gemm error: Y ≤ {worst['Y']:.4f}, dX ≤ {worst['dX e4m3']:.4f}, dW ≤ {worst['dW e4m3']:.4f} (e4m3 gradients); "
        f"e5m2 gradients: dX ≤ {worst['dX e5m2']:.4f}, dW ≤ {worst['dW e5m2']:.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
