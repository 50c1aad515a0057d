"""When collectives are issued and waited on: the overlap scheduler (docs/design.md §4).

A ``Scheduler`` belongs to one grid (``grid.scheduler``) and acts on that grid's communicator
according to an ``OverlapPolicy`` (axon4d.overlap_policy), set by ``axon4d.init(..., overlap=...)`` or,
for a region of code, ``with axon4d.overlap.using(...)``. Layers ask it for their weight block and
hand it their gradients; they hold no overlap flags.

- **OAG** (E10f/E10b): ``gather_weight`` issues the all-gather over z of the *next* layers' weights
  (``oag_depth`` of them) — next in forward order during forward, in reverse order during
  backward — so they run while the current layer computes. The order is learned from the previous
  forward. ``oag_keep`` keeps the forward's gathered block for backward (memory for time: no
  E10b, see ``geometry.linear_collectives(cache_weight=True)``).
- **OAR** (E9): the layer issues the dX all-reduce over its output axis before the dW matmul and
  waits after it; off, it waits at once.
- **ORS** (E11): the dW reduce-scatter over z is not waited on in the layer; it is folded in at
  the next layer's backward or at the end of backward.
- **ODP** (E12, E13): data-parallel all-reduces of the weight shards, in buckets of
  ``bucket_mb`` (0: one bucket per layer), are launched as the shards arrive; the bias
  all-reduces over batch are issued asynchronously too.
- **Chunked forward all-reduce** (E8): the tokens are split into ``forward_chunks`` chunks and
  chunk i is all-reduced over the input axis while chunk i+1 is multiplied (only where the input
  axis has more than one rank: otherwise there is no E8 and the GEMM stays whole).

Gradient contract: pending gradient reductions are completed and written into ``.grad`` by a
callback queued on the autograd engine, which runs before ``loss.backward()`` returns. Code
that drives backward without the engine (``torch.autograd.grad``) calls ``finish_gradients()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from axon4d.comm import Communicator, Handle
from axon4d.geometry import Term
from axon4d.overlap_policy import OverlapPolicy
from axon4d.precision import Precision, compute_dtype, reduce_dtype


@dataclasses.dataclass
class _PendingGrad:
    """A gradient on its way into ``param.grad``: a handle, then what to do with its result."""

    param: torch.Tensor
    handle: Handle
    stage: str  # "rs": reduce-scatter over z still to fold; "ar": final all-reduce in flight
    scale: float


def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad`` times ``scale``, in place; no pass over it when ``scale`` is 1 (G_batch = 1)."""
    return grad if scale == 1.0 else grad.mul_(scale)


class Scheduler:
    """Issues and completes the overlapped collectives of one grid according to its policy."""

    def __init__(self, comm: Communicator, precision: Precision, policy: OverlapPolicy | None = None):
        self.comm = comm
        self.precision = precision  # the grid's dtypes: what gathers move and reductions sum in
        self.policy = policy or OverlapPolicy()
        # per layer object, held weakly: a freed layer's entries go with it (keyed by id(), a new
        # layer that reused the id would inherit its successor and its prefetched block)
        self._next: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> weakref of the next in forward
        self._prev: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_forward: Any = None
        self._prefetched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (gather, weight version)
        self._gathers_in_backward: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> bool
        self._scattering: list[_PendingGrad] = []  # ORS: reduce-scatters not yet folded
        self._bucket: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (param, shard, scale)
        self._reducing: list[tuple[list[tuple[torch.Tensor, torch.Tensor, float]], Handle, torch.Tensor | None]] = []
        self._callback_queued = False
        self._rerunning: weakref.WeakSet | None = None  # layers of the recomputed region being re-run
        self._recomputed_depth = 0  # depth of regions under full recomputation being run

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

    # -- OAG: weights ---------------------------------------------------------------------------
    def gather_weight(self, layer: Any, weight: torch.Tensor, backward: bool) -> torch.Tensor:
        """The (rows, cols) weight block of ``layer`` — E10f/E10b, all-gather over z — and the OAG prefetch
        of the layer that runs next (forward order, or reverse order when ``backward``)."""
        handle = self._take_prefetch(layer, weight)
        if handle is None:
            handle = self._issue_gather(weight, backward)
        if self.policy.oag:
            self._prefetch_after(layer, backward)
        rows, cols = layer.block_shape
        return handle.wait()[: rows * cols].view(rows, cols)

    def _prefetch_after(self, layer: Any, backward: bool) -> None:
        """OAG: issue the gathers of the ``oag_depth`` layers that run after ``layer`` (in forward
        order, or reverse order in backward) unless already in flight; in backward, a layer whose
        backward needs no weight block (no input gradient, or kept) is passed over but still counts
        towards the depth."""
        links = self._prev if backward else self._next
        for _ in range(self.policy.oag_depth):
            ref = links.get(layer)
            layer = ref() if ref is not None else None
            if layer is None:
                return
            if backward and not self._gathers_in_backward.get(layer, False):
                continue
            if not backward and self._rerunning is not None and layer not in self._rerunning:
                return
            if layer not in self._prefetched:
                self._prefetched[layer] = (self._issue_gather(layer.weight, backward), layer.weight._version)

    def will_gather_in_backward(self, layer: Any, needed: bool) -> None:
        """Note (at forward) whether ``layer``'s backward will gather its weight block, so the
        backward prefetch never fetches a block nobody uses."""
        self._gathers_in_backward[layer] = needed

    def _issue_gather(self, weight: torch.Tensor, backward: bool) -> Handle:
        # mixed precision: the shard is cast before the gather, so E10 moves compute-dtype bytes;
        # a forward re-run under full recomputation gathers as a forward does (E10f)
        term = Term.E10B if backward else Term.E10F
        return self.comm.all_gather(weight.detach().to(compute_dtype(self.precision, weight)), "z", tag=term)

    def _take_prefetch(self, layer: Any, weight: torch.Tensor) -> Handle | None:
        entry = self._prefetched.pop(layer, None)
        if entry is None:
            return None
        handle, version = entry
        if version != weight._version:  # the weight changed since the prefetch: gather again
            handle.wait()
            return None
        return handle

    @property
    def recomputing(self) -> bool:
        """True inside a region under full recomputation (its forward or its re-run): layers then
        save what they keep for backward through autograd, so it is dropped and made again."""
        return self._recomputed_depth > 0

    @contextlib.contextmanager
    def recomputed_region(self) -> Iterator[None]:
        """The enclosed forward is a region under full recomputation (docs/design.md §5)."""
        self._recomputed_depth += 1
        try:
            yield
        finally:
            self._recomputed_depth -= 1

    @contextlib.contextmanager
    def rerunning(self, layers: Any) -> Iterator[None]:
        """The enclosed forward re-runs a recomputed region during backward (full recomputation,
        docs/design.md §5): it teaches OAG no order, and OAG prefetches only the region's own
        ``layers`` (the layer after the region already ran its backward)."""
        previous = self._rerunning
        self._rerunning = weakref.WeakSet(layers)
        try:
            with self.recomputed_region():
                yield
        finally:
            self._rerunning = previous

    def note_forward(self, layer: Any) -> None:
        """Learn the forward order of layers (for OAG) from a forward that will be differentiated.

        Layers call this before their forward when grad mode is on; the chain restarts after each
        backward, so the order never links the last layer of one step to the first of the next.
        A recomputed forward (``rerunning``) teaches nothing: it runs in backward order."""
        if self._rerunning is not None:
            return
        last = self._last_forward() if self._last_forward is not None else None
        if last is not None and last is not layer:
            self._next[last] = weakref.ref(layer)
            self._prev[layer] = weakref.ref(last)
        self._last_forward = weakref.ref(layer)

    # -- ORS / ODP: gradients -------------------------------------------------------------------
    def reduce_weight_grad(self, param: torch.Tensor, dw: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Reduce a flat padded dW block: reduce-scatter over z (E11), all-reduce over data (E12),
        times ``scale``, in the grid's gradient-reduction dtype. Returns the shard (in the
        parameter's dtype) when the policy is fully synchronous; otherwise the result is written
        into ``param.grad`` before backward returns and None is returned."""
        dw = dw.to(reduce_dtype(self.precision, param))
        rs = self.comm.reduce_scatter(dw, "z", tag=Term.E11)
        if not (self.policy.ors or self.policy.odp):
            shard = rs.wait()
            return _scaled(self.comm.all_reduce(shard, "data", tag=Term.E12).wait(), scale).to(param.dtype)
        # fold the reduce-scatters of layers that ran before this one, all but the newest
        # ors_inflight - 1 (a count, not "whichever finished": every rank folds the same ones)
        self._advance(keep=self.policy.ors_inflight - 1)
        self._scattering.append(_PendingGrad(param, rs, "rs", scale))
        if not self.policy.ors:
            self._advance()
        return None

    def reduce_bias_grad(self, param: torch.Tensor, db: torch.Tensor, scale: float) -> torch.Tensor | None:
        """All-reduce a bias gradient over batch (E13) times ``scale``; asynchronous under ODP."""
        db = db.to(reduce_dtype(self.precision, param))
        handle = self.comm.all_reduce(db, "batch", tag=Term.E13)
        if not self.policy.odp:
            return _scaled(handle.wait(), scale).to(param.dtype)
        self._reducing.append(([(param, db, scale)], handle, None))
        return None

    def _advance(self, keep: int = 0) -> None:
        """Fold the due reduce-scatters — all but the newest ``keep`` — into the ODP bucket (in
        issue order, the same on every rank), launching the bucket's all-reduce over data when it
        is full."""
        while len(self._scattering) > keep:
            pending = self._scattering.pop(0)
            shard = pending.handle.wait()
            self._bucket.append((pending.param, shard, pending.scale))
            limit = self.policy.bucket_mb * 2**20
            if sum(s.numel() * s.element_size() for _, s, _ in self._bucket) >= limit:
                self._flush_bucket()

    def _flush_bucket(self) -> None:
        """All-reduce the bucket over data (E12): one tensor as is, several through a flat buffer."""
        if not self._bucket:
            return
        items, self._bucket = self._bucket, []
        flat = items[0][1] if len(items) == 1 else torch.cat([s for _, s, _ in items])
        handle = self.comm.all_reduce(flat, "data", tag=Term.E12)
        if not self.policy.odp:
            handle.wait()
        self._reducing.append((items, handle, flat if len(items) > 1 else None))

    def finish_gradients(self) -> None:
        """Complete every pending gradient reduction and add the results into ``.grad``.

        Runs automatically at the end of each backward; call it yourself only if you drive
        backward in a way that does not finish through the autograd engine."""
        self._advance()
        self._flush_bucket()
        reducing, self._reducing = self._reducing, []
        for items, handle, flat in reducing:
            handle.wait()
            offset = 0
            for param, shard, scale in items:
                if flat is not None:
                    shard = flat[offset : offset + shard.numel()]
                    offset += shard.numel()
                shard = _scaled(shard, scale).to(param.dtype)
                if param.grad is None:
                    param.grad = shard if flat is None or shard.dtype != flat.dtype else shard.clone()
                else:
                    param.grad.add_(shard)
        for handle, _ in list(self._prefetched.values()):  # prefetches nobody asked for (control flow changed)
            handle.wait()
        self._prefetched.clear()
        self._last_forward = None

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
