"""The inverse of ``auto_parallelize``: ``to_dense(model)``, an unparallelized copy with full weights
(docs/parallelize.md), which the families' own modules use for their parts too.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.parallelize.styles import HOOK_MARK, RESTORE_ATTR

#: attribute set on a parameter whose gradient hook averages it over batch (set once per parameter)
REPLICATED_MARK = "_axon4d_replicated"


def to_dense(model: nn.Module, grads: bool = False) -> nn.Module:
    """An unparallelized copy of ``model`` with full weights (and ``.grad`` if ``grads``), on every rank.

    Every submodule with a ``to_dense(grads=...)`` method (``ShardedLinear``, ``axon4d.Linear``
    and the library's other sharded modules) is replaced by its result, gathering over the axes it
    is split on; everything else is copied. Hooks and attribute changes made by
    ``auto_parallelize`` are undone in the copy. Every rank must call it (it communicates).
    """
    own_to_dense = getattr(model, "to_dense", None)  # duck-typed: any module with a to_dense(grads=...) method
    if callable(own_to_dense):
        return own_to_dense(grads=grads)
    memo: dict[int, Any] = {}

    def convert(parent: nn.Module) -> None:  # children in a fixed order, the same on every rank
        grid = getattr(parent, "grid", None)
        if isinstance(grid, Grid):
            memo[id(grid)] = grid  # shared, never copied
        for child in parent.children():
            if id(child) in memo:
                continue
            child_to_dense = getattr(child, "to_dense", None)
            if callable(child_to_dense):
                memo[id(child)] = child_to_dense(grads=grads)
            else:
                convert(child)

    convert(model)
    dense = copy.deepcopy(model, memo)
    for m in dense.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, fn in hooks.items() if getattr(fn, HOOK_MARK, False)]:
                del hooks[key]
                for extra in (
                    m._forward_pre_hooks_with_kwargs,
                    m._forward_hooks_with_kwargs,
                    m._forward_hooks_always_called,
                ):
                    extra.pop(key, None)
        for k, v in m.__dict__.pop(RESTORE_ATTR, {}).items():
            setattr(m, k, v)
    originals = dict(model.named_parameters())
    for name, p in dense.named_parameters():
        p.__dict__.pop(REPLICATED_MARK, None)
        if grads and p.grad is None and name in originals:
            original_grad = originals[name].grad
            if original_grad is not None:
                p.grad = original_grad.detach().clone()
    return dense
