"""Parallelize styles: how ``auto_parallelize`` splits a model's layers, and the pieces the family
styles share (docs/design.md §2; the styles — sharded, chained, general — are described in
docs/parallelize.md).

A family style is a function ``(name, module, grid) -> BlockStyle | None`` that reads sizes only
(no collective, the same on every rank) and says, for one block or one whole model: which linear
layers become which 3D layer (``LinearStyle``: normal or transposed, input/output kept split),
which modules are replaced by sharded ones (norms, embeddings), which attributes are patched and
which forward hooks are installed. It returns None when a module is not the structure it was
written for; ``auto_parallelize`` then falls back to the next style.

Shared here: the linear styles of chained layers (``NORMAL_SPLIT``; ``TRANSPOSED_GATHERED``
closing a chained block, ``TRANSPOSED_SPLIT`` in the sharded style), the forward hooks that move a
block's input or a module's output between full and x-split features, the head count check, the
name test ``within``, and the model edges of the sharded style (``sharded_edges``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.grid.shape import factorizations, suggest
from axon4d.layout.rectangles import FusedRows
from axon4d.nn.embedding import VocabParallelEmbedding
from axon4d.nn.functional import gather_replicated, split_replicated

#: attribute marking a forward hook installed by a style (``to_dense`` strips them from its copy)
HOOK_MARK = "__axon4d_hook__"

#: attribute holding {name: original value} of module attributes a style changed (``to_dense`` restores them)
RESTORE_ATTR = "_axon4d_restore"


@dataclasses.dataclass(frozen=True)
class LinearStyle:
    """How one linear layer is replaced (``ShardedLinear``'s arguments); frozen, so the shared
    styles below cannot be changed through one block's style."""

    transpose: bool = False
    input_sharded: bool = False
    output_sharded: bool = False
    fused: FusedRows | None = None


#: normal layer of a chained pair: x-split input in, y-split output out
NORMAL_SPLIT = LinearStyle(input_sharded=True, output_sharded=True)
#: transposed layer of the sharded style: y-split input in, x-split output out (no gather)
TRANSPOSED_SPLIT = LinearStyle(transpose=True, input_sharded=True, output_sharded=True)
#: transposed layer closing a chained block: y-split input in, output gathered over x
TRANSPOSED_GATHERED = LinearStyle(transpose=True, input_sharded=True)

Hook = Callable[..., Any]


@dataclasses.dataclass
class BlockStyle:
    """A family style's decisions for one block; names are relative to the block ('' = the block)."""

    linears: dict[str, LinearStyle]
    """linear layers and how each is replaced"""
    patch: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """module → {attribute: new value} to change (``to_dense`` restores the old values)"""
    replace: dict[str, Callable[[nn.Module], nn.Module]] = dataclasses.field(default_factory=dict)
    """other modules (norms, embeddings) and the builder of each one's sharded replacement"""
    pre_hooks: dict[str, Hook] = dataclasses.field(default_factory=dict)
    """forward pre-hooks (with kwargs) to install"""
    post_hooks: dict[str, Hook] = dataclasses.field(default_factory=dict)
    """forward hooks to install"""


#: a family style: (module name, module, grid) → its block style, or None when the module is not its structure
StyleFn = Callable[[str, nn.Module, Grid], BlockStyle | None]


def within(name: str, prefixes: list[str]) -> bool:
    """Whether module ``name`` is one of ``prefixes`` or inside one ('' is the root)."""
    return any(p == "" or name == p or name.startswith(f"{p}.") for p in prefixes)


def marked(hook: Hook) -> Hook:
    """Mark ``hook`` as installed by auto_parallelize, so ``to_dense`` removes it from its copy."""
    setattr(hook, HOOK_MARK, True)
    return hook


def slice_hidden_states_hook(grid: Grid) -> Hook:
    """A forward pre-hook slicing a block's ``hidden_states`` (first argument) over x, once."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            args = (split_replicated(args[0], "x", grid), *args[1:])
        else:
            kwargs = dict(kwargs, hidden_states=split_replicated(kwargs["hidden_states"], "x", grid))
        return args, kwargs

    return marked(hook)


def slice_output_hook(grid: Grid) -> Hook:
    """A forward hook slicing a module's output features over x."""
    return marked(lambda mod, args, out: split_replicated(out, "x", grid))


def gather_input_hook(grid: Grid) -> Hook:
    """A forward pre-hook (with kwargs) gathering a module's first argument's features over x."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (gather_replicated(args[0], "x", grid), *args[1:]), kwargs

    return marked(hook)


def require_heads(name: str, what: str, heads: int, grid: Grid) -> None:
    """Attention runs on this rank's heads: ``heads`` must divide by G_y (chained style)."""
    g = grid.size("y")
    if heads % g == 0:
        return
    ok = [s for s in factorizations(grid.world_size) if heads % s.y == 0]
    raise ValueError(
        f"{name or 'the model'}: {what} = {heads} is not divisible by G_y = {g} on grid {grid.shape} "
        f"(this style splits attention heads over y); use style='general', or "
        + suggest(grid.world_size, ok, near=grid.shape)
    )


def sharded_edges(
    style: BlockStyle, grid: Grid, emb_name: str, emb: nn.Embedding, head_name: str, head: nn.Linear
) -> None:
    """Add the model's edges in the sharded style to ``style``: token embedding and output head.

    The embedding becomes vocabulary-parallel (``VocabParallelEmbedding``: output split over x)
    when it is a plain lookup that the grid divides and is not tied to the head; otherwise it stays
    whole and its output is sliced over x. An untied head is a normal layer taking the x-split
    input and gathering the logits over y; a tied one stays whole and gathers its input over x.
    """

    def vocab_parallel(module: nn.Module) -> nn.Module:
        e = cast(nn.Embedding, module)  # the module named emb_name: emb, an nn.Embedding
        inner = VocabParallelEmbedding(
            e.num_embeddings, e.embedding_dim, grid=grid, device=e.weight.device, dtype=e.weight.dtype
        )
        return inner.load_dense_(e.weight.detach())

    tied = head.weight is emb.weight
    plain = emb.padding_idx is None and emb.max_norm is None and not emb.sparse and not emb.scale_grad_by_freq
    if tied or not plain or emb.num_embeddings % grid.size("y"):
        style.post_hooks[emb_name] = slice_output_hook(grid)
    else:
        style.replace[emb_name] = vocab_parallel
    if tied:
        style.pre_hooks[head_name] = gather_input_hook(grid)
    else:
        style.linears[head_name] = LinearStyle(input_sharded=True)
