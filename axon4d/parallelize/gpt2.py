"""Plans for Hugging Face's GPT-2 (``GPT2Attention``, ``GPT2MLP``, ``GPT2LMHeadModel``): which
linear layers (``Conv1D``, weight stored (in, out)) become normal or transposed 3D layers
(docs/design.md §2) so that the code between them needs no feature gathers. ``c_attn`` packs
q|k|v, so its output rows are permuted to give each y rank whole heads of all three. Tested
against transformers' GPT-2 with its tied head (docs/parallelize.md).
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from axon4d.grid import Grid
from axon4d.parallelize.layers import norms_fit, sharded_norm_builder
from axon4d.parallelize.plan import (
    NORMAL_SPLIT,
    TRANSPOSED_GATHERED,
    TRANSPOSED_SPLIT,
    BlockPlan,
    PlanFn,
    Spec,
    require_heads,
    sharded_edges,
    slice_hidden_states_hook,
    slice_output_hook,
)
from axon4d.rectangles import FusedRows


def attention_specs(name: str, m: nn.Module, grid: Grid, last: Spec) -> tuple[dict[str, Spec], dict[str, Any]] | None:
    """Specs and attribute patch of a GPT-2 self-attention (None for cross-attention).

    c_attn packs q|k|v, so its rows are permuted to give rank y [q, k, v] of its own heads, and the
    module's ``split_size`` becomes hidden/G_y so its ``split`` cuts the local chunk; c_proj is
    ``last`` (transposed)."""
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        return None  # cross-attention: general path
    attn = cast(Any, m)  # Hugging Face's GPT2Attention: duck-typed, its attributes are unknown to mypy
    require_heads(name, "num_heads", attn.num_heads, grid)
    h, g = attn.embed_dim, grid.size("y")
    fused = FusedRows((("q", h), ("k", h), ("v", h)), g)
    specs = {"c_attn": Spec(input_sharded=True, output_sharded=True, fused=fused), "c_proj": last}
    return specs, {"split_size": h // g}


def plan_attention(name: str, m: nn.Module, grid: Grid) -> BlockPlan | None:
    """Chained GPT-2 attention (see ``attention_specs``)."""
    found = attention_specs(name, m, grid, TRANSPOSED_GATHERED)
    if found is None:
        return None
    return BlockPlan(found[0], patch={"": found[1]}, pre_hooks={"": slice_hidden_states_hook(grid)})


def plan_mlp(name: str, m: nn.Module, grid: Grid) -> BlockPlan:
    """c_fc normal with output split over y; GELU is elementwise; c_proj transposed."""
    return BlockPlan(
        {"c_fc": NORMAL_SPLIT, "c_proj": TRANSPOSED_GATHERED}, pre_hooks={"": slice_hidden_states_hook(grid)}
    )


def plan_sharded(name: str, m: nn.Module, grid: Grid) -> BlockPlan | None:
    """GPT2LMHeadModel with its residual stream split over x: LayerNorms over x, attention as in
    ``attention_specs`` and the MLP chained, c_proj outputs kept split over x, learned positions
    whole with their output sliced over x. Edges: ``sharded_edges``."""
    # Hugging Face's GPT2LMHeadModel and GPT2Model (checked by class name): duck-typed, their attributes
    # are unknown to mypy
    hf = cast(Any, m)
    body: Any = getattr(m, "transformer", None)
    if type(body).__name__ != "GPT2Model" or not isinstance(getattr(m, "lm_head", None), nn.Linear):
        return None
    norms = [body.ln_f] + [n for block in body.h for n in (block.ln_1, block.ln_2)]
    if (
        not all(type(block).__name__ == "GPT2Block" for block in body.h)
        or not norms_fit(norms)
        or any(hasattr(block, "crossattention") for block in body.h)
    ):
        return None
    if hf.config.hidden_size % grid.size("x"):
        return None
    norm = sharded_norm_builder(grid)
    plan = BlockPlan({}, replace={"transformer.ln_f": norm})
    for i, block in enumerate(body.h):
        p = f"transformer.h.{i}"
        found = attention_specs(f"{p}.attn", block.attn, grid, TRANSPOSED_SPLIT)
        if found is None:
            return None
        plan.specs.update({f"{p}.attn.{c}": spec for c, spec in found[0].items()})
        plan.patch[f"{p}.attn"] = found[1]
        plan.specs.update({f"{p}.mlp.c_fc": NORMAL_SPLIT, f"{p}.mlp.c_proj": TRANSPOSED_SPLIT})
        plan.replace.update({f"{p}.ln_1": norm, f"{p}.ln_2": norm})
    plan.post_hooks["transformer.wpe"] = slice_output_hook(grid)
    sharded_edges(plan, grid, "transformer.wte", body.wte, "lm_head", hf.lm_head)
    return plan


#: class name → plan of the "chained" layout (attention and MLP blocks)
CHAINED_PLANS: dict[str, PlanFn] = {"GPT2Attention": plan_attention, "GPT2MLP": plan_mlp}

#: class name → plan of the "sharded" layout (the whole model, residual stream split over x)
SHARDED_PLANS: dict[str, PlanFn] = {"GPT2LMHeadModel": plan_sharded}
