"""How long NCCL takes for one collective, as its tuner prices and picks the algorithm (docs/planner.md).

The model is NCCL 2.24–2.27's tuner (``src/graph/tuning.cc``: ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``) for the Simple protocol, the one large payloads run with: each algorithm
NCCL would consider for the operation and the group's placement is priced as

    t = latency + payload / bandwidth

and the cheapest is taken, as the tuner takes it. The group's placement is a ``Span``: its ranks,
the nodes they sit on and the ranks per node. Per-step latencies and per-rank bandwidths come from
the machine file's levels (``Link``: the level of one node's share of the group for the steps
inside a node, the network level for the steps between nodes).

- **ring** (every operation): all-gather and reduce-scatter take g − 1 steps, all-reduce 2(g − 1);
  of these, (nodes − 1) (all-reduce: 2(nodes − 1)) cross the network and the rest stay in a node.
  Bandwidth: the ring traffic (``ring_traffic``) at the link's per-rank bandwidth. A ring all-reduce
  across nodes pays NCCL's "plateau" factor 1.4 on its latency (sm80 and later).
- **tree** (all-reduce only): 2·((ranks per node − 1) + ⌊log2 nodes⌋) steps; bandwidth 0.92 × ½
  of the ring's bus bandwidth, less at middle sizes by NCCL's correction table.
- **PAT** (all-gather and reduce-scatter, NCCL ≥ 2.23, only where every rank is on its own node):
  8 µs + ⌊log2 nodes⌋ · α_net / 3.5 + 2.8 µs per rank, at 0.75 of the bus bandwidth — cheaper
  than a ring's g − 1 network steps for small payloads over many nodes.

Every algorithm starts with NCCL's base latency of 8.4 µs. NCCL's LL and LL128 protocols (lower
latency, less bandwidth; what NCCL picks below ~64 KiB), NVLS (NVLink SHARP) and CollNet are not
modelled: the model prices small collectives a few µs high and large intra-node all-reduces on
NVSwitch systems with NVLS somewhat slow.

An all-to-all (an MoE layer's E16) has no tuner's choice — NCCL runs it as point-to-point sends
and receives to every peer fused in one group call (``ncclGroupStart``/``ncclGroupEnd``, NCCL's
p2p design: NVIDIA/nccl pull request 316), spread over its p2p channels, several peers in flight at
once — and is priced on either device (``all_to_all_time``) where a machine has no measured curve
of it: the peers of each level in rounds of ``P2P_PEERS_IN_FLIGHT``, one latency of the level per
round, and the bytes to the other ranks at each level's per-rank bandwidth. A shift (one step of
ring context parallelism's ring, ``shift_time``) is one grouped send and receive: a latency and the
payload at the slowest hop's bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from axon4d.grid.shape import GridShape

#: the NCCL releases whose tuner constants this module reproduces
NCCL_VERSIONS = "2.24-2.27"
#: baseLat of Ring and Tree, Simple protocol (µs → s): once per collective
BASE_LATENCY_S = 8.4e-6
#: a multi-node ring all-reduce's latency is multiplied by this ("plateau effect of ring", sm80+)
RING_PLATEAU = 1.4
#: tree all-reduce bus bandwidth against the ring's (``busBw * .92``), and algorithm bandwidth ½ of it
TREE_BANDWIDTH = 0.92 * 0.5
#: NCCL's tree correction of bandwidth, Simple protocol, by ⌊log2(bytes / 64)⌋ = 0 … 22 (larger: 1)
TREE_CORRECTION = (
    0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5,
    0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9,
)  # fmt: skip
#: PAT's latency: a base, a part per log2 of the nodes (of the network latency), and a part per rank
PAT_BASE_S, PAT_LOG_DIVISOR, PAT_PER_RANK_S = 8e-6, 3.5, 2.8e-6
#: PAT's bandwidth against the ring's bus bandwidth (0.85 in NCCL 2.23, 0.75 from 2.24)
PAT_BANDWIDTH = 0.75
#: the operations priced here
OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Span:
    """Where one group's ranks sit: ``ranks`` of them on ``nodes`` nodes, ``per_node`` on each."""

    ranks: int
    nodes: int
    per_node: int


@dataclasses.dataclass(frozen=True)
class Link:
    """The latency of one algorithm step (s) and the per-rank bandwidth (bytes/s) of a level."""

    alpha_s: float
    beta_Bps: float


@dataclasses.dataclass(frozen=True)
class Priced:
    """One algorithm's price for a collective: ``steps`` latency steps, ``seconds`` in all."""

    algorithm: str  # "ring", "tree" or "pat"
    steps: int
    seconds: float


@functools.lru_cache(maxsize=4096)
def span_of(group: int, stride: int, devices_per_node: int) -> Span:
    """The span of a group of ``group`` ranks ``stride`` apart (E1) on nodes of ``devices_per_node``
    consecutive ranks, counted for the group that starts at rank 0 (cached: the search asks for
    the same few spans of a grid hundreds of thousands of times)."""
    nodes = len({i * stride // max(devices_per_node, 1) for i in range(group)})
    return Span(group, nodes, math.ceil(group / nodes))


@functools.lru_cache(maxsize=4096)
def group_geometry(shape: GridShape, axis: str, devices_per_node: int) -> tuple[int, int]:
    """(ranks, stride) of the uniformly strided group the time model prices for ``axis``: its own for
    one of the grid's axes and for a product of axes adjacent in E1 (batch, y·z, …); for another
    product (x·data: runs of G_x ranks G_x·G_y·G_z apart), the stride that puts as many of its
    ranks on one node of ``devices_per_node`` consecutive ranks as the group really has — within
    one node, the stride that spans what it spans. Counted for the group of rank 0 (cached: the
    search prices the same few axes of a grid hundreds of thousands of times)."""
    group = shape.size(axis)
    offsets = sorted(shape.group_offsets(axis))
    stride = offsets[1] - offsets[0] if group > 1 else 1
    if offsets == [i * stride for i in range(group)]:
        return group, stride
    nodes = len({o // max(devices_per_node, 1) for o in offsets})
    if nodes == 1:
        return group, max(1, offsets[-1] // (group - 1))
    return group, max(1, devices_per_node // math.ceil(group / nodes))


def ring_traffic(op: str, group: int, payload: float) -> float:
    """Bytes one rank sends (and receives) in a ring ``op`` over ``group`` ranks of ``payload``
    bytes (the whole buffer: an all-reduce's, an all-gather's output, a reduce-scatter's input):
    2(g−1)/g · payload for an all-reduce, payload for a shift (one step of a ring: ring context
    parallelism's), (g−1)/g · payload for the other two."""
    if group <= 1:
        return 0.0
    if op == "shift":  # one ring step: each rank sends its whole buffer to the next
        return payload
    share = (group - 1) / group * payload
    return 2 * share if op == "all_reduce" else share


def _tree_correction(payload: float) -> float:
    size = int(math.log2(max(payload, 64) / 64))
    return TREE_CORRECTION[size] if size < len(TREE_CORRECTION) else 1.0


def candidates(op: str, payload: float, span: Span, intra: Link, net: Link, channels: int = 1) -> list[Priced]:
    """Every algorithm NCCL's tuner would consider for ``op`` of ``payload`` bytes over ``span``,
    priced; ``intra``: the level of the steps inside a node; ``net``: the level between nodes (unused
    for a group inside one node); ``channels``: NCCL's channels (the ring plateau's size condition)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; the model prices {OPS}")
    g, nodes = span.ranks, span.nodes
    if g <= 1:
        return [Priced("ring", 0, 0.0)]
    beta = net.beta_Bps if nodes > 1 else intra.beta_Bps
    reduce = op == "all_reduce"
    steps = 2 * (g - 1) if reduce else g - 1
    across = (2 if reduce else 1) * (nodes - 1)
    latency = (steps - across) * intra.alpha_s + across * net.alpha_s
    if reduce and nodes > 1 and payload / (channels * g) >= 64:
        latency *= RING_PLATEAU
    out = [Priced("ring", steps, BASE_LATENCY_S + latency + ring_traffic(op, g, payload) / beta)]
    log_nodes = int(math.log2(nodes))
    if reduce:
        tree_steps = 2 * ((span.per_node - 1) + log_nodes)
        tree_latency = 2 * ((span.per_node - 1) * intra.alpha_s + log_nodes * net.alpha_s)
        tree_beta = beta * TREE_BANDWIDTH * _tree_correction(payload)
        out.append(Priced("tree", tree_steps, BASE_LATENCY_S + tree_latency + payload / tree_beta))
    elif nodes == g:  # PAT: one rank per node
        pat_latency = PAT_BASE_S + log_nodes * net.alpha_s / PAT_LOG_DIVISOR + g * PAT_PER_RANK_S
        out.append(Priced("pat", log_nodes, pat_latency + payload / (beta * PAT_BANDWIDTH)))
    return out


@functools.lru_cache(maxsize=65536)  # a pure function of hashable inputs, asked again and again by the search
def nccl_time(op: str, payload: float, span: Span, intra: Link, net: Link, channels: int = 1) -> Priced:
    """The algorithm NCCL's tuner picks for ``op`` (the cheapest of ``candidates``) and its price."""
    return min(candidates(op, payload, span, intra, net, channels), key=lambda p: p.seconds)


#: peers an all-to-all exchanges with at once: NCCL's p2p channels on an 8-GPU H100 node (32, as its
#: INFO log prints "32 p2p channels, 2 p2p channels per peer" — NVIDIA/nccl issue 1680; an H20
#: system's log in issue 1189 prints 8 and 2) over its channels per peer (2). An assumption for the
#: shipped GPU files, whose all-to-all no GPU has measured; `axon4d calibrate` measures the curve.
P2P_PEERS_IN_FLIGHT = 16


def all_to_all_time(payload: float, span: Span, intra: Link, net: Link) -> float:
    """An all-to-all in which each rank of ``span`` sends ``payload`` bytes, its own share included,
    split evenly over the ranks (E16), as grouped point-to-point sends (module docstring): the
    peers of each level (``intra`` inside a node, ``net`` between nodes) in rounds of
    ``P2P_PEERS_IN_FLIGHT``, each round paying its level's latency once, and the bytes to the other
    ranks at the per-rank bandwidth of each level, the slower of the node-local and the cross-node part."""
    g = span.ranks
    if g <= 1:
        return 0.0
    local_peers, remote_peers = span.per_node - 1, g - span.per_node
    rounds = functools.partial(_rounds, per=P2P_PEERS_IN_FLIGHT)
    latency = rounds(local_peers) * intra.alpha_s + rounds(remote_peers) * net.alpha_s
    local = payload * local_peers / g / intra.beta_Bps
    remote = payload * remote_peers / g / net.beta_Bps if remote_peers else 0.0
    return latency + max(local, remote)


def shift_time(payload: float, span: Span, intra: Link, net: Link) -> float:
    """One step of a ring over ``span`` (ring context parallelism's shift, ``Op.SHIFT``): every rank
    sends ``payload`` bytes to the next and receives as many from the previous, all at once, as one
    grouped send and receive — NCCL's base latency, then the slowest hop's: across the network where
    the ring spans nodes (some rank's next is on another node), inside a node otherwise."""
    if span.ranks <= 1:
        return 0.0
    link = net if span.nodes > 1 else intra
    return BASE_LATENCY_S + link.alpha_s + payload / link.beta_Bps


def _rounds(peers: int, per: int) -> int:
    """Rounds in which ``peers`` exchanges run, ``per`` at a time."""
    return -(-peers // per) if peers > 0 else 0


def host_time(op: str, group: int, payload: float, link: Link) -> float:
    """A host collective library (gloo, MPI) without a measured curve: α per step, the fewer of a
    ring's and a tree's steps, and the ring traffic at β."""
    if group <= 1:
        return 0.0
    tree = math.ceil(math.log2(group))  # latency-bound sizes: collective libraries switch to trees
    steps = min(2 * (group - 1), 2 * tree) if op == "all_reduce" else min(group - 1, tree)
    return link.alpha_s * steps + ring_traffic(op, group, payload) / link.beta_Bps
