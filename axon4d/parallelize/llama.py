"""Parallelize styles for Hugging Face's Llama (``LlamaAttention``, ``LlamaMLP``, ``LlamaForCausalLM``): which
linear layers become normal or transposed 3D layers (docs/design.md §2) so that the code between
them needs no feature gathers. Tested against transformers' Llama, GQA and tied embeddings
included (docs/parallelize.md).
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.parallelize.layers import norms_fit, sharded_norm_builder
from axon4d.parallelize.styles import (
    NORMAL_SPLIT,
    TRANSPOSED_GATHERED,
    TRANSPOSED_SPLIT,
    BlockStyle,
    StyleFn,
    require_heads,
    sharded_edges,
    slice_hidden_states_hook,
)


def attention_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle:
    """q, k, v normal with output split over y (whole heads; GQA needs kv heads to divide too), o transposed."""
    cfg = cast(Any, m).config  # Hugging Face's LlamaAttention: duck-typed, its attributes are unknown to mypy
    require_heads(name, "num_attention_heads", cfg.num_attention_heads, grid)
    require_heads(name, "num_key_value_heads", cfg.num_key_value_heads, grid)
    return BlockStyle(
        {"q_proj": NORMAL_SPLIT, "k_proj": NORMAL_SPLIT, "v_proj": NORMAL_SPLIT, "o_proj": TRANSPOSED_GATHERED},
        pre_hooks={"": slice_hidden_states_hook(grid)},
    )


def mlp_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle:
    """gate and up normal with output split over y; the SiLU product is elementwise; down transposed."""
    return BlockStyle(
        {"gate_proj": NORMAL_SPLIT, "up_proj": NORMAL_SPLIT, "down_proj": TRANSPOSED_GATHERED},
        pre_hooks={"": slice_hidden_states_hook(grid)},
    )


def sharded_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle | None:
    """LlamaForCausalLM with its residual stream split over x (norms on sharded features).

    Every block chains with no feature gather: input norm (RMSNorm over x) → q, k, v normal →
    this rank's heads → o transposed (output stays split over x) → residual add → norm → gate, up
    normal → down transposed. Edges: ``sharded_edges``.
    """
    # Hugging Face's LlamaForCausalLM and LlamaModel (checked by class name): duck-typed, their attributes
    # are unknown to mypy
    hf = cast(Any, m)
    body: Any = getattr(m, "model", None)
    if type(body).__name__ != "LlamaModel" or not isinstance(getattr(m, "lm_head", None), nn.Linear):
        return None
    norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if not all(type(layer).__name__ == "LlamaDecoderLayer" for layer in body.layers) or not norms_fit(norms):
        return None  # not the structure this style was written for
    cfg = hf.config
    require_heads(name, "num_attention_heads", cfg.num_attention_heads, grid)
    require_heads(name, "num_key_value_heads", cfg.num_key_value_heads, grid)
    if cfg.hidden_size % grid.size("x"):
        return None  # the chained styles still apply block by block
    norm = sharded_norm_builder(grid)
    style = BlockStyle({}, replace={"model.norm": norm})
    for i in range(len(body.layers)):
        p = f"model.layers.{i}"
        style.linears.update({f"{p}.self_attn.{c}": NORMAL_SPLIT for c in ("q_proj", "k_proj", "v_proj")})
        style.linears.update({f"{p}.mlp.{c}": NORMAL_SPLIT for c in ("gate_proj", "up_proj")})
        style.linears.update({f"{p}.self_attn.o_proj": TRANSPOSED_SPLIT, f"{p}.mlp.down_proj": TRANSPOSED_SPLIT})
        style.replace.update({f"{p}.input_layernorm": norm, f"{p}.post_attention_layernorm": norm})
    sharded_edges(style, grid, "model.embed_tokens", body.embed_tokens, "lm_head", hf.lm_head)
    return style


#: class name → its block style under "chained" (attention and MLP blocks)
CHAINED_STYLES: dict[str, StyleFn] = {"LlamaAttention": attention_style, "LlamaMLP": mlp_style}

#: class name → its whole-model style under "sharded" (residual stream split over x)
SHARDED_STYLES: dict[str, StyleFn] = {"LlamaForCausalLM": sharded_style}
