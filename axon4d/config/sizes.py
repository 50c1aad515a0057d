"""The size table of docs/design.md §6 by name: ``SIZES`` holds AxoNN's table (5B … 640B, sequence
2048), the Mixture-of-Experts shapes the planner is checked on, and small models for tests and the
demo; ``get_config`` looks one up, ``moe_overrides`` reads the training job's ``--moe``.
"""

from __future__ import annotations

import dataclasses

from axon4d.config.model import ModelConfig


def _table(name: str, layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(n_layers=layers, hidden=hidden, n_heads=heads, vocab_size=51200, seq_len=2048, name=name)


#: AxoNN's reference models (docs/design.md §6) and small ones for tests and the demo.
SIZES: dict[str, ModelConfig] = {
    "5B": _table("5B", 24, 4096, 32),
    "10B": _table("10B", 32, 5120, 40),
    "20B": _table("20B", 32, 7168, 56),
    "40B": _table("40B", 38, 9216, 72),
    "80B": _table("80B", 42, 12288, 96),
    "320B": _table("320B", 96, 16384, 128),
    "640B": _table("640B", 192, 16384, 128),
    "tiny": ModelConfig(n_layers=2, hidden=64, n_heads=4, vocab_size=256, seq_len=32, name="tiny"),
    "small": ModelConfig(n_layers=4, hidden=256, n_heads=8, vocab_size=4096, seq_len=128, name="small"),
    "tiny-moe": ModelConfig(
        n_layers=2,
        hidden=64,
        n_heads=4,
        vocab_size=256,
        seq_len=32,
        arch="llama",
        n_experts=8,
        experts_per_token=2,
        expert_ffn=64,
        shared_experts=1,
        name="tiny-moe",
    ),
    # Llama 3 8B — Meta's "The Llama 3 Herd of Models" (arXiv:2407.21783) Table 3 and the Hugging Face
    # config of meta-llama/Meta-Llama-3-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336
    # (SwiGLU), vocabulary 128256, RoPE θ 500000, sequence 8192; n_params() = 8.0B. The long-context
    # plans (docs/context.md) give it --seq-len.
    "llama3-8b": ModelConfig(
        n_layers=32,
        hidden=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=128256,
        seq_len=8192,
        arch="llama",
        rope_theta=500000.0,
        name="llama3-8b",
    ),
    # Mixture-of-Experts shapes (docs/planner.md, "Mixture of Experts"), each Llama-style (RMSNorm,
    # SwiGLU experts, RoPE), sequence 4096 (the pre-training length of all three sources):
    # Mixtral 8x7B — Jiang et al., "Mixtral of Experts" (arXiv:2401.04088) Table 1 and the Hugging Face
    # config of mistralai/Mixtral-8x7B-v0.1: 32 layers, hidden 4096, 32 heads, 8 KV heads, 8 experts
    # top-2, expert FFN 14336, vocabulary 32000. n_params() = 46.7B total, 12.9B active (the paper's).
    "mixtral-8x7b": ModelConfig(
        n_layers=32,
        hidden=4096,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        seq_len=4096,
        arch="llama",
        n_experts=8,
        experts_per_token=2,
        expert_ffn=14336,
        name="mixtral-8x7b",
    ),
    # DeepSeek-V3 at its scale — DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437) §4.2:
    # 61 layers, hidden 7168, 128 heads, the first 3 blocks dense (FFN 18432), the rest 256 routed
    # experts top-8 and 1 shared expert of FFN 2048, vocabulary 129280; its routing (§2.1.2, §4.2 and
    # the config of deepseek-ai/DeepSeek-V3: n_group 8, topk_group 4, routed_scaling_factor 2.5):
    # sigmoid scores, auxiliary-loss-free bias balancing (update speed 0.001), the experts in 8 groups
    # of which a token's top-8 come from 4 (the node limit), gates scaled by 2.5, the sequence-wise
    # balance loss (α = 0.0001) instead of E19. Simplified: standard multi-head attention (head_dim
    # 56) instead of MLA, no multi-token prediction module: 672B total (the report's 671B: +0.2%)
    # and 38.7B active (37B: +5%, MLA's smaller projections).
    "deepseek-v3-scale": ModelConfig(
        n_layers=61,
        hidden=7168,
        n_heads=128,
        ffn_hidden=18432,
        vocab_size=129280,
        seq_len=4096,
        arch="llama",
        n_experts=256,
        experts_per_token=8,
        expert_ffn=2048,
        shared_experts=1,
        router_scoring="sigmoid",
        moe_aux_coef=0.0,
        moe_bias_update_rate=1e-3,
        n_groups=8,
        topk_groups=4,
        routed_scaling_factor=2.5,
        moe_seq_aux_coef=1e-4,
        first_k_dense=3,
        name="deepseek-v3-scale",
    ),
    # A 1T-parameter MoE — the shape of Kimi K2 (Moonshot AI's Kimi K2 technical report, 2025, and the
    # config of moonshotai/Kimi-K2-Base: 1.04T total, 32B active): DeepSeek-V3's width and depth with the
    # first block dense (FFN 18432, first_k_dense_replace 1) and 384 routed experts top-8, 1 shared, FFN
    # 2048, 64 heads, vocabulary 163840; standard attention instead of MLA (head_dim 112): 1.03T total,
    # 39B active. 384 = 2^7·3 experts split over up to 128 expert-parallel ranks, so 1024 GPUs
    # replicate or split each expert over the other 8.
    "moe-1t": ModelConfig(
        n_layers=61,
        hidden=7168,
        n_heads=64,
        ffn_hidden=18432,
        vocab_size=163840,
        seq_len=4096,
        arch="llama",
        n_experts=384,
        experts_per_token=8,
        expert_ffn=2048,
        shared_experts=1,
        router_scoring="sigmoid",
        first_k_dense=1,
        name="moe-1t",
    ),
    # DeepSeek-V3's routing at tiny-moe's size (docs/moe.md, "DeepSeek-V3 routing"): sigmoid scores,
    # auxiliary-loss-free bias balancing, 4 groups of 2 experts of which a token keeps 2, gates
    # scaled by 2.5, the sequence-wise balance loss instead of E19, a dense first block.
    "tiny-deepseek": ModelConfig(
        n_layers=2,
        hidden=64,
        n_heads=4,
        vocab_size=256,
        seq_len=32,
        arch="llama",
        n_experts=8,
        experts_per_token=2,
        expert_ffn=64,
        shared_experts=1,
        router_scoring="sigmoid",
        moe_aux_coef=0.0,
        moe_bias_update_rate=1e-3,
        n_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        first_k_dense=1,
        moe_seq_aux_coef=1e-4,
        name="tiny-deepseek",
    ),
}


#: the Mixture-of-Experts fields of ``ModelConfig`` and their types: what ``moe_overrides`` sets
MOE_FIELDS: dict[str, type] = {
    "n_experts": int,
    "experts_per_token": int,
    "expert_ffn": int,
    "shared_experts": int,
    "router_scoring": str,
    "moe_aux_coef": float,
    "moe_z_coef": float,
    "moe_bias_update_rate": float,
    "n_groups": int,
    "topk_groups": int,
    "routed_scaling_factor": float,
    "first_k_dense": int,
    "moe_seq_aux_coef": float,
}


def moe_overrides(text: str) -> dict[str, object]:
    """``field=value,…`` of ``MOE_FIELDS`` (the training job's ``--moe``) as ``ModelConfig`` overrides,
    e.g. "n_experts=8,experts_per_token=2,moe_aux_coef=0.02"; "" gives none. A ``ValueError`` names
    an item that is not one of those fields or whose value is not of its type; ``ModelConfig``
    checks the values themselves."""
    out: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = (piece.strip() for piece in item.partition("="))
        kind = MOE_FIELDS.get(name)
        if not eq or kind is None:
            raise ValueError(
                f"--moe item {item!r}: give field=value with a field of {', '.join(MOE_FIELDS)}, "
                "e.g. --moe n_experts=8,experts_per_token=2"
            )
        try:
            out[name] = kind(value)
        except ValueError:
            raise ValueError(
                f"--moe {name}={value!r}: {name} takes a{'n' if kind is int else ''} {kind.__name__}"
            ) from None
    return out


def get_config(name: str, **overrides: object) -> ModelConfig:
    """A config from ``SIZES`` by name (e.g. "20B"), with fields overridden; ValueError lists the names."""
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}; known sizes: {', '.join(SIZES)}")
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"ModelConfig has no field {unknown[0]!r}; its fields are {', '.join(fields)}")
    return SIZES[name].replace(**overrides) if overrides else SIZES[name]
