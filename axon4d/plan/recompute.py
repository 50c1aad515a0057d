"""What activation recomputation adds to the time of a step (docs/design.md §5, §6): every mode,
priced here and only here (``rerun``); ``axon4d.plan.cost`` adds it to the step it assembles.

- ``none``: nothing.
- ``selective``: core attention's forward runs again in each block's backward (its
  ``ATTENTION_FORWARD`` share of attention's forward + backward).
- ``balanced``: the MLP activation and the two norms' normalisation run again, each twice — once
  when the consuming GEMM's backward re-makes its input, once in the op's own backward — and the
  norms take the elementwise chain (statistics kept, normalisation re-run) where they would
  otherwise be a fused kernel: torch's (G_x = 1) or the fused split norm (G_x > 1); the difference
  in passes is ``block_extras.norm_passes``'.
- ``full``: every block's whole forward runs again in backward — the compute of its layers'
  forwards and every collective of the block's forward issued again (``rerun_collectives``: the
  layers' E8 and E10f, the norms' sums over x, context parallelism's key/value all-gather, an MoE
  layer's forward collectives but its counts exchange, whose routing the re-run reuses, its
  dispatches, whose received rows the forward kept, and its combines and output's moves, before
  which torch's checkpoint stops the re-run):
  counted, with their bytes per axis, ring traffic and the interference it costs.

What each mode keeps for backward is the memory model's (``axon4d.plan.saved.block_saved``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from axon4d.layout.geometry import Collective, Term
from axon4d.plan.block_extras import ATTENTION_FORWARD, attention_seconds, norm_passes
from axon4d.plan.blocks import mlp_width
from axon4d.plan.layers import ACTIVATION_TERMS, LayerCost, collectives, in_block, priced
from axon4d.plan.moe_cost import layer_seconds, output_moves
from axon4d.plan.scenario import Scenario


@dataclasses.dataclass(frozen=True)
class Rerun:
    """Seconds and collectives one step adds by recomputation on one rank (unscaled, as
    ``TimeEstimate``'s parts)."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    activation_comm_s: float = 0.0  # of which activation collectives (``layers.ACTIVATION_TERMS``)
    collectives: int = 0
    traffic_bytes: float = 0.0
    interference_s: float = 0.0  # compute lost to that traffic (Machine.interference_time)
    comm_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_by_axis: dict[str, int] = dataclasses.field(default_factory=dict)


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
        # the activation the MLP re-makes: a dense block's, an MoE block's shared experts' (none without)
        act = m.activation_time(b * mlp_width(mod) // shape.y * (2 if mod.gated else 1), world)[0]
        h_x = mod.hidden // shape.x
        normalize = m.elementwise_time(3 * b * h_x * elem, world) if wl.norms else 0.0
        # the step prices each norm by ``norm_passes`` without recomputation; balanced takes the chain
        chain = sum(norm_passes(wl, shape, "balanced")) - sum(norm_passes(wl, shape))
        unfused = m.elementwise_time(chain * b * h_x * elem, world) if wl.norms else 0.0
        return 2 * (act + 2 * normalize) + 2 * unfused
    return 0.0


def rerun(sc: Scenario, layers: Sequence[LayerCost], issued: Sequence[tuple[Collective, int]]) -> Rerun:
    """What ``sc.recompute`` adds to a step whose layer kinds cost ``layers`` (``layer_cost``);
    ``issued``: the collectives it issues again (``rerun_collectives``), each with how many times,
    as the step's walk lists them (``axon4d.plan.walk``)."""
    again = _collectives(sc, issued)
    if sc.recompute == "full":
        return _full(sc, layers, again)
    if sc.recompute in ("selective", "balanced"):  # selective under the ring: the forward's ring again
        return dataclasses.replace(again, compute_s=sc.model.n_layers * recomputed_seconds(sc))
    return Rerun()


#: an MoE layer's forward collectives its re-run under full recomputation does not issue: the counts
#: exchange (the routing is the forward's), the dispatch (its rows are the forward's, kept) and the
#: combine (the re-run stops before it: ``axon4d.nn.moe``)
NOT_RERUN = frozenset({Term.MOE_COUNTS, Term.MOE_DISPATCH, Term.MOE_COMBINE})


def rerun_collectives(sc: Scenario) -> list[tuple[Collective, int]]:
    """The collectives recomputation issues again in one pass on one rank, each with how many times:
    under full recomputation every block's forward again — each block layer's forward collectives
    (E8 in its chunks, E10f: ``layers.collectives``) n_layers times, and the norms' sums over x and
    the key/value all-gather of context parallelism (``Workload.block_forward_collectives``);
    under selective recomputation with ring context parallelism each block's forward ring of keys
    and values (``Workload.context_collectives``' forward shifts: core attention re-runs its ring
    in backward, ``axon4d.nn.context_ring``); nothing else under the other modes (no collective
    runs twice). The gathers of a block's last
    ``oag_depth`` layers are those OAG's backward prefetch issued (tagged E10b, as the runtime logs
    them): the same bytes on the same axis."""
    if sc.recompute == "selective" and sc.workload.context_mode == "ring":
        return [(c, 1) for c in sc.context_collectives if c.phase == "forward"]
    if sc.recompute != "full":
        return []
    block = [spec for spec in sc.linears if in_block(spec, sc)]  # forward order
    ov = sc.overlap
    # OAG's backward prefetch runs ahead into the block below (reverse order, ``oag_depth`` layers, those
    # whose backward gathers: not under keep-for-backward) before that block's forward is re-run: the
    # re-run takes those blocks, gathered in backward (E10b), for its last layers (``Scheduler._prefetch_after``)
    early = min(ov.oag_depth, len(block)) if ov.oag and not ov.oag_keep and sc.shape.z > 1 else 0
    out = []
    for i, spec in enumerate(block):
        for c in collectives(spec, sc):
            if c.phase == "forward":
                prefetched = c.term == Term.E10F and i >= len(block) - early
                out.append((dataclasses.replace(c, term=Term.E10B) if prefetched else c, spec.count))
    # an MoE layer's re-run reuses its first run's routing and dispatch plan (no counts exchange
    # again) and the rows its dispatches delivered (no dispatch again); it stops before the combines,
    # whose gated sum keeps nothing for backward, and the output's moves (``moe_cost.output_moves``)
    forward = [c for c in sc.moe_collectives if c.phase == "forward"]
    forward = forward[: len(forward) - output_moves(sc.model, sc.shape, sc.workload.expert_layout)]
    moe = [(c, sc.model.moe_layers) for c in forward if c.term not in NOT_RERUN]
    return out + moe + [(c, 1) for c in sc.workload.block_forward_collectives(sc.shape)]


def _full(sc: Scenario, layers: Sequence[LayerCost], again: Rerun) -> Rerun:
    """Full recomputation: the forward of every block layer kind run n_layers times, with every
    collective of the blocks' forwards again (``again``: ``rerun_collectives`` priced)."""
    block = [lc for lc in layers if in_block(lc.spec, sc)]
    moe = (
        sc.model.moe_layers
        * layer_seconds(
            sc.model,
            sc.tokens,
            sc.shape,
            sc.machine,
            sc.workload.dtype,
            sc.element_size,
            sc.workload.imbalance,
            sc.workload.expert_layout,
        ).rerun
        if sc.model.moe
        else 0.0
    )
    return dataclasses.replace(again, compute_s=sum(lc.spec.count * lc.fwd_s for lc in block) + moe)


def _collectives(sc: Scenario, issued: Sequence[tuple[Collective, int]]) -> Rerun:
    """The collectives ``issued`` again (each with how many times) as a ``Rerun`` without compute:
    their seconds, calls, bytes per axis, ring traffic and the interference it costs."""
    comm = activation = traffic = 0.0
    calls = 0
    by_axis: dict[str, float] = {}
    sent: dict[str, int] = {}
    for c, n in issued:
        seconds, moved = priced(c, sc)
        comm += n * seconds
        activation += n * seconds if c.term in ACTIVATION_TERMS else 0.0
        traffic += n * moved
        calls += n
        by_axis[c.axis] = by_axis.get(c.axis, 0.0) + n * seconds
        sent[c.axis] = sent.get(c.axis, 0) + n * c.payload_bytes
    return Rerun(
        comm_s=comm,
        activation_comm_s=activation,
        collectives=calls,
        traffic_bytes=traffic,
        interference_s=sc.machine.interference_time(traffic, sc.world),
        comm_by_axis=by_axis,
        bytes_by_axis=sent,
    )
