"""What a gloo group of every rank needs from the host it starts on: a socket to every other rank,
and the network interface they connect over (``axon4d.comm.communicator.host_group``, which the checkpoint
saved in the background coordinates on; docs/training.md, "Saving in the background").

gloo connects a group as a full mesh: each rank opens a connection to each other rank, about
world − 1 sockets (file descriptors) per rank for the group's life, on top of what the process has
open. A process limited to fewer open files (``ulimit -n``; 1024 is a common soft limit) fails
inside gloo's connect with a bare "Too many open files". ``check`` compares the two first and
lifts the soft limit itself when the hard limit allows, else refuses, naming both and what to set.

gloo binds the interface ``GLOO_SOCKET_IFNAME`` names, else the address this host's name resolves
to. ``check`` refuses a ``GLOO_SOCKET_IFNAME`` naming an interface this host does not have, and a
host name resolving only to loopback (127.0.1.1 in many ``/etc/hosts``) in a job the launcher says
spans several nodes (gloo would then offer 127.0.1.1 to the other nodes and wait for its timeout);
on a multi-homed node, ``GLOO_SOCKET_IFNAME`` picks the network between the nodes (e.g. ``ib0``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import NamedTuple

from axon4d.grid import launch
from axon4d.grid.launch_env import LOCAL_SIZES, SLURM_NODES

#: files a process is left free to open beside the group's sockets (checkpoint files, logs, pipes)
SPARE_FILES = 64
IFNAME_ENV = "GLOO_SOCKET_IFNAME"


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
    """Sockets a gloo group of ``world`` ranks holds open on each rank (a full mesh)."""
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
