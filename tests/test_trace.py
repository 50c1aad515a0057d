"""Protects what a step reports about its communication (axon4d/stepstats.py) and the timelines
(axon4d/trace.py): interval arithmetic, the per-step record and line, per-rank dumps of a real
training step, the Chrome trace's tracks and the PNG, and the ``axon4d trace`` command's module."""

import argparse
import json
import os
import types

import torch

import axon4d
from axon4d import stepstats, trace
from axon4d.comm import log as commlog
from axon4d.comm.log import CommLog, CommRecord
from axon4d.layout.geometry import Op


def test_union_length_counts_overlaps_once():
    assert commlog.union_length([]) == 0
    assert commlog.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert commlog.union_length([(2, 3), (0, 10)]) == 10


def test_report_from_a_log():
    log = CommLog()
    # two collectives at once, 0–4 s and 2–6 s; blocked 5–6 s on the second
    log.add(CommRecord(Op.ALL_REDUCE, "x", 2, 1024, "a", t_issue=0.0, t_wait_start=4.0, t_wait_end=4.0, t_done=4.0))
    log.add(CommRecord(Op.ALL_GATHER, "z", 2, 2048, "b", t_issue=2.0, t_wait_start=5.0, t_wait_end=6.5, t_done=6.0))
    log.add_span("fwd.matmul", 0.0, 5.0)
    rep = stepstats.report(log, step=3, rank=1, wall_s=6.5)
    assert rep.bytes_by_axis == {"x": 1024, "z": 2048} and rep.collectives == 2
    assert rep.comm_s == 6.0 and rep.blocked_s == 1.0 and rep.compute_s == 5.0
    assert abs(rep.hidden_pct - 100 * 5 / 6) < 1e-9
    d = rep.as_dict()
    assert d["hidden_pct"] == rep.hidden_pct and d["step"] == 3 and json.dumps(d)
    assert rep.line().startswith(
        "step 3 | 6500.0 ms | x=0.00MiB z=0.00MiB | comm 6000.0 ms, blocked 1000.0 ms, hidden 83%"
    )


def _traced_step(grid, directory):
    torch.manual_seed(0)
    layers = [axon4d.Linear(16, 32), axon4d.Linear(32, 16, transpose=True)]
    x = axon4d.shard_input(torch.randn(8, 16)).requires_grad_()
    with stepstats.step(grid, 1) as rep:
        layers[1](layers[0](x)).sum().backward()
    path = trace.dump(grid, directory, label="test")
    return rep.as_dict(), path


def test_dump_of_a_real_step_gives_a_chrome_trace_and_a_png(pools, tmp_path):
    results = pools(4).run((2, 1, 2, 1), _traced_step, str(tmp_path / "run"))
    for rep, path in results:
        assert os.path.exists(path) and rep["collectives"] > 0 and rep["comm_s"] > 0
        assert set(rep["bytes_by_axis"]) == {"x", "z", "batch"}
    dumps = trace.load(str(tmp_path / "run"))
    assert [d["rank"] for d in dumps] == [0, 1, 2, 3]
    assert all(d["spans"] and d["records"] for d in dumps)
    doc = trace.chrome_trace([("run", dumps)])
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert (0, "compute") in names and (0, "comm x") in names and (3, "comm z") in names
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in complete} >= {"compute", "comm"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    # the CLI module writes both files
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    args = parser.parse_args([str(tmp_path / "run"), "--json", str(out_json), "--png", str(out_png), "--ranks", "0,3"])
    assert trace.main(args) == 0
    assert json.loads(out_json.read_text())["traceEvents"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wire_intervals_serialise_collectives_on_one_axis():
    recs = [
        {"axis": "x", "issue": 0.0, "done": 2.0},
        {"axis": "x", "issue": 0.5, "done": 3.0},
        {"axis": "z", "issue": 1.0, "done": 1.5},
    ]
    spans = [(r["axis"], a, b) for r, a, b in trace.wire_intervals(recs)]
    assert spans == [("x", 0.0, 2.0), ("x", 2.0, 3.0), ("z", 1.0, 1.5)]


def _rank_on_its_own_clock(rank: int, perf_zero_s: float, wall_s: float, directory: str) -> str:
    """Dump rank ``rank`` of a process whose perf_counter reads wall-clock time − ``perf_zero_s``:
    an all-reduce issued at wall time ``wall_s`` and done 2 ms later, a span before it, written
    1 s after; each rank's t0 its own first event."""
    log = CommLog()
    issue = wall_s - perf_zero_s
    log.add(CommRecord(Op.ALL_REDUCE, "x", 2, 64, "a", issue, t_wait_start=issue + 0.001, t_wait_end=issue + 0.002))
    log.add_span("fwd", issue - 0.005 * (rank + 1), issue)
    comm = types.SimpleNamespace(log=log, transport_name="torch")
    coords = {"x": rank, "y": 0, "z": 0, "data": 0}
    grid = types.SimpleNamespace(comm=comm, rank=rank, coords=coords, shape="(2, 1, 1, 1)")
    written = wall_s + 1.0
    return trace.dump(grid, directory, now=lambda: (round(written * 1e9), written - perf_zero_s))


def test_dumps_of_processes_with_different_clocks_line_up_on_the_wall_clock(tmp_path):
    wall = 1.7e9  # an all-reduce both ranks issued at the same wall-clock instant
    _rank_on_its_own_clock(0, perf_zero_s=wall - 1234.5, wall_s=wall, directory=str(tmp_path))
    _rank_on_its_own_clock(1, perf_zero_s=wall - 7.25, wall_s=wall, directory=str(tmp_path))
    dumps = trace.load(str(tmp_path))
    issues = [d["records"][0]["issue"] for d in dumps]
    assert abs(issues[0] - issues[1]) < 1e-6, issues
    assert abs(issues[0] - 0.010) < 1e-6  # rank 1's span began 10 ms before, the earliest event
    assert [round(d["spans"][0][1], 6) for d in dumps] == [0.005, 0.0]
    assert dumps[0]["epoch_ns"] == dumps[1]["epoch_ns"]
    assert abs(dumps[0]["epoch_ns"] - (wall - 0.010) * 1e9) < 1e3  # the earliest event's wall time
    events = [e for e in trace.chrome_trace([("run", dumps)])["traceEvents"] if e.get("cat") == "comm"]
    assert abs(events[0]["ts"] - events[1]["ts"]) < 1.0  # µs
