"""axon4d's Transformer in Hugging Face's terms: the config and the name and layout of every tensor.

A GPT exports as ``GPT2LMHeadModel`` and a Llama as ``LlamaForCausalLM`` (axon4d.export writes
them). Each exported tensor (``Exported``) is made of tensors as a checkpoint saves them
(``axon4d.layout.param_layout``: a parameter's name, or ``<name>.<segment>`` for the fused q | k | v and
gate | up rows), stacked along the output features (dim 0 of an (out, in) weight):

- Llama: q, k, v (GQA: k and v have n_kv_heads·head_dim rows) become ``q_proj``, ``k_proj``,
  ``v_proj``; gate and up ``gate_proj`` and ``up_proj``. Rotary embeddings need no permutation:
  axon4d rotates the two halves of each head (``axon4d.nn.attention.apply_rotary``), as
  transformers' Llama does (``rotate_half``), with the same frequencies θ^(−2i/d). The head is its
  own tensor (``tie_word_embeddings=False``); no biases.
- GPT-2: its ``Conv1D`` stores a weight as (in, out): every linear weight is written transposed;
  q, k, v are stacked into ``c_attn``, weight and bias. Exact GELU (``activation_function="gelu"``,
  not GPT-2's tanh approximation), no dropout, an untied ``lm_head``; GPT-2 has no grouped-query
  attention, so a GPT with n_kv_heads ≠ n_heads has no export.
- A Llama with Mixture-of-Experts blocks exports as ``MixtralForCausalLM``: the router
  ``blocks.<i>.mlp.router.weight`` becomes ``mlp.gate.weight``, the experts' gate and up (E, f,
  hidden) are stacked along dim 1 into ``mlp.experts.gate_up_proj`` (E, 2f, hidden) = [gate | up]
  and ``mlp.experts.down`` is ``mlp.experts.down_proj`` (E, hidden, f). Mixtral's router is a
  softmax top-k whose gates are always renormalised, with no shared expert and every block sparse.
  With shared experts it exports as ``Qwen2MoeForCausalLM`` (gates renormalised or not,
  ``norm_topk_prob``): the shared MLP is ``mlp.shared_expert``, which Qwen2-MoE scales by
  sigmoid(``shared_expert_gate``·x), so the gate's weight is written as zeros (a factor 1/2) and the
  shared ``down_proj`` doubled (``Exported.scale``: powers of two, exact). Another router (sigmoid
  scores, un-normalised gates without a shared expert, DeepSeek-V3's groups, bias or scaling) or
  dense blocks have no exact counterpart and are refused in one line (``moe_refusal``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from axon4d.config import ModelConfig

#: the Hugging Face class each arch exports as
ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
#: the Hugging Face class a llama-arch Mixture-of-Experts model exports as (without, with shared experts)
MOE_ARCHITECTURE = "MixtralForCausalLM"
SHARED_ARCHITECTURE = "Qwen2MoeForCausalLM"


@dataclasses.dataclass(frozen=True)
class Source:
    """A tensor as a checkpoint saves it, and where it lies in an exported tensor."""

    key: str
    """Its name: a parameter's (``blocks.0.attn.out.weight``), or ``<name>.<segment>`` of fused rows."""
    shape: tuple[int, ...]
    """Its global shape: (out, in) for a weight, (out,) for a bias."""
    row0: int = 0
    """The first of its rows (along ``dim``) among the exported tensor's."""
    dim: int = 0
    """The dim sources are stacked along (1: a Mixture-of-Experts block's fused [gate | up] experts)."""


@dataclasses.dataclass(frozen=True)
class Exported:
    """One tensor of the exported checkpoint: its sources stacked along dim 0, transposed if it is
    a ``Conv1D``'s (in, out) weight."""

    name: str
    shape: tuple[int, ...]
    """Its shape in the file."""
    sources: tuple[Source, ...]
    transposed: bool = False
    scale: float = 1.0
    """The stacked sources multiplied by it (a power of two: exact); 0: zeros, the sources read for
    their dtype only."""


def _special_id(value: int, vocab_size: int) -> int | None:
    """A default special token id, or None where the vocabulary has no such id."""
    return value if value < vocab_size else None


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config of the model ``cfg`` describes: ``Qwen2MoeConfig`` (MoE with shared
    experts), ``MixtralConfig`` (MoE without), ``LlamaConfig`` or ``GPT2Config``."""
    check_exportable(cfg)
    common: dict[str, Any] = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=False)
    if cfg.moe and cfg.shared_experts:
        config, arch = _qwen2_moe_config(cfg, common), SHARED_ARCHITECTURE
    elif cfg.moe:
        config, arch = _mixtral_config(cfg, common), MOE_ARCHITECTURE
    elif cfg.arch == "llama":
        config, arch = _llama_config(cfg, common), ARCHITECTURES[cfg.arch]
    else:
        config, arch = _gpt2_config(cfg, common), ARCHITECTURES[cfg.arch]
    config.architectures = [arch]
    return config


def _llama_attention(cfg: ModelConfig) -> dict[str, Any]:
    """The fields a Llama-built transformers config shares: sizes, heads, positions, norm, rotary, SiLU."""
    return dict(
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        hidden_act="silu",
        bos_token_id=_special_id(1, cfg.vocab_size),
        eos_token_id=_special_id(2, cfg.vocab_size),
    )


def _qwen2_moe_config(cfg: ModelConfig, common: dict[str, Any]) -> Any:
    """An MoE model with shared experts as ``Qwen2MoeConfig`` (every layer sparse)."""
    from transformers import Qwen2MoeConfig  # an optional dependency

    k, norm = cfg.experts_per_token, cfg.router_topk_norm
    return Qwen2MoeConfig(
        intermediate_size=cfg.ffn,
        moe_intermediate_size=cfg.expert_width,
        shared_expert_intermediate_size=cfg.shared_experts * cfg.expert_width,
        use_sliding_window=False,
        qkv_bias=False,
        num_experts=cfg.n_experts,
        num_experts_per_tok=k,
        norm_topk_prob=bool(norm if norm is not None else k > 1),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=cfg.moe_aux_coef,
        output_router_logits=False,
        **_llama_attention(cfg),
        **common,
    )


def _mixtral_config(cfg: ModelConfig, common: dict[str, Any]) -> Any:
    """An MoE model without shared experts as ``MixtralConfig``."""
    from transformers import MixtralConfig  # an optional dependency

    return MixtralConfig(
        intermediate_size=cfg.expert_width,
        head_dim=cfg.head_dim,
        sliding_window=None,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        router_jitter_noise=0.0,
        router_aux_loss_coef=cfg.moe_aux_coef,
        output_router_logits=False,
        **_llama_attention(cfg),
        **common,
    )


def _llama_config(cfg: ModelConfig, common: dict[str, Any]) -> Any:
    """A dense Llama as ``LlamaConfig``."""
    from transformers import LlamaConfig  # an optional dependency

    return LlamaConfig(
        intermediate_size=cfg.ffn,
        head_dim=cfg.head_dim,
        attention_bias=False,
        mlp_bias=False,
        **_llama_attention(cfg),
        **common,
    )


def _gpt2_config(cfg: ModelConfig, common: dict[str, Any]) -> Any:
    """A GPT as ``GPT2Config`` (no dropout)."""
    from transformers import GPT2Config  # an optional dependency

    return GPT2Config(
        n_embd=cfg.hidden,
        n_inner=cfg.ffn,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_positions=cfg.seq_len,
        layer_norm_epsilon=cfg.norm_eps,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=_special_id(50256, cfg.vocab_size),
        eos_token_id=_special_id(50256, cfg.vocab_size),
        **common,
    )


def check_exportable(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` if ``cfg`` has no Hugging Face counterpart (a GPT with grouped-query attention)."""
    if cfg.arch not in ARCHITECTURES:
        raise ValueError(f"arch {cfg.arch!r} has no Hugging Face export; axon4d exports {sorted(ARCHITECTURES)}")
    why = moe_refusal(cfg) if cfg.moe else None
    if why:
        raise ValueError(
            f"a Mixture-of-Experts model (n_experts = {cfg.n_experts}) with {why} has no Hugging Face export: "
            f"axon4d exports a llama-arch MoE with softmax top-k routing in every block as {MOE_ARCHITECTURE} "
            f"(gates renormalised, no shared experts) or {SHARED_ARCHITECTURE} (shared experts); save a checkpoint "
            "(axon4d.checkpoint.save) instead"
        )
    if cfg.arch == "gpt" and cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"a GPT with n_kv_heads = {cfg.kv_heads} ≠ n_heads = {cfg.n_heads} has no Hugging Face export: "
            "GPT2LMHeadModel has no grouped-query attention; use arch 'llama' for GQA"
        )


def moe_refusal(cfg: ModelConfig) -> str | None:
    """Why the Mixture-of-Experts model ``cfg`` has no exact ``MixtralForCausalLM`` counterpart (the
    first reason), None when it has one."""
    k, norm = cfg.experts_per_token, cfg.router_topk_norm
    deepseek = {  # DeepSeek-V3's routing fields, where the config has them: their "off" values
        "first_k_dense": 0,
        "n_groups": 1,
        "routed_scaling_factor": 1.0,
        "moe_bias_update_rate": 0.0,
    }
    if cfg.arch != "llama":
        return f"arch {cfg.arch!r} (GELU experts; Mixtral's are SiLU-gated)"
    if cfg.router_scoring != "softmax":
        return f"router_scoring {cfg.router_scoring!r} (Mixtral's router is a softmax)"
    if not cfg.shared_experts and (norm is False or (k == 1 and norm is None)):
        return (
            f"un-normalised top-{k} gates and no shared expert (Mixtral always renormalises; Qwen2-MoE, which "
            "need not, has a shared expert; Qwen3-MoE and OLMoE normalise q and k)"
        )
    for field, off in deepseek.items():
        value = getattr(cfg, field, off)
        if value != off:
            return f"{field} = {value} (DeepSeek-V3 routing; Mixtral has no such option)"
    return None


def stacked(
    name: str, parts: list[tuple[str, tuple[int, ...]]], transposed: bool = False, dim: int = 0, scale: float = 1.0
) -> Exported:
    """The exported tensor ``name`` made of the saved tensors ``parts`` ((key, global shape), in
    order) stacked along ``dim``; (in, out) when ``transposed``."""
    sources, row = [], 0
    for key, shape in parts:
        sources.append(Source(key, shape, row, dim))
        row += shape[dim] if shape else 0
    first = parts[0][1]
    shape = (*first[:dim], row, *first[dim + 1 :]) if first else ()
    return Exported(name, tuple(reversed(shape)) if transposed else shape, tuple(sources), transposed, scale)


def hf_tensors(cfg: ModelConfig) -> list[Exported]:
    """Every tensor of the exported model, in the order transformers' ``state_dict`` lists them."""
    check_exportable(cfg)
    h, f, kv = cfg.hidden, cfg.ffn, cfg.kv_heads * cfg.head_dim
    one = stacked
    if cfg.arch == "llama":
        out = [one("model.embed_tokens.weight", [("tok_emb.weight", (cfg.vocab_size, h))])]
        e, fe = cfg.n_experts, cfg.expert_width
        for i in range(cfg.n_layers):
            b, t = f"blocks.{i}", f"model.layers.{i}"
            mlp = [
                one(f"{t}.mlp.gate_proj.weight", [(f"{b}.mlp.up.weight.gate", (f, h))]),
                one(f"{t}.mlp.up_proj.weight", [(f"{b}.mlp.up.weight.up", (f, h))]),
                one(f"{t}.mlp.down_proj.weight", [(f"{b}.mlp.down.weight", (h, f))]),
            ]
            if cfg.moe:  # Mixtral's fused experts: [gate | up] stacked along dim 1
                ups: list[tuple[str, tuple[int, ...]]] = [
                    (f"{b}.mlp.experts.up.{s}", (e, fe, h)) for s in ("gate", "up")
                ]
                mlp = [
                    one(f"{t}.mlp.gate.weight", [(f"{b}.mlp.router.weight", (e, h))]),
                    one(f"{t}.mlp.experts.gate_up_proj", ups, dim=1),
                    one(f"{t}.mlp.experts.down_proj", [(f"{b}.mlp.experts.down", (e, h, fe))]),
                ]
            if cfg.moe and cfg.shared_experts:  # Qwen2-MoE: sigmoid(0) = 1/2 gates the shared expert, down ×2
                fs, s = cfg.shared_experts * fe, f"{t}.mlp.shared_expert"
                mlp += [
                    one(f"{s}.gate_proj.weight", [(f"{b}.mlp.shared.up.weight.gate", (fs, h))]),
                    one(f"{s}.up_proj.weight", [(f"{b}.mlp.shared.up.weight.up", (fs, h))]),
                    one(f"{s}.down_proj.weight", [(f"{b}.mlp.shared.down.weight", (h, fs))], scale=2.0),
                    Exported(
                        f"{t}.mlp.shared_expert_gate.weight", (1, h), (Source(f"{b}.norm2.weight", (h,)),), scale=0.0
                    ),
                ]
            out += [
                one(f"{t}.self_attn.q_proj.weight", [(f"{b}.attn.qkv.weight.q", (h, h))]),
                one(f"{t}.self_attn.k_proj.weight", [(f"{b}.attn.qkv.weight.k", (kv, h))]),
                one(f"{t}.self_attn.v_proj.weight", [(f"{b}.attn.qkv.weight.v", (kv, h))]),
                one(f"{t}.self_attn.o_proj.weight", [(f"{b}.attn.out.weight", (h, h))]),
                *mlp,
                one(f"{t}.input_layernorm.weight", [(f"{b}.norm1.weight", (h,))]),
                one(f"{t}.post_attention_layernorm.weight", [(f"{b}.norm2.weight", (h,))]),
            ]
        return [
            *out,
            one("model.norm.weight", [("norm.weight", (h,))]),
            one("lm_head.weight", [("head.weight", (cfg.vocab_size, h))]),
        ]
    out = [
        one("transformer.wte.weight", [("tok_emb.weight", (cfg.vocab_size, h))]),
        one("transformer.wpe.weight", [("pos_emb.weight", (cfg.seq_len, h))]),
    ]
    for i in range(cfg.n_layers):
        b, t = f"blocks.{i}", f"transformer.h.{i}"
        qkv = [(f"{b}.attn.qkv.{{}}.{s}", (h,)) for s in "qkv"]
        out += [
            one(f"{t}.ln_1.weight", [(f"{b}.norm1.weight", (h,))]),
            one(f"{t}.ln_1.bias", [(f"{b}.norm1.bias", (h,))]),
            one(f"{t}.attn.c_attn.weight", [(k.format("weight"), (*s, h)) for k, s in qkv], transposed=True),
            one(f"{t}.attn.c_attn.bias", [(k.format("bias"), s) for k, s in qkv]),
            one(f"{t}.attn.c_proj.weight", [(f"{b}.attn.out.weight", (h, h))], transposed=True),
            one(f"{t}.attn.c_proj.bias", [(f"{b}.attn.out.bias", (h,))]),
            one(f"{t}.ln_2.weight", [(f"{b}.norm2.weight", (h,))]),
            one(f"{t}.ln_2.bias", [(f"{b}.norm2.bias", (h,))]),
            one(f"{t}.mlp.c_fc.weight", [(f"{b}.mlp.up.weight", (f, h))], transposed=True),
            one(f"{t}.mlp.c_fc.bias", [(f"{b}.mlp.up.bias", (f,))]),
            one(f"{t}.mlp.c_proj.weight", [(f"{b}.mlp.down.weight", (h, f))], transposed=True),
            one(f"{t}.mlp.c_proj.bias", [(f"{b}.mlp.down.bias", (h,))]),
        ]
    return [
        *out,
        one("transformer.ln_f.weight", [("norm.weight", (h,))]),
        one("transformer.ln_f.bias", [("norm.bias", (h,))]),
        one("lm_head.weight", [("head.weight", (cfg.vocab_size, h))]),
    ]
