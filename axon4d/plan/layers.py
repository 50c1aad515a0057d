"""Seconds of each linear layer kind of a step on one rank: its GEMMs, its collectives and the
non-GEMM work after it, given (``axon4d.plan.block_extras``) (docs/design.md §3, §6).

For every linear layer kind of the ``Workload`` the collectives are exactly the list
``axon4d.layout.geometry.linear_collectives`` returns (E8–E13, normal or transposed layout) under the
step's precision and ZeRO stage (``collectives``: each collective's dtype from
``geometry.wire_dtype``, as the runtime casts it) — the same list the communication log is tested
against (tests/test_plan_bytes.py) — each priced by ``Machine.comm_time`` on its axis
(group size and rank stride from E1, ``axis_group_and_stride``) with the time model of §3. GEMMs are
priced from the machine's measured throughput at the local shapes; attention, elementwise work and
norms from their own calibrations. ``LayerCost`` is one layer kind's run; ``axon4d.plan.cost``
adds the runs up into a step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import (
    MOE_LAYER_TERMS,
    Collective,
    Op,
    Term,
    chunk_sizes,
    linear_collectives,
    weight_shard_numel,
)
from axon4d.options.precision import Precision, layer_precision
from axon4d.plan import fp8 as fp8_plan
from axon4d.plan.collective_model import group_geometry, ring_traffic
from axon4d.plan.moe_cost import all_to_all_seconds
from axon4d.plan.overlap_credit import Window
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import LinearSpec

#: Collectives that move activations on the critical path (each waited on at once: E8's chunks aside,
#: nothing hides them but what ``overlap_credit`` credits); every other one moves weights or gradients.
ACTIVATION_TERMS = frozenset(
    {Term.E8, Term.E9, Term.EMBEDDING, Term.NORM_STATS, Term.NORM_STATS_GRAD, Term.CE_LSE, Term.CE_TARGET}
    | MOE_LAYER_TERMS
)
#: The embedding layer's own collectives (priced with its layer; the other edge collectives apart).
EMBEDDING_TERMS = frozenset({Term.EMBEDDING, Term.EMBEDDING_GRAD})


def axis_group_and_stride(shape: GridShape, axis: str, devices_per_node: int) -> tuple[int, int]:
    """(ranks in one group of ``axis``, distance between consecutive members) — E1, x innermost; for
    a product of axes not adjacent in E1, the uniform stride that spans nodes as it does
    (``collective_model.group_geometry``)."""
    return group_geometry(shape, axis, devices_per_node)


def priced(c: Collective, sc: Scenario) -> tuple[float, float]:
    """(seconds, ring traffic bytes) of one collective (§3's time model on its axis, E1), remembered
    per collective, grid and MoE imbalance by the machine (``Machine.remembered``)."""
    key = ("priced", c, sc.shape, sc.workload.imbalance)
    return sc.machine.remembered(key, lambda: _priced(c, sc))


def _priced(c: Collective, sc: Scenario) -> tuple[float, float]:
    """``priced``, made."""
    group, stride = axis_group_and_stride(sc.shape, c.axis, sc.machine.devices_per_node)
    if c.op == Op.ALL_TO_ALL:  # an MoE layer's dispatch or combine (E16)
        seconds = all_to_all_seconds(sc.machine, sc.shape, c, sc.workload.imbalance)
        return seconds, ring_traffic(c.op.value, group, c.payload_bytes)
    return (
        sc.machine.comm_time(c.op.value, group, stride, c.payload_bytes, sc.world),
        ring_traffic(c.op.value, group, c.payload_bytes),
    )


def comm_field(term: Term) -> str:
    """The field of ``LayerCost.report`` (``TimeEstimate.layers``) holding ``term``'s seconds, e.g. "comm_E8"."""
    return f"comm_{term.value}"


@dataclasses.dataclass
class LayerCost:
    """Seconds of one run of one linear layer kind (compute and each collective) on one rank."""

    spec: LinearSpec
    fwd: float  # forward GEMM + elementwise of the layer itself
    post_fwd: float  # non-GEMM forward work after the layer (attention, GELU, residual, loss)
    fwd_mm: float  # of which the forward GEMM (one per token chunk of E8)
    dx: float  # input-gradient GEMM dY·W
    dw: float  # weight-gradient GEMM dYᵀ·X (the embedding: zero-fill and scatter-add)
    bwd_ew: float  # the layer's own elementwise backward work (gradient buffers, bias gradient)
    post_bwd: float  # backward of the non-GEMM work after the layer
    comm: dict[Term, float]  # term (E8, E10f, E10b, E9, E11, E12, E13; the embedding's) -> seconds
    comm_axis: dict[Term, str]
    bytes_by_axis: dict[str, int]
    chunks: int = 1  # forward all-reduces E8 is issued as
    calls: float = 0  # collectives the layer issues per run (a bucketed reduction's share: ``buckets``)
    fwd_calls: int = 0  # of which in the forward pass
    traffic: float = 0.0  # ring traffic bytes of its collectives per run (collective_model.ring_traffic)
    fwd_traffic: float = 0.0  # of which in the forward pass
    term_calls: dict[Term, float] = dataclasses.field(default_factory=dict)  # calls, payload bytes and
    term_bytes: dict[Term, int] = dataclasses.field(default_factory=dict)  # ring traffic of each term
    term_traffic: dict[Term, float] = dataclasses.field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        """Compute seconds of one run: forward, the work after it, and their backward."""
        return self.fwd + self.post_fwd + self.dx + self.dw + self.bwd_ew + self.post_bwd

    @property
    def fwd_s(self) -> float:
        """The forward's compute: the layer and the non-GEMM work after it (what full recomputation runs again)."""
        return self.fwd + self.post_fwd

    @property
    def fwd_comm_s(self) -> float:
        """The forward's collectives: E8 and the Z all-gather E10f."""
        return self.comm.get(Term.E8, 0.0) + self.comm.get(Term.E10F, 0.0)

    def window(self, repeated: bool) -> Window:
        """The layer as the overlap schedule sees it (``repeated``: one of the block's layers)."""
        return Window(
            self.spec.count,
            repeated,
            self.fwd_s,
            self.fwd_mm,
            self.post_bwd + self.dx + self.dw + self.bwd_ew,
            self.dw,
            self.chunks,
            self.comm,
        )

    def report(self, hidden_s: float) -> dict[str, float]:
        """One run's figures as ``TimeEstimate.layers`` gives them (``hidden_s``: what overlap hid)."""
        c = self.comm
        return {
            "count": self.spec.count,
            "compute_s": self.compute_s,
            "comm_s": sum(c.values()),
            "fwd_s": self.fwd_s,
            "fwd_comm_s": self.fwd_comm_s,
            "fwd_collectives": self.fwd_calls,
            "fwd_traffic_bytes": self.fwd_traffic,
            "hidden_s": hidden_s,
            **{comm_field(k): v for k, v in c.items()},
        }


def in_block(spec: LinearSpec, sc: Scenario) -> bool:
    """Whether ``spec`` is one of the block's layers, repeated n_layers times."""
    return spec.count == sc.model.n_layers and not spec.embedding and spec.name != "head"


def carried(spec: LinearSpec, sc: Scenario) -> bool:
    """Whether the micro-batches after a step's first reuse ``spec``'s weight block instead of
    gathering it (E10f): keep-for-backward carries each layer's block over the held backward passes
    (``axon4d.scheduler.Scheduler.carry_block``), except the blocks' layers under full
    recomputation, which gather in every forward and again in its re-run (docs/design.md §4)."""
    return sc.overlap.oag_keep and not spec.embedding and not (sc.recompute == "full" and in_block(spec, sc))


def collectives(spec: LinearSpec, sc: Scenario, gathers: bool = True) -> list[Collective]:
    """The collectives of one run of ``spec`` on one rank: the embedding's lookup all-reduce over y
    and its table's gradient all-reduce over batch, or a linear layer's E8–E13 (no E9 without an
    input gradient) as the step issues them — their bytes from ``geometry.linear_collectives``
    under the step's precision (``Scenario.precision``: E10 in FP8 with its scales, E11–E13 in the
    reduction dtype) and ZeRO stage (ZeRO-2: E12 a reduce-scatter over data), as the overlap
    policy issues them (keep-for-backward, token chunks); no E10f unless ``gathers`` (a
    micro-batch that reuses the block, ``carried``)."""
    if spec.embedding:
        return [c for c in sc.edge_collectives if c.term in EMBEDDING_TERMS]
    ov = sc.overlap
    floor, rows = ov.chunking(sc.machine.accelerator)  # the device's chunk floor and row multiple
    out = linear_collectives(
        spec.in_features,
        spec.out_features,
        sc.tokens,
        sc.shape,
        transpose=spec.transpose,
        bias=spec.bias,
        precision=_layer_precision(spec, sc),
        zero=sc.zero,
        cache_weight=ov.oag_keep,
        forward_chunks=ov.forward_chunks,
        min_chunk_bytes=floor,
        chunk_rows=rows,
    )
    return [c for c in out if (spec.input_grad or c.term != Term.E9) and (gathers or c.term != Term.E10F)]


def _layer_precision(spec: LinearSpec, sc: Scenario) -> Precision:
    """The precision ``spec`` runs in on ``sc`` (``precision.layer_precision``): under FP8 GEMMs a
    layer the planner keeps in bf16 gathers bf16; the FP8 choice is priced only there."""
    if sc.precision.gemm is None:
        return sc.precision
    return layer_precision(sc.precision, fp8_plan.layer_choice(spec, sc)[0])


def fp8_cast_seconds(spec: LinearSpec, sc: Scenario) -> float:
    """Seconds of one FP8 E10 gather's casts on one rank: the shard to e4m3 with its scale (read
    the 16-bit shard twice — amax, then cast — write bytes), the gathered block back to 16 bits.
    None under FP8 GEMMs: an FP8 layer's weight copy is priced with its GEMMs (``plan.fp8``), and a
    layer kept in bf16 gathers bf16 (``precision.layer_precision``)."""
    if not sc.fp8_gather or sc.shape.z == 1 or spec.embedding or sc.precision.gemm is not None:
        return 0.0
    shard = weight_shard_numel(spec.in_features, spec.out_features, sc.shape, spec.transpose)
    elem = sc.element_size
    return sc.machine.elementwise_time(shard * (2 * elem + 1) + shard * sc.shape.z * (1 + elem), sc.world)


def _gemms(spec: LinearSpec, sc: Scenario, chunks: int) -> tuple[float, float, float, float]:
    """(forward, of which the forward GEMM, dX, dW) seconds of one run of ``spec``; the forward GEMM
    runs as one GEMM per token chunk of E8 (axon4d.nn.linear)."""
    m, world, dt, elem, b = sc.machine, sc.world, sc.workload.dtype, sc.element_size, sc.tokens
    in_l, out_l = spec.local(sc.shape)
    ew = m.elementwise_time
    if spec.embedding:
        table = (spec.in_features // sc.shape.y) * (spec.out_features // sc.shape.x)
        fwd = ew(4 * b * out_l * elem, world)  # gather rows, mask
        dw = ew((2 * table + 2 * b * out_l) * elem, world)  # zero-fill the table, scatter-add rows
        return fwd, 0.0, 0.0, dw
    multiple = sc.overlap.chunking(m.accelerator)[1]
    # under bf16-fp8, the layers the planner runs in FP8 (axon4d.plan.fp8: where it fits and is cheaper)
    fp8 = fp8_plan.runs_fp8_at_all(spec, sc) and fp8_plan.layer_choice(spec, sc)[0]
    mm = functools.partial(fp8_plan.gemm_seconds, m) if fp8 else m.matmul_time
    fwd_mm = sum(mm("nt", rows, in_l, out_l, dt, world) for rows in chunk_sizes(b, chunks, multiple))
    fwd = fwd_mm + (ew(2 * b * out_l * elem, world) if spec.bias else 0.0)
    dx = mm("nn", b, out_l, in_l, dt, world) if spec.input_grad else 0.0
    dw = mm("tn", out_l, b, in_l, dt, world)
    if fp8:  # the casts: X's in forward, dY's, X's again, Ŵᵀ and the block's in backward (about a third, two thirds)
        casts = fp8_plan.cast_seconds(spec, sc)
        fwd, dw = fwd + casts / 3, dw + 2 * casts / 3
    return fwd, fwd_mm, dx, dw


def _backward_elementwise(spec: LinearSpec, sc: Scenario) -> float:
    """The layer's own elementwise backward: the gradient shard scaled by 1/G_batch in place (read
    and write; none when G_batch = 1) and the bias gradient's sum over tokens; dW itself is computed
    straight into E11's input (no copy)."""
    shape, m = sc.shape, sc.machine
    shard = weight_shard_numel(spec.in_features, spec.out_features, shape, spec.transpose)
    scaled = 2 * shard if shape.size("batch") > 1 else 0
    out_l = spec.local(shape)[1]
    return m.elementwise_time((scaled + (sc.tokens * out_l if spec.bias else 0)) * sc.element_size, sc.world) + (
        8 * m.op_overhead_s
    )


def layer_cost(
    spec: LinearSpec,
    sc: Scenario,
    post: tuple[float, float] = (0.0, 0.0),
    issued: Sequence[Collective] | None = None,
    scales: dict[Term, tuple[float, float]] | None = None,
) -> LayerCost:
    """One run of ``spec`` on one rank; ``post``: the (forward, backward) seconds of the non-GEMM
    work after it (``block_extras.block_extras``); ``issued``: the collectives of one run as the step's walk
    lists them (``axon4d.plan.walk``: without E10f nor its FP8 casts in a run that reuses the
    weight block the step's first micro-batch gathered, ``carried``), by default ``collectives``;
    ``scales``: term → (seconds, calls) factors of the reductions the runtime buckets
    (``axon4d.plan.buckets.layer_scales``)."""
    comm: dict[Term, float] = {}
    axes: dict[Term, str] = {}
    by_axis: dict[str, int] = {}
    chunks = fwd_calls = 0
    calls = 0.0
    traffic = fwd_traffic = 0.0
    term_calls: dict[Term, float] = {}
    term_bytes: dict[Term, int] = {}
    term_traffic: dict[Term, float] = {}
    for c in collectives(spec, sc) if issued is None else issued:
        chunks += c.term == Term.E8
        fwd_calls += c.phase == "forward"
        seconds, moved = priced(c, sc)
        time_share, call_share = (scales or {}).get(c.term, (1.0, 1.0))  # a bucket's share of the call
        seconds *= time_share
        calls += call_share
        term_calls[c.term] = term_calls.get(c.term, 0) + call_share
        term_bytes[c.term] = term_bytes.get(c.term, 0) + c.payload_bytes
        term_traffic[c.term] = term_traffic.get(c.term, 0.0) + moved
        comm[c.term] = comm.get(c.term, 0.0) + seconds
        traffic += moved
        fwd_traffic += moved if c.phase == "forward" else 0.0
        axes[c.term] = c.axis
        by_axis[c.axis] = by_axis.get(c.axis, 0) + c.payload_bytes
    chunks = max(chunks, 1)
    fwd, fwd_mm, dx, dw = _gemms(spec, sc, chunks)
    bwd_ew = _backward_elementwise(spec, sc)
    cast = fp8_cast_seconds(spec, sc)
    fwd += term_calls.get(Term.E10F, 0) * cast
    bwd_ew += term_calls.get(Term.E10B, 0) * cast
    return LayerCost(
        spec,
        fwd=fwd,
        post_fwd=post[0],
        fwd_mm=fwd_mm,
        dx=dx,
        dw=dw,
        bwd_ew=bwd_ew,
        post_bwd=post[1],
        comm=comm,
        comm_axis=axes,
        bytes_by_axis=by_axis,
        chunks=chunks,
        calls=calls,
        fwd_calls=fwd_calls,
        traffic=traffic,
        fwd_traffic=fwd_traffic,
        term_calls=term_calls,
        term_bytes=term_bytes,
        term_traffic=term_traffic,
    )
