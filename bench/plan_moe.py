"""MoE jobs priced by the planner with and without expert layouts of their own (issue 51).

For each job — Mixtral-8x7B on 256 H100s and ``moe-1t`` (Kimi K2's shape) on 1024, each with a
batch of 1024 sequences of 4096 tokens — two searches of ``axon4d.plan.search.plan`` with the
shipped ``h100.json``:

- **default layout**: the experts over data × z, each split over x·y (``ep=batch,tp=x·y``: the one
  placement the runtime had before expert layouts);
- **searched**: every expert layout each grid admits, with the grid and every step option (what
  ``axon4d plan`` does).

Every plan is held to what the machine file says a node has (docs/planner.md). These are
predictions of the cost model — its GPU figures are published peaks derated by the stated
assumptions of ``axon4d/plan/machines/h100.json``, its all-to-all an unmeasured model — not GPU
runs. Nothing is timed; the whole bench takes about five minutes on a 2-core host.

    .venv/bin/python bench/plan_moe.py

Then ``moe-1t``'s ceilings: the same search on what-if machines — device memory ×8, every
collective free (latency 0, bandwidth ×1e6), both — and on the shipped machine with every MoE
all-to-all hidden behind compute (an ideal two-micro-batch schedule), and with both device memory
×8 and every all-to-all hidden, to show which part of the cost model holds the job where it is.
Those machines and that schedule do not exist; their figures are bounds, not plans. And the best
``moe-1t`` plan's floor: the bytes its all-to-alls send across the network per rank and step, their
seconds at the network's bandwidth, and its MFU were every collective hidden behind compute. The
``moe-1t`` search, its ceilings and its floor are made again at a batch of 4096 sequences
(``LARGER_BATCH``), nearer what a 1T model trains with, where the once-per-step collectives weigh
less.

Saves ``bench/results/plan_moe.json`` (each search's top candidates: grid, options, layout,
predicted step time, time parts and memory, the ceilings, the floor, and the header of bench/common.py). It prints
each ceiling and floor, then ``plan MoE: moe-1t on 1024 × h100, batch 4096: A% model MFU (predicted;
grid G, options O)``; the last lines are, per job, ``plan MoE: mixtral-8x7b on 256 × h100, batch
1024: default layout B% → searched A% model MFU (predicted; grid G, options O)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402

from axon4d.config import get_config  # noqa: E402
from axon4d.grid.shape import GridShape  # noqa: E402
from axon4d.options import fp8_rows  # noqa: E402
from axon4d.plan import cost  # noqa: E402
from axon4d.plan.candidate import Candidate  # noqa: E402
from axon4d.plan.collective_model import group_geometry, span_of  # noqa: E402
from axon4d.plan.machine import Machine, load  # noqa: E402
from axon4d.plan.moe_cost import GATE_BYTES  # noqa: E402
from axon4d.plan.moe_placement import placement  # noqa: E402
from axon4d.plan.search import plan  # noqa: E402

#: (model, GPUs, batch in sequences): the issue's two jobs
JOBS = (("mixtral-8x7b", 256, 1024), ("moe-1t", 1024, 1024))
#: ``moe-1t``'s search, ceilings and floor again at a batch nearer a 1T model's in practice (Kimi
#: K2's report: 67M tokens a step; DeepSeek-V3's: 15360 × 4096): 4096 sequences, 16.8M tokens
LARGER_BATCH = 4096
#: the placement the runtime had before expert layouts
DEFAULT_LAYOUT = "ep=batch,tp=x·y"


def _row(c: Candidate) -> dict[str, Any]:
    t = c.time
    return {
        "grid": list(c.shape.as_tuple()),
        "options": c.options_spec(),
        "expert_layout": c.expert_layout,
        "fits": c.fits,
        "mfu": c.mfu,
        "step_s": t.step_s,
        "compute_s": t.compute_s,
        "comm_s": t.comm_s,
        "hidden_s": t.hidden_s,
        "comm_by_axis_s": t.comm_by_axis,
        "hidden_by_mechanism_s": t.hidden_by_mechanism,
        "peak_gib": c.mem.peak / 2**30,
    }


def search(model: str, gpus: int, batch: int, machine: str, top: int, layout: str | None) -> dict[str, Any]:
    """One search (``layout`` None: every layout searched), its fitting candidates' rows."""
    kw = {} if layout is None else {"expert_layout": layout}
    r = plan(model, gpus, machine, batch, top=top, **kw)
    fitting = [c for c in r.candidates if c.fits][:top]
    return {"layout": layout or "searched", "searched": r.searched, "valid": r.valid, "top": [_row(c) for c in fitting]}


def _best(found: dict[str, Any]) -> str:
    """``A% model MFU (predicted; grid G, options O)`` of a search's best fitting candidate."""
    b = found["top"][0]
    return f"{100 * b['mfu']:.1f}% model MFU (predicted; grid {tuple(b['grid'])}, {b['options']})"


def headline(model: str, gpus: int, machine: str, batch: int, default: dict[str, Any], best: dict[str, Any]) -> str:
    """``plan MoE: <model> on <gpus> × <machine>, batch <b>: default layout B% → searched A% ...``."""
    was = f"{100 * default['top'][0]['mfu']:.1f}%" if default["top"] else "nothing fits"
    return f"plan MoE: {model} on {gpus} × {machine}, batch {batch}: default layout {was} → searched {_best(best)}"


#: what-if machines for ``moe-1t``'s ceilings: (name, what is relaxed) — not machines that exist
CEILINGS = (
    ("memory unlimited", "device memory ×8"),
    ("collectives free", "every link's latency 0 and bandwidth ×1e6"),
    ("both", "device memory ×8, collectives free"),
    (
        "all-to-alls hidden",
        "every MoE all-to-all hidden behind compute at the machine's overlap efficiency "
        "(an ideal two-micro-batch schedule, DualPipe's; the machine as shipped)",
    ),
    (
        "memory and all-to-alls",
        "device memory ×8 and every MoE all-to-all hidden behind compute at the machine's overlap "
        "efficiency (what a pipeline's share of the layers and an interleaved schedule would give)",
    ),
)


@contextlib.contextmanager
def all_to_alls_hidden() -> Iterator[None]:
    """The cost model with its credit for an MoE layer's chunked exchange
    (``axon4d.plan.moe_cost.chunks_hidden``, bounded by the layer's expert GEMMs) replaced by every
    dispatch and combine hidden, forward and backward, at the machine's overlap efficiency — what a
    schedule that runs one micro-batch's all-to-alls behind another's compute could hide at most.
    A bound: no runtime schedule of axon4d does this."""
    was = cost.chunks_hidden

    def every(a2a_fwd: float, a2a_bwd: float, moe: Any, chunks: int, efficiency: float) -> float:
        return efficiency * (a2a_fwd + a2a_bwd)

    cost.chunks_hidden = every
    try:
        yield
    finally:
        cost.chunks_hidden = was


def relaxed(machine: str, what: str) -> Machine:
    """``machine`` with ``what`` (a ``CEILINGS`` name) relaxed: a bound, not a machine."""
    m = load(machine)
    if what in ("memory unlimited", "both", "memory and all-to-alls"):
        m = dataclasses.replace(m, memory_per_device=8 * m.memory_per_device)
    if what in ("collectives free", "both"):
        free = [dataclasses.replace(lv, alpha_s=0.0, beta_Bps=lv.beta_Bps * 1e6) for lv in m.levels]
        m = dataclasses.replace(m, levels=free, comm=[], host_sync_s=0.0)
    return m


def ceilings(model: str, gpus: int, batch: int, machine: str) -> list[dict[str, Any]]:
    """The best plan of ``model`` when the planner is told memory is unlimited, collectives are
    free, or both, or every all-to-all is hidden (with memory unlimited or not): how far each part
    of the cost model holds the job below its target."""
    out = []
    for name, what in CEILINGS:
        hidden = name in ("all-to-alls hidden", "memory and all-to-alls")
        with all_to_alls_hidden() if hidden else contextlib.nullcontext():
            r = plan(model, gpus, relaxed(machine, name), batch, top=1)
        best = next(c for c in r.candidates if c.fits)
        out.append({"relaxed": name, "how": what, **_row(best)})
    return out


def _spans_nodes(shape: GridShape, axis: str, per_node: int) -> bool:
    """Whether a group of ``axis`` on ``shape`` spans nodes of ``per_node`` ranks."""
    group, stride = group_geometry(shape, axis, per_node)
    return span_of(group, stride, per_node).nodes > 1


def floor(model: str, gpus: int, batch: int, machine: str, best: dict[str, Any]) -> dict[str, Any]:
    """What the best plan's all-to-alls and overlap allow at most: the bytes its MoE layers send
    across the network per rank and step (each rank's share of the tokens × top-k rows, to the
    experts — packed under FP8 dispatch — each with its gate, and back, forward and backward; a
    fully recomputed block's re-run exchanges none again), over the network's bandwidth; and the
    model MFU if every collective
    were hidden behind compute, the network's collectives one after another and the nodes' beside
    them (a step of max(compute, network communication, node communication)). Bounds, not plans."""
    cfg, m = get_config(model), load(machine)
    shape = GridShape(*best["grid"])
    p = placement(cfg, shape, best["expert_layout"])
    group, stride = group_geometry(shape, p.ep_axis, m.devices_per_node) if p.ep_axis else (1, 1)
    span = span_of(group, stride, m.devices_per_node)
    remote = (group - span.per_node) / group  # the share of a rank's rows bound for another node
    rows = batch * cfg.seq_len // gpus * cfg.experts_per_token  # per rank and MoE layer
    out = fp8_rows.packed_width(cfg.hidden) if p.fp8_dispatch else 2 * cfg.hidden  # bytes of a row sent out
    home = 2 * cfg.hidden  # ... and of a row sent home (bf16)
    # dispatch (with the gates) and combine, the combine's gradient and the dispatch's (with the gates')
    per_layer = rows * (2 * out + 2 * home + 2 * GATE_BYTES)
    step = per_layer * cfg.moe_layers
    net = m.levels[-1].beta_Bps
    flops_s = best["mfu"] * best["step_s"]  # the step's model FLOPs at peak, in seconds
    # every collective hidden behind compute, each link busy with its own: those whose groups span
    # nodes one after another on the network, the others inside the nodes
    across = {a: _spans_nodes(shape, a, m.devices_per_node) for a in best["comm_by_axis_s"]}
    network_comm = sum(s for a, s in best["comm_by_axis_s"].items() if across[a])
    node_comm = sum(s for a, s in best["comm_by_axis_s"].items() if not across[a])
    hidden_all = max(best["compute_s"], network_comm, node_comm)
    return {
        "grid": best["grid"],
        "expert_layout": best["expert_layout"],
        "remote_share": remote,
        "all_to_all_bytes_per_layer": per_layer,
        "all_to_all_bytes_per_step": step,
        "network_s": step * remote / net,
        "compute_s": best["compute_s"],
        "network_comm_s": network_comm,
        "node_comm_s": node_comm,
        "step_s_all_hidden": hidden_all,
        "mfu_all_hidden": flops_s / hidden_all,
        "step_s_at_30pct": flops_s / 0.30,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machine", default="h100")
    p.add_argument("--top", type=int, default=5, help="fitting candidates kept per search")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_moe.json"))
    args = p.parse_args(argv)
    head = common.header()
    jobs, lines = [], []
    for model, gpus, batch in JOBS:
        default = search(model, gpus, batch, args.machine, args.top, DEFAULT_LAYOUT)
        best = search(model, gpus, batch, args.machine, args.top, None)
        jobs.append({"model": model, "gpus": gpus, "batch": batch, "default_layout": default, "searched": best})
        lines.append(headline(model, gpus, args.machine, batch, default, best))
    bound = ceilings("moe-1t", 1024, 1024, args.machine)
    least = floor("moe-1t", 1024, 1024, args.machine, jobs[-1]["searched"]["top"][0])
    larger = search("moe-1t", 1024, LARGER_BATCH, args.machine, args.top, None)
    at_larger = {
        "batch": LARGER_BATCH,
        "searched": larger,
        "ceilings": ceilings("moe-1t", 1024, LARGER_BATCH, args.machine),
        "floor": floor("moe-1t", 1024, LARGER_BATCH, args.machine, larger["top"][0]),
    }
    result = {
        "machine": args.machine,
        "jobs": jobs,
        "moe_1t_ceilings": bound,
        "moe_1t_floor": least,
        "moe_1t_larger_batch": at_larger,
    }
    common.save(args.out, result, head)
    for batch, rows, low in ((1024, bound, least), (LARGER_BATCH, at_larger["ceilings"], at_larger["floor"])):
        for row in rows:
            print(
                f"ceiling: moe-1t on 1024 × {args.machine}, batch {batch}, with {row['relaxed']} ({row['how']}): "
                f"{100 * row['mfu']:.1f}% model MFU (grid {tuple(row['grid'])}, {row['options']})"
            )
        print(
            f"floor: moe-1t on 1024 × {args.machine}, batch {batch}, grid {tuple(low['grid'])}: all-to-alls "
            f"{low['all_to_all_bytes_per_step'] / 1e9:.0f} GB a step per rank, "
            f"{100 * low['remote_share']:.0f}% across the network: {low['network_s']:.1f} s "
            f"(none again in a fully recomputed block's re-run); every collective hidden behind "
            f"{low['compute_s']:.2f} s of compute, {low['network_comm_s']:.2f} s of it on the network: "
            f"{100 * low['mfu_all_hidden']:.1f}% model MFU (predicted bounds)"
        )
    print(f"plan MoE: moe-1t on 1024 × {args.machine}, batch {LARGER_BATCH}: {_best(larger)}")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
