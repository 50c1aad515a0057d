"""One transformer block of the 20B width on one GPU: axon4d against plain PyTorch (issue 30, GPU target).

On a grid of one rank (``axon4d.init(grid=(1, 1, 1, 1), precision="bf16")``) axon4d's
``TransformerBlock`` runs the ops of its plain PyTorch reference ``DenseBlock`` (``nn.Linear``,
``F.scaled_dot_product_attention``, ``nn.LayerNorm``, GELU, bf16 parameters): the bench says what
the library's machinery costs where a GPU runs it. The block is a GPT block of the 20B width
(``axon4d.config.SIZES["20B"]``: hidden 7168, 56 heads, ffn 28672, biases), on ``--tokens``
tokens as one sequence. Both blocks hold the same weights; their outputs are compared first
(bf16: within 5e-2 of the output's scale). One step is forward and backward of the input's
``(y · v).sum()``, the gradients set to None after. The two blocks' steps are timed alternately
(A B, B A, …: ``bench/common.paired``), each step ending on a device synchronize; the figures are
the medians. MFU is the model FLOPs of a step (``axon4d.plan.Workload.flops``: 6 per matmul
parameter per token plus causal attention) over the step time and the accelerator's dense bf16 peak
from axon4d.train.peak's table (a measured matmul peak for a device it does not list).

    python bench/gpu_block.py                        # on the GPU machine (make gpu-check runs it)
    python bench/gpu_block.py --on-host --hidden 256 --heads 4 --tokens 128 --pairs 3   # checks the script

Saves ``bench/results/gpu_block_<device>.json``; the last line is
``gpu: 20B width 7168, 1 rank, bf16: step S ms, plain PyTorch P ms (ratio R), MFU M%``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402
from axon4d.config import SIZES  # noqa: E402
from axon4d.nn.block import DenseBlock, TransformerBlock  # noqa: E402
from axon4d.plan import Workload  # noqa: E402
from axon4d.train import peak  # noqa: E402


def step_of(block: nn.Module, x: torch.Tensor, v: torch.Tensor, device: torch.device) -> Callable[[], float]:
    """One timed step of ``block``: forward and backward of ``(block(x) · v).sum()``, seconds."""

    def step() -> float:
        devices.synchronize(device)
        start = time.perf_counter()
        (block(x) * v).sum().backward()
        devices.synchronize(device)
        seconds = time.perf_counter() - start
        x.grad = None
        for p in block.parameters():
            p.grad = None
        return seconds

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    width = SIZES["20B"]
    p.add_argument("--hidden", type=int, default=width.hidden)
    p.add_argument("--heads", type=int, default=width.n_heads)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=20, help="timed A/B pairs")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--on-host", action="store_true", help="run on the host without an accelerator")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/gpu_block_<device>.json)")
    args = p.parse_args(argv)
    if not (devices.accelerator_available() or args.on_host):
        print("gpu_block: no accelerator here; --on-host runs it on the host", file=sys.stderr)
        return 1
    cfg = dataclasses.replace(width, hidden=args.hidden, n_heads=args.heads, ffn_hidden=4 * args.hidden, n_layers=1)
    grid = axon4d.init(grid=(1, 1, 1, 1), precision="bf16", device=devices.HOST if args.on_host else None)
    device, dtype = grid.device, torch.bfloat16
    try:
        torch.manual_seed(0)
        dense = DenseBlock(cfg, device=device, dtype=dtype)
        block = TransformerBlock(cfg, device=device, dtype=dtype).load_dense_(dense)
        x = torch.randn(1, args.tokens, cfg.hidden, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(cfg.hidden, device=device, dtype=dtype)
        with torch.no_grad():
            ref, got = dense(x), block(x)
        agreement = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        if agreement > 5e-2:
            raise SystemExit(f"gpu_block: axon4d's block differs from DenseBlock by {agreement:.2e} (> 5e-2)")
        steps = {"axon4d": step_of(block, x, v, device), "torch": step_of(dense, x, v, device)}
        for step in steps.values():
            for _ in range(args.warmup):
                step()
        samples = common.paired(steps, args.pairs)
        med = {k: common.median(s) for k, s in samples.items()}
        name = devices.device_name(device)
        known = peak.known_peak(name, dtype, tf32=False)
        peak_tflops, source = known if known is not None else (peak.measure_peak_tflops(grid, dtype), "measured")
    finally:
        axon4d.shutdown()
    # the model FLOPs as the planner counts them: the block's matmuls and causal attention
    flops = Workload(dataclasses.replace(cfg, seq_len=args.tokens), batch=1, embedding=False, head=False).flops()
    mfu = flops / med["axon4d"] / (peak_tflops * 1e12)
    ratio = med["axon4d"] / med["torch"]
    label = "host" if args.on_host else name.replace(" ", "_")
    out = args.out or os.path.join(ROOT, "bench", "results", f"gpu_block_{label}.json")
    result: dict[str, Any] = {
        "args": vars(args),
        "device": name,
        "config": dataclasses.asdict(cfg),
        "agreement": agreement,
        "samples_s": samples,
        "median_s": med,
        "ratio": ratio,
        "step_flops": flops,
        "peak_tflops": peak_tflops,
        "peak_source": source,
        "mfu": mfu,
    }
    print(f"saved {common.save(out, result)}")
    what = "20B width" if cfg.hidden == width.hidden else "width"
    print(
        f"gpu: {what} {cfg.hidden}, 1 rank, bf16: step {med['axon4d'] * 1e3:.2f} ms, plain PyTorch "
        f"{med['torch'] * 1e3:.2f} ms (ratio {ratio:.3f}), MFU {100 * mfu:.1f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
