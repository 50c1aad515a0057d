"""The MoE training job on the 4D grid against the same model in one process (issue 43, item 3): a
numerics result, not a timing.

The training job (``axon4d.train``) trains the size table's ``tiny-moe`` (2 blocks, hidden 64, 8
experts top-2, one shared expert) on a grid of 8 ranks with ``--compare-single``: the run's initial
model, gathered whole, is trained again in one process on the same batches (``axon4d.train.reference``)
and the two loss curves are compared step by step — what ``docs/moe.md`` gives as a command:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 8 -m axon4d.train --grid 1,2,2,2 --model tiny-moe \\
        --data corpus --steps 30 --batch-size 16 --warmup-steps 4 --compare-single

    .venv/bin/python bench/moe_job.py                     # the same job, 8 local ranks
    .venv/bin/python bench/moe_job.py --grid 2,1,2,2 --steps 60

Saves ``bench/results/moe_job.json`` (both loss curves, the tokens per expert of the last step,
with the result header of bench/common.py); the last line is
``moe job: max relative loss difference = D over N steps on GRID (W ranks) against one process``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="1,2,2,2", help="x,y,z,data")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "moe_job.json"))
    args = p.parse_args(argv)
    world = math.prod(int(g) for g in args.grid.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(
            grid=args.grid,
            model="tiny-moe",
            data="corpus",
            steps=args.steps,
            batch_size=args.batch_size,
            warmup_steps=4,
            compare_single=True,
            out_dir=tmp,
            progress=False,
            overwrite=True,
        )
        summary = common.train_on_ranks(cfg, timeout=1200)
        with open(os.path.join(tmp, "log.jsonl")) as f:
            last = [json.loads(line) for line in f][-1]
    result = {
        "args": vars(args),
        "config": cfg | {"out_dir": None},
        "losses": summary["losses"],
        "single_process_losses": summary["single_process_losses"],
        "max_rel_diff": summary["max_rel_diff"],
        "last_step_moe": last.get("moe"),
    }
    print(f"saved {common.save(args.out, result)}")
    print(
        f"moe job: max relative loss difference = {summary['max_rel_diff']:.1e} over {len(summary['losses'])} steps "
        f"on {args.grid} ({world} ranks) against one process"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
