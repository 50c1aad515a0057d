"""Choose a plan: search every (x, y, z, data) factorisation of the job with every step option and
print the best.

    axon4d plan --model 80B --gpus 1024 --machine perlmutter --batch 2048
    axon4d plan --model 20B --gpus 512 --machine frontier --batch 1024 --recompute full --zero 1 --json -

By default every option is searched (``auto``): recomputation, micro-batches, ZeRO stage,
activation offload, FP8 weight gathers, context parallelism and an MoE model's expert layout; a
flag pins one. For each grid the
planner finds its fastest options that fit and predicts the step time (compute + communication of
docs/design.md E8–E13 − what the chosen overlap hides), MFU, peak memory per rank, communication
time per axis, the share hidden by overlap and the communication volume against Agarwal's bound.
When no grid fits, it prints no table: it says what the smallest plan needs and what would make
one fit, and exits with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from axon4d.config import SIZES, ModelConfig, get_config
from axon4d.grid import rules
from axon4d.grid.expert_layout import ExpertLayout, candidates
from axon4d.grid.shape import factorizations
from axon4d.plan import correction, stepfit
from axon4d.plan import fp8 as fp8_plan
from axon4d.plan.candidate import Candidate
from axon4d.plan.flags import SPLIT_SEQUENCES, SWITCH, add_arguments
from axon4d.plan.moe_cost import param_counts
from axon4d.plan.moe_placement import placement
from axon4d.plan.options import AUTO_OPTION
from axon4d.plan.result import PlanResult, step_breakdown
from axon4d.plan.scenario import Scenario
from axon4d.plan.search import load_machine, plan
from axon4d.plan.workload import Workload

__all__ = ["add_arguments", "main"]  # what the `axon4d` command calls (axon4d.cli)


def main(args: argparse.Namespace) -> int:
    """Price the job of the parsed flags and print the table; every flag is checked first. The exit
    status: 0, or 1 when no plan fits."""
    _check_flags(args)
    cfg = get_config(args.model, **({"seq_len": args.seq_len} if args.seq_len is not None else {}))
    _check_expert_layout(args, cfg)
    result, elapsed = _search(args, cfg)
    if args.json == "-":
        json.dump(result.to_json(args.top), sys.stdout, indent=1)
        print()
        return 0
    _print_search(args, cfg, result, elapsed)
    fitting = [c for c in result.candidates if c.fits]
    if not fitting:
        print(f"no plan fits: {result.no_fit_advice()}")
        return 1
    _print_plans(args, cfg, result, fitting)
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse (``ValueError``) a --top that is not a whole number ≥ 1 and a --memory-gib that is
    not a finite number above 0."""
    rules.count(args.top, "--top (rows to print)", example=10)
    if args.memory_gib is not None and not 0 < args.memory_gib < float("inf"):
        raise ValueError(
            f"--memory-gib {args.memory_gib}: memory per device must be a finite number of GiB above 0, "
            "e.g. --memory-gib 80, or leave it out for the machine's own"
        )


def _check_expert_layout(args: argparse.Namespace, cfg: ModelConfig) -> None:
    """Refuse (``ValueError``, before anything is priced) an --expert-layout that is not ``auto`` nor
    a layout (the layout parser's message), a layout for a model without experts (``cfg``, --model's),
    and one that no grid of --gpus ranks admits for the model (the rule it breaks, and layouts that
    some grid admits)."""
    layout, world = args.expert_layout, args.gpus
    if layout == AUTO_OPTION:
        return
    try:
        ExpertLayout.parse(layout)
    except ValueError as e:
        raise ValueError(f"--expert-layout {layout!r}: {e}; or give auto (searched)") from None
    if not cfg.moe:
        raise ValueError(
            f"--expert-layout {layout!r} with --model {args.model}: a dense model has no experts to "
            f"place; drop --expert-layout, or plan an MoE model ({', '.join(n for n in SIZES if get_config(n).moe)})"
        )
    pinned = ExpertLayout.parse(layout)
    rules.count(world, "world (ranks, --gpus)", example=8)  # as the search refuses it
    sizes = (cfg.n_experts, cfg.expert_width, cfg.shared_experts * cfg.expert_width, cfg.hidden)
    shapes = factorizations(world)
    broken = [next((r for r in pinned.rules(*sizes) if not r.holds(s)), None) for s in shapes]
    first = broken[0]
    if first is not None and all(broken):  # no grid of the job's ranks admits it: say why, not "no plan fits"
        fits = sorted({str(c) for s in shapes for c in candidates(s, *sizes)})
        shown = ", ".join(fits[:8]) + (f" and {len(fits) - 8} more" if len(fits) > 8 else "")
        raise ValueError(
            f"--expert-layout {pinned}: no grid of {world} ranks places {args.model}'s experts so "
            f"({first.message(shapes[0])}); layouts some grid admits: {shown or 'none'}"
        )


def _search(args: argparse.Namespace, cfg: ModelConfig) -> tuple[PlanResult, float]:
    """The planner's search (``search.plan``) for the flags' job of model ``cfg`` — its workload, the
    machine (its prices scaled by --correction's factors where one is given) and the options — and
    the seconds the search took."""
    wl = Workload(
        cfg,
        args.batch,
        args.dtype,
        optimizer=args.optimizer,
        precision=args.precision,
        imbalance=args.imbalance,
        document_tokens=args.document_tokens,
    )
    machine: Any = args.machine
    if args.correction:
        machine = correction.apply(load_machine(args.machine), correction.load(args.correction))
    start = time.perf_counter()
    result = plan(
        cfg,
        args.gpus,
        machine,
        args.batch,
        workload=wl,
        overlap=args.overlap,
        recompute=args.recompute,
        optimizer=args.optimizer,
        context_parallel=SPLIT_SEQUENCES[args.context_parallel],
        context_axes=args.context_axes,
        memory_limit=args.memory_gib * 2**30 if args.memory_gib is not None else None,
        micro_batches=args.micro_batches,
        zero=args.zero,
        offload=args.offload,
        fp8_gather=fp8_option(wl.preset, args.fp8_gather),
        async_save=args.async_save,
        top=args.top,
        expert_layout=args.expert_layout if cfg.moe else AUTO_OPTION,
        fp8_dispatch=SWITCH[args.fp8_dispatch],
    )
    return result, time.perf_counter() - start


def _print_search(args: argparse.Namespace, cfg: ModelConfig, result: PlanResult, elapsed: float) -> None:
    """Print what was searched: the job, the machine's in-step scale, the result's caveat, and how
    many grids were valid, searched and fit in ``elapsed`` seconds."""
    wl = result.workload
    total, active = param_counts(cfg)
    size = f"{total / 1e9:.1f}B parameters" + (f", {active / 1e9:.1f}B active" if cfg.moe else "")
    print(
        f"{cfg.name or 'model'} ({size}), batch {wl.batch} × {cfg.seq_len} tokens, "
        f"precision {wl.preset}, on {args.gpus} × {result.machine.name} ({result.memory_limit / 2**30:.0f} GiB each); "
        f"overlap {result.overlap.spec()}; {searched_options(result)}"
        + (f", {_layout_searched(args.expert_layout, args.fp8_dispatch)}" if cfg.moe else "")
    )
    if result.machine.step_scale:
        used, steps = stepfit.samples_for(result.machine, args.gpus)
        print(
            f"in-step scale {stepfit.describe(result.machine.step_scale_for(args.gpus))}; fitted to steps "
            f"{'of ' + steps[0].spec() + ' ' if steps else ''}on {used} ranks of this machine (axon4d.plan.stepfit)"
        )
    if result.caveat:
        print(f"warning: {result.caveat}")
    fitting = [c for c in result.candidates if c.fits]
    print(
        f"{result.valid} valid grids ({result.invalid} factorisations break a divisibility rule); "
        f"{result.searched} searched (the rest cannot beat the top {args.top}), {len(fitting)} of them fit; "
        f"searched in {elapsed * 1e3:.0f} ms\n"
    )


def _print_plans(args: argparse.Namespace, cfg: ModelConfig, result: PlanResult, fitting: list[Candidate]) -> None:
    """Print the ``fitting`` plans: the best (with its expert placement for an MoE model), the
    table of the top --top, the best's FP8 GEMMs under bf16-fp8, the columns' legend; and write
    --json's file."""
    wl = result.workload
    best = fitting[0]
    print(f"best: {best.shape.as_tuple()} with {best.options_spec()}")
    print(step_breakdown(best.time))
    if cfg.moe:
        routing = "uniform routing" if wl.imbalance == 1 else f"the busiest rank at {wl.imbalance:g}× the mean"
        where = placement(cfg, best.shape, best.expert_layout or wl.expert_layout).describe()
        print(f"expert layout {where} ({routing}; MFU counts active parameters)")
        if cfg.first_k_dense:
            print(
                f"blocks: the first {cfg.first_k_dense} dense (an MLP of {cfg.ffn}), the other {cfg.moe_layers} MoE; "
                "each kind priced as its own blocks (docs/planner.md)"
            )
    print()
    print(result.table(min(args.top, len(fitting))))
    if wl.preset == fp8_plan.PRESET:  # which layers the best plan runs in FP8
        print(f"\nFP8 GEMMs on {best.shape.as_tuple()} (priced per run of each layer on one rank):")
        print(fp8_plan.table(best_scenario(wl, best, result.machine)))
    print(
        "\ncolumns: mem = peak device memory per rank; pin = host memory the node's ranks pin (offload, async "
        "snapshot); t_<axis> = communication seconds per step on that axis before overlap; hidden = share of "
        "communication overlap hides; ×bound = communication words / Agarwal's lower bound"
        + (
            "; experts = the expert layout (docs/moe.md); t_prod = seconds on products of axes an expert layout "
            "groups (y·z, world, …)"
            if cfg.moe
            else ""
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(args.top), f, indent=1)
        print(f"wrote {args.json}")


def best_scenario(wl: Workload, best: Any, machine: Any) -> Scenario:
    """The ``Scenario`` a candidate was priced as: its grid, policy and step options."""
    o = best.options
    return Scenario(
        dataclasses.replace(
            wl,
            context_parallel=best.context_parallel,
            context_mode=best.context_mode or "all-gather",
            context_axes=best.context_axes or "z",
        ),
        best.shape,
        machine,
        best.overlap,
        best.recompute,
        o.get("micro_batches", 1),
        o.get("zero", 0),
        o.get("offload", 0),
        o.get("fp8_gather", False),
    )


def fp8_option(precision: str, flag: str) -> bool | str:
    """``plan``'s ``fp8_gather`` for ``--fp8-gather flag`` under ``--precision precision``: FP8
    gathers turn bf16-fp32-reduce into bf16-fp8-gather (``scenario.step_precision``), so
    bf16-fp8-gather pins them on (``off`` contradicts it: ValueError), and bf16, which reduces
    gradients in bf16 — no preset gathers FP8 with it — pins them off (``on``: ValueError)."""
    if precision == "bf16-fp8-gather":
        if flag == "off":
            raise ValueError(
                "--fp8-gather off with --precision bf16-fp8-gather: that precision gathers weights in FP8; "
                "use --precision bf16-fp32-reduce for bf16 gathers"
            )
        return True
    if precision == "bf16":
        if flag == "on":
            raise ValueError(
                "--fp8-gather on with --precision bf16: FP8 gathers are the preset bf16-fp8-gather, which reduces "
                "gradients in fp32; use --precision bf16-fp32-reduce (FP8 searched) or bf16-fp8-gather"
            )
        return False
    return SWITCH[flag]


def _layout_searched(layout: str, fp8_dispatch: str = AUTO_OPTION) -> str:
    """--expert-layout in the searched line: "expert layout searched" (with "FP8 dispatch on" or
    "off" where --fp8-dispatch pins it), or the pinned layout."""
    if layout != AUTO_OPTION:
        return f"expert layout {ExpertLayout.parse(layout)}"
    return "expert layout searched" + (f" (FP8 dispatch {fp8_dispatch})" if fp8_dispatch != AUTO_OPTION else "")


def searched_options(result: Any) -> str:
    """What the search varied and what was pinned, in one line."""
    ch = result.choices
    if ch is None:
        return f"recompute {result.recompute}"
    parts = []
    for name, values in ch.spec().items():
        if values == AUTO_OPTION or (isinstance(values, list) and len(values) > 1):
            parts.append(f"{name} searched")
        else:
            parts.append(f"{name} {values[0] if isinstance(values, list) else values}")
    return ", ".join(parts)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
