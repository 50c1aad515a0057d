"""Bounded failure of the training job (axon4d.watchdog, docs/reliability.md): one rank raises in
the forward, the backward or a checkpoint save, is SIGKILLed or SIGSTOPped, under a plain
multi-process launch, torchrun and mpiexec. The job must end within its deadline, the failing
rank's own error must be printed, and the ranks that were still running must name it.

Each case runs ``tests/fault_check.py`` (the real ``axon4d train`` with a fault planted from
outside the library) on 2 ranks with a tiny model.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from axon4d.launch import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_check.py")
BIN = os.path.dirname(sys.executable)
WORLD = 2
TIMEOUT = 8  # --timeout: seconds a rank may wait in a collective after the first step
#: a fault-free run of these flags takes ~15 s here; a faulty one must end within this
BOUND_S = 90


def _flags(out_dir) -> list[str]:
    return [
        "--model",
        "tiny",
        "--steps",
        "8",
        "--batch-size",
        "4",
        "--grid",
        "1,2,1,1",
        "--save-every",
        "2",
        "--timeout",
        str(TIMEOUT),
        "--startup-timeout",
        "120",
        "--no-progress",
        "--peak-tflops",
        "1",
        "--out-dir",
        str(out_dir),
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return env


def _plain(fault: str, rank: int, step: int, out_dir) -> tuple[list[int], list[str], float]:
    """Start WORLD processes by hand (RANK/WORLD_SIZE/MASTER_* set, no agent); wait for them all
    (SIGKILLing one that stopped itself once the others are gone); (exit codes, outputs, seconds)."""
    port = str(free_port())
    procs = []
    start = time.monotonic()
    for r in range(WORLD):
        env = dict(
            _env(), RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        cmd = [sys.executable, SCRIPT, fault, str(rank), str(step), *_flags(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    others = [p for r, p in enumerate(procs) if r != rank]
    try:
        for p in others:
            p.wait(timeout=BOUND_S)
        elapsed = time.monotonic() - start
        if fault == "stop":  # a stopped process stays stopped: nothing but a signal ends it
            procs[rank].send_signal(signal.SIGKILL)
        procs[rank].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], [p.stdout.read() for p in procs], elapsed


@pytest.mark.parametrize("fault", ["forward", "backward", "save"])
def test_an_error_on_one_rank_ends_the_job_and_is_named(tmp_path, fault):
    codes, outs, elapsed = _plain(fault, 1, 3, tmp_path)
    assert elapsed < BOUND_S
    assert all(c != 0 for c in codes), codes
    assert "PlantedError: planted" in outs[1], outs[1]  # the original error, printed, not lost
    assert "axon4d: rank 1 failed" in outs[1]
    assert "rank 1 failed with PlantedError" in outs[0], outs[0]  # the survivor names the rank and the error
    if fault == "save":  # the checkpoint of step 2 was never published
        assert not os.path.exists(tmp_path / "checkpoints" / "step_2" / "meta.json")


def test_a_killed_rank_ends_the_job_and_is_named(tmp_path):
    codes, outs, elapsed = _plain("kill", 1, 3, tmp_path)
    assert elapsed < BOUND_S
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    assert "rank(s) 1 stopped answering" in outs[0], outs[0]


def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    codes, outs, elapsed = _plain("stop", 1, 3, tmp_path)
    assert elapsed < BOUND_S
    assert codes[0] == 4, (codes, outs[0])  # watchdog.EXIT_TIMEOUT
    assert f"(deadline {TIMEOUT} s after the first step)" in outs[0], outs[0]
    assert "rank(s) 1 stopped answering" in outs[0], outs[0]
    assert "waited" in outs[0] and " over " in outs[0]  # which collective, on which axis


def test_under_torchrun_an_error_ends_the_job(tmp_path):
    torchrun = os.path.join(BIN, "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(WORLD), "--master-port", str(free_port()), SCRIPT, "forward", "1", "3"]
    start = time.monotonic()
    proc = subprocess.run(cmd + _flags(tmp_path), env=_env(), capture_output=True, text=True, timeout=BOUND_S + 30)
    assert time.monotonic() - start < BOUND_S
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "PlantedError: planted forward failure" in out and "axon4d: rank 1 failed" in out, out
    assert "rank 1 failed with PlantedError" in out, out  # printed by rank 0 before the agent stopped it


def _mpiexec():
    found = os.path.join(BIN, "mpiexec")
    return found if os.path.exists(found) else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec: install the [mpi] extra (make test does)")
@pytest.mark.parametrize("fault", ["forward", "stop"])
def test_under_mpiexec_a_failing_or_hung_rank_ends_the_job(tmp_path, fault):
    pytest.importorskip("mpi4py")
    cmd = [_mpiexec(), "-n", str(WORLD), sys.executable, SCRIPT, fault, "1", "3", *_flags(tmp_path)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - start < BOUND_S
    assert proc.returncode != 0
    if fault == "forward":  # MPI_Abort after the error was printed and announced
        assert "PlantedError: planted forward failure" in out and "rank 1 failed with PlantedError" in out, out
    else:  # the MPI transport's waits poll: the watchdog's deadline ends them
        assert f"(deadline {TIMEOUT} s after the first step)" in out and "rank(s) 1 stopped answering" in out, out
