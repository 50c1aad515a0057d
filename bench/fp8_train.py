"""FP8 GEMMs against bf16 GEMMs over a training run (issues 44 and 53): a numerics result, not a timing.

The training job (``axon4d.train``) runs twice per grid on the same seed and data — a Llama of 4 blocks
of hidden 256 on the byte corpus, on two 4-rank grids: with ``--precision bf16-fp8`` (the 3D Linear's
forward, dX and dW GEMMs in FP8 with one tensorwise scale per local block: X and the weights e4m3,
quantised once per step and gathered as e4m3 where G_z > 1, dY e5m2; docs/design.md §2 "FP8 GEMMs")
and with ``bf16-fp32-reduce``. Embedding, LM head, norms and attention are bf16 in both. Compared: the
mean of the last 50 losses (``final_rel_diff``, bound: 1%) and the largest per-step relative
difference; reported: the share of dY's non-zero entries flushed to zero per layer kind on every
``LOG_EVERY``-th step (the job's ``fp8_underflow``) and each layer kind's GEMMs.

    .venv/bin/python bench/fp8_train.py                        # two grids, 500 steps each
    .venv/bin/python bench/fp8_train.py --grids 1,1,2,2 --steps 100

Saves ``bench/results/fp8_train_loss.json`` (both loss curves per grid, the final losses and their
differences, the underflow, with the result header of bench/common.py) and
``bench/results/fp8_train_loss.png`` (the curves); the last line is ``fp8 gemms: N steps on G grids,
final rel diff ≤ X% (max per-step Y%), dY flushed ≤ Z%``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import common  # noqa: E402

FP8, BF16 = "bf16-fp8", "bf16-fp32-reduce"
OUT = os.path.join(ROOT, "bench", "results", "fp8_train_loss.json")
#: (x, y, z, data), four ranks each: z and data split (the FP8 weight copies gathered over z), x and y split
GRIDS = ("1,1,2,2", "2,2,1,1")
#: the steps whose dY underflow the job counts (``--log-every``: fp8_underflow in log.jsonl)
LOG_EVERY = 25
#: the mean of this many last losses is a run's final loss
TAIL = 50


def job_config(grid: str, steps: int, precision: str, out_dir: str) -> dict[str, Any]:
    """The small llama's job: every Linear's local block a multiple of 16 on ``GRIDS`` (all run FP8);
    bench/fp8_gather.py trains the same job."""
    return dict(
        grid=grid,
        model="tiny",
        arch="llama",
        layers=4,
        hidden=256,
        heads=8,
        kv_heads=4,
        seq_len=64,
        lr=1e-3,
        min_lr=1e-4,
        data="corpus",
        batch_size=8,
        steps=steps,
        warmup_steps=10,
        precision=precision,
        seed=0,
        out_dir=out_dir,
        log_every=LOG_EVERY,
        peak_tflops=1.0,  # MFU is not compared: skip the start-up matmul timing
        progress=False,
        overwrite=True,
    )


def run(grids: tuple[str, ...] = GRIDS, steps: int = 500, out: str = OUT, plot: bool = True) -> dict[str, Any]:
    """Train the small llama with each precision on each of ``grids`` for ``steps`` steps; save and
    return the curves and their differences (and the plot, with ``plot``)."""
    head = common.header()
    per_grid: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for grid in grids:
            losses, underflow, gemms = {}, {}, {}
            for precision in (FP8, BF16):
                cfg = job_config(grid, steps, precision, os.path.join(tmp, grid, precision))
                summary = common.train_on_ranks(cfg, timeout=3000)
                losses[precision] = [float(v) for v in summary["losses"]]
                if precision == FP8:  # dY's flushed share per layer kind on the logged steps, and the GEMMs
                    with open(os.path.join(cfg["out_dir"], "log.jsonl")) as f:
                        logged = [json.loads(line) for line in f]
                    underflow = {r["step"]: r["fp8_underflow"] for r in logged if r.get("fp8_underflow")}
                    gemms = summary["gemm_precision"]
            final = {p: sum(v[-TAIL:]) / len(v[-TAIL:]) for p, v in losses.items()}
            per_grid[grid] = {
                "losses": losses,
                "final_loss": final,
                "final_rel_diff": abs(final[FP8] - final[BF16]) / final[BF16],
                "max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(losses[FP8], losses[BF16])),
                "fp8_underflow": underflow,
                "max_underflow": max((max(u.values()) for u in underflow.values()), default=0.0),
                "gemm_precision": gemms,
            }
    result = {
        "steps": steps,
        "config": {
            k: v for k, v in job_config("-", steps, "-", "-").items() if k not in ("grid", "precision", "out_dir")
        },
        "grids": per_grid,
        "metric": f"final: mean of the last {TAIL} losses; max_rel_diff: max over steps of |fp8 − bf16| / bf16",
        "bound": "final_rel_diff < 1% on every grid (issue 44)",
    }
    result["saved"] = common.save(out, result, head)
    if plot:
        result["plot"] = _plot(result, os.path.splitext(out)[0] + ".png")
    return result


def _plot(result: dict[str, Any], path: str) -> str:
    """Both loss curves of every grid, one panel per grid; saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = result["grids"]
    fig, axes = plt.subplots(1, len(grids), figsize=(5 * len(grids), 3.6), squeeze=False)
    for ax, (grid, r) in zip(axes[0], grids.items()):
        for precision, style in ((BF16, "-"), (FP8, "--")):
            ax.plot(r["losses"][precision], style, lw=0.8, label=precision)
        ax.set_title(f"grid (x,y,z,d) = ({grid}): final rel diff {100 * r['final_rel_diff']:.2f}%", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default=";".join(GRIDS), help="x,y,z,data grids separated by ';'")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    r = run(tuple(args.grids.split(";")), args.steps, args.out)
    print(f"saved {r['saved']} and {r.get('plot')}")
    worst = max(g["final_rel_diff"] for g in r["grids"].values())
    worst_step = max(g["max_rel_diff"] for g in r["grids"].values())
    flushed = max(g["max_underflow"] for g in r["grids"].values())
    print(
        f"fp8 gemms: {r['steps']} steps on {len(r['grids'])} grids, final rel diff ≤ {100 * worst:.3f}% "
        f"(max per-step {100 * worst_step:.3f}%), dY flushed ≤ {100 * flushed:.3f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
