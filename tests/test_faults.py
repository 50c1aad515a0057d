"""Bounded failure of the training job (axon4d.reliability.watchdog, docs/reliability.md): one rank raises in
the forward, the backward or a checkpoint save, is SIGKILLed or SIGSTOPped, under a plain
multi-process launch, torchrun and mpiexec; or is SIGKILLed while it writes a checkpoint in the
background (--async-save), which leaves the previous checkpoint published and intact. The job must end within its deadline, the failing
rank's own error must be printed, and the ranks that were still running must name it.

Each job case runs ``tests/fault_check.py`` (the real ``axon4d train`` with a fault planted from
outside the library) on 2 ranks with a tiny model (4 for naming the hung rank among several
survivors); the jobs run in the background from the module's first test, two at a time, the
stand-in accelerator's beside them (``jobs``). The in-process cases check the watchdog's parts that a CPU job cannot reach: the
host reads that block under NCCL (loss, gradient norm, device synchronize) end the rank at their
deadline and are named, and torch.distributed's own timeout follows the watchdog's after the
first step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from axon4d import checkpoint
from axon4d import device as devices
from axon4d.files import ckptfiles
from axon4d.grid.launch import free_port
from axon4d.reliability import diagnosis, watchdog
from axon4d.train import loop

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_check.py")
BIN = os.path.dirname(sys.executable)
WORLD = 2
TIMEOUT = 8  # --timeout: seconds a rank may wait in a collective after the first step
#: a faulty job must end within this: a fault-free run of these flags takes ~15 s alone, four ranks
#: on a loaded 2-core host about a minute; that the deadline ended it is checked by its exit code
#: and message, so this only stands between a hang and the suite
BOUND_S = 240


def _flags(out_dir, grid: str = "1,2,1,1") -> list[str]:
    return [
        "--model",
        "tiny",
        "--steps",
        "8",
        "--batch-size",
        "4",
        "--grid",
        grid,
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


def _plain(
    fault: str, rank: int, step: int, out_dir, world: int = WORLD, grid: str = "1,2,1,1", extra: tuple[str, ...] = ()
) -> tuple[list[int], list[str], float]:
    """Start ``world`` processes by hand (RANK/WORLD_SIZE/MASTER_* set, no agent) with the flags
    and ``extra``; wait for them all (SIGKILLing one that stopped itself once the others are gone);
    (exit codes, outputs, seconds)."""
    port = str(free_port())
    procs = []
    start = time.monotonic()
    for r in range(world):
        env = dict(
            _env(), RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        cmd = [sys.executable, SCRIPT, fault, str(rank), str(step), *_flags(out_dir, grid), *extra]
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


def _torchrun(out_dir) -> tuple[int, str, float]:
    """The forward fault under torchrun (2 ranks); (exit code, output, seconds)."""
    torchrun = os.path.join(BIN, "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(WORLD), "--master-port", str(free_port()), SCRIPT, "forward", "1", "3"]
    start = time.monotonic()
    proc = subprocess.run(cmd + _flags(out_dir), env=_env(), capture_output=True, text=True, timeout=BOUND_S + 30)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _mpiexec():
    found = os.path.join(BIN, "mpiexec")
    return found if os.path.exists(found) else shutil.which("mpiexec")


def _under_mpiexec(fault: str, out_dir) -> tuple[int, str, float]:
    """``fault`` on rank 1 at step 3 under ``mpiexec -n 2``; (exit code, output, seconds)."""
    cmd = [_mpiexec(), "-n", str(WORLD), sys.executable, SCRIPT, fault, "1", "3", *_flags(out_dir)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, time.monotonic() - start


def _mpi_runs() -> bool:
    """Whether the mpiexec jobs can run here (mpiexec found, mpi4py importable)."""
    import importlib.util

    return _mpiexec() is not None and importlib.util.find_spec("mpi4py") is not None


#: the fault jobs the tests below read, by name: each a function of its --out-dir
JOBS = {
    **{fault: functools.partial(_plain, fault, 1, 3) for fault in ("forward", "backward", "save", "kill", "stop")},
    "write-kill": functools.partial(_plain, "write-kill", 1, 2, extra=("--async-save",)),  # in step_4's write
    "stop of 4": functools.partial(_plain, "stop", 2, 3, world=4, grid="1,2,1,2"),
    "torchrun": _torchrun,
    **{f"mpiexec {fault}": functools.partial(_under_mpiexec, fault) for fault in ("forward", "stop")},
    "late": lambda out_dir: _late_pair(out_dir),
}
#: jobs whose time is mostly sleep (the stand-in accelerator's steps): run beside the others from the start
BESIDE = {"late"}
#: the job each test reads (a parametrized one: by its fault)
JOB_OF_TEST = {
    "test_a_killed_rank_ends_the_job_and_is_named": "kill",
    "test_a_rank_killed_in_a_background_write_ends_the_job_and_keeps_the_previous_checkpoint": "write-kill",
    "test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named": "stop",
    "test_every_survivor_names_only_the_hung_rank": "stop of 4",
    "test_under_torchrun_an_error_ends_the_job": "torchrun",
    "test_on_the_accelerator_s_path_steps_of_three_times_the_timeout_finish_and_a_rank_stopped_mid_step_is_named": "late",
}


def _job_of(item: pytest.Item) -> str | None:
    name = getattr(item, "originalname", "")
    if name == "test_an_error_on_one_rank_ends_the_job_and_is_named":
        return item.callspec.params["fault"]  # type: ignore[attr-defined]
    if name == "test_under_mpiexec_a_failing_or_hung_rank_ends_the_job":
        return f"mpiexec {item.callspec.params['fault']}" if _mpi_runs() else None  # type: ignore[attr-defined]
    return JOB_OF_TEST.get(name)


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The JOBS of the tests of this module that were selected, run two at a time in the
    background in the tests' order (a job mostly waits: for its ranks' start-up, then for the
    fault and the deadlines), those of BESIDE beside them from the start: name -> future of (the
    job's result, its --out-dir)."""
    wanted = dict.fromkeys(
        name for item in request.session.items if item.module is request.module and (name := _job_of(item))
    )
    dirs = {name: tmp_path_factory.mktemp(name.replace(" ", "-")) for name in wanted}

    def run(name: str) -> tuple[Any, pathlib.Path]:
        return JOBS[name](dirs[name]), dirs[name]

    with (
        concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool,
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as beside,
    ):
        yield {name: (beside if name in BESIDE else pool).submit(run, name) for name in wanted}


@pytest.mark.parametrize("fault", ["forward", "backward", "save"])
@pytest.mark.slow
def test_an_error_on_one_rank_ends_the_job_and_is_named(jobs, fault):
    (codes, outs, elapsed), out_dir = jobs[fault].result()
    assert elapsed < BOUND_S
    assert all(c != 0 for c in codes), codes
    assert "PlantedError: planted" in outs[1], outs[1]  # the original error, printed, not lost
    assert "axon4d: rank 1 failed" in outs[1]
    assert "rank 1 failed with PlantedError" in outs[0], outs[0]  # the survivor names the rank and the error
    if fault == "save":  # the checkpoint of step 2 was never published
        assert not os.path.exists(out_dir / "checkpoints" / "step_2" / "meta.json")


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_is_named(jobs):
    (codes, outs, elapsed), _ = jobs["kill"].result()
    assert elapsed < BOUND_S
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    assert "rank(s) 1 stopped answering" in outs[0], outs[0]


@pytest.mark.slow
def test_a_rank_killed_in_a_background_write_ends_the_job_and_keeps_the_previous_checkpoint(jobs):
    (codes, outs, elapsed), out_dir = jobs["write-kill"].result()
    assert elapsed < BOUND_S
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    assert "rank(s) 1 stopped answering" in outs[0], outs[0]
    ckpts = str(out_dir / "checkpoints")
    assert checkpoint.list_checkpoints(ckpts) == [os.path.join(ckpts, "step_2")], outs[0]
    meta = checkpoint.read_meta(checkpoint.latest(ckpts))
    ckptfiles.verify(os.path.join(ckpts, "step_2"), meta["files"], meta["files"])  # every file as it was saved


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout_and_is_named(jobs):
    (codes, outs, elapsed), _ = jobs["stop"].result()
    assert elapsed < BOUND_S
    assert codes[0] == 4, (codes, outs[0])  # watchdog.EXIT_TIMEOUT
    assert f"(deadline {TIMEOUT} s after the first step)" in outs[0], outs[0]
    assert "rank(s) 1 stopped answering" in outs[0], outs[0]
    assert "waited" in outs[0] and " over " in outs[0]  # which collective, on which axis


@pytest.mark.slow
def test_every_survivor_names_only_the_hung_rank(jobs):
    """4 ranks on a 1,2,1,2 grid; rank 2 stops at step 3. Its partners on y (rank 3) and on data
    (rank 0) block in a collective with it first, rank 1 only once they do: the survivors reach
    their deadlines at different times, and each must name rank 2 alone, not the others that are
    ending on their own deadline at the same time."""
    (codes, outs, elapsed), _ = jobs["stop of 4"].result()
    assert elapsed < BOUND_S
    for r in (0, 1, 3):
        assert codes[r] == 4, (r, codes, outs[r])  # watchdog.EXIT_TIMEOUT
        assert "rank(s) 2 stopped answering" in outs[r], (r, outs[r])


@pytest.mark.slow
def test_under_torchrun_an_error_ends_the_job(jobs):
    (returncode, out, elapsed), _ = jobs["torchrun"].result()
    assert elapsed < BOUND_S
    assert returncode != 0
    assert "PlantedError: planted forward failure" in out and "axon4d: rank 1 failed" in out, out
    assert "rank 1 failed with PlantedError" in out, out  # printed by rank 0 before the agent stopped it


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec: install the [mpi] extra (make test does)")
@pytest.mark.parametrize("fault", ["forward", "stop"])
@pytest.mark.slow
def test_under_mpiexec_a_failing_or_hung_rank_ends_the_job(jobs, fault):
    pytest.importorskip("mpi4py")
    (returncode, out, elapsed), _ = jobs[f"mpiexec {fault}"].result()
    assert elapsed < BOUND_S
    assert returncode != 0
    if fault == "forward":  # MPI_Abort after the error was printed and announced
        assert "PlantedError: planted forward failure" in out and "rank 1 failed with PlantedError" in out, out
    else:  # the MPI transport's waits poll: the watchdog's deadline ends them
        assert f"(deadline {TIMEOUT} s after the first step)" in out and "rank(s) 1 stopped answering" in out, out


# ---- in-process: the watchdog's parts a CPU job cannot reach ------------------------------------


class _Ended:
    """The ``exit`` of a watchdog under test: records the code and releases a blocked read."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.event = threading.Event()

    def __call__(self, code: int) -> None:
        self.code = code
        self.event.set()


class _Clock:
    """The watchdog's ``time`` in these tests: ``monotonic`` moves only when the test moves it or
    the watchdog sleeps (``sleep`` adds to it at once), so no deadline depends on how fast the
    host runs the threads. With ``lockstep`` (a barrier) each thread keeps a time of its own and
    a sleep first waits for the other threads to sleep: watchers of the heartbeats sleep in turn."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lockstep: threading.Barrier | None = None
        self._own = threading.local()

    def monotonic(self) -> float:
        return getattr(self._own, "now", 0.0) if self.lockstep is not None else self.now

    def advance(self, seconds: float) -> None:
        if self.lockstep is not None:
            self._own.now = self.monotonic() + seconds
        else:
            self.now += seconds

    def sleep(self, seconds: float) -> None:
        if self.lockstep is not None:
            self.lockstep.wait(timeout=60)
        self.advance(seconds)


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    """The watchdog's clock, in the test's hands (``_Clock``); the heartbeat thread still beats
    every ``beat_s`` of real time."""
    fake = _Clock()
    monkeypatch.setattr(watchdog, "time", fake)
    return fake


def _dog(world: int = 1, rank: int = 0, store=None, **kwargs) -> tuple[watchdog.Watchdog, _Ended, io.StringIO]:
    ended, out = _Ended(), io.StringIO()
    kwargs = {"timeout_s": 0.3, "beat_s": 0.05, **kwargs}
    store = store if store is not None else dist.HashStore()
    return watchdog.Watchdog(rank, world, store, exit=ended, out=out, **kwargs), ended, out


def _looked(dog: watchdog.Watchdog) -> None:
    """Wait (real time, up to a minute) until ``dog``'s heartbeat thread has beaten twice more: it
    has then checked the wait in progress at least once since this call."""
    beats = lambda: diagnosis.beats(dog._store, dog.world)[dog.rank]  # noqa: E731
    first, deadline = beats(), time.monotonic() + 60
    while beats() < first + 2:
        assert time.monotonic() < deadline, "the heartbeat thread stopped beating"
        time.sleep(0.01)


class _BlockedRead:
    """A device value whose host read blocks (as under NCCL with a hung peer) until the watchdog
    ends the rank: the read moves the watchdog's clock past the deadline, then waits."""

    def __init__(self, ended: _Ended, clock: _Clock):
        self._ended, self._clock = ended, clock

    def _block(self) -> float:
        self._clock.advance(1.0)
        self._ended.event.wait(60)
        return 1.0

    __float__ = _block
    item = _block


def _grid(ended: _Ended, clock: _Clock) -> types.SimpleNamespace:
    handle = types.SimpleNamespace(wait=lambda: _BlockedRead(ended, clock))
    comm = types.SimpleNamespace(all_reduce=lambda *args, **kwargs: handle)
    return types.SimpleNamespace(device=devices.HOST, comm=comm, size=lambda axis: 1)


NAMED = {
    "loss and gradient norm": "the host read of the step's loss and gradient norm",
    "synchronize": "the device synchronize at the end of step 3",
}


@pytest.mark.parametrize("where", sorted(NAMED))
def test_a_host_read_blocked_past_its_deadline_ends_the_rank_and_is_named(monkeypatch, clock, where):
    dog, ended, out = _dog()
    grid = _grid(ended, clock)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: [_BlockedRead(ended, clock)._block()] * t.numel())
    monkeypatch.setattr(devices, "synchronize_compute", lambda device: _BlockedRead(ended, clock)._block())
    reads = {
        "loss and gradient norm": lambda: loop._read_step(torch.ones(1), torch.ones(()), grid),
        "synchronize": lambda: loop._synchronize(grid, 3),
    }
    dog.start()
    dog.steady()
    try:
        reads[where]()
    finally:
        dog.stop()
    assert ended.code == watchdog.EXIT_TIMEOUT, out.getvalue()
    message = out.getvalue()
    assert f"in {NAMED[where]}" in message and "(deadline 0.3 s after the first step)" in message, message


def test_a_wait_inside_one_with_its_own_deadline_keeps_that_deadline(clock):
    dog, ended, out = _dog()
    dog.start()
    dog.steady()
    try:
        with watchdog.waiting("the checkpoint save of step 2", 5.0), watchdog.waiting("all_gather over world"):
            clock.advance(0.8)  # past the steady deadline of 0.3 s, within the save's 5 s
            _looked(dog)
            assert ended.code is None, out.getvalue()
            clock.advance(5.0)  # past the save's own deadline too
            assert ended.event.wait(60), "the save's deadline passed and the watchdog did nothing"
    finally:
        dog.stop()
    assert ended.code == watchdog.EXIT_TIMEOUT
    assert "in all_gather over world (deadline 5 s for this wait)" in out.getvalue(), out.getvalue()


def test_ranks_watching_at_once_do_not_name_each_other(clock):
    """Every rank blocked with a hung one reaches its deadline at about the same time, and its
    heartbeat thread watches the heartbeats: its own must go on meanwhile. The watchers' sleeps
    take turns (``_Clock.lockstep``), so each watches the whole time the other does."""
    store = dist.HashStore()
    dogs = [_dog(3, r, store, beat_s=0.1)[0] for r in range(3)]
    store.add("axon4d/beat/2", 1)  # rank 2 beat once, then stopped
    found: dict[int, list[int] | None] = {}
    clock.lockstep = threading.Barrier(2)
    watchers = [threading.Thread(target=lambda d=d: found.update({d.rank: d.stalled_ranks()})) for d in dogs[:2]]
    for t in watchers:
        t.start()
    for t in watchers:
        t.join()
    assert found == {0: [2], 1: [2]}
    clock.lockstep = None
    diagnosis.say_ending(store, 1, 4)  # rank 1 ended on its own deadline: not hung
    assert dogs[0].stalled_ranks() == [2]


def test_the_groups_timeout_follows_the_deadline_after_the_first_step(monkeypatch):
    calls: list[tuple[float, object]] = []
    monkeypatch.setattr(
        dist.distributed_c10d, "_set_pg_timeout", lambda t, g: calls.append((t.total_seconds(), g)), raising=False
    )
    dog, _, _ = _dog(timeout_s=7.0, beat_s=1.0)
    x, y = object(), object()
    dog.steady([x, y, x])
    steady_s = 7.0 + watchdog.PG_MARGIN_S
    assert calls == [(steady_s, x), (steady_s, y)]
    calls.clear()
    with dog.waiting("the checkpoint save of step 2", 100.0):
        assert calls == [(100.0 + watchdog.PG_MARGIN_S, x), (100.0 + watchdog.PG_MARGIN_S, y)]
        calls.clear()
        with dog.waiting("all_gather over world (tag checkpoint)"):
            assert calls == []  # the save's lifted timeout holds for the waits inside it
    assert calls == [(steady_s, x), (steady_s, y)]  # back to the steady timeout
    calls.clear()
    with dog.waiting("all_reduce over y"), dog.waiting("a short save", 1.0):
        assert calls == []  # no wait without a longer deadline of its own changes it


def test_without_the_setter_the_timeout_stays_and_rank_0_says_so(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout", raising=False)
    dog, _, out = _dog(timeout_s=7.0)
    dog.steady([object()])
    with dog.waiting("the checkpoint save of step 2", 100.0):
        pass
    assert out.getvalue().count("has no torch.distributed.distributed_c10d._set_pg_timeout") == 1, out.getvalue()


def _group_timeouts(grid) -> list[float]:
    """The timeout of the default group and of every group of ``grid``, read back from their gloo backends."""
    groups = [dist.group.WORLD, *grid.groups.values()]
    return [g._get_backend(devices.HOST).options._timeout.total_seconds() for g in groups]


def _steady_on(grid) -> list[list[float]]:
    """The groups' timeouts at start-up, after steady(), inside a save, after it, after stop()."""
    default = dist.group.WORLD._get_backend(devices.HOST).options  # the pool's: restored afterwards
    before = default._timeout
    try:
        dog = watchdog.Watchdog(grid.rank, grid.world_size, watchdog.default_store(), timeout_s=7.0, out=io.StringIO())
        seen = [_group_timeouts(grid)]
        dog.steady(grid.groups.values())
        seen.append(_group_timeouts(grid))
        with dog.waiting("the checkpoint save", 100.0):
            seen.append(_group_timeouts(grid))
        seen.append(_group_timeouts(grid))
        dog.stop()
        return [*seen, _group_timeouts(grid)]
    finally:
        dist.distributed_c10d._set_pg_timeout(before, dist.group.WORLD)


def test_steady_sets_the_timeout_of_the_default_group_and_the_grids(pools):
    for start, steady, lifted, after, stopped in pools(2).run((1, 2, 1, 1), _steady_on):
        assert start[0] == 90.0  # the pool's start-up timeout
        assert steady == [7.0 + watchdog.PG_MARGIN_S] * len(start), (start, steady)
        assert lifted == [100.0 + watchdog.PG_MARGIN_S] * len(start)
        assert after == steady
        assert stopped == start  # the groups outlive the job: back as they were


# ---- deadlines that follow the step (the accelerator's path) -------------------------------------


def test_a_step_s_host_read_may_take_a_multiple_of_the_median_step_and_a_stopped_rank_is_named(monkeypatch, clock):
    """On an accelerator a step's host read waits for the whole queued step: steps of three times
    --timeout (0.9 s at 0.3 s) finish, their read's deadline being 3 × the median step, the process
    groups' timeout raised with it; a read blocked past that — a rank stopped mid-step, its
    heartbeat silent — ends the rank naming the stopped one and the deadline."""
    calls: list[float] = []
    monkeypatch.setattr(
        dist.distributed_c10d, "_set_pg_timeout", lambda t, g: calls.append(t.total_seconds()), raising=False
    )
    store = dist.HashStore()
    store.add("axon4d/beat/1", 1)  # rank 1 beat once, then stopped
    dog, ended, out = _dog(2, 0, store)
    deadline = watchdog.STEP_DEADLINE_FACTOR * 0.9
    grid = _grid(ended, clock)
    dog.start()
    try:
        dog.step_took(0.95)  # the first step: start-up's deadline holds until steady()
        dog.steady([object()])
        for seconds in (0.9, 0.9):
            dog.step_took(seconds)
        assert dog.step_deadline_s == pytest.approx(deadline)
        # set at steady() for 3 × 0.95 s; lowered only once the deadline needs less than half of it
        assert calls == [pytest.approx(3 * 0.95 + watchdog.PG_MARGIN_S)]

        def device_step(t, took):
            clock.advance(took)
            _looked(dog)  # the watchdog has seen the wait this long
            return [1.0] * t.numel()

        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: device_step(t, 0.9))
        assert loop._read_step(torch.ones(1), torch.ones(()), grid) == (1.0, 1.0)
        assert ended.code is None, out.getvalue()

        def stopped_peer(t):  # the device waits for rank 1, stopped mid-step
            clock.advance(deadline + 0.1)
            ended.event.wait(60)
            return [1.0] * t.numel()

        monkeypatch.setattr(torch.Tensor, "tolist", stopped_peer)
        loop._read_step(torch.ones(1), torch.ones(()), grid)
    finally:
        dog.stop()
    message = out.getvalue()
    assert ended.code == watchdog.EXIT_TIMEOUT, message
    assert f"(deadline {deadline:g} s for a step's host read: 3 × the median step of 0.9 s)" in message, message
    assert "rank(s) 1 stopped answering" in message, message


LATE_SCRIPT = os.path.join(HERE, "late_device_check.py")
#: --timeout of the stand-in accelerator's jobs, and the device time of each of their steps: 3 ×
LATE_TIMEOUT, DEVICE_S = 2, 6.0


def _start_late(stop_rank: int, stop_step: int, out_dir, steps: int = 3) -> tuple[list[subprocess.Popen], float]:
    """Start ``late_device_check.py`` on 2 ranks (1,2,1,1), ``steps`` steps of DEVICE_S each under
    --timeout LATE_TIMEOUT; (its processes, the time it started)."""
    port, procs, start = str(free_port()), [], time.monotonic()
    flags = ["--model", "tiny", "--steps", str(steps), "--batch-size", "4", "--grid", "1,2,1,1", "--save-every", "0"]
    flags += ["--timeout", str(LATE_TIMEOUT), "--startup-timeout", "120", "--no-progress", "--peak-tflops", "1"]
    for r in range(WORLD):
        env = dict(
            _env(), RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        cmd = [sys.executable, LATE_SCRIPT, str(DEVICE_S), str(stop_rank), str(stop_step), *flags]
        cmd += ["--out-dir", str(out_dir)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs, start


def _end_late(
    procs: list[subprocess.Popen], start: float, stop_rank: int, stop_step: int
) -> tuple[list[int], list[str], float]:
    """Wait for a job of ``_start_late``; (exit codes, outputs, seconds from its start until every
    rank but a stopped one ended)."""
    try:
        for r, p in enumerate(procs):
            if r != stop_rank:
                p.wait(timeout=BOUND_S)
        elapsed = time.monotonic() - start
        if 0 <= stop_rank < WORLD and stop_step:
            procs[stop_rank].send_signal(signal.SIGKILL)  # stopped: nothing but a signal ends it
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], [p.stdout.read() for p in procs], elapsed


def _late_pair(out_dir) -> tuple[tuple[list[int], list[str], float], tuple[list[int], list[str], float]]:
    """Two jobs of ``_start_late`` side by side (their steps mostly sleep: the stand-in device's
    time): fault-free, and rank 1 stopped in step 2; (exit codes, outputs, seconds) of each."""
    ok, stop = _start_late(-1, 0, out_dir / "ok"), _start_late(1, 2, out_dir / "stop")
    try:
        done = _end_late(*ok, -1, 0)
    finally:
        stopped = _end_late(*stop, 1, 2)
    return done, stopped


@pytest.mark.slow
def test_on_the_accelerator_s_path_steps_of_three_times_the_timeout_finish_and_a_rank_stopped_mid_step_is_named(
    jobs,
):
    """The real job on a stand-in accelerator (``late_device_check.py``): each step's host read
    lasts DEVICE_S = 3 × --timeout, then waits for every rank's. The job finishes (its second and
    third steps under the step read's deadline, 3 × the median step); with rank 1 stopped halfway
    through step 2's read, rank 0 ends at that deadline naming rank 1, torch.distributed's own
    timeout (the barrier's) having been raised past it."""
    ((codes, outs, _), stopped), _ = jobs["late"].result()
    assert codes == [0, 0], (codes, outs[0][-3000:])
    codes, outs, elapsed = stopped
    assert elapsed < BOUND_S
    assert "LATE-CHECK stopping in the read of step 2" in outs[1], outs[1][-3000:]
    assert codes[0] == watchdog.EXIT_TIMEOUT, (codes, outs[0][-3000:])
    message = outs[0]
    assert "rank(s) 1 stopped answering" in message and loop.STEP_READ in message, message[-3000:]
    found = re.search(r"waited (\d+) s in .*\(deadline ([\d.]+) s for a step's host read: 3 × the median step", message)
    assert found, message[-3000:]
    waited, deadline = int(found[1]), float(found[2])
    assert 3 * DEVICE_S <= deadline <= 3 * (DEVICE_S + 4), (
        f"the deadline {deadline} s is not 3 × a step of ~{DEVICE_S} s"
    )
    assert waited <= deadline + 3, f"rank 0 waited {waited} s, past its deadline of {deadline} s"
