"""Protects how a job starts: axon4d.init() under torchrun, under mpiexec (rank and size from
mpi4py, rendezvous published by rank 0), under srun (processes started with the environment srun
gives its tasks) and as a plain python process, with clean shutdown — and a second grid built after
``shutdown()`` in the same job; a process whose environment names a larger world refuses to run
alone. The environment rules themselves: tests/test_launch_env.py."""

import os
import random
import shutil
import socket
import subprocess
import sys

import pytest

from axon4d.grid.launch import free_port, slurm_port

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


@pytest.mark.slow
def test_plain_python_is_a_world_of_one():
    lines = _run([sys.executable, SCRIPT, "1,1,1,1;1,1,1,1"])
    assert len(lines) == 2 and all("LAUNCH single world=1" in line for line in lines) and _errors_ok(lines)


@pytest.mark.slow
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
@pytest.mark.slow
def test_mpiexec():
    pytest.importorskip("mpi4py")
    lines = _run([_mpiexec(), "-n", "4", sys.executable, SCRIPT, "1,2,1,2;4,1,1,1"])
    assert len(lines) == 8 and all("world=4" in line for line in lines) and _errors_ok(lines)
    assert {line.split()[1] for line in lines} == {"mpi"}
    assert sum("rank 0 at" in line for line in lines) == 2


#: launcher variables a test job must not inherit from the shell that runs pytest
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "PMIX_"))}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _slurm_job_id():
    """A job id whose rendezvous port (axon4d.grid.launch.slurm_port) is free on this host now."""
    for _ in range(100):
        job = random.randrange(1, 10**7)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", slurm_port(job)))
            except OSError:
                continue
        return job
    raise AssertionError("no free port in the SLURM range")


def _srun(ntasks, args, nodelist, timeout=240, script=SCRIPT, **extra):
    """Start ``ntasks`` copies of ``script`` (launch_check.py) with ``args`` as ``srun -n ntasks`` on
    one node would: only the environment tells each its place (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID, the step's nodes). The LAUNCH lines of their output."""
    job = _slurm_job_id()
    procs = []
    for task in range(ntasks):
        env = _clean_env(
            SLURM_JOB_ID=str(job),
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(task),
            SLURM_NTASKS=str(ntasks),
            SLURM_LOCALID=str(task),
            SLURM_STEP_NODELIST=nodelist,
            SLURM_JOB_NODELIST=nodelist,
            **extra,
        )
        cmd = [sys.executable, script, *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    for task, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"task {task} exited {p.returncode}:\n{out}\n{err}"
    return [line for out, _ in outs for line in out.splitlines() if line.startswith("LAUNCH")]


@pytest.mark.slow
def test_srun_tasks_form_one_world_from_slurm_variables():
    # the step's first host in compressed form; the port derived from SLURM_JOB_ID
    lines = _srun(4, ["2,1,2,1;1,1,2,2"], "localhost,nid[001-003]")
    assert len(lines) == 8 and all("LAUNCH slurm world=4" in line for line in lines) and _errors_ok(lines)
    assert sum("Grid(x=1, y=1, z=2, data=2)" in line for line in lines) == 4  # the second grid, after shutdown
    assert sorted(int(line.split(" rank ")[1].split()[0]) for line in lines) == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.slow
def test_srun_tasks_meet_at_master_addr_and_port_when_the_script_exports_them():
    # the usual sbatch script: export MASTER_ADDR/MASTER_PORT, then srun — still SLURM's ranks
    lines = _srun(2, ["1,1,2,1"], "nid[007-008]", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert len(lines) == 2 and all("LAUNCH slurm world=2" in line for line in lines) and _errors_ok(lines)


@pytest.mark.slow
def test_a_process_told_the_world_is_larger_refuses_to_run_alone():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "1,1,1,1"], capture_output=True, text=True, timeout=120, env=_clean_env(WORLD_SIZE="4")
    )
    assert proc.returncode != 0 and "LAUNCH" not in proc.stdout
    assert "WORLD_SIZE=4" in proc.stderr and "MASTER_ADDR" in proc.stderr and "torchrun" in proc.stderr


def _rank_pid_then_wait(grid, pid_dir, fail_rank):
    """Write this rank's pid, then (``fail_rank``) end one rank as if killed, or wait forever."""
    import time

    path = os.path.join(pid_dir, str(grid.rank))
    with open(path + ".partial", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".partial", path)  # whole or absent: the test reads it as soon as it appears
    if grid.rank == fail_rank:
        os._exit(9)
    while True:
        time.sleep(1)


_SPAWNER = """
import sys
sys.path.insert(0, {root!r})
from axon4d.measure.spawn import run_local
from tests.test_launch import _rank_pid_then_wait
run_local(2, _rank_pid_then_wait, {pid_dir!r}, -1)
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, only not yet reaped
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.slow
def test_local_ranks_end_with_the_process_that_spawned_them(tmp_path):
    """axon4d.measure.spawn: killing the spawner leaves no rank (nor the fork server they came from)
    behind; a rank that dies is reported."""
    import signal
    import time

    from axon4d.measure.spawn import run_local

    root = os.path.dirname(HERE)
    spawner = subprocess.Popen([sys.executable, "-c", _SPAWNER.format(root=root, pid_dir=str(tmp_path))])
    written = lambda: [name for name in os.listdir(tmp_path) if name.isdigit()]  # noqa: E731
    deadline = time.monotonic() + 120
    while len(written()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int((tmp_path / name).read_text()) for name in written()]
    assert len(pids) == 2
    # the ranks' parent: the spawner, or the fork server it forks them from, which must end with it too
    parents = {int(open(f"/proc/{p}/stat").read().split(") ")[1].split()[1]) for p in pids} - {spawner.pid}
    pids += sorted(parents)
    spawner.send_signal(signal.SIGKILL)
    spawner.wait()
    deadline = time.monotonic() + 120  # a rank notices within half a second; a loaded host may take longer
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    (tmp_path / "again").mkdir()
    with pytest.raises(RuntimeError, match="rank 1 of the local 2-rank world ended with exit code 9"):
        run_local(2, _rank_pid_then_wait, str(tmp_path / "again"), 1)


_FORK_SERVER_IMPORTS = """
import torch

def refuse(*args, **kwargs):
    raise AssertionError("importing the fork server's modules asked torch.cuda")

for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
    setattr(torch.cuda, name, refuse)
import axon4d.measure.spawn as spawn

assert spawn._context().get_start_method() == "forkserver"
"""


def test_the_fork_server_that_forks_local_ranks_touches_no_accelerator():
    """axon4d.measure.spawn: local ranks are forked from a server that imported torch and the
    spawner's module; a process forked after CUDA is initialised cannot use it, so that import must
    never ask torch.cuda anything (each rank initialises its own device, as a spawned one would)."""
    proc = subprocess.run([sys.executable, "-c", _FORK_SERVER_IMPORTS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _say(_, word):
    """On a rank: ``word`` with the rank's pid, once to stdout and once to stderr."""
    print(f"{word} out {os.getpid()}", flush=True)
    print(f"{word} err {os.getpid()}", file=sys.stderr, flush=True)
    return os.getpid()


@pytest.mark.slow
def test_local_ranks_write_where_the_starting_process_writes_now(tmp_path):
    """axon4d.measure.spawn: a rank's stdout and stderr are those of the process that starts its world,
    as they are when it does — not those of the fork server the ranks come from, which keeps the
    streams of whatever started it first (an earlier command, another test's captured output)."""
    from axon4d.measure.spawn import run_local

    run_local(1, _say, "first", grid=None)  # the fork server runs from here on, with today's streams
    out, err = tmp_path / "out", tmp_path / "err"
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            pids = run_local(2, _say, "second", grid=None, every_rank=True)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    assert sorted(out.read_text().split("\n")[:-1]) == sorted(f"second out {p}" for p in pids)
    assert sorted(err.read_text().split("\n")[:-1]) == sorted(f"second err {p}" for p in pids)


class _Ended:
    """A rank process of a local world that has ended with exit code 1."""

    exitcode = 1

    def is_alive(self) -> bool:
        return False


class _Outbox:
    """The world's report queue, holding the traceback a rank sent just before it ended; with
    ``late``, the first read times out as if the report arrived just after it."""

    def __init__(self, late: bool):
        self.reports = [(0, "error", "Traceback (most recent call last):\nValueError: planted")]
        self.late = late

    def get(self, timeout: float):
        import queue

        if self.late or not self.reports:
            self.late = False
            raise queue.Empty
        return self.reports.pop(0)

    def empty(self) -> bool:
        return not self.reports


@pytest.mark.parametrize("late", [False, True], ids=["report-read-first", "end-seen-first"])
def test_a_rank_that_reports_its_error_and_ends_is_named_by_its_traceback(late):
    """axon4d.measure.spawn: a rank sends its traceback, then ends (a failed start-up). Whether the
    spawner reads the report first or first sees the process gone, it raises the traceback."""
    from axon4d.measure.spawn import LocalWorld, RankFailure

    world = object.__new__(LocalWorld)  # its collection of reports alone, on stand-ins for the processes
    world.world, world.procs, world.inboxes, world.outbox = 1, [_Ended()], [], _Outbox(late)
    with pytest.raises(
        RankFailure, match=r"(?s)rank 0 of the local 1-rank world failed:\nTraceback.*ValueError: planted"
    ):
        world._collect("ready", timeout=60)
