"""What of a node's memory a training job can use (docs/planner.md, "Memory a job can use").

A device's memory is not all the job's: the CUDA context, the GEMM and attention libraries'
workspaces and every NCCL communicator's buffers are taken before the first tensor, and the
caching allocator loses a share of the peak to fragmentation. A node's host memory is not all
the job's either: the OS, SLURM, the file system client and the ranks' own processes hold part of
it. ``axon4d.plan.machine.Machine`` states these per machine (``usable_device_memory``,
``fragmentation``, ``pinned_host_per_node``); this module counts the communicators a rank of a
grid holds (``grid_communicators``) and checks a machine file's fields (``check_memory_fields``).

No figure the fit test needs is taken as 0 for want of one: an accelerator's file must give each of
``FIT_FIELDS`` with its source (a key of its "sources" naming it, alone or in a comma-separated
list), else it is refused naming the field and how to get it (``axon4d calibrate``, which measures
or states each on the device it runs on: ``axon4d.measure.memory_figures``). A host's file needs
only ``memory_per_device``: a process on a host holds no accelerator context, library workspace
or NCCL communicator, so those are 0 by definition there.
"""

from __future__ import annotations

from typing import Any

from axon4d.grid.shape import GridShape

#: the axes axon4d.grid.mesh builds a process group for, besides the world's (the default group)
GROUP_AXES = ("x", "y", "z", "data", "batch")
#: node memory fields an accelerator's machine file must give (bytes)
NODE_FIELDS = ("host_memory_per_node", "host_reserve_per_node")
#: device memory fields (bytes) that are not the job's; an accelerator's file must give them
DEVICE_FIELDS = ("cuda_context_bytes", "device_workspace_bytes", "nccl_buffer_bytes")
#: what each figure the fit test needs is, for the message that refuses a file without it
FIT_FIELDS: dict[str, str] = {
    "memory_per_device": "bytes of memory on one device",
    "cuda_context_bytes": "device memory the accelerator's context and libraries take before any tensor",
    "device_workspace_bytes": "device memory the GEMM and attention libraries' workspaces hold through a step",
    "nccl_buffer_bytes": "device memory of one NCCL communicator's buffers",
    "fragmentation": "share of the peak the caching allocator loses",
    "host_memory_per_node": "bytes of host memory in one node",
    "host_reserve_per_node": "bytes of the node's host memory the OS, batch system and job's processes keep",
}


def grid_communicators(shape: GridShape) -> int:
    """NCCL communicators one rank of ``shape`` holds that carry collectives.

    ``axon4d.grid.mesh`` builds one process group per axis x, y, z, data and batch (data × z) with
    DeviceMesh, and keeps the default group as "world". Counted: the world's communicator where
    there are two ranks or more (barriers, gradient norms, agreement), and one per axis of two
    ranks or more that is not the whole world (DeviceMesh hands a mesh dimension spanning every
    rank the default group itself). Batch has a communicator of its own even where it holds the
    same ranks as z (data = 1) or data (z = 1): torch creates a separate group. Axes of one rank
    issue no collective (axon4d.comm.communicator returns at once), so their groups never create one; torch
    creates every communicator lazily, on its first collective."""
    world = shape.world_size
    if world <= 1:
        return 0
    return 1 + sum(1 for axis in GROUP_AXES if 1 < shape.size(axis) < world)


def check_memory_fields(d: dict[str, Any], name: str) -> None:
    """``ValueError`` for a machine file (as a dict) whose memory fields cannot be used: an
    accelerator's without ``host_memory_per_node`` and ``host_reserve_per_node`` (or with the
    replaced ``host_memory_per_device``), a reserve not below the memory, a negative device field
    or a fragmentation share outside [0, 1)."""
    accelerator = bool(d.get("accelerator", False))
    if "memory_per_device" not in d:
        raise ValueError(
            f"machine file {name!r} gives no memory_per_device ({FIT_FIELDS['memory_per_device']}): calibrate the "
            "machine (`axon4d calibrate --out FILE`, which records it) or give it in bytes"
        )
    if accelerator and "host_memory_per_device" in d:
        raise ValueError(
            f"machine file {name!r} gives host_memory_per_device ({d['host_memory_per_device']:.4g} bytes), which "
            "was replaced: give host_memory_per_node (bytes of host memory in one node) and host_reserve_per_node "
            "(bytes of it the OS, the batch system and the job's own processes keep), e.g. 256 GB and 24 GiB for a "
            "Perlmutter GPU node"
        )
    d.pop("host_memory_per_device", None)  # a host file's (always 0): not needed there
    if accelerator:
        missing = [f for f in NODE_FIELDS if f not in d]
        if missing:
            raise ValueError(
                f"machine file {name!r} describes an accelerator but gives no {' and no '.join(missing)}: give "
                "host_memory_per_node (bytes of host memory in one node) and host_reserve_per_node (bytes of it "
                "the OS, the batch system and the job's own processes keep; below host_memory_per_node), e.g. as "
                "`axon4d calibrate --out FILE` on one node of that machine records them"
            )
        memory, reserve = float(d["host_memory_per_node"]), float(d["host_reserve_per_node"])
        if not memory > 0:
            raise ValueError(
                f"machine file {name!r}: host_memory_per_node is {memory:.4g}; it must be the node's host memory "
                "in bytes, above 0"
            )
        if not 0 <= reserve < memory:
            raise ValueError(
                f"machine file {name!r}: host_reserve_per_node is {reserve:.4g} bytes against host_memory_per_node "
                f"{memory:.4g}; it must be at least 0 and below the memory (e.g. {0.1 * memory:.4g}, a tenth), or "
                "nothing is left to pin"
            )
    if accelerator:
        check_sourced(d, name)
    for field in DEVICE_FIELDS:
        if float(d.get(field, 0.0)) < 0:
            raise ValueError(f"machine file {name!r}: {field} is {d[field]:.4g}; give bytes, 0 or more")
    frag = float(d.get("fragmentation", 0.0))
    if not 0 <= frag < 1:
        raise ValueError(
            f"machine file {name!r}: fragmentation is {frag}; give the share of the peak the allocator loses, "
            "from 0 up to below 1 (e.g. 0.05)"
        )


def sourced(d: dict[str, Any]) -> set[str]:
    """The fields a machine file (as a dict) names in its "sources": each key, split at commas."""
    return {part.strip() for key in d.get("sources", {}) for part in str(key).split(",")}


def check_sourced(d: dict[str, Any], name: str) -> None:
    """``ValueError`` for an accelerator's machine file (as a dict) missing a figure the fit test
    needs (``FIT_FIELDS``), or giving one without a source: the first such field named, what it is
    and how to get it."""
    have = sourced(d)
    for field, what in FIT_FIELDS.items():
        if field in d and field in have:
            continue
        given = f"gives {field} = {d[field]!r} without a source" if field in d else f"gives no {field}"
        raise ValueError(
            f"machine file {name!r} describes an accelerator but {given} ({what}; the fit test needs it, and a "
            "figure taken as 0 would overstate the memory a job can use): run `axon4d calibrate --out FILE` on one "
            f"node of that machine (it measures or states the device-memory figures and their sources), or give "
            f'{field} with its source under "sources" (e.g. "sources": {{"{field}": "measured with ..."}})'
        )
