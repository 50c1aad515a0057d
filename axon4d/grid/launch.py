"""Where this process sits in the job: rank and world size from torchrun, MPI, SLURM or a lone process.

``detect()`` reads the launcher's environment; ``start_world()`` creates the default
torch.distributed process group from it, bound to the rank's accelerator (``device_id``) when it
has one.

- torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (``env://``). A task that
  srun or an sbatch script started *running torchrun* is torchrun's: its variables come first.
  Under ``--max-restarts`` the agent keeps one store across its restarts of the job: each attempt
  (``TORCHELASTIC_RESTART_COUNT``, ``restart_count``) keeps its keys apart (``attempt_store``).
- ``mpirun``/``mpiexec`` (inside a SLURM allocation too): rank and size from mpi4py; rank 0
  publishes the rendezvous with an MPI broadcast: ``MASTER_ADDR`` if set, else an address of its
  host that is not loopback (``rendezvous_address``), and a free port. A job spanning several nodes
  (by ``MPI.Get_processor_name``) whose rank 0 finds only loopback refuses, naming ``MASTER_ADDR``.
- ``srun`` (a job step: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_*``): rank, world and local
  rank from ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), ``SLURM_LOCALID``;
  the rendezvous (``tcp://``) is ``MASTER_ADDR`` if set, else the first host of the step's node
  list (``expand_nodelist``), and ``MASTER_PORT`` if set, else ``slurm_port(SLURM_JOB_ID)``.
- a plain ``python`` process is a world of one — unless its environment says the world is larger
  (``WORLD_SIZE`` > 1 without torchrun's other variables, ``SLURM_NTASKS`` > 1 outside a step, an
  MPI size without mpi4py): then ``detect()`` raises instead of running alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import re
import socket
from typing import Any

import torch
import torch.distributed as dist

from axon4d import device as devices
from axon4d.grid.launch_env import MPI, MPI_LOCAL, SLURM, SLURM_LOCAL, TORCHRUN, TORCHRUN_LOCAL

#: environment variables by which MPI launchers announce a world size.
_MPI_SIZE_VARS = tuple(v.size for v in MPI)
#: torchrun's variables (all four present: launched by torchrun or an equivalent).
_TORCHRUN_VARS = (TORCHRUN.rank, TORCHRUN.size, "MASTER_ADDR", "MASTER_PORT")
#: set by srun for the tasks of a job step, never in an sbatch script's own environment.
_SLURM_STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")
#: the node lists of a step and of its job, most specific first.
_SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
#: under srun without ``MASTER_PORT`` the port is ``SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN``.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000
#: a documentation address (RFC 5737), never assigned: "connecting" a UDP socket to it sends nothing
#: but makes the kernel choose the source address of this host's default route.
_UNROUTED = "192.0.2.1"


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """How this process was started and where it sits in the world."""

    launcher: str  # "torchrun" | "mpi" | "slurm" | "single" | "existing"
    rank: int
    world_size: int
    local_rank: int


def _env_int(name: str) -> int | None:
    """``$name`` as an int, None when unset; ``RuntimeError`` when it is not a whole number."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r}: the launcher's variable must be a whole number") from None


def detect() -> LaunchInfo:
    """Read rank, world size and local rank from the launcher; do not start any communication.

    Raises ``RuntimeError`` when the environment says this process is one of several but not
    enough to tell which (module docstring)."""
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get(TORCHRUN_LOCAL, "0"))
        return LaunchInfo("existing", dist.get_rank(), dist.get_world_size(), local)
    if all(v in os.environ for v in _TORCHRUN_VARS):
        return LaunchInfo(
            "torchrun",
            int(os.environ[TORCHRUN.rank]),
            int(os.environ[TORCHRUN.size]),
            int(os.environ.get(TORCHRUN_LOCAL, "0")),
        )
    found = _detect_mpi() or _detect_slurm()
    if found is not None:
        return found
    _refuse_lone_process()
    return LaunchInfo("single", 0, 1, 0)


def _detect_mpi() -> LaunchInfo | None:
    """The MPI world when an MPI launcher started this process; None when none did, or when mpi4py
    is missing and srun's variables describe the same world (srun with a PMI plugin)."""
    size_var = next((v for v in _MPI_SIZE_VARS if v in os.environ), None)
    if size_var is None:
        return None
    size = _env_int(size_var) or 1
    try:
        from mpi4py import MPI
    except ImportError:
        step = _detect_slurm()
        if size <= 1 or (step is not None and step.world_size == size):
            return None
        raise RuntimeError(
            f"{size_var}={size}: an MPI launcher started this process as one of {size} ranks, but mpi4py "
            "is not installed, so it cannot learn its rank. Install mpi4py built for that MPI "
            "(pip install 'axon4d[mpi]'), or launch with torchrun or srun instead"
        ) from None
    world = MPI.COMM_WORLD
    if world.Get_size() == 1 and size > 1:
        raise RuntimeError(
            f"{size_var}={size}, but mpi4py's MPI sees a world of 1: mpi4py is built for another MPI "
            "than the launcher's. Launch with the mpirun of the MPI mpi4py uses (python -c 'import "
            "mpi4py; print(mpi4py.get_config())'), or rebuild mpi4py for the launcher's MPI"
        )
    named = next((int(os.environ[v]) for v in MPI_LOCAL if v in os.environ), None)
    if named is None:
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_rank()
        node.Free()
    else:
        local = named
    return LaunchInfo("mpi", world.Get_rank(), world.Get_size(), local)


def _detect_slurm() -> LaunchInfo | None:
    """The world of an srun job step; None outside one. An sbatch script's own process (it has
    ``SLURM_PROCID`` and ``SLURM_NTASKS`` but no step variable) of a job with several tasks raises."""
    rank, ntasks = _env_int(SLURM.rank), _env_int(SLURM.size)
    if rank is None or ntasks is None:
        return None
    if not any(v in os.environ for v in _SLURM_STEP_VARS):
        if ntasks > 1:
            raise RuntimeError(
                f"SLURM_NTASKS={ntasks} and SLURM_PROCID={rank} without any of {', '.join(_SLURM_STEP_VARS)}: "
                "this is the sbatch script's own process, not one of the job's tasks. Start the ranks "
                "with srun (srun python -m axon4d.train ...) or torchrun; to run one process, use "
                "srun -n 1 or set SLURM_NTASKS=1"
            )
        return None
    world = _env_int("SLURM_STEP_NUM_TASKS") or ntasks
    local = _env_int(SLURM_LOCAL) or 0
    if not 0 <= rank < world:
        raise RuntimeError(f"SLURM_PROCID={rank} is outside a step of {world} tasks (SLURM_NTASKS)")
    for name, want in ((TORCHRUN.rank, rank), (TORCHRUN.size, world), (TORCHRUN_LOCAL, local)):
        seen = _env_int(name)
        if seen is not None and seen != want:
            raise RuntimeError(
                f"{name}={seen} but srun gives this task {want} (SLURM_PROCID={rank}, world {world}, "
                f"SLURM_LOCALID={local}): unset {name}, or export all of {', '.join(_TORCHRUN_VARS)} "
                "to launch as torchrun does"
            )
    return LaunchInfo("slurm", rank, world, local)


def _refuse_lone_process() -> None:
    """Raise ``RuntimeError`` when the environment says the world is larger than this one process."""
    seen = {v: os.environ[v] for v in (*TORCHRUN, TORCHRUN_LOCAL, SLURM.size) if v in os.environ}
    world, rank = _env_int(TORCHRUN.size) or 1, _env_int(TORCHRUN.rank) or 0
    if world > 1 or rank > 0:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise RuntimeError(
            f"the environment says this process is one of several ({_show(seen)}) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set, so it cannot join them. Launch with torchrun, "
            f"or set all of {', '.join(_TORCHRUN_VARS)}; to run alone, unset WORLD_SIZE and RANK"
        )
    if (_env_int(SLURM.size) or 1) > 1:
        raise RuntimeError(
            f"SLURM_NTASKS={os.environ['SLURM_NTASKS']} but SLURM_PROCID is not set: this process is not "
            "one of the job's tasks (an salloc shell or a batch script). Start the ranks with srun "
            "(srun python -m axon4d.train ...) or torchrun; to run one process, set SLURM_NTASKS=1"
        )


def _show(values: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list in its compressed form, in order:
    ``"nid[001-003,010],gpu7"`` -> nid001, nid002, nid003, nid010, gpu7 (zero padding kept; several
    bracket groups in one name multiply: ``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2).
    ``ValueError`` for unbalanced brackets or a range that is not two numbers ascending."""
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"node list {nodelist!r}: brackets do not nest, nor close before they open")
        if ch == "," and depth == 0:
            item = nodelist[start:i].strip()
            hosts.extend(_expand_name(item, nodelist) if item else [])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {nodelist!r}: a '[' is never closed")
    return hosts


def _expand_name(item: str, nodelist: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ValueError(f"node list {nodelist!r}: {item!r} has a stray bracket")
        return [item]
    prefix, ranges, rest = match.groups()
    numbers: list[str] = []
    for part in ranges.split(","):
        lo, dash, hi = part.strip().partition("-")
        hi = hi if dash else lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"node list {nodelist!r}: {part!r} in [{ranges}] is not N or N-M with N <= M")
        numbers.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    tails = _expand_name(rest, nodelist) if rest else [""]
    return [prefix + n + tail for n in numbers for tail in tails]


def slurm_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id`` when ``MASTER_PORT`` is not set: the same on every
    task of the job, different for jobs that follow one another. Two steps of one job running at
    once on the same first node need ``MASTER_PORT`` set to different ports."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def slurm_rendezvous(rank: int) -> tuple[str, int]:
    """(host, port) where the tasks of an srun step meet: ``MASTER_ADDR`` or the first host of the
    step's node list, ``MASTER_PORT`` or ``slurm_port(SLURM_JOB_ID)``. Rank 0 checks that it runs
    on that host (``SLURMD_NODENAME``): the others would wait for it at an address nobody serves."""
    host = os.environ.get("MASTER_ADDR")
    if host is None:
        name = next((v for v in _SLURM_NODELIST_VARS if os.environ.get(v)), None)
        hosts = expand_nodelist(os.environ[name]) if name else []
        if not hosts:
            raise RuntimeError(f"none of {', '.join(_SLURM_NODELIST_VARS)} names a host: set MASTER_ADDR")
        host, mine = hosts[0], os.environ.get("SLURMD_NODENAME")
        if rank == 0 and name is not None and mine is not None and mine != host:
            raise RuntimeError(
                f"rank 0 runs on {mine}, not on {host}, the first host of {name}={os.environ[name]}: set "
                "MASTER_ADDR to rank 0's host (or keep task 0 on the first node: no --distribution=arbitrary)"
            )
    port = _env_int("MASTER_PORT")
    if port is None:
        job = _env_int("SLURM_JOB_ID") or _env_int("SLURM_JOBID")
        if job is None:
            raise RuntimeError("neither MASTER_PORT nor SLURM_JOB_ID is set: set MASTER_PORT")
        port = slurm_port(job)
    return host, port


def restart_count() -> int:
    """How many times the launcher has restarted this job's processes: torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` (0 at the first launch, N after N restarts under
    ``--max-restarts``); 0 for the other launchers, whose relaunch is a new job."""
    return _env_int("TORCHELASTIC_RESTART_COUNT") or 0


def attempt_store(store: Any) -> Any:
    """``store`` (the job's key-value store) seen through this attempt's keys: after a restart,
    under the prefix ``attempt_<N>/``, so that keys an earlier attempt left in torchrun's agent
    store (the ranks' addresses, the watchdog's failures) are not read as this attempt's; the first
    attempt's store as it is."""
    n = restart_count()
    return dist.PrefixStore(f"attempt_{n}", store) if n else store


def free_port() -> int:
    """A TCP port that is free on this host now (for a rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _route_address() -> str | None:
    """The source address of this host's default route, None without one (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((_UNROUTED, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def hostname_addresses() -> list[str]:
    """The IPv4 addresses this host's name resolves to (possibly only 127.0.1.1)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback or unspecified IP address (False for a host name)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False  # a host name: let the others resolve it
    return ip.is_loopback or ip.is_unspecified


def rendezvous_address(nodes: int) -> str:
    """The address rank 0 publishes for a job on ``nodes`` hosts: ``MASTER_ADDR`` if set, else this
    host's default-route address, else one its name resolves to, that is not loopback; loopback
    (127.0.0.1) only for a job on one host — on several, ``RuntimeError`` naming ``MASTER_ADDR``."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    candidates = [a for a in [_route_address(), *hostname_addresses()] if a is not None]
    routable = [a for a in candidates if not is_loopback(a)]
    if routable:
        return routable[0]
    if nodes > 1:
        raise RuntimeError(
            f"the job spans {nodes} hosts, but rank 0's host ({socket.gethostname()}) has no address other "
            f"than loopback ({', '.join(candidates) or 'none found'}) to publish for the rendezvous: set "
            "MASTER_ADDR to an address of rank 0's host the others can reach (e.g. mpirun -x "
            "MASTER_ADDR=$(hostname -I | cut -d' ' -f1) ...)"
        )
    return "127.0.0.1"


def _mpi_rendezvous(comm: Any, processor_name: str) -> tuple[str, int]:
    """(address, port) from rank 0 of MPI communicator ``comm``, the same on every rank; its
    refusal (``rendezvous_address``) is raised on every rank, so none waits for the others."""
    names = comm.gather(processor_name, root=0)
    published: tuple[str, int] | str | None = None
    if comm.Get_rank() == 0:
        try:
            published = (rendezvous_address(len(set(names))), free_port())
        except RuntimeError as refusal:
            published = str(refusal)
    published = comm.bcast(published, root=0)
    if isinstance(published, str):
        raise RuntimeError(published)
    assert published is not None
    return published


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def start_world(info: LaunchInfo, backend: str, timeout_s: float = 600.0, device: torch.device | None = None) -> None:
    """Create the default process group for ``info`` with ``backend`` (a no-op if one exists),
    bound to ``device`` when it is an accelerator (``device_id``: the backend makes its
    communicator now and splits the subgroups' from it instead of one more per subgroup)."""
    if info.launcher == "existing":
        return
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    device_id = devices.process_group_device(device)
    if device_id is not None and backend == devices.default_backend(device_id):  # NCCL: not gloo staging
        options["device_id"] = device_id
    if info.launcher == "torchrun":
        store, rank, world = next(dist.rendezvous("env://", timeout=options["timeout"]))
        store = dist.PrefixStore("default_pg", attempt_store(store))  # as init_process_group's env:// names it
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)
        return
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
        return
    if info.launcher == "mpi":
        from mpi4py import MPI

        host, port = _mpi_rendezvous(MPI.COMM_WORLD, MPI.Get_processor_name())
    elif info.launcher == "slurm":
        host, port = slurm_rendezvous(info.rank)
    else:
        raise ValueError(f"launcher {info.launcher!r}: expected torchrun, mpi, slurm, single or existing")
    options.update(rank=info.rank, world_size=info.world_size)
    dist.init_process_group(backend, init_method=_tcp(host, port), **options)
