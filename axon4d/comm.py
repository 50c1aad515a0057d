"""The communication layer: the only module in axon4d that calls collectives (its MPI transport
lives in ``axon4d.mpi``).

Every collective goes through a ``Communicator``, built from a grid's shape and a transport over
its process groups (it knows nothing of the ``Grid`` object). It is issued asynchronously and
returns a ``Handle``; ``Handle.wait()`` blocks until the result is ready and returns it. Each call
is recorded in the ``CommLog`` (axon4d.commlog: op, axis, payload bytes, issue time, time blocked
waiting, completion) — the payload is the size of the full tensor the collective produces, as
defined in docs/design.md §3, so the log can be checked term by term against E8–E13
(``axon4d.geometry``).

Collectives on an axis of size 1 are not issued and not recorded: they move nothing.

The transport sits behind ``Backend``: ``TorchBackend`` uses torch.distributed process groups
(gloo on CPU, NCCL on GPU); ``MPIBackend`` (``axon4d.mpi``) uses mpi4py's non-blocking collectives on
per-axis sub-communicators. A backend only moves bytes; logging, reshaping and handles live here.

Which transport ``axon4d.init`` uses is decided here too (``choose_transport``): under mpirun on
the host with ``comm="auto"``, a short probe times both on the world group and every rank takes
the faster (``probe_transports``, ``decide_transport``); the choice is ``grid.comm.transport``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from axon4d import device as devices
from axon4d import watchdog
from axon4d.commlog import CommLog, CommRecord
from axon4d.geometry import Op
from axon4d.mpi import MPIBackend
from axon4d.shape import GridShape

log = logging.getLogger(__name__)


def _collective(name: str, before_2_12: str) -> Callable[..., Any]:
    """torch.distributed's ``name``, or ``before_2_12`` on a torch that predates it: the
    single-tensor collectives were renamed (all_gather_into_tensor → all_gather_single,
    reduce_scatter_tensor → reduce_scatter_single, the old names deprecated) after 2.11, which GPU
    hosts still run."""
    return getattr(dist, name, None) or getattr(dist, before_2_12)


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
        self._pairs: dict[str, int | None] = {}  # axis -> this rank's index in its gloo pair, or None

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> Work:
        return dist.all_reduce(tensor, group=self.groups[axis], async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work:
        return _collective("all_gather_single", "all_gather_into_tensor")(
            out, inp, group=self.groups[axis], async_op=True
        )

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: str) -> Work:
        group = self.groups[axis]
        index = self._pair_index(axis)
        if index is not None and inp.device.type == "cpu":
            return _ExchangedHalves(out, inp, index, group)
        return _collective("reduce_scatter_single", "reduce_scatter_tensor")(out, inp, group=group, async_op=True)

    def _pair_index(self, axis: str) -> int | None:
        """This rank's index on ``axis`` when the axis is two ranks under gloo (else None): gloo's
        reduce-scatter sends the whole tensor, as an all-reduce does; two ranks exchange halves."""
        if axis not in self._pairs:
            group = self.groups[axis]
            pair = group.size() == 2 and "gloo" in str(dist.get_backend(group))
            self._pairs[axis] = group.rank() if pair else None
        return self._pairs[axis]

    def barrier(self) -> None:
        dist.barrier(group=self.groups["world"])

    def close(self) -> None:
        pass


class _ExchangedHalves:
    """Reduce-scatter over a pair of ranks as one exchange (E5/E11 on gloo): each rank sends the
    half the other keeps and receives the other's copy of its own half into ``out``, then adds its
    own. It moves n/2 bytes each way, where gloo's reduce-scatter moves n like an all-reduce, and
    needs no buffer beyond ``out``. The sum is the same on both ranks (two terms commute)."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, index: int, group: dist.ProcessGroup):
        halves = inp.chunk(2)  # (n/2, ...) each: half i is rank i's result
        splits = [0, 0]
        splits[1 - index] = out.shape[0]  # send to and receive from the other rank only
        self._own: torch.Tensor | None = halves[index]
        self._out = out
        self._work = dist.all_to_all_single(
            out, halves[1 - index], output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True
        )

    def wait(self) -> bool:
        self._work.wait()
        if self._own is not None:
            self._out.add_(self._own)
            self._own = None
        return True

    def get_future(self) -> Any:
        return self._work.get_future()


#: the transports, in the order that breaks an exact tie in the probe (MPI: the launcher's own).
TRANSPORTS = ("mpi", "torch")
#: what ``choose_transport`` answers when the transport is to be measured (``settle_transport``).
PROBE = "probe"
#: the probe's payloads in bytes (fp32; the full tensor of each collective, as in the CommLog) and
#: timed repetitions per collective and payload, after one untimed warm-up.
PROBE_BYTES = (64 << 10, 4 << 20)
PROBE_REPS = 2


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The transport a grid's communication layer uses (``grid.comm.transport``) and why.

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
    default process group. Logged once, on rank 0 (logger "axon4d.comm", level INFO)."""
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
    assert world is not None, "probe_transports needs the default process group (axon4d.launch.start_world)"
    torch_comm = Communicator(shape, TorchBackend({"world": world}))
    torch_comm.barrier()  # ranks arrive apart (imports, start-up); the wait is not the probe's cost
    start = time.perf_counter()
    comms = {"mpi": Communicator(shape, MPIBackend(shape, rank, axes=("world",))), "torch": torch_comm}
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


def make_backend(name: str, groups: dict[str, dist.ProcessGroup], shape: GridShape, rank: int) -> Backend:
    """The transport called ``name`` over a grid's per-axis ``groups`` (torch) or MPI
    sub-communicators mirroring them (``shape`` and ``rank`` place this rank, E1)."""
    if name == "torch":
        return TorchBackend(groups)
    if name == "mpi":
        return MPIBackend(shape, rank)
    raise ValueError(f"unknown communication backend {name!r}; available: 'torch', 'mpi'")


class Handle:
    """An issued collective. ``wait()`` blocks until done and returns the result tensor.

    Until then the handle also holds the collective's input (``source``), which the backend is
    still reading: the memory stays accounted to torch — its allocator and memory trackers see
    it as live, which it is — however the caller drops its own references."""

    def __init__(
        self,
        work: Work | None,
        result: torch.Tensor,
        record: CommRecord | None,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        source: torch.Tensor | None = None,
    ):
        self._work = work
        self._result = result
        self._record = record
        self._finish = finish
        self._done = work is None
        self._source = source if work is not None else None

    def wait(self) -> torch.Tensor:
        if not self._done:
            start = time.perf_counter()
            assert self._work is not None
            dog = watchdog.current()
            if dog is None:  # the common case: nothing to tell, nothing to set up per wait
                self._work.wait()
            else:
                with dog.waiting(self._describe()):
                    try:
                        self._work.wait()
                    except RuntimeError as e:  # a peer died or the transport timed out: say who
                        raise RuntimeError(dog.diagnose(f"{self._describe()} failed ({e})")) from e
            end = time.perf_counter()
            if self._record is not None:
                self._record.t_wait_start, self._record.t_wait_end = start, end
                if self._record.t_done is None or self._record.t_done > end:
                    self._record.t_done = end
            self._done = True
            self._work = self._source = None
            if self._finish is not None:
                self._result = self._finish(self._result)
                self._finish = None
        return self._result

    @property
    def done(self) -> bool:
        return self._done

    def _describe(self) -> str:
        """What this handle waits for, e.g. "all_gather over z (tag E10f, 1.5 MB)"."""
        r = self._record
        if r is None:
            return "a collective"
        return f"{r.op.value} over {r.axis} (tag {r.tag or '-'}, {r.payload_bytes / 1e6:.3g} MB)"


def _stamp_completion(work: Work, record: CommRecord) -> None:
    """Record the time the backend finished ``work`` (when it can tell us)."""

    def done(_: Any = None) -> None:
        now = time.perf_counter()
        if record.t_done is None or record.t_done > now:
            record.t_done = now

    add_done_callback = getattr(work, "add_done_callback", None)  # the MPI transport's requests
    if add_done_callback is not None:
        add_done_callback(done)
        return
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return

    try:
        get_future().add_done_callback(done)
    except (RuntimeError, AttributeError):
        pass


class Communicator:
    """Issues and records every collective of one grid of ``shape`` through ``backend``.
    Axes: x, y, z, data, batch, world (axon4d.shape).

    When the layers' collectives are issued and waited on is the grid's scheduler's decision
    (axon4d.scheduler), which calls this class.
    """

    def __init__(self, shape: GridShape, backend: Backend):
        self.shape = shape
        self.backend = backend
        self.log = CommLog()
        #: which transport and why; ``axon4d.init`` records its choice here (``settle_transport``)
        self.transport = TransportChoice(backend.name, "given to the grid")

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def close(self) -> None:
        self.backend.close()

    @property
    def abort(self) -> Callable[[], None] | None:
        """How to end every rank of the job at once after an error on this one: the MPI transport's
        ``MPI_Abort``; None for torch.distributed, whose ranks learn of it from the watchdog
        (axon4d.watchdog) or their launcher (torchrun's agent stops the others)."""
        abort = getattr(self.backend, "abort", None)
        return abort if callable(abort) else None

    def barrier(self) -> None:
        """Block until every rank of the world arrives here (not logged: it moves no data)."""
        with watchdog.waiting("a barrier of the world"):
            self.backend.barrier()

    def _record(self, op: Op, axis: str, payload: torch.Tensor, tag: str) -> CommRecord:
        record = CommRecord(
            op=op,
            axis=axis,
            group_size=self.shape.size(axis),
            payload_bytes=payload.numel() * payload.element_size(),
            tag=tag,
            t_issue=time.perf_counter(),
        )
        self.log.add(record)
        return record

    def all_reduce(self, tensor: torch.Tensor, axis: str, tag: str = "") -> Handle:
        """Sum ``tensor`` over ``axis``, in place; the handle's result is ``tensor``."""
        if self.shape.size(axis) == 1:
            return Handle(None, tensor, None)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce works in place and needs a contiguous tensor")
        record = self._record(Op.ALL_REDUCE, axis, tensor, tag)
        work = self.backend.all_reduce(tensor, axis)
        _stamp_completion(work, record)
        return Handle(work, tensor, record)

    def all_gather(self, tensor: torch.Tensor, axis: str, dim: int = 0, tag: str = "") -> Handle:
        """Concatenate every rank's ``tensor`` along ``dim``, in order of their ``axis`` index."""
        g = self.shape.size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        dim = dim % tensor.dim()
        inp = tensor.movedim(dim, 0).contiguous()
        out = inp.new_empty((g * inp.shape[0], *inp.shape[1:]))
        record = self._record(Op.ALL_GATHER, axis, out, tag)
        work = self.backend.all_gather(out, inp, axis)
        _stamp_completion(work, record)
        finish = None if dim == 0 else (lambda t: t.movedim(0, dim))
        return Handle(work, out, record, finish, source=inp)

    def reduce_scatter(self, tensor: torch.Tensor, axis: str, dim: int = 0, tag: str = "") -> Handle:
        """Sum ``tensor`` over ``axis`` and keep this rank's chunk of ``dim`` (its ``axis`` index)."""
        g = self.shape.size(axis)
        if g == 1:
            return Handle(None, tensor, None)
        dim = dim % tensor.dim()
        if tensor.shape[dim] % g:
            raise ValueError(
                f"reduce_scatter over {axis}: dim {dim} has size {tensor.shape[dim]}, not divisible by G_{axis} = {g}"
            )
        inp = tensor.movedim(dim, 0).contiguous()
        out = inp.new_empty((inp.shape[0] // g, *inp.shape[1:]))
        record = self._record(Op.REDUCE_SCATTER, axis, inp, tag)
        work = self.backend.reduce_scatter(out, inp, axis)
        _stamp_completion(work, record)
        finish = None if dim == 0 else (lambda t: t.movedim(0, dim))
        return Handle(work, out, record, finish, source=inp)
