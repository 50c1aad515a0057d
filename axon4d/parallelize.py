"""Drop-in parallelization of an existing model: ``auto_parallelize(model)`` and ``to_dense(model)``.

``auto_parallelize`` swaps every ``torch.nn.Linear`` (and Hugging Face's ``Conv1D``) for a
``ShardedLinear`` around an ``axon4d.Linear`` (DESIGN.md §2, E2–E7) and keeps the model's own
forward code. The model runs on this rank's token shard (``axon4d.shard_batch``, dim 0 split over
batch = data × z); everything outside the wrapped layers (norms, residuals, attention maths,
reshapes, embeddings) runs replicated over x and y on full features.

Three layouts (``auto_parallelize(model, layout=...)``), from most general to most efficient:
- **general** (any model): the layer takes full features, slices its input features locally (no
  communication) and all-gathers its output features, so the code around it sees full tensors.
  Cost per layer: one all-gather of (b, out) forward and one of (b, in) backward, on top of the
  3D layer's own E8/E9 all-reduces.
- **chained** (blocks in ``FAMILY_PLANS``): inside an attention or MLP block whose code between
  projections only reshapes per head or acts elementwise, the first projections are normal layers
  whose output stays split over y (so attention runs on this rank's heads only), and the last is
  a transposed layer that takes that split input and gathers over x — one all-gather per block
  instead of one per layer.
- **sharded** (models in ``SHARDED_PLANS``, the default): the residual stream stays split over x
  between blocks, norms run on sharded features (``axon4d.nn.norm``), the embedding is
  vocabulary-parallel where it can be, and only the logits are gathered.

Parameters left replicated (norms, embeddings, layers it cannot split) get a gradient hook that
averages over batch = data × z (E6/E7 for replicated parameters), so ``.grad`` is DDP-complete when
``backward()`` returns. Layers left as they are are listed in one warning.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from axon4d import runtime, volume
from axon4d.grid import Grid, _suggest, factorizations
from axon4d.nn.functional import average_grad_over_batch
from axon4d.nn.linear import Linear

#: attribute marking a forward pre-hook installed here (stripped from ``to_dense`` copies)
_HOOK_MARK = "__axon4d_hook__"
#: attribute holding {name: original value} of module attributes a family plan changed
_RESTORE = "_axon4d_restore"


# -- differentiable feature collectives ------------------------------------------------------
class _SliceFeatures(torch.autograd.Function):
    """Forward: this rank's chunk of the last dim over ``axis`` (local). Backward: all-gather over ``axis``.

    The input is replicated over ``axis``; each rank's gradient is exact for its own chunk only,
    so the full input gradient is the concatenation of every rank's chunk.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, grid: Grid) -> torch.Tensor:
        ctx.axis, ctx.grid = axis, grid
        n = x.shape[-1] // grid.size(axis)
        return x.narrow(-1, grid.coord(axis) * n, n).contiguous()  # (..., f/G_axis)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = ctx.grid.comm.all_gather(g.contiguous(), ctx.axis, dim=-1, tag=f"parallelize.bwd.gather.{ctx.axis}")
        return full.wait(), None, None  # (..., f)


class _GatherFeatures(torch.autograd.Function):
    """Forward: all-gather the last dim over ``axis``. Backward: keep this rank's chunk (local).

    The result is used identically on every rank of ``axis``, so each rank's incoming gradient is
    already complete and its own chunk is exact.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, grid: Grid) -> torch.Tensor:
        ctx.axis, ctx.grid, ctx.n = axis, grid, x.shape[-1]
        return grid.comm.all_gather(x.contiguous(), axis, dim=-1, tag=f"parallelize.fwd.gather.{axis}").wait()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g.narrow(-1, ctx.grid.coord(ctx.axis) * ctx.n, ctx.n).contiguous(), None, None


def _slice_features(x: torch.Tensor, axis: str, grid: Grid) -> torch.Tensor:
    """This rank's chunk of ``x``'s last dim over ``axis``; the backward all-gathers over ``axis``."""
    return x if grid.size(axis) == 1 else _SliceFeatures.apply(x, axis, grid)


def _gather_features(x: torch.Tensor, axis: str, grid: Grid) -> torch.Tensor:
    """The full last dim from every rank's chunk over ``axis``; the backward keeps this rank's chunk."""
    return x if grid.size(axis) == 1 else _GatherFeatures.apply(x, axis, grid)


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
            x = _slice_features(x, self.inner.in_axis, self.grid)  # (..., in) → (..., in/G_in)
        y = self.inner(x)  # (..., out/G_out)
        return y if self.output_sharded else _gather_features(y, self.inner.out_axis, self.grid)

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


# -- family plans ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Spec:
    """How one linear layer is replaced."""

    transpose: bool = False
    input_sharded: bool = False
    output_sharded: bool = False
    out_perm: torch.Tensor | None = None


Hook = Callable[..., Any]


@dataclasses.dataclass
class _BlockPlan:
    """A family plan's decisions for one block; names are relative to the block ('' = the block)."""

    specs: dict[str, _Spec]
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
    setattr(hook, _HOOK_MARK, True)
    return hook


def _slice_hidden_states_hook(grid: Grid) -> Callable[..., Any]:
    """A forward pre-hook slicing a block's ``hidden_states`` (first argument) over x, once."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            args = (_slice_features(args[0], "x", grid), *args[1:])
        else:
            kwargs = dict(kwargs, hidden_states=_slice_features(kwargs["hidden_states"], "x", grid))
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
        + _suggest(grid.world_size, ok, near=grid.shape)
    )


def _plan_llama_attention(name: str, m: nn.Module, grid: Grid) -> _BlockPlan:
    """q, k, v normal with output split over y (whole heads; GQA needs kv heads to divide too), o transposed."""
    cfg = m.config
    _require_heads(name, "num_attention_heads", cfg.num_attention_heads, grid)
    _require_heads(name, "num_key_value_heads", cfg.num_key_value_heads, grid)
    qkv = _Spec(input_sharded=True, output_sharded=True)
    o = _Spec(transpose=True, input_sharded=True)
    return _BlockPlan({"q_proj": qkv, "k_proj": qkv, "v_proj": qkv, "o_proj": o},
                      pre_hooks={"": _slice_hidden_states_hook(grid)})


def _plan_llama_mlp(name: str, m: nn.Module, grid: Grid) -> _BlockPlan:
    """gate and up normal with output split over y; the SiLU product is elementwise; down transposed."""
    up = _Spec(input_sharded=True, output_sharded=True)
    return _BlockPlan({"gate_proj": up, "up_proj": up, "down_proj": _Spec(transpose=True, input_sharded=True)},
                      pre_hooks={"": _slice_hidden_states_hook(grid)})


def _plan_gpt2_mlp(name: str, m: nn.Module, grid: Grid) -> _BlockPlan:
    """c_fc normal with output split over y; GELU is elementwise; c_proj transposed."""
    return _BlockPlan({"c_fc": _Spec(input_sharded=True, output_sharded=True),
                       "c_proj": _Spec(transpose=True, input_sharded=True)},
                      pre_hooks={"": _slice_hidden_states_hook(grid)})


def _gpt2_attention(name: str, m: nn.Module, grid: Grid, last: _Spec) -> tuple[dict[str, _Spec], dict[str, Any]] | None:
    """Specs and attribute patch of a GPT-2 self-attention: c_attn packs q|k|v, so its rows are
    permuted to give rank y [q, k, v] of its own heads, and the module's ``split_size`` becomes
    hidden/G_y so its ``split`` cuts the local chunk; c_proj is ``last`` (transposed)."""
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        return None  # cross-attention: general path
    _require_heads(name, "num_heads", m.num_heads, grid)
    h, g = m.embed_dim, grid.size("y")
    local = h // g
    perm = torch.cat([torch.arange(y * local, (y + 1) * local) + j * h for y in range(g) for j in range(3)])
    specs = {"c_attn": _Spec(input_sharded=True, output_sharded=True, out_perm=perm), "c_proj": last}
    return specs, {"split_size": local}


def _plan_gpt2_attention(name: str, m: nn.Module, grid: Grid) -> _BlockPlan | None:
    """Chained GPT-2 attention (see ``_gpt2_attention``)."""
    found = _gpt2_attention(name, m, grid, _Spec(transpose=True, input_sharded=True))
    if found is None:
        return None
    return _BlockPlan(found[0], patch={"": found[1]}, pre_hooks={"": _slice_hidden_states_hook(grid)})


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


def _sharded_edges(plan: _BlockPlan, grid: Grid, emb_name: str, emb: nn.Embedding, head_name: str,
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
        return (_gather_features(args[0], "x", grid), *args[1:]), kwargs

    tied = head.weight is emb.weight
    plain = emb.padding_idx is None and emb.max_norm is None and not emb.sparse and not emb.scale_grad_by_freq
    if tied or not plain or emb.num_embeddings % grid.size("y"):
        plan.post_hooks[emb_name] = _slice_output_hook(grid)
    else:
        plan.replace[emb_name] = vocab_parallel
    if tied:
        plan.pre_hooks[head_name] = _marked(gather_input)
    else:
        plan.specs[head_name] = _Spec(input_sharded=True)


def _slice_output_hook(grid: Grid) -> Hook:
    """A forward hook slicing a module's output features over x."""
    return _marked(lambda mod, args, out: _slice_features(out, "x", grid))


_MID = _Spec(input_sharded=True, output_sharded=True)  # normal: x-split in, y-split out
_LAST = _Spec(transpose=True, input_sharded=True, output_sharded=True)  # transposed: y-split in, x-split out


def _plan_llama_sharded(name: str, m: nn.Module, grid: Grid) -> _BlockPlan | None:
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
    plan = _BlockPlan({}, replace={"model.norm": norm})
    for i in range(len(body.layers)):
        p = f"model.layers.{i}"
        plan.specs.update({f"{p}.self_attn.{c}": _MID for c in ("q_proj", "k_proj", "v_proj")})
        plan.specs.update({f"{p}.mlp.{c}": _MID for c in ("gate_proj", "up_proj")})
        plan.specs.update({f"{p}.self_attn.o_proj": _LAST, f"{p}.mlp.down_proj": _LAST})
        plan.replace.update({f"{p}.input_layernorm": norm, f"{p}.post_attention_layernorm": norm})
    _sharded_edges(plan, grid, "model.embed_tokens", body.embed_tokens, "lm_head", m.lm_head)
    return plan


def _plan_gpt2_sharded(name: str, m: nn.Module, grid: Grid) -> _BlockPlan | None:
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
    plan = _BlockPlan({}, replace={"transformer.ln_f": norm})
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
SHARDED_PLANS: dict[str, Callable[[str, nn.Module, Grid], _BlockPlan | None]] = {
    "LlamaForCausalLM": _plan_llama_sharded,
    "GPT2LMHeadModel": _plan_gpt2_sharded,
}


#: class name → plan for blocks whose forward code is known (tested: see docs/parallelize.md)
FAMILY_PLANS: dict[str, Callable[[str, nn.Module, Grid], _BlockPlan | None]] = {
    "LlamaAttention": _plan_llama_attention,
    "LlamaMLP": _plan_llama_mlp,
    "GPT2Attention": _plan_gpt2_attention,
    "GPT2MLP": _plan_gpt2_mlp,
}


# -- the entry points ------------------------------------------------------------------------
def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def _owned_by_axon4d(m: nn.Module) -> bool:
    """Modules of this library reduce their own gradients (the 3D Linear, sharded norms, ...)."""
    return type(m).__module__.startswith("axon4d.")


def _linear_problem(name: str, m: nn.Module, spec: _Spec, grid: Grid, users: dict[int, list[str]]) -> str | None:
    """Why ``m`` cannot be replaced as ``spec`` says (None if it can)."""
    weight, _ = _dense_params(m)
    out_f, in_f = weight.shape
    for p in m.parameters(recurse=False):
        others = [u for u in users[id(p)] if u != name]
        if others:
            return f"weight shared with {', '.join(others)} (tied)"
    in_axis, out_axis = volume.layer_axes(spec.transpose)
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
    specs: dict[str, _Spec] = {}
    blocks: list[tuple[str, _BlockPlan]] = []
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
            problem = _linear_problem(name, m, _Spec(), grid, users)
            if problem:
                skipped[name] = f"{type(m).__name__}: {problem}"
            else:
                specs[name] = _Spec()
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
            for key in [k for k, fn in hooks.items() if getattr(fn, _HOOK_MARK, False)]:
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

