"""What a gloo group of every rank needs from the host it starts on: sockets to the other ranks,
the network interface they connect over (``axon4d.comm.communicator.host_group``, the group
checkpoints coordinate on; docs/reliability.md, "The host group"), and how its ranks connect.

``lazy_connections``: gloo's default connects a group as a full mesh when it is made: every rank
publishes its address and one identifier per pair (≈ 170 + 8·world bytes) in the store and reads
every other rank's, ≈ world·(170 + 8·world) bytes per rank — 134 MB per rank and 550 GB through
the one store at 4096 ranks. Under torch's ``TORCH_GLOO_LAZY_INIT`` (torch 2.8 and later) a rank
publishes only its address, and a pair connects at its first message, reading the other's address
once: DCP's coordination (gathers to rank 0, scatters and broadcasts from it, ring all-gathers,
dissemination barriers) connects rank 0 to every rank and each other rank to a few, O(world)
store requests and bytes per rank. A torch without it ignores the variable and connects the full
mesh (``lazy_supported`` says which). Measured, on loopback, for 8 … 64 ranks and extrapolated to
4096: ``python bench/host_group_scaling.py`` (bench/results/host_group_scaling.json).

``check``: a connected pair holds a socket (a file descriptor) on each side for the group's life,
on top of what the process has open; rank 0 connects to every other rank, world − 1 sockets. A
process limited to fewer open files (``ulimit -n``; 1024 is a common soft limit) fails inside
gloo's connect with a bare "Too many open files". ``check`` compares the two first (on every rank,
against rank 0's need) and lifts the soft limit itself when the hard limit allows, else refuses,
naming both and what to set.

gloo binds the interface ``GLOO_SOCKET_IFNAME`` names, else the address this host's name resolves
to. ``check`` refuses a ``GLOO_SOCKET_IFNAME`` naming an interface this host does not have, and a
host name resolving only to loopback (127.0.1.1 in many ``/etc/hosts``) in a job the launcher says
spans several nodes (gloo would then offer 127.0.1.1 to the other nodes and wait for its timeout);
on a multi-homed node, ``GLOO_SOCKET_IFNAME`` picks the network between the nodes (e.g. ``ib0``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import NamedTuple

import torch.distributed as dist

from axon4d.grid import launch
from axon4d.grid.launch_env import LOCAL_SIZES, SLURM_NODES

#: files a process is left free to open beside the group's sockets (checkpoint files, logs, pipes)
SPARE_FILES = 64
IFNAME_ENV = "GLOO_SOCKET_IFNAME"
#: what torch reads when it makes a gloo group: "1" connects each pair at its first message
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


def lazy_supported() -> bool:
    """Whether this torch's gloo can connect pairs lazily (``LAZY_ENV``; torch 2.8 and later, whose
    ``ProcessGroupGloo.create_device`` takes ``lazy_init`` alike)."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    return gloo is not None and "lazy_init" in (getattr(gloo.create_device, "__doc__", "") or "")


@contextlib.contextmanager
def lazy_connections(environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Within the block, gloo groups made connect each pair of ranks at its first message instead of
    every pair at once (``LAZY_ENV`` set to "1", then restored as it was; module docstring). A torch
    without lazy connections ignores it and connects the full mesh."""
    before = environ.get(LAZY_ENV)
    environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            environ.pop(LAZY_ENV, None)
        else:
            environ[LAZY_ENV] = before


class Limits(NamedTuple):
    """The process's open-file limits (``RLIMIT_NOFILE``), soft and hard; -1 is unlimited."""

    soft: int
    hard: int


def _limits() -> Limits | None:
    try:
        import resource
    except ImportError:  # not a POSIX host: nothing to check
        return None
    return Limits(*resource.getrlimit(resource.RLIMIT_NOFILE))


def _set_soft(soft: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def open_files() -> int:
    """How many files this process has open now (0 where ``/proc/self/fd`` cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def interface_names() -> list[str]:
    """The names of this host's network interfaces."""
    return [name for _, name in socket.if_nameindex()]


def mesh_sockets(world: int) -> int:
    """Sockets a gloo group of ``world`` ranks may hold open on one rank: world − 1 on rank 0 (which
    DCP gathers to) and on every rank of a full mesh."""
    return max(0, world - 1)


def spans_nodes(world: int, environ: Mapping[str, str]) -> bool | None:
    """Whether a job of ``world`` ranks spans several nodes, by what its launcher says (ranks on
    this node, or a SLURM job's node count); None where the launcher does not say."""
    for name in LOCAL_SIZES:
        if environ.get(name, "").isdigit():
            return int(environ[name]) < world
    nodes = environ.get(SLURM_NODES, "")
    return int(nodes) > 1 if nodes.isdigit() else None


def check(
    world: int,
    environ: Mapping[str, str] = os.environ,
    limits: Callable[[], Limits | None] | None = None,
    set_soft: Callable[[int], None] | None = None,
    opened: Callable[[], int] = open_files,
    interfaces: Callable[[], list[str]] | None = None,
    addresses: Callable[[], list[str]] = launch.hostname_addresses,
) -> str:
    """Check that this process can open a gloo group of ``world`` ranks (module docstring) and
    return one line saying how many sockets it takes and which interface gloo will use; raises
    ``RuntimeError`` where it cannot (too few open files allowed, a missing interface, loopback in
    a job over several nodes). Lifts the soft open-file limit up to the hard one where needed.
    ``limits``, ``set_soft``, ``opened``, ``interfaces``, ``addresses``: the host's, by default."""
    sockets = mesh_sockets(world)
    need = opened() + sockets + SPARE_FILES
    have = (limits or _limits)()
    allowed = "unknown" if have is None else "unlimited" if have.soft < 0 else str(have.soft)
    if have is not None and 0 <= have.soft < need:
        if have.hard < 0 or have.hard >= need:
            (set_soft or _set_soft)(need)
            allowed = f"{need}, lifted from {have.soft}"
        else:
            raise RuntimeError(
                f"a gloo group of {world} ranks opens {sockets} sockets on each rank; this process has "
                f"{opened()} files open and may open {have.soft} (hard limit {have.hard}), {need} are needed: "
                f"raise the limit where the job starts (ulimit -n {need}, or the launcher's / scheduler's "
                "limit on open files)"
            )
    named = environ.get(IFNAME_ENV, "")
    interfaces = interfaces or interface_names
    if named:
        known = interfaces()
        missing = [n for n in named.split(",") if n not in known]
        if missing:
            raise RuntimeError(
                f"{IFNAME_ENV}={named!r} names {', '.join(missing)}, which this host does not have "
                f"(its interfaces: {', '.join(known)}): set it to the one the nodes reach each other over"
            )
        where = f"interface {named} ({IFNAME_ENV})"
    else:
        found = addresses()
        where = f"the address of host name {socket.gethostname()!r} ({', '.join(found) or 'unresolved'})"
        if found and all(launch.is_loopback(a) for a in found) and spans_nodes(world, environ):
            raise RuntimeError(
                f"this host's name {socket.gethostname()!r} resolves only to loopback ({', '.join(found)}), "
                f"which the other nodes of this job cannot reach: set {IFNAME_ENV} to the interface the nodes "
                f"reach each other over (its interfaces: {', '.join(interfaces())})"
            )
    return f"a gloo group of {world} ranks: {sockets} sockets per rank (open-file limit {allowed}), over {where}"
