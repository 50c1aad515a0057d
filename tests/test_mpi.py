"""Protects the MPI transport (axon4d/comm/mpi.py MPITransport): the same correctness tests as the gloo
backend — collectives, byte log against axon4d.layout.geometry, Linear against torch.nn.Linear on every grid
of 8 ranks, overlap on = overlap off — run under ``mpiexec -n 8`` with every collective going
through mpi4py's non-blocking collectives (tests/mpi_check.py); and, launched by mpiexec,
``axon4d.init(comm="auto")`` times both transports and every rank takes the faster, while
``AXON4D_COMM`` chooses without a probe. Every test but the bench's reads one ``mpiexec -n 8`` job (``JOB``):
eight ranks start once."""

import json
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
    pytest.mark.slow,  # mpiexec -n 8 jobs
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


def test_every_check_ran_and_passed_under_mpiexec(checks):
    results, output = checks
    from mpi_check import TESTS

    assert sorted(results) == sorted(name for name, _, _ in TESTS), output[-3000:]
    failed = {name: r for name, r in results.items() if r != "ok"}
    assert not failed, f"{failed}\n{output[-3000:]}"


AUTO = r"""
import json, os, torch, axon4d
lines = {}
# launched with AXON4D_COMM=torch: that, then "mpi", chooses without a probe; unset, init probes
for phase in ("torch", "mpi", "auto"):
    if phase == "auto":
        del os.environ["AXON4D_COMM"]
    else:
        os.environ["AXON4D_COMM"] = phase
    g = axon4d.init(grid=(2, 2, 2, 1))
    t = torch.full((4,), float(g.rank))
    s = g.comm.all_reduce(t, "x").wait()
    c = g.comm.transport_choice
    line = {"backend": g.comm.transport_name, "launcher": g.launcher, "sum": s.tolist(), "name": c.name,
            "why": c.why, "seconds": c.seconds, "cost_s": c.cost_s}
    axon4d.shutdown()
    again = axon4d.init(grid=(1, 1, 2, 4))  # a second grid in the same job: the probe is not run again
    line["again"] = again.comm.transport_choice == c and again.comm.transport_name == c.name
    axon4d.shutdown()
    lines[phase] = line
os.write(1, ("AUTO " + json.dumps(lines) + "\n").encode())  # one write: ranks share stdout
"""


#: the one mpiexec job of this file: AUTO (its first ``init`` creates the world), then
#: tests/mpi_check.py's checks on that world
JOB = (
    AUTO
    + f"""
import sys
sys.path.insert(0, {HERE!r})
import mpi_check
mpi_check.main()
"""
)


@pytest.fixture(scope="module")
def job():
    """JOB under ``mpiexec -n 8``, launched with ``AXON4D_COMM=torch``; its output."""
    pytest.importorskip("mpi4py")
    proc = _run(["-c", JOB], AXON4D_COMM="torch")
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def checks(job):
    """mpi_check.py's verdict by check name, and the job's output."""
    stdout, output = job
    lines = [line.split(" ", 2) for line in stdout.splitlines() if line.startswith("MPICHECK")]
    return {name: rest for _, name, rest in lines}, output


@pytest.fixture(scope="module")
def auto(job):
    """AUTO's lines, every rank's per phase: "torch" and "mpi" (``AXON4D_COMM`` set), "auto"
    (unset: ``comm="auto"`` probes)."""
    stdout, output = job
    ranks = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("AUTO ")]
    assert len(ranks) == 8, output[-3000:]
    phases = {phase: [r[phase] for r in ranks] for phase in ("torch", "mpi", "auto")}
    for lines in phases.values():
        for line in lines:
            assert line["launcher"] == "mpi" and line["backend"] == line["name"] and line["again"]
        # x pairs are (2k, 2k+1): their sum is 4k+1, whichever transport moved it
        assert sorted({str(line["sum"]) for line in lines}) == sorted({str([4.0 * k + 1] * 4) for k in range(4)})
    return phases


def test_init_under_mpiexec_probes_both_transports_and_takes_the_faster_on_every_rank(auto):
    lines = auto["auto"]
    first = lines[0]
    assert set(first["seconds"]) == {"mpi", "torch"} and all(s > 0 for s in first["seconds"].values())
    # one verdict from one set of figures on every rank, and it is the faster transport by them
    assert all(
        (line["name"], line["seconds"], line["why"]) == (first["name"], first["seconds"], first["why"])
        for line in lines
    )
    assert first["name"] == min(("mpi", "torch"), key=lambda n: first["seconds"][n])
    assert first["why"] == "probe over 8 ranks"
    print(f"probe: {first['seconds']}, cost per rank {max(line['cost_s'] for line in lines):.2f} s")


@pytest.mark.parametrize("forced", ["torch", "mpi"])
def test_axon4d_comm_chooses_the_transport_under_mpiexec_without_a_probe(auto, forced):
    for line in auto[forced]:
        assert (line["name"], line["why"]) == (forced, f"AXON4D_COMM={forced}")
        assert line["seconds"] is None and line["cost_s"] is None


def test_the_transport_bench_records_the_choice_and_both_steps(tmp_path):
    # bench/transport.py: the auto job's choice, probe figures and cost, and a step under each
    # transport; the headline names the choice and whether it stepped faster (issue 18, item 5)
    pytest.importorskip("mpi4py")
    out = tmp_path / "transport.json"
    root = os.path.dirname(HERE)
    bench = os.path.join(root, "bench", "transport.py")
    args = ["--ranks", "2", "--hidden", "64", "--seq", "8", "--steps", "1", "--results", str(out)]
    proc = subprocess.run([sys.executable, bench, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (record,) = json.loads(out.read_text())["records"]
    jobs = record["jobs"]
    assert jobs["torch"]["transport"] == "torch" and jobs["mpi"]["transport"] == "mpi"
    auto = jobs["auto"]
    assert auto["transport"] == min(auto["probe_s"], key=auto["probe_s"].get) and auto["probe_cost_s"] > 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"transport: ranks = 2, chosen = {auto['transport']}, probe cost = ")
