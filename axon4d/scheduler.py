"""When collectives are issued and waited on: the overlap scheduler (docs/design.md §4).

A ``Scheduler`` belongs to one grid (``grid.scheduler``) and acts on that grid's communicator
according to an ``OverlapPolicy`` (axon4d.overlap_policy), set by ``axon4d.init(..., overlap=...)`` or,
for a region of code, ``with axon4d.overlap.using(...)``. Layers ask it for their weight block and
hand it their gradients; they hold no overlap flags.

- **OAG** (E10f/E10b): ``gather_weight`` issues the all-gather over z of the *next* layers' weights
  (``oag_depth`` of them) — next in forward order during forward, in reverse order during
  backward — so they run while the current layer computes. The order is learned from the previous
  forward. ``oag_keep`` keeps the forward's gathered block for backward (memory for time: no
  E10b, see ``geometry.linear_collectives(cache_weight=True)``) and, inside ``accumulating``, on
  for the next micro-batch's forward (``carry_block``): E10f runs once per step, not once per
  micro-batch.
- **OAR** (E9): the layer issues the dX all-reduce over its output axis before the dW matmul and
  waits after it; off, it waits at once.
- **ORS** (E11): the dW reduce-scatter over z is not waited on in the layer; it is folded in at
  the next layer's backward or at the end of backward.
- **ODP** (E12, E13): data-parallel all-reduces of the weight shards, in buckets of
  the policy's ``bucket_bytes`` (0: one bucket per layer), are launched as the shards arrive; the bias
  all-reduces over batch are issued asynchronously too, and so are the gradients of replicated
  parameters (norm weights, embedding tables: ``track_replicated``), bucketed by kind the same way
  and folded into ``.grad`` in ``finish_gradients`` — never waited one by one in the backward.
- **Accumulation** (``accumulating``): backward passes inside hold their data-axis reductions
  (E12, E13, the replicated gradients) — each rank sums its micro-batches locally, reduced over z
  where the z shard needs it (E11 still runs per micro-batch) — and the first backward outside
  adds the sums to its own and reduces once, overlapped with itself: with M micro-batches the
  data axis moves the bytes of one (DDP's ``no_sync``, docs/design.md §4). Under ``oag_keep`` a
  held backward keeps each layer's weight block (outside full recomputation) for the next
  micro-batch's forward, which gathers nothing while the weight is unchanged; the backward outside
  frees the blocks as it would without accumulation.
- **ZeRO** (``shard_over_data``): under ZeRO-2 the E12 buckets are reduce-scattered over data
  instead of all-reduced — each rank receives only the sum of the parts of the weight shards it
  owns, which go to the ``DataSharding`` (axon4d.zero) instead of ``.grad``; under ZeRO-1 training
  in 16 bits the all-reduced gradients of the 16-bit weights go to it whole, in the reduction dtype,
  never rounded into a 16-bit ``.grad`` (docs/design.md §4).
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
from typing import Any, Protocol

import torch

from axon4d.comm import Communicator, Handle
from axon4d.geometry import Term, wire_dtype
from axon4d.overlap_policy import OverlapPolicy
from axon4d.precision import Precision, compute_dtype, fp8_pack, fp8_unpack, gathers_fp8
from axon4d.shape import Axis


@dataclasses.dataclass
class _PendingGrad:
    """A weight shard's reduce-scatter over z (E11) not folded yet, and whether its micro-batch
    holds the data-axis reduction (``accumulating``)."""

    param: torch.Tensor
    handle: Handle
    scale: float
    hold: bool


#: a gradient waiting in a bucket: (parameter, flat gradient in the reduction dtype, scale)
_Item = tuple[torch.Tensor, torch.Tensor, float]


class DataSharding(Protocol):
    """Who owns which part of a weight shard's gradient over data (ZeRO, axon4d.zero): each flat
    shard of n elements is split into G_data parts of ``part_numel`` (the last zero-padded), data
    rank d owning part d (docs/design.md §4)."""

    #: True: E12 is reduce-scattered and each rank's part handed over (``take_grad``, ZeRO-2);
    #: False: E12 is all-reduced and the whole gradient handed over (``take_whole_grad``, ZeRO-1)
    scatters: bool

    def part_numel(self, param: torch.Tensor) -> int | None:
        """Elements per data rank's part of ``param``'s flat gradient; None: not the sharding's
        (all-reduced into ``.grad``)."""
        ...

    def take_grad(self, param: torch.Tensor, part: torch.Tensor) -> None:
        """This rank's reduced, scaled part of ``param``'s gradient, (part_numel,) in the reduction dtype."""
        ...

    def take_whole_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param``'s all-reduced, scaled gradient, flat (numel,) in the reduction dtype."""
        ...


def _stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when ``weight``'s values may have: its version (an in-place write through the
    tensor or a ``detach()`` of it: ``torch.optim``'s for-loop and foreach steps, a load's ``copy_``,
    ZeRO's gather) and its storage (``.data =``). Writes through ``.data`` or a fused optimizer's
    kernel leave both as they were: the step's last backward drops every carried block for them."""
    return weight._version, weight.data_ptr()


def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad`` times ``scale``, in place; no pass over it when ``scale`` is 1 (G_batch = 1)."""
    return grad if scale == 1.0 else grad.mul_(scale)


class Scheduler:
    """Issues and completes the overlapped collectives of one grid according to its policy."""

    def __init__(
        self, comm: Communicator, precision: Precision, policy: OverlapPolicy | None = None, accelerator: bool = False
    ):
        self.comm = comm
        self.precision = precision  # the grid's dtypes: what gathers move and reductions sum in
        self.policy = policy or OverlapPolicy()
        self.accelerator = accelerator  # the grid's device: its forward chunking (OverlapPolicy.chunking)
        # per layer object, held weakly: a freed layer's entries go with it (keyed by id(), a new
        # layer that reused the id would inherit its successor and its prefetched block)
        self._next: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> weakref of the next in forward
        self._prev: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_forward: Any = None
        self._prefetched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (gather, weight version)
        # oag_keep under accumulation: layer -> ((rows, cols) block, _stamp of its weight), carried
        # from a held backward to the next micro-batch's forward (``carry_block``)
        self._carried: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._gathers_in_backward: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> bool
        self._scattering: list[_PendingGrad] = []  # ORS: reduce-scatters not yet folded
        # ODP buckets, one per (axis, tag): E12's weight shards over data, each kind of replicated
        # gradient over batch; insertion-ordered, so every rank flushes them in the same order
        self._buckets: dict[tuple[Axis, Term], list[_Item]] = {}
        self._reducing: list[tuple[list[_Item], Handle, torch.Tensor | None]] = []
        # ZeRO-2's E12 reduce-scatters in flight: (items, each one's part size and sharding, handle)
        self._reducing_parts: list[tuple[list[_Item], list[tuple[int, DataSharding]], Handle]] = []
        self._holding = 0  # depth of ``accumulating`` regions: data-axis reductions are held
        # held sums (accumulation), by parameter id in first-held order: (param, sum, axis, tag, scale)
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor, Axis, Term, float]] = {}
        # replicated parameters whose .grad holds this window's local (unreduced) sum, and the
        # reduced gradient each held before its window opened (restored under the reduction)
        self._local: dict[int, tuple[weakref.ref, Term]] = {}
        self._kept: dict[int, torch.Tensor] = {}
        # persistent E12 buckets (bucket_bytes > 0): where each weight shard lands in its bucket's flat
        # buffer — param id -> (bucket, offset, numel) and each bucket's size — learned from the
        # previous reducing backward; the buffers of this backward, made as their first shard comes
        self._layout: dict[int, tuple[int, int, int]] = {}
        self._layout_sizes: list[int] = []
        self._learning: list[list[tuple[int, int]]] = []
        self._flats: dict[int, torch.Tensor] = {}
        self._callback_queued = False
        self._shardings: list[DataSharding] = []  # ZeRO: who take E12's gradients instead of .grad
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
        of the layer that runs next (forward order, or reverse order when ``backward``). A forward
        outside full recomputation takes the block a held backward carried (``carry_block``) while
        ``weight`` is unchanged since: no E10f."""
        carried = None if backward or self.recomputing else self._carried_block(layer, weight)
        if carried is not None:
            if self.policy.oag:
                self._prefetch_after(layer, backward)
            return carried
        handle = self._take_prefetch(layer, weight)
        if handle is None:
            handle = self._issue_gather(weight, backward)
        if self.policy.oag:
            self._prefetch_after(layer, backward)
        rows, cols = layer.block_shape
        flat = handle.wait()  # (G_z·n,) in the compute dtype, or (G_z·(n + 4),) uint8 under fp8 gathers
        g_z = self.comm.shape.size("z")
        if gathers_fp8(self.precision, g_z):  # restored to the compute dtype for the GEMM
            flat = fp8_unpack(flat, g_z, compute_dtype(self.precision, weight))
        return flat[: rows * cols].view(rows, cols)

    def forward_chunks(self, tokens: int, row_bytes: int, group: int) -> list[int]:
        """Rows of the token chunks a layer's forward all-reduce (E8) of ``tokens`` rows of
        ``row_bytes`` over ``group`` ranks runs in, chunk i on the wire while chunk i+1 is
        multiplied: the policy's chunking on this grid's device (``OverlapPolicy.chunk_sizes``)."""
        return self.policy.chunk_sizes(tokens, row_bytes, group, self.accelerator)

    def _prefetch_after(self, layer: Any, backward: bool) -> None:
        """OAG: issue the gathers of the ``oag_depth`` layers that run after ``layer`` (in forward
        order, or reverse order in backward) unless already in flight; a layer that needs no gather —
        in backward no input gradient or a kept block, in forward a carried block (``carry_block``) —
        is passed over but still counts towards the depth."""
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
            if not backward and self._carried_block(layer, layer.weight) is not None:
                continue
            if layer not in self._prefetched:
                self._prefetched[layer] = (self._issue_gather(layer.weight, backward), layer.weight._version)

    def will_gather_in_backward(self, layer: Any, needed: bool) -> None:
        """Note (at forward) whether ``layer``'s backward will gather its weight block, so the
        backward prefetch never fetches a block nobody uses."""
        self._gathers_in_backward[layer] = needed

    def _issue_gather(self, weight: torch.Tensor, backward: bool) -> Handle:
        """Issue E10 (E10b when ``backward``, else E10f), the all-gather over z of ``weight``'s shard.

        Mixed precision: the shard is cast before the gather, so E10 moves compute-dtype bytes;
        under fp8 gathers (``precision.gather``) it moves the shard's e4m3 bytes and its scale, one
        uint8 chunk per rank (``fp8_pack``), which ``gather_weight`` restores. A forward re-run under
        full recomputation gathers as a forward does (E10f)."""
        term = Term.E10B if backward else Term.E10F
        dtype = wire_dtype(self.precision, term, weight.dtype, g_z=self.comm.shape.size("z"))
        if dtype == torch.uint8:  # FP8 gathers
            return self.comm.all_gather(fp8_pack(weight), "z", tag=term)  # (n + 4,) uint8 per rank
        return self.comm.all_gather(weight.detach().to(dtype), "z", tag=term)

    def _take_prefetch(self, layer: Any, weight: torch.Tensor) -> Handle | None:
        entry = self._prefetched.pop(layer, None)
        if entry is None:
            return None
        handle, version = entry
        if version != weight._version:  # the weight changed since the prefetch: gather again
            handle.wait()
            return None
        return handle

    def carry_block(self, layer: Any, block: torch.Tensor | None) -> None:
        """``layer``'s backward is done with ``block``, the weight block its forward kept
        (``oag_keep``; None: none kept). Inside ``accumulating`` the block is carried to the next
        micro-batch's forward of ``layer`` (``gather_weight``), so over k micro-batches E10f runs
        once per step; outside (the step's last backward) the layer's carried block is dropped, so
        the block is freed as it is without accumulation (docs/design.md §4).

        The weight's stamp is read here: autograd refuses a weight written in place between its
        forward and backward, so it is the one the block was gathered from."""
        if block is not None and self.holding and self.policy.oag_keep:
            self._carried[layer] = (block, _stamp(layer.weight))
        else:
            self._carried.pop(layer, None)

    @property
    def carried_blocks(self) -> int:
        """How many layers' weight blocks are carried to the next micro-batch now (``carry_block``;
        none once a step's last backward has run)."""
        return len(self._carried)

    def _carried_block(self, layer: Any, weight: torch.Tensor) -> torch.Tensor | None:
        """The block carried for ``layer`` if ``weight`` is unchanged since (same version, same
        storage) under ``oag_keep``; a stale one is dropped (an optimizer step or a load between
        micro-batches: the next forward gathers again)."""
        entry = self._carried.get(layer)
        if entry is None:
            return None
        block, stamp = entry
        if not self.policy.oag_keep or stamp != _stamp(weight):
            del self._carried[layer]
            return None
        return block

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
    def shard_over_data(self, sharding: DataSharding, on: bool = True) -> None:
        """ZeRO (docs/design.md §4): from now on the weight shards' gradients (E12) of the
        parameters ``sharding`` owns parts of go to it, never to ``.grad`` — reduce-scattered over
        data, each rank's part to ``sharding.take_grad``, when ``sharding.scatters`` (ZeRO-2); else
        all-reduced as before and handed whole to ``sharding.take_whole_grad`` (ZeRO-1 training in
        16 bits). ``on=False``: its parameters' are all-reduced into ``.grad`` again. A grid takes
        any number (one per optimizer, over parameters of its own). Pending reductions are
        finished first."""
        self.finish_gradients()
        self._shardings = [s for s in self._shardings if s is not sharding] + ([sharding] if on else [])

    def forget_sharding(self, sharding: DataSharding) -> None:
        """Drop ``sharding`` without finishing pending reductions (its optimizer is gone: what it
        would take has nowhere to go; the next backward's gradients land in ``.grad``)."""
        self._shardings = [s for s in self._shardings if s is not sharding]

    @property
    def data_shardings(self) -> tuple[DataSharding, ...]:
        """The ``DataSharding`` s that take E12 gradients (ZeRO), in the order they came."""
        return tuple(self._shardings)

    def sharding_of(self, param: torch.Tensor) -> DataSharding | None:
        """The ``DataSharding`` that takes ``param``'s gradient, or None (it goes to ``.grad``)."""
        for sharding in self._shardings:
            if sharding.part_numel(param) is not None:
                return sharding
        return None

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

    @property
    def holding(self) -> bool:
        """True inside ``accumulating``: data-axis gradient reductions are held."""
        return self._holding > 0

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
            reduced = _scaled(self.comm.all_reduce(shard, "data", tag=Term.E12).wait(), scale)
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
        where = self._layout.get(id(param))
        if where is None or where[2] != numel:
            return None
        bucket, offset, _ = where
        flat = self._flats.get(bucket)
        if flat is None or flat.dtype != dtype or flat.device != device:
            flat = self._flats[bucket] = torch.empty(self._layout_sizes[bucket], dtype=dtype, device=device)
        return flat[offset : offset + numel]

    def reduce_bias_grad(self, param: torch.Tensor, db: torch.Tensor, scale: float) -> torch.Tensor | None:
        """All-reduce a bias gradient over batch (E13) times ``scale``; asynchronous under ODP,
        held inside ``accumulating``."""
        db = db.to(wire_dtype(self.precision, Term.E13, param.dtype))
        if self.holding:
            self._hold(param, db, "batch", Term.E13, scale)
            return None
        db = self._with_held(param, db)
        handle = self.comm.all_reduce(db, "batch", tag=Term.E13)
        if not self.policy.odp:
            return _scaled(handle.wait(), scale).to(param.dtype)
        self._reducing.append(([(param, db, scale)], handle, None))
        return None

    def track_replicated(self, param: torch.Tensor, tag: Term) -> None:
        """Average ``param``'s gradient over batch = data × z, as DDP does, for a parameter every
        rank of batch holds a copy of (norm weights, embedding tables): each backward's gradient
        is all-reduced over batch under ``tag`` — bucketed with the others of its kind, launched
        as it arrives under ODP — divided by G_batch and added into ``.grad`` before the backward
        returns (held over micro-batches inside ``accumulating``).

        Autograd accumulates the backward's local gradient into ``.grad`` (a gradient already
        there is set aside first and restored under the reduced one), and a hook after that
        accumulation hands it to the scheduler: no zero-filled or extra copy per backward."""
        g_batch = self.comm.shape.size("batch")
        if g_batch == 1:
            return
        ref = weakref.ref(param)
        param.register_hook(lambda grad: self._replicated_arrives(ref, tag))
        param.register_post_accumulate_grad_hook(lambda p: self._replicated_accumulated(p, tag))

    def _replicated_arrives(self, ref: weakref.ref, tag: Term) -> None:
        """Before autograd accumulates a replicated parameter's gradient: on the first backward of
        its window, set the (reduced) gradient it holds aside, so ``.grad`` becomes the local sum."""
        param = ref()
        if param is None or id(param) in self._local:
            return
        self._local[id(param)] = (ref, tag)
        if param.grad is not None:
            self._kept[id(param)] = param.grad
            param.grad = None

    def _replicated_accumulated(self, param: torch.Tensor, tag: Term) -> None:
        """After autograd accumulated it: unless held, hand the local sum to its bucket."""
        self.backward_started()
        if not self.holding:
            self._reduce_replicated(param, tag)

    def _reduce_replicated(self, param: torch.Tensor, tag: Term) -> None:
        """Put a replicated parameter's local sum (its ``.grad``) in its bucket, restoring the
        gradient set aside when its window opened; the reduction is averaged over batch."""
        self._local.pop(id(param), None)
        scale = 1.0 / self.comm.shape.size("batch")
        local, param.grad = param.grad, self._kept.pop(id(param), None)
        if local is None:
            return
        flat = local.detach().reshape(-1).to(wire_dtype(self.precision, tag, param.dtype))  # (numel,)
        self._add_to_bucket(("batch", tag), (param, flat, scale))

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

    def _add_to_bucket(self, key: tuple[Axis, Term], item: _Item) -> None:
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
            self._learning.append([(id(p), g.numel()) for p, g, _ in items])
        if key == ("data", Term.E12) and self._shardings:
            self._scatter([item for item in items if self._scattered(item[0])])
            items = [item for item in items if not self._scattered(item[0])]
            if not items:
                return
        flat = items[0][1] if len(items) == 1 else self._in_place(items)
        if flat is None:
            flat = torch.cat([g for _, g, _ in items])
        handle = self.comm.all_reduce(flat, key[0], tag=key[1])
        if not self.policy.odp:
            handle.wait()
        self._reducing.append((items, handle, flat if len(items) > 1 else None))

    def _scattered(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s E12 is a reduce-scatter over data (ZeRO-2 owns parts of it)."""
        sharding = self.sharding_of(param) if self._shardings else None
        return sharding is not None and sharding.scatters

    def _whole_taker(self, param: torch.Tensor) -> DataSharding | None:
        """The ``DataSharding`` that takes ``param``'s all-reduced gradient whole (ZeRO-1 in 16 bits), or None."""
        sharding = self.sharding_of(param) if self._shardings else None
        return None if sharding is None or sharding.scatters else sharding

    def _scatter(self, items: list[_Item]) -> None:
        """ZeRO-2's E12 for one bucket: reduce-scatter its weight shards over data so that each rank
        receives the sum of its own part of each (docs/design.md §4). The input is rank-major —
        (G_data, S), row d holding data rank d's part of every shard in turn, the last part of a
        shard zero-padded — so a single shard that G_data divides is reduced as it stands, and
        several are laid side by side (one copy of the bucket)."""
        if not items:
            return
        g = self.comm.shape.size("data")
        parts: list[tuple[int, DataSharding]] = []
        columns: list[torch.Tensor] = []
        for param, grad, _ in items:
            sharding = self.sharding_of(param)
            c = sharding.part_numel(param) if sharding is not None else None
            assert sharding is not None and c is not None and g * c >= grad.numel()  # _scattered
            if grad.numel() != g * c:
                grad = torch.nn.functional.pad(grad, (0, g * c - grad.numel()))  # (G·c,)
            parts.append((c, sharding))
            columns.append(grad.view(g, c))  # (G, c): row d is data rank d's part
        flat = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)  # (G, S), S = Σ c
        handle = self.comm.reduce_scatter(flat, "data", tag=Term.E12)  # (1, S): this rank's parts
        if not self.policy.odp:
            handle.wait()
        self._reducing_parts.append((items, parts, handle))

    def _in_place(self, items: list[_Item]) -> torch.Tensor | None:
        """The flat buffer ``items`` fill exactly, in order (all written through ``weight_grad_slot``), or None."""
        first = items[0][1]
        flat = first._base
        if flat is None or first.data_ptr() != flat.data_ptr() or sum(g.numel() for _, g, _ in items) != flat.numel():
            return None
        ptr, size = flat.data_ptr(), flat.element_size()
        for _, g, _ in items:
            if g._base is not flat or g.data_ptr() != ptr:
                return None
            ptr += g.numel() * size
        return flat

    def _relearn(self) -> None:
        """After a reducing backward: the E12 buckets it flushed become the layout of the next one
        (its buffers now belong to the gradients they became)."""
        if self._learning:
            self._layout, self._layout_sizes = {}, []
            for b, members in enumerate(self._learning):
                offset = 0
                for pid, numel in members:
                    self._layout[pid] = (b, offset, numel)
                    offset += numel
                self._layout_sizes.append(offset)
        self._learning = []
        self._flats = {}

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
                    taker.take_whole_grad(param, _scaled(grad, scale))
                    continue
                grad = _scaled(grad, scale).to(param.dtype).view(param.shape)
                if param.grad is None:
                    param.grad = grad  # a slice of the bucket, or the reduced tensor itself
                else:
                    param.grad.add_(grad)
        reducing_parts, self._reducing_parts = self._reducing_parts, []
        for items, parts, handle in reducing_parts:  # ZeRO-2: each rank's parts
            row = handle.wait().view(-1)  # (S,)
            offset = 0
            for (param, _, scale), (c, sharding) in zip(items, parts):
                sharding.take_grad(param, _scaled(row[offset : offset + c], scale))
                offset += c
        if not self.holding:
            self._relearn()
        for handle, _ in list(self._prefetched.values()):  # prefetches nobody asked for (control flow changed)
            handle.wait()
        self._prefetched.clear()
        self._last_forward = None
        if not self.holding:  # carried blocks of layers the step's last backward did not reach
            self._carried.clear()

    def _release_held(self) -> None:
        """Reduce what accumulation still holds: weight shards' and biases' sums, and replicated
        parameters' local sums in ``.grad`` (in the order they were first held: the same on every rank)."""
        held, self._held = self._held, {}
        for param, grad, axis, tag, scale in held.values():
            self._add_to_bucket((axis, tag), (param, grad, scale))
        for ref, tag in list(self._local.values()):
            replicated = ref()
            if replicated is not None:
                self._reduce_replicated(replicated, tag)
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
