"""What activation recomputation adds to the time of a step (docs/design.md §5, §6): every mode,
priced here and only here (``rerun``); ``axon4d.plan.cost`` adds it to the step it assembles.

- ``none``: nothing.
- ``selective``: core attention's forward runs again in each block's backward (its
  ``ATTENTION_FORWARD`` share of attention's forward + backward).
- ``balanced``: the MLP activation and the two norms' normalisation run again, each twice — once
  when the consuming GEMM's backward re-makes its input, once in the op's own backward — and the
  norms take the elementwise chain (statistics kept, normalisation re-run) where they would
  otherwise be a fused kernel: torch's (G_x = 1) or the fused split norm (G_x > 1); the difference
  in passes is ``layers.norm_passes``'.
- ``full``: every block's whole forward runs again in backward — the compute of its layers'
  forwards and their forward collectives (E8, E10f), issued again: counted, with their ring
  traffic and the interference it costs.

What each mode keeps for backward is the memory model's (``axon4d.plan.saved.block_saved``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from axon4d.geometry import Term
from axon4d.plan.layers import ATTENTION_FORWARD, LayerCost, attention_seconds, norm_passes
from axon4d.plan.scenario import Scenario


@dataclasses.dataclass(frozen=True)
class Rerun:
    """Seconds and collectives one step adds by recomputation on one rank (unscaled, as
    ``TimeEstimate``'s parts)."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    activation_comm_s: float = 0.0  # of which activation collectives (E8)
    collectives: int = 0
    traffic_bytes: float = 0.0
    interference_s: float = 0.0  # compute lost to that traffic (Machine.interference_time)


def recomputed_seconds(sc: Scenario) -> float:
    """Forward work one block runs again in backward under ``selective`` or ``balanced``
    recomputation (0 for the other modes: ``full`` is priced from the layers, ``rerun``)."""
    wl, shape, m, mod = sc.workload, sc.shape, sc.machine, sc.model
    world, elem, b = sc.world, sc.element_size, sc.tokens
    if sc.recompute == "selective":
        if not wl.attention:
            return 0.0
        return ATTENTION_FORWARD * sum(attention_seconds(sc))
    if sc.recompute == "balanced":
        act = m.activation_time(b * mod.ffn // shape.y * (2 if mod.gated else 1), world)[0]
        h_x = mod.hidden // shape.x
        normalize = m.elementwise_time(3 * b * h_x * elem, world) if wl.norms else 0.0
        # the step prices each norm by ``norm_passes`` without recomputation; balanced takes the chain
        chain = sum(norm_passes(wl, shape, "balanced")) - sum(norm_passes(wl, shape))
        unfused = m.elementwise_time(chain * b * h_x * elem, world) if wl.norms else 0.0
        return 2 * (act + 2 * normalize) + 2 * unfused
    return 0.0


def rerun(sc: Scenario, layers: Sequence[LayerCost]) -> Rerun:
    """What ``sc.recompute`` adds to a step whose layer kinds cost ``layers`` (``layer_cost``)."""
    if sc.recompute == "full":
        return _full(sc, layers)
    if sc.recompute in ("selective", "balanced"):
        return Rerun(compute_s=sc.model.n_layers * recomputed_seconds(sc))
    return Rerun()


def _full(sc: Scenario, layers: Sequence[LayerCost]) -> Rerun:
    """Full recomputation: the forward of every layer kind run n_layers times (the block's; with
    one block, the embedding's and the head's too), with its forward all-reduces (E8) and Z
    all-gathers (E10f)."""
    block = [lc for lc in layers if lc.spec.count == sc.model.n_layers]
    traffic = sum(lc.spec.count * lc.fwd_traffic for lc in block)
    return Rerun(
        compute_s=sum(lc.spec.count * lc.fwd_s for lc in block),
        comm_s=sum(lc.spec.count * lc.fwd_comm_s for lc in block),
        activation_comm_s=sum(lc.spec.count * lc.comm.get(Term.E8, 0.0) for lc in block),
        collectives=sum(lc.spec.count * lc.fwd_calls for lc in block),
        traffic_bytes=traffic,
        interference_s=sc.machine.interference_time(traffic, sc.world),
    )
