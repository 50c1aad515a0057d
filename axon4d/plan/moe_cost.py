"""A Mixture-of-Experts layer priced on one rank (docs/moe.md; docs/design.md §10, E14–E18): its
placement on the grid, the collectives it issues per step and their seconds, and its compute.

The runtime (``axon4d.nn.moe``, ``moe_dispatch``) is mirrored here, not imported (the planner's
pricing may not import the layers): T tokens per rank, h = hidden/G_x features, k experts per
token, f an expert's FFN width, G_ep = G_data·G_z (the expert-parallel axis is batch),
E_l = E/G_ep experts per rank; y index j dispatches the j-th contiguous share of the T tokens,
each share in C chunks (the overlap policy's forward chunking of T/G_y tokens of k rows,
``moe_chunks``).

**The routing assumption.** How many rows a rank receives depends on where the router sends the
tokens. The planner assumes *uniform routing*: every (source rank, y share, chunk) sends the same
number of rows to every expert, so a rank receives T_j·k rows per share j — what it sends — and
computes T·k rows, T·k·G_ep/E per local expert. ``Workload.imbalance`` = ρ ≥ 1 prices the busiest
rank instead: it receives, gathers and computes ρ times the mean (its GEMMs, the expert all-reduces,
E17, the combine and the dispatch's gradient), and every all-to-all waits for its largest peer,
ρ times the mean share (``all_to_all_seconds``). What a rank *sends* in the dispatch (and the
combine's gradient) is its own T_j·k rows whatever the routing: those bytes are exact.

The counts exchange (E15) is the layer's one host synchronisation: besides its all-gather, an
accelerator's stream drains while the host reads the counts, priced as the machine's
``host_sync_s`` where ``axon4d calibrate`` measured it, else ``HOST_SYNC_S`` (an assumption);
on the host the ranks compute synchronously and it costs nothing more (``host_sync_seconds``).
"""

from __future__ import annotations

import dataclasses
import math

from axon4d.config import ModelConfig
from axon4d.grid import rules
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Collective, Op, Term
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import Precision
from axon4d.plan.machine import Machine

#: seconds an accelerator idles at the counts exchange's host read (stream drained, counts copied to
#: the host, the next kernels launched): an assumption of the order of a device synchronisation, for
#: a machine file that gives no measured ``host_sync_s`` (the shipped GPU files)
HOST_SYNC_S = 50e-6
#: framework ops of one MoE layer's forward and backward besides its GEMMs (sorts, index selects,
#: scatters, concatenations, casts: counted in axon4d.nn.moe's forward and its autograd graph)
FORWARD_OPS, BACKWARD_OPS = 40, 50


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an MoE layer's experts live on a grid (docs/moe.md, "Placement")."""

    experts: int  # E, routed experts per layer
    ep: int  # G_ep = G_data·G_z, the expert-parallel size
    local: int  # E/G_ep experts per rank
    hidden_x: int  # each expert's hidden features per rank (hidden/G_x)
    ffn_y: int  # each expert's FFN width per rank (f/G_y)
    shared_y: int  # the shared experts' MLP width per rank (shared·f/G_y; 0: none)

    def describe(self) -> str:
        """One line: "E experts over batch (G_ep ranks): E_l per rank, each split hidden/G_x × f/G_y"."""
        shared = f"; shared experts' MLP {self.shared_y} wide per rank" if self.shared_y else ""
        return (
            f"{self.experts} experts over batch = data·z (G_ep = {self.ep}): {self.local} per rank, each split "
            f"over x·y as hidden {self.hidden_x} × ffn {self.ffn_y} per rank{shared}"
        )

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def placement(model: ModelConfig, shape: GridShape) -> Placement:
    """The expert placement ``shape`` gives ``model`` (the runtime's ``GridExperts``): experts over
    batch, each expert's FFN over x·y."""
    ep = shape.size("batch")
    f = model.expert_width
    return Placement(
        model.n_experts,
        ep,
        model.n_experts // ep,
        model.hidden // shape.x,
        f // shape.y,
        model.shared_experts * f // shape.y,
    )


def moe_rules(model: ModelConfig) -> list[rules.Rule]:
    """The placement's divisibility rules (the runtime's ``axon4d.nn.moe.placement_rules``): E over
    data·z, the expert width (and the shared experts' MLP width) over y, hidden over x."""
    return rules.moe_placement(
        model.n_experts, model.expert_width, model.shared_experts * model.expert_width, model.hidden
    )


def shares(tokens: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` contiguous shares of ``tokens`` (``moe_dispatch.share_sizes``)."""
    base, extra = divmod(tokens, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def moe_chunks(model: ModelConfig, tokens: int, shape: GridShape, elem: int, policy: OverlapPolicy, accel: bool) -> int:
    """Chunks each y share is dispatched in (``MoE._chunks``): the policy's forward chunking of
    T/G_y tokens of k·h·e bytes over G_ep ranks; one when G_ep = 1."""
    ep = shape.size("batch")
    if ep == 1:
        return 1
    row_bytes = model.experts_per_token * (model.hidden // shape.x) * elem
    return len(policy.chunk_sizes(max(tokens // shape.y, 1), row_bytes, ep, accel))


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows of one chunk on one rank (y index 0, the largest share) under the routing assumption:
    ``sent`` its share's assignments, ``received`` what the busiest rank gets back for its y index,
    ``gathered_max`` the largest y index's received rows (E17 pads to it) and ``computed`` all
    y indices' (the expert GEMMs' rows)."""

    sent: int
    received: float
    gathered_max: float
    computed: float


def chunk_rows(model: ModelConfig, tokens: int, g_y: int, chunks: int, imbalance: float) -> list[Rows]:
    """``Rows`` of each chunk (uniform routing times ``imbalance``; module docstring)."""
    k = model.experts_per_token
    per_share = [shares(t, chunks) for t in shares(tokens, g_y)]  # [j][c] tokens
    out = []
    for c in range(chunks):
        tok = [per_share[j][c] for j in range(g_y)]
        out.append(Rows(tok[0] * k, imbalance * tok[0] * k, imbalance * max(tok) * k, imbalance * sum(tok) * k))
    return out


def layer_collectives(
    model: ModelConfig, tokens: int, shape: GridShape, elem: int, chunks: int, imbalance: float = 1.0
) -> list[Collective]:
    """The collectives one MoE layer issues in one forward + backward on one rank (y index 0), in
    the order the runtime issues them, with the payloads the communication log records (bytes of
    the result; an all-to-all's: the bytes this rank sends, its own rows included). ``elem``: bytes
    of an activation element (the compute dtype). Axes of one rank issue nothing.

    Forward: E14 over x (T·E fp32 logits); E15 over batch (G_ep·G_y·C·E int64 counts); per chunk
    E16's dispatch over batch, E17's gather over y (padded to the largest share), the all-reduce
    over x after the experts' up GEMM (``sum_partials.x``), the reduce-scatter over y after their
    down GEMM (``moe.expert``: each y index keeps its own rows, padded blocks) and the combine over
    batch; the shares' gated sums gathered over y (T_j rows each, padded: the gates are applied
    before the gather). Backward: the gates' gradient gathered over y (T_j·k fp32 each, padded) and
    summed over x (T·k fp32); per chunk the combine's and dispatch's reverse
    all-to-alls, the outputs' gradient gathered over y, the up all-reduce's gradient over x and the
    gathered rows' partial gradients summed over y (E17); the shares' input gradient gathered over y."""
    g_x, g_y, ep = shape.x, shape.y, shape.size("batch")
    h, k, e_count = model.hidden // g_x, model.experts_per_token, model.n_experts
    up = (2 if model.gated else 1) * model.expert_width // g_y
    most = max(shares(tokens, g_y))
    rows = chunk_rows(model, tokens, g_y, chunks, imbalance)
    out: list[Collective] = []

    def add(op: Op, axis: str, nbytes: float, phase: str, term: Term) -> None:
        if shape.size(axis) > 1:
            out.append(Collective(op, axis, int(round(nbytes)), phase, term))

    add(Op.ALL_REDUCE, "x", tokens * e_count * 4, "forward", Term.MOE_ROUTER)
    add(Op.ALL_GATHER, "batch", ep * g_y * chunks * e_count * 8, "forward", Term.MOE_COUNTS)
    for r in rows:
        add(Op.ALL_TO_ALL, "batch", r.sent * h * elem, "forward", Term.MOE_DISPATCH)
        add(Op.ALL_GATHER, "y", g_y * r.gathered_max * h * elem, "forward", Term.MOE_ROWS_Y)
        add(Op.ALL_REDUCE, "x", r.computed * up * elem, "forward", Term.MOE_EXPERT_UP)
        add(Op.REDUCE_SCATTER, "y", g_y * r.gathered_max * h * elem, "forward", Term.MOE_EXPERT)
        add(Op.ALL_TO_ALL, "batch", r.received * h * elem, "forward", Term.MOE_COMBINE)
    add(Op.ALL_GATHER, "y", g_y * most * h * elem, "forward", Term.MOE_ROWS_Y)
    add(Op.ALL_GATHER, "y", g_y * most * k * 4, "backward", Term.MOE_ROUTER_GRAD)
    add(Op.ALL_REDUCE, "x", tokens * k * 4, "backward", Term.MOE_ROUTER_GRAD)
    for r in reversed(rows):
        add(Op.ALL_TO_ALL, "batch", r.sent * h * elem, "backward", Term.MOE_COMBINE_GRAD)
        add(Op.ALL_GATHER, "y", g_y * r.gathered_max * h * elem, "backward", Term.MOE_ROWS_Y)
        add(Op.ALL_REDUCE, "x", r.computed * up * elem, "backward", Term.MOE_EXPERT_UP_GRAD)
        add(Op.ALL_REDUCE, "y", r.computed * h * elem, "backward", Term.MOE_ROWS_Y_GRAD)
        add(Op.ALL_TO_ALL, "batch", r.received * h * elem, "backward", Term.MOE_DISPATCH_GRAD)
    add(Op.ALL_GATHER, "y", g_y * most * h * elem, "backward", Term.MOE_ROWS_Y)
    return out


def router_grad(model: ModelConfig, shape: GridShape, precision: Precision, param_bytes: int) -> Collective | None:
    """The router weight's gradient all-reduce over batch (E·hidden/G_x elements in the reduction
    dtype: fp32 under mixed precision, the parameters' own otherwise), once per step."""
    if shape.size("batch") == 1:
        return None
    elem = precision.reduce.itemsize if precision.mixed else param_bytes
    n = model.n_experts * (model.hidden // shape.x)
    return Collective(Op.ALL_REDUCE, "batch", n * elem, "backward", Term.MOE_ROUTER_WEIGHT_GRAD)


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
    return machine.comm_time(Op.ALL_TO_ALL.value, shape.size(c.axis), shape.stride(c.axis), payload, world)


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


def layer_seconds(
    model: ModelConfig, tokens: int, shape: GridShape, machine: Machine, dtype: str, elem: int, imbalance: float
) -> MoESeconds:
    """One MoE layer on one rank: the router's fp32 GEMM (T × h × E; dX and dW in backward), the
    scores, top-k and gates over (T, E), the grouped GEMMs of the E_l local experts on
    ρ·T·k·G_ep/E rows each (up h → ups·f/G_y, down f/G_y → h; dX and dW each in backward, the
    weight gradient scaled by 1/G_batch), the activation, the row copies of the dispatch (index
    selects, sorts, the gathered rows' unpadding) and the gated sum, each op's launch overhead
    (``FORWARD_OPS``, ``BACKWARD_OPS``), and on an accelerator the host sync of E15."""
    world = shape.world_size
    p = placement(model, shape)
    k, e_count, h = model.experts_per_token, model.n_experts, p.hidden_x
    ups = 2 if model.gated else 1
    mm, ew = machine.matmul_time, machine.elementwise_time
    rows = imbalance * tokens * k  # rows this rank's experts compute (uniform: T·k)
    per = max(int(math.ceil(rows / p.local)), 0)  # rows per local expert
    router_f = mm("nt", tokens, h, e_count, "float32", world)
    router_b = mm("nn", tokens, e_count, h, "float32", world) + mm("tn", e_count, tokens, h, "float32", world)
    up_f = p.local * mm("nt", per, h, ups * p.ffn_y, dtype, world)
    down_f = p.local * mm("nt", per, p.ffn_y, h, dtype, world)
    up_b = p.local * (mm("nn", per, ups * p.ffn_y, h, dtype, world) + mm("tn", ups * p.ffn_y, per, h, dtype, world))
    down_b = p.local * (mm("nn", per, h, p.ffn_y, dtype, world) + mm("tn", h, per, p.ffn_y, dtype, world))
    act_f, act_b = machine.activation_time(rows * p.ffn_y * ups, world)
    scores = ew(8 * tokens * e_count * 4, world)  # softmax/sigmoid, top-k, gates, the balance loss' means
    moved = (tokens * k + 3 * rows) * h * elem  # rows selected for the dispatch, sorted, unsorted, unpadded
    combine = ew(3 * tokens * k * h * elem, world)  # gates · outputs summed per token
    scale = ew(2 * p.local * (ups + 1) * p.ffn_y * h * elem, world) if shape.size("batch") > 1 else 0.0
    fwd = router_f + scores + up_f + down_f + act_f + ew(2 * moved, world) + combine + host_sync_seconds(machine)
    fwd += FORWARD_OPS * machine.op_overhead_s
    bwd = router_b + scores + up_b + down_b + act_b + ew(2 * moved, world) + 2 * combine + scale
    bwd += BACKWARD_OPS * machine.op_overhead_s
    return MoESeconds(fwd, bwd, router_f + router_b + up_f + down_f + up_b + down_b)


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
    idle = model.n_layers * (model.n_experts - model.experts_per_token) * per_expert if model.moe else 0
    return total, total - idle
