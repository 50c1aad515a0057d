"""Drop-in parallelization of an existing model: ``auto_parallelize(model)`` and ``to_dense(model)``.

``auto_parallelize`` swaps every ``torch.nn.Linear`` (and Hugging Face's ``Conv1D``) for a
``ShardedLinear`` around an ``axon4d.Linear`` (docs/design.md §2, E2–E7) and keeps the model's own
forward code. The model runs on this rank's token shard (``axon4d.shard_batch``, dim 0 split over
batch = data × z); everything outside the wrapped layers (norms, residuals, attention maths,
reshapes, embeddings) runs replicated over x and y on full features.

Three layouts (``auto_parallelize(model, layout=...)``), from most general to most efficient:
- **general** (any model): the layer takes full features, slices its input features locally (no
  communication) and all-gathers its output features, so the code around it sees full tensors.
  Cost per layer: one all-gather of (b, out) forward and one of (b, in) backward, on top of the
  3D layer's own E8/E9 all-reduces.
- **chained** (blocks in ``FAMILY_PLANS``, ``axon4d.family_plans``): inside an attention or MLP
  block whose code between projections only reshapes per head or acts elementwise, the first
  projections are normal layers whose output stays split over y (so attention runs on this rank's
  heads only), and the last is a transposed layer that takes that split input and gathers over x
  — one all-gather per block instead of one per layer.
- **sharded** (models in ``SHARDED_PLANS``, the default): the residual stream stays split over x
  between blocks, norms run on sharded features (``axon4d.nn.norm``), the embedding is
  vocabulary-parallel where it can be, and only the logits are gathered.

Parameters left replicated (norms, embeddings, layers it cannot split) get a gradient hook that
averages over batch = data × z (E6/E7 for replicated parameters), so ``.grad`` is DDP-complete when
``backward()`` returns. Layers left as they are are listed in one warning.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from axon4d import geometry, runtime
from axon4d.family_plans import FAMILY_PLANS, HOOK_MARK, SHARDED_PLANS, BlockPlan, Spec
from axon4d.grid import Grid
from axon4d.nn.functional import average_grad_over_batch, gather_replicated, split_replicated
from axon4d.nn.linear import Linear

#: attribute holding {name: original value} of module attributes a family plan changed
_RESTORE = "_axon4d_restore"


# -- the wrapped layer -----------------------------------------------------------------------
def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer storing its weight as (in, out)."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


def _dense_params(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias (out,) or None) of an ``nn.Linear`` or a ``Conv1D``."""
    if _is_conv1d(m):
        return m.weight.detach().t(), m.bias.detach()
    return m.weight.detach(), None if m.bias is None else m.bias.detach()


class ShardedLinear(nn.Module):
    """An ``axon4d.Linear`` that fits where a model had an ``nn.Linear`` or ``Conv1D``.

    Input: (..., in) full features, or — ``input_sharded`` — this rank's chunk over the layer's
    input axis (x normal, y transposed). Output: (..., out) full, gathered over the output axis, or —
    ``output_sharded`` — this rank's chunk. ``out_perm`` reorders output features before splitting
    (GPT-2's packed q|k|v so each rank gets whole heads of all three); ``to_dense`` undoes it.
    """

    def __init__(self, dense: nn.Module, *, transpose: bool = False, input_sharded: bool = False,
                 output_sharded: bool = False, out_perm: torch.Tensor | None = None, grid: Grid | None = None):
        super().__init__()
        weight, bias = _dense_params(dense)
        out_f, in_f = weight.shape
        if out_perm is not None:
            weight, bias = weight[out_perm], None if bias is None else bias[out_perm]
        self.inner = Linear(in_f, out_f, bias=bias is not None, transpose=transpose, grid=grid,
                            device=weight.device, dtype=weight.dtype)
        self.inner.load_dense_(weight, bias)
        self.grid = self.inner.grid
        self.input_sharded, self.output_sharded = input_sharded, output_sharded
        self.conv1d = _is_conv1d(dense)
        self.register_buffer("out_perm", out_perm, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_sharded:
            x = split_replicated(x, self.inner.in_axis, self.grid)  # (..., in) → (..., in/G_in)
        y = self.inner(x)  # (..., out/G_out)
        return y if self.output_sharded else gather_replicated(y, self.inner.out_axis, self.grid)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        """The layer it replaced (``nn.Linear`` or ``Conv1D``) with full weight, bias and ``.grad``."""
        lin = self.inner.to_dense(grads=grads)
        if self.out_perm is not None:
            inv = torch.argsort(self.out_perm)
            for p in lin.parameters():
                p.data = p.data[inv]
                if p.grad is not None:
                    p.grad = p.grad[inv]
        if not self.conv1d:
            return lin
        from transformers.pytorch_utils import Conv1D  # only reached for a model that had one

        conv = Conv1D(lin.out_features, lin.in_features).to(lin.weight)
        conv.weight.copy_(lin.weight.t())
        conv.bias.copy_(lin.bias)
        if grads:
            conv.weight.grad = None if lin.weight.grad is None else lin.weight.grad.t().contiguous()
            conv.bias.grad = lin.bias.grad
        return conv

    def extra_repr(self) -> str:
        return f"conv1d={self.conv1d}, input_sharded={self.input_sharded}, output_sharded={self.output_sharded}"


# -- the entry points ------------------------------------------------------------------------
def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def _owned_by_axon4d(m: nn.Module) -> bool:
    """Modules of this library reduce their own gradients (the 3D Linear, sharded norms, ...)."""
    return type(m).__module__.startswith("axon4d.")


def _linear_problem(name: str, m: nn.Module, spec: Spec, grid: Grid, users: dict[int, list[str]]) -> str | None:
    """Why ``m`` cannot be replaced as ``spec`` says (None if it can)."""
    weight, _ = _dense_params(m)
    out_f, in_f = weight.shape
    for p in m.parameters(recurse=False):
        others = [u for u in users[id(p)] if u != name]
        if others:
            return f"weight shared with {', '.join(others)} (tied)"
    in_axis, out_axis = geometry.layer_axes(spec.transpose)
    if in_f % grid.size(in_axis) or out_f % grid.size(out_axis):
        return (f"({out_f}, {in_f}) does not split over G_{out_axis} = {grid.size(out_axis)} × "
                f"G_{in_axis} = {grid.size(in_axis)}")
    return None


LAYOUTS = ("sharded", "chained", "general")


def auto_parallelize(model: nn.Module, *, grid: Grid | None = None, layout: str = "sharded") -> nn.Module:
    """Replace ``model``'s linear layers by 3D-parallel ones in place and return ``model``.

    ``model`` must be identical on every rank (same seed or checkpoint) and already on the grid's
    device; afterwards it takes this rank's batch shard (``axon4d.shard_batch``) and its outputs
    are this rank's shard (``axon4d.gather_batch`` reassembles them). ``layout``:
    ``"sharded"`` (default) uses ``SHARDED_PLANS`` (the residual stream split over x), else
    ``FAMILY_PLANS``, else the general path; ``"chained"`` skips the sharded plans; ``"general"``
    uses the general path for every layer. Layers left as they are (tied to another module, not
    divisible by the grid, embeddings) stay replicated with gradients averaged over batch =
    data × z and are listed in a ``UserWarning``. Raises ``ValueError`` on every rank, before any
    collective, when a planned block's heads do not divide by G_y.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not known; use one of {LAYOUTS}")
    grid = runtime.resolve(grid)
    users: dict[int, list[str]] = {}  # id(parameter) → names of the modules holding it
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            users.setdefault(id(p), []).append(name)
    plans = {"sharded": [SHARDED_PLANS, FAMILY_PLANS], "chained": [FAMILY_PLANS], "general": []}[layout]

    # 1. decide everything (sizes only: no collective, the same on every rank)
    specs: dict[str, Spec] = {}
    blocks: list[tuple[str, BlockPlan]] = []
    handled: set[str] = set()  # modules a plan replaces
    whole: list[str] = []  # prefixes whose linear layers are left alone
    skipped: dict[str, str] = {}
    for name, m in model.named_modules():
        if _owned_by_axon4d(m) or _under(name, [b for b, _ in blocks]):
            continue
        fn = next((table[type(m).__name__] for table in plans if type(m).__name__ in table), None)
        plan = fn(name, m, grid) if fn else None
        if plan is None:
            continue
        absolute = {(f"{name}.{rel}" if name else rel): s for rel, s in plan.specs.items()}
        modules = dict(m.named_modules())
        if all(_is_linear(modules.get(rel)) and not _linear_problem(a, modules[rel], s, grid, users)
               for (rel, s), a in zip(plan.specs.items(), absolute)):
            blocks.append((name, plan))
            specs.update(absolute)
            handled.update(f"{name}.{rel}" if name else rel for rel in plan.replace)
    for name, m in model.named_modules():
        if name in handled or name in specs or _owned_by_axon4d(m) or _under(name, whole):
            continue
        if _is_linear(m):
            problem = _linear_problem(name, m, Spec(), grid, users)
            if problem:
                skipped[name] = f"{type(m).__name__}: {problem}"
            else:
                specs[name] = Spec()
        elif isinstance(m, nn.Embedding):
            skipped[name] = "Embedding: kept whole on every rank"
        elif isinstance(m, nn.MultiheadAttention):
            skipped[name] = "MultiheadAttention: uses its projection weights directly"
            whole.append(name)

    # 2. apply: replace modules and layers, install patches and hooks, hook replicated gradients
    for block_name, plan in blocks:
        block = model.get_submodule(block_name)
        for rel, build in plan.replace.items():
            _swap(block, rel, build(block.get_submodule(rel)))
    for name, spec in specs.items():
        _swap(model, name, ShardedLinear(model.get_submodule(name), transpose=spec.transpose,
                                         input_sharded=spec.input_sharded, output_sharded=spec.output_sharded,
                                         out_perm=spec.out_perm, grid=grid))
    for block_name, plan in blocks:
        block = model.get_submodule(block_name)
        for rel, attrs in plan.patch.items():
            target = block.get_submodule(rel)
            setattr(target, _RESTORE, {k: getattr(target, k) for k in attrs})
            for k, v in attrs.items():
                setattr(target, k, v)
        for rel, hook in plan.pre_hooks.items():
            block.get_submodule(rel).register_forward_pre_hook(hook, with_kwargs=True)
        for rel, hook in plan.post_hooks.items():
            block.get_submodule(rel).register_forward_hook(hook)
    _hook_replicated_grads(model, grid)
    if skipped:
        listed = "; ".join(f"{n} ({why})" for n, why in skipped.items())
        warnings.warn(
            f"axon4d.auto_parallelize left {len(skipped)} layer(s) as they are — replicated on every "
            f"rank, gradients averaged over data × z: {listed}", UserWarning, stacklevel=2)
    return model


def _under(name: str, prefixes: list[str]) -> bool:
    """Whether module ``name`` is one of ``prefixes`` or inside one ('' is the root)."""
    return any(p == "" or name == p or name.startswith(f"{p}.") for p in prefixes)


def _swap(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``root``'s submodule ``name`` is."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _hook_replicated_grads(model: nn.Module, grid: Grid) -> None:
    """Average over batch (data × z) the gradient of every parameter this library does not shard."""
    sharded = {id(p) for m in model.modules() if _owned_by_axon4d(m) for p in m.parameters()}
    for p in model.parameters():  # each shared parameter once
        if p.requires_grad and id(p) not in sharded and not getattr(p, "_axon4d_replicated", False):
            average_grad_over_batch(p, grid)
            p._axon4d_replicated = True


def to_dense(model: nn.Module, grads: bool = False) -> nn.Module:
    """An unparallelized copy of ``model`` with full weights (and ``.grad`` if ``grads``), on every rank.

    Every submodule with a ``to_dense(grads=...)`` method (``ShardedLinear``, ``axon4d.Linear``
    and the library's other sharded modules) is replaced by its result, gathering over the axes it
    is split on; everything else is copied. Hooks and attribute changes made by
    ``auto_parallelize`` are undone in the copy. Every rank must call it (it communicates).
    """
    if callable(getattr(model, "to_dense", None)):
        return model.to_dense(grads=grads)
    memo: dict[int, Any] = {}

    def convert(parent: nn.Module) -> None:  # children in a fixed order, the same on every rank
        grid = getattr(parent, "grid", None)
        if isinstance(grid, Grid):
            memo[id(grid)] = grid  # shared, never copied
        for child in parent.children():
            if id(child) in memo:
                continue
            if callable(getattr(child, "to_dense", None)):
                memo[id(child)] = child.to_dense(grads=grads)
            else:
                convert(child)

    convert(model)
    dense = copy.deepcopy(model, memo)
    for m in dense.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, fn in hooks.items() if getattr(fn, HOOK_MARK, False)]:
                del hooks[key]
                for extra in (m._forward_pre_hooks_with_kwargs, m._forward_hooks_with_kwargs,
                              m._forward_hooks_always_called):
                    extra.pop(key, None)
        for k, v in m.__dict__.pop(_RESTORE, {}).items():
            setattr(m, k, v)
    originals = dict(model.named_parameters())
    for name, p in dense.named_parameters():
        p.__dict__.pop("_axon4d_replicated", None)
        if grads and p.grad is None and name in originals and originals[name].grad is not None:
            p.grad = originals[name].grad.detach().clone()
    return dense

