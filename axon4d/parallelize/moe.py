"""Hugging Face Mixture-of-Experts causal LMs under ``auto_parallelize`` (docs/parallelize.md,
"Mixture-of-Experts models"; docs/moe.md).

The sharded style of the llama-built MoE families (``MODELS``: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE) keeps the
residual stream split over x as for Llama (``axon4d.parallelize.llama``) and puts an ``HFMoEBlock``
— axon4d's grid MoE layer (``axon4d.nn.moe.MoE``, E14–E18) — in place of every sparse MoE block:

- the router ``gate.weight`` (E, hidden) becomes ``MoE.router`` (split over x); Mixtral's gates
  are its top-k softmax scores renormalised (``router_topk_norm=True``), Qwen3-MoE's, Qwen2-MoE's and
  OLMoE's renormalised when ``norm_topk_prob`` (else taken as they are);
- the fused experts ``experts.gate_up_proj`` (E, 2I, hidden) = [gate | up] and
  ``experts.down_proj`` (E, hidden, I) become ``MoE.experts``: experts over batch = data × z,
  each split over x·y, up stored as [gate_j | up_j] per y chunk;
- Qwen3-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) keep ``Qwen3MoeMLP``,
  chained like Llama's MLP; its per-head q/k norms become ``HeadNorm`` (this rank's heads, the
  weight's gradient summed over y); Qwen2-MoE's likewise keep ``Qwen2MoeMLP``;
- OLMoE's q/k norms over all heads' features become ``FeatureNorm`` (the sum of squares summed
  over y);
- Qwen2-MoE's block becomes a ``GatedSharedMoEBlock``: the routed experts plus its shared expert
  (chained like Llama's MLP) scaled by sigmoid(``shared_expert_gate``), a ``SharedGate``.

The auxiliary loss: transformers adds its load-balancing loss only when ``output_router_logits``
is asked; then every ``HFMoE`` records its router logits for transformers' output and
``RouterAux`` computes transformers' pooled loss exactly, as this rank's share (the training job
adds it: ``axon4d.nn.moe.aux_loss``). Otherwise it is off.

``check_supported`` refuses, in one line naming the class, every other model with MoE blocks.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from axon4d.config import ModelConfig
from axon4d.grid import rules
from axon4d.grid.mesh import Grid
from axon4d.layout.geometry import Term
from axon4d.nn.functional import average_grad_over_batch, sum_partials, sum_to_replicas
from axon4d.nn.moe import MoE, placement_rules
from axon4d.nn.moe_dense import DenseMoE
from axon4d.nn.moe_dispatch import use_replicated
from axon4d.parallelize.layers import linear_problem, owned_by_axon4d, sharded_norm_builder
from axon4d.parallelize.styles import (
    NORMAL_SPLIT,
    TRANSPOSED_SPLIT,
    BlockStyle,
    StyleFn,
    marked,
    require_heads,
    sharded_edges,
)

#: causal LM class → (its body's class, its decoder layer's class, its sparse MoE block's class)
MODELS = {
    "MixtralForCausalLM": ("MixtralModel", "MixtralDecoderLayer", "MixtralSparseMoeBlock"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeSparseMoeBlock"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeModel", "Qwen2MoeDecoderLayer", "Qwen2MoeSparseMoeBlock"),
    "OlmoeForCausalLM": ("OlmoeModel", "OlmoeDecoderLayer", "OlmoeSparseMoeBlock"),
}
#: the dense MLP class of a family's non-MoE layers
DENSE_MLPS = ("Qwen3MoeMLP", "MixtralMLP", "Qwen2MoeMLP", "OlmoeMLP")
#: what the refusal of an unsupported MoE model lists
SUPPORTED = (
    "MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (its sigmoid-gated shared expert) and "
    "OlmoeForCausalLM (softmax top-k routers, renormalised or not, SiLU-gated experts, style='sharded')"
)
#: why a known MoE family is refused: what of it is not implemented
REFUSED = {
    "DeepseekV3ForCausalLM": (
        "its multi-head latent attention (MLA: low-rank q_a/kv_a projections, a decoupled rotary key) is not "
        "implemented, and its grouped sigmoid routing with e_score_correction_bias is not loaded from transformers"
    ),
    "GptOssForCausalLM": "its experts (biased, clamped SwiGLU), biased router and attention sinks are not implemented",
}
#: config fields by which a Hugging Face config says its model has routed experts
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def moe_config(config: Any, n_moe_layers: int) -> ModelConfig:
    """The ``ModelConfig`` of one sparse MoE block of a Mixtral or Qwen3-MoE ``config`` (only the
    fields ``MoE`` reads are meaningful)."""
    mixtral = config.model_type == "mixtral"
    e = int(config.num_local_experts if mixtral else config.num_experts)
    k = int(config.num_experts_per_tok)
    ffn = int(config.intermediate_size if mixtral or config.model_type == "olmoe" else config.moe_intermediate_size)
    return ModelConfig(
        n_layers=1,
        hidden=int(config.hidden_size),
        n_heads=1,
        arch="llama",
        ffn_hidden=ffn,
        n_experts=e,
        experts_per_token=k,
        expert_ffn=ffn,
        router_topk_norm=True if mixtral else bool(config.norm_topk_prob),
        moe_aux_coef=0.0,  # transformers' pooled balance loss instead: ``RouterAux``
        moe_z_coef=0.0,
        name=str(config.model_type),
    )


def is_sparse_layer(config: Any, i: int) -> bool:
    """Whether decoder layer ``i`` of a Mixtral or Qwen3-MoE ``config`` is a sparse MoE block
    (Qwen3-MoE: not in ``mlp_only_layers`` and (i + 1) divisible by ``decoder_sparse_step``)."""
    if config.model_type in ("mixtral", "olmoe"):
        return True
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return i not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0 and (i + 1) % step == 0


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"{type(model).__name__}: {why}; axon4d parallelizes the MoE models {SUPPORTED}")


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` looks like a Mixture-of-Experts model: its config names routed experts, or
    a module's class (not one of this library's: they place themselves) is an MoE block or experts."""
    config = getattr(model, "config", None)
    if any(int(getattr(config, f, 0) or 0) > 0 for f in EXPERT_FIELDS if isinstance(getattr(config, f, 0), int)):
        return True
    return any(
        any(w in type(m).__name__ for w in ("Moe", "MoE", "Experts")) and not owned_by_axon4d(m)
        for m in model.modules()
    )


def check_supported(model: nn.Module, style: str) -> None:
    """Raise one ``ValueError`` line (the same on every rank) when ``model`` has MoE blocks that
    ``auto_parallelize`` cannot place on the grid: another MoE family, a supported one with options
    it does not implement, or a style other than sharded."""
    if not has_experts(model):
        return
    name = type(model).__name__
    if name not in MODELS:
        raise _refuse(model, REFUSED.get(name, "its Mixture-of-Experts blocks are not supported"))
    config = cast(Any, model).config
    if style != "sharded":
        raise _refuse(model, f"style={style!r} would leave its experts whole on every rank; use style='sharded'")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise _refuse(model, f"hidden_act {config.hidden_act!r}: the grid's experts are SiLU-gated")
    if float(getattr(config, "router_jitter_noise", 0.0) or 0.0):
        raise _refuse(model, f"router_jitter_noise = {config.router_jitter_noise} is not implemented; set it to 0")


class HeadNorm(nn.Module):
    """A per-head RMSNorm (Qwen3-MoE's q_norm, k_norm: over head_dim) on this rank's heads; the
    weight is whole on every rank and its gradient, partial over y (each y rank holds other heads),
    is summed over y and averaged over batch = data × z."""

    def __init__(self, original: nn.Module, grid: Grid):
        super().__init__()
        norm = cast(Any, original)  # Hugging Face's RMSNorm: duck-typed
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.grid = grid
        self.template = [original]  # what to_dense returns; in a list: not a submodule
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # (..., heads/G_y, head_dim)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return use_replicated(self.weight, "y", self.grid, Term.REPLICATED_GRAD) * h.to(dtype)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        dense = copy.deepcopy(self.template[0])
        weight = cast(nn.Parameter, dense.weight)  # Hugging Face's RMSNorm weight
        if weight.is_meta:
            dense.to_empty(device=self.weight.device)
            weight = cast(nn.Parameter, dense.weight)
        weight.copy_(self.weight)
        weight.grad = self.weight.grad.clone() if grads and self.weight.grad is not None else None
        return dense


class HFMoE(MoE):
    """``MoE`` that, while ``record`` is set, keeps its last forward's router logits (T, E) (fp32,
    with their graph) in ``router_logits`` and hands them to transformers' output recorder, as the
    Hugging Face router it replaced would (``output_router_logits``)."""

    def __init__(self, cfg: ModelConfig, **kw: Any):
        super().__init__(cfg, **kw)
        self.record = False
        self.router_logits: torch.Tensor | None = None

    def _aux(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.record:  # the (T, E) fp32 logits every forward computes for its aux losses
            self.router_logits = logits
            _record_router_logits(logits.to(self.router.weight.dtype))
        return super()._aux(logits, *args, **kwargs)


def _record_router_logits(logits: torch.Tensor) -> None:
    """Append ``logits`` to the router logits transformers is collecting for the running forward
    (``output_router_logits``), if it is collecting them."""
    try:
        from transformers.utils import output_capturing
    except ImportError:  # pragma: no cover - transformers is what made the model
        return
    collector = getattr(output_capturing, "_active_collector", None)
    got = collector.get() if collector is not None else None
    if isinstance(got, dict) and "router_logits" in got:
        got["router_logits"].append(logits)


class RouterAux:
    """transformers' load-balancing loss (``load_balancing_loss_func``) of a model whose sparse
    blocks are ``HFMoEBlock``s, as this rank's share: averaged over batch = data × z, the shares
    are the one-process loss, and so are their gradients.

    transformers pools every sparse layer's router statistics before the product:
    aux = E·Σ_e F_e·P_e, F_e = (assignments to e, all layers) / M, P_e = (Σ of e's probability over
    tokens and layers) / M, M = layers × tokens (the attention mask's ones when one is given). F
    has no gradient and is global (the counts the MoE layers exchanged; with a mask, one
    all-reduce over batch of E + 1 numbers), P is linear in the tokens, so this rank's share is
    E·G_batch·Σ_e F_e·S_e/M with S_e its own tokens' probability sums. The body's pre-hook
    (``pre``) arms the blocks when ``output_router_logits`` is asked; its post-hook (``post``) sets
    each block's ``moe.aux_loss`` to its layer's part × ``router_aux_loss_coef`` (what the training
    job adds, ``axon4d.nn.moe.aux_loss``); the causal LM's post-hook (``fix``) puts the share in
    the output's ``aux_loss`` and its ``loss`` in place of the aux transformers computed from this
    rank's tokens alone."""

    def __init__(self, config: Any, grid: Grid):
        self.grid = grid
        self.n_experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0))
        self.k = int(config.num_experts_per_tok)
        self.coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.want = False
        self.mask: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None

    @staticmethod
    def blocks(module: nn.Module) -> list[HFMoE]:
        return [b.moe for b in module.modules() if isinstance(b, HFMoEBlock)]

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        asked = kwargs.get("output_router_logits")
        self.want = bool(cast(Any, module).config.output_router_logits if asked is None else asked)
        mask = kwargs.get("attention_mask")
        self.mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self.aux = None
        for b in self.blocks(module):
            b.record = self.want
            b.router_logits = None

    def post(self, module: nn.Module, args: tuple, out: Any) -> None:
        if not self.want:
            return
        blocks = self.blocks(module)
        logits = [b.router_logits for b in blocks]
        if not blocks or any(x is None for x in logits):
            return
        terms = self.shares(blocks, [cast(torch.Tensor, x) for x in logits])
        for b, t in zip(blocks, terms):
            b.aux_loss = self.coef * t
            b.router_logits = None
        self.aux = torch.stack(terms).sum()

    def fix(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if self.aux is None or getattr(out, "aux_loss", None) is None:
            return None
        if getattr(out, "loss", None) is not None:
            out.loss = out.loss + self.coef * (self.aux - out.aux_loss).to(out.loss.dtype)
        out.aux_loss = self.aux
        self.aux = None
        return out

    def shares(self, blocks: list[HFMoE], logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each sparse layer's part of this rank's share (class docstring)."""
        e, k, grid = self.n_experts, self.k, self.grid
        probs = [torch.softmax(x.float(), dim=-1) for x in logits]  # (T, E) each
        layers = len(blocks)
        if self.mask is None:
            per_layer = [torch.tensor(b.tokens_per_expert or [0] * e, dtype=torch.float32) for b in blocks]
            counts = torch.stack(per_layer).sum(0).to(probs[0].device)  # (E,): every rank's assignments
            total = layers * float(per_layer[0].sum()) / k
            sums = [p.sum(dim=0) for p in probs]
        else:
            m = self.mask.reshape(-1).to(device=probs[0].device, dtype=torch.float32)
            local = torch.zeros(e + 1, dtype=torch.float32, device=m.device)
            for p in probs:
                chosen = torch.topk(p.detach(), k, dim=-1).indices.reshape(-1)
                local[:e].scatter_add_(0, chosen, m.repeat_interleave(k))
            local[e] = layers * m.sum()
            local = grid.comm.all_reduce(local, "batch", tag="moe.hf_aux_counts").wait()
            counts, total = local[:e], float(local[e])
            sums = [(p * m.unsqueeze(-1)).sum(dim=0) for p in probs]
        scale = e * grid.size("batch") / max(total, 1e-12) ** 2
        return [scale * (counts * s).sum() for s in sums]


class HFMoEBlock(nn.Module):
    """axon4d's grid MoE layer where a Hugging Face sparse MoE block was: (b, s, hidden/G_x) →
    (b, s, hidden/G_x), split over x, replicated over y (module docstring). ``to_dense`` gives back
    the block with fused ``gate.weight``, ``experts.gate_up_proj`` and ``experts.down_proj``."""

    def __init__(self, original: nn.Module, cfg: ModelConfig, grid: Grid):
        super().__init__()
        block = cast(Any, original)
        w = block.gate.weight
        self.moe = HFMoE(cfg, grid=grid, device=w.device, dtype=w.dtype)
        self.template = [original]
        if not w.is_meta:
            self.moe.load_dense_(self.dense_of(block, cfg))

    @staticmethod
    def dense_of(block: Any, cfg: ModelConfig) -> DenseMoE:
        """The ``DenseMoE`` holding the Hugging Face ``block``'s weights (gate_up split into gate, up)."""
        w = block.gate.weight
        with torch.device("meta"):
            dense = DenseMoE(cfg, dtype=w.dtype)
        dense.to_empty(device=w.device)
        gate, up = block.experts.gate_up_proj.detach().chunk(2, dim=1)  # (E, I, hidden) each
        with torch.no_grad():
            dense.router.weight.copy_(w)
            assert dense.experts.gate is not None
            dense.experts.gate.copy_(gate)
            dense.experts.up.copy_(up)
            dense.experts.down.copy_(block.experts.down_proj)
        return dense

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden_states)

    def _dense_parts(self, grads: bool) -> dict[int, Any]:
        """{id(the template's module): its dense copy} for the parts of the block held outside ``moe``."""
        return {}

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        """The Hugging Face block with the whole router and experts (and ``.grad``), on every rank
        (gathers over x, y and batch)."""
        dense = self.moe.to_dense(grads)
        block = copy.deepcopy(self.template[0], self._dense_parts(grads))
        hf = cast(Any, block)  # Hugging Face's sparse MoE block: duck-typed
        if hf.gate.weight.is_meta:
            hf.gate.to_empty(device=dense.router.weight.device)
            hf.experts.to_empty(device=dense.router.weight.device)
        assert dense.experts.gate is not None
        pairs = (
            (hf.gate.weight, dense.router.weight, None),
            (hf.experts.gate_up_proj, dense.experts.gate, dense.experts.up),
            (hf.experts.down_proj, dense.experts.down, None),
        )
        for target, a, b in pairs:
            target.copy_(a if b is None else torch.cat([a, b], dim=1))
            if grads:
                ga = a.grad if a.grad is not None else torch.zeros_like(a)
                gb = None if b is None else (b.grad if b.grad is not None else torch.zeros_like(b))
                target.grad = ga.clone() if gb is None else torch.cat([ga, gb], dim=1)
        return block


class GatedSharedMoEBlock(HFMoEBlock):
    """Qwen2-MoE's sparse block: the routed experts (``HFMoEBlock``) plus its shared expert (a dense
    ``Qwen2MoeMLP``, its linears chained as Llama's MLP: input and output split over x) scaled per
    token by sigmoid(``shared_expert_gate``(x)) (a ``SharedGate``)."""

    def __init__(self, original: nn.Module, cfg: ModelConfig, grid: Grid):
        super().__init__(original, cfg, grid)
        block = cast(Any, original)
        self.shared_expert = block.shared_expert  # its linears replaced by the style
        self.shared_expert_gate = block.shared_expert_gate  # replaced by a SharedGate by the style

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden_states) + self.shared_expert_gate(hidden_states) * self.shared_expert(hidden_states)

    def _dense_parts(self, grads: bool) -> dict[int, Any]:
        from axon4d.parallelize.walk import to_dense  # walk imports this module

        hf = cast(Any, self.template[0])
        gate = cast(Any, self.shared_expert_gate)
        return {
            id(hf.shared_expert): to_dense(self.shared_expert, grads=grads),
            id(hf.shared_expert_gate): gate.to_dense(grads=grads) if hasattr(gate, "to_dense") else gate,
        }


class SharedGate(nn.Module):
    """Qwen2-MoE's ``shared_expert_gate`` (Linear hidden → 1, no bias) followed by the sigmoid the
    block applies, on the residual layout (…, hidden/G_x): the weight is whole on every rank, each
    x rank's partial dot product is summed over x, and the gate (used by every x rank on its own
    features) has its gradient summed over x; the weight's gradient is summed over x (each rank
    has its columns') and averaged over batch."""

    def __init__(self, original: nn.Module, grid: Grid):
        super().__init__()
        self.weight = cast(nn.Parameter, original.weight)
        self.grid = grid
        self.template = [original]
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.grid
        cols = x.shape[-1]
        start = grid.coord("x") * cols
        w = use_replicated(self.weight, "x", grid, Term.REPLICATED_GRAD)[:, start : start + cols]
        logit = sum_to_replicas(x @ w.t().to(x.dtype), "x", grid)  # (…, 1), the same on every x rank
        return use_replicated(torch.sigmoid(logit), "x", grid, Term.REPLICATED_GRAD)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        return _dense_copy(self.template[0], self.weight, grads)


class FeatureNorm(nn.Module):
    """An RMSNorm over all heads' features (OLMoE's q_norm, k_norm over heads·head_dim) of this
    rank's heads (…, heads/G_y · head_dim): the sum of squares is summed over y; the whole weight
    on every rank, this rank's slice used, its gradient summed over y and averaged over batch."""

    def __init__(self, original: nn.Module, grid: Grid):
        super().__init__()
        norm = cast(Any, original)
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        self.grid = grid
        self.template = [original]
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid, dtype, n = self.grid, x.dtype, self.weight.shape[0]
        h = x.float()
        squares = sum_partials(h.pow(2).sum(-1, keepdim=True), "y", grid)
        h = h * torch.rsqrt(squares / n + self.eps)
        start = grid.coord("y") * x.shape[-1]
        w = use_replicated(self.weight, "y", grid, Term.REPLICATED_GRAD)[start : start + x.shape[-1]]
        return w * h.to(dtype)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:
        return _dense_copy(self.template[0], self.weight, grads)


def _dense_copy(template: nn.Module, weight: torch.Tensor, grads: bool) -> nn.Module:
    """A copy of ``template`` (a module with one parameter, ``weight``) holding ``weight`` (and its gradient)."""
    dense = copy.deepcopy(template)
    target = cast(nn.Parameter, cast(Any, dense).weight)
    if target.is_meta:
        dense.to_empty(device=weight.device)
        target = cast(nn.Parameter, cast(Any, dense).weight)
    target.copy_(weight)
    target.grad = weight.grad.clone() if grads and weight.grad is not None else None
    return dense


def sharded_style(name: str, m: nn.Module, grid: Grid) -> BlockStyle | None:
    """A Mixtral or Qwen3-MoE causal LM with its residual stream split over x (module docstring):
    attention and dense MLPs as Llama's, every sparse MoE block an ``HFMoEBlock``. Raises a
    ``ValueError`` naming the rule and the grids that work when the grid cannot place it."""
    hf = cast(Any, m)
    body_cls, layer_cls, block_cls = MODELS[type(m).__name__]
    body: Any = getattr(m, "model", None)
    if type(body).__name__ != body_cls or not all(type(layer).__name__ == layer_cls for layer in body.layers):
        raise _refuse(m, "its structure is not the one its class is known by")
    cfg = hf.config
    require_heads(name, "num_attention_heads", cfg.num_attention_heads, grid)
    require_heads(name, "num_key_value_heads", cfg.num_key_value_heads, grid)
    sparse = [i for i, layer in enumerate(body.layers) if type(layer.mlp).__name__ == block_cls]
    mcfg = moe_config(cfg, len(sparse))
    rules.check(grid.shape, placement_rules(mcfg))  # experts over batch, their FFN over y, hidden over x
    norm = sharded_norm_builder(grid)

    def moe_block(block: nn.Module) -> nn.Module:
        return (
            GatedSharedMoEBlock(block, mcfg, grid) if hasattr(block, "shared_expert") else HFMoEBlock(block, mcfg, grid)
        )

    def head_norm(n: nn.Module) -> nn.Module:
        return HeadNorm(n, grid)

    def feature_norm(n: nn.Module) -> nn.Module:
        return FeatureNorm(n, grid)

    def shared_gate(n: nn.Module) -> nn.Module:
        return SharedGate(n, grid)

    aux = RouterAux(cfg, grid)  # transformers' balance loss when output_router_logits is asked
    style = BlockStyle(
        {},
        replace={"model.norm": norm},
        pre_hooks={"model": marked(lambda mod, args, kwargs: aux.pre(mod, args, kwargs))},
        post_hooks={
            "model": marked(lambda mod, args, out: aux.post(mod, args, out)),
            "": marked(lambda mod, args, out: aux.fix(mod, args, out)),
        },
    )
    users: dict[int, list[str]] = {}  # id(parameter) → names of the modules holding it
    for mod_name, mod in m.named_modules(remove_duplicate=False):
        for q in mod.parameters(recurse=False):
            users.setdefault(id(q), []).append(mod_name)
    for i, layer in enumerate(body.layers):
        p = f"model.layers.{i}"
        attn = [f"{p}.self_attn.{c}" for c in ("q_proj", "k_proj", "v_proj")]
        style.linears.update(dict.fromkeys(attn, NORMAL_SPLIT))
        style.linears[f"{p}.self_attn.o_proj"] = TRANSPOSED_SPLIT
        style.replace.update({f"{p}.input_layernorm": norm, f"{p}.post_attention_layernorm": norm})
        for qk in ("q_norm", "k_norm"):
            if hasattr(layer.self_attn, qk):  # per head (Qwen3-MoE) or over all heads (OLMoE)
                per_head = getattr(layer.self_attn, qk).weight.shape[0] == layer.self_attn.head_dim
                style.replace[f"{p}.self_attn.{qk}"] = head_norm if per_head else feature_norm
        if i in sparse:
            style.replace[f"{p}.mlp"] = moe_block
            if hasattr(layer.mlp, "shared_expert"):  # Qwen2-MoE: chained as a dense MLP, its gate over x
                shared = f"{p}.mlp.shared_expert"
                style.linears.update({f"{shared}.{c}": NORMAL_SPLIT for c in ("gate_proj", "up_proj")})
                style.linears[f"{shared}.down_proj"] = TRANSPOSED_SPLIT
                style.replace[f"{p}.mlp.shared_expert_gate"] = shared_gate
        elif type(layer.mlp).__name__ in DENSE_MLPS:
            style.linears.update({f"{p}.mlp.{c}": NORMAL_SPLIT for c in ("gate_proj", "up_proj")})
            style.linears[f"{p}.mlp.down_proj"] = TRANSPOSED_SPLIT
        else:
            raise _refuse(m, f"layer {i}'s MLP is a {type(layer.mlp).__name__}")
    modules = dict(m.named_modules())
    for lin, s in style.linears.items():
        problem = linear_problem(lin, modules[lin], s.transpose, grid, users)
        if problem:
            raise ValueError(f"{type(m).__name__}: {lin} {problem} on grid {grid.shape}; choose a grid that divides it")
    sharded_edges(style, grid, "model.embed_tokens", body.embed_tokens, "lm_head", hf.lm_head)
    return style


#: a Hugging Face MoE block's tensor (relative to the block) → (the ``HFMoEBlock`` tensors, as
#: checkpoints save them, that make it; the dim they are stacked along)
HF_TENSORS: dict[str, tuple[tuple[str, ...], int]] = {
    "gate.weight": (("moe.router.weight",), 0),
    "experts.gate_up_proj": (("moe.experts.up.gate", "moe.experts.up.up"), 1),
    "experts.down_proj": (("moe.experts.down",), 0),
}


def saved_sources(name: str, saved: dict[str, tuple[int, ...]]) -> tuple[list[str], int] | None:
    """(the saved tensors that make the Hugging Face tensor ``name``, their stacking dim) when
    ``name`` is a tensor of an MoE block that an ``HFMoEBlock`` replaced and ``saved`` holds them;
    None otherwise."""
    for rel, (parts, dim) in HF_TENSORS.items():
        if name.endswith(f".{rel}"):
            block = name[: -len(rel) - 1]
            keys = [f"{block}.{p}" for p in parts]
            if all(k in saved for k in keys):
                return keys, dim
    return None


def moe_blocks(model: nn.Module) -> list[tuple[str, HFMoEBlock]]:
    """(name, block) of every ``HFMoEBlock`` of ``model``."""
    return [(n, b) for n, b in model.named_modules() if isinstance(b, HFMoEBlock)]


#: class name → its whole-model style under "sharded"
SHARDED_STYLES: dict[str, StyleFn] = dict.fromkeys(MODELS, sharded_style)
