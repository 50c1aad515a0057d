"""What a Mixture-of-Experts layer holds on one rank (docs/moe.md; docs/design.md §10): its
weights, what its forward keeps for backward and the peak of its backward — mirrored from
``axon4d.nn.moe`` (the planner may not import the layers) under ``axon4d.plan.moe_cost``'s routing
assumption (uniform routing; ``imbalance`` ρ: the busiest rank's rows, ρ·T·k).

Weights per layer: the router's (E, hidden/G_x) columns, replicated over y, z and data (averaged
over batch like a norm's); this rank's E_l = E/G_ep experts, each split over x·y — up
(ups·f/G_y, hidden/G_x), ups = 2 for a gated FFN, and down (hidden/G_x, f/G_y) — held by this rank
only: never sharded over z nor over data (ZeRO leaves them whole: a data rank's part of an expert
weight is all of it).

Saved for backward per layer (T tokens, h = hidden/G_x, n = ρ·T·k rows the experts compute,
``saved``): the rows sorted by expert (n·h, the up GEMM's input), the up output (n·ups·f/G_y; a
gated FFN's silu(gate) too, n·f/G_y), the activation (n·f/G_y, the down GEMM's input), the
gathered outputs (T·k·h) and the gates (T·k) of the gated sum, in the compute dtype; the router's
fp32 scores (T·E; the logits too with a z-loss), gates and their sums; the int64 orders of the
dispatch (the share's T·k/G_y assignments twice, the n gathered rows twice) and the chosen experts
(T·k). Under mixed precision also the router input widened to fp32 (T·h) and the experts' weights
cast to the compute dtype for the GEMMs (kept to their backward).
"""

from __future__ import annotations

from axon4d.config import ModelConfig
from axon4d.grid.shape import GridShape
from axon4d.plan.moe_cost import placement


def layer_tensors(model: ModelConfig, shape: GridShape) -> tuple[int, int, int]:
    """Elements of one MoE layer's (router weight, experts' up, experts' down) on one rank."""
    p = placement(model, shape)
    ups = 2 if model.gated else 1
    return model.n_experts * p.hidden_x, p.local * ups * p.ffn_y * p.hidden_x, p.local * p.hidden_x * p.ffn_y


def param_tensors(model: ModelConfig, shape: GridShape) -> list[int]:
    """Elements of every MoE parameter tensor one rank holds (router, up, down per layer; none
    without MoE)."""
    return list(layer_tensors(model, shape)) * model.n_layers if model.moe else []


def expert_elements(model: ModelConfig, shape: GridShape) -> int:
    """Expert weight elements on one rank, every layer's: never sharded over data (module docstring)."""
    if not model.moe:
        return 0
    _, up, down = layer_tensors(model, shape)
    return model.n_layers * (up + down)


def saved(
    model: ModelConfig, tokens: int, shape: GridShape, elem: int, mixed: bool, imbalance: float = 1.0
) -> list[tuple[float, int]]:
    """(elements, bytes per element) of each tensor one MoE layer keeps for backward on one rank
    (module docstring)."""
    p = placement(model, shape)
    k, e_count, h = model.experts_per_token, model.n_experts, p.hidden_x
    ups = 2 if model.gated else 1
    n = imbalance * tokens * k
    most = -(-tokens // shape.y)  # the largest y share's tokens
    t = [
        (n * h, elem),  # rows sorted by expert: the up GEMM's input
        (n * ups * p.ffn_y, elem),  # the up output (a gated FFN's [gate | up])
        (n * p.ffn_y if model.gated else 0, elem),  # silu(gate)
        (n * p.ffn_y, elem),  # the activation: the down GEMM's input
        (most * k * h, elem),  # this y share's outputs, the gated sum's (gated before the gather over y)
        (most * k if elem != 4 else 0, elem),  # this share's gates cast to the outputs' dtype
        (tokens * e_count * (2 if model.moe_z_coef else 1), 4),  # scores (and the z-loss' logits)
        (tokens * (k + 1), 4),  # the chosen scores and their sums
        (tokens * k + 2 * tokens * k / shape.y + 2 * n, 8),  # chosen experts, the dispatch's orders
    ]
    if mixed:
        t.append((tokens * h, 4))  # the router's input widened to fp32
        t.append((p.local * (ups + 1) * p.ffn_y * h, elem))  # the experts' weights cast for the GEMMs
    return [(c, b) for c, b in t if c > 0]


def saved_bytes(model: ModelConfig, tokens: int, shape: GridShape, elem: int, mixed: bool, imbalance: float) -> float:
    """Bytes one MoE layer keeps for backward on one rank (``saved`` summed)."""
    return sum(c * b for c, b in saved(model, tokens, shape, elem, mixed, imbalance))


def backward_transient(model: ModelConfig, tokens: int, shape: GridShape, elem: int, imbalance: float) -> float:
    """Bytes live only during one MoE layer's backward at its peak, on one rank, beside what it
    saved (which its backward frees as it goes): the share's outputs' gradient (T_j·k·h, T_j the
    largest y share), the rows' gradient through down (n·h), the up output's gradient (n·ups·f/G_y)
    and one activation-sized gradient more (n·f/G_y), in the compute dtype — sized against torch's memory tracker on a
    (1,1,2,1) grid (tests/test_plan_moe.py), where counting every gradient the experts' backward
    makes (SwiGLU's two products and the all-reduce's copy too) priced the step's peak 7% high."""
    p = placement(model, shape)
    ups = 2 if model.gated else 1
    n = imbalance * tokens * model.experts_per_token
    most = -(-tokens // shape.y)
    return elem * (most * model.experts_per_token * p.hidden_x + n * p.hidden_x + n * (ups + 1) * p.ffn_y)


def grad_elements(model: ModelConfig, shape: GridShape) -> int:
    """Gradient elements one MoE layer's backward leaves on one rank (router, experts' up and down)."""
    return sum(layer_tensors(model, shape))
