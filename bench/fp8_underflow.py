"""How many of a layer's output-gradient entries each float8 format flushes to zero (issue 53, item 3):
a numerics result, not a timing.

A Llama of 4 blocks of 256 trains on the byte corpus in ``bf16-fp32-reduce`` on one rank for
``--steps`` steps. At a few steps, a backward hook takes each 3D Linear's output gradient dY and
quantises it as the FP8 GEMMs would (``axon4d.options.fp8_gemm.quantise``: its own current scale)
in e4m3 and in e5m2, and counts the non-zero entries whose code is zero. Why ``bf16-fp8`` quantises
dY to e5m2 by default (``axon4d.options.precision.FP8_GRAD``).

    .venv/bin/python bench/fp8_underflow.py

Saves ``bench/results/fp8_underflow.json`` (the share per layer, format and step); the last line is
``fp8 underflow: dY flushed up to X% in e4m3, Y% in e5m2 (N layers, steps S)``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "fp8_underflow.json")
#: the steps at which dY is looked at (counted from 0)
LOOKED = (0, 50, 100, 200)


def run(steps: int = 200, out: str = OUT) -> dict[str, Any]:
    """Train the model, look at dY at ``LOOKED`` steps up to ``steps``; save and return the shares."""
    import torch

    import axon4d
    from axon4d.config import ModelConfig
    from axon4d.options import fp8_gemm
    from axon4d.train.batches import accumulate, make_data, step_batches
    from axon4d.train.config import TrainConfig
    from axon4d.train.loop import build_model

    head = common.header()
    cfg = TrainConfig(model="small", data="corpus", vocab_size=256, batch_size=8, steps=steps)
    mcfg = ModelConfig(n_layers=4, hidden=256, n_heads=8, vocab_size=256, seq_len=128, arch="llama", name="small")
    grid = axon4d.init((1, 1, 1, 1), precision="bf16-fp32-reduce")
    try:
        torch.manual_seed(0)
        model = build_model(mcfg, grid)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = make_data(cfg, mcfg, grid)
        shares: dict[str, dict[str, dict[int, float]]] = collections.defaultdict(lambda: collections.defaultdict(dict))
        now = {"step": -1}

        def hook(name: str) -> Any:
            def look(module: Any, grad_in: Any, grad_out: Any) -> None:
                if now["step"] not in LOOKED:
                    return
                dy = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1])  # (tokens, out)
                for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
                    counts = torch.zeros(2, dtype=torch.int64)
                    fp8_gemm.count_flushes(dy, fp8_gemm.quantise(dy, dtype=fmt), counts)
                    shares[name][str(fmt).split("_")[-1]][now["step"]] = int(counts[0]) / max(1, int(counts[1]))

            return look

        for name, module in model.named_modules():
            if isinstance(module, axon4d.Linear):
                module.register_full_backward_hook(hook(name))
        losses = {}
        for step in range(steps + 1):
            now["step"] = step
            opt.zero_grad()
            loss = accumulate(model, step_batches(data, step, cfg), grid)
            opt.step()
            if step in LOOKED:
                losses[step] = float(loss)
    finally:
        axon4d.shutdown()
    result = {
        "model": "llama, 4 blocks of 256, 8 heads, seq 128, batch 8, byte corpus, AdamW lr 1e-3, one rank",
        "metric": "share of dY's non-zero entries whose float8 code is zero (the layer's own current scale)",
        "losses": losses,
        "shares": {n: dict(v) for n, v in shares.items()},
        "max": {f: max(max(v[f].values()) for v in shares.values()) for f in ("e4m3fn", "e5m2")},
    }
    result["saved"] = common.save(out, result, head)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    r = run(args.steps, args.out)
    print(f"saved {r['saved']}")
    print(
        f"fp8 underflow: dY flushed up to {100 * r['max']['e4m3fn']:.2f}% in e4m3, {100 * r['max']['e5m2']:.3f}% "
        f"in e5m2 ({len(r['shares'])} layers, steps {', '.join(map(str, LOOKED))})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
