"""What a plan pins in host memory, per rank and per node (docs/design.md §5, §6).

A node's host memory is shared by its ranks (``Machine.devices_per_node`` of them, or the whole
world when it is smaller), the operating system and the job's own processes. What a plan pins
there, per rank, in the bytes the runtime's allocations really take (``axon4d.device.pinned``:
buffers carved from one allocation at ``ALIGN``-aligned offsets, ``carve``, which holds
``pinned_footprint`` of its bytes — whole pages when page-locked):

- activation offload (``axon4d.memory.offload``, ``axon4d.memory.host_pool``): every storage the first
  ``offload`` blocks save for backward (``axon4d.plan.saved.block_storages``) except those under
  ``axon4d.memory.offload.MIN_BYTES``, which stay on the device — all held at the end of the forward, in
  the one allocation the pool keeps from the second step on;
- the asynchronous checkpoint's snapshot (``--async-save``, ``Workload.async_save``): a host copy
  of each stored tensor of the model and its optimizer state (``snapshot_tensors``) in one
  allocation, kept from one save to the next.

The plan fits the node when the node's ranks together pin no more than its host memory less its
reserve (``candidate.fits``). On a host without accelerators nothing is page-locked: offload's
copies are plain host tensors that take the bytes they hold, and host memory is the device's own.
"""

from __future__ import annotations

import functools
import math

from axon4d.device.pinned import carve, pinned_footprint
from axon4d.grid.shape import GridShape
from axon4d.memory.offload import MIN_BYTES
from axon4d.plan.persistent import local_param_tensors, sixteen_bit_weights
from axon4d.plan.saved import block_storages
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import OPTIMIZERS, Workload


def offload_pinned(sc: Scenario) -> float:
    """Host bytes one rank's offload pool takes: the footprint of one allocation carved into
    ``offload`` blocks' storages at or above ``MIN_BYTES``."""
    if not sc.offload:
        return 0.0
    return float(
        pinned_footprint(sc.offload * _carved_block(sc.workload, sc.shape, sc.recompute), sc.machine.accelerator)
    )


@functools.lru_cache(maxsize=4096)
def _carved_block(wl: Workload, shape: GridShape, recompute: str) -> int:
    """Bytes of one block's offloaded storages (those at or above ``MIN_BYTES``) carved into one
    allocation (cached: a search asks it of each (workload, grid, mode) for every option)."""
    return carve([math.ceil(s) for s in block_storages(wl, shape, recompute) if s >= MIN_BYTES])[1]


def snapshot_tensors(sc: Scenario) -> list[int]:
    """Bytes of each tensor the asynchronous checkpoint copies to the host on one rank
    (``axon4d.checkpoint``: the model's parameters as saved — the fp32 masters, of which a ZeRO
    optimizer that stores the Linear weights in 16 bits keeps this data rank's part — and each
    parameter's optimizer moments, fp32, the whole tensor's or under ZeRO this rank's part). An
    upper bound: a piece several ranks hold alike is copied by the one of them that writes it
    (``axon4d.checkpoint.pieces``), which of them decided by its name, so the ranks' shares differ
    and each is priced as holding every piece it has."""
    wl, shape = sc.workload, sc.shape
    tensors = local_param_tensors(wl, shape)
    sixteen = list(sixteen_bit_weights(wl, shape, sc.zero))
    moments = OPTIMIZERS[wl.optimizer] // 4  # fp32 states per parameter element
    out: list[int] = []
    for n in tensors:
        part = math.ceil(n / shape.data) if sc.zero else n  # what this rank's optimizer holds of it
        if n in sixteen:
            sixteen.remove(n)
            out.append(part * 4)  # the master part, not the 16-bit weight
        else:
            out.append(n * 4)
        out += [part * 4] * moments + [4]  # the moments, the step count
    return out


def snapshot_pinned(sc: Scenario) -> float:
    """Host bytes one rank's asynchronous-checkpoint snapshot takes (``Workload.async_save``; 0
    without it): the footprint of one allocation carved into the ``snapshot_tensors``."""
    if not sc.workload.async_save:
        return 0.0
    return float(pinned_footprint(carve(snapshot_tensors(sc))[1], sc.machine.accelerator))


def ranks_per_node(sc: Scenario) -> int:
    """Ranks of the job on one node: the machine's devices per node, or the whole world if smaller."""
    return min(sc.world, sc.machine.devices_per_node)


def pinned_per_rank(sc: Scenario) -> float:
    """Host bytes one rank of ``sc`` pins: its offload buffers and its checkpoint snapshot."""
    return offload_pinned(sc) + snapshot_pinned(sc)


def pinned_per_node(sc: Scenario) -> float:
    """Host bytes the ranks of one node pin together (every rank of a plan pins alike)."""
    return ranks_per_node(sc) * pinned_per_rank(sc)
