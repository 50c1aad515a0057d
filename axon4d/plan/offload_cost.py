"""Seconds activation offload adds to a pass, with the host link shared phase by phase (docs/design.md §5, §6).

Offload (``axon4d.memory.offload``) copies the first n blocks' saved activations to host memory during the
forward and back ahead of their backward, on one side stream (``copy_queue``). On an accelerator
those copies cross the device's one host link (PCIe) — and so does every byte the device's
collectives send to or receive from other nodes: with GPUDirect RDMA the network card reads and
writes device memory across the same link. The link runs both ways at once at
``Machine.host_link_Bps`` each; in each direction the forward moves the copies out and its
collectives' network traffic, the backward the copies back in and its own collectives' traffic
(``link_traffic``: the layers', the edge collectives', the MoE layers' and what recomputation
issues again, each in the phase it runs in).

The copies of each phase are priced at the share of the link that phase's network leaves them:
with N bytes of network traffic per direction spread over the phase's T seconds of compute, a
copy runs at β_link·(1 − N/(β_link·T)) (the share capped at ``MAX_NETWORK_SHARE``) — the backward,
which carries most of a step's network traffic (the weight gradients' reductions), leaves its
fetches less of the link than the step's average would. No phase can be shorter than all its link
bytes at the full link rate: the exposed time is at least Σ over the phases of
(N + copies)/β_link − max(T, N/β_link). On a host without accelerators the copies are memory
copies on the compute cores: nothing is hidden and no network shares a link
(``Machine.host_copy_time``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from axon4d.plan.collective_model import group_geometry
from axon4d.plan.layers import LayerCost, in_block
from axon4d.plan.saved import block_bytes
from axon4d.plan.scenario import Scenario
from axon4d.plan.walk import Sent, pass_collectives

#: the most of the host link the network may be taken to use while copies run beside it: beyond it
#: the link-bound floor of ``offload_seconds`` prices the pass
MAX_NETWORK_SHARE = 0.95


def network_share(sc: Scenario, axis: str) -> float:
    """The share of a rank's ring traffic on ``axis`` that leaves its node (and so crosses its host
    link): 0 for a group inside one node; else 1/p for a group of p ranks per node — a ring over
    the group crosses each node boundary once, and the node's ranks carry those crossings between
    them (NCCL spreads its channels over the node's network cards)."""
    shape, per_node = sc.shape, sc.machine.devices_per_node
    group, stride = group_geometry(shape, axis, per_node)
    if group <= 1 or (group - 1) * stride + 1 <= per_node:
        return 0.0
    on_node = max(1, min(group, math.ceil(per_node / stride)))
    return 1.0 / on_node


def link_traffic(sc: Scenario, walked: Sequence[Sent] | None = None) -> dict[str, float]:
    """Bytes one pass's collectives move across a rank's host link in each direction (sent and
    received alike), by phase ("forward", "backward"): the ring traffic on each axis of the pass's
    collectives as ``axon4d.plan.walk`` enumerates them (the layers', the edge collectives', every
    MoE layer's and what recomputation issues again, in the backward), times the axis'
    ``network_share``; ``walked``: the pass's ``walk.step_walk`` where the caller has it. 0 on a host."""
    out = {"forward": 0.0, "backward": 0.0}
    if not sc.machine.accelerator:
        return out
    for (axis, phase), traffic in pass_collectives(sc, walked).traffic.items():
        out[phase] += traffic * network_share(sc, axis)
    return out


def offload_seconds(sc: Scenario, layers: list[LayerCost], walked: Sequence[Sent] | None = None) -> float:
    """Seconds activation offload adds to one pass (docs/design.md §5): what the copies of the first
    ``offload`` blocks' saved activations leave exposed (``copy_queue``), the forward's copies out at
    the share of the host link the forward's network traffic leaves them and the backward's copies
    in at the backward's, and at least what each phase's whole link load in one direction takes
    beyond the phase (module docstring). The copies run on the accelerator's copy engines, not its
    cores, so no overlap efficiency applies. On a host the copies are memory copies on the compute
    cores: nothing is hidden. ``walked``: the pass's ``walk.step_walk`` where the caller has it."""
    if not sc.offload:
        return 0.0
    moved, fwd, bwd, between = offload_windows(sc, layers)
    m = sc.machine
    if not m.accelerator:
        return 2 * sc.offload * m.host_copy_time(moved, sc.world)
    alone = m.host_copy_time(moved, sc.world)  # the link to itself (refused without host_link_Bps)
    n, link = sc.model.n_layers, m.host_link_Bps
    head_fwd, head_bwd = _between_phases(sc, layers)
    compute = {"forward": n * fwd + head_fwd, "backward": n * bwd + head_bwd}
    network = link_traffic(sc, walked)
    copy = {}
    floor = 0.0
    for phase, t in compute.items():
        share = min(network[phase] / (link * t), MAX_NETWORK_SHARE) if t > 0 else MAX_NETWORK_SHARE
        copy[phase] = alone / (1.0 - share)
        floor += max((network[phase] + sc.offload * moved) / link - max(t, network[phase] / link), 0.0)
    exposed = copy_queue(copy["forward"], sc.offload, n, fwd, bwd, between, copy_in=copy["backward"])
    return max(exposed, floor, 0.0)


def _between_phases(sc: Scenario, layers: list[LayerCost]) -> tuple[float, float]:
    """(forward, backward) seconds of the layers outside the blocks (the head's), as the phases split them."""
    outside = [lc for lc in layers if not in_block(lc.spec, sc) and not lc.spec.embedding]
    fwd = sum(lc.spec.count * lc.fwd_s for lc in outside)
    return fwd, sum(lc.spec.count * lc.compute_s for lc in outside) - fwd


def offload_windows(sc: Scenario, layers: list[LayerCost]) -> tuple[float, float, float, float]:
    """(bytes one offloaded block's saved activations move each way, one block's forward seconds,
    its backward seconds — with its forward again under full recomputation —, the seconds of the
    layers outside the blocks): what ``copy_queue`` schedules the copies against."""
    moved = block_bytes(sc.workload, sc.shape, sc.recompute)
    block = [lc for lc in layers if in_block(lc.spec, sc)]
    fwd = sum(lc.fwd_s for lc in block)
    bwd = sum(lc.compute_s - lc.fwd_s for lc in block) + (fwd if sc.recompute == "full" else 0.0)
    between = sum(lc.compute_s for lc in layers if not in_block(lc.spec, sc) and not lc.spec.embedding)
    return moved, fwd, bwd, between


def copy_queue(
    copy: float, offloaded: int, n_layers: int, fwd: float, bwd: float, between: float, copy_in: float | None = None
) -> float:
    """Seconds the offload copies expose in one pass, as the runtime issues them (axon4d.memory.offload):
    one side stream runs every copy in order. Block i < ``offloaded`` sends its activations out from
    the start of its forward (each is copied as it is saved), the copy ending no sooner than that
    forward; the forward does not wait for them. In the backward, when block j's output gradient
    arrives, block j−1's activations are fetched (one block ahead; the last block fetches its own),
    and block j's backward waits for its fetch. ``copy``: seconds of one block's copy out (and back
    in, unless ``copy_in`` gives the backward's); ``fwd``/``bwd``: one block's forward/backward;
    ``between``: the head's forward and backward."""
    back = copy if copy_in is None else copy_in
    t = free = 0.0  # compute stream's time; when the side stream is next free
    for i in range(n_layers):
        if i < offloaded:
            free = max(max(free, t) + copy, t + fwd)
        t += fwd
    t += between
    ready: dict[int, float] = {}
    for j in reversed(range(n_layers)):
        for i in (j, j - 1):  # block j (if nobody fetched it) and, one ahead, block j − 1
            if 0 <= i < offloaded and i not in ready:
                free = max(free, t) + back
                ready[i] = free
        t = max(t, ready.get(j, 0.0)) + bwd
    return max(0.0, t - n_layers * (fwd + bwd) - between)  # no negative rounding residue
