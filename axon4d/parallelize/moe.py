"""Hugging Face Mixture-of-Experts causal LMs under ``auto_parallelize`` (docs/parallelize.md,
"Mixture-of-Experts models"; docs/moe.md).

The sharded style of the llama-built MoE families (``MODELS``: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE) keeps the
residual stream split over x as for Llama (``axon4d.parallelize.llama``) and puts an ``HFMoEBlock``
— axon4d's grid MoE layer (``axon4d.nn.moe.MoE``, E14–E18) — in place of every sparse MoE block:

- the router ``gate.weight`` (E, hidden) becomes ``MoE.router`` (split over x); Mixtral's gates
  are its top-k softmax scores renormalised (``router_topk_norm=True``), Qwen3-MoE's, Qwen2-MoE's and
  OLMoE's renormalised when ``norm_topk_prob`` (else taken as they are);
- the fused experts ``experts.gate_up_proj`` (E, 2I, hidden) = [gate | up] and
  ``experts.down_proj`` (E, hidden, I) become ``MoE.experts``, placed by the expert layout
  (``auto_parallelize(expert_layout=...)``, else the grid's; by default experts over batch =
  data × z, each split over x·y), up stored as [gate_j | up_j] per y chunk;
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
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.mesh import Grid
from axon4d.nn.moe_dense import DenseMoE
from axon4d.nn.moe_experts import check_layout
from axon4d.parallelize import deepseek
from axon4d.parallelize.dense import to_dense
from axon4d.parallelize.layers import linear_problem, owned_by_axon4d, sharded_norm_builder
from axon4d.parallelize.moe_aux import HFMoE, RouterAux
from axon4d.parallelize.moe_parts import FeatureNorm, HeadNorm, SharedGate
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
    deepseek.CLASSES[0]: deepseek.CLASSES[1:4],
}
#: the dense MLP class of a family's non-MoE layers
DENSE_MLPS = ("Qwen3MoeMLP", "MixtralMLP", "Qwen2MoeMLP", "OlmoeMLP", deepseek.CLASSES[4])
#: what the refusal of an unsupported MoE model lists
SUPPORTED = (
    "MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (its sigmoid-gated shared expert), "
    "OlmoeForCausalLM (softmax top-k routers, renormalised or not) and DeepseekV3ForCausalLM (MLA, grouped sigmoid "
    "routing with its fixed correction bias, a shared expert; SiLU-gated experts, style='sharded')"
)
#: why a known MoE family is refused: what of it is not implemented
REFUSED = {
    "GptOssForCausalLM": "its experts (biased, clamped SwiGLU), biased router and attention sinks are not implemented",
}
#: config fields by which a Hugging Face config says its model has routed experts
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def moe_config(config: Any, n_moe_layers: int) -> ModelConfig:
    """The ``ModelConfig`` of one sparse MoE block of a Mixtral or Qwen3-MoE ``config`` (only the
    fields ``MoE`` reads are meaningful)."""
    mixtral = config.model_type == "mixtral"
    k = int(config.num_experts_per_tok)
    fields: dict[str, Any]
    if config.model_type == "deepseek_v3":
        fields = deepseek.moe_fields(config)
    else:
        ffn = int(config.intermediate_size if mixtral or config.model_type == "olmoe" else config.moe_intermediate_size)
        fields = dict(
            n_experts=int(config.num_local_experts if mixtral else config.num_experts),
            ffn_hidden=ffn,
            expert_ffn=ffn,
            router_topk_norm=True if mixtral else bool(config.norm_topk_prob),
        )
    return ModelConfig(
        n_layers=1,
        hidden=int(config.hidden_size),
        n_heads=1,
        arch="llama",
        experts_per_token=k,
        moe_aux_coef=0.0,  # transformers' pooled balance loss instead: ``RouterAux``
        moe_z_coef=0.0,
        name=str(config.model_type),
        **fields,
    )


def is_sparse_layer(config: Any, i: int) -> bool:
    """Whether decoder layer ``i`` of a Mixtral or Qwen3-MoE ``config`` is a sparse MoE block
    (Qwen3-MoE: not in ``mlp_only_layers`` and (i + 1) divisible by ``decoder_sparse_step``)."""
    if config.model_type in ("mixtral", "olmoe"):
        return True
    if config.model_type == "deepseek_v3":
        return deepseek.is_sparse_layer(config, i)
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
    why = deepseek.refusal(config) if name == deepseek.CLASSES[0] else None
    if why:
        raise _refuse(model, why)


class HFMoEBlock(nn.Module):
    """axon4d's grid MoE layer where a Hugging Face sparse MoE block was: (b, s, hidden/G_x) →
    (b, s, hidden/G_x), split over x, replicated over y (module docstring). ``to_dense`` gives back
    the block with fused ``gate.weight``, ``experts.gate_up_proj`` and ``experts.down_proj``."""

    def __init__(self, original: nn.Module, cfg: ModelConfig, grid: Grid, layout: ExpertLayout | None = None):
        super().__init__()
        block = cast(Any, original)
        w = block.gate.weight
        self.moe = HFMoE(cfg, grid=grid, device=w.device, dtype=w.dtype, layout=layout)
        self.template = [original]
        bias = getattr(block.gate, "e_score_correction_bias", None)  # DeepSeek-V3: fixed, ranks the choice only
        if bias is not None:  # the balancing bias of moe_router.choose, never moved (moe_bias_update_rate 0)
            self.moe.register_buffer("expert_bias", bias.detach().clone().float())
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
        bias = getattr(hf.gate, "e_score_correction_bias", None)
        if bias is not None and self.moe.expert_bias is not None:
            hf.gate.e_score_correction_bias = self.moe.expert_bias.detach().clone().to(bias.dtype)
        return block


class GatedSharedMoEBlock(HFMoEBlock):
    """Qwen2-MoE's sparse block: the routed experts (``HFMoEBlock``) plus its shared expert (a dense
    ``Qwen2MoeMLP``, its linears chained as Llama's MLP: input and output split over x) scaled per
    token by sigmoid(``shared_expert_gate``(x)) (a ``SharedGate``)."""

    def __init__(self, original: nn.Module, cfg: ModelConfig, grid: Grid, layout: ExpertLayout | None = None):
        super().__init__(original, cfg, grid, layout)
        block = cast(Any, original)
        self.shared_expert = block.shared_expert  # its linears replaced by the style
        self.shared_expert_gate = block.shared_expert_gate  # replaced by a SharedGate by the style

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden_states) + self.shared_expert_gate(hidden_states) * self.shared_expert(hidden_states)

    def _dense_parts(self, grads: bool) -> dict[int, Any]:
        hf = cast(Any, self.template[0])
        gate = cast(Any, self.shared_expert_gate)
        return {
            id(hf.shared_expert): to_dense(self.shared_expert, grads=grads),
            id(hf.shared_expert_gate): gate.to_dense(grads=grads) if hasattr(gate, "to_dense") else gate,
        }


class SharedMoEBlock(HFMoEBlock):
    """DeepSeek-V3's sparse block: the routed experts (``HFMoEBlock``) plus its shared experts, one
    dense ``DeepseekV3MLP`` every token passes through, its linears chained as Llama's MLP."""

    def __init__(self, original: nn.Module, cfg: ModelConfig, grid: Grid, layout: ExpertLayout | None = None):
        super().__init__(original, cfg, grid, layout)
        self.shared_experts = cast(Any, original).shared_experts  # its linears replaced by the style

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden_states) + self.shared_experts(hidden_states)

    def _dense_parts(self, grads: bool) -> dict[int, Any]:
        hf = cast(Any, self.template[0])
        return {id(hf.shared_experts): to_dense(self.shared_experts, grads=grads)}


def sharded_style(name: str, m: nn.Module, grid: Grid, layout: ExpertLayout | str | None = None) -> BlockStyle | None:
    """A Mixtral or Qwen3-MoE causal LM with its residual stream split over x (module docstring):
    attention and dense MLPs as Llama's, every sparse MoE block an ``HFMoEBlock`` whose experts
    run in ``layout`` (``axon4d.grid.expert_layout``; None: the grid's). Raises a ``ValueError``
    naming the rule and the layouts that fit when the grid cannot place the experts so."""
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
    lay = ExpertLayout.parse(layout if layout is not None else grid.expert_layout)
    try:  # E over the expert-parallel axes, their FFN over y where y splits them, hidden over x
        check_layout(mcfg, grid, lay)
    except ValueError as e:
        raise ValueError(f"{type(m).__name__} under expert layout {lay}: {e}") from None
    norm = sharded_norm_builder(grid)

    def moe_block(block: nn.Module) -> nn.Module:
        kind = GatedSharedMoEBlock if hasattr(block, "shared_expert") else HFMoEBlock
        kind = SharedMoEBlock if hasattr(block, "shared_experts") else kind
        return kind(block, mcfg, grid, lay)

    def mla(n: nn.Module) -> nn.Module:
        return deepseek.HFMLA(n, grid)

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
        if hasattr(layer.self_attn, "kv_a_proj_with_mqa"):  # DeepSeek-V3's multi-head latent attention
            style.replace[f"{p}.self_attn"] = mla
        else:
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
            if hasattr(layer.mlp, "shared_experts"):  # DeepSeek-V3: chained as a dense MLP, no gate
                shared = f"{p}.mlp.shared_experts"
                style.linears.update({f"{shared}.{c}": NORMAL_SPLIT for c in ("gate_proj", "up_proj")})
                style.linears[f"{shared}.down_proj"] = TRANSPOSED_SPLIT
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
    "gate.e_score_correction_bias": (("moe.expert_bias",), 0),  # DeepSeek-V3's routing bias: a buffer
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


def sharded_styles(layout: ExpertLayout | str | None = None) -> dict[str, StyleFn]:
    """Class name → its whole-model style under "sharded", its experts in ``layout`` (None: the grid's)."""

    def style(name: str, m: nn.Module, grid: Grid) -> BlockStyle | None:
        return sharded_style(name, m, grid, layout)

    return dict.fromkeys(MODELS, style)


#: class name → its whole-model style under "sharded" (experts in the grid's layout)
SHARDED_STYLES: dict[str, StyleFn] = sharded_styles()
