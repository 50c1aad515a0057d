"""What a forward under full recomputation decided that its re-run in backward must repeat
(docs/design.md §5): an MoE layer's routing — each token's experts and the dispatch plan whose
sizes cost a host sync — chosen once, by the forward, and reused by the re-run of that forward.

One ``RegionMemo`` per checkpointed call: ``axon4d.nn.recompute.recompute_block`` makes it when the
call runs and hands it to both the forward's context and the re-run's, so torch's checkpoint keeps it
with that call's autograd state. A forward that is never differentiated (an evaluation written
without ``no_grad``, a probe) drops its memo with its graph: no routing outlives the forward it
came from, and no other backward can take it.
"""

from __future__ import annotations

from typing import Any


class RegionMemo:
    """Values recorded by one recomputed region's forward, per owner (a layer) in call order, and read
    back in the same order by each re-run of that forward (a re-run starts again from the first)."""

    __slots__ = ("_values", "_read")

    def __init__(self) -> None:
        self._values: dict[int, list[Any]] = {}  # id(owner) -> values, in the forward's call order
        self._read: dict[int, int] = {}  # id(owner) -> how many the current re-run has read

    def record(self, owner: Any, value: Any) -> None:
        """The forward's ``value`` for ``owner``'s next call."""
        self._values.setdefault(id(owner), []).append(value)

    def rewind(self) -> None:
        """A re-run starts: its first call per owner reads the forward's first value."""
        self._read.clear()

    def replay(self, owner: Any) -> Any:
        """The forward's value for ``owner``'s call at this point of the re-run."""
        values = self._values.get(id(owner), [])
        i = self._read.get(id(owner), 0)
        if i >= len(values):
            raise RuntimeError(
                f"the re-run of a recomputed region called {type(owner).__name__} {i + 1} time(s), its forward "
                f"{len(values)}: the recomputed function must make the same calls as its forward"
            )
        self._read[id(owner)] = i + 1
        return values[i]
