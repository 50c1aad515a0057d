"""Which transport a grid's communication layer uses: torch.distributed or MPI (issue 18, item 5).

``axon4d.init`` asks ``choose_transport`` before any process group exists. Under mpirun on the
host with ``comm="auto"`` the answer is ``PROBE``: once the world exists, ``settle_transport``
runs ``probe_transports``, which times both transports' collectives on the world group, and every
rank takes the one whose slowest rank finished first (``decide_transport``, a pure function of the
gathered figures, so every rank reaches the same verdict). ``$AXON4D_COMM``, ``comm=`` or
``backend="mpi"`` decide without a probe; other launchers and accelerators use torch.distributed.
The result is a ``TransportChoice`` (axon4d.comm.communicator), kept as ``grid.comm.transport_choice``. The probe's
collectives go through ``axon4d.comm.communicator.Communicator``, like every other.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from axon4d import device as devices
from axon4d.comm.communicator import Communicator, TorchTransport, TransportChoice
from axon4d.comm.mpi import MPITransport
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Op

log = logging.getLogger(__name__)

#: the transports, in the order that breaks an exact tie in the probe (MPI: the launcher's own).
TRANSPORTS = ("mpi", "torch")
#: what ``choose_transport`` answers when the transport is to be measured (``settle_transport``).
PROBE = "probe"
#: the probe's payloads in bytes (fp32; the full tensor of each collective, as in the CommLog) and
#: timed repetitions per collective and payload, after one untimed warm-up.
PROBE_BYTES = (64 << 10, 4 << 20)
PROBE_REPS = 2


def choose_transport(
    comm: str, backend: str | None, launcher: str, device: torch.device
) -> tuple[str, str | None, str]:
    """(transport, torch.distributed backend, why) for ``axon4d.init``, before any group exists.

    The transport is "torch", "mpi", or ``PROBE``: measure both once the world exists
    (``settle_transport``). ``backend="mpi"`` means the MPI transport (torch.distributed keeps its
    default backend for group bookkeeping); an explicit ``comm`` is taken as it is. ``comm="auto"``:
    ``$AXON4D_COMM`` ("torch" or "mpi") if set; else, when launched by mpirun/mpiexec on the host
    with mpi4py importable, ``PROBE``; else torch (gloo or NCCL). None of the overrides probes."""
    if backend == "mpi":
        return "mpi", None, 'backend="mpi"'
    if comm not in ("torch", "mpi", "auto"):
        raise ValueError(f"comm={comm!r}: choose 'torch', 'mpi' or 'auto'")
    if comm != "auto":
        return comm, backend, f"comm={comm!r}"
    env = os.environ.get("AXON4D_COMM", "")
    if env in ("torch", "mpi"):
        return env, backend, f"AXON4D_COMM={env}"
    if env not in ("", "auto"):
        raise ValueError(f"AXON4D_COMM={env!r}: choose 'torch', 'mpi' or 'auto', or leave it unset")
    if launcher != "mpi":
        return "torch", backend, f"launcher {launcher}"
    if not devices.is_host(device):
        return "torch", backend, f"device {device}"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "torch", backend, "mpi4py is not installed"
    return PROBE, backend, "probe"


def decide_transport(per_rank: Sequence[Mapping[str, float]]) -> TransportChoice:
    """The transport whose slowest rank finished the probe first, from every rank's probe totals
    (seconds per transport, one mapping per rank of the world); an exact tie goes to the first of
    ``TRANSPORTS``. A pure function: every rank calls it on the same gathered figures, so every
    rank reaches the same verdict."""
    if not per_rank:
        raise ValueError("decide_transport needs the probe figures of at least one rank, got none")
    for rank, figures in enumerate(per_rank):
        if set(figures) != set(TRANSPORTS):
            raise ValueError(f"rank {rank}'s probe figures name {sorted(figures)}; expected {sorted(TRANSPORTS)}")
    slowest = {name: max(figures[name] for figures in per_rank) for name in TRANSPORTS}
    name = min(TRANSPORTS, key=lambda n: slowest[n])  # min keeps the first of equal keys
    return TransportChoice(name, f"probe over {len(per_rank)} ranks", seconds=slowest)


def settle_transport(name: str, why: str, device: torch.device, rank: int, world_size: int) -> TransportChoice:
    """The transport ``choose_transport`` named, or, for ``PROBE``, the faster of the two over the
    world (``probe_transports``; one rank moves nothing and takes torch unmeasured). Needs the
    default process group. Logged once, on rank 0 (logger "axon4d.comm.transport", level INFO)."""
    if name != PROBE:
        choice = TransportChoice(name, why)
    elif world_size == 1:
        choice = TransportChoice("torch", "one rank: no collective to time")
    else:
        choice = probe_transports(device, rank, world_size)
    if rank == 0:
        log.info("axon4d: communication transport %s", choice.describe())
    return choice


def probe_transports(
    device: torch.device, rank: int, world_size: int, sizes: Sequence[int] = PROBE_BYTES, reps: int = PROBE_REPS
) -> TransportChoice:
    """Time both transports on the world group and choose the faster, identically on every rank.

    Each transport runs the job's collectives — all-reduce, all-gather, reduce-scatter of fp32
    tensors of ``sizes`` bytes over the world — ``reps`` timed times each, after one untimed
    warm-up of each collective at the first size; the two transports take turns, so load on the
    machine falls on both alike. Every rank's totals are all-gathered over the world through the
    torch transport, and ``decide_transport`` picks from those bit-identical figures on every
    rank. Must be called by every rank of the world."""
    shape = GridShape(1, 1, 1, world_size)  # "world" is the only axis the probe uses
    world = dist.group.WORLD
    assert world is not None, "probe_transports needs the default process group (axon4d.grid.launch.start_world)"
    torch_comm = Communicator(shape, TorchTransport({"world": world}))
    torch_comm.barrier()  # ranks arrive apart (imports, start-up); the wait is not the probe's cost
    start = time.perf_counter()
    comms = {"mpi": Communicator(shape, MPITransport(shape, rank, axes=("world",))), "torch": torch_comm}
    try:
        totals = _time_collectives(comms, device, world_size, sizes, reps)
        mine = torch.tensor([[totals[n] for n in TRANSPORTS]], dtype=torch.float64, device=device)  # (1, 2)
        every = comms["torch"].all_gather(mine, "world").wait()  # (world, 2), rank order
    finally:
        for c in comms.values():
            c.close()
    verdict = decide_transport([dict(zip(TRANSPORTS, row)) for row in every.tolist()])
    return dataclasses.replace(verdict, cost_s=time.perf_counter() - start)


def _time_collectives(
    comms: dict[str, Communicator], device: torch.device, world_size: int, sizes: Sequence[int], reps: int
) -> dict[str, float]:
    """This rank's seconds per transport for ``probe_transports``'s collectives over the world."""
    totals = dict.fromkeys(comms, 0.0)
    for i, nbytes in enumerate(sizes):
        n = max(1, nbytes // 4 // world_size) * world_size  # fp32 elements, a multiple of the world
        full = torch.zeros(n, device=device)  # zeros: repeated in-place sums stay finite
        part = torch.zeros(n // world_size, device=device)  # (n / world,)
        for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
            for rep in range(-1 if i == 0 else 0, reps):  # -1: warm-up at the first size (connections, threads)
                for name, c in comms.items():
                    t0 = time.perf_counter()
                    if op is Op.ALL_REDUCE:
                        c.all_reduce(full, "world").wait()
                    elif op is Op.ALL_GATHER:
                        c.all_gather(part, "world").wait()
                    else:
                        c.reduce_scatter(full, "world").wait()
                    if rep >= 0:
                        totals[name] += time.perf_counter() - t0
    return totals
