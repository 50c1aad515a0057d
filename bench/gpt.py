"""The GPT benchmark: train a model of the size table on the 4D grid and report throughput, MFU and
the planner's predicted vs measured step time (docs/design.md §6).

    srun -N 256 --ntasks-per-node 4 python bench/gpt.py --model 80B --batch 2048 --grid auto --machine perlmutter
    torchrun --nproc-per-node 8 bench/gpt.py --model 20B --batch 64 --grid 2,2,2,1
    # on a CPU host: the same code path at reduced depth and width
    torchrun --nproc-per-node 8 bench/gpt.py --model 20B --layers 2 --hidden 448 --heads 8 --seq 128 \
        --vocab 4096 --batch 8 --dtype float32 --grid auto --machine bench/results/planner_machine_local.json

Runs ``--steps`` timed steps (after ``--warmup``) of ``axon4d.models.transformer.Transformer``
(embedding, blocks, final norm, vocab-parallel head and cross-entropy) with Adam on random tokens.
Tokens/s, TFLOP/s per device (model FLOPs, ``ModelConfig.flops_per_token``), MFU against the
machine file's peak, and the planner's prediction for the same grid and overlap policy go to
stdout and to ``bench/results/gpt_<model>.json``; the last line is
``gpt: <model> grid (x,y,z,d): T tokens/s, F TFLOP/s per device, MFU M%, step S ms (planner P ms, error E%)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402
from axon4d.shape import GridShape# noqa: E402
from axon4d.config import SIZES, get_config  # noqa: E402
from axon4d.plan import Overlap, Workload, describe, evaluate, load  # noqa: E402
from axon4d.plan.workload import DTYPES_TORCH  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="20B", help=f"size: {', '.join(SIZES)}")
    p.add_argument("--layers", type=int, default=None, help="override depth (reduced runs)")
    p.add_argument("--hidden", type=int, default=None, help="override width (reduced runs)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    p.add_argument("--grid", default="auto", help="x,y,z,data or auto (the planner chooses)")
    p.add_argument("--machine", default=None, help="machine name or file for the planner and the MFU peak")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES_TORCH))
    p.add_argument("--overlap", default="all", help="overlap policy (all, off, oag,oar,...)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpt_<model>.json)")
    return p.parse_args()


def main() -> int:
    args = parse()
    overrides = {k: v for k, v in (("n_layers", args.layers), ("hidden", args.hidden), ("n_heads", args.heads),
                                   ("seq_len", args.seq), ("vocab_size", args.vocab)) if v is not None}
    cfg = get_config(args.model, **overrides)
    machine_name = args.machine
    if machine_name is None:
        from axon4d.plan.auto import default_machine

        machine_name = default_machine()
    grid_spec = "auto" if args.grid == "auto" else tuple(int(v) for v in args.grid.split(","))
    grid = axon4d.init(grid=grid_spec, overlap=args.overlap, seed=0,
                       plan={"model": cfg, "batch": args.batch, "machine": machine_name, "dtype": args.dtype})
    from axon4d.models.transformer import Transformer

    dtype = DTYPES_TORCH[args.dtype]
    model = Transformer(cfg, grid=grid, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
    local = axon4d.shard_batch(ids).to(grid.device)  # (b, s+1) this rank's sequences

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(local[:, :-1], local[:, 1:])
        loss.backward()
        opt.step()
        return float(loss.detach())

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        grid.comm.barrier()
        t = time.perf_counter()
        step()
        devices.synchronize(grid.device)
        times.append(time.perf_counter() - t)
    per_rank = grid.comm.all_gather(torch.tensor(times, dtype=torch.float64, device=grid.device), "world").wait()
    slowest = per_rank.view(grid.world_size, -1).max(dim=0).values.tolist()
    shape, rank, world = grid.shape, grid.rank, grid.world_size
    axon4d.shutdown()
    if rank != 0:
        return 0

    measured = statistics.median(slowest)
    machine = load(machine_name)
    wl = Workload(cfg, args.batch, args.dtype)
    policy = Overlap.parse(args.overlap)
    cand = evaluate(wl, GridShape(*shape.as_tuple()), machine, policy)
    flops = cfg.flops_per_token() * args.batch * cfg.seq_len
    tflops = flops / measured / world / 1e12
    peak = machine.peak(args.dtype)
    result = {
        "model": cfg.__dict__, "grid": list(shape.as_tuple()), "world": world, "batch": args.batch, "dtype": args.dtype,
        "overlap": args.overlap, "machine": machine.name, "steps_s": slowest, "step_s": measured,
        "tokens_per_s": args.batch * cfg.seq_len / measured, "tflops_per_device": tflops, "mfu": tflops * 1e12 / peak,
        "predicted_step_s": cand.time.step_s, "predicted_mfu": cand.mfu, "time_error": (cand.time.step_s - measured) / measured,
        "predicted_memory_bytes": cand.mem.peak, "prediction": cand.to_json(),
    }
    out = args.out or os.path.join(ROOT, "bench/results", f"gpt_{args.model}{'_reduced' if overrides else ''}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{cfg.name} {'reduced ' + str(overrides) if overrides else ''} on {world} ranks, grid {shape.as_tuple()}, "
          f"overlap {describe(policy)}; steps (ms): "
          + ", ".join(f"{t * 1e3:.0f}" for t in slowest))
    print(f"saved {out}")
    print(f"gpt: {args.model} grid {shape.as_tuple()}: {result['tokens_per_s']:.0f} tokens/s, {tflops:.3g} TFLOP/s per "
          f"device, MFU {100 * result['mfu']:.1f}%, step {measured * 1e3:.0f} ms (planner {cand.time.step_s * 1e3:.0f} ms, "
          f"error {100 * result['time_error']:+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
