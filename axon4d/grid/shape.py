"""The grid's shape as plain data (docs/design.md §1): axis names, sizes, rank coordinates (E1).

Nothing here communicates. A rank has coordinates (d, z, y, x) with x varying fastest:

    rank = ((d · G_z + z) · G_y + y) · G_x + x                                   (E1)

The axes are named once, here: ``AXES`` (x, y, z, data, fastest first), the composite axes
``batch`` (data × z, over which tokens are split) and ``world``, and ``MESH_AXES``, the order
DeviceMesh and checkpoints lay them out in (slowest first); ``Axis`` (``GridAxis`` for the four) is
their type, so mypy checks the axis a caller names. E1 is written once too:
``GridShape.stride`` (the rank distance between neighbours of an axis), from which come
``coordinates`` and the DeviceMesh's shape and coordinate (``mesh_shape``, ``mesh_coordinate``,
axon4d.grid.mesh).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from axon4d.grid import counts

#: one of the grid's four axes (``AXES``)
GridAxis = Literal["x", "y", "z", "data"]
#: an axis a collective runs over or a size is asked of: the grid's four, ``batch`` (data × z) and
#: ``world`` (``ALL_AXES``). A type for mypy; ``GridShape.size`` checks a value at run time.
Axis = Literal[
    "x",
    "y",
    "z",
    "data",
    "batch",
    "world",
    "x·y",
    "x·z",
    "x·data",
    "y·z",
    "y·data",
    "x·y·z",
    "x·y·data",
    "x·z·data",
    "y·z·data",
]

#: the grid's axes, fastest first (E1).
AXES: tuple[GridAxis, ...] = ("x", "y", "z", "data")
#: axes made of others: "batch" is data × z, "world" is every rank.
COMPOSITE_AXES: tuple[Axis, ...] = ("batch", "world")
#: every axis a collective may run over, in the order reports list them.
ALL_AXES: tuple[Axis, ...] = AXES + COMPOSITE_AXES
#: the axes as DeviceMesh dims, slowest first (the reverse of E1's order).
MESH_AXES: tuple[GridAxis, ...] = tuple(reversed(AXES))
#: the DeviceMesh dims the composite ``batch`` axis is flattened from (data × z).
BATCH_AXES: tuple[GridAxis, ...] = ("data", "z")


def members(axis: str) -> tuple[GridAxis, ...]:
    """The grid axes ``axis`` is made of, fastest first: ("x",) for x, ("z", "data") for batch, all
    four for world, ("y", "data") for "y·data" — a product of axes an expert layout groups ranks
    over (axon4d.grid.expert_layout). ``ValueError`` for a name that is none of these."""
    if axis == "batch":
        return ("z", "data")
    if axis == "world":
        return AXES
    parts = tuple(axis.split("·"))
    if not parts or any(p not in AXES for p in parts) or list(parts) != sorted(set(parts), key=AXES.index):
        raise ValueError(
            f"unknown grid axis {axis!r}; axes are {ALL_AXES}, or a product of the four written fastest "
            "first with '·', e.g. 'y·data'"
        )
    return parts  # type: ignore[return-value]  # checked: each is one of AXES


def axis_of(axes: Iterable[str]) -> Axis | None:
    """The axis name of the product of ``axes`` (any order; None for none): "batch" for z and data,
    "world" for all four, else the names fastest first joined by '·' (inverse of ``members``)."""
    given = set(axes)
    unknown = given - set(AXES)
    if unknown:
        raise ValueError(f"unknown grid axes {sorted(unknown)}; axes are {AXES}")
    ordered = tuple(a for a in AXES if a in given)
    if not ordered:
        return None
    if ordered == ("z", "data"):
        return "batch"
    if ordered == AXES:
        return "world"
    return "·".join(ordered)  # type: ignore[return-value]  # a product of grid axes


@dataclasses.dataclass(frozen=True)
class GridShape:
    """Sizes of the four axes; their product is the world size."""

    x: int
    y: int
    z: int
    data: int

    @property
    def world_size(self) -> int:
        return self.x * self.y * self.z * self.data

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis`` (one of x, y, z, data, batch, world)."""
        if axis == "batch":
            return self.data * self.z
        if axis == "world":
            return self.world_size
        if axis in AXES:
            return int(getattr(self, axis))
        size = 1
        for a in members(axis):  # a product of axes (``members`` raises for an unknown name)
            size *= int(getattr(self, a))
        return size

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.data)

    def __str__(self) -> str:
        return f"(x={self.x}, y={self.y}, z={self.z}, data={self.data})"

    def stride(self, axis: str) -> int:
        """The distance in rank numbers between consecutive members of an ``axis`` group (E1):
        1 for x, G_x for y, G_x·G_y for z and batch (data × z), G_x·G_y·G_z for data, 1 for world;
        for another product of axes, that of its fastest member (its members lie at that distance
        and multiples of the slower members' strides)."""
        if axis == "world":
            return 1
        first = members(axis)[0] if axis not in AXES else axis
        stride = 1
        for a in AXES[: AXES.index(first)]:
            stride *= self.size(a)
        return stride

    def coordinate(self, rank: int, axis: str) -> int:
        """``rank``'s index along ``axis`` (E1): its own coordinate for one of the four axes, and for
        a product of axes the mixed-radix number of its members' coordinates, fastest first —
        d·G_z + z for batch, the rank for world."""
        index, radix = 0, 1
        for a in members(axis) if axis not in AXES else (axis,):
            c = rank // self.stride(a) % self.size(a)
            index += c * radix
            radix *= self.size(a)
        return index

    def group_offsets(self, axis: str) -> list[int]:
        """The ranks of the ``axis`` group that holds rank 0, in the group's order (E1): i·stride for
        one of the four axes, the mixed-radix sums of the members' strides for a product of them."""
        offsets = [0]
        for a in members(axis) if axis not in AXES else (axis,):
            step = self.stride(a)
            offsets = [o + c * step for c in range(self.size(a)) for o in offsets]
        return offsets

    def coordinates(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis of ``ALL_AXES`` (E1); ``batch`` is d·G_z + z,
        ``world`` the rank (``coordinate`` for any product of axes)."""
        return {a: self.coordinate(rank, a) for a in ALL_AXES}

    def mesh_shape(self) -> tuple[int, ...]:
        """The sizes of the DeviceMesh dims (``MESH_AXES``: data, z, y, x)."""
        return tuple(self.size(a) for a in MESH_AXES)

    def mesh_coordinate(self, rank: int) -> tuple[int, ...]:
        """Where E1 puts ``rank`` on the DeviceMesh (``MESH_AXES``: d, z, y, x)."""
        c = self.coordinates(rank)
        return tuple(c[a] for a in MESH_AXES)

    @classmethod
    def parse(cls, grid: GridShape | Sequence[int] | Mapping[str, int], world_size: int) -> GridShape:
        """Turn ``grid`` into a validated shape for ``world_size`` ranks.

        ``grid`` is (x, y, z, data) or a dict with those keys (missing keys are 1). At most one
        size may be -1, meaning "whatever makes the product equal the world size".
        """
        if isinstance(grid, GridShape):
            sizes = check_sizes(grid.as_tuple())
        elif isinstance(grid, Mapping):
            unknown = set(grid) - set(AXES)
            if unknown:
                raise ValueError(f"unknown grid axes {sorted(unknown)}; axes are {AXES}")
            sizes = check_sizes([grid.get(a, 1) for a in AXES])
        elif isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
            raise TypeError(
                f"grid {grid!r} ({type(grid).__name__}) is not a grid: give (x, y, z, data) sizes, a dict such as "
                f"{{'x': 2, 'data': -1}}, or a GridShape, for example {factorizations(world_size)[-1].as_tuple()}"
            )
        else:
            given = tuple(grid)
            if len(given) != 4:
                raise ValueError(
                    f"grid {given} has {len(given)} sizes; give 4 as (x, y, z, data), "
                    f"for example {factorizations(world_size)[-1].as_tuple()}"
                )
            sizes = check_sizes(given)
        if -1 in sizes:
            known = 1
            for s in sizes:
                known *= s if s != -1 else 1
            if world_size % known:
                raise ValueError(
                    f"grid {tuple(sizes)}: the known sizes multiply to {known}, which does not "
                    f"divide the world size {world_size}; {suggest(world_size)}"
                )
            sizes[sizes.index(-1)] = world_size // known
        shape = cls(*sizes)
        if shape.world_size != world_size:
            raise ValueError(
                f"grid {shape} has {shape.world_size} ranks (x·y·z·data) but the world size is "
                f"{world_size}; {suggest(world_size)}"
            )
        return shape


def check_sizes(sizes: Sequence[object]) -> list[int]:
    """``sizes`` as ints if each is a whole number ≥ 1 or -1 ("the rest", at most once); a float
    such as 1.5, a string or a bool is a ``TypeError`` (never truncated), zero or another negative
    size a ``ValueError``. The world size is not needed (``GridShape.parse`` checks the product)."""
    shown = tuple(sizes)
    ints: list[int] = []
    for s in sizes:
        if not counts.is_whole(s):
            raise TypeError(
                f"grid {shown}: size {s!r} ({type(s).__name__}) is not a whole number; give each of "
                "(x, y, z, data) as an int ≥ 1, or -1 for the rest, e.g. (1, 4, 1, 1)"
            )
        ints.append(int(s))
    if ints.count(-1) > 1:
        raise ValueError(f"grid {shown}: at most one size may be -1 (fill in the rest); give the others as sizes ≥ 1")
    bad = [s for s in ints if s == 0 or s < -1]
    if bad:
        raise ValueError(
            f"grid {shown}: size {bad[0]} is not allowed; sizes must be positive (or a single -1 for the rest)"
        )
    return ints


def factorizations(world_size: int) -> list[GridShape]:
    """Every (x, y, z, data) whose product is ``world_size``, in lexicographic order."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    shapes = []
    for x, y, z in itertools.product(divisors, repeat=3):
        if world_size % (x * y * z) == 0:
            shapes.append(GridShape(x, y, z, world_size // (x * y * z)))
    return shapes


def suggest(
    world_size: int, shapes: Iterable[GridShape] | None = None, near: GridShape | None = None, limit: int = 8
) -> str:
    """A sentence listing grids that work, those closest to ``near`` (fewest changed axes) first."""
    shapes = list(factorizations(world_size) if shapes is None else shapes)
    if near is not None:
        shapes.sort(key=lambda s: sum(a != b for a, b in zip(s.as_tuple(), near.as_tuple())))
    if not shapes:
        return f"no grid of {world_size} ranks satisfies this"
    shown = ", ".join(str(s.as_tuple()) for s in shapes[:limit])
    more = f" and {len(shapes) - limit} more" if len(shapes) > limit else ""
    return f"grids (x, y, z, data) that work: {shown}{more}"
