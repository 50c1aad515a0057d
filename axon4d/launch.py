"""Where this process sits in the job: rank and world size from torchrun, MPI or a lone process.

``detect()`` reads the launcher's environment; ``start_world()`` creates the default
torch.distributed process group from it. Under ``mpirun``/``mpiexec`` rank and size come from
mpi4py and rank 0 publishes a rendezvous address (``MASTER_ADDR`` if set, else its host's
address, and a free port) with an MPI broadcast. A plain ``python`` process is a world of one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch.distributed as dist

#: environment variables by which MPI launchers announce a world size.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """How this process was started and where it sits in the world."""

    launcher: str  # "torchrun" | "mpi" | "single" | "existing"
    rank: int
    world_size: int
    local_rank: int


def _under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _under_mpi() -> bool:
    return any(v in os.environ for v in _MPI_SIZE_VARS)


def detect() -> LaunchInfo:
    """Read rank, world size and local rank from the launcher; do not start any communication."""
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return LaunchInfo("existing", dist.get_rank(), dist.get_world_size(), local)
    if _under_torchrun():
        return LaunchInfo(
            "torchrun",
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")),
        )
    if _under_mpi():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        named = next((int(os.environ[v]) for v in _MPI_LOCAL_RANK_VARS if v in os.environ), None)
        if named is None:
            node = world.Split_type(MPI.COMM_TYPE_SHARED)
            local = node.Get_rank()
            node.Free()
        else:
            local = named
        return LaunchInfo("mpi", world.Get_rank(), world.Get_size(), local)
    return LaunchInfo("single", 0, 1, 0)


def free_port() -> int:
    """A TCP port that is free on this host now (for a rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _host_address() -> str:
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def start_world(info: LaunchInfo, backend: str, timeout_s: float = 600.0) -> None:
    """Create the default process group for ``info`` with ``backend`` (a no-op if one exists)."""
    if info.launcher == "existing":
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    elif info.launcher == "mpi":
        from mpi4py import MPI

        address = (_host_address(), free_port()) if info.rank == 0 else None
        addr, port = MPI.COMM_WORLD.bcast(address, root=0)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
