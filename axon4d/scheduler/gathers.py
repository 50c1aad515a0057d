"""OAG: the weight blocks' all-gathers over z, prefetched and kept (docs/design.md §4, E10f/E10b).

The weight side of ``axon4d.scheduler.Scheduler``: ``gather_weight`` issues the all-gather over z
of the *next* layers' weights (``oag_depth`` of them) — next in forward order during forward, in
reverse order during backward — so they run while the current layer computes. The order is learned
from the previous forward (``note_forward``). ``oag_keep`` keeps the forward's gathered block for
backward (memory for time: no E10b, see ``geometry.linear_collectives(cache_weight=True)``) and,
inside ``accumulating``, for the next micro-batch's forward (``carry_block``): E10f runs once per
step, not once per micro-batch. Regions under full recomputation (``recomputed_region``,
``rerunning``) save through autograd and teach no order.

A weight whose values are still arriving — ZeRO's all-gather over data deferred past the optimizer
step (``axon4d.zero``, ``defer_writes``) — is settled before its shard is read for a gather.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from axon4d.comm.communicator import Communicator, Handle
from axon4d.layout.geometry import Term, wire_dtype
from axon4d.options import fp8_gemm
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import (
    FP8,
    Precision,
    compute_dtype,
    fp8_pack,
    fp8_unpack,
    gathers_fp8,
    layer_precision,
)
from axon4d.scheduler.fp8_copies import FP8Copies
from axon4d.scheduler.fp8_copies import stamp as _stamp
from axon4d.scheduler.replay import RegionMemo


class WeightGathers(FP8Copies):
    """OAG for one grid's layers: E10f/E10b issued ahead, kept and carried blocks (the module docstring)."""

    comm: Communicator
    precision: Precision
    policy: OverlapPolicy
    _holding: int  # depth of ``Scheduler.accumulating`` regions

    def _init_gathers(self) -> None:
        self._init_fp8_copies()
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
        self._rerunning: weakref.WeakSet | None = None  # layers of the recomputed region being re-run
        self._recomputed_depth = 0  # depth of regions under full recomputation being run
        self._memo: RegionMemo | None = None  # the innermost such region's memo (``region_memo``)
        self._replaying = False  # whether that region is a re-run, reading its memo
        # parameters whose values are still arriving (``defer_writes``): id -> what completes them
        self._arriving: dict[int, Callable[[torch.Tensor], None]] = {}

    @property
    def holding(self) -> bool:
        """True inside ``Scheduler.accumulating``: data-axis gradient reductions are held and kept
        blocks carried to the next micro-batch."""
        return self._holding > 0

    def gather_weight(self, layer: Any, weight: torch.Tensor, backward: bool, fp8: bool = False) -> Any:
        """The (rows, cols) weight block of ``layer`` — E10f/E10b, all-gather over z — and the OAG prefetch
        of the layer that runs next (forward order, or reverse order when ``backward``). A forward
        outside full recomputation takes the block a held backward carried (``carry_block``) while
        ``weight`` is unchanged since: no E10f. With ``fp8`` (the layer's GEMMs run in FP8) the block
        is an ``fp8_gemm.Quantised`` e4m3 block with one scale: E10's result as gathered, a view of
        the z ranks' copies made once per step (``FP8Copies.fp8_shard``); else a tensor in the
        compute dtype."""
        carried = None if backward or self.recomputing else self._carried_block(layer, weight)
        if carried is not None:
            if self.policy.oag:
                self._prefetch_after(layer, backward)
            return carried
        handle = self._take_prefetch(layer, weight)
        if handle is None:
            handle = self._issue_gather(weight, backward, fp8)
        if self.policy.oag:
            self._prefetch_after(layer, backward)
        rows, cols = layer.block_shape
        flat = handle.wait()  # (G_z·n,) in the compute dtype; uint8 under FP8: (G_z·n,), or (G_z·(n + 4),) with scales
        g_z = self.comm.shape.size("z")
        if fp8:  # FP8 GEMMs: the gathered e4m3 bytes are the block, with the scale its z ranks share
            data = flat.view(-1)[: rows * cols].view(FP8).view(rows, cols)  # (rows, cols): a view
            return fp8_gemm.Quantised(data, self.fp8_shard_made(weight).scale)
        if gathers_fp8(layer_precision(self.precision, fp8), g_z):  # restored to the compute dtype for the GEMM
            flat = fp8_unpack(flat, g_z, compute_dtype(self.precision, weight))
        return flat[: rows * cols].view(rows, cols)

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
                handle = self._issue_gather(layer.weight, backward, getattr(layer, "fp8_gemms", False))
                self._prefetched[layer] = (handle, layer.weight._version)

    def will_gather_in_backward(self, layer: Any, needed: bool) -> None:
        """Note (at forward) whether ``layer``'s backward will gather its weight block, so the
        backward prefetch never fetches a block nobody uses."""
        self._gathers_in_backward[layer] = needed

    def _issue_gather(self, weight: torch.Tensor, backward: bool, fp8: bool = False) -> Handle:
        """Issue E10 (E10b when ``backward``, else E10f), the all-gather over z of ``weight``'s shard.

        Mixed precision: the shard is cast before the gather, so E10 moves compute-dtype bytes;
        under fp8 gathers (``precision.gather``) it moves the shard's e4m3 bytes and its scale, one
        uint8 chunk per rank (``fp8_pack``), which ``gather_weight`` restores. A layer whose GEMMs
        run in FP8 (``fp8``) moves the e4m3 bytes of this step's copy alone (``fp8_shard``: its
        scale is already the block's); with G_z = 1 the "gather" is that copy. A forward re-run under
        full recomputation gathers as a forward does (E10f)."""
        self._settle(weight)
        term = Term.E10B if backward else Term.E10F
        if fp8:
            return self.comm.all_gather(self.fp8_shard(weight).data.view(torch.uint8), "z", tag=term)
        # a layer kept in the compute dtype under FP8 GEMMs gathers in it: its weight is never e4m3-rounded
        dtype = wire_dtype(layer_precision(self.precision, fp8), term, weight.dtype, g_z=self.comm.shape.size("z"))
        if dtype == torch.uint8:  # FP8 gathers
            packed = fp8_pack(weight)  # (n + 4,)
            return self.comm.all_gather(packed, "z", tag=term)
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

    def carry_block(self, layer: Any, block: Any) -> None:
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

    def _carried_block(self, layer: Any, weight: torch.Tensor) -> Any:
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

    @property
    def region_memo(self) -> tuple[RegionMemo | None, bool]:
        """The innermost region under full recomputation's memo (None outside one, or in a region
        entered without one), and whether this is its re-run (read it) or its forward (record)."""
        return self._memo, self._replaying

    @contextlib.contextmanager
    def recomputed_region(self, memo: RegionMemo | None = None, replaying: bool = False) -> Iterator[None]:
        """The enclosed forward is a region under full recomputation (docs/design.md §5); ``memo``
        keeps what its forward decided for its re-run (``replaying``) to repeat."""
        self._recomputed_depth += 1
        previous = self._memo, self._replaying
        self._memo, self._replaying = memo, replaying
        if memo is not None and replaying:
            memo.rewind()
        try:
            yield
        finally:
            self._recomputed_depth -= 1
            self._memo, self._replaying = previous

    @contextlib.contextmanager
    def rerunning(self, layers: Any, memo: RegionMemo | None = None) -> Iterator[None]:
        """The enclosed forward re-runs a recomputed region during backward (full recomputation,
        docs/design.md §5): it teaches OAG no order, OAG prefetches only the region's own ``layers``
        (the layer after the region already ran its backward), and it reads the forward's ``memo``."""
        previous = self._rerunning
        self._rerunning = weakref.WeakSet(layers)
        try:
            with self.recomputed_region(memo, replaying=True):
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

    def defer_writes(self, params: list[torch.Tensor], settle: Callable[[torch.Tensor], None]) -> None:
        """``params``' values are still arriving (ZeRO's all-gather over data left in flight by the
        optimizer step, ``axon4d.zero.gathers``): ``settle(p)`` completes at least ``p``'s, and is
        called before any of their shards is read for a gather over z (E10f, E10b, an OAG
        prefetch). ``settle`` calls ``settled`` for the parameters it completed."""
        for p in params:
            self._arriving[id(p)] = settle

    def settled(self, params: list[torch.Tensor]) -> None:
        """``params``' deferred writes are complete (``defer_writes``)."""
        for p in params:
            self._arriving.pop(id(p), None)

    def _settle(self, weight: torch.Tensor) -> None:
        """Complete ``weight``'s deferred write, if it has one (``defer_writes``)."""
        settle = self._arriving.get(id(weight))
        if settle is not None:
            settle(weight)

    def _drop_prefetches(self) -> None:
        """The end of a backward: wait the prefetches nobody asked for (control flow changed), forget
        the forward order, and — outside ``accumulating`` — the carried blocks of layers the step's
        last backward did not reach and the weights' e4m3 copies (the optimizer step comes next)."""
        for handle, _ in list(self._prefetched.values()):
            handle.wait()
        self._prefetched.clear()
        self._last_forward = None
        if not self.holding:
            self._carried.clear()
            self.forget_fp8_copies()
