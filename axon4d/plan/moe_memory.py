"""What a Mixture-of-Experts layer holds on one rank (docs/moe.md; docs/design.md §10): its
weights, what its forward keeps for backward and the peak of its backward — mirrored from
``axon4d.nn.moe`` (the planner may not import the layers) under ``axon4d.plan.moe_cost``'s routing
assumption (uniform routing; ``imbalance`` ρ: the busiest rank's rows) and the layer's expert
layout (``axon4d.grid.expert_layout``; None: the default).

Weights per layer: the router's (E, hidden/G_x) columns, replicated over y, z and data (averaged
over batch like a norm's); this rank's E_l = E/G_ep experts, each split as the layout splits them
— up (ups·f/G_ty, hidden/G_tx), ups = 2 for a gated FFN, and down (hidden/G_tx, f/G_ty), G_tx and
G_ty the x and y sizes where they split the experts, else 1. Held by one data rank (data among
the expert-parallel axes), ZeRO leaves them whole; replicated over data, ZeRO shards them (and in
mixed precision stores them in 16 bits: ``persistent.sixteen_bit_weights``).

Saved for backward per layer (T tokens, h the features of a dispatched row — hidden/G_x where x
splits the experts, else hidden —, n = the rows the experts compute: ρ·k times the rank's share of
tokens, every y-neighbour's where y splits the experts; ``saved``): the rows sorted by expert (n·h,
the up GEMM's input), the up output (n·ups·f/G_ty; a gated FFN's silu(gate) too, n·f/G_ty), the
activation (n·f/G_ty, the down GEMM's input), the share's gathered outputs (T_share·k·h) and gates
(T_share·k) of the gated sum, in the compute dtype; the router's fp32 scores (T·E; the logits too
with a z-loss), gates and their sums; the int64 orders of the dispatch (the share's assignments
twice, the n gathered rows twice) and the chosen experts (T·k). Under mixed precision also the
router input widened to fp32 (T·hidden/G_x) and the experts' weights cast to the compute dtype
for the GEMMs (kept to their backward).
"""

from __future__ import annotations

import dataclasses

from axon4d.config import ModelConfig
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape
from axon4d.options import fp8_rows
from axon4d.plan.moe_cost import GATE_BYTES
from axon4d.plan.moe_placement import first_share, placement

Layout = ExpertLayout | str | None


def layer_tensors(model: ModelConfig, shape: GridShape, layout: Layout = None) -> tuple[int, int, int]:
    """Elements of one MoE layer's (router weight, experts' up, experts' down) on one rank."""
    p = placement(model, shape, layout)
    ups = 2 if model.gated else 1
    router = model.n_experts * (model.hidden // shape.x)
    return router, p.local * ups * p.ffn_y * p.hidden_x, p.local * p.hidden_x * p.ffn_y


def param_tensors(model: ModelConfig, shape: GridShape, layout: Layout = None) -> list[int]:
    """Elements of every MoE parameter tensor one rank holds (router, up, down per MoE layer; none
    without MoE)."""
    return list(layer_tensors(model, shape, layout)) * model.moe_layers if model.moe else []


def expert_elements(model: ModelConfig, shape: GridShape, layout: Layout = None) -> int:
    """Expert weight elements on one rank, every MoE layer's."""
    if not model.moe:
        return 0
    _, up, down = layer_tensors(model, shape, layout)
    return model.moe_layers * (up + down)


def experts_whole_under_zero(layout: Layout) -> bool:
    """Whether ZeRO leaves the experts' weights whole on the rank that holds them: where the layout
    holds no replicas over data (its part of an expert weight is all of it); replicated over data,
    they are sharded like any replicated parameter (``axon4d.zero``)."""
    return "data" not in ExpertLayout.parse(layout).dp


def computed_rows(model: ModelConfig, tokens: int, shape: GridShape, imbalance: float, layout: Layout) -> float:
    """Rows one rank's experts compute (``moe_cost.layer_seconds``): ρ·k times its share's tokens,
    every y-neighbour's where y splits the experts."""
    p = placement(model, shape, layout)
    return imbalance * model.experts_per_token * (tokens if p.gather_y else first_share(tokens, shape, p.rows_over_x))


def saved(
    model: ModelConfig,
    tokens: int,
    shape: GridShape,
    elem: int,
    mixed: bool,
    imbalance: float = 1.0,
    layout: Layout = None,
) -> list[tuple[float, int]]:
    """(elements, bytes per element) of each tensor one MoE layer keeps for backward on one rank
    (module docstring)."""
    p = placement(model, shape, layout)
    k, e_count, h = model.experts_per_token, model.n_experts, p.hidden_x
    ups = 2 if model.gated else 1
    n = computed_rows(model, tokens, shape, imbalance, layout)
    most = first_share(tokens, shape, p.rows_over_x)  # the largest share's tokens
    received = n / shape.y if p.gather_y else n  # rows this rank's experts received, before E17
    t = [
        (n * h, elem),  # rows sorted by expert: the up GEMM's input
        (n * ups * p.ffn_y, elem),  # the up output (a gated FFN's [gate | up])
        (n * p.ffn_y if model.gated else 0, elem),  # silu(gate)
        (n * p.ffn_y, elem),  # the activation: the down GEMM's input
        (received * h, elem),  # the experts' outputs of the rows this rank received, gated here
        (received if elem != 4 else 0, elem),  # their gates cast to the outputs' dtype
        (tokens * e_count * (2 if model.moe_z_coef else 1), 4),  # scores (and the z-loss' logits)
        (tokens * (k + 1), 4),  # the chosen scores and their sums
        (tokens * k + 2 * most * k + (2 * n if p.local > 1 else 0), 8),  # chosen experts, the orders
    ]
    if mixed:
        t.append((tokens * (model.hidden // shape.x), 4))  # the router's input widened to fp32
        t.append((p.local * (ups + 1) * p.ffn_y * h, elem))  # the experts' weights cast for the GEMMs
    return [(c, b) for c, b in t if c > 0]


def kept_rows(
    model: ModelConfig, tokens: int, shape: GridShape, elem: int, imbalance: float = 1.0, layout: Layout = None
) -> tuple[float, int]:
    """(rows, bytes per row) one MoE layer's forward keeps for its re-run under full recomputation:
    what its dispatches delivered — the rows this rank's experts received (before E17), each as it
    travelled (F values in the compute dtype, or packed in e4m3 with its scales under FP8 dispatch)
    with its gate's bytes (``axon4d.nn.moe``; ``moe_cost.GATE_BYTES``); none where no axis exchanges
    the rows (the re-run selects them again)."""
    p = placement(model, shape, layout)
    if p.ep_axis is None or shape.size(p.ep_axis) == 1:
        return 0.0, 0
    n = computed_rows(model, tokens, shape, imbalance, layout)
    received = n / shape.y if p.gather_y else n
    row = fp8_rows.packed_width(p.hidden_x) if p.fp8_dispatch else p.hidden_x * elem
    return received, row + GATE_BYTES


def saved_bytes(
    model: ModelConfig, tokens: int, shape: GridShape, elem: int, mixed: bool, imbalance: float, layout: Layout = None
) -> float:
    """Bytes one MoE layer keeps for backward on one rank (``saved`` summed)."""
    return sum(c * b for c, b in saved(model, tokens, shape, elem, mixed, imbalance, layout))


@dataclasses.dataclass(frozen=True)
class BackwardPhases:
    """Bytes of one MoE layer's backward on one rank, in the compute dtype unless said, in the
    order autograd runs it (it runs a node's backward after those of every node made later in the
    forward: the gated sum, made after the shared experts, comes first; the experts, made before
    them, after the shared experts' backward — ``axon4d.nn.moe``):

    - ``gated_sum``: live beside everything saved during the gated sum's backward (``MulBackward``
      of pairs·gates): the pairs' gradient (T_j·k·h) and grad·pairs (T_j·k·h), summed into the
      gates' gradient (T_j·k);
    - ``handed_on``: the change of live bytes from there through the shared experts' backward:
      the pairs (T_j·k·h) and the gates' cast (T_j·k, 16-bit only) freed, the rows' gradient
      (``back``'s, T_j·k·h: ``IndexSelectBackward``'s result) held — and where an axis exchanges
      the rows, the reverse all-to-all's receive buffer (the rows this rank's experts received)
      on the wire;
    - ``experts``: live beside what is live at the experts' backward's start, at its peak — the
      most of the outputs' index_select backward (its zeros and their index_add'ed copy, n·h
      each, where the rank holds several experts: one expert's rows are never sorted) and the
      rows gathered over y where y splits the experts (the reduce-scatter's backward), the down
      GEMM's backward (the outputs' gradient n·h, the activation's n·f and
      down's dW, in the gradients' dtype) and the activation's backward (SwiGLU's d(silu(gate))
      and d(up), GELU's d(h): n·f each, the activation's gradient n·f, down's dW; the incoming
      rows' gradient and the saved activation freed); the later GEMM's and dispatch's backward
      hold less (the up output, silu(gate) and activation freed first). In ``chunks`` c > 1
      (``moe_placement.moe_chunks``: the share dispatched in overlapped chunks, each chunk's GEMMs
      taking the experts' weights again), autograd runs the later chunks' backward first and
      keeps each weight's dW of them to add the next chunk's to, out of place; at the first
      chunk's up GEMM's backward, the last one, live are down's dW summed (D, as the walk keeps
      a gradient), up's dW of the later chunks, the first chunk's and their sum (3U, in the
      compute dtype: the GEMM's, ``w.to(x.dtype)``), the chunk's up output's gradient
      (n/c·ups·f) and its rows' gradient (n/c·h) beside its saved rows (n/c·h) — every other
      row tensor saved (the later chunks' and the chunk's up output, silu(gate) and activation)
      and the incoming rows' gradient freed.
    """

    gated_sum: float
    handed_on: float
    experts: float


def backward_phases(
    model: ModelConfig,
    tokens: int,
    shape: GridShape,
    elem: int,
    grad_bytes: float,
    imbalance: float = 1.0,
    layout: Layout = None,
    chunks: int = 1,
) -> BackwardPhases:
    """``BackwardPhases`` of one MoE layer on one rank (T_j the largest share's tokens, h the
    features of a dispatched row, n the rows the experts compute: ``saved``; ``grad_bytes``: a
    weight gradient's bytes per element as the walk keeps it; ``chunks``: the share's forward
    chunks)."""
    p = placement(model, shape, layout)
    k, h, f = model.experts_per_token, p.hidden_x, p.ffn_y
    n = computed_rows(model, tokens, shape, imbalance, layout)
    pairs = first_share(tokens, shape, p.rows_over_x) * k  # T_j·k: the share's assignments
    gated_sum = elem * (2 * pairs * h + pairs)
    received = n / shape.y if p.gather_y else n  # rows this rank's experts received, before E17
    exchanged = p.ep_axis is not None and shape.size(p.ep_axis) > 1
    incoming = elem * (pairs * h + (received * h if exchanged else 0.0))  # consumed first by the experts' backward
    cast = pairs if elem != 4 else 0
    handed_on = incoming - elem * (pairs * h + cast)
    down = p.local * p.hidden_x * p.ffn_y * grad_bytes  # down's dW
    # the outputs' unsort (one local expert: none) and the rows gathered over y
    index_select = elem * n * h * ((2 if p.local > 1 else 0) + (1 if p.gather_y else 0))
    down_gemm = -incoming + elem * (n * h + n * f) + down
    activation = -incoming + elem * (n * f * (2 if model.gated else 1)) + down  # − the saved activation + its gradient
    phases = [index_select, down_gemm, activation]
    if chunks > 1:  # the first chunk's up GEMM's backward, its dW summed into the later chunks'
        ups = 2 if model.gated else 1
        up = p.local * ups * p.ffn_y * p.hidden_x  # up's dW elements
        rows_saved = n * (h + ups * f + (f if model.gated else 0) + f)  # sorted rows, up output, silu(gate), activation
        first = n / chunks  # the first chunk's rows
        phases.append(-incoming - elem * rows_saved + elem * first * (2 * h + ups * f) + down + 3 * up * elem)
    return BackwardPhases(gated_sum, handed_on, max(phases))


def forward_held(
    model: ModelConfig,
    tokens: int,
    shape: GridShape,
    elem: int,
    chunks: int,
    imbalance: float = 1.0,
    layout: Layout = None,
) -> tuple[float, float]:
    """Bytes one MoE layer's forward holds on one rank beside what it saved, in the compute dtype,
    (where a fully recomputed re-run stops, at the gated sum): the forward's locals keep to its
    return the rows each chunk dispatched (``dispatches``: T_j·k·h in all; an exchange's payload),
    the gated rows sent back (``combines``: the rows its experts received, n/G_y where y splits
    them, else n) and, where an axis exchanges the rows, the rows received back (T_j·k·h; with more
    than one chunk also their cat, ``back``) and the shared experts' output (T·hidden/G_x; the
    residual's layout). A fully recomputed re-run stops at its last saved tensor, before the
    combines (``torch.utils.checkpoint`` stops once it is re-made), its dispatches adopting the
    payload the forward kept: the rows selected where nothing is exchanged, the gated rows, and —
    made by the backward before it needed the re-run — the gated sum's input gradient (T_j·k·h)
    and, where the rows are exchanged, the combines' reverse exchanges' receive buffers (the gated
    rows' gradient). The first forward goes on to the gated sum: the rows taken in token order
    (T_j·k·h) and their sum (T_j·h), with the rest."""
    p = placement(model, shape, layout)
    k, h = model.experts_per_token, p.hidden_x
    n = computed_rows(model, tokens, shape, imbalance, layout)
    most = first_share(tokens, shape, p.rows_over_x)
    exchanged = p.ep_axis is not None and shape.size(p.ep_axis) > 1
    sent_back = n / shape.y if p.gather_y else n
    back = most * k * ((1 if exchanged else 0) + (1 if exchanged and chunks > 1 else 0))
    shared = tokens * (model.hidden // shape.x) if model.shared_experts else 0
    # the re-run: the rows selected where nothing is exchanged (an exchange's payload is the kept
    # one), the gated rows, the gated sum's gradient and, exchanged, its reverse exchanges' receive buffers
    selected = 0 if exchanged else most * k * h
    rerun = elem * (selected + sent_back * h + most * k * h + (sent_back * h if exchanged else 0))
    first = elem * (most * k * h + sent_back * h + back * h + shared)
    return rerun, first + elem * (most * k * h + most * h)


def grad_elements(model: ModelConfig, shape: GridShape, layout: Layout = None) -> int:
    """Gradient elements one MoE layer's backward leaves on one rank (router, experts' up and down)."""
    return sum(layer_tensors(model, shape, layout))
