"""Gradient accumulation moves the data axis's bytes once per step (issue 30, item 2).

The training job (``axon4d.train``) runs twice on the same grid with the same global batch per
step: once as one micro-batch, once as ``--micro-batches`` micro-batches of a ``1/M`` of it. Every
micro-batch but the last holds its data-axis reductions (``Scheduler.accumulating``,
docs/design.md §4), so the bytes per step on the data and batch axes in the job's
``summary.json`` must be the same for both, while E11's reduce-scatter over z runs once per
micro-batch (the z axis moves M times the bytes). The losses of the two runs agree to rounding:
the gradients are those of the whole batch either way.

    .venv/bin/python bench/accumulation.py                   # (2,1,2,2), 8 ranks, M = 4; about a minute
    .venv/bin/python bench/accumulation.py --grid 1,1,2,2 --micro-batches 8

Saves ``bench/results/accumulation.json`` (both summaries' bytes per step and losses, with the
result header of bench/common.py); the last line is
``accumulation: data-axis bytes per step with M micro-batches / with 1 = R (data D MiB, batch B MiB; z ×Z)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="2,1,2,2", help="x,y,z,data")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (split into the micro-batches)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "accumulation.json"))
    args = p.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in (1, args.micro_batches):
            cfg = dict(
                grid=args.grid,
                model="tiny",
                layers=2,
                hidden=64,
                heads=4,
                kv_heads=2,
                vocab_size=128,
                seq_len=16,
                batch_size=args.batch_size // m,
                micro_batches=m,
                steps=args.steps,
                warmup_steps=1,
                out_dir=os.path.join(tmp, f"m{m}"),
                progress=False,
                overwrite=True,
            )
            summary = common.train_on_ranks(cfg, timeout=1200)
            runs[m] = {
                "config": cfg,
                "comm_bytes_per_step": summary["comm_bytes_per_step"],
                "losses": summary["losses"],
            }
    one, many = runs[1]["comm_bytes_per_step"], runs[args.micro_batches]["comm_bytes_per_step"]
    data_axes = [a for a in ("data", "batch") if a in one]
    ratio = sum(many.get(a, 0) for a in data_axes) / sum(one[a] for a in data_axes)
    z_ratio = many.get("z", 0) / one["z"] if one.get("z") else None
    losses = zip(runs[1]["losses"], runs[args.micro_batches]["losses"])
    result = {
        "args": vars(args),
        "runs": {str(m): r for m, r in runs.items()},
        "data_axis_ratio": ratio,
        "z_ratio": z_ratio,
        "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in losses),
    }
    print(f"saved {common.save(args.out, result)}")
    mib = {a: one.get(a, 0) / 2**20 for a in ("data", "batch")}
    z = "" if z_ratio is None else f"; z ×{z_ratio:.2f}"
    print(
        f"accumulation: data-axis bytes per step with {args.micro_batches} micro-batches / with 1 = {ratio:.3f} "
        f"(data {mib['data']:.3f} MiB, batch {mib['batch']:.3f} MiB{z})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
