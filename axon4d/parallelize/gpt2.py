"""Parallelize styles for Hugging Face's GPT-2 (``GPT2Attention``, ``GPT2MLP``, ``GPT2LMHeadModel``): which
linear layers (``Conv1D``, weight stored (in, out)) become normal or transposed 3D layers
(docs/design.md §2) so that the code between them needs no feature gathers. ``c_attn`` packs
q|k|v, so its output rows are permuted to give each y rank whole heads of all three. Tested
against transformers' GPT-2 with its tied head (docs/parallelize.md).
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.layout.rectangles import FusedRows
from axon4d.parallelize.layers import norms_fit, sharded_norm_builder
from axon4d.parallelize.styles import (
    NORMAL_SPLIT,
    TRANSPOSED_GATHERED,
    TRANSPOSED_SPLIT,
    BlockStyle,
    LinearStyle,
    StyleFn,
    require_heads,
    sharded_edges,
    slice_hidden_states_hook,
    slice_output_hook,
)


def attention_linears(
    name: str, m: nn.Module, grid: Grid, last: LinearStyle
) -> tuple[dict[str, LinearStyle], dict[str, Any]] | None:
    """Linear styles and attribute patch of a GPT-2 self-attention (None for cross-attention).

    c_attn packs q|k|v, so its rows are permuted to give rank y [q, k, v] of its own heads, and the
    module's ``split_size`` becomes hidden/G_y so its ``split`` cuts the local chunk; c_proj is
    ``last`` (transposed)."""
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        return None  # cross-attention: general path
    attn = cast(Any, m)  # Hugging Face's GPT2Attention: duck-typed, its attributes are unknown to mypy
    require_heads(name, "num_heads", attn.num_heads, grid)
    h, g = attn.embed_dim, grid.size("y")
    fused = FusedRows((("q", h), ("k", h), ("v", h)), g)
    linears = {"c_attn": LinearStyle(input_sharded=True, output_sharded=True, fused=fused), "c_proj": last}
    return linears, {"split_size": h // g}


def attention_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle | None:
    """Chained GPT-2 attention (see ``attention_linears``)."""
    found = attention_linears(name, m, grid, TRANSPOSED_GATHERED)
    if found is None:
        return None
    return BlockStyle(found[0], patch={"": found[1]}, pre_hooks={"": slice_hidden_states_hook(grid)})


def mlp_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle:
    """c_fc normal with output split over y; GELU is elementwise; c_proj transposed."""
    return BlockStyle(
        {"c_fc": NORMAL_SPLIT, "c_proj": TRANSPOSED_GATHERED}, pre_hooks={"": slice_hidden_states_hook(grid)}
    )


def sharded_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle | None:
    """GPT2LMHeadModel with its residual stream split over x: LayerNorms over x, attention as in
    ``attention_linears`` and the MLP chained, c_proj outputs kept split over x, learned positions
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
    style = BlockStyle({}, replace={"transformer.ln_f": norm})
    for i, block in enumerate(body.h):
        p = f"transformer.h.{i}"
        found = attention_linears(f"{p}.attn", block.attn, grid, TRANSPOSED_SPLIT)
        if found is None:
            return None
        style.linears.update({f"{p}.attn.{c}": linear for c, linear in found[0].items()})
        style.patch[f"{p}.attn"] = found[1]
        style.linears.update({f"{p}.mlp.c_fc": NORMAL_SPLIT, f"{p}.mlp.c_proj": TRANSPOSED_SPLIT})
        style.replace.update({f"{p}.ln_1": norm, f"{p}.ln_2": norm})
    style.post_hooks["transformer.wpe"] = slice_output_hook(grid)
    sharded_edges(style, grid, "transformer.wte", body.wte, "lm_head", hf.lm_head)
    return style


#: class name → its block style under "chained" (attention and MLP blocks)
CHAINED_STYLES: dict[str, StyleFn] = {"GPT2Attention": attention_style, "GPT2MLP": mlp_style}

#: class name → its whole-model style under "sharded" (residual stream split over x)
SHARDED_STYLES: dict[str, StyleFn] = {"GPT2LMHeadModel": sharded_style}
