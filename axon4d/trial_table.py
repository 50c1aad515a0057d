"""The tried plans as ``--try`` and ``axon4d.try_plans`` show them (``axon4d.trials``): a line per
try as it ends, the table of every plan before the banner and after the run summary."""

from __future__ import annotations

import sys
from typing import Any

#: what ``axon4d.trials.choose`` does, in the words the table and trials.json keep
RULE = (
    "the planner's first plan that ran, unless another plan's slowest round was faster than its fastest round; "
    "then the fastest median of those"
)


def error_pct(row: dict[str, Any], key: str) -> float | None:
    """How far the prediction of ``key`` ("s" or "peak_bytes") was off, in % of the measured value."""
    measured = row[f"measured_{key}"]
    return None if not measured else 100 * (row[f"predicted_{key}"] - measured) / measured


def line(row: dict[str, Any]) -> str:
    """One tried plan in a line: the grid and options, predicted and measured (its last round), or why it failed."""
    head = f"{tuple(row['grid'])} {row['options']}: predicted {1e3 * row['predicted_s']:.1f} ms"
    if row["error"] is not None:
        return f"{head}; skipped ({row['failure']}: {row['error']})"
    last = row["rounds_s"][-1] if row["rounds_s"] else row["measured_s"]
    return f"{head}, measured {1e3 * last:.1f} ms ({100 * (row['predicted_s'] - last) / last:+.0f}%)"


def table(rows: list[dict[str, Any]]) -> str:
    """The tried plans as the banner and the summary show them: predicted and measured step time
    (the median of the rounds, and each round's) and peak memory per rank, the error of each
    prediction, and which plan the run trains with."""
    head = (
        f"{'#':>2} {'grid (x,y,z,d)':<15} {'options':<34} {'pred ms':>8} {'meas ms':>8} {'err':>5} "
        f"{'pred MiB':>9} {'meas MiB':>9} {'err':>5}  {'rounds ms':<20}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        rounds = "/".join(f"{1e3 * t:.0f}" for t in r.get("rounds_s") or [] if t is not None) or "-"
        if r["measured_s"] is None:
            measured = f"{'-':>8} {'-':>5} {r['predicted_peak_bytes'] / 2**20:>9.1f} {'-':>9} {'-':>5}"
            mark = f"skipped: {r.get('failure') or 'error'}: {r['error']}"
        else:
            measured = (
                f"{1e3 * r['measured_s']:>8.1f} {error_pct(r, 's'):>+4.0f}% "
                f"{r['predicted_peak_bytes'] / 2**20:>9.1f} {r['measured_peak_bytes'] / 2**20:>9.1f} "
                f"{error_pct(r, 'peak_bytes'):>+4.0f}%"
            )
            mark = "chosen" if r["chosen"] else ""
        out.append(
            f"{r['rank']:>2} {str(tuple(r['grid'])):<15} {r['options'][:34]:<34} {1e3 * r['predicted_s']:>8.1f} "
            f"{measured}  {rounds:<20} {mark}"
        )
    recorded = " (recorded by the first launch; not tried again)" if rows and rows[0].get("recorded") else ""
    return f"plans tried (--try){recorded}; err = (predicted − measured) / measured; chosen: {RULE}\n" + "\n".join(out)


def say(text: str) -> None:
    """A line of the trial's progress on stderr, as ``axon4d: ...``."""
    print(f"axon4d: {text}", file=sys.stderr, flush=True)
