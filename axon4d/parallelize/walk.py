"""The replacement walk: ``auto_parallelize(model)`` (docs/design.md §2; docs/parallelize.md); its
inverse ``to_dense(model)`` is ``axon4d.parallelize.dense``.

``auto_parallelize`` walks a model twice. First it decides everything from sizes alone (no
collective, the same on every rank): which blocks a family style takes (the style tables below,
``axon4d.parallelize.llama`` and ``.gpt2``), then which other linear layers the general path takes
(``axon4d.parallelize.general``) and which it leaves as they are. Then it applies the decisions:
replaces modules and layers, patches attributes, installs the styles' forward hooks, and hooks the
gradient of every parameter left replicated so it is averaged over batch = data × z (E6/E7 for
replicated parameters), which makes every ``.grad`` DDP-complete when ``backward()`` returns.
"""

from __future__ import annotations

import warnings

from torch import nn

from axon4d.grid import runtime
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.mesh import Grid
from axon4d.nn.functional import average_grad_over_batch
from axon4d.options.context_mode import context_mode
from axon4d.options.recompute_mode import check_recompute
from axon4d.parallelize import context, gpt2, llama, moe
from axon4d.parallelize import recompute as recomputation
from axon4d.parallelize.dense import REPLICATED_MARK
from axon4d.parallelize.general import general_linears
from axon4d.parallelize.layers import ShardedLinear, is_linear, linear_problem, owned_by_axon4d
from axon4d.parallelize.styles import RESTORE_ATTR, BlockStyle, LinearStyle, StyleFn, within

#: class name → style for blocks whose forward code is known ("chained" style; tested: docs/parallelize.md)
FAMILY_STYLES: dict[str, StyleFn] = {**llama.CHAINED_STYLES, **gpt2.CHAINED_STYLES}

#: class name → its whole-model style under "sharded" (the residual stream split over x)
SHARDED_STYLES: dict[str, StyleFn] = {**llama.SHARDED_STYLES, **gpt2.SHARDED_STYLES, **moe.SHARDED_STYLES}

STYLES = ("sharded", "chained", "general")


def auto_parallelize(
    model: nn.Module,
    *,
    grid: Grid | None = None,
    style: str = "sharded",
    recompute: str = "none",
    context_parallel: bool | str = False,
    expert_layout: ExpertLayout | str | None = None,
) -> nn.Module:
    """Replace ``model``'s linear layers by 3D-parallel ones in place and return ``model``.

    ``model`` must be identical on every rank (same seed or checkpoint) and already on the grid's
    device; afterwards it takes this rank's batch shard (``axon4d.shard_batch``) and its outputs
    are this rank's shard (``axon4d.gather_batch`` reassembles them). ``style``:
    ``"sharded"`` (default) uses ``SHARDED_STYLES`` (the residual stream split over x), else
    ``FAMILY_STYLES``, else the general path; ``"chained"`` skips the sharded styles; ``"general"``
    uses the general path for every layer. Layers left as they are (tied to another module, not
    divisible by the grid, embeddings) stay replicated with gradients averaged over batch =
    data × z and are listed in a ``UserWarning``. Raises ``ValueError`` on every rank, before any
    collective, when a styled block's heads do not divide by G_y. ``recompute`` is the activation
    recomputation of the model's decoder layers: "none", "selective", "balanced" (sharded style)
    or "full" (axon4d.parallelize.recompute, docs/design.md §5). ``context_parallel``: the tokens
    of each sequence are split head–tail over z and attention runs across the split through
    transformers' AttentionInterface (axon4d.parallelize.context, docs/context.md); feed the model
    ``axon4d.parallelize.context.inputs(ids)``; True or "all-gather" gathers the keys and values over z,
    "ring" passes them around z (``axon4d.options.context_mode``). ``expert_layout``: where the experts of every MoE
    block it builds run (``axon4d.grid.expert_layout``, e.g. "ep=world,tp=1"; None: the grid's,
    ``axon4d.init(expert_layout=...)``); a layout the grid cannot place is refused with the rule it
    breaks and the layouts that fit, on every rank before any collective.
    """
    _check_arguments(model, style, recompute)
    mode = context_mode(context_parallel)  # a bad value: refused here, before anything is replaced
    grid = runtime.resolve(grid)
    layout = ExpertLayout.parse(expert_layout if expert_layout is not None else grid.expert_layout)
    moe.check_supported(model, style)  # an MoE model it cannot place: one line naming its class
    # 1. decide everything (sizes only: no collective, the same on every rank)
    blocks, linears, skipped = _decide(model, grid, style, layout)
    # 2. apply: replace modules and layers, install patches and hooks, hook replicated gradients
    _replace(model, grid, blocks, linears)
    _patch_and_hook(model, blocks)
    _hook_replicated_grads(model, grid)
    recomputation.apply(model, "none" if mode and recompute == "selective" else recompute, grid)
    if mode:
        context.enable(model, grid, recompute_core=recompute == "selective", mode=mode)
    if skipped:
        listed = "; ".join(f"{n} ({why})" for n, why in skipped.items())
        warnings.warn(
            f"axon4d.auto_parallelize left {len(skipped)} layer(s) as they are — replicated on every "
            f"rank, gradients averaged over data × z: {listed}",
            UserWarning,
            stacklevel=2,
        )
    return model


def _check_arguments(model: nn.Module, style: str, recompute: str) -> None:
    """Refuse a ``model`` that is not a ``torch.nn.Module`` (``TypeError``), an unknown
    recomputation mode or ``style`` (``ValueError``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"auto_parallelize takes a torch.nn.Module (the model to parallelize in place), got {type(model).__name__}"
        )
    check_recompute(recompute)
    if style not in STYLES:
        raise ValueError(f"style {style!r} is not known; use one of {STYLES}")


def _decide(
    model: nn.Module, grid: Grid, style: str, layout: ExpertLayout
) -> tuple[list[tuple[str, BlockStyle]], dict[str, LinearStyle], dict[str, str]]:
    """What ``auto_parallelize`` does to ``model`` under ``style``, from sizes alone (no collective,
    the same on every rank): the styled blocks (``_styled_blocks``; MoE blocks' experts in
    ``layout``), every linear layer to replace (by absolute name) with how, and the layers left as
    they are with why."""
    users: dict[int, list[str]] = {}  # id(parameter) → names of the modules holding it
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            users.setdefault(id(p), []).append(name)
    sharded = {**SHARDED_STYLES, **moe.sharded_styles(layout)}
    tables = {"sharded": [sharded, FAMILY_STYLES], "chained": [FAMILY_STYLES], "general": []}[style]
    blocks = _styled_blocks(model, grid, tables, users)
    linears: dict[str, LinearStyle] = {}
    handled: set[str] = set()  # modules a block style replaces
    for name, block_style in blocks:
        linears.update({_join(name, rel): s for rel, s in block_style.linears.items()})
        handled.update(_join(name, rel) for rel in block_style.replace)
    general, skipped = general_linears(model, grid, users, taken=handled | set(linears))
    linears.update(general)
    return blocks, linears, skipped


def _replace(
    model: nn.Module, grid: Grid, blocks: list[tuple[str, BlockStyle]], linears: dict[str, LinearStyle]
) -> None:
    """Put in ``model`` the modules the block styles of ``blocks`` build, and a ``ShardedLinear``
    on ``grid`` in place of each of ``linears``, split as its style says."""
    for block_name, block_style in blocks:
        block = model.get_submodule(block_name)
        for rel, build in block_style.replace.items():
            _swap(block, rel, build(block.get_submodule(rel)))
    for name, linear in linears.items():
        _swap(
            model,
            name,
            ShardedLinear(
                model.get_submodule(name),
                grid=grid,
                transpose=linear.transpose,
                input_sharded=linear.input_sharded,
                output_sharded=linear.output_sharded,
                fused=linear.fused,
            ),
        )


def _patch_and_hook(model: nn.Module, blocks: list[tuple[str, BlockStyle]]) -> None:
    """Set the attributes each block style of ``blocks`` patches (the originals kept for
    ``to_dense``) and install its forward pre- and post-hooks."""
    for block_name, block_style in blocks:
        block = model.get_submodule(block_name)
        for rel, attrs in block_style.patch.items():
            target = block.get_submodule(rel)
            setattr(target, RESTORE_ATTR, {k: getattr(target, k) for k in attrs})
            for k, v in attrs.items():
                setattr(target, k, v)
        for rel, hook in block_style.pre_hooks.items():
            block.get_submodule(rel).register_forward_pre_hook(hook, with_kwargs=True)
        for rel, hook in block_style.post_hooks.items():
            block.get_submodule(rel).register_forward_hook(hook)


def _styled_blocks(
    model: nn.Module, grid: Grid, tables: list[dict[str, StyleFn]], users: dict[int, list[str]]
) -> list[tuple[str, BlockStyle]]:
    """(block name, block style) of every module the first table that knows its class styles,
    outermost first; a block style is dropped when one of its linear layers cannot be replaced as
    it says."""
    blocks: list[tuple[str, BlockStyle]] = []
    for name, m in model.named_modules():
        if owned_by_axon4d(m) or within(name, [b for b, _ in blocks]):
            continue
        fn = next((table[type(m).__name__] for table in tables if type(m).__name__ in table), None)
        block_style = fn(name, m, grid) if fn else None
        if block_style is None:
            continue
        modules = dict(m.named_modules())
        if all(
            is_linear(modules.get(rel)) and not linear_problem(_join(name, rel), modules[rel], s.transpose, grid, users)
            for rel, s in block_style.linears.items()
        ):
            blocks.append((name, block_style))
    return blocks


def _join(block: str, rel: str) -> str:
    """The absolute name of module ``rel`` of block ``block`` ('' is the root)."""
    return f"{block}.{rel}" if block else rel


def _swap(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``root``'s submodule ``name`` is."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _hook_replicated_grads(model: nn.Module, grid: Grid) -> None:
    """Average over batch (data × z) the gradient of every parameter this library does not shard."""
    sharded = {id(p) for m in model.modules() if owned_by_axon4d(m) for p in m.parameters()}
    for p in model.parameters():  # each shared parameter once
        if p.requires_grad and id(p) not in sharded and not getattr(p, REPLICATED_MARK, False):
            average_grad_over_batch(p, grid)
            setattr(p, REPLICATED_MARK, True)
