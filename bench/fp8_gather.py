"""FP8 weight all-gathers against bf16 ones over a training run (issue 31, item 4).

The training job (``axon4d.train``) runs twice on the same grid, seed and data: with
``--precision bf16-fp8-gather`` (E10 moves e4m3 z shards and their scales, restored to bf16 for
the GEMM; docs/design.md §3) and with ``bf16-fp32-reduce`` (E10 moves bf16). Everything else —
bf16 compute, fp32 master weights and gradient reductions — is the same, so the loss curves differ
only by the weights' fp8 rounding in the forward and backward GEMMs. Compared: the mean of the
last 20 losses (``final_rel_diff``) and the largest per-step relative difference (``max_rel_diff``).

    .venv/bin/python bench/fp8_gather.py                      # (1,1,2,1), 200 steps; under a minute
    .venv/bin/python bench/fp8_gather.py --grid 1,1,4,1 --steps 100

Saves ``bench/results/fp8_gather_loss.json`` (both loss curves, the z axis's bytes per step, the
two figures, with the result header of bench/common.py); the last line is
``fp8 gathers: N steps, final loss X vs Y (bf16), max rel diff Z%``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
from fp8_train import job_config  # noqa: E402

FP8, BF16 = "bf16-fp8-gather", "bf16-fp32-reduce"
OUT = os.path.join(ROOT, "bench", "results", "fp8_gather_loss.json")
#: the mean of this many last losses is the run's final loss
TAIL = 20


def run(grid: str = "1,1,2,1", steps: int = 200, out: str = OUT) -> dict[str, Any]:
    """Train the small llama with each precision on ``grid`` for ``steps`` steps; save and return
    the curves and their differences."""
    head = common.header()
    losses, z_bytes, configs = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in (FP8, BF16):
            cfg = job_config(grid, steps, precision, os.path.join(tmp, precision))
            summary = common.train_on_ranks(cfg, timeout=1200)
            losses[precision] = [float(v) for v in summary["losses"]]
            z_bytes[precision] = summary["comm_bytes_per_step"].get("z", 0)
            configs[precision] = {k: v for k, v in cfg.items() if k != "out_dir"}
    a, b = losses[FP8], losses[BF16]
    final = {p: sum(v[-TAIL:]) / len(v[-TAIL:]) for p, v in losses.items()}
    result = {
        "grid": grid,
        "steps": steps,
        "configs": configs,
        "losses": losses,
        "final_loss": final,
        "final_rel_diff": abs(final[FP8] - final[BF16]) / final[BF16],
        "max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b)),
        "z_bytes_per_step": z_bytes,
        "metric": f"final: mean of the last {TAIL} losses; max_rel_diff: max over steps of |fp8 − bf16| / bf16",
    }
    result["saved"] = common.save(out, result, head)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="1,1,2,1", help="x,y,z,data (G_z > 1: otherwise nothing is gathered)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    r = run(args.grid, args.steps, args.out)
    print(f"saved {r['saved']}")
    print(
        f"fp8 gathers: {r['steps']} steps, final loss {r['final_loss'][FP8]:.4f} vs {r['final_loss'][BF16]:.4f} "
        f"(bf16), max rel diff {100 * r['max_rel_diff']:.3f}% (final {100 * r['final_rel_diff']:.3f}%; "
        f"z bytes/step {r['z_bytes_per_step'][FP8] / 2**20:.3f} vs {r['z_bytes_per_step'][BF16] / 2**20:.3f} MiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
