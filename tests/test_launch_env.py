"""Protects axon4d.grid.launch's reading of the launcher's environment, in one process: which launcher
a set of variables means (srun, an sbatch script running torchrun, mpirun), the refusal to run
alone when the environment names a larger world, SLURM's compressed node lists, the rendezvous
address rank 0 publishes under mpirun, ``device_id`` for ``init_process_group``, the keys of a
torchrun attempt kept apart from the earlier attempts' after a restart, and one
accelerator per local rank (axon4d.device.default_device). Started as real processes:
tests/test_launch.py."""

import sys

import pytest
import torch
import torch.distributed as dist

import axon4d
from axon4d import device as devices
from axon4d.grid import launch, launch_env
from axon4d.grid.launch import LaunchInfo, detect, expand_nodelist, rendezvous_address, slurm_port, slurm_rendezvous
from axon4d.reliability import errors, watchdog

_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    *(v for launcher in launch_env.MPI for v in launcher),
    *launch_env.MPI_LOCAL,
    *launch._SLURM_STEP_VARS,
    *launch._SLURM_NODELIST_VARS,
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURMD_NODENAME",
    "CUDA_VISIBLE_DEVICES",
    "TORCHELASTIC_RESTART_COUNT",
)


@pytest.fixture
def env(monkeypatch):
    """No launcher variable and no process group; ``env(**vars)`` sets variables."""
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)

    def put(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return put


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("nid[001-004,010],gpu7", ["nid001", "nid002", "nid003", "nid004", "nid010", "gpu7"]),
        ("node1", ["node1"]),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
        ("rack-1-n[1-2], login", ["rack-1-n1", "rack-1-n2", "login"]),
        ("a[7],b[1-2]-ib", ["a7", "b1-ib", "b2-ib"]),
    ],
)
def test_node_lists_expand_in_order(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["nid[001-004", "nid[4-1]", "nid[a-b]", "nid]1[", "n[[1]]", "n[1-]"])
def test_malformed_node_lists_are_refused(nodelist):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(nodelist)


def test_srun_tasks_take_rank_world_and_local_rank_from_slurm(env):
    env(SLURM_JOB_ID=77, SLURM_STEP_ID=0, SLURM_PROCID=5, SLURM_NTASKS=8, SLURM_LOCALID=1)
    assert detect() == LaunchInfo("slurm", 5, 8, 1)


def test_a_batch_script_running_torchrun_is_torchrun(env):
    # an sbatch script's own environment (SLURM_JOB_ID, SLURM_PROCID=0, no step) under torchrun's
    env(SLURM_JOB_ID=77, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0, SLURM_JOB_NODELIST="nid[1-2]")
    env(RANK=3, WORLD_SIZE=8, LOCAL_RANK=3, MASTER_ADDR="nid1", MASTER_PORT=29500)
    assert detect() == LaunchInfo("torchrun", 3, 8, 3)


def test_a_batch_script_of_one_task_is_a_world_of_one(env):
    env(SLURM_JOB_ID=77, SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_LOCALID=0)
    assert detect() == LaunchInfo("single", 0, 1, 0)


def test_srun_with_a_pmi_plugin_and_no_mpi4py_is_srun(env, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises ImportError
    env(PMI_SIZE=4, SLURM_JOB_ID=77, SLURM_STEP_ID=0, SLURM_PROCID=2, SLURM_NTASKS=4, SLURM_LOCALID=2)
    assert detect() == LaunchInfo("slurm", 2, 4, 2)


@pytest.mark.parametrize(
    "variables, said",
    [
        ({"WORLD_SIZE": 4}, ["WORLD_SIZE=4", "RANK, MASTER_ADDR, MASTER_PORT are not set", "torchrun"]),
        ({"WORLD_SIZE": 4, "RANK": 1, "MASTER_ADDR": "h"}, ["MASTER_PORT is not set"]),
        ({"RANK": 2}, ["RANK=2", "WORLD_SIZE"]),
        ({"SLURM_NTASKS": 4}, ["SLURM_NTASKS=4", "SLURM_PROCID is not set", "srun"]),
        ({"SLURM_NTASKS": 4, "SLURM_PROCID": 0, "SLURM_JOB_ID": 7}, ["sbatch script's own process", "srun"]),
        ({"OMPI_COMM_WORLD_SIZE": 4}, ["OMPI_COMM_WORLD_SIZE=4", "mpi4py is not installed"]),
        ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 1, "SLURM_NTASKS": 4, "RANK": 0}, ["RANK=0", "srun gives this task 1"]),
        ({"SLURM_STEP_ID": 0, "SLURM_PROCID": 4, "SLURM_NTASKS": 4}, ["SLURM_PROCID=4 is outside"]),
        ({"WORLD_SIZE": "four"}, ["WORLD_SIZE='four'", "whole number"]),
    ],
)
def test_a_process_told_the_world_is_larger_refuses_to_run_alone(env, monkeypatch, variables, said):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    env(**variables)
    with pytest.raises(RuntimeError) as refused:
        detect()
    for words in said:
        assert words in str(refused.value)


@pytest.mark.parametrize("variables", [{}, {"WORLD_SIZE": 1, "RANK": 0}, {"SLURM_NTASKS": 1}, {"PMI_SIZE": 1}])
def test_a_world_of_one_runs_alone(env, monkeypatch, variables):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    env(**variables)
    assert detect() == LaunchInfo("single", 0, 1, 0)


@pytest.mark.parametrize(
    "variables, rank",
    [
        ({}, None),
        ({"RANK": 3, "WORLD_SIZE": 1}, None),  # a world of one: no rank to name
        ({"RANK": 3, "WORLD_SIZE": 8}, 3),
        ({"OMPI_COMM_WORLD_RANK": 5, "OMPI_COMM_WORLD_SIZE": 8}, 5),
        ({"PMI_RANK": 2, "PMI_SIZE": 4}, 2),
        ({"MV2_COMM_WORLD_RANK": 1, "MV2_COMM_WORLD_SIZE": 2}, 1),
        ({"SLURM_PROCID": 6, "SLURM_NTASKS": 8}, 6),
        ({"RANK": 1, "WORLD_SIZE": 2, "SLURM_PROCID": 0, "SLURM_NTASKS": 2}, 1),  # torchrun under an sbatch script
        ({"WORLD_SIZE": 4, "PMI_RANK": 2, "PMI_SIZE": 4}, 2),  # a world size without its rank: the next launcher
        ({"RANK": "x", "WORLD_SIZE": 4}, None),
    ],
)
def test_the_rank_a_message_names_comes_from_the_launcher(env, monkeypatch, variables, rank, capsys):
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)  # the one-line message, not a traceback
    env(**variables)
    assert launch_env.env_rank() == rank

    def refuse() -> None:
        raise ValueError("--steps 0: must be at least 1")

    assert errors.run(refuse, "axon4d train") == errors.EXIT_REFUSED
    where = f"axon4d train: rank {rank}" if rank is not None else "axon4d train"
    assert capsys.readouterr().err == f"{where}: error: --steps 0: must be at least 1\n"


def test_srun_meets_at_the_first_host_on_the_port_of_its_job(env):
    env(SLURM_JOB_ID=123456, SLURM_STEP_NODELIST="nid[004-005],gpu1", SLURM_JOB_NODELIST="nid[001-009]")
    assert slurm_port(123456) == 20000 + 123456 % 20000 == 23456
    assert slurm_rendezvous(3) == ("nid004", 23456)
    env(SLURMD_NODENAME="nid004")
    assert slurm_rendezvous(0) == ("nid004", 23456)
    env(MASTER_ADDR="10.0.0.9", MASTER_PORT=29511, SLURMD_NODENAME="nid005")
    assert slurm_rendezvous(0) == ("10.0.0.9", 29511)
    assert all(20000 <= slurm_port(job) < 40000 for job in (0, 1, 19999, 20000, 10**9 + 7))


def test_srun_refuses_a_rendezvous_nobody_serves(env):
    env(SLURM_JOB_ID=5, SLURM_STEP_NODELIST="nid[004-005]", SLURMD_NODENAME="nid005")
    with pytest.raises(RuntimeError, match="rank 0 runs on nid005, not on nid004.*MASTER_ADDR"):
        slurm_rendezvous(0)
    assert slurm_rendezvous(1) == ("nid004", 20005)  # the others cannot tell; rank 0's error ends the job
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        env(SLURM_STEP_NODELIST="")
        slurm_rendezvous(1)


@pytest.fixture
def addresses(monkeypatch):
    """``addresses(route, names)``: what the default route and the host name resolve to."""

    def put(route, names):
        monkeypatch.setattr(launch, "_route_address", lambda: route)
        monkeypatch.setattr(launch, "hostname_addresses", lambda: list(names))

    return put


def test_mpirun_publishes_an_address_that_is_not_loopback(env, addresses):
    addresses("10.1.2.3", ["127.0.1.1"])
    assert rendezvous_address(nodes=2) == "10.1.2.3"
    addresses(None, ["127.0.1.1", "192.168.5.5"])  # no default route: the name's other address
    assert rendezvous_address(nodes=2) == "192.168.5.5"
    addresses(None, ["127.0.1.1"])  # only loopback: enough for one host
    assert rendezvous_address(nodes=1) == "127.0.0.1"
    env(MASTER_ADDR="node0-ib")
    assert rendezvous_address(nodes=2) == "node0-ib"


def test_mpirun_over_several_hosts_with_only_loopback_refuses(env, addresses):
    addresses("127.0.0.1", ["127.0.1.1"])
    with pytest.raises(RuntimeError, match="spans 2 hosts.*127.0.1.1.*set MASTER_ADDR"):
        rendezvous_address(nodes=2)


class _FakeComm:
    """An MPI communicator of one rank's view: rank 0 gathers ``names``; others receive ``sent``."""

    def __init__(self, rank, names, sent=None):
        self.rank, self.names, self.sent = rank, names, sent

    def Get_rank(self):
        return self.rank

    def gather(self, value, root):
        return self.names if self.rank == root else None

    def bcast(self, value, root):
        return value if self.rank == root else self.sent


def test_every_mpi_rank_raises_the_refusal_of_rank_0(env, addresses):
    addresses(None, ["127.0.1.1"])
    with pytest.raises(RuntimeError, match="spans 2 hosts") as refused:
        launch._mpi_rendezvous(_FakeComm(0, ["a", "b", "a"]), "a")
    with pytest.raises(RuntimeError, match="spans 2 hosts"):  # rank 1 gets the words rank 0 broadcast
        launch._mpi_rendezvous(_FakeComm(1, None, sent=str(refused.value)), "b")
    host, port = launch._mpi_rendezvous(_FakeComm(0, ["a", "a"]), "a")  # one host: loopback will do
    assert host == "127.0.0.1" and port > 0
    assert launch._mpi_rendezvous(_FakeComm(3, None, sent=("10.0.0.1", 4242)), "b") == ("10.0.0.1", 4242)


@pytest.fixture
def groups(monkeypatch):
    """The arguments of every init_process_group call (none is made)."""
    calls = []
    monkeypatch.setattr(launch.dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


def test_the_world_is_bound_to_an_accelerator_and_not_to_the_host(env, groups, accelerators):
    accelerators(2)
    accelerator = devices.default_device(1)
    launch.start_world(LaunchInfo("single", 0, 1, 0), "nccl", device=accelerator)
    launch.start_world(LaunchInfo("single", 0, 1, 0), "gloo", device=devices.HOST)
    launch.start_world(LaunchInfo("single", 0, 1, 0), "gloo")
    launch.start_world(LaunchInfo("single", 0, 1, 0), "gloo", device=accelerator)  # staged through the host
    assert groups[0][1]["device_id"] == accelerator
    assert all("device_id" not in kwargs for _, kwargs in groups[1:])


def test_srun_tasks_start_the_world_at_the_slurm_rendezvous(env, groups):
    env(SLURM_JOB_ID=40001, SLURM_STEP_NODELIST="nid[002-003]")
    launch.start_world(LaunchInfo("slurm", 1, 2, 1), "gloo", timeout_s=30)
    (backend,), kwargs = groups[0]
    assert backend == "gloo" and kwargs["init_method"] == "tcp://nid002:20001"
    assert (kwargs["rank"], kwargs["world_size"], kwargs["timeout"].total_seconds()) == (1, 2, 30)


def test_a_restarted_torchrun_attempt_keeps_its_keys_apart_from_the_earlier_ones(env, groups, monkeypatch):
    """torchrun's agent keeps one store across its restarts: the attempt after a restart must not
    read the ranks' addresses or the watchdog's failures that the attempt before it left there."""
    agent = dist.HashStore()
    agent.set("default_pg/0//cpu/rank_0", "the first attempt's address")  # as gloo's key would be
    agent.set("axon4d/failures", "1")
    monkeypatch.setattr(launch.dist, "rendezvous", lambda url, **kwargs: iter([(agent, 1, 2)]))
    env(RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    launch.start_world(detect(), "gloo")
    assert groups[0][1]["store"].check(["0//cpu/rank_0"]) and launch.restart_count() == 0  # as env:// names it
    assert watchdog._client(agent, 1).check(["axon4d/failures"])  # the first attempt's keys as they are
    env(TORCHELASTIC_RESTART_COUNT=1)
    launch.start_world(detect(), "gloo")
    _, kwargs = groups[1]
    assert (kwargs["rank"], kwargs["world_size"]) == (1, 2)
    assert not kwargs["store"].check(["0//cpu/rank_0"]) and not watchdog._client(agent, 1).check(["axon4d/failures"])
    kwargs["store"].set("0//cpu/rank_0", "the second attempt's")
    assert agent.check(["attempt_1/default_pg/0//cpu/rank_0"])  # (a get of a missing key would wait for it)
    assert agent.get("attempt_1/default_pg/0//cpu/rank_0") == b"the second attempt's"
    env(TORCHELASTIC_RESTART_COUNT="x")
    with pytest.raises(RuntimeError, match="TORCHELASTIC_RESTART_COUNT='x'"):
        launch.restart_count()


@pytest.fixture
def accelerators(monkeypatch):
    """``accelerators(n)``: make this process see ``n`` accelerators (none is touched)."""

    def put(count):
        monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: count)

    return put


def test_every_local_rank_gets_an_accelerator_of_its_own(env, accelerators):
    accelerators(2)
    assert [devices.default_device(r).index for r in (0, 1)] == [0, 1]
    assert devices.default_device() == devices.default_device(0)
    assert not devices.is_host(devices.default_device(1))
    accelerators(1)  # srun --gpus-per-task=1: each task is shown its own one
    assert [devices.default_device(r).index for r in (0, 3)] == [0, 0]
    accelerators(0)
    assert devices.default_device(5) == devices.HOST


def test_an_accelerator_named_without_an_index_is_the_local_ranks_own(env, accelerators):
    accelerators(4)
    assert devices.rank_device(torch.device("cuda"), 3) == torch.device("cuda", 3)
    assert devices.rank_device(torch.device("cuda", 1), 3) == torch.device("cuda", 1)  # as named
    assert devices.rank_device(None, 2) == torch.device("cuda", 2)
    assert devices.rank_device(devices.HOST, 2) == devices.HOST
    accelerators(0)
    with pytest.raises(RuntimeError, match="device='cuda' was asked for, but this process sees no accelerator"):
        devices.rank_device(torch.device("cuda"), 0)
    with pytest.raises(RuntimeError, match="device='cuda' was asked for"):
        axon4d.init((1, 1, 1, 1), device="cuda")  # before any process group


def test_more_local_ranks_than_accelerators_is_refused(env, accelerators):
    accelerators(2)
    env(CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(RuntimeError) as refused:
        devices.default_device(2)
    said = str(refused.value)
    for words in ("local rank 2", "sees 2", "CUDA_VISIBLE_DEVICES='0,1'", "at least 3 ranks", "--nproc-per-node"):
        assert words in said
