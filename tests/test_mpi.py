"""Protects the MPI backend (axon4d/mpi.py MPIBackend): the same correctness tests as the gloo
backend — collectives, byte log against axon4d.geometry, Linear against torch.nn.Linear on every grid
of 8 ranks, overlap on = overlap off — run under ``mpiexec -n 8`` with every collective going
through mpi4py's non-blocking collectives (tests/mpi_check.py), and ``axon4d.init`` picks MPI by
itself when launched by mpiexec."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def _mpiexec():
    found = os.path.join(BIN, "mpiexec")
    return found if os.path.exists(found) else shutil.which("mpiexec")


pytestmark = [
    pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec: install the [mpi] extra (make test does)"),
    pytest.mark.timeout(1500),  # one mpiexec job runs every check: ~1.5 min alone, far longer on a loaded machine
]


def _run(args, timeout=1400, **env):
    environ = dict(os.environ, OMP_NUM_THREADS="1", **env)
    environ.pop("MASTER_ADDR", None)
    proc = subprocess.run(
        [_mpiexec(), "-n", "8", sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=environ
    )
    return proc


@pytest.fixture(scope="module")
def checks():
    pytest.importorskip("mpi4py")
    proc = _run([os.path.join(HERE, "mpi_check.py")])
    lines = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("MPICHECK")]
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {name: rest for _, name, rest in lines}, proc.stdout + proc.stderr


def test_every_check_ran_and_passed_under_mpiexec(checks):
    results, output = checks
    from mpi_check import TESTS

    assert sorted(results) == sorted(name for name, _, _ in TESTS), output[-3000:]
    failed = {name: r for name, r in results.items() if r != "ok"}
    assert not failed, f"{failed}\n{output[-3000:]}"


AUTO = r"""
import os, torch, axon4d
g = axon4d.init(grid=(2, 2, 2, 1))
t = torch.full((4,), float(g.rank))
s = g.comm.all_reduce(t, "x").wait()
os.write(1, f"AUTO {g.comm.backend_name} {g.launcher} {s.tolist()}\n".encode())  # one write: ranks share stdout
axon4d.shutdown()
"""


def test_init_chooses_mpi_under_mpiexec_and_torch_when_asked():
    pytest.importorskip("mpi4py")
    for env, expect in [({}, "mpi"), ({"AXON4D_COMM": "torch"}, "torch")]:
        proc = _run(["-c", AUTO], timeout=240, **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [line.split(" ", 3) for line in proc.stdout.splitlines() if line.startswith("AUTO")]
        assert len(lines) == 8 and {line[1] for line in lines} == {expect} and {line[2] for line in lines} == {"mpi"}
        # x pairs are (2k, 2k+1): their sum is 4k+1
        assert sorted({line[3] for line in lines}) == sorted({str([4.0 * k + 1] * 4) for k in range(4)})
