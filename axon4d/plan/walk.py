"""One enumeration of what a pass of a step sends (issue 54's "one walk"; docs/planner.md, rule 1):
every collective of one forward + backward of a micro-batch on one rank with its axis, term,
phase and count — every layer kind's (``layers.collectives``: ``geometry.linear_collectives`` under
the step's precision and ZeRO stage), the collectives outside the layers (``buckets.edge_collectives``:
the embedding lookup, the replicated parameters' gradients bucket by bucket, context parallelism's
keys and values), every MoE layer's (``Scenario.moe_collectives``) and what recomputation issues
again (``recompute.rerun_collectives``, in the backward, where the block is rebuilt).

``pass_collectives`` tallies them: calls and payload bytes per (axis, term, phase) — what
``axon4d.plan.sent`` counts a step's of and the byte parity test compares with the communication
log — and the ring traffic per (axis, phase), which ``axon4d.plan.offload_cost`` takes the host
link's load from.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from axon4d.layout.geometry import Collective, Term
from axon4d.plan.buckets import edge_collectives as bucketed_edges
from axon4d.plan.buckets import layer_scales
from axon4d.plan.collective_model import ring_traffic
from axon4d.plan.layers import EMBEDDING_TERMS, carried, collectives
from axon4d.plan.recompute import rerun_collectives
from axon4d.plan.scenario import Scenario

#: (axis, term, phase) → a count of a pass's (or a step's) collectives, or of their payload bytes, on one rank
PhaseTally = Counter[tuple[str, Term, str]]


@dataclasses.dataclass
class PassCollectives:
    """What one pass sends on one rank: calls and payload bytes per (axis, term, phase) and ring
    traffic bytes per (axis, phase) (``collective_model.ring_traffic``: what one rank sends, and
    receives, of each)."""

    calls: PhaseTally
    sent: PhaseTally
    traffic: dict[tuple[str, str], float]


def pass_collectives(sc: Scenario, reuse: bool = False) -> PassCollectives:
    """Every collective of one forward + backward of ``sc`` (one micro-batch) on one rank (module
    docstring); ``reuse``: a micro-batch after the first, whose carried weight blocks are not
    gathered. A bucketed reduction counts the calls of its buckets."""
    out = PassCollectives(Counter(), Counter(), {})

    def add(c: Collective, n: int = 1, phase: str = "") -> None:
        key = (c.axis, c.term, phase or c.phase)
        out.calls[key] += n
        out.sent[key] += n * c.payload_bytes
        moved = n * ring_traffic(c.op.value, sc.shape.size(c.axis), c.payload_bytes)
        out.traffic[(c.axis, key[2])] = out.traffic.get((c.axis, key[2]), 0.0) + moved

    scales = layer_scales(sc)
    shares: dict[tuple[str, Term, str], float] = {}  # bucketed: each run's share of its bucket's call
    for spec in sc.linears:
        for c in collectives(spec, sc, gathers=not (reuse and carried(spec, sc))):
            add(c, spec.count)
            if c.term in scales:
                key = (c.axis, c.term, c.phase)
                shares[key] = shares.get(key, 0.0) + spec.count * scales[c.term][1]
    for key, share in shares.items():  # the step's calls of a bucketed term: its buckets
        out.calls[key] = round(share)
    for c in bucketed_edges(sc):
        if c.term not in EMBEDDING_TERMS:  # the embedding's are its layer's
            add(c)
    for c in sc.moe_collectives:  # every block's MoE layer (plan.moe_cost)
        add(c, sc.model.n_layers)
    for c, n in rerun_collectives(sc):  # what recomputation issues again, inside the backward
        add(c, n, "backward")
    return out
