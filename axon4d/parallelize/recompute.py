"""Activation recomputation for a parallelized Hugging Face model (docs/design.md §5), with the
meanings of axon4d.nn.recompute, applied through the model's own mechanisms:

- ``full``: every decoder layer (transformers' ``GradientCheckpointingLayer``) recomputes its
  forward through axon4d's ``recompute_block`` (non-reentrant, the grid's scheduler told), so only
  the layer's input is kept; the layer re-runs, collectives included, in backward. Active while the
  model is in training mode, as transformers' own gradient checkpointing is.
- ``selective``: core attention runs through an attention function registered with transformers'
  ``AttentionInterface`` that wraps the model's own (sdpa, eager, …) in ``recomputed``: q, k, v are
  kept, scores, softmax and the weighted sum re-run in backward.
- ``balanced``: the sharded norms (``ShardedNorm``) keep their statistics, and the activation
  function's output is not kept: whoever saves either output saves a recipe instead
  (``Recipes``), re-run inside that consumer's backward. Where the model multiplies the
  activation by another tensor in its own code (Llama's SwiGLU), that product is kept.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.nn.linear import Linear
from axon4d.nn.recompute import Recipes, recompute_block, recomputed
from axon4d.options.recompute_mode import Recompute, check_recompute
from axon4d.parallelize.layers import ShardedNorm
from axon4d.parallelize.styles import RESTORE_ATTR, marked

#: prefix of the attention functions registered for selective recomputation
SELECTIVE_PREFIX = "axon4d_selective:"


def apply(model: nn.Module, mode: str, grid: Grid) -> None:
    """Make ``model`` (already parallelized on ``grid``) recompute activations under ``mode``."""
    mode = check_recompute(mode)
    if mode == Recompute.FULL:
        _recompute_layers(model, grid)
    elif mode == Recompute.SELECTIVE:
        _selective_attention(model)
    elif mode == Recompute.BALANCED:
        _balanced(model)


def _layers_of(module: nn.Module) -> list[Linear]:
    """The 3D layers in ``module``: the ``ShardedLinear``s' and those of the library's own modules (MLA's)."""
    return [m for m in module.modules() if isinstance(m, Linear)]


def _recompute_layers(model: nn.Module, grid: Grid) -> None:
    layers = [m for m in model.modules() if hasattr(type(m), "gradient_checkpointing") and _layers_of(m)]
    if not layers:
        raise ValueError(
            f"recompute='full' needs decoder layers that support gradient checkpointing (transformers' "
            f"GradientCheckpointingLayer); {type(model).__name__} has none with 3D layers in them"
        )
    for layer in layers:
        own = _layers_of(layer)

        def run(fn: Callable[..., Any], *args: Any, _own: list[Linear] = own) -> Any:
            return recompute_block(fn, *args, scheduler=grid.scheduler, layers=_own)

        hf = cast(Any, layer)  # transformers' GradientCheckpointingLayer: its attributes are unknown to mypy
        _restore_in_dense_copy(layer, "gradient_checkpointing", hf.gradient_checkpointing)
        hf.gradient_checkpointing = True
        hf._gradient_checkpointing_func = run


def _selective_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface  # optional dependency: only Hugging Face models get here
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    base = getattr(config, "_attn_implementation", None)
    if config is None or base is None:
        raise ValueError(
            f"recompute='selective' on a model that is not a Hugging Face model ({type(model).__name__} has no "
            "config._attn_implementation); use 'full' or 'none'"
        )
    if base.startswith(SELECTIVE_PREFIX):
        return
    interface = AttentionInterface()
    inner = interface[base] if base in interface else None
    if inner is None and base != "eager":
        raise ValueError(f"recompute='selective': attention implementation {base!r} is not registered")

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        fn = inner if inner is not None else _eager(module)
        out = recomputed(lambda q, k, v, m: fn(module, q, k, v, m, **kwargs)[0], query, key, value, attention_mask)
        return out, None

    name = SELECTIVE_PREFIX + base
    AttentionInterface.register(name, attention)
    masks = AttentionMaskInterface()
    if base in masks:  # the model builds the mask its own implementation takes (eager: the additive causal mask)
        AttentionMaskInterface.register(name, masks[base])
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == base:
            cfg._attn_implementation = name


def _eager(module: nn.Module) -> Callable[..., Any]:
    """The eager attention function of ``module``'s modeling file (transformers keeps one per model)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"recompute='selective': {type(module).__name__} has no eager attention function")
    return cast(Callable[..., Any], fn)


class _RecomputedActivation(nn.Module):
    """An activation function whose output is saved as a recipe by whoever consumes it."""

    def __init__(self, act: nn.Module, recipes: Recipes):
        super().__init__()
        self.act, self.recipes = act, recipes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recipes.keep(recomputed(self.act, x), self.act, x)


def _balanced(model: nn.Module) -> None:
    recipes = Recipes()
    norms = [m for m in model.modules() if isinstance(m, ShardedNorm)]
    if not norms:
        raise ValueError(
            "recompute='balanced' needs the sharded style (auto_parallelize(..., style='sharded')): its norms "
            "run on split features and keep only their statistics"
        )
    for norm in norms:
        norm.recipes = recipes
    for m in list(model.modules()):
        for attr in ("act_fn", "act"):  # Llama's MLP, GPT-2's MLP
            act = getattr(m, attr, None)
            if isinstance(act, nn.Module) and not isinstance(act, _RecomputedActivation) and _layers_of(m):
                _restore_in_dense_copy(m, attr, act)
                setattr(m, attr, _RecomputedActivation(act, recipes))
    state: dict[str, Any] = {}

    def enter(module: nn.Module, args: Any) -> None:
        state["ctx"] = recipes.saving()
        state["ctx"].__enter__()

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        ctx = state.pop("ctx", None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    model.register_forward_pre_hook(marked(enter))
    model.register_forward_hook(marked(leave), always_call=True)


def _restore_in_dense_copy(module: nn.Module, attr: str, value: Any) -> None:
    """Have ``axon4d.to_dense``'s copy of ``module`` get ``attr`` back as ``value``."""
    module.__dict__.setdefault(RESTORE_ATTR, {}).setdefault(attr, value)
