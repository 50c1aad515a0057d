"""Where an MoE layer's experts sit on a grid and which rows each rank moves and computes, as the
planner prices them (docs/moe.md, "Placement and expert layouts"; docs/design.md §10): the
runtime's ``GridExperts``, ``MoE`` and ``moe_routes`` mirrored, not imported (the planner's pricing
may not import the layers). T tokens per rank, k experts per token, f an expert's FFN width, and the
layer's expert layout (``axon4d.grid.expert_layout``): G_ep ranks of its expert-parallel axes hold
E_l = E/G_ep experts each, split over its tensor-parallel axes (hidden over x: h = hidden/G_x, or
whole; f over y, or whole) and replicated over the rest. y index j dispatches the j-th contiguous
share of the T tokens — cut again over x, the rows moved from features to rows, where x does not
split the experts — each share in C chunks (the overlap policy's forward chunking of a share's
tokens of k rows, ``moe_chunks``).

**The routing assumption.** How many rows a rank receives depends on where the router sends the
tokens. The planner assumes *uniform routing*: every (source rank, y share, chunk) sends the same
number of rows to every expert, so a rank receives T_j·k rows per share j — what it sends — and
computes T·k rows, T·k·G_ep/E per local expert. ``Workload.imbalance`` = ρ ≥ 1 prices the busiest
rank instead: it receives, gathers and computes ρ times the mean (its GEMMs, the expert all-reduces,
E17, the combine and the dispatch's gradient), and every all-to-all waits for its largest peer,
ρ times the mean share (``moe_cost.all_to_all_seconds``). What a rank *sends* in the dispatch (and
the combine's gradient) is its own T_j·k rows whatever the routing: those bytes are exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from axon4d.config import ModelConfig
from axon4d.grid import rules
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape, axis_of
from axon4d.options.overlap_policy import OverlapPolicy


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an MoE layer's experts live on a grid under an expert layout (docs/moe.md, "Placement
    and expert layouts"): the runtime's ``GridExperts`` and ``MoE`` mirrored, axes of one rank left out."""

    layout: str  # the expert layout, as text (``ExpertLayout.__str__``)
    experts: int  # E, routed experts per layer
    ep: int  # G_ep, the expert-parallel size
    local: int  # E/G_ep experts per rank
    hidden_x: int  # each expert's hidden features per rank (hidden/G_x where x splits experts, else hidden)
    ffn_y: int  # each expert's FFN width per rank (f/G_y where y splits experts, else f)
    shared_y: int  # the shared experts' MLP width per rank (shared·f/G_y; 0: none)
    replicas: int  # G_dp, copies of each expert block (their gradients reduced over dp)
    ep_axis: str | None  # the all-to-alls' axis (None: every rank holds every expert)
    dp_axis: str | None  # the replicas' axis (None: none)
    count_axis: str | None  # the counts exchange's gather axis (E15)
    total_axis: (
        str | None
    )  # ... and the axis it sums the micro-batch's counts over (None: the gather's counts hold them)
    rows_over_x: bool  # the shares are cut over x and their rows moved from features to rows over x
    gather_y: bool  # y splits the experts: the rows are gathered over y at the experts (E17)
    fp8_dispatch: bool = False  # rows travel to the experts in e4m3, a scale per 128 features (``fp8_rows``)

    def describe(self) -> str:
        """One line: the layout, where the experts are, how each is split, and the replicas."""
        split = f"each {self.hidden_x} × {self.ffn_y} per rank"
        over = f"over {self.ep_axis} (G_ep = {self.ep})" if self.ep_axis else "on every rank"
        replicas = f"; replicated over {self.dp_axis} ({self.replicas})" if self.dp_axis else ""
        shared = f"; shared experts' MLP {self.shared_y} wide per rank" if self.shared_y else ""
        fp8 = "; rows sent to the experts in FP8 (e4m3, a scale per 128 features)" if self.fp8_dispatch else ""
        return f"{self.layout}: {self.experts} experts {over}, {self.local} per rank, {split}{replicas}{shared}{fp8}"

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def placement(model: ModelConfig, shape: GridShape, layout: ExpertLayout | str | None = None) -> Placement:
    """The expert placement ``shape`` and ``layout`` (None: the default, experts over batch, each
    split over x·y) give ``model`` — the runtime's ``GridExperts`` and ``MoE``: axes of one rank
    split nothing and name no group."""
    return _placement(model, shape, ExpertLayout.parse(layout))


@functools.lru_cache(maxsize=4096)
def _placement(model: ModelConfig, shape: GridShape, lay: ExpertLayout) -> Placement:
    """``placement`` of a parsed layout (cached: the search asks for the same few a million times)."""
    f = model.expert_width
    ep, dp = lay.ep_axes(shape), lay.dp_axes(shape)
    g_ep = math.prod(shape.size(a) for a in ep)
    return Placement(
        str(lay),
        model.n_experts,
        g_ep,
        model.n_experts // g_ep,
        model.hidden // (shape.x if lay.splits("x") else 1),
        f // (shape.y if lay.splits("y") else 1),
        model.shared_experts * f // shape.y,
        math.prod(shape.size(a) for a in dp),
        axis_of(ep),
        axis_of(dp),
        axis_of(lay.count_axes(shape)),
        axis_of(lay.summed_axes(shape)),
        lay.rows_over_x(shape),
        lay.gathers_y(shape),
        lay.fp8_dispatches(shape),
    )


def moe_rules(model: ModelConfig, layout: ExpertLayout | None = None) -> list[rules.Rule]:
    """The placement's divisibility rules under ``layout`` (the default: experts over data·z, each
    split over x·y) — ``axon4d.grid.expert_layout``'s, which the runtime checks too."""
    return ExpertLayout.parse(layout).rules(
        model.n_experts, model.expert_width, model.shared_experts * model.expert_width, model.hidden
    )


def shares(tokens: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` contiguous shares of ``tokens`` (``moe_routes.share_sizes``)."""
    base, extra = divmod(tokens, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def first_share(tokens: int, shape: GridShape, rows_over_x: bool) -> int:
    """Tokens of the largest share (y index 0; x index 0 where the shares are cut over x)."""
    share = shares(tokens, shape.y)[0]
    return shares(share, shape.x)[0] if rows_over_x else share


def moe_chunks(
    model: ModelConfig,
    tokens: int,
    shape: GridShape,
    elem: int,
    policy: OverlapPolicy,
    accel: bool,
    layout: ExpertLayout | str | None = None,
) -> int:
    """Chunks each share is dispatched in (``MoE._chunks``): the policy's forward chunking of the
    largest share's tokens of k rows of the dispatched features over G_ep ranks; one when no axis
    holds different experts."""
    p = placement(model, shape, layout)
    if p.ep_axis is None:
        return 1
    row_bytes = model.experts_per_token * p.hidden_x * elem
    return len(policy.chunk_sizes(max(first_share(tokens, shape, p.rows_over_x), 1), row_bytes, p.ep, accel))


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows of one chunk on one rank (y index 0, x index 0: the largest share) under the routing
    assumption: ``sent`` its share's assignments, ``received`` what the busiest rank gets back,
    ``gathered_max`` the largest y-neighbour's received rows (E17 pads to it; where y splits the
    experts) and ``computed`` the rows its expert GEMMs run (every y-neighbour's where y splits them)."""

    sent: int
    received: float
    gathered_max: float
    computed: float


def chunk_rows(
    model: ModelConfig, tokens: int, shape: GridShape, chunks: int, imbalance: float, p: Placement
) -> list[Rows]:
    """``Rows`` of each chunk (uniform routing times ``imbalance``; module docstring)."""
    k = model.experts_per_token
    own = [shares(t, shape.x)[0] if p.rows_over_x else t for t in shares(tokens, shape.y)]  # each y index's share
    per_share = [shares(t, chunks) for t in own]  # [j][c] tokens
    out = []
    for c in range(chunks):
        tok = [per_share[j][c] for j in range(len(own))] if p.gather_y else [per_share[0][c]]
        out.append(Rows(tok[0] * k, imbalance * tok[0] * k, imbalance * max(tok) * k, imbalance * sum(tok) * k))
    return out
