"""The MPI transport of the communication layer (``axon4d.comm.communicator``): mpi4py's non-blocking
collectives on per-axis sub-communicators that mirror the grid (docs/design.md §7).

``axon4d.comm.communicator`` builds an ``MPITransport`` for ``axon4d.init(..., backend="mpi")``, or under mpirun on
the host when its transport probe finds MPI the faster (``axon4d.comm.transport.probe_transports``); only
its ``Communicator`` calls it. Like every transport, it only moves
bytes: logging, reshaping and handles live in ``axon4d.comm.communicator``.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from axon4d import device as devices
from axon4d.grid.shape import AXES, Axis, GridShape, members


class _MPIWork:
    """An MPI request plus what to copy back when it completes (for staged or upcast buffers)."""

    def __init__(self, transport: MPITransport, request: Any, finish: Callable[[], None] | None):
        self.transport, self.request, self.finish = transport, request, finish
        self.done = False
        self.on_done: Callable[[], None] | None = None

    def test(self) -> bool:
        """Progress MPI once; True when this request has completed (callers hold the transport lock)."""
        if not self.done and self.request.Test():
            self.done = True
            if self.on_done is not None:
                self.on_done()
        return self.done

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the request completes (at once if it already has)."""
        with self.transport.lock:
            self.on_done = fn
            if self.done:
                fn()

    def wait(self) -> None:
        polls = 0
        while True:  # poll Test under the lock so a progress thread never races for the request
            with self.transport.lock:
                if self.test():
                    break
            polls += 1  # ranks may share cores: yield, then back off so the peers we wait for run
            if polls < 20:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 2e-5 * (polls - 19)))
        if self.finish is not None:
            self.finish()
            self.finish = None

    def is_completed(self) -> bool:
        with self.transport.lock:
            return self.test()


class _Requests:
    """Several MPI requests tested as one (a shift's send and receive)."""

    def __init__(self, MPI: Any, requests: list[Any]):
        self.MPI, self.requests = MPI, requests

    def Test(self) -> bool:  # an MPI request's name: what _MPIWork calls
        return bool(self.MPI.Request.Testall(self.requests))


def mpi_cuda_aware() -> bool:
    """True when the MPI library reports that it reads and writes device memory (CUDA-aware MPI).

    ``AXON4D_MPI_CUDA_AWARE=1`` or ``=0`` decides when set (an override for libraries that
    cannot tell). Otherwise the library is asked, first answer wins: mpi4py's
    ``MPI.Query_cuda_support()`` where mpi4py has it; the MPI 4.1 info key
    ``mpi_memory_alloc_kinds`` of ``COMM_WORLD`` naming the accelerator's memory ("cuda" or "rocm",
    ``axon4d.device.accelerator_kind``); the ``MPIX_Query_cuda_support``/``MPIX_Query_rocm_support``
    extension of Open MPI and MPICH, called through the library mpi4py loaded. No answer: False,
    and device tensors are staged through host memory."""
    env = os.environ.get("AXON4D_MPI_CUDA_AWARE", "")
    if env in ("0", "1"):
        return env == "1"
    from mpi4py import MPI

    kind = devices.accelerator_kind()
    query = getattr(MPI, f"Query_{kind}_support", None)
    if query is not None:
        return bool(query())
    kinds = _memory_alloc_kinds(MPI)
    if kinds is not None and any(k.split(":")[0] == kind for k in kinds):
        return True
    extension = _mpix_query(MPI, kind)
    return bool(extension) if extension is not None else False


def _memory_alloc_kinds(MPI: Any) -> list[str] | None:
    """The memory kinds of MPI 4.1's ``mpi_memory_alloc_kinds`` on ``COMM_WORLD`` (e.g. "system",
    "mpi", "cuda:device"), or None when the library does not say."""
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception:
        return None
    return [k.strip() for k in value.split(",")] if value else None


def _mpix_query(MPI: Any, kind: str) -> int | None:
    """``MPIX_Query_<kind>_support()`` of the MPI library mpi4py loaded, or None when it lacks it."""
    try:
        lib = ctypes.CDLL(MPI.__file__)  # symbol lookups search the extension and the libmpi it links
        fn = getattr(lib, f"MPIX_Query_{kind}_support")
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return int(fn())


class MPITransport:
    """Non-blocking MPI collectives (mpi4py Iallreduce / Iallgather / Ireduce_scatter_block) on
    per-axis sub-communicators that mirror the grid (split of COMM_WORLD keyed by E1 coordinates).

    Host tensors are passed zero-copy (numpy views of the same memory). bf16/fp16 reductions run in
    fp32 (MPI has no 16-bit float sum) and are copied back on completion. Device tensors go to MPI
    directly when the library reports it is CUDA-aware (``mpi_cuda_aware``; mpi4py reads DLPack /
    ``__cuda_array_interface__``; the device is synchronised first, so MPI reads finished data) and
    are staged through pinned host memory otherwise: copied to the host before the call, and for
    outputs copied back to the device when the request completes.

    Progress: ``progress="thread"`` (default) runs a Python thread that tests outstanding requests
    every ``poll_us`` microseconds, so collectives advance while matmuls (which release the GIL)
    run; ``"mpich"`` relies on MPICH's own progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1`` in the
    environment before MPI starts); ``"none"`` progresses only inside ``wait()``.

    ``axes``: build the sub-communicators of these axes only (default: every axis); each one is a
    collective split of ``COMM_WORLD`` (the transport probe of ``axon4d.comm.transport`` needs only "world").
    """

    name = "mpi"
    #: Ireduce_scatter_block writes the caller's output only; what MPI stages inside is its own
    #: memory, not a tensor of the job's
    stages_reduce_scatter = False

    def __init__(
        self,
        shape: GridShape,
        rank: int,
        progress: str | None = None,
        poll_us: float = 200.0,
        axes: tuple[Axis, ...] | None = None,
    ):
        from mpi4py import MPI  # optional dependency (the "mpi" extra), needed only here

        world = MPI.COMM_WORLD
        if world.Get_size() != shape.world_size or world.Get_rank() != rank:
            raise ValueError(
                f"the MPI transport needs MPI's world to be the grid's: MPI rank {world.Get_rank()} of "
                f"{world.Get_size()}, grid rank {rank} of {shape.world_size}; launch with "
                f"mpiexec -n {shape.world_size}, or use comm='torch'"
            )
        progress = progress or os.environ.get("AXON4D_MPI_PROGRESS", "thread")
        if progress not in ("thread", "mpich", "none"):
            raise ValueError(f"MPI progress {progress!r}: choose 'thread', 'mpich' or 'none'")
        self.MPI, self.progress, self.poll_s = MPI, progress, poll_us * 1e-6
        self.lock = threading.Lock()
        c = shape.coordinates(rank)
        others: dict[Axis, tuple[int, ...]] = {
            "x": (c["data"], c["z"], c["y"]),
            "y": (c["data"], c["z"], c["x"]),
            "z": (c["data"], c["y"], c["x"]),
            "data": (c["z"], c["y"], c["x"]),
            "batch": (c["y"], c["x"]),
            "world": (),
        }
        self.comms: dict[str, Any] = {}
        for axis, key in others.items():  # color: coordinates on the other axes; key: own index
            if axes is not None and axis not in axes:
                continue
            color = 0
            for k, size in zip(key, _other_sizes(shape, axis)):
                color = color * size + k
            self.comms[axis] = world.Split(color, c[axis])
        self._pending: list[_MPIWork] = []
        self._wake = threading.Event()
        self._stop = False
        self._cuda_aware: bool | None = None
        self._thread = None
        if progress == "thread":
            self._thread = threading.Thread(target=self._poll, name="axon4d-mpi-progress", daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop:
            self._wake.wait()
            with self.lock:
                self._pending = [w for w in self._pending if not w.test()]
                if not self._pending:
                    self._wake.clear()
            time.sleep(self.poll_s)

    def _buffer(self, t: torch.Tensor, writes: bool) -> tuple[Any, Callable[[], None] | None]:
        """(what MPI reads/writes for ``t``, copy-back to run after completion or None)."""
        if devices.is_host(t.device):
            return t.detach().numpy(), None
        if self._cuda_aware is None:
            self._cuda_aware = mpi_cuda_aware()
        if self._cuda_aware:
            devices.synchronize(t.device)
            return t.detach(), None
        host = devices.staging_copy(t)

        def copy_back() -> None:
            t.copy_(host)

        return host.numpy(), (copy_back if writes else None)

    def _start(self, request: Any, finish: list[Callable[[], None] | None]) -> _MPIWork:
        steps = [f for f in finish if f is not None]

        def run_steps() -> None:
            for step in steps:  # staged copy-back first, then the fp32 → 16-bit copy
                step()

        work = _MPIWork(self, request, run_steps if steps else None)
        if self._thread is not None:
            with self.lock:
                self._pending.append(work)
            self._wake.set()
        return work

    def _reducible(self, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """``t`` itself, or an fp32 copy for 16-bit floats with a copy-back into ``t``."""
        if t.dtype in (torch.bfloat16, torch.float16):
            wide = t.float()

            def narrow() -> None:
                t.copy_(wide)

            return wide, narrow
        return t, None

    def all_reduce(self, tensor: torch.Tensor, axis: Axis) -> _MPIWork:
        wide, back = self._reducible(tensor)
        buf, staged = self._buffer(wide, writes=True)
        req = self.comms[axis].Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return self._start(req, [staged, back])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis) -> _MPIWork:
        send, _ = self._buffer(inp.view(torch.uint8), writes=False)  # bytes: any dtype gathers as is
        recv, staged = self._buffer(out.view(torch.uint8), writes=True)
        return self._start(self.comms[axis].Iallgather(send, recv), [staged])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis) -> _MPIWork:
        wide_in, _ = self._reducible(inp)
        wide_out, back = self._reducible(out)
        send, _ = self._buffer(wide_in, writes=False)
        recv, staged = self._buffer(wide_out, writes=True)
        req = self.comms[axis].Ireduce_scatter_block(send, recv, op=self.MPI.SUM)
        return self._start(req, [staged, back])

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, send_rows: list[int], recv_rows: list[int], axis: Axis
    ) -> _MPIWork:
        """Ialltoallv of whole rows, as bytes (any dtype moves as is): ``send_rows[i]`` rows of
        ``inp`` to index i of ``axis``, ``recv_rows[j]`` rows from index j into ``out``."""
        send_row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes per row
        recv_row = math.prod(out.shape[1:]) * out.element_size()
        send, _ = self._buffer(inp.reshape(-1).view(torch.uint8), writes=False)
        recv, staged = self._buffer(out.view(-1).view(torch.uint8), writes=True)
        send_counts = [n * send_row for n in send_rows]
        recv_counts = [n * recv_row for n in recv_rows]
        req = self.comms[axis].Ialltoallv(
            [send, (send_counts, _displacements(send_counts)), self.MPI.BYTE],
            [recv, (recv_counts, _displacements(recv_counts)), self.MPI.BYTE],
        )
        return self._start(req, [staged])

    def shift(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis, channel: int) -> _MPIWork:
        """Isend of ``inp`` to the next rank of ``axis`` and Irecv of ``out`` from the previous one, as
        bytes, under tag ``channel``; one work that completes when both have."""
        comm = self.comms[axis]
        me, g = comm.Get_rank(), comm.Get_size()
        send, _ = self._buffer(inp.view(-1).view(torch.uint8), writes=False)
        recv, staged = self._buffer(out.view(-1).view(torch.uint8), writes=True)
        sending = comm.Isend(send, dest=(me + 1) % g, tag=channel)
        receiving = comm.Irecv(recv, source=(me - 1) % g, tag=channel)
        return self._start(_Requests(self.MPI, [sending, receiving]), [staged])

    def barrier(self) -> None:
        self.comms["world"].Barrier()

    def open_axis(self, axis: Axis, shape: GridShape, rank: int) -> None:
        """A sub-communicator for a product of axes (``axon4d.grid.shape.members``): a collective
        split of the world, coloured by this rank's coordinates on the other axes, keyed by its
        index on ``axis``. Every rank calls it, in the same order (``Grid.open_axis``)."""
        if axis in self.comms:
            return
        inside = members(axis)
        color = 0
        for a in reversed(AXES):  # the other axes' coordinates, slowest first
            if a not in inside:
                color = color * shape.size(a) + shape.coordinate(rank, a)
        self.comms[axis] = self.MPI.COMM_WORLD.Split(color, shape.coordinate(rank, axis))

    def abort(self) -> None:
        """End every rank of the job now (``MPI_Abort`` on the world, exit code 1): after an error
        on this rank, the others may be blocked in collectives it will never join."""
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for c in self.comms.values():
            c.Free()
        self.comms = {}


def _displacements(counts: list[int]) -> list[int]:
    """Where each count's block begins in a buffer of the blocks back to back."""
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def _other_sizes(s: GridShape, axis: Axis) -> tuple[int, ...]:
    """Sizes of the axes whose coordinates colour ``axis``'s sub-communicator (see MPITransport)."""
    return {
        "x": (s.data, s.z, s.y),
        "y": (s.data, s.z, s.x),
        "z": (s.data, s.y, s.x),
        "data": (s.z, s.y, s.x),
        "batch": (s.y, s.x),
        "world": (),
    }[axis]
