"""ZeRO's side of the gradient reductions: who owns which part of a weight shard's gradient over
data, and the reduce-scatter input that gives each data rank its parts (docs/design.md §4, "ZeRO").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from axon4d.comm.communicator import Communicator, Handle
from axon4d.layout.geometry import Term
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.scheduler.layout import Item


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

    def stores_sixteen(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is stored in 16 bits with its fp32 master here: its reduced gradient,
        however it is reduced, goes to ``take_whole_grad`` or ``take_grad``, never to ``.grad``."""
        ...


#: each item's part size and the sharding that takes it, in the bucket's order
Parts = list[tuple[int, DataSharding]]


def scatter_input(
    items: list[Item], g_data: int, sharding_of: Callable[[torch.Tensor], DataSharding | None]
) -> tuple[torch.Tensor, Parts]:
    """ZeRO-2's E12 input for one bucket, reduce-scattered over data so that each rank receives the
    sum of its own part of each weight shard: rank-major (G_data, S), row d holding data rank d's
    part of every shard in turn, the last part of a shard zero-padded — a single shard that G_data
    divides is reduced as it stands, and several are laid side by side (one copy of the bucket)."""
    parts: Parts = []
    columns: list[torch.Tensor] = []
    for param, grad, _ in items:
        sharding = sharding_of(param)
        c = sharding.part_numel(param) if sharding is not None else None
        assert sharding is not None and c is not None and g_data * c >= grad.numel()  # a scattered shard
        if grad.numel() != g_data * c:
            grad = torch.nn.functional.pad(grad, (0, g_data * c - grad.numel()))  # (G·c,)
        parts.append((c, sharding))
        columns.append(grad.view(g_data, c))  # (G, c): row d is data rank d's part
    flat = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)  # (G, S), S = Σ c
    return flat, parts


def scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad`` times ``scale``, in place; no pass over it when ``scale`` is 1 (G_batch = 1)."""
    return grad if scale == 1.0 else grad.mul_(scale)


#: the gradient buckets ZeRO-2 reduce-scatters over data (axis, tag): the 3D Linear weight shards'
#: (E12), and an MoE layer's expert replicas' where its layout puts the replicas on data alone
#: (``Scheduler.track_replicated`` with axis "data"); every other replicated gradient is all-reduced
SCATTERED_OVER_DATA = frozenset({("data", Term.E12), ("data", Term.MOE_EXPERT_WEIGHT_GRAD)})


class DataShardings:
    """The scheduler's ZeRO hand-off: the ``DataSharding`` s that take E12 gradients instead of
    ``.grad``, ZeRO-2's reduce-scatters over data and the parts they deliver."""

    comm: Communicator
    policy: OverlapPolicy

    def finish_gradients(self) -> None: ...  # the scheduler's

    def _init_shardings(self) -> None:
        self._shardings: list[DataSharding] = []  # ZeRO: who take E12's gradients instead of .grad
        # ZeRO-2's E12 reduce-scatters in flight: (items, each one's part size and sharding, handle)
        self._reducing_parts: list[tuple[list[Item], Parts, Handle]] = []

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

    def _scattered(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s E12 is a reduce-scatter over data (ZeRO-2 owns parts of it)."""
        sharding = self.sharding_of(param) if self._shardings else None
        return sharding is not None and sharding.scatters

    def _whole_taker(self, param: torch.Tensor) -> DataSharding | None:
        """The ``DataSharding`` that takes ``param``'s all-reduced gradient whole, or None: ZeRO-1
        training in 16 bits, and under ZeRO-2 a 16-bit parameter whose gradient is all-reduced, not
        reduce-scattered (an MoE layer's expert replicas whose axis is not data alone, e.g. z·data)."""
        sharding = self.sharding_of(param) if self._shardings else None
        if sharding is None or (sharding.scatters and not sharding.stores_sixteen(param)):
            return None
        return sharding

    def _scatter(self, items: list[Item], tag: Term = Term.E12) -> None:
        """ZeRO-2's reduction over data of one bucket (``tag``: E12, or an MoE layer's expert
        replicas' gradients where the replicas lie on data alone): reduce-scatter its gradients over
        data, each rank receiving the sum of its own part of each (``sharding.scatter_input``)."""
        if not items:
            return
        flat, parts = scatter_input(items, self.comm.shape.size("data"), self.sharding_of)  # (G, S)
        handle = self.comm.reduce_scatter(flat, "data", tag=tag)  # (1, S): this rank's parts
        if not self.policy.odp:
            handle.wait()
        self._reducing_parts.append((items, parts, handle))

    def _hand_parts(self) -> None:
        """Wait ZeRO-2's reduce-scatters and hand each rank's parts to their ``DataSharding``."""
        reducing_parts, self._reducing_parts = self._reducing_parts, []
        for items, parts, handle in reducing_parts:
            row = handle.wait().view(-1)  # (S,)
            offset = 0
            for (param, _, scale), (c, sharding) in zip(items, parts):
                sharding.take_grad(param, scaled(row[offset : offset + c], scale))
                offset += c
