"""The 4D process grid (DESIGN.md §1): sizes, validation, rank coordinates and process groups.

A rank has coordinates (d, z, y, x) with x varying fastest (E1):

    rank = ((d · G_z + z) · G_y + y) · G_x + x

Groups come from ``torch.distributed.device_mesh.init_device_mesh`` with mesh shape
(G_data, G_z, G_y, G_x); the flattened ("data", "z") sub-mesh is the ``batch`` axis over which
tokens are split. Every check that depends only on sizes runs before any group is created, so a
wrong grid raises ``ValueError`` on every rank and never hangs in a collective.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from axon4d import device as devices
from axon4d.precision import Precision

#: the grid's axes, fastest first (E1). "batch" is data × z, "world" is every rank.
AXES = ("x", "y", "z", "data")
COMPOSITE_AXES = ("batch", "world")


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
        if axis not in AXES:
            raise ValueError(f"unknown grid axis {axis!r}; axes are {AXES + COMPOSITE_AXES}")
        return int(getattr(self, axis))

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.data)

    def __str__(self) -> str:
        return f"(x={self.x}, y={self.y}, z={self.z}, data={self.data})"

    @classmethod
    def parse(cls, grid: "GridShape | Sequence[int] | dict[str, int]", world_size: int) -> "GridShape":
        """Turn ``grid`` into a validated shape for ``world_size`` ranks.

        ``grid`` is (x, y, z, data) or a dict with those keys (missing keys are 1). At most one
        size may be -1, meaning "whatever makes the product equal the world size".
        """
        if isinstance(grid, GridShape):
            sizes = list(grid.as_tuple())
        elif isinstance(grid, dict):
            unknown = set(grid) - set(AXES)
            if unknown:
                raise ValueError(f"unknown grid axes {sorted(unknown)}; axes are {AXES}")
            sizes = [int(grid.get(a, 1)) for a in AXES]
        else:
            sizes = [int(s) for s in grid]
            if len(sizes) != 4:
                raise ValueError(
                    f"grid {tuple(grid)} has {len(sizes)} sizes; give 4 as (x, y, z, data), "
                    f"for example {factorizations(world_size)[-1].as_tuple()}"
                )
        if sizes.count(-1) > 1:
            raise ValueError(f"grid {tuple(sizes)}: at most one size may be -1 (fill in the rest)")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"grid {tuple(sizes)}: sizes must be positive (or a single -1)")
        if -1 in sizes:
            known = 1
            for s in sizes:
                known *= s if s != -1 else 1
            if world_size % known:
                raise ValueError(
                    f"grid {tuple(sizes)}: the known sizes multiply to {known}, which does not "
                    f"divide the world size {world_size}; {_suggest(world_size)}"
                )
            sizes[sizes.index(-1)] = world_size // known
        shape = cls(*sizes)
        if shape.world_size != world_size:
            raise ValueError(
                f"grid {shape} has {shape.world_size} ranks (x·y·z·data) but the world size is "
                f"{world_size}; {_suggest(world_size)}"
            )
        return shape


def factorizations(world_size: int) -> list[GridShape]:
    """Every (x, y, z, data) whose product is ``world_size``, in lexicographic order."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    shapes = []
    for x, y, z in itertools.product(divisors, repeat=3):
        if world_size % (x * y * z) == 0:
            shapes.append(GridShape(x, y, z, world_size // (x * y * z)))
    return shapes


def _suggest(
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


def require_divisible(
    value: int, what: str, shape: GridShape, axes: Sequence[str], rule: str
) -> None:
    """Raise ``ValueError`` unless ``value`` is divisible by the product of ``axes``' sizes.

    The message names the value, the rule and the grids of the same world size that satisfy it.
    """
    divisor = 1
    for a in axes:
        divisor *= shape.size(a)
    if value % divisor == 0:
        return

    def ok(s: GridShape) -> bool:
        d = 1
        for a in axes:
            d *= s.size(a)
        return value % d == 0

    label = "·".join(f"G_{a}" for a in axes)
    raise ValueError(
        f"{what} = {value} is not divisible by {label} = {divisor} on grid {shape} ({rule}); "
        + _suggest(shape.world_size, [s for s in factorizations(shape.world_size) if ok(s)], near=shape)
    )


class Grid:
    """A 4D process grid: this rank's coordinates and one process group per axis.

    Collectives are not issued here: ``grid.comm`` (axon4d.comm) is the only caller.
    """

    def __init__(self, shape: GridShape, device: torch.device, backend: str = "torch", launcher: str = "existing",
                 precision: "Precision | str | None" = None):
        from axon4d import comm  # comm needs the groups built here; import late to avoid a cycle

        self.shape = shape
        self.device = device
        self.launcher = launcher  # how the job was started: torchrun, mpi, single or existing
        self.precision = Precision.parse(precision)  # dtypes of parameters, compute and reductions
        self.rank = dist.get_rank()
        r = self.rank
        self.coords = {
            "x": r % shape.x,
            "y": (r // shape.x) % shape.y,
            "z": (r // (shape.x * shape.y)) % shape.z,
            "data": r // (shape.x * shape.y * shape.z),
        }
        self.coords["batch"] = self.coords["data"] * shape.z + self.coords["z"]
        self.coords["world"] = r
        mesh = init_device_mesh(
            devices.mesh_device_type(device),
            (shape.data, shape.z, shape.y, shape.x),
            mesh_dim_names=("data", "z", "y", "x"),
        )
        self._mesh: DeviceMesh | None = mesh  # None once destroyed
        self.groups: dict[str, dist.ProcessGroup] = {a: mesh[a].get_group() for a in AXES}
        self.groups["batch"] = mesh["data", "z"]._flatten("batch").get_group()
        self.groups["world"] = dist.group.WORLD
        expected = (self.coords["data"], self.coords["z"], self.coords["y"], self.coords["x"])
        if tuple(mesh.get_coordinate() or ()) != expected:
            raise RuntimeError(f"DeviceMesh placed rank {r} at {mesh.get_coordinate()}, E1 says {expected}")
        self.comm = comm.Communicator(self, backend)

    @property
    def mesh(self) -> DeviceMesh:
        """The grid's DeviceMesh (for DTensors); a destroyed grid has none."""
        if self._mesh is None:
            raise RuntimeError(f"{self} was destroyed (axon4d.shutdown / Grid.destroy); it has no DeviceMesh")
        return self._mesh

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis`` (x, y, z, data, batch = data·z, world)."""
        return self.shape.size(axis)

    def coord(self, axis: str) -> int:
        """This rank's index along ``axis``; for ``batch`` it is d·G_z + z."""
        return self.coords[axis]

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"Grid{self.shape} rank {self.rank} at (x={c['x']}, y={c['y']}, z={c['z']}, "
            f"data={c['data']}) on {self.device}, comm {self.comm.backend_name}"
        )

    def destroy(self) -> None:
        """Release this grid's process groups (the default group is left to its owner)."""
        self.comm.close()
        seen = {id(dist.group.WORLD)}  # DeviceMesh reuses the default group for a world-wide axis
        for group in self.groups.values():
            if id(group) in seen:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)
        self.groups.clear()  # the backend holds this same dict: empty it so the groups can be freed
        # The DeviceMesh holds the groups too, and layers, optimizers and autograd graphs built on
        # this grid refer to it in cycles. Drop the mesh and collect now: each group's transport
        # threads live as long as the group, and a process that builds one grid after another (a
        # benchmark, the calibration) would otherwise keep them all, time-slicing with its compute
        # (in a one-off 8-rank check the calibration's later steps ran 10–50% slower).
        self._mesh = None
        gc.collect()
