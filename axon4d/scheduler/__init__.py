"""When collectives are issued and waited on: the overlap scheduler (docs/design.md §4).

A ``Scheduler`` belongs to one grid (``grid.scheduler``) and acts on that grid's communicator
according to an ``OverlapPolicy`` (axon4d.options.overlap_policy), set by ``axon4d.init(..., overlap=...)`` or,
for a region of code, ``with axon4d.overlap.using(...)``. Layers ask it for their weight block and
hand it their gradients; they hold no overlap flags.

- **OAG** (E10f/E10b): the weight blocks' all-gathers over z issued ahead of the layers that use
  them, kept for backward and carried between micro-batches (``oag_keep``): ``axon4d.scheduler.gathers``.
- **OAR** (E9): the layer issues the dX all-reduce over its output axis before the dW matmul and
  waits after it; off, it waits at once.
- **ORS** (E11): the dW reduce-scatter over z is not waited on in the layer; it is folded in at
  the next layer's backward or at the end of backward.
- **ODP** (E12, E13): data-parallel all-reduces of the weight shards, in buckets of
  the policy's ``bucket_bytes`` (0: one bucket per layer; their layout ``axon4d.scheduler.layout``),
  are launched as the shards arrive; the biases' all-reduces over batch (E13) and the gradients of
  replicated parameters (norm weights, embedding tables: ``track_replicated``) likewise, bucketed by
  kind the same way, and folded into ``.grad`` in ``finish_gradients`` — never waited one by one in
  the backward. The planner prices these buckets as they are issued (``axon4d.plan.buckets``).
- **Accumulation** (``accumulating``): backward passes inside hold their data-axis reductions
  (E12, E13, the replicated gradients) — each rank sums its micro-batches locally, reduced over z
  where the z shard needs it (E11 still runs per micro-batch) — and the first backward outside
  adds the sums to its own and reduces once, overlapped with itself: with M micro-batches the
  data axis moves the bytes of one (DDP's ``no_sync``, docs/design.md §4). Under ``oag_keep`` a
  held backward keeps each layer's weight block (outside full recomputation) for the next
  micro-batch's forward, which gathers nothing while the weight is unchanged; the backward outside
  frees the blocks as it would without accumulation.
- **ZeRO** (``shard_over_data``): under ZeRO-2 the E12 buckets — and an MoE layer's expert
  replicas' gradient buckets where its layout puts the replicas on data alone — are reduce-scattered
  over data instead of all-reduced: each rank receives only the sum of the parts it owns, which go
  to the ``DataSharding`` (axon4d.zero) instead of ``.grad``; under ZeRO-1 training
  in 16 bits the all-reduced gradients of the 16-bit weights go to it whole, in the reduction dtype,
  never rounded into a 16-bit ``.grad`` (docs/design.md §4; ``axon4d.scheduler.sharding``).
- **Chunked forward all-reduce** (E8): the tokens are split into ``forward_chunks`` chunks and
  chunk i is all-reduced over the input axis while chunk i+1 is multiplied (only where the input
  axis has more than one rank: otherwise there is no E8 and the GEMM stays whole).

Gradient contract: pending gradient reductions are completed and written into ``.grad`` by a
callback queued on the autograd engine, which runs before ``loss.backward()`` returns. Code
that drives backward without the engine (``torch.autograd.grad``) calls ``finish_gradients()``;
the layers' reduced weight and bias gradients then land in ``.grad``, not in what it returns. A
replicated parameter's gradient is reduced only by ``backward()`` (its hooks run after autograd
accumulates into ``.grad``): ``torch.autograd.grad`` returns its local gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from axon4d.comm.communicator import Communicator, Handle
from axon4d.grid.shape import Axis
from axon4d.layout.geometry import Term, wire_dtype
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import Precision
from axon4d.scheduler.gathers import WeightGathers
from axon4d.scheduler.layout import BucketLayout, Item
from axon4d.scheduler.sharding import SCATTERED_OVER_DATA, DataSharding, DataShardings, scaled

__all__ = ["DataSharding", "Scheduler"]


@dataclasses.dataclass
class _PendingGrad:
    """A weight shard's reduce-scatter over z (E11) not folded yet, and whether its micro-batch
    holds the data-axis reduction (``accumulating``)."""

    param: torch.Tensor
    handle: Handle
    scale: float
    hold: bool


#: a gradient waiting in a bucket: (parameter, flat gradient in the reduction dtype, scale)


class Scheduler(WeightGathers, DataShardings):
    """Issues and completes the overlapped collectives of one grid according to its policy."""

    def __init__(
        self, comm: Communicator, precision: Precision, policy: OverlapPolicy | None = None, accelerator: bool = False
    ):
        self.comm = comm
        self.precision = precision  # the grid's dtypes: what gathers move and reductions sum in
        self.policy = policy or OverlapPolicy()
        self.accelerator = accelerator  # the grid's device: its forward chunking (OverlapPolicy.chunking)
        self._holding = 0  # depth of ``accumulating`` regions: data-axis reductions are held
        self._init_gathers()
        self._scattering: list[_PendingGrad] = []  # ORS: reduce-scatters not yet folded
        # ODP buckets, one per (axis, tag): E12's weight shards over data, each kind of replicated
        # gradient over batch; insertion-ordered, so every rank flushes them in the same order
        self._buckets: dict[tuple[Axis, Term], list[Item]] = {}
        self._reducing: list[tuple[list[Item], Handle, torch.Tensor | None]] = []
        # held sums (accumulation), by parameter id in first-held order: (param, sum, axis, tag, scale)
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor, Axis, Term, float]] = {}
        # replicated parameters whose .grad holds this window's local (unreduced) sum, and the
        # reduced gradient each held before its window opened (restored under the reduction)
        self._local: dict[int, tuple[weakref.ref, Term, Axis]] = {}
        self._kept: dict[int, torch.Tensor] = {}
        self._layout = BucketLayout()  # persistent E12 buckets (bucket_bytes > 0)
        self._callback_queued = False
        self._init_shardings()

    # -- policy ---------------------------------------------------------------------------------
    def configure(self, spec: Any) -> OverlapPolicy:
        """Set the policy (see ``OverlapPolicy.parse``); returns it. Pending work is finished first."""
        self.finish_gradients()
        self.policy = OverlapPolicy.parse(spec)
        return self.policy

    @contextlib.contextmanager
    def using(self, spec: Any) -> Iterator[OverlapPolicy]:
        """Run the enclosed region under another policy, then restore the previous one."""
        old = self.policy
        try:
            yield self.configure(spec)
        finally:
            self.configure(old)

    def forward_chunks(self, tokens: int, row_bytes: int, group: int) -> list[int]:
        """Rows of the token chunks a layer's forward all-reduce (E8) of ``tokens`` rows of
        ``row_bytes`` over ``group`` ranks runs in, chunk i on the wire while chunk i+1 is
        multiplied: the policy's chunking on this grid's device (``OverlapPolicy.chunk_sizes``)."""
        return self.policy.chunk_sizes(tokens, row_bytes, group, self.accelerator)

    # -- ORS / ODP: gradients -------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside hold their data-axis reductions: E12 (weight shards over data),
        E13 (biases over batch) and the replicated parameters' all-reduces over batch are not
        issued; each rank sums its gradients locally (weight shards after E11, their reduce-scatter
        over z, which still runs per backward). The first backward outside adds the held sums to
        its own and reduces them once, overlapped with itself; until then ``.grad`` of a layer's
        weight and bias stays as it was and a replicated parameter's holds its local sum.

        The gradient-accumulation counterpart of DDP's ``no_sync`` (docs/design.md §4): over M
        micro-batches the data axis moves the bytes of one. Zero the gradients before the first
        micro-batch, never between."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def reduce_weight_grad(self, param: torch.Tensor, dw: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Reduce a flat padded dW block: reduce-scatter over z (E11), all-reduce over data (E12),
        times ``scale``, in the grid's gradient-reduction dtype. Returns the shard (in the
        parameter's dtype) when the policy is fully synchronous; otherwise — or when the reduction
        over data is held (``accumulating``) — the result is written into ``param.grad`` later
        (before the backward that reduces returns) and None is returned. Under ZeRO
        (``shard_over_data``) the result goes to the ``DataSharding``, not ``.grad`` — under ZeRO-2
        E12 is a reduce-scatter over data: None is returned."""
        dw = dw.to(wire_dtype(self.precision, Term.E11, param.dtype))
        g_z = self.comm.shape.size("z")  # with G_z = 1 there is no E11: the dW GEMM wrote into the slot
        slot = self.weight_grad_slot(param, dw.numel() // g_z, dw.dtype, dw.device) if g_z > 1 else None
        rs = self.comm.reduce_scatter(dw, "z", tag=Term.E11, out=slot)  # into its bucket's buffer, if any
        hold = self.holding
        if not (self.policy.ors or self.policy.odp):
            shard = rs.wait()
            if hold:
                self._hold(param, shard, "data", Term.E12, scale)
                return None
            shard = self._with_held(param, shard)
            if self._scattered(param):  # ZeRO-2: reduce-scattered, the part lands in the sharding
                self._buckets.setdefault(("data", Term.E12), []).append((param, shard, scale))
                self._flush(("data", Term.E12))
                return None
            reduced = scaled(self.comm.all_reduce(shard, "data", tag=Term.E12).wait(), scale)
            taker = self._whole_taker(param)
            if taker is not None:  # ZeRO-1 in 16 bits: the gradient goes to the master, never rounded
                taker.take_whole_grad(param, reduced)
                return None
            return reduced.to(param.dtype)
        # fold the reduce-scatters of layers that ran before this one, all but the newest
        # ors_inflight - 1 (a count, not "whichever finished": every rank folds the same ones)
        self._advance(keep=self.policy.ors_inflight - 1)
        self._scattering.append(_PendingGrad(param, rs, scale, hold))
        if not self.policy.ors:
            self._advance()
        return None

    def weight_grad_slot(
        self, param: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """Where this backward's E12 bucket takes ``param``'s reduced shard of ``numel`` elements: a
        slice of the bucket's flat buffer, so the reduce-scatter over z (or, with G_z = 1, the dW
        GEMM) writes there and the bucket is all-reduced as it stands — no concatenation, and
        its slices become the gradients. None where there is no such bucket: buckets off
        (``bucket_bytes`` 0), no ODP, a held backward, or a shard the layout learned from the
        previous backward does not place (the first backward, changed control flow)."""
        if self.holding or not self.policy.odp or self.policy.bucket_bytes(self.accelerator) <= 0:
            return None
        return self._layout.slot(param, numel, dtype, device)

    def reduce_bias_grad(self, param: torch.Tensor, db: torch.Tensor, scale: float) -> torch.Tensor | None:
        """All-reduce a bias gradient over batch (E13) times ``scale``; under ODP asynchronous, in
        buckets of ``bucket_bytes`` like the other reductions over batch; held inside ``accumulating``."""
        db = db.to(wire_dtype(self.precision, Term.E13, param.dtype))
        if self.holding:
            self._hold(param, db, "batch", Term.E13, scale)
            return None
        db = self._with_held(param, db)
        if not self.policy.odp:
            return scaled(self.comm.all_reduce(db, "batch", tag=Term.E13).wait(), scale).to(param.dtype)
        self._add_to_bucket(("batch", Term.E13), (param, db, scale))  # launched once the bucket is full
        return None

    def track_replicated(self, param: torch.Tensor, tag: Term, axis: Axis = "batch") -> None:
        """Average ``param``'s gradient over batch = data × z, as DDP does, for a parameter every
        rank of batch holds a copy of (norm weights, embedding tables): each backward's gradient
        is all-reduced over batch under ``tag`` — bucketed with the others of its kind, launched
        as it arrives under ODP — divided by G_batch and added into ``.grad`` before the backward
        returns (held over micro-batches inside ``accumulating``).

        Autograd accumulates the backward's local gradient into ``.grad`` (a gradient already
        there is set aside first and restored under the reduced one), and a hook after that
        accumulation hands it to the scheduler: no zero-filled or extra copy per backward.

        ``axis``: the axis the copies lie on, when not batch — an MoE layer's expert replicas
        (axon4d.grid.expert_layout's expert data-parallel axes): their gradients are summed over it,
        still divided by G_batch (each copy's gradient is its own tokens' part of the batch average)."""
        if self.comm.shape.size(axis) == 1:
            return
        ref = weakref.ref(param)
        param.register_hook(lambda grad: self._replicated_arrives(ref, tag, axis))
        param.register_post_accumulate_grad_hook(lambda p: self._replicated_accumulated(p, tag, axis))

    def _replicated_arrives(self, ref: weakref.ref, tag: Term, axis: Axis) -> None:
        """Before autograd accumulates a replicated parameter's gradient: on the first backward of
        its window, set the (reduced) gradient it holds aside, so ``.grad`` becomes the local sum."""
        param = ref()
        if param is None or id(param) in self._local:
            return
        self._local[id(param)] = (ref, tag, axis)
        if param.grad is not None:
            self._kept[id(param)] = param.grad
            param.grad = None

    def _replicated_accumulated(self, param: torch.Tensor, tag: Term, axis: Axis) -> None:
        """After autograd accumulated it: unless held, hand the local sum to its bucket. Held, a
        parameter stored in 16 bits (ZeRO's expert replicas, ``axon4d.zero.sixteen_bit``) moves its
        sum into one held in the reduction dtype, so that micro-batches add up unrounded."""
        self.backward_started()
        if not self.holding:
            self._reduce_replicated(param, tag, axis)
            return
        wire = wire_dtype(self.precision, tag, param.dtype)
        if param.grad is not None and param.grad.dtype != wire:
            self._hold(param, param.grad.detach().reshape(-1).to(wire), axis, tag, 1.0 / self.comm.shape.size("batch"))
            param.grad = None

    def _reduce_replicated(self, param: torch.Tensor, tag: Term, axis: Axis) -> None:
        """Put a replicated parameter's local sum (its ``.grad``) in its bucket, restoring the
        gradient set aside when its window opened; the reduction is averaged over batch."""
        self._local.pop(id(param), None)
        scale = 1.0 / self.comm.shape.size("batch")
        local, param.grad = param.grad, self._kept.pop(id(param), None)
        if local is None:
            return
        flat = local.detach().reshape(-1).to(wire_dtype(self.precision, tag, param.dtype))  # (numel,)
        self._add_to_bucket((axis, tag), (param, self._with_held(param, flat), scale))

    def _hold(self, param: torch.Tensor, grad: torch.Tensor, axis: Axis, tag: Term, scale: float) -> None:
        """Add a micro-batch's gradient to ``param``'s held sum (accumulation)."""
        held = self._held.get(id(param))
        if held is None:
            self._held[id(param)] = (param, grad, axis, tag, scale)
        else:
            held[1].add_(grad)

    def _with_held(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus ``param``'s held sum, if any (which is then no longer held)."""
        held = self._held.pop(id(param), None)
        return grad if held is None else grad.add_(held[1])

    def _advance(self, keep: int = 0) -> None:
        """Fold the due reduce-scatters — all but the newest ``keep`` — into the E12 bucket (in
        issue order, the same on every rank), launching the bucket's all-reduce over data when it
        is full; a held one's shard is added to its sum instead."""
        while len(self._scattering) > keep:
            pending = self._scattering.pop(0)
            shard = pending.handle.wait()
            if pending.hold:
                self._hold(pending.param, shard, "data", Term.E12, pending.scale)
            else:
                self._add_to_bucket(
                    ("data", Term.E12), (pending.param, self._with_held(pending.param, shard), pending.scale)
                )

    def _add_to_bucket(self, key: tuple[Axis, Term], item: Item) -> None:
        """Put a gradient in the bucket of its axis and tag; launch the bucket once it holds
        ``bucket_bytes`` (0: at once)."""
        bucket = self._buckets.setdefault(key, [])
        bucket.append(item)
        if sum(g.numel() * g.element_size() for _, g, _ in bucket) >= self.policy.bucket_bytes(self.accelerator):
            self._flush(key)

    def _flush(self, key: tuple[Axis, Term]) -> None:
        """All-reduce one bucket over its axis: one tensor as is, several through a flat buffer
        whose slices then become the gradients (no copy back) — the E12 bucket's persistent buffer
        when its shards were written in place (``weight_grad_slot``), else their concatenation."""
        items = self._buckets.pop(key, [])
        if not items:
            return
        if key == ("data", Term.E12) and self.policy.bucket_bytes(self.accelerator) > 0:
            self._layout.learn(items)
        if key in SCATTERED_OVER_DATA and self._shardings:  # ZeRO-2: each data rank receives its parts
            self._scatter([item for item in items if self._scattered(item[0])], key[1])
            items = [item for item in items if not self._scattered(item[0])]
            if not items:
                return
        flat = items[0][1] if len(items) == 1 else self._layout.in_place(items)
        if flat is None:
            flat = torch.cat([g for _, g, _ in items])
        handle = self.comm.all_reduce(flat, key[0], tag=key[1])
        if not self.policy.odp:
            handle.wait()
        self._reducing.append((items, handle, flat if len(items) > 1 else None))

    def finish_gradients(self) -> None:
        """Complete every pending gradient reduction and add the results into ``.grad``.

        Runs automatically at the end of each backward; call it yourself only if you drive
        backward in a way that does not finish through the autograd engine. Inside
        ``accumulating`` the held sums stay held; outside, sums still held (a parameter the last
        backward did not reach) are reduced here too. ZeRO-2's reduce-scattered parts are handed
        to their ``DataSharding`` (``take_grad``) instead."""
        self._advance()
        if not self.holding:
            self._release_held()
        for key in list(self._buckets):
            self._flush(key)
        reducing, self._reducing = self._reducing, []
        for items, handle, flat in reducing:
            handle.wait()
            offset = 0
            for param, grad, scale in items:
                if flat is not None:
                    grad = flat[offset : offset + grad.numel()]
                    offset += grad.numel()
                taker = self._whole_taker(param)
                if taker is not None:  # ZeRO-1 in 16 bits: to the master, never rounded into .grad
                    taker.take_whole_grad(param, scaled(grad, scale))
                    continue
                grad = scaled(grad, scale).to(param.dtype).view(param.shape)
                if param.grad is None:
                    param.grad = grad  # a slice of the bucket, or the reduced tensor itself
                else:
                    param.grad.add_(grad)
        self._hand_parts()
        if not self.holding:
            self._layout.relearn()
        self._drop_prefetches()

    def _release_held(self) -> None:
        """Reduce what accumulation still holds: weight shards' and biases' sums, and replicated
        parameters' local sums in ``.grad`` (in the order they were first held: the same on every rank)."""
        held, self._held = self._held, {}
        for param, grad, axis, tag, scale in held.values():
            self._add_to_bucket((axis, tag), (param, grad, scale))
        for ref, tag, axis in list(self._local.values()):
            replicated = ref()
            if replicated is not None:
                self._reduce_replicated(replicated, tag, axis)
        self._local.clear()

    def backward_started(self) -> None:
        """Called by every layer's backward: makes sure ``finish_gradients`` runs when this
        backward pass ends (an autograd-engine callback, queued once per pass)."""
        if self._callback_queued:
            return
        self._callback_queued = True

        def done() -> None:
            self._callback_queued = False
            self.finish_gradients()

        try:
            torch.autograd.Variable._execution_engine.queue_callback(done)
        except RuntimeError:  # not inside the engine's backward: the caller finishes explicitly
            self._callback_queued = False

    # -- compute spans for the timeline ---------------------------------------------------------
    @contextlib.contextmanager
    def compute(self, name: str) -> Iterator[None]:
        """Record the enclosed compute as a span of this rank's timeline (see axon4d.trace), on the
        communicator's clock: on an accelerator, when the device ran it, not when the host queued it."""
        clock = self.comm.clock
        start = clock.mark()
        try:
            yield
        finally:
            self.comm.log.add_span(name, start, clock.mark())
