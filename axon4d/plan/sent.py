"""What one training step sends, collective by collective, as the planner prices it (docs/planner.md,
rule 1): the calls and payload bytes per (axis, term, phase) on one rank (``step_collectives_by_phase``;
``step_collectives`` sums the phases).

A pass's collectives are ``axon4d.plan.walk``'s one enumeration (``pass_collectives``); a step of k
micro-batches issues them every pass — the passes after the first without the weight gathers
keep-for-backward carries over (``layers.carried``) — and the data-axis reductions
(``cost.ONCE_PER_STEP``), ZeRO's parameter all-gathers (``cost.zero_gathers``) and the FP8 weights'
scales (``fp8.scale_gathers``) once. Its sum over terms is ``TimeEstimate.bytes_by_axis`` and its
calls ``TimeEstimate.collectives`` (tests/test_plan_bytes.py checks both, and this list against the
communication log per (axis, term, phase)).
"""

from __future__ import annotations

from collections import Counter

from axon4d.layout.geometry import Term
from axon4d.plan.cost import ONCE_PER_STEP, zero_gathers
from axon4d.plan.fp8 import scale_gathers
from axon4d.plan.scenario import Scenario
from axon4d.plan.walk import PhaseTally, pass_collectives

#: (axis, term) → a count of one step's collectives or of their payload bytes on one rank
Tally = Counter[tuple[str, Term]]


def step_collectives_by_phase(sc: Scenario) -> tuple[PhaseTally, PhaseTally]:
    """(calls, payload bytes) per (axis, term, phase) of one step of ``sc`` on one rank —
    "forward", "backward" or "optimizer" (ZeRO's all-gathers): ``micro_batches`` passes of a
    micro-batch, the data-axis reductions, ZeRO's all-gathers and the FP8 weights' scales once
    (module docstring)."""
    micro, k = sc.micro(), sc.micro_batches
    first = pass_collectives(micro)
    calls, sent = first.calls, first.sent
    later = pass_collectives(micro, reuse=True) if sc.overlap.oag_keep else first
    later_calls, later_sent = later.calls, later.sent
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
