"""Predicted time of one training step on one grid: compute + communication − overlap (docs/design.md §3, §4, §6).

The step is assembled here from its parts, each priced elsewhere. Its collectives are the step's
one walk (``axon4d.plan.walk.step_walk``), the list the byte parity test and the host link's load
read too; each is priced by its source: every linear layer kind's run — its GEMMs, its collectives
E8–E13 and the non-GEMM work after it — by ``axon4d.plan.layers``; what overlap hides (§4) by
``axon4d.plan.overlap_credit``'s credit over the layers' windows (and the context-parallel
key/value collectives behind attention, ``block_extras.context_hidden``); what recomputation runs again
(§5) by ``axon4d.plan.recompute``; the collectives outside the layers (replicated parameters'
gradients), ZeRO's gathers and the optimizer step here. An MoE block's layer — its compute and
its collectives E14–E18 — is ``axon4d.plan.moe_cost``'s; of its collectives only the dispatches
and combines are hidden, behind its other chunks' expert GEMMs (``moe_cost.chunks_hidden``).

Interference: where the machine measured it (``Machine.interference_time``; a host whose ranks
share CPU cores), every collective also costs the compute its ring traffic's bytes take, hidden
or not: interference = κ · Σ ``collective_model.ring_traffic`` over the step's collectives. On an
accelerator whose file gives its SM count (``Machine.overlap_slowdown``: NCCL's channels hold
channels/SMs of it), the compute overlapped with collectives runs that much slower for the time
overlap hides: interference = (channels/SMs) · hidden; an exposed collective slows nothing.

The step is then the sum of three parts and a per-collective cost, weighted by the machine's
in-step scale for the world size (``Machine.step_scale``, fitted by ``axon4d.plan.stepfit`` from
measured steps; 1, 1, 1, 0 for a machine without step calibration):

    step = k_c · (compute + optimizer + interference)
           + k_a · exposed activation all-reduces (E8, E9, embedding lookup)
           + k_w · exposed weight and gradient collectives (E10–E13, replicated gradients)
           + k_n · collectives issued per step (each chunk of E8 is one)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Collective, Op, Term
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.block_extras import block_extras, context_hidden
from axon4d.plan.blocks import DENSE_MLP
from axon4d.plan.buckets import layer_scales
from axon4d.plan.layers import ACTIVATION_TERMS, LayerCost, in_block, layer_cost, priced
from axon4d.plan.machine import UNSCALED, Machine
from axon4d.plan.moe_cost import MoESeconds, chunks_hidden, layer_seconds
from axon4d.plan.offload_cost import offload_seconds
from axon4d.plan.overlap_credit import credit
from axon4d.plan.persistent import optimizer_elements
from axon4d.plan.recompute import rerun
from axon4d.plan.scenario import Scenario
from axon4d.plan.walk import ONCE_PER_STEP, step_walk, stored
from axon4d.plan.workload import Workload

#: Overlap mechanisms that hide activation collectives (the rest hide weight/gradient collectives).
ACTIVATION_MECHANISMS = frozenset({"chunks", "oar"})


@dataclasses.dataclass
class TimeEstimate:
    """Predicted seconds of one step on one rank, and where they go (recomputation included).

    ``compute_s``, ``comm_s`` and ``hidden_s`` are the unscaled model; ``step_s`` weights the three
    parts (compute, exposed activation collectives, exposed weight/gradient collectives) and the
    number of collectives by ``scale`` — the machine's in-step scale (``Machine.step_scale``)."""

    compute_s: float  # GEMMs, attention, elementwise work and the optimizer
    matmul_s: float
    optimizer_s: float
    comm_s: float  # all collectives as if serial
    hidden_s: float  # the part of comm_s overlap hides
    comm_by_axis: dict[str, float]
    bytes_by_axis: dict[str, int]
    hidden_by_mechanism: dict[str, float]
    layers: dict[str, dict[str, float]]
    activation_comm_s: float = 0.0  # the part of comm_s in ACTIVATION_TERMS
    collectives: int = 0  # issued per step on one rank (the communication log's count)
    traffic_bytes: float = 0.0  # ring traffic of those collectives (collective_model.ring_traffic)
    interference_s: float = 0.0  # compute lost to that traffic (Machine.interference_time)
    scale: tuple[float, float, float, float] = UNSCALED  # (k_c, k_a, k_w, k_n s per collective)
    offload_s: float = 0.0  # of compute_s, the activation offload copies exposed (``offload_seconds``)
    micro_batches: int = 1  # passes the step's batch ran as (``layers`` holds one pass's)

    @property
    def parts(self) -> tuple[float, float, float]:
        """(compute with interference, exposed activation collectives, exposed weight/gradient
        collectives), unscaled."""
        act_hidden = sum(v for k, v in self.hidden_by_mechanism.items() if k in ACTIVATION_MECHANISMS)
        return (
            self.compute_s + self.interference_s,
            self.activation_comm_s - act_hidden,
            self.comm_s - self.activation_comm_s - (self.hidden_s - act_hidden),
        )

    @property
    def step_s(self) -> float:
        k_c, k_a, k_w, k_n = self.scale
        compute, activation, weight = self.parts
        return k_c * compute + k_a * activation + k_w * weight + k_n * self.collectives

    @property
    def hidden_pct(self) -> float:
        return 100.0 * self.hidden_s / self.comm_s if self.comm_s > 0 else 0.0


@dataclasses.dataclass
class _Totals:
    """The per-step sums on one rank, as layers and collectives are added (unscaled seconds)."""

    compute: float = 0.0
    matmul: float = 0.0
    comm: float = 0.0
    activation_comm: float = 0.0  # the part of comm in ACTIVATION_TERMS
    traffic: float = 0.0
    calls: float = 0.0  # a bucketed reduction counts its share of its bucket's call (``buckets``)
    interference: float = 0.0  # compute lost to ``traffic`` (set by the caller: Machine.interference_time)
    comm_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_by_axis: dict[str, int] = dataclasses.field(default_factory=dict)

    def add_layer(self, lc: LayerCost, terms: frozenset[Term] | None = None) -> None:
        """Every run of one layer kind: its compute, GEMMs and collectives; with ``terms``, only
        the collectives of those terms (no compute)."""
        n = lc.spec.count
        if terms is None:
            self.compute += n * lc.compute_s
            self.matmul += n * (lc.fwd_mm + lc.dx + lc.dw)
        for term, t in lc.comm.items():
            if terms is not None and term not in terms:
                continue
            axis = lc.comm_axis[term]
            self.comm += n * t
            self.activation_comm += n * t if term in ACTIVATION_TERMS else 0.0
            self.calls += n * lc.term_calls[term]
            self.traffic += n * lc.term_traffic[term]
            self.comm_by_axis[axis] = self.comm_by_axis.get(axis, 0.0) + n * t
            self.bytes_by_axis[axis] = self.bytes_by_axis.get(axis, 0) + n * lc.term_bytes[term]

    def add_collective(self, c: Collective, seconds: float, traffic: float, count: int = 1) -> None:
        """``count`` of one collective outside the layers, priced (``layers.priced``: ``seconds`` and
        ``traffic`` each) and never hidden."""
        self.comm += count * seconds
        self.activation_comm += count * seconds if c.term in ACTIVATION_TERMS else 0.0
        self.calls += count
        self.traffic += count * traffic
        self.comm_by_axis[c.axis] = self.comm_by_axis.get(c.axis, 0.0) + count * seconds
        self.bytes_by_axis[c.axis] = self.bytes_by_axis.get(c.axis, 0) + count * c.payload_bytes


def step_time(
    wl: Workload,
    shape: GridShape,
    machine: Machine,
    overlap: OverlapPolicy = OverlapPolicy(),
    recompute: str = "none",
) -> TimeEstimate:
    """Predicted seconds of one forward + backward + optimizer step of ``wl`` on ``shape`` (one
    rank), with ``recompute``'s forward work again: ``step_estimate`` of their ``Scenario``."""
    return step_estimate(Scenario(wl, shape, machine, overlap, recompute))


def step_estimate(sc: Scenario) -> TimeEstimate:
    """Predicted seconds of one forward + backward + optimizer step of ``sc`` on one rank: one pass
    of a micro-batch (``_one_pass``; the whole batch when ``micro_batches`` is 1) repeated k times,
    with the once-per-step parts — the data-axis gradient reductions (``ONCE_PER_STEP``) and what
    ODP hides of them, the optimizer, ZeRO's parameter all-gather — counted once (``_accumulated``).
    Under keep-for-backward the k − 1 passes after the first gather no weight block that the first
    carried over (``layers.carried``): they are priced as such a pass. A model with blocks of two
    kinds (dense blocks before MoE blocks, ``Workload.kinds``) is the sum of its kinds' steps, each
    weighted by its share of the blocks (``combined``)."""
    kinds = sc.kinds()
    if len(kinds) > 1:
        return combined([(_kind_estimate(kind), share, not kind.model.moe) for kind, share in kinds])
    sc = kinds[0][0]  # its one kind: an MoE model whose blocks are all dense is the dense model
    k = sc.micro_batches
    micro = sc.micro()
    first = _one_pass(micro)
    if k == 1:
        return first[0]
    return _accumulated(first, _one_pass(micro, reuse=True) if sc.overlap.oag_keep else first, k)


def _kind_estimate(sc: Scenario) -> TimeEstimate:
    """``step_estimate`` of one kind of a mixed model's blocks; its dense blocks' step, which no
    expert layout changes (they have no experts), is made once per step options on the machine
    (``Machine.remembered``) and shared by every layout the search prices on the grid."""
    if sc.model.moe:
        return step_estimate(sc)
    wl = dataclasses.replace(sc.workload, expert_layout=ExpertLayout())
    # every input of the price but the machine, whose memo this is (a Machine does not hash)
    key = (
        "dense kind",
        *(wl if f.name == "workload" else getattr(sc, f.name) for f in dataclasses.fields(sc) if f.name != "machine"),
    )
    return sc.machine.remembered(key, lambda: step_estimate(dataclasses.replace(sc, workload=wl)))


#: the overlap mechanism that hides the once-per-step reductions, and the one that hides ZeRO's all-gather
ONCE_MECHANISMS = ("odp", "zero")


def _one_pass(sc: Scenario, reuse: bool = False) -> tuple[TimeEstimate, _Totals]:
    """One forward + backward of ``sc`` (micro-batches aside) with the optimizer step, and the
    once-per-step collectives among its collectives (priced, as ``_Totals``); ``reuse``: a
    micro-batch after the step's first, whose carried weight blocks are not gathered (``carried``).
    Every collective is the step's walk's (``axon4d.plan.walk.step_walk``), priced by its source."""
    m, world = sc.machine, sc.world
    extras = block_extras(sc)
    scales = layer_scales(sc)  # the runtime's buckets of E12 and E13
    walked = step_walk(sc, reuse, scales)
    issued: dict[str, list[Collective]] = {spec.name: [] for spec in sc.linears}
    for s in walked:
        if s.source == "layer":
            issued[s.layer].append(s.collective)
    layers = [layer_cost(s, sc, extras.get(s.name, (0.0, 0.0)), issued[s.name], scales) for s in sc.linears]
    hidden = credit([lc.window(in_block(lc.spec, sc)) for lc in layers], sc.overlap, m.overlap_efficiency)
    hidden_cp = context_hidden(sc)
    totals, once = _Totals(), _Totals()
    for lc in layers:
        totals.add_layer(lc)
        once.add_layer(lc, ONCE_PER_STEP)
    # the walk's other entries, each alike collective priced once: replicated parameters' gradients
    # (one collective per bucket of a kind), norms' sums, the loss's; every block's MoE layer's
    # collectives (never hidden but by its chunked exchanges); ZeRO's gathers; the FP8 scales
    replicas_s = 0.0  # the expert replicas' weight-gradient reductions (an MoE layout with replicas)
    a2a = {"forward": 0.0, "backward": 0.0}  # one MoE layer's dispatches and combines, per phase
    combine_grads = 0.0  # ... of which its combines' gradients (backward)
    gathers_s = 0.0  # ZeRO's all-gathers
    for s in walked:
        if s.source in ("layer", "rerun"):  # the layers' own; recomputation's are ``rerun``'s
            continue
        c = s.collective
        seconds, traffic = priced(c, sc)
        totals.add_collective(c, seconds, traffic, s.runs)
        if s.once:
            once.add_collective(c, seconds, traffic, s.runs)
        if c.term == Term.MOE_EXPERT_WEIGHT_GRAD:
            replicas_s += s.runs * seconds
        if s.source == "moe" and c.op == Op.ALL_TO_ALL and c.axis != "x":  # not the moves over x
            a2a[c.phase] += s.runs // sc.model.moe_layers * seconds
            combine_grads += s.runs // sc.model.moe_layers * seconds if c.term == Term.MOE_COMBINE_GRAD else 0.0
        if c.term == Term.ZERO_GATHER:
            gathers_s += seconds
    again = rerun(sc, layers, [(s.collective, s.runs) for s in walked if s.source == "rerun"])
    # what ODP hides of the replicas' reductions, the chunked exchanges, a fully recomputed block's re-run
    odp_experts = moe_chunks = moe_rerun = 0.0
    if sc.model.moe:  # every MoE block's MoE layer's compute
        n = sc.model.moe_layers
        moe = moe_seconds(sc)
        totals.compute += n * (moe.fwd + moe.bwd)
        totals.matmul += n * moe.matmul
        odp_experts = replicas_hidden(sc, replicas_s, moe.bwd)
        # under full recomputation a block's combine gradients, issued before its re-run needs them,
        # travel while the re-run (which exchanges nothing) computes the block's forward again: the
        # chunked exchange hides what is left of the backward's
        behind = min(combine_grads, again.compute_s / sc.model.n_layers) if sc.recompute == "full" else 0.0
        moe_rerun = n * m.overlap_efficiency * behind
        eff = m.overlap_efficiency
        moe_chunks = n * chunks_hidden(a2a["forward"], a2a["backward"] - behind, moe, sc.moe_chunks, eff)
    opt = m.optimizer_time(_owned(sc), world, sc.workload.optimizer)
    by_mechanism = {**hidden.by_mechanism, **({"context": hidden_cp} if hidden_cp else {})}
    if odp_experts:
        by_mechanism["odp"] = by_mechanism.get("odp", 0.0) + odp_experts
    if moe_chunks:
        by_mechanism["moe_chunks"] = moe_chunks
    if moe_rerun:
        by_mechanism["moe_rerun"] = moe_rerun
    hidden_s = hidden.total + hidden_cp + odp_experts + moe_chunks + moe_rerun
    if any(s.collective.term == Term.ZERO_GATHER for s in walked):
        # ZeRO: the updated parameters all-gathered over data, bucket by bucket, behind the optimizer;
        # each bucket's parts are copied into the send buffer and every rank's back into the parameters
        held = sum(sum(tensors) * size for tensors, size in stored(sc))
        opt += m.elementwise_time(2 * (1 + 1 / sc.shape.data) * held, world)
        by_mechanism["zero"] = min(gathers_s, opt) * m.overlap_efficiency
        hidden_s += by_mechanism["zero"]
    once.interference = m.interference_time(once.traffic, world)
    offload = offload_seconds(sc, layers, walked)
    interference = m.interference_time(totals.traffic, world) + again.interference_s
    slowdown = m.overlap_slowdown
    if slowdown:  # an accelerator: the compute overlapped with a collective runs on the SMs it leaves
        interference = slowdown * hidden_s
        once.interference = slowdown * sum(by_mechanism.get(mech, 0.0) for mech in ONCE_MECHANISMS)
    return (
        TimeEstimate(
            compute_s=totals.compute + opt + again.compute_s + offload,
            matmul_s=totals.matmul,
            optimizer_s=opt,
            comm_s=totals.comm + again.comm_s,
            hidden_s=hidden_s,
            comm_by_axis=_merged(totals.comm_by_axis, again.comm_by_axis),
            bytes_by_axis=_merged(totals.bytes_by_axis, again.bytes_by_axis),
            hidden_by_mechanism=by_mechanism,
            layers={lc.spec.name: lc.report(h) for lc, h in zip(layers, hidden.per_window)},
            activation_comm_s=totals.activation_comm + again.activation_comm_s,
            collectives=round(totals.calls + again.collectives),
            traffic_bytes=totals.traffic + again.traffic_bytes,
            interference_s=interference,
            scale=m.step_scale_for(world),
            offload_s=offload,
        ),
        once,
    )


def combined(parts: list[tuple[TimeEstimate, float, bool]]) -> TimeEstimate:
    """A step whose blocks are of several kinds from the steps of each kind alone (every block of
    that kind), each weighted by its share of the blocks: every sum of the estimate is the weighted
    sum of the kinds' — each kind's blocks counted as many times as the model has them, the edges
    (embedding, head, optimizer of their parameters) once. A layer of every kind (attention) keeps
    its per-run figures weighted by the kinds' shares; a layer of one kind (the dense blocks' MLP,
    ``workload.DENSE_MLP``, or the MoE blocks' shared experts) its kind's, with its own count.
    What this leaves out: overlap across the one boundary between the kinds, where each kind's
    schedule assumes a neighbour of its own kind. ``parts``: (the kind's estimate, its share of the
    blocks, whether it is the dense blocks' kind of an MoE model)."""
    first = parts[0][0]

    def total(field: str) -> float:
        return sum(share * getattr(t, field) for t, share, _ in parts)

    def by_key(field: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, share, _ in parts:
            for key, v in getattr(t, field).items():
                out[key] = out.get(key, 0.0) + share * v
        return out

    layers: dict[str, dict[str, float]] = {}
    weight: dict[str, float] = {}
    for t, share, dense in parts:
        for name, report in t.layers.items():
            name = DENSE_MLP.get(name, name) if dense else name
            row = layers.setdefault(name, {})
            weight[name] = weight.get(name, 0.0) + share
            for key, v in report.items():
                row[key] = row.get(key, 0.0) + share * v
    for name, row in layers.items():  # per-run figures: the kinds' mean; the count: the runs of all kinds
        for key in row:
            if key != "count":
                row[key] /= weight[name]
    return dataclasses.replace(
        first,
        compute_s=total("compute_s"),
        matmul_s=total("matmul_s"),
        optimizer_s=total("optimizer_s"),
        comm_s=total("comm_s"),
        hidden_s=total("hidden_s"),
        comm_by_axis=by_key("comm_by_axis"),
        bytes_by_axis={axis: round(v) for axis, v in by_key("bytes_by_axis").items()},
        hidden_by_mechanism=by_key("hidden_by_mechanism"),
        layers=layers,
        activation_comm_s=total("activation_comm_s"),
        collectives=round(total("collectives")),
        traffic_bytes=total("traffic_bytes"),
        interference_s=total("interference_s"),
        offload_s=total("offload_s"),
    )


def replicas_hidden(sc: Scenario, seconds: float, moe_bwd: float) -> float:
    """Seconds ODP hides of the expert replicas' weight-gradient reductions (``seconds`` in all):
    the scheduler launches each block's as its experts' backward ends (``track_replicated``,
    bucketed), so all but the first block's run behind the backward of the MoE layers below it —
    at most their compute (``moe_bwd`` each), which no other overlap window uses (the MoE layer's
    own collectives are waited for in place) — at the machine's overlap efficiency. Nothing
    without ODP or replicas."""
    n = sc.model.moe_layers
    if not sc.overlap.odp or seconds <= 0 or n < 2:
        return 0.0
    return min(seconds * (n - 1) / n, (n - 1) * moe_bwd) * sc.machine.overlap_efficiency


def moe_seconds(sc: Scenario) -> MoESeconds:
    """One MoE layer's compute on one rank of ``sc`` (``moe_cost.layer_seconds``)."""
    wl = sc.workload
    return layer_seconds(
        sc.model, sc.tokens, sc.shape, sc.machine, wl.dtype, sc.element_size, wl.imbalance, wl.expert_layout
    )


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per-axis sums of ``a`` and ``b``."""
    return {axis: a.get(axis, 0) + b.get(axis, 0) for axis in a.keys() | b.keys()}


def _accumulated(first: tuple[TimeEstimate, _Totals], later: tuple[TimeEstimate, _Totals], k: int) -> TimeEstimate:
    """A step of ``k`` micro-batches: the first pass and k − 1 ``later`` ones (each a pass and its
    once-per-step collectives, ``_one_pass``; the same pass unless keep-for-backward carries weight
    blocks over), the later ones without the optimizer, the once-per-step collectives and what
    ``ONCE_MECHANISMS`` hide of them. ``layers`` stays the first micro-batch's."""
    one, _ = first
    again, once = later
    n = k - 1

    def more(field: str, per_step: dict[str, Any]) -> dict[str, Any]:
        """A per-axis ``field`` of the first pass plus the later ones' less their once-per-step part."""
        per_pass = getattr(again, field)
        return {a: v + n * (per_pass.get(a, 0) - per_step.get(a, 0)) for a, v in getattr(one, field).items()}

    hidden_once = sum(again.hidden_by_mechanism.get(mech, 0.0) for mech in ONCE_MECHANISMS)
    return dataclasses.replace(
        one,
        compute_s=one.compute_s + n * (again.compute_s - again.optimizer_s),
        matmul_s=one.matmul_s + n * again.matmul_s,
        comm_s=one.comm_s + n * (again.comm_s - once.comm),
        hidden_s=one.hidden_s + n * (again.hidden_s - hidden_once),
        comm_by_axis=more("comm_by_axis", once.comm_by_axis),
        bytes_by_axis=more("bytes_by_axis", once.bytes_by_axis),
        hidden_by_mechanism={
            mech: v if mech in ONCE_MECHANISMS else v + n * again.hidden_by_mechanism.get(mech, 0.0)
            for mech, v in one.hidden_by_mechanism.items()
        },
        activation_comm_s=one.activation_comm_s + n * again.activation_comm_s,
        collectives=round(one.collectives + n * (again.collectives - once.calls)),
        traffic_bytes=one.traffic_bytes + n * (again.traffic_bytes - once.traffic),
        interference_s=one.interference_s + n * (again.interference_s - once.interference),
        offload_s=one.offload_s + n * again.offload_s,
        micro_batches=k,
    )


def _owned(sc: Scenario) -> float:
    """Parameter elements whose optimizer step runs on this rank: all of its own, or with ZeRO
    ⌈N/G_data⌉ of them, an MoE model's experts whole (``persistent.optimizer_elements``)."""
    return optimizer_elements(sc.workload, sc.shape, sc.zero)
