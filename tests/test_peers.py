"""Protects bench/peers.py (issue 18), the side-by-side comparison with DTensor, FSDP2, DDP and one
process: at tiny sizes every implementation passes its check against the single-process module,
the rounds and the paired steps of axon4d against the best peer are recorded, and the last lines
are the headline in the issue's form."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_the_peers_bench_checks_times_and_pairs_every_implementation(tmp_path):
    out = tmp_path / "peers.json"
    bench = os.path.join(os.path.dirname(HERE), "bench", "peers.py")
    args = ["--quick", "--ranks", "2", "--workloads", "mlp", "--results", str(out)]
    proc = subprocess.run([sys.executable, bench, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())["records"]
    assert set(rec["check_max_rel_err"]) == {"axon4d", "dtensor", "fsdp2", "ddp"}
    assert all(e <= 1e-4 for e in rec["check_max_rel_err"].values()), rec["check_max_rel_err"]
    assert set(rec["median_s"]) == {"axon4d", "dtensor", "fsdp2", "ddp", "dense"}
    pair = rec["paired"]
    best = min(("dtensor", "fsdp2", "ddp"), key=rec["median_s"].get)
    assert pair["against"] == best, (pair, rec["median_s"])
    a, b = pair["steps_s"]["axon4d"], pair["steps_s"][best]
    assert len(a) == len(b) == 2 and pair["ratios"] == [x / y for x, y in zip(a, b)]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith(f"paired: ranks = 2, link = loopback, workload = mlp, axon4d / {best} = ")
    assert lines[-1].startswith("peers: ranks = 2, link = loopback, workload = mlp, axon4d = ")
    assert ", dtensor = " in lines[-1] and ", fsdp2 = " in lines[-1] and ", ddp = " in lines[-1]
