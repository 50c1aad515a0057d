"""The flags of ``axon4d plan`` (``axon4d.plan.cli``): the job — model, ranks, machine, batch —, what
it computes in and moves, how its communication overlaps, and its step options, each ``auto``
(searched) or pinned to a value.
"""

from __future__ import annotations

import argparse
from typing import Any

from axon4d.config import SIZES
from axon4d.options.precision import NAMED
from axon4d.options.recompute_mode import RECOMPUTE_MODES
from axon4d.plan.machine import available
from axon4d.plan.options import AUTO_OPTION
from axon4d.plan.workload import DEFAULT_PRECISION, OPTIMIZERS

#: --context-parallel → plan(context_parallel=...)
SPLIT_SEQUENCES: dict[str, bool | str] = {
    "off": False,
    "on": True,
    "auto": "auto",
    "all-gather": "all-gather",
    "ring": "ring",
}
#: an on/off/auto flag → the option's value: --fp8-gather → plan(fp8_gather=...), --fp8-dispatch → plan(fp8_dispatch=...)
SWITCH: dict[str, bool | str] = {"off": False, "on": True, AUTO_OPTION: AUTO_OPTION}


def _auto_or_int(text: str) -> Any:
    """An argparse type: "auto" as it is, else a whole number (a bad value: argparse's clear error)."""
    if text == AUTO_OPTION:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto or a whole number, e.g. 2") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``axon4d plan`` on ``p``: the job, what it computes and moves, its step
    options (each ``auto``, searched, or pinned), and the output."""
    _job_arguments(p)
    _precision_arguments(p)
    _option_arguments(p)
    p.add_argument("--memory-gib", type=float, default=None, help="memory per device (default: the machine's)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the candidates as JSON ('-' for stdout)")


def _job_arguments(p: argparse.ArgumentParser) -> None:
    """The job's flags on ``p``: the model, the ranks, the machine (and a correction of its
    prices), the batch, the sequence length and MoE routing's imbalance."""
    p.add_argument("--model", default="20B", help=f"model size: {', '.join(SIZES)}")
    p.add_argument("--gpus", "--ranks", dest="gpus", type=int, required=True, help="world size (devices)")
    p.add_argument("--machine", default="perlmutter", help=f"shipped machine ({', '.join(available())}) or a JSON file")
    p.add_argument(
        "--correction",
        default="",
        help="a correction.json written by `axon4d train --grid auto --try N`: its factors scale the machine's "
        "priced compute and communication (axon4d.plan.correction; the machine file is unchanged)",
    )
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length")
    p.add_argument(
        "--imbalance",
        type=float,
        default=1.0,
        help="MoE models: the busiest rank's expert rows over the mean (1: uniform routing, the default; "
        "axon4d.plan.moe_placement)",
    )


def _precision_arguments(p: argparse.ArgumentParser) -> None:
    """The flags on ``p`` of what the job computes in and moves, and how its communication overlaps."""
    p.add_argument(
        "--dtype",
        default="",
        choices=sorted(DEFAULT_PRECISION),
        help="compute dtype (default: --precision's; bfloat16 when neither is given)",
    )
    p.add_argument(
        "--precision",
        default="",
        choices=tuple(NAMED),
        help="what the collectives move (axon4d train --precision): default by --dtype — bf16-fp32-reduce for "
        "bfloat16 (the training job's on GPUs), fp32 for float32; bf16-fp8-gather pins --fp8-gather on",
    )
    p.add_argument(
        "--overlap",
        default="all",
        help="mechanisms on: all (every mechanism, default knobs) | auto (all, with the knobs tuned per grid: "
        "what axon4d.init gives a job it can price) | off | a list like oag,oar,odp,chunks; "
        "knobs too: all,oag_depth=3,ors_inflight=2 (axon4d.overlap.OverlapPolicy.parse)",
    )


def _option_arguments(p: argparse.ArgumentParser) -> None:
    """The step options' flags on ``p`` (``auto``: searched), the optimizer and --async-save."""
    p.add_argument(
        "--recompute",
        default=AUTO_OPTION,
        choices=(AUTO_OPTION, *RECOMPUTE_MODES),
        help="activation recomputation, as the runtime does it (Transformer(cfg, recompute=...), axon4d train --recompute): "
        "auto (searched, default) | none | selective (core attention) | balanced (norms and MLP activation, inside the "
        "consuming GEMM's backward) | full (whole blocks)",
    )
    p.add_argument(
        "--micro-batches",
        default=AUTO_OPTION,
        type=_auto_or_int,
        help="micro-batches the step's batch is accumulated over: auto (searched, default) or a count, e.g. 4",
    )
    p.add_argument(
        "--zero",
        default=AUTO_OPTION,
        type=_auto_or_int,
        help="optimizer sharding over data: auto (searched, default) | 0 | 1 (optimizer state and master weights) | "
        "2 (and gradients)",
    )
    p.add_argument(
        "--offload",
        default=AUTO_OPTION,
        type=_auto_or_int,
        help="blocks whose saved activations go to host memory: auto (searched where the machine gives its host link, "
        "default) or a number of blocks, e.g. 0",
    )
    p.add_argument(
        "--fp8-gather",
        default=AUTO_OPTION,
        choices=(AUTO_OPTION, "on", "off"),
        help="gather weights over z in FP8 (e4m3 with a scale per shard; bf16 only): auto (searched, default) | on | off",
    )
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=sorted(OPTIMIZERS),
        help="adam (two fp32 states per parameter, the training job's) or sgd (none)",
    )
    p.add_argument(
        "--context-parallel",
        default="auto",
        choices=tuple(SPLIT_SEQUENCES),
        help="split each sequence's tokens over z (docs/context.md): auto (whole and split searched, default), off, "
        "on (both modes searched), all-gather (keys and values gathered over z) or ring (passed around z: memory "
        "O(chunk), for the longest sequences)",
    )
    p.add_argument(
        "--context-axes",
        default=AUTO_OPTION,
        choices=(AUTO_OPTION, "z", "z,data"),
        help="the axes a split sequence spans (axon4d train --context-parallel-axes): z, z,data (hierarchical: "
        "z and data together) or auto (both searched, default)",
    )
    p.add_argument(
        "--document-tokens",
        type=int,
        default=0,
        help="packed documents of this many tokens per sequence (axon4d train --packed-documents): attention is "
        "priced within each document (docs/context.md); 0: one document per sequence (default)",
    )
    p.add_argument(
        "--fp8-dispatch",
        default=AUTO_OPTION,
        choices=tuple(SWITCH),
        help="MoE models: the searched expert layouts send their rows to the experts in FP8 (on), not (off), or both "
        "searched (auto, default; only where the model computes in 16 bits). A pinned --expert-layout says it itself "
        "(dispatch=fp8); docs/moe.md",
    )
    p.add_argument(
        "--expert-layout",
        default=AUTO_OPTION,
        help="MoE models: where the experts run, ep=<axes>,tp=<axes> (axon4d train --expert-layout): auto (every "
        "layout each grid admits searched, each with and without FP8 dispatch under bf16, default) or a layout, e.g. "
        "ep=world,tp=1 (whole experts over every rank), ep=z·data,tp=x·y (the runtime's default; '+' may stand for "
        "'·') or ep=batch,tp=x,dispatch=fp8 (rows sent to the experts in FP8; docs/moe.md)",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="the job checkpoints with --async-save: its pinned host snapshot counts against the node's host memory",
    )
