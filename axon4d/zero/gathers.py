"""ZeRO's all-gathers over data: each rank's updated parts back into the whole parameters, bucket
by bucket, optionally left in flight into the next forward (docs/design.md §4, "ZeRO").

After a sharded step every data rank holds the new values of its own part of each parameter only;
an all-gather over data (the log's ``GATHER_TAG``, the planner's term) makes the parameters whole
again. The parameters are gathered in buckets of the grid's ``bucket_bytes`` (0: one parameter per
bucket), one open bucket per dtype — half the bytes for the 16-bit weights.

- **Eager** (``ParamGathers.run(defer=False)``): each bucket's gather is in flight while the next
  bucket steps, the last waited before the step returns: the parameters are whole when it returns.
- **Deferred** (``defer=True``, the training job's): every bucket's gather is issued as its bucket
  steps and none is waited in the step: all are left in flight when the step returns and each is
  completed as late as correctness allows — before the forward of a module that holds one of its
  parameters (a forward pre-hook), before the grid's scheduler reads one of its weight shards for a
  gather over z (E10f, an OAG prefetch: ``Scheduler.defer_writes``), or at ``settle()``
  (checkpoints, the next step) — in issue order, which is the parameters' order and so, near
  enough, the forward's. The gathers run under the next forward instead of between steps: the
  first layers' buckets are waited before its first GEMMs, the last layers' while the first
  compute. Their buffers (every bucket's: the parameters' bytes received and 1/G_data of them sent)
  live until their bucket is settled. Reading the communication log meanwhile does not wait for
  them (axon4d.comm.log: their times are reported in the read after they are waited).
  A parameter read any other way between the step and its module's forward (``p.data`` in user
  code) must be settled first: ``ShardedOptimizer.settle()``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from axon4d.comm.communicator import Communicator, Handle
from axon4d.layout.geometry import Term

#: the log's tag of the parameters' all-gather over data (docs/design.md §4): the planner's term
GATHER_TAG = Term.ZERO_GATHER


@dataclasses.dataclass
class Part:
    """This data rank's part of one parameter."""

    param: torch.Tensor
    name: str
    chunk: int  # c = ⌈n / G_data⌉: elements per data rank's part
    start: int  # the owned elements [start, stop) of the flattened parameter
    stop: int
    master: torch.Tensor  # (stop - start,) fp32: a view of the parameter, or a copy
    sixteen: bool = False  # stored in the compute dtype: its reduced gradient comes to the master, never .grad
    scattered: bool = False  # its gradient part is delivered (take_grad, take_whole_grad), never .grad
    whole: bool = False  # held by this data rank alone (an MoE expert weight): all of it, stepped here, never gathered


def make_buckets(parts: list[Part], limit: int) -> list[list[Part]]:
    """The all-gather buckets: parameters in order (but those held whole: none to gather), one open bucket per dtype and device (16-bit
    weights, the fp32 rest), closed once it holds ``limit`` parameter bytes (the policy's
    ``bucket_bytes``; 0: one parameter each); in the order they close, alike on every rank."""
    buckets: list[list[Part]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[Part], float]] = {}
    for part in parts:
        if part.whole:  # stepped apart, never gathered (``ShardedOptimizer.step``)
            continue
        p = part.param
        key = (p.dtype, p.device)
        bucket, size = open_.get(key, ([], 0.0))
        if bucket and size >= limit:
            buckets.append(bucket)
            bucket, size = [], 0.0
        bucket.append(part)
        open_[key] = (bucket, size + p.numel() * p.element_size())
    buckets += [bucket for bucket, _ in open_.values()]
    return buckets


class Deferrer(Protocol):
    """Where the scheduler is told of deferred writes (``Scheduler.defer_writes``/``settled``)."""

    def defer_writes(self, params: list[torch.Tensor], settle: Callable[[torch.Tensor], None]) -> None: ...

    def settled(self, params: list[torch.Tensor]) -> None: ...


class ParamGathers:
    """The all-gathers over data of one sharded optimizer's parameters (the module docstring)."""

    def __init__(self, parts: list[Part], comm: Communicator, data_size: int, limit: int, scheduler: Deferrer):
        self.comm, self.data_size, self.scheduler = comm, data_size, scheduler
        self.parts, self.limit = parts, limit
        self.buckets = make_buckets(parts, limit)
        self._pending: list[tuple[list[Part], Handle]] = []  # deferred gathers, in issue order
        self._pending_ids: set[int] = set()  # ids of their parameters
        self._hooks: list[Any] = []

    # -- one bucket -----------------------------------------------------------------------------
    def gather(self, bucket: list[Part]) -> Handle:
        """Issue the all-gather over data of this rank's updated parts of ``bucket``: a flat (S,)
        of each part padded to its c, S = Σ c; the result (G_data·S,) is row d = data rank d's."""
        first = bucket[0].param
        send = torch.empty(sum(p.chunk for p in bucket), dtype=first.dtype, device=first.device)  # (S,)
        offset = 0
        for part in bucket:
            owned = part.stop - part.start
            send[offset : offset + owned].copy_(part.master)
            send[offset + owned : offset + part.chunk].zero_()
            offset += part.chunk
        with self.comm.in_phase("optimizer"):
            return self.comm.all_gather(send, "data", tag=GATHER_TAG)

    def unpack(self, bucket: list[Part], handle: Handle) -> None:
        """Wait for a bucket's all-gather and copy every rank's parts into the parameters."""
        rows = handle.wait().view(self.data_size, -1)  # (G_data, S)
        offset = 0
        for part in bucket:
            flat = part.param.detach().view(-1)  # (n,)
            n, c = flat.numel(), part.chunk
            full = n // c  # data ranks whose part is whole
            flat[: full * c].view(full, c).copy_(rows[:full, offset : offset + c])
            if n > full * c:
                flat[full * c :].copy_(rows[full, offset : offset + n - full * c])
            offset += c

    def rebucket(self, limit: int) -> None:
        """Lay the buckets out again for a bucket size of ``limit`` bytes (the grid's policy changed:
        ``Scheduler.configure``); a no-op when it is the size they were made for."""
        if limit != self.limit:
            self.settle()
            self.limit, self.buckets = limit, make_buckets(self.parts, limit)

    # -- a step's gathers -----------------------------------------------------------------------
    def run(self, step_bucket: Callable[[list[Part]], None], defer: bool) -> None:
        """Step each bucket (``step_bucket``) and issue its gather. Eager: each in flight while the
        next bucket steps, the last waited here (two buckets' buffers at a time). With ``defer``:
        every gather left in flight, completed in the next forward (the module docstring)."""
        self.settle()
        in_flight: tuple[list[Part], Handle] | None = None
        for bucket in self.buckets:
            step_bucket(bucket)
            handle = self.gather(bucket)
            if defer:
                self._pending.append((bucket, handle))
                continue
            if in_flight is not None:
                self.unpack(*in_flight)
            in_flight = (bucket, handle)
        if in_flight is not None:
            self.unpack(*in_flight)
        if self._pending:
            params = [part.param for bucket, _ in self._pending for part in bucket]
            self._pending_ids = {id(p) for p in params}
            self.scheduler.defer_writes(params, self.settle_through)

    @property
    def deferred(self) -> int:
        """How many buckets' gathers are in flight, not yet unpacked."""
        return len(self._pending)

    def settle_through(self, param: torch.Tensor) -> None:
        """Complete the deferred gathers in issue order through the bucket that holds ``param``
        (every rank completes the same ones: the order is the issue order)."""
        if id(param) not in self._pending_ids:
            return
        while self._pending:
            bucket, handle = self._pending.pop(0)
            self.unpack(bucket, handle)
            params = [part.param for part in bucket]
            self._pending_ids.difference_update(id(p) for p in params)
            self.scheduler.settled(params)
            if any(p is param for p in params):
                return

    def settle(self) -> None:
        """Complete every deferred gather: every parameter is whole."""
        while self._pending:
            self.settle_through(self._pending[-1][0][0].param)

    # -- forward pre-hooks ----------------------------------------------------------------------
    def hook(self, model: nn.Module) -> None:
        """Settle a module's parameters before its forward (deferred gathers): a pre-hook on each
        module of ``model`` that directly holds one of these parameters, holding this object weakly.
        A module that only holds parameters and is never called (an MoE layer's router weight and
        expert stacks, read in the layer's own forward) is settled before the forward of the
        nearest module above it that is called."""
        ours = {id(part.param) for bucket in self.buckets for part in bucket}
        ref = weakref.ref(self)
        parents = {id(child): module for module in model.modules() for child in module.children()}

        def settling(params: list[nn.Parameter]) -> Any:
            def before_forward(module: nn.Module, args: Any) -> None:
                gathers = ref()
                if gathers is None or not gathers._pending:
                    return
                for p in params:
                    gathers.settle_through(p)

            return before_forward

        for module in model.modules():
            held = [p for p in module.parameters(recurse=False) if id(p) in ours]
            if not held:
                continue
            called = module
            while type(called).forward is nn.Module.forward and id(called) in parents:  # a holder: never called
                called = parents[id(called)]
            self._hooks.append(called.register_forward_pre_hook(settling(held)))

    def unhook(self) -> None:
        """Remove the forward pre-hooks (after settling)."""
        self.settle()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
