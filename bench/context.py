"""Long sequences with context parallelism (docs/context.md): throughput, memory per rank, the
causal balance of the head–tail split, and the planner's prediction.

For each sequence length S of ``--seqs``, a small Llama with grouped-query attention (``--heads``
query and ``--kv-heads`` key/value heads) trains on one sequence of S tokens:

- **split**: on ``--grid`` (default (1,2,4,1): 8 ranks) with ``context_parallel=True`` — the
  sequence's tokens split head–tail over z. ``--warmup`` + ``--steps`` steps of forward, backward
  and Adam (more steps for short sequences, so that at least ``--min-seconds`` are measured by
  the planner's estimate of a step); the step time is the median of the slowest rank's; peak memory per rank is the maximum
  over ranks (torch's memory tracker on the host, the allocator's peak on a GPU:
  ``axon4d.measure.probe.peak_bytes``);
- **unsplit**: the same model and sequence on the grid without z (default (1,2,1,1): 2 ranks), every
  rank holding the whole sequence: its peak memory per rank (``--unsplit-steps`` steps).

The balance of the causal work is measured rank by rank in one process (no contention between
ranks): for every z-rank r, forward + backward of its attention against the keys it needs — its
two head–tail chunks (chunks r and 2·G_z−1−r of 2·G_z), or, for comparison, one contiguous chunk r
of G_z (which needs the keys of every earlier chunk) — with this rank's heads (n/G_y query,
n_kv/G_y key/value), median of ``--reps``. The ratio of the slowest to the fastest rank is
reported for both layouts.

The planner (``axon4d.plan``, ``Workload(context_parallel=True)``) prices the split job on
``--machine``; its time and memory errors are (planner − measured) / measured.

    python bench/context.py                          # S = 4096 … 32768 on 8 ranks
    python bench/context.py --seqs 4096,8192 --steps 2
    python bench/context.py --seqs 32768 --keep      # re-measure one length, keep the others' rows

Each world is spawned on this host (bench/common.py's ``spawn``). Saves
``bench/results/context.json`` (with the result header of bench/common.py); the last line is
``context: seq = S, tokens/s = T, memory per rank = M GiB (unsplit U GiB), balance max/min = B (contiguous C)``
for the longest S.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

from axon4d.activations import sequence_chunks  # noqa: E402
from axon4d.config import ModelConfig  # noqa: E402
from axon4d.measure.spawn import run_local  # noqa: E402
from axon4d.nn.context import prefix_attention  # noqa: E402

#: the arguments rows kept by --keep must share
SETTING = ("grid", "unsplit_grid", "layers", "hidden", "heads", "kv_heads", "machine")


def model_config(args: argparse.Namespace, seq: int) -> ModelConfig:
    return ModelConfig(
        n_layers=args.layers,
        hidden=args.hidden,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=256,
        seq_len=seq,
        arch="llama",
        name="context-bench",
    )


def _train_steps(grid: Any, cfg: ModelConfig, split: bool, warmup: int, steps: int) -> dict[str, Any]:
    """On every rank: steps of one sequence of cfg.seq_len tokens; (this rank's step times, peak bytes)."""
    import axon4d
    from axon4d import activations
    from axon4d.measure.probe import peak_bytes
    from axon4d.models.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg, grid=grid, context_parallel=split)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(
        0, cfg.vocab_size, (grid.size("data"), cfg.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    cut = activations.shard_sequence if split else axon4d.shard_batch
    inputs, targets = cut(ids[:, :-1], grid), cut(ids[:, 1:], grid)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model.loss(inputs, targets).backward()
        opt.step()

    times = []
    for i in range(warmup + steps):
        grid.comm.barrier()
        t = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"times": times, "peak": peak_bytes(grid, model, opt, step)}


def _slowest_median(per_rank: list[dict[str, Any]]) -> float:
    steps = len(per_rank[0]["times"])
    return common.median(max(r["times"][i] for r in per_rank) for i in range(steps))


def attention_balance(
    seq: int, g_z: int, heads: int, kv_heads: int, head_dim: int, reps: int
) -> dict[str, list[float]]:
    """Per z-rank seconds of forward + backward attention for the head–tail and the contiguous
    layouts of one sequence of ``seq`` tokens (this rank's ``heads`` query, ``kv_heads`` key/value heads)."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, kv_heads, seq, head_dim, generator=gen, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, generator=gen, requires_grad=True)
    out: dict[str, list[float]] = {"head_tail": [], "contiguous": []}
    for z in range(g_z):
        q_ht = torch.randn(1, heads, seq // g_z, head_dim, generator=gen, requires_grad=True)
        q_c = torch.randn(1, heads, seq // g_z, head_dim, generator=gen, requires_grad=True)
        chunks = sequence_chunks(z, g_z)

        def head_tail() -> None:
            prefix_attention(q_ht, k, v, chunks).sum().backward()

        def contiguous() -> None:  # z-rank z holds tokens [z·S/G_z, (z+1)·S/G_z): chunks 2z and 2z+1 of 2·G_z
            prefix_attention(q_c, k, v, (2 * z, 2 * z + 1)).sum().backward()

        for name, fn in (("head_tail", head_tail), ("contiguous", contiguous)):
            fn()  # warm-up
            samples = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
            out[name].append(common.median(samples))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="4096,8192,16384,32768", help="sequence lengths")
    p.add_argument("--grid", default="1,2,4,1", help="the split grid x,y,z,data (z > 1)")
    p.add_argument("--unsplit-grid", default="1,2,1,1", help="the grid whose ranks hold whole sequences")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="measured steps (at least; see --min-seconds)")
    p.add_argument(
        "--min-seconds",
        type=float,
        default=12.0,
        help="measure at least this long: short sequences run more steps (by the planner's step estimate)",
    )
    p.add_argument("--unsplit-steps", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="repetitions of each rank's attention (balance)")
    p.add_argument("--machine", default=os.path.join(ROOT, "bench", "results", "planner_machine_host_2026-11-24.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "context.json"))
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows of other lengths already in --out (same setting; each row has its date)",
    )
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    head = common.header()

    from axon4d.grid.shape import GridShape
    from axon4d.options.overlap_policy import OverlapPolicy
    from axon4d.plan import Workload, evaluate, load

    split_grid = tuple(int(v) for v in args.grid.split(","))
    unsplit_grid = tuple(int(v) for v in args.unsplit_grid.split(","))
    shape, g_z, g_y = GridShape(*split_grid), split_grid[2], split_grid[1]
    machine = load(args.machine)
    seqs = [int(s) for s in args.seqs.split(",")]
    rows = []
    for seq in seqs:
        cfg = model_config(args, seq)
        wl = Workload(cfg, batch=shape.size("data"), dtype="float32", context_parallel=True)
        cand = evaluate(wl, shape, machine, OverlapPolicy.parse("all"))
        steps = max(args.steps, math.ceil(args.min_seconds / cand.time.step_s))
        split = run_local(
            shape.world_size,
            _train_steps,
            cfg,
            True,
            args.warmup,
            steps,
            grid=split_grid,
            every_rank=True,
            timeout=3600,
        )
        whole = run_local(
            GridShape(*unsplit_grid).world_size,
            _train_steps,
            cfg,
            False,
            0,
            args.unsplit_steps,
            grid=unsplit_grid,
            every_rank=True,
            timeout=3600,
        )
        step_s = _slowest_median(split)
        balance = attention_balance(
            seq, g_z, args.heads // g_y, args.kv_heads // g_y, args.hidden // args.heads, args.reps
        )
        row = {
            "seq": seq,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "steps": steps,
            "step_s": step_s,
            "tokens_per_s": seq * shape.size("data") / step_s,
            "memory_per_rank_bytes": max(r["peak"] for r in split),
            "unsplit_memory_per_rank_bytes": max(r["peak"] for r in whole),
            "unsplit_step_s": _slowest_median(whole),
            "attention_s": balance,
            "balance": max(balance["head_tail"]) / min(balance["head_tail"]),
            "contiguous_balance": max(balance["contiguous"]) / min(balance["contiguous"]),
            "planner_step_s": cand.time.step_s,
            "planner_memory_bytes": cand.mem.peak,
        }
        row["memory_ratio"] = row["memory_per_rank_bytes"] / row["unsplit_memory_per_rank_bytes"]
        row["time_error"] = (row["planner_step_s"] - step_s) / step_s
        row["memory_error"] = (row["planner_memory_bytes"] - row["memory_per_rank_bytes"]) / row[
            "memory_per_rank_bytes"
        ]
        rows.append(row)
        print(
            f"S {seq:6d}: step {step_s:7.2f} s ({row['tokens_per_s']:7.0f} tokens/s; planner {cand.time.step_s:7.2f} s, "
            f"{100 * row['time_error']:+.1f}%), memory/rank {row['memory_per_rank_bytes'] / 2**30:.3f} GiB (unsplit "
            f"{row['unsplit_memory_per_rank_bytes'] / 2**30:.3f} GiB, ratio {row['memory_ratio']:.2f}; planner "
            f"{100 * row['memory_error']:+.1f}%), balance {row['balance']:.2f} (contiguous {row['contiguous_balance']:.2f})",
            flush=True,
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if args.keep and os.path.exists(args.out):  # rows of other lengths from an earlier run of the same setting
        with open(args.out) as f:
            old = json.load(f)
        same = {k: old["args"].get(k) == getattr(args, k) for k in SETTING}
        if not all(same.values()):
            raise SystemExit(f"--keep: {args.out} was measured with other settings ({same}); drop --keep")
        rows = sorted(rows + [r for r in old["rows"] if r["seq"] not in seqs], key=lambda r: r["seq"])
    common.save(args.out, {"args": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}, head)
    print(f"saved {args.out}")
    last = rows[-1]
    print(
        f"context: seq = {last['seq']}, tokens/s = {last['tokens_per_s']:.0f}, memory per rank = "
        f"{last['memory_per_rank_bytes'] / 2**30:.3f} GiB (unsplit {last['unsplit_memory_per_rank_bytes'] / 2**30:.3f} GiB), "
        f"balance max/min = {last['balance']:.2f} (contiguous {last['contiguous_balance']:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
