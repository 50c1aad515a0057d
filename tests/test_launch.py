"""Protects how a job starts: axon4d.init() under torchrun, under mpiexec (rank and size from
mpi4py, rendezvous published by rank 0) and as a plain python process, with clean shutdown —
and a second grid built after ``shutdown()`` in the same job."""

import os
import shutil
import subprocess
import sys

import pytest

from axon4d.launch import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launch_check.py")
BIN = os.path.dirname(sys.executable)


def _run(cmd, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return [line for line in proc.stdout.splitlines() if line.startswith("LAUNCH")]


def _errors_ok(lines):
    return all(float(line.rsplit("err=", 1)[1]) < 1e-5 for line in lines)


def test_plain_python_is_a_world_of_one():
    lines = _run([sys.executable, SCRIPT, "1,1,1,1;1,1,1,1"])
    assert len(lines) == 2 and all("LAUNCH single world=1" in line for line in lines) and _errors_ok(lines)


def test_torchrun():
    torchrun = os.path.join(BIN, "torchrun")
    lines = _run([torchrun, "--nproc-per-node", "4", "--master-port", str(free_port()), SCRIPT, "2,1,2,1;1,1,2,2"])
    assert len(lines) == 8 and all("world=4" in line for line in lines) and _errors_ok(lines)
    assert sum("Grid(x=1, y=1, z=2, data=2)" in line for line in lines) == 4  # the second grid, after shutdown
    assert {line.split()[1] for line in lines} == {"torchrun"}


def _mpiexec():
    found = os.path.join(BIN, "mpiexec")
    return found if os.path.exists(found) else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec: install the [mpi] extra (make test does)")
def test_mpiexec():
    pytest.importorskip("mpi4py")
    lines = _run([_mpiexec(), "-n", "4", sys.executable, SCRIPT, "1,2,1,2;4,1,1,1"])
    assert len(lines) == 8 and all("world=4" in line for line in lines) and _errors_ok(lines)
    assert {line.split()[1] for line in lines} == {"mpi"}
    assert sum("rank 0 at" in line for line in lines) == 2


_FAULTS = """
import os, resource
import axon4d, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    x = torch.empty(64 << 20, dtype=torch.uint8); x.fill_(1); del x  # 64 MiB made and freed, as a step does
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_value):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    setting, faults = out.stdout.split()
    return setting, int(faults)


def test_importing_axon4d_puts_host_tensors_in_huge_pages_unless_told_not_to():
    """Host memory freed by one step and made again by the next is touched afresh every step
    (axon4d.device.use_huge_pages): in 4 KiB pages 512 MiB is 131072 page faults."""
    default, faults = _faults(None)
    off, faults_off = _faults("0")
    assert (default, off) == ("1", "0")  # the user's own setting is kept
    assert faults_off > 100_000
    policy = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(policy) and "[never]" not in open(policy).read():  # where the kernel gives huge pages
        assert faults < faults_off / 10
