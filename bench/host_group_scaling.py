"""How making and using the host group grows with the world: gloo's full mesh against lazy connections.

For each world size W (``--worlds``, default 8 16 32 64) and each way of making a world-wide gloo
group (``--modes``), W processes on this host (forked, ``OMP_NUM_THREADS=1``) meet at one
TCPStore and each rank

1. makes the group (``create``): ``eager`` is ``dist.new_group(backend="gloo")`` as gloo connects
   by default, a full mesh; ``host_group`` is ``axon4d.comm.communicator.host_group``, which makes
   the same group with lazy connections (``axon4d.comm.host_mesh.lazy_connections``);
2. saves a one-element tensor per rank with ``dcp.save`` over it (``save``: the group's first
   collectives, DCP's coordination of a save), then loads it back with ``dcp.load`` (``load``).

Every store request a rank makes goes through a counting wrapper (``CountingStore``, a Python
``dist.Store`` gloo calls through torch's trampoline): requests and bytes (keys and values, both
ways) per phase and per rank; with the wall time of each phase (the slowest rank's and the median
rank's), a rank's CPU seconds (all its threads: less bent than wall time by the other ranks and
jobs sharing the cores), the sockets a rank holds after the save (open files, less those before),
and the collectives DCP issued (rank 0's calls of torch.distributed's object collectives and
barrier). The world group itself is made with lazy connections, before the counting starts, and
is never used.

Measured: W = 8 … 64, the median over ``--repeats`` runs of each figure (counts and bytes are the
same in every run; times vary with the shared host's load). Extrapolated, not measured: W = 1024
and 4096, by laws fitted to the measured points in the form each mechanism has (``laws_for``):
quadratic in W for a full mesh's ranks (W records of ≈ 170 + 8·W bytes each) and lazy rank 0's
(one record per peer: linear), c0 + c1·log2 W for lazy other ranks (a ring's and a tree's few
peers), a·W^b for times; each law's log-log exponent over the measured points is saved with it,
and the store's total (busiest rank + (W − 1) × busiest other rank) is derived from them.

    python bench/host_group_scaling.py                         # W = 8 16 32 64, 5 runs each
    python bench/host_group_scaling.py --worlds 8 16 --repeats 1

Saves ``bench/results/host_group_scaling.json``; the last line is
``host group at W=64 (measured, create + first DCP save): full mesh X KB, N store requests per
rank, S s; lazy (host_group) rank 0 ..., other ranks <= ...; at W=4096 (extrapolated) ...``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from axon4d.comm import communicator as comm  # noqa: E402
from axon4d.comm import host_mesh  # noqa: E402

MODES = ("eager", "host_group")
PHASES = ("create", "save", "load")
#: the collectives whose calls are recorded (what DCP coordinates with)
TRACED = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "barrier")
EXTRAPOLATE = (1024, 4096)
OUT = os.path.join(common.RESULTS, "host_group_scaling.json")


def _nbytes(value: Any) -> int:
    return len(value.encode() if isinstance(value, str) else value)


class CountingStore(dist.Store):
    """A store that forwards every request to ``inner`` and counts it: ``calls`` and ``nbytes``
    (keys and values sent and received) per method."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()
        self.nbytes: collections.Counter[str] = collections.Counter()
        self.read_keys: list[str] = []  # keys read with get, in order

    def _count(self, method: str, nbytes: int) -> None:
        self.calls[method] += 1
        self.nbytes[method] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.nbytes.clear()
        self.read_keys.clear()

    def set(self, key, value):
        self._count("set", len(key) + _nbytes(value))
        return self.inner.set(key, value)

    def get(self, key):
        value = self.inner.get(key)
        self._count("get", len(key) + len(value))
        self.read_keys.append(key)
        return value

    def add(self, key, amount):
        self._count("add", len(key) + 8)
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        got = self.inner.compare_set(key, expected, desired)
        self._count("compare_set", len(key) + _nbytes(expected) + _nbytes(desired) + len(got))
        return got

    def wait(self, keys, timeout=None):
        self._count("wait", sum(map(len, keys)))
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self._count("check", sum(map(len, keys)))
        return self.inner.check(keys)

    def delete_key(self, key):
        self._count("delete_key", len(key))
        return self.inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys", 0)
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self._count("multi_get", sum(map(len, keys)) + sum(map(len, values)))
        self.read_keys.extend(keys)
        return values

    def multi_set(self, keys, values):
        self._count("multi_set", sum(map(len, keys)) + sum(map(_nbytes, values)))
        return self.inner.multi_set(keys, values)

    def append(self, key, value):
        self._count("append", len(key) + _nbytes(value))
        return self.inner.append(key, value)

    def tally(self) -> dict[str, Any]:
        """Requests and bytes so far, in all and per method, and how many keys were read."""
        return {
            "requests": sum(self.calls.values()),
            "bytes": sum(self.nbytes.values()),
            "per_method": {m: [self.calls[m], self.nbytes[m]] for m in sorted(self.calls)},
            "keys_read": len(self.read_keys),
        }


def _trace_collectives(seen: list[str]) -> None:
    """Record in ``seen`` each call of the ``TRACED`` collectives (this process only)."""
    for name in TRACED:
        real = getattr(dist, name)

        def traced(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            seen.append(_name)
            return _real(*args, **kwargs)

        setattr(dist, name, traced)


def _make_group(mode: str, timeout_s: float) -> dist.ProcessGroup:
    """The world-wide gloo group of ``mode`` (module docstring)."""
    if mode == "host_group":
        return comm.host_group(timeout_s)
    if mode == "eager":
        before = os.environ.pop(host_mesh.LAZY_ENV, None)
        try:
            return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        finally:
            if before is not None:
                os.environ[host_mesh.LAZY_ENV] = before
    raise ValueError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")


def _worker(rank: int, world: int, port: int, mode: str, where: str, results: Any, timeout_s: float) -> None:
    """One rank of one run: its tallies and seconds per phase, put on ``results``."""
    try:
        client = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        store = CountingStore(client)
        with host_mesh.lazy_connections():  # the world group: made, never used, costs one request
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        seen: list[str] = []
        _trace_collectives(seen)
        row: dict[str, Any] = {"rank": rank}
        opened = host_mesh.open_files()
        client.add("ready", 1)  # all ranks start each phase together: a barrier on the bare store
        while int(client.add("ready", 0)) < world:
            time.sleep(0.005)
        state = {f"rank{rank}": torch.full((1,), float(rank))}
        group = None
        for phase in PHASES:
            store.reset()
            start, cpu = time.perf_counter(), time.process_time()
            if phase == "create":
                group = _make_group(mode, timeout_s)
            elif phase == "save":
                dcp.save(state, checkpoint_id=where, process_group=group)
            else:
                back = {f"rank{rank}": torch.zeros(1)}
                dcp.load(back, checkpoint_id=where, process_group=group)
                assert back[f"rank{rank}"].item() == rank
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            row[phase] = {"seconds": seconds, "cpu_seconds": cpu_seconds, **store.tally()}
            row[f"collectives_{phase}"] = list(seen)
            seen.clear()
            if phase == "save":
                row["sockets"] = host_mesh.open_files() - opened
        if group is not None:
            dist.destroy_process_group(group)
        dist.destroy_process_group()
        results.put(row)
    except BaseException as e:  # reported, never left hanging
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, mode: str, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """One run: ``world`` forked ranks make the group of ``mode`` and save and load over it; each
    rank's row (phase → seconds, requests, bytes; sockets; collectives), by rank. Raises
    ``RuntimeError`` naming the ranks that failed."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    where = tempfile.mkdtemp(prefix=f"host_group_{world}_{mode}_")
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, mode, where, results, timeout_s), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    server = None
    rows: list[dict[str, Any]] = []
    try:
        # made after the fork, so that no child inherits the server's threads
        server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
        deadline = time.monotonic() + timeout_s * 2
        while len(rows) < world:
            rows.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del server
        shutil.rmtree(where, ignore_errors=True)
    failed = [r for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} of {world} ranks failed ({mode}): {failed[0]['error']}")
    return sorted(rows, key=lambda r: r["rank"])


#: what a rank did to make the group and coordinate its first save, its figures summed
FIRST = "create+save"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase (and ``FIRST``, create and save summed per rank): the slowest rank's seconds and
    the median rank's, the largest CPU seconds of a rank (all its threads; less bent by the other
    ranks sharing the cores than wall time); the busiest rank's requests and bytes (rank 0 under lazy connections), the
    busiest other rank's, the median rank's, and all ranks' together (what the one store serves)."""
    out: dict[str, Any] = {}
    for phase in (*PHASES, FIRST):
        parts = phase.split("+")
        keys = ("seconds", "cpu_seconds", "requests", "bytes")
        per = [{k: sum(r[p][k] for p in parts) for k in keys} for r in rows]
        fig: dict[str, float] = {
            "seconds_max": max(p["seconds"] for p in per),
            "seconds_median": statistics.median(p["seconds"] for p in per),
            "cpu_seconds_max": max(p["cpu_seconds"] for p in per),
        }
        for k in ("requests", "bytes"):
            fig[f"{k}_rank0"] = per[0][k]
            fig[f"{k}_max"] = max(p[k] for p in per)
            fig[f"{k}_max_other"] = max(p[k] for p in per[1:])
            fig[f"{k}_median"] = statistics.median(p[k] for p in per)
            fig[f"{k}_all"] = sum(p[k] for p in per)
        out[phase] = fig
    out["sockets_rank0"] = rows[0]["sockets"]
    out["sockets_max_other"] = max((r["sockets"] for r in rows[1:]), default=0)
    return out


def _median_of(runs: list[Any]) -> Any:
    """The median of each figure over runs (nested dicts of numbers)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: _median_of([r[k] for r in runs]) for k in first}
    return statistics.median(runs)


def fit(worlds: list[int], values: list[float], kind: str) -> dict[str, Any]:
    """A growth law through the measured (world, value) points, least squares, and its values at
    ``EXTRAPOLATE``. ``kind``: "quadratic" (c0 + c1·W + c2·W²), "linear" (c0 + c1·W), "log"
    (c0 + c1·log2 W) or "power" (a·W^b, in log-log: the times). Every law also reports the log-log
    exponent over the measured points."""
    w, v = np.array(worlds, float), np.array(values, float)
    b, log_a = np.polyfit(np.log(w), np.log(np.maximum(v, 1e-12)), 1)
    law: dict[str, Any] = {"kind": kind, "loglog_exponent": round(float(b), 3)}
    if kind == "power":
        law["a_b"] = [float(math.exp(log_a)), round(float(b), 3)]
        at = {n: math.exp(log_a) * n**b for n in EXTRAPOLATE}
    else:
        x, degree = (np.log2(w), 1) if kind == "log" else (w, 2 if kind == "quadratic" else 1)
        c = np.polyfit(x, v, degree)[::-1]  # c0, c1[, c2]
        law["coefficients"] = [round(float(k), 4) for k in c]
        at = {n: sum(k * (math.log2(n) if kind == "log" else n) ** i for i, k in enumerate(c)) for n in EXTRAPOLATE}
    law["extrapolated"] = {str(n): float(x) for n, x in at.items()}
    return law


def laws_for(mode: str) -> dict[str, str]:
    """Figure ("phase.key") → the kind of law fitted to it under ``mode``, the form its mechanism
    has: under a full mesh every rank reads every record of ≈ 170 + 8·W bytes (quadratic in W);
    under lazy connections making the group is one record (constant: "log" absorbs the keys' digits),
    rank 0 reads one record per peer (linear) and any other rank a few (log)."""
    lazy = mode == "host_group"
    made, busiest, other = ("log", "linear", "log") if lazy else ("quadratic",) * 3
    return {
        "create.seconds_max": "power",
        f"{FIRST}.seconds_max": "power",
        "create.cpu_seconds_max": "power",
        "create.requests_max": made,
        "create.bytes_max": made,
        f"{FIRST}.requests_max": busiest,
        f"{FIRST}.bytes_max": busiest,
        f"{FIRST}.requests_max_other": other,
        f"{FIRST}.bytes_max_other": other,
    }


def _figure(summary: dict[str, Any], dotted: str) -> float:
    phase, key = dotted.split(".")
    return float(summary[phase][key])


def store_total(laws: dict[str, Any], what: str, n: int) -> float:
    """At ``n`` ranks (extrapolated): the busiest rank's ``what`` ("requests" or "bytes") to make the
    group and coordinate its first save, plus n − 1 times the busiest other rank's — at least what
    the one store serves then (exact for a full mesh, whose ranks all do the same)."""
    busiest = laws[f"{FIRST}.{what}_max"]["extrapolated"][str(n)]
    other = laws[f"{FIRST}.{what}_max_other"]["extrapolated"][str(n)]
    return busiest + (n - 1) * other


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=OUT)
    ap.add_argument(
        "--refit", action="store_true", help="fit the laws again to the measured points of --out; run nothing"
    )
    args = ap.parse_args(argv)
    head = common.header()
    measured: dict[str, dict[str, Any]] = {m: {} for m in args.modes}
    collectives: dict[str, Any] = {}
    if args.refit:
        with open(args.out) as f:
            saved = json.load(f)
        head, measured = saved["header"], saved["measured"]["by_mode"]
        collectives, args.modes = saved["collectives_issued_by_dcp_rank0"], list(measured)
        args.worlds, args.repeats = sorted(int(w) for w in measured[args.modes[0]]), saved["measured"]["repeats"]
    for world in [] if args.refit else args.worlds:
        for mode in args.modes:
            runs = []
            for _ in range(args.repeats):
                rows = run_world(world, mode)
                runs.append(summarize(rows))
                collectives = {p: rows[0][f"collectives_{p}"] for p in PHASES}
            m = measured[mode][str(world)] = _median_of(runs)
            c, f = m["create"], m[FIRST]
            print(
                f"W={world:3d} {mode:10s} create {c['seconds_max']:.3f} s, {c['requests_max']:.0f} requests "
                f"{c['bytes_max'] / 1e3:.1f} KB per rank; create+save {f['seconds_max']:.2f} s, busiest rank "
                f"{f['requests_max']:.0f} requests {f['bytes_max'] / 1e3:.1f} KB, other ranks <= "
                f"{f['requests_max_other']:.0f} {f['bytes_max_other'] / 1e3:.1f} KB; sockets rank 0 "
                f"{m['sockets_rank0']:.0f}, others <= {m['sockets_max_other']:.0f}",
                flush=True,
            )
    laws: dict[str, Any] = {}
    if len(args.worlds) >= 3:
        for mode in args.modes:
            laws[mode] = {
                name: fit(args.worlds, [_figure(measured[mode][str(w)], name) for w in args.worlds], kind)
                for name, kind in laws_for(mode).items()
            }
            laws[mode]["store_total"] = {
                what: {str(n): store_total(laws[mode], what, n) for n in EXTRAPOLATE} for what in ("requests", "bytes")
            }
    result = {
        "what": (
            "store requests and bytes per rank (keys and values both ways, through a counting Python dist.Store), "
            "wall seconds and sockets to make a world-wide gloo group (create) and to run dcp.save (save) and "
            "dcp.load (load) of one element per rank over it; create+save: both summed per rank. eager: gloo's "
            "full mesh (dist.new_group); host_group: axon4d.comm.communicator.host_group (lazy connections)"
        ),
        "measured": {
            "repeats": args.repeats,
            "note": (
                f"W = {args.worlds}: forked ranks on loopback on this 2-core host, shared with other jobs; "
                f"median of {args.repeats} runs (counts and bytes are the same in every run, times vary)"
            ),
            "by_mode": measured,
        },
        "collectives_issued_by_dcp_rank0": collectives,
        "extrapolated": {
            "note": (
                "NOT measured: W = 1024 and 4096 from the laws fitted to the measured points, per mode and "
                "figure; store_total: the busiest rank plus (W - 1) times the busiest other rank, create + save"
            ),
            "laws": laws,
        },
        "lazy_supported": host_mesh.lazy_supported(),
    }
    common.save(args.out, result, head)
    w = str(max(args.worlds))
    if "eager" in measured and "host_group" in measured:
        e, h = measured["eager"][w][FIRST], measured["host_group"][w][FIRST]
        tail = ""
        if laws:
            n = str(EXTRAPOLATE[-1])
            le, lh = laws["eager"], laws["host_group"]
            tail = (
                f"; at W={n} (extrapolated) {le[f'{FIRST}.bytes_max']['extrapolated'][n] / 1e6:.0f} MB per rank and "
                f"{le['store_total']['bytes'][n] / 1e9:.0f} GB through the store against "
                f"{lh[f'{FIRST}.bytes_max']['extrapolated'][n] / 1e6:.2f} MB on rank 0 and "
                f"{lh['store_total']['bytes'][n] / 1e6:.0f} MB"
            )
        print(
            f"host group at W={w} (measured, create + first DCP save): full mesh {e['bytes_max'] / 1e3:.1f} KB, "
            f"{e['requests_max']:.0f} store requests per rank, {e['seconds_max']:.2f} s; lazy (host_group) rank 0 "
            f"{h['bytes_max'] / 1e3:.1f} KB, {h['requests_max']:.0f} requests, other ranks <= "
            f"{h['bytes_max_other'] / 1e3:.1f} KB, {h['seconds_max']:.2f} s{tail}"
        )
    return result


if __name__ == "__main__":
    main()
