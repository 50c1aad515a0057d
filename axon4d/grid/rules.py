"""The divisibility rules a grid must satisfy (docs/design.md §1), stated once.

A ``Rule`` says that some count (features, heads, sequences) is split evenly over some grid axes.
The layers check their rules when they are built (``check``: a ``ValueError`` on every rank, before
any communication, naming the value, the rule and the grids that would work); the planner
evaluates the same rules on every factorisation at once (``Rule.holds`` accepts numpy arrays of
axis sizes) to know which grids are valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from axon4d.grid import counts
from axon4d.grid.shape import GridShape, factorizations, suggest
from axon4d.layout.geometry import layer_axes


def _size(sizes: GridShape | Mapping[str, Any], axis: str) -> Any:
    if isinstance(sizes, GridShape):
        return sizes.size(axis)
    if axis == "batch":
        return sizes["data"] * sizes["z"]
    return sizes[axis]


@dataclasses.dataclass(frozen=True)
class Rule:
    """``value`` (called ``what``) must be divisible by the product of ``axes``' sizes, because ``why``."""

    value: int
    what: str
    axes: tuple[str, ...]
    why: str

    def divisor(self, sizes: GridShape | Mapping[str, Any]) -> Any:
        """The product of the rule's axis sizes (elementwise for arrays of sizes)."""
        d: Any = 1
        for a in self.axes:
            d = d * _size(sizes, a)
        return d

    def holds(self, sizes: GridShape | Mapping[str, Any]) -> Any:
        """True where the rule holds: a bool for a ``GridShape``, a boolean array for arrays of sizes
        ({"x": ..., "y": ..., "z": ..., "data": ...})."""
        return self.value % self.divisor(sizes) == 0

    def message(self, shape: GridShape) -> str:
        """What breaks on ``shape``, the rule, and the grids of the same world size that satisfy it."""
        label = "·".join(f"G_{a}" for a in self.axes)
        ok = [s for s in factorizations(shape.world_size) if self.holds(s)]
        return (
            f"{self.what} = {self.value} is not divisible by {label} = {self.divisor(shape)} on grid {shape} "
            f"({self.why}); " + suggest(shape.world_size, ok, near=shape)
        )

    def check(self, shape: GridShape) -> None:
        """Raise ``ValueError`` (``message``) unless the rule holds on ``shape``."""
        if not self.holds(shape):
            raise ValueError(self.message(shape))


def count(value: object, what: str, example: int = 8) -> int:
    """``value`` if it is a count of things (a whole number, at least 1; ``axon4d.grid.counts.whole``):
    ``TypeError`` for a non-integer (bools included), ``ValueError`` for zero or a negative number,
    each naming ``what``, the value and an ``example`` that works."""
    return counts.whole(value, what, example=example)


def check(shape: GridShape, rules: Iterable[Rule]) -> None:
    """Raise ``ValueError`` for the first of ``rules`` that ``shape`` breaks."""
    for rule in rules:
        rule.check(shape)


def divisible(value: int, what: str, axes: Sequence[str], why: str) -> Rule:
    """The rule that ``value`` splits evenly over ``axes``."""
    return Rule(value, what, tuple(axes), why)


def linear(in_features: int, out_features: int, transpose: bool, name: str = "") -> list[Rule]:
    """A 3D linear layer splits input features over its input axis and output features over its
    output axis (x and y; swapped when ``transpose``) — §2."""
    in_axis, out_axis = layer_axes(transpose)
    prefix = f"{name}: " if name else ""
    return [
        Rule(
            in_features,
            f"{prefix}in_features",
            (in_axis,),
            f"{'a transposed' if transpose else 'a normal'} layer splits input features over {in_axis}",
        ),
        Rule(
            out_features,
            f"{prefix}out_features",
            (out_axis,),
            f"{'a transposed' if transpose else 'a normal'} layer splits output features over {out_axis}",
        ),
    ]


def heads(n_heads: int, n_kv_heads: int) -> list[Rule]:
    """Attention splits query heads and key/value heads over y."""
    return [
        Rule(n_heads, "n_heads", ("y",), "attention splits heads over y"),
        Rule(n_kv_heads, "n_kv_heads", ("y",), "attention splits key/value heads over y"),
    ]


def batch(sequences: int, what: str = "the batch (dim 0 of the input)") -> Rule:
    """Tokens are split by whole sequences (dim 0) over batch = data × z."""
    return Rule(sequences, what, ("data", "z"), "tokens are split over data × z")


def mlp(ffn: int) -> Rule:
    """The MLP splits its inner features over y."""
    return Rule(ffn, "ffn_hidden", ("y",), "the MLP splits its inner features over y")


def embedding(vocab_size: int, hidden: int) -> list[Rule]:
    """The vocabulary-parallel embedding splits the vocabulary over y and hidden features over x."""
    return [
        Rule(vocab_size, "vocab_size", ("y",), "the embedding splits the vocabulary over y"),
        Rule(hidden, "hidden", ("x",), "the embedding splits hidden features over x"),
    ]


def positions(hidden: int) -> Rule:
    """Learned position embeddings split hidden features over x."""
    return Rule(hidden, "hidden", ("x",), "position embeddings split hidden over x")


def norm(hidden: int, axis: str) -> Rule:
    """A sharded norm splits its features over ``axis``, like the residual stream it normalises."""
    return Rule(
        hidden, "the normalised feature count", (axis,), f"norm features are split over {axis} like the residual stream"
    )


def features(count: int, axis: str) -> Rule:
    """A tensor's last dim split over ``axis``."""
    return Rule(count, "the feature count (last dim)", (axis,), f"features are split over {axis} here")
