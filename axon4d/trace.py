"""Timelines of compute and communication: Chrome/Perfetto trace JSON and a PNG (docs/design.md §4).

Each rank writes what its CommLog holds — collectives (op, axis, bytes, issue, wait, done) and
compute spans recorded by the layers — with ``dump(grid, directory)`` (one ``rank<r>.json`` per
rank, times relative to ``t0``, e.g. the step start). Each process times on its own
``perf_counter`` (whose zero is arbitrary), so a dump also records ``epoch_ns``, the wall-clock
time (``time.time_ns``) of its ``t0``, from one reading of both clocks taken together; ``load``
shifts every dump of a directory onto the earliest of them, so ranks line up on the wall clock.
On one host that is exact to within the two readings (microseconds); across hosts it is as good
as their clocks' agreement: NTP keeps servers within about a millisecond of each other on one
network, PTP within microseconds — compare events across nodes only where they differ by more.
``axon4d trace DIR`` merges a directory of dumps into

- a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing): one process per rank with
  a ``compute`` track (compute spans, and the stretches blocked waiting for a collective) and one
  ``comm <axis>`` track per axis;
- a PNG timeline (matplotlib): the same rows for a few ranks, several runs stacked (e.g. overlap
  off above overlap on) on one time scale.

On a comm track a collective is drawn from when it could start on the wire — its issue time, or
the completion of the previous collective on that axis, whichever is later — to its completion.

    axon4d trace build/trace/off build/trace/all --json build/trace.json --png timeline.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import ALL_AXES as AXIS_ORDER

COLORS = {
    "compute": "#4C72B0",
    "blocked": "#D62728",
    "x": "#55A868",
    "y": "#DD8452",
    "z": "#8172B3",
    "data": "#937860",
    "batch": "#DA8BC3",
    "world": "#8C8C8C",
}


def _now() -> tuple[int, float]:
    """(wall-clock ns, ``perf_counter`` s), read back to back."""
    return time.time_ns(), time.perf_counter()


def dump(
    grid: Grid, directory: str, t0: float | None = None, label: str = "", now: Callable[[], tuple[int, float]] = _now
) -> str:
    """Write this rank's collectives and compute spans to ``directory/rank<r>.json``, times from
    ``t0`` (default: its first event) and ``epoch_ns``, ``t0`` on the wall clock (``now``: the wall
    clock and ``perf_counter`` read together); return the path. Raises on an untimed log
    (axon4d.comm.log)."""
    log = grid.comm.log
    log.check_timed("a trace")
    if t0 is None:
        starts = [r.t_issue for r in log.records] + [a for _, a, _ in log.spans]
        t0 = min(starts) if starts else 0.0
    wall_ns, perf_s = now()
    records = []
    for r in log.records:
        done = r.t_issue + r.duration
        records.append(
            {
                "op": r.op.value,
                "axis": r.axis,
                "tag": str(r.tag),  # a Term prints its value, e.g. "E10f"
                "bytes": r.payload_bytes,
                "issue": r.t_issue - t0,
                "done": done - t0,
                "wait": None if r.t_wait_start is None else [r.t_wait_start - t0, r.t_wait_start - t0 + r.blocked],
            }
        )
    data = {
        "rank": grid.rank,
        "coords": dict(grid.coords),
        "grid": str(grid.shape),
        "label": label,
        "epoch_ns": wall_ns - round((perf_s - t0) * 1e9),
        "backend": grid.comm.transport_name,
        "records": records,
        "spans": [[name, a - t0, b - t0] for name, a, b in log.spans],
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{grid.rank}.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def load(directory: str) -> list[dict[str, Any]]:
    """Every rank's dump in ``directory``, in rank order, on one wall-clock time line (``align``)."""
    dumps = []
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        with open(path) as f:
            dumps.append(json.load(f))
    if not dumps:
        raise ValueError(f"no rank*.json dumps in {directory!r}; write them with axon4d.trace.dump(grid, directory)")
    return align(sorted(dumps, key=lambda d: d["rank"]))


def align(dumps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``dumps`` with every time measured from the earliest ``epoch_ns`` among them (which each
    then holds): events at one wall-clock instant get one time, whichever process took them.
    Dumps without ``epoch_ns`` are returned as they are."""
    if not dumps or any("epoch_ns" not in d for d in dumps):
        return dumps
    base = min(d["epoch_ns"] for d in dumps)
    out = []
    for d in dumps:
        shift = (d["epoch_ns"] - base) / 1e9
        records = [
            {
                **r,
                "issue": r["issue"] + shift,
                "done": r["done"] + shift,
                "wait": None if r["wait"] is None else [t + shift for t in r["wait"]],
            }
            for r in d["records"]
        ]
        spans = [[name, a + shift, b + shift] for name, a, b in d["spans"]]
        out.append({**d, "epoch_ns": base, "records": records, "spans": spans})
    return out


def wire_intervals(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, float]]:
    """(record, start, end) per collective: start = max(issue, previous completion on its axis)."""
    out: list[tuple[dict[str, Any], float, float]] = []
    last_done: dict[str, float] = {}
    for r in sorted(records, key=lambda r: r["issue"]):
        start = max(r["issue"], last_done.get(r["axis"], float("-inf")))
        end = max(r["done"], start)
        last_done[r["axis"]] = end
        out.append((r, start, end))
    return out


def chrome_trace(runs: Sequence[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """A Chrome trace of ``runs`` = [(title, dumps)]: a process per (run, rank), tracks as above."""
    events: list[dict[str, Any]] = []
    for k, (title, dumps) in enumerate(runs):
        for d in dumps:
            pid = k * 10000 + d["rank"]
            c = d["coords"]
            name = f"{title} rank {d['rank']} (x={c['x']}, y={c['y']}, z={c['z']}, data={c['data']})"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
            for i, axis in enumerate(AXIS_ORDER):
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": i + 1, "args": {"name": f"comm {axis}"}}
                )
            for span_name, a, b in d["spans"]:
                events.append(
                    {
                        "ph": "X",
                        "cat": "compute",
                        "name": span_name,
                        "pid": pid,
                        "tid": 0,
                        "ts": a * 1e6,
                        "dur": (b - a) * 1e6,
                    }
                )
            for r, start, end in wire_intervals(d["records"]):
                args = {"bytes": r["bytes"], "issue_ms": r["issue"] * 1e3, "done_ms": r["done"] * 1e3}
                events.append(
                    {
                        "ph": "X",
                        "cat": "comm",
                        "name": f"{r['op']} {r['tag']}",
                        "pid": pid,
                        "tid": AXIS_ORDER.index(r["axis"]) + 1,
                        "ts": start * 1e6,
                        "dur": (end - start) * 1e6,
                        "args": args,
                    }
                )
                if r["wait"] and r["wait"][1] > r["wait"][0]:
                    events.append(
                        {
                            "ph": "X",
                            "cat": "blocked",
                            "name": f"wait {r['tag']}",
                            "pid": pid,
                            "tid": 0,
                            "ts": r["wait"][0] * 1e6,
                            "dur": (r["wait"][1] - r["wait"][0]) * 1e6,
                        }
                    )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(runs: Sequence[tuple[str, list[dict[str, Any]]]], path: str, ranks: Sequence[int] = (0, 1)) -> str:
    """A PNG timeline: per run a panel, per rank a compute row and one row per axis it used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = max(
        (
            max([b for _, _, b in d["spans"]] + [r["done"] for r in d["records"]] + [0.0])
            for _, dumps in runs
            for d in dumps
        ),
        default=1.0,
    )
    rows_per_run = []
    for _, dumps in runs:
        rows = []
        for d in (d for d in dumps if d["rank"] in ranks):
            axes = [a for a in AXIS_ORDER if any(r["axis"] == a for r in d["records"])]
            rows.append((d, axes))
        rows_per_run.append(rows)
    heights = [max(1, sum(1 + len(axes) for _, axes in rows)) for rows in rows_per_run]
    fig, panels = plt.subplots(
        len(runs),
        1,
        figsize=(13, 1.0 + 0.32 * sum(heights) + 0.5 * len(runs)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for (title, _), rows, ax in zip(runs, rows_per_run, panels[:, 0]):
        labels, y = [], 0
        for d, axes in rows:
            ax.broken_barh([(a, b - a) for _, a, b in d["spans"]], (y + 0.1, 0.8), color=COLORS["compute"])
            waits = [(r["wait"][0], r["wait"][1] - r["wait"][0]) for r in d["records"] if r["wait"]]
            ax.broken_barh(waits, (y + 0.1, 0.8), color=COLORS["blocked"])
            labels.append(f"rank {d['rank']} compute")
            for axis in axes:
                y += 1
                bars = [(a, b - a) for r, a, b in wire_intervals(d["records"]) if r["axis"] == axis]
                ax.broken_barh(bars, (y + 0.1, 0.8), color=COLORS[axis], edgecolor="white", linewidth=0.3)
                labels.append(f"rank {d['rank']} comm {axis}")
            y += 1
        ax.set_yticks([i + 0.5 for i in range(len(labels))], labels, fontsize=8)
        ax.set_ylim(len(labels), 0)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    panels[-1, 0].set_xlim(0, end)
    ticks = panels[-1, 0].get_xticks()
    panels[-1, 0].set_xticks(ticks, [f"{t * 1e3:.0f}" for t in ticks])
    panels[-1, 0].set_xlim(0, end)
    panels[-1, 0].set_xlabel("time since step start (ms)")
    used = [
        k for k in COLORS if k in ("compute", "blocked") or any(k in axes for rows in rows_per_run for _, axes in rows)
    ]
    names = {"compute": "compute", "blocked": "blocked waiting"}
    fig.legend(
        handles=[Patch(color=COLORS[k], label=names.get(k, f"comm over {k}")) for k in used],
        loc="upper right",
        ncol=len(used),
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", help="directories of rank*.json dumps (one per run)")
    parser.add_argument("--titles", help="comma-separated panel titles (default: the directory names)")
    parser.add_argument("--json", default="trace.json", help="Chrome/Perfetto trace to write")
    parser.add_argument("--png", default=None, help="PNG timeline to write")
    parser.add_argument("--ranks", default="0,1", help="ranks to draw in the PNG (the JSON has all)")


def main(args: argparse.Namespace) -> int:
    titles = args.titles.split(",") if args.titles else [os.path.basename(os.path.normpath(d)) for d in args.dirs]
    if len(titles) != len(args.dirs):
        raise ValueError(f"--titles has {len(titles)} names for {len(args.dirs)} directories")
    runs = [(t, load(d)) for t, d in zip(titles, args.dirs)]
    with open(args.json, "w") as f:
        json.dump(chrome_trace(runs), f)
    print(f"wrote {args.json} ({sum(len(d) for _, d in runs)} rank tracks)")
    if args.png:
        plot(runs, args.png, [int(r) for r in args.ranks.split(",")])
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="axon4d trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
