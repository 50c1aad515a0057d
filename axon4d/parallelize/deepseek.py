"""transformers' DeepSeek-V3 under ``auto_parallelize`` (docs/moe.md, "DeepSeek-V3 from Hugging Face"):
its attention and what of its configuration the grid implements.

``HFMLA`` stands where ``DeepseekV3Attention`` was: axon4d's grid MLA (``axon4d.nn.mla.MLA``, heads
over y, ``q_b_proj``/``q_proj``, ``kv_b_proj`` and ``o_proj`` 3D layers, the down projections and
latent norms whole on every rank). Its parts carry transformers' names and row order, so a
checkpoint of transformers' loads into it by slices, and ``axon4d export-hf`` writes it back under
the same names. The rotary tables are the ones the model computes for the layer
(``position_embeddings``), the softmax scale the attention module's own (``scaling``).

Rotary scaling (YaRN, DeepSeek-V3's published setting) is therefore the model's own: its tables
carry the frequency ramps and ``scaling`` the mscale. Selective recomputation
(``auto_parallelize(recompute="selective")``) recomputes MLA's core (``MLA.recompute_core``), full
recomputation re-runs the decoder layer with MLA's 3D layers in it.

``refusal(config)`` says, in one line, what of a DeepSeek-V3 configuration is not implemented:
key/value heads fewer than the query heads. At the first forward ``HFMLA`` refuses a key/value cache
and a sequence split over z (context parallelism, which ``auto_parallelize`` refuses first: it
finds no q/k/v attention to split).
``moe_fields(config)`` gives the routing fields of its sparse blocks (sigmoid scores, the fixed
``e_score_correction_bias`` for the choice, group-limited routing, ``routed_scaling_factor``).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.nn.mla import MLA
from axon4d.parallelize.context import ATTENTION_NAME
from axon4d.parallelize.recompute import SELECTIVE_PREFIX

#: the causal LM class, its body's and decoder layer's, its sparse block's and its dense MLP's
CLASSES = ("DeepseekV3ForCausalLM", "DeepseekV3Model", "DeepseekV3DecoderLayer", "DeepseekV3MoE", "DeepseekV3MLP")


def refusal(config: Any) -> str | None:
    """What of the DeepSeek-V3 ``config`` the grid does not implement (the first such thing), None when all is."""
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
    if kv != heads:
        return f"num_key_value_heads = {kv} ≠ num_attention_heads = {heads}: MLA's kv_b_proj makes every head's keys"
    if int(getattr(config, "n_routed_experts", 0) or 0) % int(getattr(config, "n_group", 1) or 1):
        return f"n_routed_experts = {config.n_routed_experts} is not divisible by n_group = {config.n_group}"
    return None


def moe_fields(config: Any) -> dict[str, Any]:
    """The ``ModelConfig`` routing fields of DeepSeek-V3's sparse blocks (``axon4d.parallelize.moe.moe_config``)."""
    return dict(
        n_experts=int(config.n_routed_experts),
        expert_ffn=int(config.moe_intermediate_size),
        ffn_hidden=int(config.moe_intermediate_size),
        router_scoring="sigmoid",
        router_topk_norm=bool(config.norm_topk_prob),
        n_groups=int(config.n_group or 1),
        topk_groups=int(config.topk_group) if config.topk_group else None,
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


def is_sparse_layer(config: Any, i: int) -> bool:
    """Whether decoder layer ``i`` of a DeepSeek-V3 ``config`` is sparse: from ``first_k_dense_replace`` on."""
    return int(getattr(config, "n_routed_experts", 0) or 0) > 0 and i >= int(config.first_k_dense_replace or 0)


class HFMLA(MLA):
    """axon4d's grid MLA where transformers' ``DeepseekV3Attention`` was: (b, s, hidden/G_x) →
    ((b, s, hidden/G_x), None), split over x, replicated over y (module docstring)."""

    def __init__(self, original: nn.Module, grid: Grid):
        attn = cast(Any, original)  # transformers' DeepseekV3Attention: duck-typed
        config = attn.config
        w = attn.kv_b_proj.weight
        super().__init__(
            int(config.hidden_size),
            int(config.num_attention_heads),
            grid=grid,
            device=w.device,
            dtype=w.dtype,
            q_lora_rank=attn.q_lora_rank,
            kv_lora_rank=int(attn.kv_lora_rank),
            qk_nope_head_dim=int(attn.qk_nope_head_dim),
            qk_rope_head_dim=int(attn.qk_rope_head_dim),
            v_head_dim=int(attn.v_head_dim),
            bias=bool(config.attention_bias),
            rope_theta=float(config.rope_parameters["rope_theta"]),
            rope_interleave=bool(config.rope_interleave),
            norm_eps=float(attn.kv_a_layernorm.variance_epsilon),
            softmax_scale=float(attn.scaling),
        )
        self.config = config
        self.template = [original]  # what to_dense returns; in a list: not a submodule
        if not w.is_meta:
            self.load_dense_(original)

    def forward(  # type: ignore[override]  # transformers' attention signature
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        implementation = str(getattr(self.config, "_attn_implementation", None))
        if implementation == ATTENTION_NAME:
            raise ValueError(
                "DeepseekV3ForCausalLM with context parallelism: MLA's core is not split over z; "
                "run it with context_parallel=False"
            )
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("DeepseekV3ForCausalLM on the grid runs without a key/value cache; pass use_cache=False")
        self.recompute_core = implementation.startswith(SELECTIVE_PREFIX)  # recompute="selective"
        return super().forward(hidden_states, position_embeddings), None

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Module:  # type: ignore[override]  # transformers' module
        """transformers' attention module with the full weights (and ``.grad``), on every rank."""
        dense = super().to_dense(grads)
        hf = copy.deepcopy(self.template[0])
        if any(p.is_meta for p in hf.parameters()):
            hf.to_empty(device=self.o_proj.weight.device)
        mine = dict(dense.named_parameters())
        for name, p in hf.named_parameters():
            p.copy_(mine[name])
            g = mine[name].grad
            p.grad = g.clone() if grads and g is not None else None
        return hf
