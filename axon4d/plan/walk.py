"""One enumeration of what a step sends (issue 54's "one walk"; docs/planner.md, rule 1): every
collective one pass of a micro-batch issues on one rank, with its axis, term, phase, how many times
and where in the step it runs, and the collectives a step issues once.

``step_walk`` lists them as ``Sent`` entries, by where they come from (``SOURCES``):

- ``layer``: every linear layer kind's run (``layers.collectives``: ``geometry.linear_collectives``
  under the step's precision and ZeRO stage), a bucketed reduction counting its share of its
  buckets' calls (``buckets.layer_scales``);
- ``edge``: the collectives outside the layers (``buckets.edge_collectives``: the replicated
  parameters' gradients bucket by bucket, the norms' and the loss's sums, context parallelism's
  keys and values);
- ``moe``: every block's MoE layer (``Scenario.moe_collectives``);
- ``rerun``: what recomputation issues again (``recompute.rerun_collectives``), in the backward,
  where the block is rebuilt;
- ``step``: once per step whatever the micro-batches: ZeRO's parameter all-gathers
  (``zero_gathers``) and the FP8 weights' scales (``fp8.scale_gathers``).

Everything that counts or prices a step's collectives reads this list: the step's seconds
(``axon4d.plan.cost``: each entry priced by ``layers.priced``, the layers' own through
``layers.layer_cost`` for their overlap windows), the bytes the byte parity test compares with
the communication log (``axon4d.plan.sent``) and the host link's load under offload
(``axon4d.plan.offload_cost``, from ``pass_collectives``' ring traffic per axis and phase).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from axon4d.layout.geometry import GRADIENT_TERMS, Collective, Op, Term, data_part_numel, wire_element_size
from axon4d.plan import moe_memory
from axon4d.plan.buckets import edge_collectives as bucketed_edges
from axon4d.plan.buckets import layer_scales
from axon4d.plan.collective_model import ring_traffic
from axon4d.plan.fp8 import scale_gathers
from axon4d.plan.layers import EMBEDDING_TERMS, carried, collectives
from axon4d.plan.persistent import local_param_tensors, sixteen_bit_weights
from axon4d.plan.recompute import rerun_collectives
from axon4d.plan.scenario import Scenario

#: (axis, term, phase) → a count of a pass's (or a step's) collectives, or of their payload bytes, on one rank
PhaseTally = Counter[tuple[str, Term, str]]
#: where in a step a ``Sent`` entry comes from (module docstring)
SOURCES = ("layer", "edge", "moe", "rerun", "step")
#: the gradient reductions accumulation issues once per step however many micro-batches it runs
#: (``axon4d.overlap.accumulating``, docs/design.md §4): every gradient reduction but E11, the
#: reduce-scatter over z each micro-batch's backward issues
ONCE_PER_STEP = GRADIENT_TERMS - {Term.E11}


@dataclasses.dataclass(frozen=True)
class Sent:
    """One collective of a step on one rank, issued ``runs`` times per pass (per step where
    ``source`` is "step") in ``calls`` calls — ``runs``, or a bucketed reduction's share of its
    buckets' calls — in ``phase`` as the communication log records it (a re-run's: "backward")."""

    collective: Collective
    runs: int
    calls: float
    phase: str
    source: str  # one of ``SOURCES``
    layer: str = ""  # the linear layer kind (``LinearSpec.name``) of a "layer" entry

    @property
    def once(self) -> bool:
        """Whether the step issues it once whatever its micro-batches: the once-per-step gradient
        reductions (``ONCE_PER_STEP``), ZeRO's gathers and the FP8 scales."""
        return self.source == "step" or self.collective.term in ONCE_PER_STEP


def step_walk(sc: Scenario, reuse: bool = False, scales: dict[Term, tuple[float, float]] | None = None) -> list[Sent]:
    """Every collective of one forward + backward of ``sc`` (one micro-batch) on one rank and the
    step's once-per-step collectives (module docstring); ``reuse``: a micro-batch after the first,
    whose carried weight blocks are not gathered (``layers.carried``); ``scales``: the step's
    ``buckets.layer_scales`` where the caller has them."""
    scales = layer_scales(sc) if scales is None else scales
    out = []
    for spec in sc.linears:
        for c in collectives(spec, sc, gathers=not (reuse and carried(spec, sc))):
            share = scales[c.term][1] if c.term in scales else 1.0
            out.append(Sent(c, spec.count, spec.count * share, c.phase, "layer", spec.name))
    for c, n in Counter(bucketed_edges(sc)).items():
        if c.term not in EMBEDDING_TERMS:  # the embedding's are its layer's
            out.append(Sent(c, n, n, c.phase, "edge"))
    for c, n in Counter(sc.moe_collectives).items():  # every block's MoE layer (plan.moe_cost)
        out.append(Sent(c, n * sc.model.moe_layers, n * sc.model.moe_layers, c.phase, "moe"))
    for c, n in rerun_collectives(sc):  # what recomputation issues again, inside the backward
        out.append(Sent(c, n, n, "backward", "rerun"))
    for c in zero_gathers(sc) + scale_gathers(sc):
        out.append(Sent(c, 1, 1, c.phase, "step"))
    return out


@dataclasses.dataclass
class PassCollectives:
    """What one pass sends on one rank: calls and payload bytes per (axis, term, phase) and ring
    traffic bytes per (axis, phase) (``collective_model.ring_traffic``: what one rank sends, and
    receives, of each)."""

    calls: PhaseTally
    sent: PhaseTally
    traffic: dict[tuple[str, str], float]


def tally(walked: Sequence[Sent], sc: Scenario) -> PassCollectives:
    """``walked``'s calls and payload bytes per (axis, term, phase), and ring traffic per (axis,
    phase), on ``sc``'s grid; a bucketed reduction's calls are its buckets' (rounded per key)."""
    out = PassCollectives(Counter(), Counter(), {})
    calls: dict[tuple[str, Term, str], float] = {}
    for s in walked:
        c = s.collective
        key = (c.axis, c.term, s.phase)
        calls[key] = calls.get(key, 0.0) + s.calls
        out.sent[key] += s.runs * c.payload_bytes
        moved = s.runs * ring_traffic(c.op.value, sc.shape.size(c.axis), c.payload_bytes)
        out.traffic[(c.axis, s.phase)] = out.traffic.get((c.axis, s.phase), 0.0) + moved
    for key, n in calls.items():
        out.calls[key] = round(n)
    return out


def pass_collectives(sc: Scenario, walked: Sequence[Sent] | None = None) -> PassCollectives:
    """The tally (``tally``) of one forward + backward of ``sc`` (one micro-batch) on one rank: the
    walk's entries but the once-per-step "step" ones; ``walked``: ``step_walk(sc)`` where the
    caller has it."""
    entries = step_walk(sc) if walked is None else walked
    return tally([s for s in entries if s.source != "step"], sc)


def zero_gathers(sc: Scenario) -> list[Collective]:
    """ZeRO's all-gathers over data of the updated parameters, once per step, one per bucket as
    ``axon4d.zero`` issues them: parameters in order, a bucket closed once it holds the policy's
    ``bucket_bytes`` on the machine's device (0: one parameter each); each moves every rank's part of ⌈n/G_data⌉ elements of
    each of its parameters, in the parameters' dtype as stored (``stored``), one dtype per bucket.
    None without ZeRO or with G_data = 1."""
    if not sc.zero or sc.shape.data == 1:
        return []
    d = sc.shape.data
    limit = sc.overlap.bucket_bytes(sc.machine.accelerator)  # the runtime's: the device's where unset
    out = []
    for tensors, elem in stored(sc):
        buckets: list[int] = []  # elements gathered per bucket
        held = 0.0
        for n in tensors:
            if not buckets or held >= limit:
                buckets.append(0)
                held = 0.0
            buckets[-1] += data_part_numel(n, d) * d
            held += n * elem
        out += [Collective(Op.ALL_GATHER, "data", n * elem, "optimizer", Term.ZERO_GATHER) for n in buckets]
    return out


def stored(sc: Scenario) -> list[tuple[list[int], int]]:
    """The rank's parameter tensors (elements of each) by the bytes per element they are stored in,
    which ZeRO's all-gather moves (``geometry.wire_dtype`` of ``Term.ZERO_GATHER``): the 3D Linear
    weights ZeRO keeps in 16 bits (``persistent.sixteen_bit_weights``: mixed precision, G_data > 1) in
    the compute dtype, the others as the parameters are (fp32 master weights)."""
    wl, shape, precision = sc.workload, sc.shape, sc.precision
    # ZeRO gathers an expert weight only where the layout replicates it over data (``axon4d.zero``)
    tensors = local_param_tensors(wl, shape, experts=not moe_memory.experts_whole_under_zero(wl.expert_layout))
    sixteen = sixteen_bit_weights(wl, shape, sc.zero)

    def size(linear_weight: bool) -> int:
        return wire_element_size(
            precision, Term.ZERO_GATHER, precision.param, g_data=shape.data, linear_weight=linear_weight
        )

    if not sixteen:
        return [(tensors, size(False))]
    rest = list(tensors)
    for n in sixteen:
        rest.remove(n)
    return [(sixteen, size(True)), (rest, size(False))]
