"""The GPT benchmark: train a model of the size table on the 4D grid, at its real width and reduced
depth where need be, and compare step time and peak memory per rank with the planner's prediction
for exactly the same job (docs/design.md §6).

    srun -N 256 --ntasks-per-node 4 python bench/gpt.py --model 80B --batch 2048 --grid auto --machine perlmutter
    torchrun --nproc-per-node 8 bench/gpt.py --model 20B --layers 2 --batch 16 --grid 2,2,2,1 --machine MACHINE
    # on one CPU host (8 ranks): the 20B width, one block, a short sequence
    mpiexec -n 8 .venv/bin/python bench/gpt.py --model 20B --layers 1 --seq-len 256 --batch 8 --dtype float32 \
        --grid 2,2,2,1 --steps 3 --warmup 1

Runs ``--warmup`` + ``--steps`` steps of ``axon4d.models.transformer.Transformer`` (embedding,
blocks, final norm, vocab-parallel head and cross-entropy) with Adam (or, with ``--optimizer sgd``,
plain SGD, which keeps no state: the 80B width fits 8 ranks of one host only so) on random tokens, printing one
line per step as it goes (rank 0: the step's seconds and rank 0's loss). The step time is the
median over the timed steps of the slowest rank's step (a barrier before each step, the device
synchronised after). Peak memory per rank is measured over one more step: torch's ``MemTracker``
on the host (``axon4d.measure.probe.peak_bytes``), the allocator's
``max_memory_allocated`` on a GPU; the maximum over ranks.

Whatever is smaller than the size table's model or than a production run is printed at start and
saved under ``reduced`` in the JSON: depth (``--layers``), sequence (``--seq-len``), width, heads and
vocabulary when overridden, the batch, and the optimizer (Adam or SGD, constant learning rate, no
weight decay or clipping, where the training job runs AdamW on a schedule with clipping). The planner
prices the same job — the reduced model, grid, batch, dtype, optimizer, recompute mode and overlap policy — on
the machine file ``--machine`` (default: $AXON4D_MACHINE, else bench/results/planner_machine_local.json).
``--dtype bfloat16`` trains as ``axon4d train --precision bf16`` does (fp32 master weights, bf16
compute), which the planner's memory model prices. Results go to stdout and to
``bench/results/gpt_<model>[_reduced][_<recompute>][_sgd].json`` (with the result header of
bench/common.py); the last line is

    gpt: <model> width <h>, <L> layers, grid (x,y,z,d), recompute <mode>: step S s (planner P s, error E%), peak memory M GiB (planner Q GiB, error F%)

with errors as (planner − measured) / measured.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402
from axon4d.config import SIZES, ModelConfig, get_config  # noqa: E402
from axon4d.device import environment  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.measure.probe import peak_bytes  # noqa: E402
from axon4d.options.overlap_policy import OverlapPolicy  # noqa: E402
from axon4d.options.recompute_mode import RECOMPUTE_MODES  # noqa: E402
from axon4d.plan import Candidate, Workload, evaluate, load  # noqa: E402
from axon4d.plan.workload import OPTIMIZERS  # noqa: E402
from axon4d.train.loop import build_model  # noqa: E402
from axon4d.train.peak import check_compute_dtype  # noqa: E402

#: the training precision (axon4d.options.precision) each --dtype trains with.
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}
LOCAL_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
OPTIMIZER = {
    "adam": "Adam (lr 1e-4 constant, no weight decay, no clipping, foreach=False)",
    "sgd": "SGD (lr 1e-4 constant, no momentum, no weight decay, no clipping, foreach=False)",
}
FULL_OPTIMIZER = "AdamW with warmup and cosine decay, weight decay and clipping (axon4d train)"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="20B", help=f"size: {', '.join(SIZES)}")
    p.add_argument("--layers", type=int, default=None, help="blocks (reduced depth; at least 1; default: the table's)")
    p.add_argument("--hidden", type=int, default=None, help="override the width (default: the table's)")
    p.add_argument("--heads", type=int, default=None, help="override the attention heads")
    p.add_argument("--seq-len", "--seq", dest="seq_len", type=int, default=None, help="sequence length")
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    p.add_argument("--grid", default="auto", help="x,y,z,data or auto (the planner chooses)")
    p.add_argument(
        "--machine",
        default=None,
        help="machine name or file for the planner (default: $AXON4D_MACHINE, "
        "else bench/results/planner_machine_local.json)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(PRECISION))
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=sorted(OPTIMIZERS),
        help="adam (two fp32 states per parameter) or sgd (no state; what lets the 80B width fit one host)",
    )
    p.add_argument("--overlap", default="all", help="overlap policy (all, off, oag,oar,...)")
    p.add_argument(
        "--comm",
        default="auto",
        choices=("auto", "torch", "mpi"),
        help="transport: auto (MPI under mpiexec on CPUs, else torch.distributed), torch or mpi",
    )
    p.add_argument(
        "--recompute", default="none", choices=RECOMPUTE_MODES, help="activation recomputation in every block"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpt_<model>[_reduced][_<mode>].json)")
    args = p.parse_args()
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


def reductions(args: argparse.Namespace, cfg: ModelConfig, full: ModelConfig) -> dict[str, Any]:
    """What this run makes smaller than the size table's model and a production run."""
    out: dict[str, Any] = {}
    for key, name in (
        ("n_layers", "layers"),
        ("seq_len", "sequence"),
        ("hidden", "hidden"),
        ("n_heads", "heads"),
        ("vocab_size", "vocabulary"),
    ):
        if getattr(cfg, key) != getattr(full, key):
            out[name] = {"run": getattr(cfg, key), "table": getattr(full, key)}
    out["batch"] = {"run": args.batch, "tokens": args.batch * cfg.seq_len}
    out["optimizer"] = {"run": OPTIMIZER[args.optimizer], "training job": FULL_OPTIMIZER}
    out["steps"] = {"warmup": args.warmup, "timed": args.steps}
    return out


def describe_reductions(red: dict[str, Any]) -> str:
    parts = [f"{k} {v['run']} of {v['table']}" for k, v in red.items() if "table" in v]
    parts.append(f"batch {red['batch']['run']} sequences ({red['batch']['tokens']} tokens)")
    parts.append(f"optimizer {red['optimizer']['run']} instead of {red['optimizer']['training job']}")
    return "reduced: " + "; ".join(parts)


def predict(cfg: ModelConfig, args: argparse.Namespace, shape: GridShape, machine_name: str) -> dict[str, Any]:
    """The planner's prediction for this job (``candidate``), the machine's peak FLOP/s for MFU
    (``peak_flops``), and ``note``s saying what could not be priced."""
    out: dict[str, Any] = {"candidate": None, "peak_flops": None, "notes": []}
    try:
        machine = load(machine_name)
    except ValueError as e:
        out["notes"].append(str(e))
        return out
    try:
        out["peak_flops"] = machine.peak(args.dtype)
    except ValueError as e:
        out["notes"].append(str(e))
    try:
        wl = Workload(cfg, args.batch, args.dtype, optimizer=args.optimizer, precision=PRECISION[args.dtype])
        out["candidate"] = evaluate(wl, shape, machine, OverlapPolicy.parse(args.overlap), args.recompute)
    except (ValueError, KeyError) as e:
        out["notes"].append(f"the planner cannot price this job: {e}")
    return out


def error(predicted: float | None, measured: float) -> float | None:
    """(predicted − measured) / measured, or None without a prediction."""
    return None if predicted is None else (predicted - measured) / measured


def main() -> int:
    args = parse()
    overrides = {
        k: v
        for k, v in (
            ("n_layers", args.layers),
            ("hidden", args.hidden),
            ("n_heads", args.heads),
            ("seq_len", args.seq_len),
            ("vocab_size", args.vocab),
        )
        if v is not None
    }
    full = get_config(args.model)
    cfg = get_config(args.model, **overrides)
    red = reductions(args, cfg, full)
    machine_name = args.machine or os.environ.get("AXON4D_MACHINE") or LOCAL_MACHINE
    grid_spec = "auto" if args.grid == "auto" else tuple(int(v) for v in args.grid.split(","))
    grid = axon4d.init(
        grid=grid_spec,
        overlap=args.overlap,
        seed=0,
        comm=args.comm,
        precision=PRECISION[args.dtype],
        plan={
            "model": cfg,
            "batch": args.batch,
            "machine": machine_name,
            "dtype": args.dtype,
            "recompute": args.recompute,
            "optimizer": args.optimizer,
        },
    )
    rank0 = grid.rank == 0
    head = common.header() if rank0 else None
    shape = GridShape(*grid.shape.as_tuple())
    if rank0:
        print(
            f"{args.model}: width {cfg.hidden}, {cfg.n_layers} layers, seq {cfg.seq_len}, vocab {cfg.vocab_size}, "
            f"grid {shape.as_tuple()} on {grid.world_size} ranks ({grid.device}), dtype {args.dtype}, recompute {args.recompute}, "
            f"overlap {OverlapPolicy.parse(args.overlap).spec()}",
            flush=True,
        )
        print(describe_reductions(red), flush=True)
    check_compute_dtype(grid)
    model = build_model(cfg, grid, args.recompute)
    opt: torch.optim.Optimizer
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
    local = devices.to_device(axon4d.shard_batch(ids), grid.device)  # (b, s+1): this rank's sequences
    inputs, targets = local[:, :-1], local[:, 1:]

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets)
        loss.backward()
        opt.step()
        return loss.detach()

    times = []
    usage: list[dict[str, float]] = []  # rank 0's page faults and CPU seconds per timed step
    total = args.warmup + args.steps
    for i in range(total):
        grid.comm.barrier()
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        loss = step()
        devices.synchronize(grid.device)
        dt = time.perf_counter() - t
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        if i >= args.warmup:
            times.append(dt)
            usage.append(
                {
                    "minor_faults": u1.ru_minflt - u0.ru_minflt,
                    "user_s": u1.ru_utime - u0.ru_utime,
                    "system_s": u1.ru_stime - u0.ru_stime,
                }
            )
        if rank0:
            kind = "warm-up" if i < args.warmup else "timed"
            print(f"step {i + 1}/{total} ({kind}): {dt:.3f} s, loss {float(loss):.4f}", flush=True)
    per_rank = grid.comm.all_gather(torch.tensor(times, dtype=torch.float64, device=grid.device), "world").wait()
    slowest = per_rank.view(grid.world_size, -1).max(dim=0).values.tolist()
    measured_mem = peak_bytes(grid, model, opt, step)
    world, device, comm = grid.world_size, str(grid.device), grid.comm.transport_name
    axon4d.shutdown()
    if not rank0:
        return 0

    measured = common.median(slowest)
    plan = predict(cfg, args, shape, machine_name)
    cand: Candidate | None = plan["candidate"]
    flops = cfg.flops_per_token() * args.batch * cfg.seq_len
    tflops = flops / measured / world / 1e12
    predicted_s = cand.time.step_s if cand is not None else None
    predicted_mem = cand.mem.peak if cand is not None else None
    result: dict[str, Any] = {
        "model": args.model,
        "config": dict(cfg.__dict__),
        "table_config": dict(full.__dict__),
        "reduced": red,
        "grid": list(shape.as_tuple()),
        "world": world,
        "device": device,
        "batch": args.batch,
        "dtype": args.dtype,
        "precision": PRECISION[args.dtype],
        "recompute": args.recompute,
        "optimizer": args.optimizer,
        "overlap": args.overlap,
        "comm": comm,
        "machine": machine_name,
        "steps_s": slowest,
        "step_s": measured,
        "tokens_per_s": args.batch * cfg.seq_len / measured,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / plan["peak_flops"] if plan["peak_flops"] else None,
        "peak_memory_bytes": measured_mem,
        "predicted_step_s": predicted_s,
        "predicted_memory_bytes": predicted_mem,
        "time_error": error(predicted_s, measured),
        "memory_error": error(predicted_mem, measured_mem),
        "prediction": cand.to_json() if cand is not None else None,
        "notes": plan["notes"],
        # rank 0's process: page faults, user and system CPU seconds of each timed step (host memory
        # in huge pages or not: axon4d.device.environment.use_huge_pages)
        "rank0_usage": usage,
        "huge_pages": os.environ.get(environment.HUGE_PAGES_ENV),
    }
    tag = (
        ("_reduced" if overrides else "")
        + (f"_{args.recompute}" if args.recompute != "none" else "")
        + (f"_{args.optimizer}" if args.optimizer != "adam" else "")
    )
    out = args.out or os.path.join(ROOT, "bench", "results", f"gpt_{args.model}{tag}.json")
    common.save(out, result, head)
    for note in plan["notes"]:
        print(f"note: {note}")
    mfu = f", MFU {100 * result['mfu']:.1f}%" if result["mfu"] is not None else ""
    if usage:
        faults = common.median(u["minor_faults"] for u in usage)
        system = common.median(u["system_s"] / max(u["user_s"] + u["system_s"], 1e-9) for u in usage)
        print(f"rank 0 per timed step: {faults:.0f} page faults, {100 * system:.0f}% of its CPU time in the kernel")
    print(
        f"{world} ranks: {result['tokens_per_s']:.0f} tokens/s, {tflops:.3g} TFLOP/s per device{mfu}; "
        "timed steps (s): " + ", ".join(f"{t:.3f}" for t in slowest)
    )
    print(f"saved {out}")
    print(final_line(args.model, cfg, shape, args.recompute, measured, predicted_s, measured_mem, predicted_mem))
    return 0


def final_line(
    model: str,
    cfg: ModelConfig,
    shape: GridShape,
    recompute: str,
    step_s: float,
    predicted_s: float | None,
    mem: float,
    predicted_mem: float | None,
) -> str:
    """``gpt: <model> width <h>, <L> layers, grid (x,y,z,d), recompute <mode>: step S s (planner P s,
    error E%), peak memory M GiB (planner Q GiB, error F%)`` ("n/a" where the planner has no price)."""

    def versus(measured: float, predicted: float | None, unit: str, scale: float) -> str:
        if predicted is None:
            return f"{measured * scale:.3f} {unit} (planner n/a, error n/a)"
        err = (predicted - measured) / measured
        return f"{measured * scale:.3f} {unit} (planner {predicted * scale:.3f} {unit}, error {100 * err:+.1f}%)"

    grid = "(" + ",".join(str(v) for v in shape.as_tuple()) + ")"
    return (
        f"gpt: {model} width {cfg.hidden}, {cfg.n_layers} layers, grid {grid}, recompute {recompute}: "
        f"step {versus(step_s, predicted_s, 's', 1.0)}, peak memory {versus(mem, predicted_mem, 'GiB', 2**-30)}"
    )


if __name__ == "__main__":
    environment.use_huge_pages()  # as the training job: host tensors in huge pages (THP_MEM_ALLOC_ENABLE=0: off)
    raise SystemExit(main())
