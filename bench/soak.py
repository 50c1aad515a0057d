"""Soak: a long run of the training job, for leaks and for the reliability machinery (docs/reliability.md).

Runs ``axon4d train`` (a tiny Llama, synthetic data) for ``--steps`` steps on ``--ranks`` ranks
under torchrun, saving a checkpoint every ``--save-every`` steps, with one non-finite step planted:
at step ``--nonfinite-at`` every rank's logits are multiplied by NaN (patched in from outside the
library, as tests/fault_check.py does), so the loss and every gradient are NaN and the job must
skip that step on every rank alike and go on. From rank 0's ``log.jsonl`` (each record holds
that rank's resident memory and thread count, axon4d.train.report.host_usage) it reports the
growth of resident memory from the first checkpointed step (everything allocated once is there
by then) to the last step, the thread count at both, the checkpoints written and the skipped steps.

    python bench/soak.py                     # 1,000 steps on 4 ranks, checkpoints every 100

Saves ``bench/results/soak.json`` (with the result header of bench/common.py); the last line is
``soak: steps = 1000, rss growth = G%, threads = T0 -> T1, checkpoints = K, nonfinite skipped = N``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(args: argparse.Namespace, out_dir: str) -> list[str]:
    return [
        "--model",
        "tiny",
        "--grid",
        "1,2,1,-1",
        "--steps",
        str(args.steps),
        "--batch-size",
        "8",
        "--save-every",
        str(args.save_every),
        "--no-progress",
        "--peak-tflops",
        "1",
        "--max-nonfinite",
        "3",
        "--out-dir",
        out_dir,
    ]


def _rank_main(nonfinite_at: int, flags: list[str]) -> int:
    """Inside torchrun: plant the non-finite step, then run the job."""
    sys.path.insert(0, ROOT)
    import torch

    from axon4d.models.transformer import Transformer
    from axon4d.train import add_arguments, main

    forward = Transformer.forward
    calls = {"n": 0}

    def planted(self: Transformer, ids: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1  # one forward per step
        out = forward(self, ids)
        return out * float("nan") if calls["n"] == nonfinite_at else out

    Transformer.forward = planted  # type: ignore[method-assign]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main(parser.parse_args(flags))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--nonfinite-at", type=int, default=500)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak.json"))
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        return _rank_main(args.nonfinite_at, _flags(args, os.environ["AXON4D_SOAK_DIR"]))

    head = common.header()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "run")
        from axon4d.grid.launch import free_port

        cmd = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            "--nproc-per-node",
            str(args.ranks),
            "--master-port",
            str(free_port()),
            os.path.abspath(__file__),
            "--rank-main",
            "--steps",
            str(args.steps),
            "--save-every",
            str(args.save_every),
            "--nonfinite-at",
            str(args.nonfinite_at),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", AXON4D_SOAK_DIR=out_dir, PYTHONPATH=ROOT)
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            raise SystemExit(f"the soak run failed (exit {proc.returncode})")
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            log = [json.loads(line) for line in f]
        with open(os.path.join(out_dir, "summary.json")) as f:
            summary = json.load(f)
        checkpoints = sorted(
            d for d in os.listdir(os.path.join(out_dir, "checkpoints")) if d.startswith("step_") and d[5:].isdigit()
        )
    by_step = {r["step"]: r for r in log}
    first = by_step[args.save_every]  # after the first checkpoint: every one-time allocation is made
    last = by_step[args.steps]
    growth = (last["rss_bytes"] - first["rss_bytes"]) / first["rss_bytes"]
    skipped = [r["step"] for r in log if r.get("skipped")]
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "rank_main"},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall,
        "steps": len(log),
        "rss_bytes": {"first": first["rss_bytes"], "last": last["rss_bytes"], "from_step": args.save_every},
        "rss_growth_pct": 100 * growth,
        "rss_growth_bytes_per_step": (last["rss_bytes"] - first["rss_bytes"]) / (args.steps - args.save_every),
        "threads": {"first": first["threads"], "last": last["threads"]},
        "checkpoints": checkpoints,
        "nonfinite_skipped_steps": skipped,
        "summary": summary,
        "rss_by_step": [[r["step"], r["rss_bytes"]] for r in log[:: max(1, len(log) // 100)]],
    }
    print(f"saved {common.save(args.out, result, head)} ({wall:.0f} s)")
    print(
        f"soak: steps = {len(log)}, rss growth = {100 * growth:.2f}%, threads = {first['threads']} -> "
        f"{last['threads']}, checkpoints = {len(checkpoints)}, nonfinite skipped = {len(skipped)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
