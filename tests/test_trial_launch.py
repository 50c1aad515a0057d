"""``axon4d train --grid auto --try N`` (axon4d.train.trial) under the launchers a cluster uses:
``mpiexec -n 8`` (rank and size from mpi4py), with the torch transport and with the MPI one
(``--comm``; the second run priced with the first's correction file, ``--correction``), and
srun's tasks (their environment alone: SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, the step's nodes). Each job runs tests/trial_check.py; every rank reports the same
rows, the tried plans are the planner's top ones in its order, each trial grid and the run's are
built by that launcher on that transport, and the run trains on the fastest measured plan. The
trial itself on a spawned gloo world: tests/test_trial.py."""

import json
import os
import subprocess
import sys

import pytest
from test_launch import _clean_env, _mpiexec, _srun

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "trial_check.py")
WORLD = 8

pytestmark = pytest.mark.slow  # 8-rank jobs, each trying two plans and training on one


def _check(out, comm, launcher):
    """The eight ranks' reports of the --try run under ``comm``: alike, and what --try promises."""
    reports = [json.loads((out / f"{comm}.rank{r}.json").read_text()) for r in range(WORLD)]
    first = reports[0]
    rows = first["trials"]
    assert [r["grid"] for r in rows] == first["top"]  # the planner's fastest fitting plans, in its order
    assert all(r["measured_s"] > 0 and r["error"] is None for r in rows), rows
    (chosen,) = [r for r in rows if r["chosen"]]
    assert chosen["measured_s"] == min(r["measured_s"] for r in rows)
    for rep in reports:  # one verdict on every rank, and one run
        assert rep["trials"] == rows and rep["grid"] == first["grid"] and rep["losses"] == first["losses"]
        # every trial grid, then the run's: the chosen plan, built afresh; all by this launcher on this transport
        assert [b["grid"] for b in rep["built"]] == [*first["top"], chosen["grid"]]
        assert {(b["transport"], b["launcher"]) for b in rep["built"]} == {(comm, launcher)}
    assert [r["predicted_s"] for r in rows] == first["prices"]  # as the planner priced them in the job
    assert len(first["losses"]) == 2
    assert json.loads((out / comm / "trials.json").read_text())["trials"] == rows
    assert (out / comm / "correction.json").exists()


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec: install the [mpi] extra (make test does)")
def test_try_under_mpiexec_with_the_torch_and_the_mpi_transport(tmp_path):
    pytest.importorskip("mpi4py")
    env = _clean_env()
    proc = subprocess.run(
        [_mpiexec(), "-n", str(WORLD), sys.executable, SCRIPT, str(tmp_path), "torch", "mpi"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for comm in ("torch", "mpi"):
        _check(tmp_path, comm, "mpi")
    # the second run priced its plans with the first's correction.json (--correction): by its factors
    corr = json.loads((tmp_path / "torch" / "correction.json").read_text())
    second = json.loads((tmp_path / "mpi.rank0.json").read_text())
    for row, alone in zip(second["trials"], second["uncorrected"]):
        if corr["compute"] == corr["communication"]:
            assert row["predicted_s"] == pytest.approx(corr["compute"] * alone, rel=1e-9)
        else:
            assert row["predicted_s"] != pytest.approx(alone, rel=1e-3)


def test_try_as_srun_tasks(tmp_path):
    _srun(WORLD, [str(tmp_path), "torch"], "localhost", timeout=900, script=SCRIPT)
    _check(tmp_path, "torch", "slurm")
