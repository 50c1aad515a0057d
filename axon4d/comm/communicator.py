"""The communication layer: the only module in axon4d that calls collectives (its MPI transport
lives in ``axon4d.comm.mpi``).

Every collective goes through a ``Communicator``, built from a grid's shape and a transport over
its process groups (it knows nothing of the ``Grid`` object). It is issued asynchronously and
returns a ``Handle``; ``Handle.wait()`` blocks until the result is ready and returns it. Each call
is recorded in the ``CommLog`` (axon4d.comm.log: op, axis, payload bytes, issue time, time blocked
waiting, completion) — the payload is the size of the full tensor the collective produces, as
defined in docs/design.md §3, so the log can be checked term by term against E8–E13
(``axon4d.layout.geometry``).

Collectives on an axis of size 1 are not issued and not recorded: they move nothing.

The transport sits behind ``Transport``: ``TorchTransport`` uses torch.distributed process groups
(its backend: gloo on CPU, NCCL on GPU; gloo's reduce-scatter as one exchange of chunks:
``axon4d.comm.gloo_exchange``); ``MPITransport`` (``axon4d.comm.mpi``) uses mpi4py's
non-blocking collectives on per-axis sub-communicators. A transport only moves bytes; logging,
reshaping and handles live here.

Which transport ``axon4d.init`` uses is decided by ``axon4d.comm.transport``; the choice and why are
``Communicator.transport_choice`` (``grid.comm.transport_choice``), a ``TransportChoice``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from axon4d import device as devices
from axon4d.comm import host_mesh
from axon4d.comm.gloo_exchange import ExchangedChunks, ExchangedHalves, index_under_gloo
from axon4d.comm.handle import Handle, Work, stamp_completion
from axon4d.comm.log import CommLog, CommRecord, timing_default
from axon4d.comm.mpi import MPITransport
from axon4d.device.clock import Clock
from axon4d.grid.shape import ALL_AXES, Axis, GridShape
from axon4d.layout.geometry import Op, Term
from axon4d.reliability import watchdog


def _collective(name: str, before_2_12: str) -> Callable[..., Any]:
    """torch.distributed's ``name``, or ``before_2_12`` on a torch that predates it: the
    single-tensor collectives were renamed (all_gather_into_tensor → all_gather_single,
    reduce_scatter_tensor → reduce_scatter_single, the old names deprecated) after 2.11, which GPU
    hosts still run."""
    return getattr(dist, name, None) or getattr(dist, before_2_12)


_ALL_GATHER = _collective("all_gather_single", "all_gather_into_tensor")
_REDUCE_SCATTER = _collective("reduce_scatter_single", "reduce_scatter_tensor")


class Transport(Protocol):
    """Moves bytes for one grid; every call is asynchronous and operates on contiguous tensors."""

    name: str
    #: whether a reduce-scatter over more than two ranks holds a buffer of its input's size (the
    #: chunks received from the other ranks) until it is waited on; the planner's memory model
    #: prices it where the machine file says so (``Machine.staged_reduce_scatter``)
    stages_reduce_scatter: bool

    def all_reduce(self, tensor: torch.Tensor, axis: Axis) -> Work: ...

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis) -> Work: ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis) -> Work: ...

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, send_rows: list[int], recv_rows: list[int], axis: Axis
    ) -> Work: ...

    def shift(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis, channel: int) -> Work: ...

    def barrier(self) -> None: ...

    def open_axis(self, axis: Axis, shape: GridShape, rank: int) -> None: ...

    def close(self) -> None: ...


class _Works:
    """Several torch.distributed works waited on as one (a shift's send and receive)."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class TorchTransport:
    """Collectives through torch.distributed process groups (backends gloo, NCCL)."""

    name = "torch"

    def __init__(self, groups: dict[str, dist.ProcessGroup]):
        self.groups = groups
        #: axis -> this rank's index on it where the axis is two or more ranks under gloo, else None
        self.exchanged = {axis: index_under_gloo(group) for axis, group in groups.items()}
        # under gloo the exchange receives every rank's chunk (ExchangedChunks); NCCL stages
        # through its communicator's fixed buffers
        self.stages_reduce_scatter = any(index is not None for index in self.exchanged.values())

    def all_reduce(self, tensor: torch.Tensor, axis: Axis) -> Work:
        return dist.all_reduce(tensor, group=self.groups[axis], async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis) -> Work:
        return _ALL_GATHER(out, inp, group=self.groups[axis], async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis) -> Work:
        group, index = self.groups[axis], self.exchanged[axis]
        if index is not None and devices.is_host(inp.device):
            if group.size() == 2:
                return ExchangedHalves(out, inp, index, group)
            return ExchangedChunks(out, inp, group)
        return _REDUCE_SCATTER(out, inp, group=group, async_op=True)

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, send_rows: list[int], recv_rows: list[int], axis: Axis
    ) -> Work:
        return dist.all_to_all_single(
            out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows, group=self.groups[axis], async_op=True
        )

    def shift(self, out: torch.Tensor, inp: torch.Tensor, axis: Axis, channel: int) -> Work:
        """Send ``inp`` to the next rank of ``axis`` and receive ``out`` from the previous one (a ring
        step): one batch of isend/irecv (NCCL fuses it; gloo runs the pair), ``channel`` its tag."""
        group = self.groups[axis]
        me, g = group.rank(), group.size()
        to, source = (dist.get_global_rank(group, (me + step) % g) for step in (1, -1))
        ops = [dist.P2POp(dist.isend, inp, to, group, channel), dist.P2POp(dist.irecv, out, source, group, channel)]
        return _Works(dist.batch_isend_irecv(ops))

    def barrier(self) -> None:
        dist.barrier(group=self.groups["world"])

    def open_axis(self, axis: Axis, shape: GridShape, rank: int) -> None:
        """Use the group the grid has just put in ``groups[axis]`` (a product of axes, ``Grid.open_axis``)."""
        self.exchanged[axis] = index_under_gloo(self.groups[axis])
        self.stages_reduce_scatter = self.stages_reduce_scatter or self.exchanged[axis] is not None

    def close(self) -> None:
        pass


def host_group(timeout_s: float) -> dist.ProcessGroup:
    """A new process group of every rank on the host backend (gloo), for the collectives of
    checkpoints: DCP's gathers of pickled plans and results and its broadcast of the index stay in
    host memory (a grid's ``Grid.host_group``, for blocking saves and loads), and a checkpoint
    written in the background (``axon4d.checkpoint.AsyncSaver``) coordinates on a group of its own
    that never interleaves with the ones the grid's groups carry meanwhile. Every rank creates it at
    the same point (a collective); each of its collectives fails after ``timeout_s`` seconds.
    ``close_group`` releases it.

    Its pairs of ranks connect lazily (``axon4d.comm.host_mesh.lazy_connections``): making it costs
    each rank one store request (its own address, ≈ 170 B), and a pair connects at its first
    message, reading the other's address once. DCP's coordination (gather to rank 0, scatter and
    broadcast from it, ring all-gathers, barriers) thus costs rank 0 ≈ 2·(world − 1) store requests
    and the others a few each — O(world) per rank where gloo's full mesh read world records of
    ≈ 170 + 8·world bytes each on every rank at creation, O(world²) (bench/host_group_scaling.py). First
    ``axon4d.comm.host_mesh.check`` makes sure this rank can hold up to world − 1 sockets (rank 0
    does) and reach the others (a ``RuntimeError`` saying what to set where not); rank 0 logs what
    it found (logger "axon4d.comm.communicator", INFO)."""
    found = host_mesh.check(dist.get_world_size())
    if dist.get_rank() == 0:
        logging.getLogger(__name__).info(found)
    timeout = datetime.timedelta(seconds=timeout_s)
    with host_mesh.lazy_connections():
        return dist.new_group(backend=devices.default_backend(devices.HOST), timeout=timeout)


def close_group(group: dist.ProcessGroup) -> None:
    """Release a group made by ``host_group`` (its connections and threads)."""
    dist.destroy_process_group(group)


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The transport a grid's communication layer uses (``grid.comm.transport_choice``) and why.

    ``seconds``: when the probe chose, per transport, the slowest rank's total time for the probe's
    collectives (the figures compared); ``cost_s``: this rank's wall time for the whole probe, from
    the barrier that starts it to the verdict."""

    name: str  # "mpi" | "torch"
    why: str
    seconds: dict[str, float] | None = None
    cost_s: float | None = None

    def describe(self) -> str:
        """One line for a log, e.g. "mpi (probe over 8 ranks: mpi 0.081 s, torch 0.143 s; cost 0.30 s)"."""
        if self.seconds is None:
            return f"{self.name} ({self.why})"
        figures = ", ".join(f"{n} {s:.3g} s" for n, s in self.seconds.items())
        cost = "" if self.cost_s is None else f"; cost {self.cost_s:.2g} s"
        return f"{self.name} ({self.why}: {figures}{cost})"


def make_transport(name: str, groups: dict[str, dist.ProcessGroup], shape: GridShape, rank: int) -> Transport:
    """The transport called ``name`` over a grid's per-axis ``groups`` (torch) or MPI
    sub-communicators mirroring them (``shape`` and ``rank`` place this rank, E1)."""
    if name == "torch":
        return TorchTransport(groups)
    if name == "mpi":
        return MPITransport(shape, rank)
    raise ValueError(f"unknown communication transport {name!r}; available: 'torch', 'mpi'")


class Communicator:
    """Issues and records every collective of one grid of ``shape`` through ``transport``.
    Axes: x, y, z, data, batch, world (axon4d.grid.shape).

    When the layers' collectives are issued and waited on is the grid's scheduler's decision
    (axon4d.scheduler), which calls this class.
    """

    def __init__(self, shape: GridShape, transport: Transport, clock: Clock | None = None, timing: bool | None = None):
        self.shape = shape
        self._sizes: dict[str, int] = {axis: shape.size(axis) for axis in ALL_AXES}  # looked up per collective
        self.transport = transport
        #: whether collectives are timed (None: ``$AXON4D_COMM_TIMING``, on unless "0"); untimed, an
        #: accelerator records no timing events and the log no times (axon4d.comm.log)
        self.timing = timing_default() if timing is None else timing
        #: when collectives ran: the host's clock, or the grid device's (axon4d.device.Clock); the
        #: host's when untimed, so that compute spans take no device events either
        host = Clock(devices.HOST)
        self.log = CommLog(host, timed=self.timing)
        self._phase = ""  # ``in_phase``'s
        self.use_clock(host if clock is None or not self.timing else clock)
        #: which transport and why; ``axon4d.init`` records its choice here (``settle_transport``)
        self.transport_choice = TransportChoice(transport.name, "given to the grid")

    def use_clock(self, clock: Clock) -> None:
        """Time collectives, handles' waits and the log's compute spans on ``clock`` from now on: the
        host's, read at once, or an accelerator's (``on_device``), whose marks are read with the log."""
        self.clock = self.log.clock = clock
        self._on_device = clock.on_device
        #: the clock whose marks handles take (an accelerator's), or None: host times are read directly
        self.device_clock = clock if clock.on_device else None

    def _size(self, axis: Axis) -> int:
        """G_axis (a dict lookup per collective; an unknown axis gets ``GridShape.size``'s error)."""
        size = self._sizes.get(axis)
        if size is None:  # a product of axes an expert layout opened (``Grid.open_axis``): kept from now on
            size = self._sizes[axis] = self.shape.size(axis)
        return size

    @property
    def transport_name(self) -> str:
        return self.transport.name

    def close(self) -> None:
        self.transport.close()

    @property
    def abort(self) -> Callable[[], None] | None:
        """How to end every rank of the job at once after an error on this one: the MPI transport's
        ``MPI_Abort``; None for torch.distributed, whose ranks learn of it from the watchdog
        (axon4d.reliability.watchdog) or their launcher (torchrun's agent stops the others)."""
        abort = getattr(self.transport, "abort", None)
        return abort if callable(abort) else None

    def barrier(self) -> None:
        """Block until every rank of the world arrives here (not logged: it moves no data)."""
        with watchdog.waiting("a barrier of the world"):
            self.transport.barrier()

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Log the collectives issued inside as issued in ``phase`` (the optimizer step's, e.g.)."""
        before, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = before

    def _current_phase(self) -> str:
        """The part of the step a collective issued now belongs to: ``in_phase``'s, else "backward"
        inside autograd's backward pass (a recomputed forward included), else "forward"."""
        if self._phase:
            return self._phase
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def _record(self, op: Op, axis: Axis, group: int, payload_bytes: int, tag: Term | str) -> CommRecord:
        record = CommRecord(op, axis, group, payload_bytes, tag, time.perf_counter(), phase=self._current_phase())
        if self._on_device:  # the compute stream's position: the collective cannot start before it
            record.mark("t_issue", self.clock.mark())
        self.log.add(record)
        return record

    def all_reduce(self, tensor: torch.Tensor, axis: Axis, tag: Term | str = "") -> Handle:
        """Sum ``tensor`` over ``axis``, in place; the handle's result is ``tensor``."""
        g = self._size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce works in place and needs a contiguous tensor")
        record = self._record(Op.ALL_REDUCE, axis, g, tensor.nbytes, tag)
        work = self.transport.all_reduce(tensor, axis)
        if self.timing:
            stamp_completion(work, record, self.clock)
        return Handle(work, tensor, record, None, None, self.device_clock, self.timing)

    def all_gather(self, tensor: torch.Tensor, axis: Axis, dim: int = 0, tag: Term | str = "") -> Handle:
        """Concatenate every rank's ``tensor`` along ``dim``, in order of their ``axis`` index."""
        g = self._size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        dim = dim % tensor.dim()
        inp = tensor if dim == 0 and tensor.is_contiguous() else tensor.movedim(dim, 0).contiguous()
        out = inp.new_empty(g * inp.numel())  # (G·n,): flat, then shaped (the cheaper allocation)
        if inp.dim() > 1:
            out = out.view(g * inp.shape[0], *inp.shape[1:])
        record = self._record(Op.ALL_GATHER, axis, g, g * inp.nbytes, tag)
        work = self.transport.all_gather(out, inp, axis)
        if self.timing:
            stamp_completion(work, record, self.clock)
        finish = None if dim == 0 else (lambda t: t.movedim(0, dim))
        return Handle(work, out, record, finish, inp, self.device_clock, self.timing)

    def all_to_all(
        self, tensor: torch.Tensor, axis: Axis, send_rows: list[int], recv_rows: list[int], tag: Term | str = ""
    ) -> Handle:
        """Exchange rows of ``tensor`` over ``axis``: rows ``send_rows[i]`` (dim 0, in order) go to the
        rank of index i on ``axis``, and the result holds the ``recv_rows[j]`` rows received from
        each rank j, concatenated in index order: (Σ recv_rows, …). The split sizes must agree
        across ranks (what i sends to j is what j expects from i) — the caller derives both from one
        exchange of counts (``axon4d.nn.moe_routes``); a rank may send or receive no row at all.
        The log records the bytes this rank sends, its own rows included (payload of docs/design.md
        E16). On an axis of one rank the result is ``tensor`` itself."""
        g = self._size(axis)
        if len(send_rows) != g or len(recv_rows) != g:
            raise ValueError(
                f"all_to_all over {axis}: {len(send_rows)} send and {len(recv_rows)} receive split sizes for "
                f"G_{axis} = {g} ranks; give one row count per rank of the axis"
            )
        if sum(send_rows) != tensor.shape[0] or min(send_rows + recv_rows, default=0) < 0:
            raise ValueError(
                f"all_to_all over {axis}: send split sizes {send_rows} must be row counts ≥ 0 adding up to "
                f"the tensor's {tensor.shape[0]} rows"
            )
        if g == 1:
            return Handle(None, tensor, None)
        inp = tensor.contiguous()
        out = inp.new_empty((sum(recv_rows), *inp.shape[1:]))  # (Σ recv_rows, …)
        record = self._record(Op.ALL_TO_ALL, axis, g, inp.nbytes, tag)
        work = self.transport.all_to_all(out, inp, list(send_rows), list(recv_rows), axis)
        if self.timing:
            stamp_completion(work, record, self.clock)
        return Handle(work, out, record, None, inp, self.device_clock, self.timing)

    def shift(self, tensor: torch.Tensor, axis: Axis, tag: Term | str = "") -> Handle:
        """One ring step over ``axis``: send ``tensor`` to the rank of the next index (the last to the
        first) and receive the previous one's, of the same shape and dtype; the handle's result is
        what arrived. The log records the bytes sent (``tensor``'s). Shifts of different ``tag``s may
        be in flight at once (each moves on a channel of its own); of one tag, issue the next only
        after waiting on the last. On an axis of one rank the result is ``tensor`` itself."""
        g = self._size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        inp = tensor.contiguous()
        out = torch.empty_like(inp)
        record = self._record(Op.SHIFT, axis, g, inp.nbytes, tag)
        work = self.transport.shift(out, inp, axis, zlib.crc32(str(tag).encode()) & 0x7FFF)
        if self.timing:
            stamp_completion(work, record, self.clock)
        return Handle(work, out, record, None, inp, self.device_clock, self.timing)

    def reduce_scatter(
        self, tensor: torch.Tensor, axis: Axis, dim: int = 0, tag: Term | str = "", out: torch.Tensor | None = None
    ) -> Handle:
        """Sum ``tensor`` over ``axis`` and keep this rank's chunk of ``dim`` (its ``axis`` index);
        ``out``: a contiguous tensor of the chunk's shape (``dim`` first) to write it into, e.g. a
        slice of a gradient bucket. On an axis of one rank the result is ``tensor`` itself."""
        g = self._size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        dim = dim % tensor.dim()
        if tensor.shape[dim] % g:
            raise ValueError(
                f"reduce_scatter over {axis}: dim {dim} has size {tensor.shape[dim]}, not divisible by G_{axis} = {g}"
            )
        inp = tensor if dim == 0 and tensor.is_contiguous() else tensor.movedim(dim, 0).contiguous()
        if out is None:
            out = inp.new_empty(inp.numel() // g)  # (n/G,): flat, then shaped (the cheaper allocation)
            if inp.dim() > 1:
                out = out.view(inp.shape[0] // g, *inp.shape[1:])
        else:
            shape = (inp.shape[0] // g, *inp.shape[1:])
            if out.shape != shape or not out.is_contiguous() or out.dtype != inp.dtype:
                raise ValueError(
                    f"reduce_scatter over {axis}: out is {tuple(out.shape)} {out.dtype}, the chunk is {shape} "
                    f"{inp.dtype} (contiguous)"
                )
        record = self._record(Op.REDUCE_SCATTER, axis, g, inp.nbytes, tag)
        work = self.transport.reduce_scatter(out, inp, axis)
        if self.timing:
            stamp_completion(work, record, self.clock)
        finish = None if dim == 0 else (lambda t: t.movedim(0, dim))
        return Handle(work, out, record, finish, inp, self.device_clock, self.timing)
