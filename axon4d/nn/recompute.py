"""Activation recomputation inside a transformer block (docs/design.md §5), by mode name.

The modes mean exactly what the planner's ``--recompute`` prices (axon4d.plan.saved, axon4d.plan.memory):

- ``none``: every activation autograd needs is kept from forward to backward.
- ``selective``: core attention (scores, softmax, weighted sum, rotary) is recomputed in backward
  from the saved q, k, v (``torch.utils.checkpoint``, non-reentrant).
- ``balanced``: compute–memory balanced recomputation. The cheap elementwise ops that feed a GEMM —
  the norms' normalisation and the MLP's activation function — are not kept: the GEMM that consumes
  their output keeps a *recipe* instead (the op and its inputs, which are alive anyway) and re-runs
  the op inside its own backward (``recomputed_input``). The norms' statistics, which need an
  all-reduce over x, are kept, so no GEMM and no collective is ever run again.
- ``full``: only the block's input is kept; the whole block forward, collectives included, runs
  again in backward (``recompute_block``). The grid's scheduler is told (``Scheduler.rerunning``)
  so the recomputed forward teaches OAG no order and prefetches only the block's own layers.

Every mode gives the same gradients as ``none``. The saved-tensor hooks here pass what they do not
turn into recipes to an offloaded block's hooks (``axon4d.memory.offload.pack``; they are innermost, so
torch would not call the offloader's), and a recipe made inside an offloaded block keeps its inputs
offloaded too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from axon4d.memory import offload
from axon4d.scheduler import Scheduler
from axon4d.scheduler.replay import RegionMemo


def recomputed(fn: Callable[..., torch.Tensor], *inputs: Any) -> torch.Tensor:
    """``fn(*inputs)`` keeping only its inputs; everything inside is recomputed in backward."""
    return checkpoint(fn, *inputs, use_reentrant=False)


def recompute_block(fn: Callable[..., Any], *inputs: Any, scheduler: Scheduler, layers: Iterable[Any]) -> Any:
    """``fn(*inputs)`` keeping only ``inputs``: the forward, collectives included, re-runs in backward
    under ``scheduler.rerunning(layers)`` (``layers``: the 3D layers ``fn`` runs). What the forward
    decides for its re-run to repeat (an MoE layer's routing) goes in a memo made for this call alone,
    which torch's checkpoint keeps with the call's autograd state (``axon4d.scheduler.replay``)."""
    own = list(layers)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        memo = RegionMemo()  # one per call: the forward records, the re-run of this call reads
        return scheduler.recomputed_region(memo), scheduler.rerunning(own, memo)

    return checkpoint(fn, *inputs, use_reentrant=False, context_fn=contexts)


class _Recipe:
    """How to make a saved tensor again: ``fn(*inputs)``."""

    __slots__ = ("fn", "inputs")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[Any, ...]):
        self.fn, self.inputs = fn, inputs

    def make(self) -> torch.Tensor:
        with torch.no_grad():
            return self.fn(*(offload.unpack(i) for i in self.inputs))


@contextlib.contextmanager
def recomputed_input(fn: Callable[..., torch.Tensor], *inputs: Any) -> Iterator[torch.Tensor]:
    """Yield ``h = fn(*inputs)`` for a consumer (a GEMM) called inside the ``with`` block; neither
    ``h`` nor ``fn``'s intermediates are kept for backward.

    ``fn`` must be cheap and elementwise-like, and its ``inputs`` must stay unchanged until backward
    (they are what ``fn``'s own backward needs anyway). Where the consumer saves ``h`` for its
    backward, a recipe is saved instead and ``h`` is made again when the consumer's backward asks
    for it; ``fn``'s own backward recomputes its intermediates (``torch.utils.checkpoint``).

        with recomputed_input(norm.normalize, x, stats, norm.weight) as h:
            y = qkv(h)                        # qkv keeps a recipe for h, not h
    """
    h = recomputed(fn, *inputs)

    made = weakref.ref(h)  # autograd keeps the hooks as long as what they packed: never ``h`` itself
    # what a recipe holds: the inputs, or in an offloaded block their host copies (the hooks, which
    # autograd keeps, hold this and not ``inputs``, so the device tensors are not kept alive here)
    kept = tuple(offload.pack(i) if isinstance(i, torch.Tensor) else i for i in inputs)

    def pack(t: torch.Tensor) -> Any:
        return _Recipe(fn, kept) if t is made() else offload.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield h


class Recipes:
    """Tensors that whoever saves them for backward saves as a recipe instead (balanced
    recomputation where the consumer's code is not ours, e.g. a Hugging Face block).

    ``keep(h, fn, *inputs)`` notes that ``h == fn(*inputs)``; inside ``saving()``, autograd saves
    such an ``h`` as its recipe and makes it again when backward asks for it.
    """

    def __init__(self) -> None:
        self._noted: dict[int, tuple[Any, _Recipe]] = {}  # id(h) → (weak reference to h, recipe)

    def keep(self, h: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: Any) -> torch.Tensor:
        """Note ``h = fn(*inputs)`` (``fn`` cheap, ``inputs`` unchanged until backward); returns ``h``."""
        self._noted[id(h)] = (weakref.ref(h), _Recipe(fn, inputs))
        return h

    def _pack(self, t: torch.Tensor) -> Any:
        entry = self._noted.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return offload.pack(t)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Save the noted tensors as recipes inside the ``with`` block; forget them after it."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._noted.clear()


def _unpack(saved: Any) -> torch.Tensor:
    return saved.make() if isinstance(saved, _Recipe) else offload.unpack(saved)
