"""What a training run reports: the step record, the progress line, log.jsonl, the run summary and
the loss-curve plot.

A step record holds the loss, learning rate, gradient norm, step time, tokens/s, MFU, payload bytes
per grid axis, and the communication and blocked time with the share of communication hidden, all
as ``axon4d.comm.log`` defines them (``CommLog.summary``; docs/design.md §4), and the writing rank's
resident host memory and thread count (``host_usage``: a leak shows as a slope). A step skipped for
a non-finite loss or gradient adds ``skipped`` and ``nonfinite_param``. The run summary adds
the steady steps up (every step but the first, which pays for warm-up allocations): medians of
time, tokens/s and MFU, mean bytes per axis, and the hidden share of the summed communication and
blocked time (``commlog.hidden_pct``), the device the run trained on and its activation
recomputation mode; the training loop adds an MoE model's expert layout, the seconds each checkpoint save blocked training
(``save_summary``) and the defaults it took (``CHOSEN_KEYS``: the precision
``auto`` resolved to, TF32, the AdamW implementation), which the banner shows too. Rank 0 writes ``log.jsonl`` (one record per logged step; a resumed run keeps
the records up to its checkpoint's step and writes on from there), ``summary.json`` and, with
``--compare-single``, ``loss.png``.
"""

from __future__ import annotations

import json
import os
import resource
import threading
from typing import Any

from axon4d.comm.log import hidden_pct
from axon4d.config import ModelConfig
from axon4d.grid.mesh import Grid


def host_usage() -> tuple[int, int]:
    """(resident bytes, threads) of this process, from /proc where there is one (else the peak
    resident size from ``getrusage`` and Python's threads)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, len(os.listdir("/proc/self/task"))
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, threading.active_count()


def step_record(
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    step_s: float,
    tokens_per_s: float,
    mfu: float,
    comm: dict[str, Any],
) -> dict[str, Any]:
    """The log record of step number ``step`` (counted from 1); ``comm`` is the step's ``CommLog.summary()``."""
    rss, threads = host_usage()
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "comm_bytes": {a: v["bytes"] for a, v in comm["axes"].items()},
        "comm_s": comm["comm_s"],
        "blocked_s": comm["blocked_s"],
        "hidden_pct": comm["hidden_pct"],
        "rss_bytes": rss,
        "threads": threads,
    }


def progress_line(rec: dict[str, Any]) -> str:
    """The progress bar's fields for a step record: loss, tokens/s, MFU, communication hidden."""
    return (
        f"loss {rec['loss']:.4f} | {rec['tokens_per_s']:,.0f} tok/s | MFU {100 * rec['mfu']:.1f}% | "
        f"hidden {_pct(rec['hidden_pct'])}"
    )


def _pct(share: float | None) -> str:
    """A share hidden as "NN%", or "not timed" where the collectives were not timed
    (``AXON4D_COMM_TIMING=0``: ``axon4d.comm.log``)."""
    return "not timed" if share is None else f"{share:.0f}%"


def banner(
    grid: Grid,
    model: str,
    mcfg: ModelConfig,
    peak_tflops: float,
    start: int,
    recompute: str = "none",
    peak_source: str = "",
    chosen: dict[str, Any] | None = None,
) -> str:
    """The start-up lines: the grid, the model, the peak MFU is measured against (and where it came
    from), recomputation, the resume step, an MoE model's expert layout (``expert_line``) and, from
    ``chosen``, the defaults the run took (``chosen_line``)."""
    return (
        f"{grid}\nmodel {mcfg.name or model} ({mcfg.arch}): {mcfg.n_params() / 1e6:.2f} M parameters, "
        f"{mcfg.n_layers} layers, hidden {mcfg.hidden}, seq {mcfg.seq_len}; "
        f"peak {peak_tflops:.3f} TFLOP/s over {grid.world_size} ranks"
        + (f" ({peak_source})" if peak_source else "")
        + (f"; recompute {recompute}" if recompute != "none" else "")
        + (f"; resumed at step {start}" if start else "")
        + (f"\n{expert_line(grid, mcfg)}" if mcfg.moe else "")
        + (f"\n{chosen_line(chosen)}" if chosen else "")
    )


def expert_line(grid: Grid, mcfg: ModelConfig) -> str:
    """Where an MoE model's experts run on ``grid`` (its layers take the grid's layout,
    ``axon4d.grid.expert_layout``), e.g. "expert layout ep=world,tp=1: 8 experts over x·y·z·data (8
    ranks), 1 per rank, each whole"."""
    return f"expert layout {grid.expert_layout.describe(grid.shape, mcfg.n_experts)}"


def chosen_line(chosen: dict[str, Any]) -> str:
    """The defaults a run took, as the banner shows them: the resolved precision, whether fp32
    matmuls may use TF32, and the AdamW implementation (under FP8 GEMMs, the gradients' float8 too)."""
    grads = f" (gradients {chosen['fp8_gradients']})" if chosen.get("fp8_gradients") else ""
    return (
        f"precision {chosen['precision']}{grads}; fp32 matmuls {'TF32' if chosen['tf32'] else 'fp32'}; "
        f"AdamW {chosen['optimizer']}"
    )


class LogFile:
    """``log.jsonl`` of a run: every ``every``-th step record as one JSON line (rank 0 only)."""

    def __init__(self, out_dir: str, every: int, enabled: bool, start: int = 0):
        """A run starting at step ``start`` keeps the records of steps up to ``start`` that a
        previous run wrote (a resumed run), and drops the rest (steps that run did after its
        checkpoint, which this run does again), so each step is logged once."""
        self.every = every
        self._file = None
        if not enabled:
            return
        path = os.path.join(out_dir, "log.jsonl")
        kept = []
        if start > 0 and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= start:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line of a run that was killed
        self._file = open(path, "w")
        self._file.writelines(kept)
        self._file.flush()

    def write(self, rec: dict[str, Any]) -> None:
        if self._file is not None and rec["step"] % self.every == 0:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def summarize(
    records: list[dict[str, Any]], steps: int, grid: Grid, ckpt: str, recompute: str = "none"
) -> dict[str, Any]:
    """The run summary of the step records (steady steps: all but the first) of a run with
    activation recomputation ``recompute``."""
    steady = records[1:] or records  # the first step pays for warm-up allocations
    med = lambda key: sorted(r[key] for r in steady)[len(steady) // 2] if steady else float("nan")  # noqa: E731
    axes: dict[str, float] = {}
    for r in steady:
        for a, b in r["comm_bytes"].items():
            axes[a] = axes.get(a, 0) + b / len(steady)
    timed = all(r["comm_s"] is not None for r in steady)
    comm_s = sum(r["comm_s"] for r in steady) if timed else 0.0
    blocked_s = sum(r["blocked_s"] for r in steady) if timed else 0.0
    return {
        "grid": str(grid.shape),
        "device": str(grid.device),
        "recompute": recompute,
        "steps": steps,
        "final_loss": records[-1]["loss"] if records else None,
        "median_step_s": med("step_s"),
        "median_tokens_per_s": med("tokens_per_s"),
        "median_mfu": med("mfu"),
        "comm_bytes_per_step": axes,
        "hidden_pct": hidden_pct(comm_s, blocked_s) if timed else None,
        "checkpoint": ckpt,
    }


def save_summary(blocked_s: list[float], background: bool) -> dict[str, Any]:
    """The summary's record of a run's checkpoint saves: whether they were written in the
    background (--async-save) and the seconds each one blocked training, in order (the last, at the
    end of the run, waits for its write to be published)."""
    return {"async_save": background, "save_blocked_s": blocked_s}


def save_line(s: dict[str, Any]) -> str:
    """The summary table's line for the saves, e.g. "3 in the background: blocked 0.012 s per save
    during the run (median), 0.84 s for the last"."""
    blocked = s["save_blocked_s"]
    kind = "in the background" if s["async_save"] else "synchronous"
    during = sorted(blocked[:-1])
    if not during:
        return f"1 {kind}: blocked {blocked[-1]:.3g} s at the end"
    median = during[len(during) // 2]
    return f"{len(blocked)} {kind}: blocked {median:.3g} s per save during the run (median), {blocked[-1]:.3g} s for the last"


#: the summary's record of the defaults a run took (axon4d.train.loop): the resolved --precision,
#: whether fp32 matmuls may use TF32, the AdamW implementation
CHOSEN_KEYS = ("precision", "tf32", "optimizer")


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run table."""
    rows = [
        ("grid", s["grid"]),
        ("device", s["device"]),
        ("recompute", s["recompute"]),
        *([("expert layout", s["expert_layout"])] if s.get("expert_layout") else []),
        ("steps", s["steps"]),
        ("final loss", f"{s['final_loss']:.4f}" if s["final_loss"] is not None else "-"),
        ("step time (median)", f"{1e3 * s['median_step_s']:.1f} ms"),
        ("tokens/s (median)", f"{s['median_tokens_per_s']:,.0f}"),
        ("MFU (median)", f"{100 * s['median_mfu']:.2f}%"),
        ("communication hidden", _pct(s["hidden_pct"])),
    ]
    rows += [(key, s[key]) for key in CHOSEN_KEYS if key in s]
    rows += [(f"bytes/step on {a}", f"{b / 2**20:.2f} MiB") for a, b in sorted(s["comm_bytes_per_step"].items())]
    rows.append(("checkpoint", s["checkpoint"]))
    if s.get("save_blocked_s"):
        rows.append(("checkpoint saves", save_line(s)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "run summary", "-" * (width + 30)] + [f"{k:<{width}}  {v}" for k, v in rows])


def write_summary(out_dir: str, summary: dict[str, Any]) -> None:
    """Write ``summary.json``."""
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def plot_curves(path: str, ours: list[float], ref: list[float], grid: str) -> str:
    """Both loss curves in one PNG."""
    # pyplot is slow to import and needs its backend chosen first; only --compare-single plots
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(range(1, len(ref) + 1), ref, label="1 process, plain PyTorch", linewidth=3.5, alpha=0.45)
    ax.plot(range(1, len(ours) + 1), ours, label=f"axon4d, grid {grid}", linewidth=1.2, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("4D-parallel training follows the single-process loss curve")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
