"""Choose a grid: price every (x, y, z, data) factorisation of the job and print the best.

    axon4d plan --model 80B --gpus 1024 --machine perlmutter --batch 2048
    axon4d plan --model 20B --gpus 512 --machine frontier --batch 1024 --overlap all --recompute full --json -

For each valid grid the planner predicts the step time (compute + communication of docs/design.md
E8–E13 − what the chosen overlap hides), MFU, peak memory per rank, communication time per axis,
the share hidden by overlap and the communication volume against Agarwal's bound; grids that do
not fit in the device memory are listed after the ones that do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from axon4d import rules
from axon4d.config import SIZES, get_config
from axon4d.device import DTYPES
from axon4d.plan import stepfit
from axon4d.plan.machine import available
from axon4d.plan.search import plan
from axon4d.plan.workload import OPTIMIZERS
from axon4d.recompute_mode import RECOMPUTE_MODES

#: --context-parallel → plan(context_parallel=...)
SPLIT_SEQUENCES: dict[str, bool | str] = {"off": False, "on": True, "auto": "auto"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="20B", help=f"model size: {', '.join(SIZES)}")
    p.add_argument("--gpus", "--ranks", dest="gpus", type=int, required=True, help="world size (devices)")
    p.add_argument("--machine", default="perlmutter", help=f"shipped machine ({', '.join(available())}) or a JSON file")
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument(
        "--overlap",
        default="all",
        help="mechanisms on: all (every mechanism, default knobs) | auto (all, with the knobs tuned per grid: "
        "what axon4d.init gives a job it can price) | off | a list like oag,oar,odp,chunks; "
        "knobs too: all,oag_depth=3,ors_inflight=2 (axon4d.overlap.OverlapPolicy.parse)",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=RECOMPUTE_MODES,
        help="activation recomputation, as the runtime does it (Transformer(cfg, recompute=...), axon4d train --recompute): "
        "none | selective (core attention) | balanced (norms and MLP activation, inside the consuming GEMM's backward) "
        "| full (whole blocks)",
    )
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=sorted(OPTIMIZERS),
        help="adam (two fp32 states per parameter, the training job's) or sgd (none)",
    )
    p.add_argument(
        "--context-parallel",
        default="off",
        choices=("off", "on", "auto"),
        help="split each sequence's tokens over z (docs/context.md): off, on, or auto (price both for every grid)",
    )
    p.add_argument("--memory-gib", type=float, default=None, help="memory per device (default: the machine's)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the candidates as JSON ('-' for stdout)")


def main(args: argparse.Namespace) -> int:
    """Price the job of the parsed flags and print the table; every flag is checked first."""
    rules.count(args.top, "--top (rows to print)", example=10)
    if args.memory_gib is not None and not 0 < args.memory_gib < float("inf"):
        raise ValueError(
            f"--memory-gib {args.memory_gib}: memory per device must be a finite number of GiB above 0, "
            "e.g. --memory-gib 80, or leave it out for the machine's own"
        )
    cfg = get_config(args.model, **({"seq_len": args.seq_len} if args.seq_len is not None else {}))
    start = time.perf_counter()
    result = plan(
        cfg,
        args.gpus,
        args.machine,
        args.batch,
        dtype=args.dtype,
        overlap=args.overlap,
        recompute=args.recompute,
        optimizer=args.optimizer,
        context_parallel=SPLIT_SEQUENCES[args.context_parallel],
        memory_limit=args.memory_gib * 2**30 if args.memory_gib is not None else None,
    )
    elapsed = time.perf_counter() - start
    if args.json == "-":
        json.dump(result.to_json(args.top), sys.stdout, indent=1)
        print()
        return 0
    wl = result.workload
    print(
        f"{cfg.name or 'model'} ({cfg.n_params() / 1e9:.1f}B parameters), batch {wl.batch} × {cfg.seq_len} tokens, "
        f"{wl.dtype}, on {args.gpus} × {result.machine.name} ({result.memory_limit / 2**30:.0f} GiB each); "
        f"overlap {result.overlap.spec()}, recompute {result.recompute}"
    )
    if result.machine.step_scale:
        used, steps = stepfit.samples_for(result.machine, args.gpus)
        print(
            f"in-step scale {stepfit.describe(result.machine.step_scale_for(args.gpus))}; fitted to steps "
            f"{'of ' + steps[0].spec() + ' ' if steps else ''}on {used} ranks of this machine (axon4d.plan.stepfit)"
        )
    if result.caveat:
        print(f"warning: {result.caveat}")
    print(
        f"{len(result.candidates)} valid grids ({result.invalid} factorisations break a divisibility rule), "
        f"{sum(c.fits for c in result.candidates)} fit in memory; priced in {elapsed * 1e3:.0f} ms\n"
    )
    print(result.table(args.top))
    print(
        "\ncolumns: t_<axis> = communication seconds per step on that axis before overlap; hidden = share of "
        "communication overlap hides; ×bound = communication words / Agarwal's lower bound"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(args.top), f, indent=1)
        print(f"wrote {args.json}")
    return 0 if any(c.fits for c in result.candidates) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
