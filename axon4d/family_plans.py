"""Family plans for ``axon4d.auto_parallelize``: how the linear layers of known model families are
split so that the code between them needs no feature gathers (docs/design.md §2, E2–E7).

A plan is a function ``(name, module, grid) -> BlockPlan | None`` that reads sizes only (no
collective, the same on every rank) and says, for one block or one whole model: which linear
layers become which 3D layer (``Spec``: normal or transposed, input/output kept split), which
modules are replaced by sharded ones (norms, embeddings), which attributes are patched and which
forward hooks are installed. ``FAMILY_PLANS`` chains attention and MLP blocks ("chained" layout);
``SHARDED_PLANS`` keeps a whole model's residual stream split over x ("sharded" layout). A plan
returns None when a module is not the structure it was written for; ``auto_parallelize`` then
falls back to the next layout. Tested against transformers' Llama and GPT-2 (docs/parallelize.md).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from axon4d.grid import Grid
from axon4d.shape import factorizations, suggest
from axon4d.nn.functional import gather_replicated, split_replicated

#: attribute marking a forward pre-hook installed by a plan (``to_dense`` strips them from its copy)
HOOK_MARK = "__axon4d_hook__"


@dataclasses.dataclass
class Spec:
    """How one linear layer is replaced."""

    transpose: bool = False
    input_sharded: bool = False
    output_sharded: bool = False
    out_perm: torch.Tensor | None = None


Hook = Callable[..., Any]


@dataclasses.dataclass
class BlockPlan:
    """A family plan's decisions for one block; names are relative to the block ('' = the block)."""

    specs: dict[str, Spec]
    """linear layers and how each is replaced"""
    patch: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """module → {attribute: new value} to change (``to_dense`` restores the old values)"""
    replace: dict[str, Callable[[nn.Module], nn.Module]] = dataclasses.field(default_factory=dict)
    """other modules (norms, embeddings) and the builder of each one's sharded replacement"""
    pre_hooks: dict[str, Hook] = dataclasses.field(default_factory=dict)
    """forward pre-hooks (with kwargs) to install"""
    post_hooks: dict[str, Hook] = dataclasses.field(default_factory=dict)
    """forward hooks to install"""


def _marked(hook: Hook) -> Hook:
    """Mark ``hook`` as installed by auto_parallelize, so ``to_dense`` removes it from its copy."""
    setattr(hook, HOOK_MARK, True)
    return hook


def _slice_hidden_states_hook(grid: Grid) -> Callable[..., Any]:
    """A forward pre-hook slicing a block's ``hidden_states`` (first argument) over x, once."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            args = (split_replicated(args[0], "x", grid), *args[1:])
        else:
            kwargs = dict(kwargs, hidden_states=split_replicated(kwargs["hidden_states"], "x", grid))
        return args, kwargs

    return _marked(hook)


def _require_heads(name: str, what: str, heads: int, grid: Grid) -> None:
    """Attention runs on this rank's heads: ``heads`` must divide by G_y (chained layout)."""
    g = grid.size("y")
    if heads % g == 0:
        return
    ok = [s for s in factorizations(grid.world_size) if heads % s.y == 0]
    raise ValueError(
        f"{name or 'the model'}: {what} = {heads} is not divisible by G_y = {g} on grid {grid.shape} "
        f"(this layout splits attention heads over y); use layout='general', or "
        + suggest(grid.world_size, ok, near=grid.shape)
    )


def _plan_llama_attention(name: str, m: nn.Module, grid: Grid) -> BlockPlan:
    """q, k, v normal with output split over y (whole heads; GQA needs kv heads to divide too), o transposed."""
    cfg = m.config
    _require_heads(name, "num_attention_heads", cfg.num_attention_heads, grid)
    _require_heads(name, "num_key_value_heads", cfg.num_key_value_heads, grid)
    qkv = Spec(input_sharded=True, output_sharded=True)
    o = Spec(transpose=True, input_sharded=True)
    return BlockPlan({"q_proj": qkv, "k_proj": qkv, "v_proj": qkv, "o_proj": o},
                      pre_hooks={"": _slice_hidden_states_hook(grid)})


def _plan_llama_mlp(name: str, m: nn.Module, grid: Grid) -> BlockPlan:
    """gate and up normal with output split over y; the SiLU product is elementwise; down transposed."""
    up = Spec(input_sharded=True, output_sharded=True)
    return BlockPlan({"gate_proj": up, "up_proj": up, "down_proj": Spec(transpose=True, input_sharded=True)},
                      pre_hooks={"": _slice_hidden_states_hook(grid)})


def _plan_gpt2_mlp(name: str, m: nn.Module, grid: Grid) -> BlockPlan:
    """c_fc normal with output split over y; GELU is elementwise; c_proj transposed."""
    return BlockPlan({"c_fc": Spec(input_sharded=True, output_sharded=True),
                       "c_proj": Spec(transpose=True, input_sharded=True)},
                      pre_hooks={"": _slice_hidden_states_hook(grid)})


def _gpt2_attention(name: str, m: nn.Module, grid: Grid, last: Spec) -> tuple[dict[str, Spec], dict[str, Any]] | None:
    """Specs and attribute patch of a GPT-2 self-attention: c_attn packs q|k|v, so its rows are
    permuted to give rank y [q, k, v] of its own heads, and the module's ``split_size`` becomes
    hidden/G_y so its ``split`` cuts the local chunk; c_proj is ``last`` (transposed)."""
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        return None  # cross-attention: general path
    _require_heads(name, "num_heads", m.num_heads, grid)
    h, g = m.embed_dim, grid.size("y")
    local = h // g
    perm = torch.cat([torch.arange(y * local, (y + 1) * local) + j * h for y in range(g) for j in range(3)])
    specs = {"c_attn": Spec(input_sharded=True, output_sharded=True, out_perm=perm), "c_proj": last}
    return specs, {"split_size": local}


def _plan_gpt2_attention(name: str, m: nn.Module, grid: Grid) -> BlockPlan | None:
    """Chained GPT-2 attention (see ``_gpt2_attention``)."""
    found = _gpt2_attention(name, m, grid, Spec(transpose=True, input_sharded=True))
    if found is None:
        return None
    return BlockPlan(found[0], patch={"": found[1]}, pre_hooks={"": _slice_hidden_states_hook(grid)})


class ShardedNorm(nn.Module):
    """A sharded norm of the library (features split over x) standing in for a model's own norm class;
    ``to_dense`` gives back that class with the full weight."""

    def __init__(self, inner: nn.Module, original: nn.Module):
        super().__init__()
        self.inner = inner
        self._original = [original]  # a template for to_dense, deliberately not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # (..., hidden/G_x) → (..., hidden/G_x)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        full = self.inner.to_dense(grads=grads)
        dense = copy.deepcopy(self._original[0])
        for name, p in dense.named_parameters():
            src = full.get_parameter(name)
            p.copy_(src)
            p.grad = src.grad.clone() if grads and src.grad is not None else None
        return dense


def _sharded_norm(grid: Grid) -> Callable[[nn.Module], nn.Module]:
    """Builder of a ``ShardedNorm`` (features over x) for a Llama RMSNorm or a ``torch.nn.LayerNorm``."""
    from axon4d.nn.norm import LayerNorm, RMSNorm

    def build(n: nn.Module) -> nn.Module:
        w = n.weight
        if isinstance(n, nn.LayerNorm):
            inner: nn.Module = LayerNorm(w.shape[0], eps=n.eps, bias=n.bias is not None, grid=grid,
                                         device=w.device, dtype=w.dtype)
        else:
            inner = RMSNorm(w.shape[0], eps=n.variance_epsilon, grid=grid, device=w.device, dtype=w.dtype)
        return ShardedNorm(inner.load_dense_(n), n)

    return build


def _norms_fit(norms: list[nn.Module]) -> bool:
    """Whether ``_sharded_norm`` can replace every one of ``norms`` exactly."""
    return all(type(n).__name__ == "LlamaRMSNorm" or (isinstance(n, nn.LayerNorm) and n.elementwise_affine
                                                       and len(n.normalized_shape) == 1) for n in norms)


def _sharded_edges(plan: BlockPlan, grid: Grid, emb_name: str, emb: nn.Embedding, head_name: str,
                   head: nn.Linear) -> None:
    """The model's edges in the sharded layout: token embedding and output head.

    The embedding becomes vocabulary-parallel (``VocabParallelEmbedding``: output split over x)
    when it is a plain lookup that the grid divides and is not tied to the head; otherwise it stays
    whole and its output is sliced over x. An untied head is a normal layer taking the x-split
    input and gathering the logits over y; a tied one stays whole and gathers its input over x.
    """
    from axon4d.nn.embedding import VocabParallelEmbedding

    def vocab_parallel(e: nn.Module) -> nn.Module:
        inner = VocabParallelEmbedding(e.num_embeddings, e.embedding_dim, grid=grid,
                                       device=e.weight.device, dtype=e.weight.dtype)
        return inner.load_dense_(e.weight.detach())

    def gather_input(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (gather_replicated(args[0], "x", grid), *args[1:]), kwargs

    tied = head.weight is emb.weight
    plain = emb.padding_idx is None and emb.max_norm is None and not emb.sparse and not emb.scale_grad_by_freq
    if tied or not plain or emb.num_embeddings % grid.size("y"):
        plan.post_hooks[emb_name] = _slice_output_hook(grid)
    else:
        plan.replace[emb_name] = vocab_parallel
    if tied:
        plan.pre_hooks[head_name] = _marked(gather_input)
    else:
        plan.specs[head_name] = Spec(input_sharded=True)


def _slice_output_hook(grid: Grid) -> Hook:
    """A forward hook slicing a module's output features over x."""
    return _marked(lambda mod, args, out: split_replicated(out, "x", grid))


_MID = Spec(input_sharded=True, output_sharded=True)  # normal: x-split in, y-split out
_LAST = Spec(transpose=True, input_sharded=True, output_sharded=True)  # transposed: y-split in, x-split out


def _plan_llama_sharded(name: str, m: nn.Module, grid: Grid) -> BlockPlan | None:
    """LlamaForCausalLM with its residual stream split over x (norms on sharded features).

    Every block chains with no feature gather: input norm (RMSNorm over x) → q, k, v normal →
    this rank's heads → o transposed (output stays split over x) → residual add → norm → gate, up
    normal → down transposed. Edges: ``_sharded_edges``.
    """
    body = getattr(m, "model", None)
    if type(body).__name__ != "LlamaModel" or not isinstance(getattr(m, "lm_head", None), nn.Linear):
        return None
    norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if not all(type(layer).__name__ == "LlamaDecoderLayer" for layer in body.layers) or not _norms_fit(norms):
        return None  # not the structure this plan was written for
    cfg = m.config
    _require_heads(name, "num_attention_heads", cfg.num_attention_heads, grid)
    _require_heads(name, "num_key_value_heads", cfg.num_key_value_heads, grid)
    if cfg.hidden_size % grid.size("x"):
        return None  # the chained plans still apply block by block
    norm = _sharded_norm(grid)
    plan = BlockPlan({}, replace={"model.norm": norm})
    for i in range(len(body.layers)):
        p = f"model.layers.{i}"
        plan.specs.update({f"{p}.self_attn.{c}": _MID for c in ("q_proj", "k_proj", "v_proj")})
        plan.specs.update({f"{p}.mlp.{c}": _MID for c in ("gate_proj", "up_proj")})
        plan.specs.update({f"{p}.self_attn.o_proj": _LAST, f"{p}.mlp.down_proj": _LAST})
        plan.replace.update({f"{p}.input_layernorm": norm, f"{p}.post_attention_layernorm": norm})
    _sharded_edges(plan, grid, "model.embed_tokens", body.embed_tokens, "lm_head", m.lm_head)
    return plan


def _plan_gpt2_sharded(name: str, m: nn.Module, grid: Grid) -> BlockPlan | None:
    """GPT2LMHeadModel with its residual stream split over x: LayerNorms over x, attention as in
    ``_gpt2_attention`` and the MLP chained, c_proj outputs kept split over x, learned positions
    whole with their output sliced over x. Edges: ``_sharded_edges``."""
    body = getattr(m, "transformer", None)
    if type(body).__name__ != "GPT2Model" or not isinstance(getattr(m, "lm_head", None), nn.Linear):
        return None
    norms = [body.ln_f] + [n for block in body.h for n in (block.ln_1, block.ln_2)]
    if not all(type(block).__name__ == "GPT2Block" for block in body.h) or not _norms_fit(norms) or any(
        hasattr(block, "crossattention") for block in body.h
    ):
        return None
    if m.config.hidden_size % grid.size("x"):
        return None
    norm = _sharded_norm(grid)
    plan = BlockPlan({}, replace={"transformer.ln_f": norm})
    for i, block in enumerate(body.h):
        p = f"transformer.h.{i}"
        found = _gpt2_attention(f"{p}.attn", block.attn, grid, _LAST)
        if found is None:
            return None
        plan.specs.update({f"{p}.attn.{c}": spec for c, spec in found[0].items()})
        plan.patch[f"{p}.attn"] = found[1]
        plan.specs.update({f"{p}.mlp.c_fc": _MID, f"{p}.mlp.c_proj": _LAST})
        plan.replace.update({f"{p}.ln_1": norm, f"{p}.ln_2": norm})
    plan.post_hooks["transformer.wpe"] = _slice_output_hook(grid)
    _sharded_edges(plan, grid, "transformer.wte", body.wte, "lm_head", m.lm_head)
    return plan


#: class name → plan of the "sharded" layout (the residual stream split over x)
SHARDED_PLANS: dict[str, Callable[[str, nn.Module, Grid], BlockPlan | None]] = {
    "LlamaForCausalLM": _plan_llama_sharded,
    "GPT2LMHeadModel": _plan_gpt2_sharded,
}


#: class name → plan for blocks whose forward code is known (tested: see docs/parallelize.md)
FAMILY_PLANS: dict[str, Callable[[str, nn.Module, Grid], BlockPlan | None]] = {
    "LlamaAttention": _plan_llama_attention,
    "LlamaMLP": _plan_llama_mlp,
    "GPT2Attention": _plan_gpt2_attention,
    "GPT2MLP": _plan_gpt2_mlp,
}
