"""Protects ``make gpu-check`` (bench/gpu_check.py), which runs only where a GPU is: without CUDA it
refuses with a clear message and exit 1; on the host (``--on-host``) its cases run the same code on
CPU tensors and pass, its JSON and closing line are written; a case that errs on a rank or misses its
tolerance is reported failed (exit 1) instead of hanging or passing. The GPU itself is never needed."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import gpu_check  # noqa: E402  (bench/ is not a package)


def _saved(out):
    """The JSON gpu_check wrote, and each case's status by name."""
    saved = json.loads(out.read_text())
    return saved, {c["name"]: c["status"] for c in saved["cases"]}


def _run(*args):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_without_cuda_it_says_so_and_fails():
    proc = _run()
    assert proc.returncode == 1
    assert "gpu-check: no CUDA device here" in proc.stderr and "--on-host" in proc.stderr


@pytest.mark.slow
def test_on_the_host_the_cases_run_and_the_result_is_saved(tmp_path):
    out = tmp_path / "gpu_check.json"
    only = "exact llama x1y1z2d1 overlap-on,checkpoint,sync"
    proc = _run("--on-host", "--only", only, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-check: host: 2 passed, 0 failed, 1 skipped (")
    saved, status = _saved(out)
    assert status == {
        "exact llama x1y1z2d1 overlap-on": "passed",
        "checkpoint z2 -> y2": "passed",
        "sync training step x1y1z1d1": "skipped",
    }
    exact = next(c for c in saved["cases"] if c["name"].startswith("exact"))
    assert len(exact["metrics"]) == 2 and all(m["grad_rel"] <= gpu_check.FP32_TOL for m in exact["metrics"])
    assert all(m["collectives"] > 0 for m in exact["metrics"])  # the distributed code ran, not a short cut
    assert saved["device"] == "host" and saved["counts"] == {"passed": 2, "failed": 0, "skipped": 1}


def _raises_on_rank_one(grid):
    if grid.rank == 1:
        raise RuntimeError("broken on purpose")
    grid.comm.barrier()  # rank 0 would wait here for ever
    return {"grad_rel": 0.0, "loss_rel": 0.0}


@pytest.mark.slow
def test_a_case_that_errs_on_a_rank_fails_and_does_not_hang():
    case = gpu_check.Case("broken", 2, (1, 2, 1, 1), _raises_on_rank_one, verdict=gpu_check._exact(1e-4))
    record = gpu_check.run_case(case, "staged", timeout=60)
    assert record["status"] == "failed" and "rank 1" in record["why"]


@pytest.mark.parametrize(
    "metrics,passes",
    [
        ({"grad_rel": 2e-5, "loss_rel": 0.0}, True),
        ({"grad_rel": 0.9, "loss_rel": 0.0}, False),
        ({"grad_rel": 0.0, "loss_rel": 1e-3}, False),
    ],
)
def test_a_case_past_its_tolerance_fails(metrics, passes):
    assert (gpu_check._exact(gpu_check.FP32_TOL)([metrics, metrics]) is None) == passes


@pytest.mark.slow
def test_the_offload_cases_run_on_the_host_and_record_time_and_memory(tmp_path):
    """The offload cases (exactness against no offload on (1,2,2,1) with and without context
    parallelism; step time and peak memory with and without on one rank) pass on the host and
    write what a GPU run reports: bitwise equality there, bytes moved, both step times and peaks."""
    out = tmp_path / "gpu_check.json"
    proc = _run("--on-host", "--only", "offload", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved, status = _saved(out)
    assert status == {
        "offload exact x1y2z2d1": "passed",
        "offload exact x1y2z2d1 context": "passed",
        "offload speed x1y1z1d1": "passed",
        "offload speed wide x1y1z1d1": "passed",
    }
    for case in saved["cases"][:2]:
        assert len(case["metrics"]) == 4
        assert all(m["bitwise"] and m["copies_out"] > 0 and m["late_fetches"] == 0 for m in case["metrics"])
    speed = saved["cases"][2]["metrics"][0]
    assert speed["plain"]["step_s"] > 0 and speed["offloaded"]["step_s"] > 0 and speed["step_ratio"] > 0
    assert speed["plain"]["peak_bytes"] is None  # the host keeps no allocator peak; a GPU's is compared
    assert speed["offloaded"]["offloaded_bytes"] > 0 and sorted(speed["offloaded"]["block_bytes"]) == ["0", "1"]
    link = speed["host_link"]
    assert link["device_to_host_Bps"] > 0 and link["host_to_device_Bps"] > 0
    assert link["bytes"] == max(speed["offloaded"]["block_bytes"].values())  # a block's copy


@pytest.mark.slow
def test_the_fp8_and_zero_cases_run_side_by_side_on_the_host(tmp_path):
    """--jobs 2: the FP8-gather and ZeRO cases pass on the host, each recording what it compared,
    and the JSON holds every case once (rewritten after each)."""
    out = tmp_path / "gpu_check.json"
    proc = _run("--on-host", "--only", "fp8,zero", "--jobs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved, status = _saved(out)
    zero = ["zero 1 and 2 x1y1z1d2", "zero 1 and 2 x1y2z1d2", "zero bf16 x1y1z1d2"]
    assert status == dict.fromkeys(["fp8 gather x1y1z2d1", "fp8 gather x1y2z2d1", *zero], "passed")
    for case in saved["cases"]:
        for m in case["metrics"]:
            if case["name"].startswith("fp8"):
                assert 0 < m["grad_fro"] < 2.0**-4 and 0 < m["e10_bytes"] < m["e10_bytes_bf16"]
            else:
                assert 0 <= m["zero1_rel"] <= 1e-5 and 0 <= m["zero2_rel"] <= 1e-5
                # in bf16 ZeRO stores the Linear weights in bf16 (sharded fp32 masters), in fp32 not
                stored = ["torch.bfloat16" if "bf16" in case["name"] else "torch.float32"]
                assert m["zero1_linear_dtypes"] == m["zero2_linear_dtypes"] == stored
    assert saved["tracked_files_changed"] in (True, False)


@pytest.mark.parametrize(
    "plain_peak,offload_peak,moved,late,passes",
    [(100, 60, 40, 0, True), (100, 100, 40, 0, False), (100, 60, 0, 0, False), (100, 60, 40, 2, False)],
)
def test_the_offload_speed_case_fails_when_nothing_moved_or_the_peak_did_not_fall(
    plain_peak, offload_peak, moved, late, passes
):
    metrics = {
        "plain": {"step_s": 1.0, "peak_bytes": plain_peak},
        "offloaded": {"step_s": 1.2, "peak_bytes": offload_peak, "offloaded_bytes": moved, "late_fetches": late},
    }
    assert (gpu_check._offload_saves([metrics]) is None) == passes
