"""What the benchmarks share (a local world is ``axon4d.measure.spawn.run_local``): paired rounds, medians and the header of a result file.

- ``paired(steps, pairs)``: implementations stepped alternately, A B, B A, A B, …, so that a drift
  in the shared host's speed lands on both sides of each pair's ratio alike; ``rotated(names, r)``:
  the order of round ``r`` of interleaved rounds (each round starts one later).
- ``median``, ``medians`` (of each key over rows), ``median_of_medians`` (over rounds).
- ``header()``: how and where a result was made: the command line, the git commit (and whether
  tracked files differed from it), the host (CPU model, AVX-512, cores, load average), torch's and
  Python's versions, the date (UTC). ``save(path, result, head)`` writes ``{"header": ..., **result}``
  with the load average at the end added to the header (``head``: a header taken when the run
  started; taken at the save without it).

The scripts import it as ``common`` (bench/ is the script's directory, first on ``sys.path``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


# -- rounds and pairs --------------------------------------------------------------------------------
def rotated(names: Sequence[str], r: int) -> list[str]:
    """The order of round ``r``: ``names`` rotated by ``r``, so each name goes first in turn."""
    k = r % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def paired(steps: Mapping[str, Callable[[], float]], pairs: int) -> dict[str, list[float]]:
    """Every one of ``steps`` (name → a callable that runs one step and returns its seconds)
    ``pairs`` times, alternating: pair i runs them in order for even i and in reverse for odd i
    (A B, B A, A B, …). Returns each name's seconds, pair by pair."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(pairs):
        for n in names if i % 2 == 0 else names[::-1]:
            times[n].append(steps[n]())
    return times


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def medians(rows: Sequence[Mapping[str, Any]], keys: Iterable[str] | None = None) -> dict[str, float]:
    """Per key (default: the first row's), the median over ``rows``."""
    return {k: statistics.median(r[k] for r in rows) for k in (rows[0] if keys is None else keys)}


def median_of_medians(rounds: Iterable[Iterable[float]]) -> float:
    """The median over rounds of each round's median."""
    return statistics.median(statistics.median(r) for r in rounds)


# -- where and how a result was made -------------------------------------------------------------------
def host() -> dict[str, Any]:
    """The first processor's model and AVX-512 flags (/proc/cpuinfo), the cores this process may
    run on and the host's, the load average now, torch's and Python's versions."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if "torch" in sys.modules:
        torch_version = sys.modules["torch"].__version__
    else:  # the driver of a bench whose ranks import torch: no need to import it here
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = None
    return {
        "cpu_model": model or platform.processor() or "unknown",
        "avx512": sorted(f for f in flags if f.startswith("avx512")),
        "has_avx512": any(f.startswith("avx512f") for f in flags),
        "cores_available": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "torch": torch_version,
        "python": platform.python_version(),
    }


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def header(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """How and where a result is made: command line, commit, host, versions, date."""
    argv = list(sys.argv if argv is None else argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": shlex.join(["python", *argv]),
        "cwd": os.getcwd(),
        "commit": _git("rev-parse", "HEAD"),
        "tracked_files_changed": None if status is None else bool(status),
        "host": host(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save(path: str, result: Mapping[str, Any], head: dict[str, Any] | None = None) -> str:
    """Write ``{"header": head or header(), **result}`` to ``path`` as JSON, with the load average
    at the end in the header's host; returns ``path``."""
    head = dict(head or header())
    head["host"] = {**head["host"], "loadavg_end": list(os.getloadavg())}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"header": head, **result}, f, indent=1)
    return path


def train_on_ranks(cfg: Mapping[str, Any], timeout: float = 1200) -> dict[str, Any]:
    """The training job (``axon4d.train``) of ``cfg`` (``TrainConfig``'s fields, with its
    ``grid``) on as many local ranks as the grid has: rank 0's summary (summary.json's, with every
    step's loss). The library is imported here, not at the top of this module: some benches import
    this module before they put the project on ``sys.path``."""
    from axon4d.measure.spawn import run_local

    world = 1
    for g in str(cfg["grid"]).split(","):
        world *= int(g)
    return run_local(world, _train_job, dict(cfg), grid=None, timeout=timeout)


def _train_job(_: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """``train_on_ranks``' job on one rank."""
    from axon4d.train import TrainConfig, train

    return dict(train(TrainConfig(**cfg)))
