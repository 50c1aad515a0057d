"""What one training step sends, collective by collective, as the planner prices it (docs/planner.md,
rule 1): the calls and payload bytes per (axis, term, phase) on one rank (``step_collectives_by_phase``;
``step_collectives`` sums the phases).

A step's collectives are ``axon4d.plan.walk``'s one enumeration (``step_walk``); a step of k
micro-batches issues a pass's every pass — the passes after the first without the weight gathers
keep-for-backward carries over (``layers.carried``) — and the once-per-step ones (``Sent.once``:
the data-axis reductions, ZeRO's parameter all-gathers, the FP8 weights' scales) once. Its sum over
terms is ``TimeEstimate.bytes_by_axis`` and its calls ``TimeEstimate.collectives``
(tests/test_plan_bytes.py checks both, and this list against the communication log per (axis,
term, phase)).
"""

from __future__ import annotations

from collections import Counter

from axon4d.layout.geometry import Term
from axon4d.plan.scenario import Scenario
from axon4d.plan.walk import PhaseTally, step_walk, tally

#: (axis, term) → a count of one step's collectives or of their payload bytes on one rank
Tally = Counter[tuple[str, Term]]


def step_collectives_by_phase(sc: Scenario) -> tuple[PhaseTally, PhaseTally]:
    """(calls, payload bytes) per (axis, term, phase) of one step of ``sc`` on one rank —
    "forward", "backward" or "optimizer" (ZeRO's all-gathers): ``micro_batches`` passes of a
    micro-batch, the once-per-step collectives once (module docstring). A model with blocks of two
    kinds: its kinds' steps, each weighted by its share of the blocks (``Workload.kinds``), to the
    nearest whole call and byte."""
    kinds = sc.kinds()
    if len(kinds) > 1:
        sums: tuple[dict[tuple[str, Term, str], float], ...] = ({}, {})  # calls, bytes
        for kind, share in kinds:
            for out, part in zip(sums, step_collectives_by_phase(kind)):
                for key, n in part.items():
                    out[key] = out.get(key, 0.0) + share * n
        return Counter({k: round(v) for k, v in sums[0].items()}), Counter({k: round(v) for k, v in sums[1].items()})
    sc = kinds[0][0]  # its one kind: an MoE model whose blocks are all dense is the dense model
    micro, k = sc.micro(), sc.micro_batches
    first = step_walk(micro)
    later = step_walk(micro, reuse=True) if sc.overlap.oag_keep else first
    one, again = tally(first, micro), tally([s for s in later if not s.once], micro)
    for key in again.calls:
        one.calls[key] += (k - 1) * again.calls[key]
        one.sent[key] += (k - 1) * again.sent[key]
    return one.calls, one.sent


def step_collectives(sc: Scenario) -> tuple[Tally, Tally]:
    """(calls, payload bytes) per (axis, term) of one step of ``sc`` on one rank
    (``step_collectives_by_phase`` summed over the phases)."""
    by_phase = step_collectives_by_phase(sc)
    out: tuple[Tally, Tally] = (Counter(), Counter())
    for tally_, phased in zip(out, by_phase):
        for (axis, term, _), n in phased.items():
            tally_[(axis, term)] += n
    return out
