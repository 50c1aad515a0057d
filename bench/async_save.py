"""Asynchronous checkpoints: how long a save stops training, in the background against blocking.

On ``--ranks`` gloo ranks a Llama of ``--layers`` × ``--hidden`` with its AdamW state (every
parameter and both moments) trains on random tokens and saves the same state, in turn, with
``axon4d.checkpoint.save`` (blocking: training waits for the whole write, its checksums and the
publication) and with ``axon4d.checkpoint.AsyncSaver`` (training waits for the previous save's
publication and the host snapshot; DCP writes in the background). Between two saves the ranks
train for about 1.5× the blocking save's time, so a background write has time to end, as it does
when saves are minutes apart; the steps that ran beside a background write are timed apart from
the others (the write shares the host's cores). The first save of each kind is a warm-up (the
saver's process group and snapshot buffers are made then) and is left out of the medians. Saves
go to ``--dir`` (default: a temporary directory on the disk of /tmp).

    python bench/async_save.py                      # 4 ranks, (1,2,2,1), 4 layers × 1024, 4 saves each

Saves ``bench/results/async_save.json`` (rank 0's seconds per save and per step, with the result
header of bench/common.py); the last line is
``async save: blocked X s per save against Y s synchronous (Z×), N MB state``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

import axon4d  # noqa: E402
from axon4d import checkpoint  # noqa: E402
from axon4d.config import ModelConfig  # noqa: E402
from axon4d.grid.mesh import Grid  # noqa: E402
from axon4d.measure.spawn import run_local  # noqa: E402
from axon4d.models.transformer import Transformer  # noqa: E402


def _measure(grid: Grid, cfg: ModelConfig, saves: int, batch: int, out_dir: str) -> dict[str, Any]:
    """On every rank: ``saves`` + 1 saves of each kind, alternating, with training between them;
    this rank's seconds blocked per save, its step times, and the bytes of one checkpoint."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)

    def step() -> float:
        t0 = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    step()  # the moments exist from here on
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    steps: dict[str, list[float]] = {"quiet": [], "writing": []}
    count = 0
    with checkpoint.AsyncSaver(grid) as saver:
        for r in range(saves + 1):
            for kind in common.rotated(["sync", "async"], r):
                count += 1
                path = os.path.join(out_dir, f"step_{count}")
                t0 = time.perf_counter()
                if kind == "sync":
                    checkpoint.save(path, model, grid, opt, step=count, keep_last=2)
                else:
                    saver.save(path, model, opt, step=count, keep_last=2)
                blocked[kind].append(time.perf_counter() - t0)
                # train for about 1.5× a blocking save (round 0 saves blocking first), timing the
                # steps beside a background write apart
                budget = 1.5 * blocked["sync"][-1]
                start = time.perf_counter()
                while time.perf_counter() - start < budget:
                    writing = saver.in_flight is not None and not saver.written
                    steps["writing" if writing else "quiet"].append(step())
                if saver.in_flight is not None:
                    t0 = time.perf_counter()
                    saver.wait()  # the publication: counted as blocked, as the next save pays it
                    blocked["async"][-1] += time.perf_counter() - t0
    state_bytes = sum(f["bytes"] for f in checkpoint.read_meta(checkpoint.latest(out_dir) or "")["files"].values())
    return {"blocked_s": blocked, "step_s": steps, "state_bytes": state_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--grid", default="1,2,2,1", help="x,y,z,data")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--saves", type=int, default=4, help="measured saves of each kind (after one warm-up each)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "async_save.json"))
    args = p.parse_args(argv)
    grid = tuple(int(g) for g in args.grid.split(","))
    cfg = ModelConfig(
        n_layers=args.layers,
        hidden=args.hidden,
        n_heads=args.hidden // 64,
        vocab_size=args.vocab,
        seq_len=args.seq_len,
    )
    head = common.header()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        got = run_local(args.ranks, _measure, cfg, args.saves, args.batch, tmp, grid=grid, timeout=3600)
    sync, bg = (common.median(got["blocked_s"][k][1:]) for k in ("sync", "async"))
    quiet, writing = got["step_s"]["quiet"], got["step_s"]["writing"]
    result = {
        "args": vars(args),
        "params": cfg.n_params(),
        "state_mb": got["state_bytes"] / 1e6,
        "blocked_s": got["blocked_s"],
        "median_blocked_s": {"sync": sync, "async": bg},
        "speedup": sync / bg,
        "median_step_s": {
            "quiet": common.median(quiet) if quiet else None,
            "beside_a_write": common.median(writing) if writing else None,
        },
        "steps_beside_a_write": len(writing),
    }
    print(f"saved {common.save(args.out, result, head)}")
    print(
        f"async save: blocked {bg:.3f} s per save against {sync:.3f} s synchronous ({sync / bg:.1f}×), "
        f"{result['state_mb']:.0f} MB state"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
