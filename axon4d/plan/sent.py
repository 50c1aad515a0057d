"""What one training step sends, collective by collective, as the planner prices it (docs/planner.md,
rule 1): the calls and payload bytes per (axis, term, phase) on one rank (``step_collectives_by_phase``;
``step_collectives`` sums the phases).

The list is assembled from the same pieces ``axon4d.plan.cost`` prices a step from — every layer
kind's collectives (``layers.collectives``: ``geometry.linear_collectives`` under the step's
precision and ZeRO stage), the collectives outside the layers (``Workload.edge_collectives``:
the embedding lookup, the replicated parameters' gradients, context parallelism's keys and
values), every MoE layer's (``Scenario.moe_collectives``) and ZeRO's parameter all-gathers (``cost.zero_gathers``) — and counted as a step of k
micro-batches issues them: every pass the layers' and context parallelism's collectives, the
passes after the first without the weight gathers keep-for-backward carries over
(``layers.carried``), the data-axis reductions (``cost.ONCE_PER_STEP``) and ZeRO's gathers once.
A bucketed reduction (``axon4d.plan.buckets``) counts the calls of its buckets. Its sum over terms
is ``TimeEstimate.bytes_by_axis`` and its calls ``TimeEstimate.collectives``
(tests/test_plan_bytes.py checks both, and this list against the communication log), the forward
collectives a recomputed block issues again (``recompute.rerun_collectives``) included.
"""

from __future__ import annotations

from collections import Counter

from axon4d.layout.geometry import Collective, Term
from axon4d.plan.buckets import edge_collectives as bucketed_edges
from axon4d.plan.buckets import layer_scales
from axon4d.plan.cost import ONCE_PER_STEP, zero_gathers
from axon4d.plan.fp8 import scale_gathers
from axon4d.plan.layers import EMBEDDING_TERMS, carried, collectives
from axon4d.plan.recompute import rerun_collectives
from axon4d.plan.scenario import Scenario

#: (axis, term) → a count of one step's collectives or of their payload bytes on one rank
Tally = Counter[tuple[str, Term]]
#: (axis, term, phase) → the same, by the part of the step each is issued in
PhaseTally = Counter[tuple[str, Term, str]]


def _pass(sc: Scenario, reuse: bool) -> tuple[PhaseTally, PhaseTally]:
    """(calls, payload bytes) per (axis, term, phase) of one forward + backward of ``sc`` (one
    micro-batch); ``reuse``: a micro-batch after the first, whose carried weight blocks are not
    gathered. What recomputation issues again runs in the backward."""
    calls: PhaseTally = Counter()
    sent: PhaseTally = Counter()

    def add(c: Collective, n: int = 1, phase: str = "") -> None:
        key = (c.axis, c.term, phase or c.phase)
        calls[key] += n
        sent[key] += n * c.payload_bytes

    scales = layer_scales(sc)
    shares: dict[tuple[str, Term, str], float] = {}  # bucketed: each run's share of its bucket's call
    for spec in sc.linears:
        for c in collectives(spec, sc, gathers=not (reuse and carried(spec, sc))):
            add(c, spec.count)
            if c.term in scales:
                key = (c.axis, c.term, c.phase)
                shares[key] = shares.get(key, 0.0) + spec.count * scales[c.term][1]
    for key, share in shares.items():  # the step's calls of a bucketed term: its buckets
        calls[key] = round(share)
    for c in bucketed_edges(sc):
        if c.term not in EMBEDDING_TERMS:  # the embedding's are its layer's
            add(c)
    for c in sc.moe_collectives:  # every block's MoE layer (plan.moe_cost)
        add(c, sc.model.n_layers)
    for c, n in rerun_collectives(sc):  # what recomputation issues again, inside the backward
        add(c, n, "backward")
    return calls, sent


def step_collectives_by_phase(sc: Scenario) -> tuple[PhaseTally, PhaseTally]:
    """(calls, payload bytes) per (axis, term, phase) of one step of ``sc`` on one rank —
    "forward", "backward" or "optimizer" (ZeRO's all-gathers): ``micro_batches`` passes of a
    micro-batch, the data-axis reductions, ZeRO's all-gathers and the FP8 weights' scales once
    (module docstring)."""
    micro, k = sc.micro(), sc.micro_batches
    calls, sent = _pass(micro, reuse=False)
    later_calls, later_sent = _pass(micro, reuse=True) if sc.overlap.oag_keep else (calls, sent)
    for key in later_calls:
        if key[1] not in ONCE_PER_STEP:
            calls[key] += (k - 1) * later_calls[key]
            sent[key] += (k - 1) * later_sent[key]
    for c in zero_gathers(sc) + scale_gathers(sc):  # once per step: ZeRO's gathers, the FP8 weights' scales
        calls[(c.axis, c.term, c.phase)] += 1
        sent[(c.axis, c.term, c.phase)] += c.payload_bytes
    return calls, sent


def step_collectives(sc: Scenario) -> tuple[Tally, Tally]:
    """(calls, payload bytes) per (axis, term) of one step of ``sc`` on one rank
    (``step_collectives_by_phase`` summed over the phases)."""
    by_phase = step_collectives_by_phase(sc)
    out: tuple[Tally, Tally] = (Counter(), Counter())
    for tally, phased in zip(out, by_phase):
        for (axis, term, _), n in phased.items():
            tally[(axis, term)] += n
    return out
