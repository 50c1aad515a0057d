"""The communication layer: the only module in axon4d that calls collectives.

Every collective goes through a ``Communicator`` bound to a grid. It is issued asynchronously and
returns a ``Handle``; ``Handle.wait()`` blocks until the result is ready and returns it. Each call
is recorded in the ``CommLog`` (op, axis, payload bytes, issue time, time blocked waiting,
completion) — the payload is the size of the full tensor the collective produces, as defined in
DESIGN.md §3, so the log can be checked term by term against E8–E13 (``axon4d.volume``).

Collectives on an axis of size 1 are not issued and not recorded: they move nothing.

The transport sits behind ``Backend``: ``TorchBackend`` uses torch.distributed process groups
(gloo on CPU, NCCL on GPU); ``MPIBackend`` uses mpi4py's non-blocking collectives on per-axis
sub-communicators. A backend only moves bytes; logging, reshaping and handles live here.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from axon4d.grid import Grid


class Op(str, enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


@dataclasses.dataclass
class CommRecord:
    """One collective as it happened on this rank (times from ``time.perf_counter``)."""

    op: Op
    axis: str
    group_size: int
    payload_bytes: int
    tag: str
    t_issue: float
    t_wait_start: float | None = None
    t_wait_end: float | None = None
    t_done: float | None = None

    @property
    def blocked(self) -> float:
        """Seconds this rank spent blocked in ``wait()`` before the collective completed."""
        if self.t_wait_start is None or self.t_wait_end is None:
            return 0.0
        end = self.t_wait_end if self.t_done is None else min(self.t_wait_end, self.t_done)
        return max(0.0, end - self.t_wait_start)

    @property
    def duration(self) -> float:
        """Seconds from issue to completion (as far as this rank could observe it)."""
        end = self.t_done if self.t_done is not None else self.t_wait_end
        return 0.0 if end is None else max(0.0, end - self.t_issue)

    @property
    def traffic_bytes(self) -> float:
        """Bytes a ring algorithm sends per rank for this collective (DESIGN.md §3)."""
        phi = (self.group_size - 1) / self.group_size
        factor = 2 * phi if self.op == Op.ALL_REDUCE else phi
        return factor * self.payload_bytes


class CommLog:
    """All collectives this rank issued since the last ``clear()``."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.spans: list[tuple[str, float, float]] = []  # (name, start, end): compute, for timelines
        self._lock = threading.Lock()

    def add(self, record: CommRecord) -> None:
        with self._lock:
            self.records.append(record)

    def add_span(self, name: str, start: float, end: float) -> None:
        """Record a stretch of compute (layers call this through ``Scheduler.compute``)."""
        with self._lock:
            self.spans.append((name, start, end))

    def clear(self) -> None:
        with self._lock:
            self.records = []
            self.spans = []

    def bytes_by_axis(self, op: Op | None = None) -> dict[str, int]:
        """Total payload bytes per axis, optionally for one kind of collective."""
        out: dict[str, int] = {}
        for r in self.records:
            if op is None or r.op == op:
                out[r.axis] = out.get(r.axis, 0) + r.payload_bytes
        return out

    def summary(self) -> dict[str, Any]:
        """Per-axis bytes, counts, communication time and blocked time, and the share hidden."""
        axes: dict[str, dict[str, float]] = {}
        for r in self.records:
            a = axes.setdefault(r.axis, {"count": 0, "bytes": 0, "comm_s": 0.0, "blocked_s": 0.0})
            a["count"] += 1
            a["bytes"] += r.payload_bytes
            a["comm_s"] += r.duration
            a["blocked_s"] += r.blocked
        comm = sum(a["comm_s"] for a in axes.values())
        blocked = sum(a["blocked_s"] for a in axes.values())
        hidden = 100.0 * (1.0 - blocked / comm) if comm > 0 else 0.0
        return {"axes": axes, "comm_s": comm, "blocked_s": blocked, "hidden_pct": hidden}

    def format_summary(self) -> str:
        """One line: bytes per axis, communication time, time blocked and the share hidden."""
        s = self.summary()
        parts = [f"{a}={v['bytes'] / 2**20:.2f}MiB" for a, v in sorted(s["axes"].items())]
        return (
            f"comm {' '.join(parts) or 'none'} | time {s['comm_s'] * 1e3:.1f} ms, "
            f"blocked {s['blocked_s'] * 1e3:.1f} ms, hidden {s['hidden_pct']:.0f}%"
        )


class Work(Protocol):
    """What a backend returns for an issued collective."""

    def wait(self) -> Any: ...


class Backend(Protocol):
    """Moves bytes for one grid; every call is asynchronous and operates on contiguous tensors."""

    name: str

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> Work: ...

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work: ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class TorchBackend:
    """Collectives through torch.distributed process groups (gloo, NCCL)."""

    name = "torch"

    def __init__(self, groups: dict[str, dist.ProcessGroup]):
        self.groups = groups

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> Work:
        return dist.all_reduce(tensor, group=self.groups[axis], async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work:
        return dist.all_gather_single(out, inp, group=self.groups[axis], async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work:
        return dist.reduce_scatter_single(out, inp, group=self.groups[axis], async_op=True)

    def barrier(self) -> None:
        dist.barrier(group=self.groups["world"])

    def close(self) -> None:
        pass


class _MPIWork:
    """An MPI request plus what to copy back when it completes (for staged or upcast buffers)."""

    def __init__(self, backend: "MPIBackend", request: Any, finish: Callable[[], None] | None):
        self.backend, self.request, self.finish = backend, request, finish
        self.done = False
        self.on_done: Callable[[], None] | None = None

    def test(self) -> bool:
        """Progress MPI once; True when this request has completed (callers hold the backend lock)."""
        if not self.done and self.request.Test():
            self.done = True
            if self.on_done is not None:
                self.on_done()
        return self.done

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the request completes (at once if it already has)."""
        with self.backend.lock:
            self.on_done = fn
            if self.done:
                fn()

    def wait(self) -> None:
        polls = 0
        while True:  # poll Test under the lock so a progress thread never races for the request
            with self.backend.lock:
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
        with self.backend.lock:
            return self.test()


def mpi_cuda_aware() -> bool:
    """True when the MPI library can read device memory (CUDA-aware MPI).

    Asks mpi4py when it can tell (``MPI.Query_cuda_support`` in newer mpi4py), else trusts
    ``AXON4D_MPI_CUDA_AWARE=1``. Without it, device tensors are staged through host memory."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    return os.environ.get("AXON4D_MPI_CUDA_AWARE", "0") == "1"


class MPIBackend:
    """Non-blocking MPI collectives (mpi4py Iallreduce / Iallgather / Ireduce_scatter_block) on
    per-axis sub-communicators that mirror the grid (split of COMM_WORLD keyed by E1 coordinates).

    Host tensors are passed zero-copy (numpy views of the same memory). bf16/fp16 reductions run in
    fp32 (MPI has no 16-bit float sum) and are copied back on completion. Device tensors go to MPI
    directly when it is CUDA-aware (mpi4py reads ``__cuda_array_interface__``/DLPack; the stream
    is synchronised first) and are staged through host memory otherwise.

    Progress: ``progress="thread"`` (default) runs a Python thread that tests outstanding requests
    every ``poll_us`` microseconds, so collectives advance while matmuls (which release the GIL)
    run; ``"mpich"`` relies on MPICH's own progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1`` in the
    environment before MPI starts); ``"none"`` progresses only inside ``wait()``.
    """

    name = "mpi"

    def __init__(self, grid: "Grid", progress: str | None = None, poll_us: float = 200.0):
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if world.Get_size() != grid.world_size or world.Get_rank() != grid.rank:
            raise ValueError(
                f"the MPI backend needs MPI's world to be the grid's: MPI rank {world.Get_rank()} of "
                f"{world.Get_size()}, grid rank {grid.rank} of {grid.world_size}; launch with "
                f"mpiexec -n {grid.world_size}, or use comm='torch'"
            )
        progress = progress or os.environ.get("AXON4D_MPI_PROGRESS", "thread")
        if progress not in ("thread", "mpich", "none"):
            raise ValueError(f"MPI progress {progress!r}: choose 'thread', 'mpich' or 'none'")
        self.MPI, self.progress, self.poll_s = MPI, progress, poll_us * 1e-6
        self.lock = threading.Lock()
        c = grid.coords
        others = {
            "x": (c["data"], c["z"], c["y"]), "y": (c["data"], c["z"], c["x"]),
            "z": (c["data"], c["y"], c["x"]), "data": (c["z"], c["y"], c["x"]),
            "batch": (c["y"], c["x"]), "world": (),
        }
        self.comms: dict[str, Any] = {}
        for axis, key in others.items():  # color: coordinates on the other axes; key: own index
            color = 0
            for k, size in zip(key, _other_sizes(grid, axis)):
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
        if t.device.type == "cpu":
            return t.detach().numpy(), None
        if self._cuda_aware is None:
            self._cuda_aware = mpi_cuda_aware()
        if self._cuda_aware:
            from axon4d import device as devices

            devices.synchronize(t.device)
            return t.detach(), None
        host = t.detach().cpu()
        return host.numpy(), ((lambda: t.copy_(host)) if writes else None)

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
            return wide, (lambda: t.copy_(wide))
        return t, None

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> Work:
        wide, back = self._reducible(tensor)
        buf, staged = self._buffer(wide, writes=True)
        req = self.comms[axis].Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return self._start(req, [staged, back])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work:
        send, _ = self._buffer(inp.view(torch.uint8), writes=False)  # bytes: any dtype gathers as is
        recv, staged = self._buffer(out.view(torch.uint8), writes=True)
        return self._start(self.comms[axis].Iallgather(send, recv), [staged])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work:
        wide_in, _ = self._reducible(inp)
        wide_out, back = self._reducible(out)
        send, _ = self._buffer(wide_in, writes=False)
        recv, staged = self._buffer(wide_out, writes=True)
        req = self.comms[axis].Ireduce_scatter_block(send, recv, op=self.MPI.SUM)
        return self._start(req, [staged, back])

    def barrier(self) -> None:
        self.comms["world"].Barrier()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for c in self.comms.values():
            c.Free()
        self.comms = {}


def _other_sizes(grid: "Grid", axis: str) -> tuple[int, ...]:
    """Sizes of the axes whose coordinates colour ``axis``'s sub-communicator (see MPIBackend)."""
    s = grid.shape
    return {
        "x": (s.data, s.z, s.y), "y": (s.data, s.z, s.x), "z": (s.data, s.y, s.x),
        "data": (s.z, s.y, s.x), "batch": (s.y, s.x), "world": (),
    }[axis]


def choose_transport(comm: str, backend: str | None, launcher: str, device: torch.device) -> tuple[str, str | None]:
    """(communication transport, torch.distributed backend) for ``axon4d.init``.

    ``backend="mpi"`` means the MPI transport (torch.distributed keeps its default backend for
    group bookkeeping); ``comm="auto"`` picks MPI when launched by mpirun/mpiexec on the host with
    mpi4py importable, and torch.distributed otherwise."""
    if backend == "mpi":
        comm, backend = "mpi", None
    if comm == "auto":
        comm = "torch"
        if launcher == "mpi" and device.type == "cpu" and os.environ.get("AXON4D_COMM", "") != "torch":
            try:
                import mpi4py  # noqa: F401

                comm = "mpi"
            except ImportError:
                pass
    if comm not in ("torch", "mpi"):
        raise ValueError(f"comm={comm!r}: choose 'torch', 'mpi' or 'auto'")
    return comm, backend


def make_backend(name: str, grid: "Grid") -> Backend:
    """The transport called ``name`` for ``grid``."""
    if name == "torch":
        return TorchBackend(grid.groups)
    if name == "mpi":
        return MPIBackend(grid)
    raise ValueError(f"unknown communication backend {name!r}; available: 'torch', 'mpi'")


class Handle:
    """An issued collective. ``wait()`` blocks until done and returns the result tensor."""

    def __init__(
        self,
        work: Work | None,
        result: torch.Tensor,
        record: CommRecord | None,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self._work = work
        self._result = result
        self._record = record
        self._finish = finish
        self._done = work is None

    def wait(self) -> torch.Tensor:
        if not self._done:
            start = time.perf_counter()
            assert self._work is not None
            self._work.wait()
            end = time.perf_counter()
            if self._record is not None:
                self._record.t_wait_start, self._record.t_wait_end = start, end
                if self._record.t_done is None or self._record.t_done > end:
                    self._record.t_done = end
            self._done = True
            self._work = None
            if self._finish is not None:
                self._result = self._finish(self._result)
                self._finish = None
        return self._result

    @property
    def done(self) -> bool:
        return self._done


def _stamp_completion(work: Work, record: CommRecord) -> None:
    """Record the time the backend finished ``work`` (when it can tell us)."""

    def done(_: Any = None) -> None:
        now = time.perf_counter()
        if record.t_done is None or record.t_done > now:
            record.t_done = now

    if isinstance(work, _MPIWork):
        work.add_done_callback(done)
        return
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return

    try:
        get_future().add_done_callback(done)
    except (RuntimeError, AttributeError):
        pass


class Communicator:
    """Issues and records every collective of one grid. Axes: x, y, z, data, batch, world.

    ``scheduler`` (axon4d.overlap) decides when the layers' collectives are issued and waited on.
    """

    def __init__(self, grid: "Grid", backend: str = "torch"):
        from axon4d.overlap import Scheduler  # overlap sits on top of comm; import late

        self.grid = grid
        self.backend = make_backend(backend, grid)
        self.log = CommLog()
        self.scheduler = Scheduler(self)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def close(self) -> None:
        self.scheduler.finish_gradients()
        self.backend.close()

    def barrier(self) -> None:
        """Block until every rank of the world arrives here (not logged: it moves no data)."""
        self.backend.barrier()

    def _record(self, op: Op, axis: str, payload: torch.Tensor, tag: str) -> CommRecord:
        record = CommRecord(
            op=op,
            axis=axis,
            group_size=self.grid.size(axis),
            payload_bytes=payload.numel() * payload.element_size(),
            tag=tag,
            t_issue=time.perf_counter(),
        )
        self.log.add(record)
        return record

    def all_reduce(self, tensor: torch.Tensor, axis: str, tag: str = "") -> Handle:
        """Sum ``tensor`` over ``axis``, in place; the handle's result is ``tensor``."""
        if self.grid.size(axis) == 1:
            return Handle(None, tensor, None)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce works in place and needs a contiguous tensor")
        record = self._record(Op.ALL_REDUCE, axis, tensor, tag)
        work = self.backend.all_reduce(tensor, axis)
        _stamp_completion(work, record)
        return Handle(work, tensor, record)

    def all_gather(self, tensor: torch.Tensor, axis: str, dim: int = 0, tag: str = "") -> Handle:
        """Concatenate every rank's ``tensor`` along ``dim``, in order of their ``axis`` index."""
        g = self.grid.size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        dim = dim % tensor.dim()
        inp = tensor.movedim(dim, 0).contiguous()
        out = inp.new_empty((g * inp.shape[0], *inp.shape[1:]))
        record = self._record(Op.ALL_GATHER, axis, out, tag)
        work = self.backend.all_gather(out, inp, axis)
        _stamp_completion(work, record)
        finish = None if dim == 0 else (lambda t: t.movedim(0, dim))
        return Handle(work, out, record, finish)

    def reduce_scatter(self, tensor: torch.Tensor, axis: str, dim: int = 0, tag: str = "") -> Handle:
        """Sum ``tensor`` over ``axis`` and keep this rank's chunk of ``dim`` (its ``axis`` index)."""
        g = self.grid.size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        dim = dim % tensor.dim()
        if tensor.shape[dim] % g:
            raise ValueError(
                f"reduce_scatter over {axis}: dim {dim} has size {tensor.shape[dim]}, "
                f"not divisible by G_{axis} = {g}"
            )
        inp = tensor.movedim(dim, 0).contiguous()
        out = inp.new_empty((inp.shape[0] // g, *inp.shape[1:]))
        record = self._record(Op.REDUCE_SCATTER, axis, inp, tag)
        work = self.backend.reduce_scatter(out, inp, axis)
        _stamp_completion(work, record)
        finish = None if dim == 0 else (lambda t: t.movedim(0, dim))
        return Handle(work, out, record, finish)
