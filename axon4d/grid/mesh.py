"""The 4D process grid (docs/design.md §1): this rank's coordinates, one process group per axis,
and the grid's communicator and overlap scheduler.

A rank has coordinates (d, z, y, x) with x varying fastest (E1, ``axon4d.grid.shape``). Groups come
from ``torch.distributed.device_mesh.init_device_mesh`` with mesh shape (G_data, G_z, G_y, G_x);
the flattened ("data", "z") sub-mesh is the ``batch`` axis over which tokens are split. Every check
that depends only on sizes runs before any group is created (``GridShape.parse``, axon4d.grid.rules),
so a wrong grid raises ``ValueError`` on every rank and never hangs in a collective.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from axon4d import device as devices
from axon4d.comm.communicator import Communicator, close_group, host_group, make_transport
from axon4d.device.clock import Clock
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import AXES, BATCH_AXES, MESH_AXES, Axis, GridShape, members
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import Precision
from axon4d.scheduler import Scheduler


class Grid:
    """A 4D process grid: this rank's coordinates and one process group per axis.

    Collectives are not issued here: ``grid.comm`` (axon4d.comm.communicator) is the only caller, and
    ``grid.scheduler`` (axon4d.scheduler) decides when the layers' collectives run.
    """

    def __init__(
        self,
        shape: GridShape,
        device: torch.device,
        transport: str = "torch",
        launcher: str = "existing",
        precision: Precision | str | None = None,
        overlap: OverlapPolicy | None = None,
        timing: bool | None = None,
        timeout_s: float = 600.0,
        expert_layout: ExpertLayout | str | None = None,
    ):
        self.shape = shape
        #: where MoE layers built on this grid place their experts unless told (axon4d.grid.expert_layout)
        self.expert_layout = ExpertLayout.parse(expert_layout)
        self.timeout_s = timeout_s  # what bounds the host group's collectives (``axon4d.init``'s timeout_s)
        self.device = device
        self.launcher = launcher  # how the job was started: torchrun, mpi, slurm, single or existing
        self.precision = Precision.parse(precision)  # dtypes of parameters, compute and reductions
        self.rank = dist.get_rank()
        self.coords = shape.coordinates(self.rank)
        mesh = init_device_mesh(devices.mesh_device_type(device), shape.mesh_shape(), mesh_dim_names=MESH_AXES)
        self._mesh: DeviceMesh | None = mesh  # None once destroyed
        self.groups: dict[str, dist.ProcessGroup] = {a: mesh[a].get_group() for a in AXES}
        self.groups["batch"] = mesh[BATCH_AXES]._flatten("batch").get_group()
        world = dist.group.WORLD
        assert world is not None  # dist.get_rank() above succeeded, so the default group exists
        self.groups["world"] = world
        self._host: dist.ProcessGroup | None = None  # every rank on the host backend: made by host_group
        expected = shape.mesh_coordinate(self.rank)
        if tuple(mesh.get_coordinate() or ()) != expected:
            raise RuntimeError(f"DeviceMesh placed rank {self.rank} at {mesh.get_coordinate()}, E1 says {expected}")
        clock = Clock(device)  # collectives and compute timed where they run (axon4d.comm.log)
        self.comm = Communicator(shape, make_transport(transport, self.groups, shape, self.rank), clock, timing)
        self.scheduler = Scheduler(self.comm, self.precision, overlap, accelerator=not devices.is_host(device))

    @property
    def mesh(self) -> DeviceMesh:
        """The grid's DeviceMesh (for DTensors); a destroyed grid has none."""
        if self._mesh is None:
            raise RuntimeError(f"{self} was destroyed (axon4d.shutdown / Grid.destroy); it has no DeviceMesh")
        return self._mesh

    def host_group(self, timeout_s: float | None = None) -> dist.ProcessGroup:
        """A group of every rank on the host backend (gloo; ``axon4d.comm.communicator.host_group``), made at the
        first call — on every rank at once, a collective — and released by ``destroy``. Checkpoints
        coordinate on it (DCP's gathers of plans and results, its broadcast of the index), so those
        pickled objects travel through host memory, never through an accelerator's. Its pairs of
        ranks connect at their first message, not as a full mesh: O(world) store requests and bytes
        on rank 0, a few on the others (``axon4d.comm.host_mesh.lazy_connections``). ``timeout_s``
        (the first call's; default the grid's, ``axon4d.init``'s) bounds each of its collectives."""
        if self._host is None:
            self._host = host_group(self.timeout_s if timeout_s is None else timeout_s)
        return self._host

    def size(self, axis: Axis) -> int:
        """Number of ranks along ``axis`` (x, y, z, data, batch = data·z, world)."""
        return self.shape.size(axis)

    def coord(self, axis: Axis) -> int:
        """This rank's index along ``axis``; for ``batch`` it is d·G_z + z, for another product of
        axes the mixed-radix number of its members' coordinates, fastest first (``GridShape.coordinate``)."""
        index = self.coords.get(axis)
        return index if index is not None else self.shape.coordinate(self.rank, axis)

    def open_axis(self, axis: Axis) -> None:
        """Make the group of a product of axes (``axon4d.grid.shape.members``, e.g. "y·data", which an
        expert layout runs its all-to-all or gradient reduction over) if it does not exist yet: the
        DeviceMesh's dims flattened, and the transport told (MPI: a split of its world). Collective:
        every rank of the world calls it, in the same order (building the same layers does); the
        grid's own axes exist from the start."""
        if axis in self.groups:
            return
        dims = tuple(a for a in MESH_AXES if a in members(axis))  # the mesh's order, slowest first
        self.groups[axis] = self.mesh[dims]._flatten(axis).get_group()
        self.comm.transport.open_axis(axis, self.shape, self.rank)

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"Grid{self.shape} rank {self.rank} at (x={c['x']}, y={c['y']}, z={c['z']}, "
            f"data={c['data']}) on {self.device}, comm {self.comm.transport_name}"
        )

    def destroy(self, drain: bool = True) -> None:
        """Release this grid's process groups (the default group is left to its owner). ``drain``:
        first wait for the gradient reductions still in flight; False after an error, when the
        other ranks may never join them."""
        if drain:
            self.scheduler.finish_gradients()
        self.comm.close()
        if self._host is not None:
            close_group(self._host)
            self._host = None
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
