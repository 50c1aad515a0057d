"""A Mixture-of-Experts layer priced on one rank (docs/moe.md; docs/design.md §10, E14–E18): the
collectives it issues per step and their seconds, and its compute — on the placement
``axon4d.plan.moe_placement`` gives it (where its experts sit, which rows each rank sends and
computes under the routing assumption stated there).

The runtime (``axon4d.nn.moe``, ``moe_routes``, ``moe_dispatch``) is mirrored here, not imported (the planner's
pricing may not import the layers).

The counts exchange (E15) is the layer's one host synchronisation: besides its collectives, an
accelerator's stream drains while the host reads the counts, priced as the machine's
``host_sync_s`` where ``axon4d calibrate`` measured it, else ``HOST_SYNC_S`` (an assumption);
on the host the ranks compute synchronously and it costs nothing more (``host_sync_seconds``).
"""

from __future__ import annotations

import dataclasses
import math

from axon4d.config import ModelConfig
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Collective, Op, Term
from axon4d.options import fp8_rows
from axon4d.plan.collective_model import group_geometry
from axon4d.plan.machine import Machine
from axon4d.plan.moe_placement import chunk_rows, first_share, placement, shares

#: seconds an accelerator idles at the counts exchange's host read (stream drained, counts copied to
#: the host, the next kernels launched): an assumption of the order of a device synchronisation, for
#: a machine file that gives no measured ``host_sync_s`` (the shipped GPU files)
HOST_SYNC_S = 50e-6
#: framework ops of one MoE layer's forward and backward besides its GEMMs (sorts, index selects,
#: scatters, concatenations, casts: counted in axon4d.nn.moe's forward and its autograd graph)
FORWARD_OPS, BACKWARD_OPS = 40, 50

#: bytes a dispatched row carries beside its features, and its gradient beside the row's: its gate,
#: fp32 (``axon4d.nn.moe_dispatch.Exchange``: the experts apply the gates)
GATE_BYTES = 4


def layer_collectives(
    model: ModelConfig,
    tokens: int,
    shape: GridShape,
    elem: int,
    chunks: int,
    imbalance: float = 1.0,
    layout: ExpertLayout | str | None = None,
) -> list[Collective]:
    """The collectives one MoE layer issues in one forward + backward on one rank (y index 0, x
    index 0), in the order the runtime issues them, with the payloads the communication log records
    (bytes of the result; an all-to-all's: the bytes this rank sends, its own rows included).
    ``elem``: bytes of an activation element (the compute dtype). Axes of one rank issue nothing.
    F = the features of a dispatched row: hidden/G_x where x splits the experts, else hidden.

    Under FP8 dispatch (``Placement.fp8_dispatch``) the dispatch and the combine's gradient move
    each row packed: F e4m3 bytes and an fp32 scale per 128 features (``fp8_rows.packed_width``).
    Each dispatched row carries its gate (``GATE_BYTES``, fp32: the experts apply the gates), and
    its gradient the gate's gradient.
    Forward: E14 over x (T·E fp32 logits); E15's sum over the total axis (C·E int64 counts, where
    it is not the count axis) and its gather over the count axis (G_count·C·E int64 counts: each
    rank its share's); where the rows move over x, the share's features to rows (an all-to-all over
    x); per chunk E16's dispatch over the expert-parallel axis, where y splits the experts E17's
    gather over y (padded to the largest share), where x splits them the all-reduce over x after
    the up GEMM (``sum_partials.x``), where y splits them the reduce-scatter over y after the down
    GEMM (``moe.expert``: each y index keeps its own rows, padded blocks), and the combine; the gated
    sums back to features over x (where they moved) and gathered over y (T_j rows each, padded).
    Backward: the gates' gradient gathered over y (T_j·k fp32 each, padded), gathered over x (where
    the rows moved) or summed over x; the rows' gradient to rows over x; per chunk the combine's and
    dispatch's reverse all-to-alls, and where y and x split the experts the outputs' gradient
    gathered over y, the up all-reduce's gradient over x and the gathered rows' partial gradients
    reduce-scattered over y (E17: each y index its own rows, padded blocks); the share's gradient back to features over x; the y share's input gradient
    gathered over y."""
    p = placement(model, shape, layout)
    g_x, g_y = shape.x, shape.y
    h_x, feat, k, e_count = model.hidden // g_x, p.hidden_x, model.experts_per_token, model.n_experts
    up = (2 if model.gated else 1) * p.ffn_y
    y_shares = shares(tokens, g_y)
    most, x_most = max(y_shares), max(shares(y_shares[0], g_x))
    mine = first_share(tokens, shape, p.rows_over_x)
    rows = chunk_rows(model, tokens, shape, chunks, imbalance, p)
    count = shape.size(p.count_axis) if p.count_axis else 1
    split_x = g_x > 1 and not p.rows_over_x
    out: list[Collective] = []

    def add(op: Op, axis: str | None, nbytes: float, phase: str, term: Term, when: bool = True) -> None:
        if when and axis is not None and shape.size(axis) > 1:
            out.append(Collective(op, axis, int(round(nbytes)), phase, term))

    add(Op.ALL_REDUCE, "x", tokens * e_count * 4, "forward", Term.MOE_ROUTER)
    add(Op.ALL_REDUCE, p.total_axis, chunks * e_count * 8, "forward", Term.MOE_COUNTS)
    add(Op.ALL_GATHER, p.count_axis, count * chunks * e_count * 8, "forward", Term.MOE_COUNTS)
    add(Op.ALL_TO_ALL, "x", y_shares[0] * h_x * elem, "forward", Term.MOE_ROWS_X, p.rows_over_x)
    to_experts = fp8_rows.packed_width(feat) if p.fp8_dispatch else feat * elem  # bytes of a row sent to the experts
    for r in rows:  # each dispatched row with its gate's bytes, and in backward its gradient with the gate's
        add(Op.ALL_TO_ALL, p.ep_axis, r.sent * (to_experts + GATE_BYTES), "forward", Term.MOE_DISPATCH)
        add(Op.ALL_GATHER, "y", g_y * r.gathered_max * feat * elem, "forward", Term.MOE_ROWS_Y, p.gather_y)
        add(Op.ALL_REDUCE, "x", r.computed * up * elem, "forward", Term.MOE_EXPERT_UP, split_x)
        add(Op.REDUCE_SCATTER, "y", g_y * r.gathered_max * feat * elem, "forward", Term.MOE_EXPERT, p.gather_y)
        add(Op.ALL_TO_ALL, p.ep_axis, r.received * feat * elem, "forward", Term.MOE_COMBINE)
    add(Op.ALL_TO_ALL, "x", mine * model.hidden * elem, "forward", Term.MOE_ROWS_X, p.rows_over_x)
    add(Op.ALL_GATHER, "y", g_y * most * h_x * elem, "forward", Term.MOE_ROWS_Y)
    add(Op.ALL_GATHER, "y", g_y * most * k * 4, "backward", Term.MOE_ROUTER_GRAD)
    add(Op.ALL_GATHER, "x", g_x * x_most * k * 4, "backward", Term.MOE_ROUTER_GRAD, p.rows_over_x)
    add(Op.ALL_REDUCE, "x", tokens * k * 4, "backward", Term.MOE_ROUTER_GRAD, not p.rows_over_x)
    add(Op.ALL_TO_ALL, "x", y_shares[0] * h_x * elem, "backward", Term.MOE_ROWS_X_GRAD, p.rows_over_x)
    for r in reversed(rows):
        add(Op.ALL_TO_ALL, p.ep_axis, r.sent * to_experts, "backward", Term.MOE_COMBINE_GRAD)
        add(Op.ALL_GATHER, "y", g_y * r.gathered_max * feat * elem, "backward", Term.MOE_ROWS_Y, p.gather_y)
        add(Op.ALL_REDUCE, "x", r.computed * up * elem, "backward", Term.MOE_EXPERT_UP_GRAD, split_x)
        add(Op.REDUCE_SCATTER, "y", g_y * r.gathered_max * feat * elem, "backward", Term.MOE_ROWS_Y_GRAD, p.gather_y)
        add(Op.ALL_TO_ALL, p.ep_axis, r.received * (feat * elem + GATE_BYTES), "backward", Term.MOE_DISPATCH_GRAD)
    add(Op.ALL_TO_ALL, "x", mine * model.hidden * elem, "backward", Term.MOE_ROWS_X_GRAD, p.rows_over_x)
    add(Op.ALL_GATHER, "y", g_y * most * h_x * elem, "backward", Term.MOE_ROWS_Y)
    return out


def output_moves(model: ModelConfig, shape: GridShape, layout: ExpertLayout | str | None = None) -> int:
    """How many of ``layer_collectives``' forward collectives follow the layer's last tensor saved
    for backward (its gated sum's): the sums moved back to features over x (where the rows moved)
    and gathered over y — its last forward ones. A fully recomputed block's re-run stops before
    them: torch's checkpoint stops re-running a forward once the last tensor it saved is rebuilt."""
    p = placement(model, shape, layout)
    return int(shape.x > 1 and p.rows_over_x) + int(shape.y > 1)


#: the MoE all-to-alls whose payload is what the rank sends of its own share, the same under any
#: routing: their busiest peer still receives ``imbalance`` times its mean share
OWN_SHARE_TERMS = frozenset({Term.MOE_DISPATCH, Term.MOE_COMBINE_GRAD})


def all_to_all_seconds(machine: Machine, shape: GridShape, c: Collective, imbalance: float) -> float:
    """Seconds of one all-to-all over ``c.axis`` (batch) of ``c.payload_bytes`` sent by this rank
    (E16), as ``Machine.comm_time`` prices it: the machine's measured all-to-all curve of the axis'
    geometry where calibration wrote one, else a pairwise exchange on its levels
    (``collective_model.all_to_all_time``). A payload the rank sends of its own share
    (``OWN_SHARE_TERMS``) waits for its busiest peer: priced at ``imbalance`` times the mean."""
    payload = c.payload_bytes * (imbalance if c.term in OWN_SHARE_TERMS else 1.0)
    world = shape.world_size
    group, stride = group_geometry(shape, c.axis, machine.devices_per_node)
    return machine.comm_time(Op.ALL_TO_ALL.value, group, stride, payload, world)


def host_sync_seconds(machine: Machine) -> float:
    """Seconds an MoE layer's counts exchange (E15) idles the rank while the host reads the counts:
    on an accelerator the machine's measured ``host_sync_s``, else the assumption ``HOST_SYNC_S``;
    0 on the host, whose ranks compute synchronously (nothing is queued to drain)."""
    if not machine.accelerator:
        return 0.0
    return HOST_SYNC_S if machine.host_sync_s is None else machine.host_sync_s


@dataclasses.dataclass(frozen=True)
class MoESeconds:
    """Compute seconds of one MoE layer's forward and backward on one rank (its collectives apart)."""

    fwd: float
    bwd: float
    matmul: float  # of which GEMMs (router and experts, forward and backward)
    experts_fwd: float = 0.0  # of which the experts' GEMMs and activation, forward
    experts_bwd: float = 0.0  # ... and backward
    rerun: float = 0.0  # the forward again under full recomputation (``layer_seconds``)


def pack_passes(rows: float, features: int, elem: int, fused: bool) -> tuple[float, int]:
    """(bytes, kernels) of ``fp8_rows.pack`` of ``rows`` rows of ``features`` ``elem``-byte values, as
    the code runs it: eager (the host's path and the fallback) the blocks' largest and smallest
    values read the rows twice, the division reads them and writes fp32, the clamp reads and writes
    that, the cast reads it and writes e4m3, and the e4m3 bytes are copied into the packed rows —
    3·elem + 19 bytes per element — in 11 kernels with the scales' own (12 from 16 bits: the
    scales widened to fp32); fused (an accelerator's,
    ``axon4d.device.fp8_fused.quantise_rows``) the amax and one pass read the rows and write e4m3,
    then the copy: 2·elem + 3, in 4 kernels. The scales (4 bytes per 128 values) are left out."""
    if fused:
        return rows * features * (2 * elem + 3), 4
    return rows * features * (3 * elem + 19), 11 + (elem != 4)


def unpack_passes(rows: float, features: int, elem: int) -> tuple[float, int]:
    """(bytes, kernels) of ``fp8_rows.unpack`` of ``rows`` packed rows of ``features`` into the
    compute dtype: the e4m3 bytes read and the rows written, then read and written again by the
    product with the scales (1 + 3·elem bytes per element), in 3 kernels with the scales' copy."""
    return rows * features * (1 + 3 * elem), 3


def layer_seconds(
    model: ModelConfig,
    tokens: int,
    shape: GridShape,
    machine: Machine,
    dtype: str,
    elem: int,
    imbalance: float,
    layout: ExpertLayout | str | None = None,
) -> MoESeconds:
    """One MoE layer on one rank: the router's fp32 GEMM (T × h × E; dX and dW in backward), the
    scores, top-k and gates over (T, E), the grouped GEMMs of the E_l local experts on the rows the
    rank computes (ρ·k times its share's tokens, every y-neighbour's where y splits the experts),
    up h → ups·f/G_y, down f/G_y → h with h and f as the layout splits them; dX and dW each in
    backward, the weight gradient scaled by 1/G_batch where no replica reduction does it), the
    activation, the row copies of the dispatch (index selects, sorts, the gathered rows' unpadding,
    the moves over x) and the gated sum, each op's launch overhead (``FORWARD_OPS``,
    ``BACKWARD_OPS``), and on an accelerator the host sync of E15. Under FP8 dispatch, in forward
    and again in backward, the share's rows packed and the received rows unpacked (``pack_passes``,
    ``unpack_passes``; the fused cast on an accelerator, the eager one on the host). ``rerun``: the
    forward again under full recomputation, which where the rows are exchanged makes no host sync,
    selects and packs no rows and makes no gated sum (``axon4d.nn.moe``)."""
    world = shape.world_size
    p = placement(model, shape, layout)
    k, e_count, h = model.experts_per_token, model.n_experts, p.hidden_x
    ups = 2 if model.gated else 1
    mm, ew = machine.matmul_time, machine.elementwise_time
    share = first_share(tokens, shape, p.rows_over_x)
    rows = imbalance * k * (tokens if p.gather_y else share)  # rows this rank's experts compute
    per = max(int(math.ceil(rows / p.local)), 0)  # rows per local expert
    h_router = model.hidden // shape.x
    router_f = mm("nt", tokens, h_router, e_count, "float32", world)
    router_b = mm("nn", tokens, e_count, h_router, "float32", world) + mm(
        "tn", e_count, tokens, h_router, "float32", world
    )
    up_f = p.local * mm("nt", per, h, ups * p.ffn_y, dtype, world)
    down_f = p.local * mm("nt", per, p.ffn_y, h, dtype, world)
    up_b = p.local * (mm("nn", per, ups * p.ffn_y, h, dtype, world) + mm("tn", ups * p.ffn_y, per, h, dtype, world))
    down_b = p.local * (mm("nn", per, h, p.ffn_y, dtype, world) + mm("tn", h, per, p.ffn_y, dtype, world))
    act_f, act_b = machine.activation_time(rows * p.ffn_y * ups, world)
    scores = ew(8 * tokens * e_count * 4, world)  # softmax/sigmoid, top-k, gates, the balance loss' means
    # rows selected for the dispatch, sorted, unsorted, unpadded; one local expert's rows are neither
    # sorted nor unsorted, only made contiguous where they arrive as a column slice (not gathered over y)
    moved = (share * k + (3 if p.local > 1 else 2 if not p.gather_y else 1) * rows) * h * elem
    if p.rows_over_x:  # the share's rows to every feature and back, each a copy on either side
        moved += 2 * share * model.hidden * elem
    combine = ew(3 * share * k * h * elem, world)  # gates · outputs summed per token
    scaled = shape.size("batch") > 1 and p.dp_axis is None  # the replicas' reduction divides, where there is one
    scale = ew(2 * p.local * (ups + 1) * p.ffn_y * h * elem, world) if scaled else 0.0
    fwd = router_f + scores + up_f + down_f + act_f + ew(2 * moved, world) + combine + host_sync_seconds(machine)
    fwd += FORWARD_OPS * machine.op_overhead_s
    bwd = router_b + scores + up_b + down_b + act_b + ew(2 * moved, world) + 2 * combine + scale
    bwd += BACKWARD_OPS * machine.op_overhead_s
    # the re-run of a fully recomputed forward, where the rows are exchanged: no host sync (the
    # routing is the forward's), no rows selected or packed (the dispatched payload is the forward's,
    # unpacked again), no gated sum (it stops before the combines)
    exchanged = p.ep_axis is not None and shape.size(p.ep_axis) > 1
    skipped = host_sync_seconds(machine) + (ew(2 * share * k * h * elem, world) + combine if exchanged else 0.0)
    rerun = fwd - skipped
    if p.fp8_dispatch:  # each way: the share's rows packed here, the experts' received rows unpacked there
        packed, pack_k = pack_passes(share * k, h, elem, machine.accelerator)
        unpacked, unpack_k = unpack_passes(rows / shape.y if p.gather_y else rows, h, elem)
        cast = ew(packed + unpacked, world) + (pack_k + unpack_k) * machine.op_overhead_s  # kernels: one chunk's
        fwd, bwd = fwd + cast, bwd + cast
        rerun += ew(unpacked, world) + unpack_k * machine.op_overhead_s
    return MoESeconds(
        fwd,
        bwd,
        router_f + router_b + up_f + down_f + up_b + down_b,
        up_f + down_f + act_f,
        up_b + down_b + act_b,
        rerun,
    )


def chunks_hidden(a2a_fwd: float, a2a_bwd: float, moe: MoESeconds, chunks: int, efficiency: float) -> float:
    """Seconds of one MoE layer's all-to-alls (``a2a_fwd``, ``a2a_bwd``: its dispatches and combines
    in forward and in backward) that its chunked exchange hides (``axon4d.nn.moe_dispatch.Exchange``):
    with C chunks every dispatch is issued before the first chunk's GEMMs and each is waited for
    just before its own, each combine behind the next chunks' GEMMs, and backward mirrors it — all
    but one chunk's exchanges (C − 1 of C) run behind the other C − 1 chunks' expert GEMMs, at most
    as long as those GEMMs, at the machine's overlap ``efficiency``. Nothing in one chunk."""
    if chunks < 2:
        return 0.0
    share = (chunks - 1) / chunks
    return efficiency * (min(share * a2a_fwd, share * moe.experts_fwd) + min(share * a2a_bwd, share * moe.experts_bwd))


def active_matmul_params(model: ModelConfig) -> int:
    """Matmul parameters one token passes through in a block's MoE layer: the router (E·hidden), its
    k routed experts and the shared experts (ups·hidden·f + f·hidden each) — the active path of
    MFU (the experts a token does not reach do no work for it)."""
    per_expert = ((2 if model.gated else 1) + 1) * model.hidden * model.expert_width
    return model.n_experts * model.hidden + (model.experts_per_token + model.shared_experts) * per_expert


def param_counts(model: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of ``model``: ``ModelConfig.n_params`` and the parameters one
    token uses — the total less the routed experts it does not reach."""
    per_expert = ((2 if model.gated else 1) + 1) * model.hidden * model.expert_width
    total = model.n_params()
    idle = model.moe_layers * (model.n_experts - model.experts_per_token) * per_expert if model.moe else 0
    return total, total - idle
