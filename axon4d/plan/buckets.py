"""The gradient reductions the runtime issues in buckets, priced as it issues them (docs/design.md §4, ODP).

With a bucket size (``OverlapPolicy.bucket_bytes``: 25 MB on accelerators by default, 0 on the host)
the scheduler (``axon4d.scheduler``) puts each gradient reduction over the data or batch axis into
the open bucket of its (axis, kind) and launches the bucket once it holds that many bytes; what is
left goes at the end of backward. Each bucket is one collective: the latency of one call for the
bytes of several. Bucketed, as the runtime does:

- E12, the weight shards' reduction over data (all-reduce, or ZeRO-2's reduce-scatter), when ORS
  or ODP is on — in backward order: the head, then the blocks from the last, each block's layers
  from the last;
- E13, the biases' all-reduce over batch, under ODP;
- the replicated parameters' gradients over batch (norm weights and biases, the position and
  token embeddings, MoE routers' weights: ``Term.NORM_GRAD`` and its kin), always.

The layers' E12 and E13 stay priced per layer kind, so that the overlap schedule can hide them
under the backward of later layers (``overlap_credit``): each is scaled by its term's ratio of
bucketed to unbucketed seconds and calls (``layer_scales``), which makes their sums over the step
the buckets' exactly. The replicated gradients are priced bucket by bucket (``edge_collectives``).
"""

from __future__ import annotations

from collections.abc import Iterator

from axon4d.layout.geometry import GRADIENT_TERMS, Collective, Term
from axon4d.plan.layers import collectives, in_block, priced
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import LinearSpec

#: the layers' reductions that are bucketed, each with the policy switches under which it is
LAYER_TERMS = {Term.E12: ("ors", "odp"), Term.E13: ("odp",)}
#: the replicated parameters' gradient reductions over batch: always bucketed, one bucket per kind
REPLICATED_TERMS = GRADIENT_TERMS - {Term.E11, Term.E12, Term.E13}


def limit(sc: Scenario) -> int:
    """The bucket size in bytes the runtime uses for ``sc`` (its policy on its machine's device)."""
    return sc.overlap.bucket_bytes(sc.machine.accelerator)


def group(payloads: list[int], size: int) -> list[int]:
    """The payload bytes of each bucket the scheduler makes of ``payloads`` arriving in order: a
    bucket takes payloads until it holds ``size`` bytes (0: each payload alone)."""
    out: list[int] = []
    held = 0
    for p in payloads:
        held += p
        if held >= size:
            out.append(held)
            held = 0
    if held:
        out.append(held)
    return out


def _backward_order(sc: Scenario) -> Iterator[LinearSpec]:
    """Each run of every linear layer kind in the order backward reaches them (the embedding's
    gradient is a replicated one: not here)."""
    specs = [s for s in sc.linears if not s.embedding]
    block = [s for s in specs if in_block(s, sc)]
    for s in reversed([s for s in specs if not in_block(s, sc) and s.name == "head"]):
        yield from [s] * s.count
    for _ in range(sc.model.n_layers if block else 0):
        yield from reversed(block)
    for s in reversed([s for s in specs if not in_block(s, sc) and s.name != "head"]):
        yield from [s] * s.count


def layer_scales(sc: Scenario) -> dict[Term, tuple[float, float]]:
    """term → (seconds, calls) of the step's buckets of that layer reduction over its unbucketed
    ones: the factors a layer's E12 and E13 are priced by (1.0 where nothing is bucketed)."""
    size = limit(sc)
    out: dict[Term, tuple[float, float]] = {}
    if size <= 0:
        return out
    switches = {name for name in ("ors", "odp") if getattr(sc.overlap, name)}
    per_spec: dict[str, dict[Term, Collective]] = {}
    for spec in sc.linears:
        if not spec.embedding:
            per_spec[spec.name] = {c.term: c for c in collectives(spec, sc) if c.term in LAYER_TERMS}
    prices: dict[tuple[Collective, int], float] = {}

    def price(c: Collective, payload: int) -> float:
        key = (c, payload)
        if key not in prices:
            prices[key] = priced(Collective(c.op, c.axis, payload, c.phase, c.term), sc)[0]
        return prices[key]

    for term, needs in LAYER_TERMS.items():
        if not switches & set(needs):
            continue
        runs = [per_spec[s.name][term] for s in _backward_order(sc) if term in per_spec.get(s.name, {})]
        if not runs:
            continue
        alone = sum(price(c, c.payload_bytes) for c in runs)
        buckets = group([c.payload_bytes for c in runs], size)
        together = sum(price(runs[0], b) for b in buckets)
        out[term] = (together / alone if alone > 0 else 1.0, len(buckets) / len(runs))
    return out


def edge_collectives(sc: Scenario) -> list[Collective]:
    """The step's collectives outside the linear layers (``Scenario.edge_collectives``) with the
    replicated parameters' gradient reductions as the scheduler issues them: one collective per
    bucket of each kind (as they are when the bucket size is 0)."""
    size = limit(sc)
    edges = list(sc.edge_collectives)
    if size <= 0:
        return edges
    out = [c for c in edges if c.term not in REPLICATED_TERMS]
    kinds: dict[tuple[str, Term], list[Collective]] = {}
    for c in edges:
        if c.term in REPLICATED_TERMS:
            kinds.setdefault((c.axis, c.term), []).append(c)
    for runs in kinds.values():
        first = runs[0]
        out += [
            Collective(first.op, first.axis, b, first.phase, first.term)
            for b in group([c.payload_bytes for c in runs], size)
        ]
    return out
