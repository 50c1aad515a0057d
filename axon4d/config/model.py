"""A transformer's shape: ``ModelConfig``, the model only (no parallelism), checked when made.
The planner prices it, the reference models build it."""

from __future__ import annotations

import dataclasses
import math

from axon4d.grid import counts

#: example values for error messages
_DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-5}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer."""

    n_layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model width (features of the residual stream)."""
    n_heads: int
    """Attention (query) heads; hidden must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: same as n_heads)."""
    ffn_hidden: int | None = None
    """MLP inner width (None: 4·hidden for GPT, the Llama rule ⌈8/3·hidden⌉ rounded to 256)."""
    vocab_size: int = 50304
    """Vocabulary size (a multiple of 128 keeps every vocab split even)."""
    seq_len: int = 2048
    """Training sequence length."""
    arch: str = "gpt"
    """"gpt" (LayerNorm, GELU MLP, learned positions, biases) or "llama" (RMSNorm, SwiGLU, RoPE, no biases)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies (llama)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    name: str = ""
    """A label such as "20B"."""
    n_experts: int = 0
    """Mixture-of-Experts: routed experts per block (0: every block has the dense MLP; docs/moe.md)."""
    experts_per_token: int = 1
    """Top-k: the routed experts each token reaches (1 ≤ k ≤ n_experts)."""
    expert_ffn: int | None = None
    """Inner width of one expert's FFN (None: ``ffn``, the dense MLP's)."""
    shared_experts: int = 0
    """Experts every token passes through besides its routed ones (one MLP of shared_experts·expert_ffn)."""
    router_scoring: str = "softmax"
    """How router logits become scores: "softmax" (Mixtral, Qwen3-MoE, OLMoE) or "sigmoid" (DeepSeek-V3)."""
    router_topk_norm: bool | None = None
    """Whether a token's top-k gates are divided by their sum: None normalises when k > 1 (a single
    normalised gate would be 1), True always (Mixtral), False never (Qwen3-MoE's norm_topk_prob=False)."""
    moe_aux_coef: float = 0.01
    """Weight of the load-balancing loss E·Σ_e f_e·P_e added to the training loss (0: off)."""
    moe_z_coef: float = 0.0
    """Weight of the router z-loss mean_t logsumexp(logits_t)² (0: off)."""
    moe_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for the
    top-k choice only, moves by this rate · sign(mean count − count) after each training-mode
    forward of the layer, from the micro-batch's global counts (0: off, no bias)."""
    n_groups: int = 1
    """Group-limited routing: the experts in this many groups of n_experts/n_groups consecutive ones."""
    topk_groups: int | None = None
    """The groups a token may route to, its best by the sum of their two highest (biased) scores
    (None: all n_groups, no limit)."""
    routed_scaling_factor: float = 1.0
    """The routed experts' gates multiplied by it (DeepSeek-V3: 2.5); 1: as they are."""
    first_k_dense: int = 0
    """The first blocks that keep the dense MLP (of ``ffn``) instead of MoE (DeepSeek-V3: 3)."""
    moe_seq_aux_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, Σ_e f_e·P_e per sequence (0: off)."""

    def __post_init__(self) -> None:
        """Refuse a shape no model can have: every field is checked, and each error names the field,
        its value and a value that would work."""
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"arch {self.arch!r} is not supported; use 'gpt' or 'llama'")
        counts.whole(self.n_layers, "n_layers", unit="blocks", example=24)
        counts.whole(self.hidden, "hidden", unit="features", example=1024)
        counts.whole(self.n_heads, "n_heads", unit="heads", example=8)
        if self.n_kv_heads is not None:
            counts.whole(self.n_kv_heads, "n_kv_heads", unit="heads (or None: as many as n_heads)", example=8)
        if self.ffn_hidden is not None:
            unit = "features (or None: the architecture's rule)"
            counts.whole(self.ffn_hidden, "ffn_hidden", unit=unit, example=4096)
        counts.whole(self.vocab_size, "vocab_size", unit="token ids", example=50304)
        counts.whole(self.seq_len, "seq_len", unit="tokens", example=2048)
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} = {value!r} ({type(value).__name__}) must be a number, e.g. {_DEFAULTS[name]}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} = {value} must be a finite number above 0, e.g. {_DEFAULTS[name]}")
        self._check_moe()
        rotary = "llama's rotary embedding rotates pairs of features; choose hidden and n_heads with an even quotient"
        counts.heads(self.hidden, self.n_heads, self.kv_heads, rotary=rotary if self.arch == "llama" else "")

    def _check_moe(self) -> None:
        """The Mixture-of-Experts fields (docs/moe.md): whole counts, top-k within the experts."""
        counts.whole(self.n_experts, "n_experts", unit="experts (or 0: dense MLP blocks)", example=8, minimum=0)
        counts.whole(self.shared_experts, "shared_experts", unit="experts", example=1, minimum=0)
        counts.whole(self.experts_per_token, "experts_per_token", unit="experts", example=2)
        if self.expert_ffn is not None:
            counts.whole(self.expert_ffn, "expert_ffn", unit="features (or None: ffn)", example=1024)
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router_scoring {self.router_scoring!r} is not supported; use 'softmax' or 'sigmoid'")
        for name in ("moe_aux_coef", "moe_z_coef", "moe_seq_aux_coef", "moe_bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} = {value!r} must be a finite number ≥ 0, e.g. 0.01 (0: off)")
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise ValueError(
                f"experts_per_token = {self.experts_per_token} exceeds n_experts = {self.n_experts}: a token "
                f"cannot reach more experts than there are; use experts_per_token ≤ {self.n_experts}"
            )
        self._check_deepseek()

    def _check_deepseek(self) -> None:
        """DeepSeek-V3's routing fields (docs/moe.md): groups dividing the experts, the groups a
        token keeps holding its k experts, a positive scaling factor, the dense blocks within the model."""
        counts.whole(self.n_groups, "n_groups", unit="expert groups (1: no groups)", example=1)
        counts.whole(self.first_k_dense, "first_k_dense", unit="dense blocks", example=1, minimum=0)
        if self.first_k_dense > self.n_layers:
            raise ValueError(
                f"first_k_dense = {self.first_k_dense} exceeds n_layers = {self.n_layers}; "
                f"use first_k_dense ≤ {self.n_layers}"
            )
        value = self.routed_scaling_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"routed_scaling_factor = {value!r} must be a finite number above 0, e.g. 2.5 (1: off)")
        if self.n_experts and self.n_experts % self.n_groups:
            raise ValueError(
                f"n_experts = {self.n_experts} is not divisible by n_groups = {self.n_groups}: each group "
                f"holds n_experts/n_groups experts; use an n_groups dividing {self.n_experts}"
            )
        if self.topk_groups is not None:
            counts.whole(self.topk_groups, "topk_groups", unit="groups (or None: all)", example=self.n_groups)
            if self.topk_groups > self.n_groups:
                raise ValueError(
                    f"topk_groups = {self.topk_groups} exceeds n_groups = {self.n_groups}; "
                    f"use topk_groups ≤ {self.n_groups}"
                )
            reachable = self.topk_groups * (self.n_experts // self.n_groups)
            if self.n_experts and self.experts_per_token > reachable:
                raise ValueError(
                    f"experts_per_token = {self.experts_per_token} exceeds the {reachable} experts of "
                    f"topk_groups = {self.topk_groups} groups of {self.n_experts // self.n_groups}; "
                    f"raise topk_groups or lower experts_per_token"
                )

    def moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE layer: an MoE model's blocks from
        ``first_k_dense`` on."""
        return self.moe and index >= self.first_k_dense

    @property
    def moe_layers(self) -> int:
        """The blocks with an MoE layer."""
        return self.n_layers - self.first_k_dense if self.moe else 0

    @property
    def moe(self) -> bool:
        """True when the blocks have Mixture-of-Experts layers instead of the dense MLP."""
        return self.n_experts > 0

    @property
    def expert_width(self) -> int:
        """One expert's FFN inner width."""
        return self.expert_ffn if self.expert_ffn is not None else self.ffn

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.arch == "llama":
            return 256 * -(-(8 * self.hidden // 3) // 256)
        return 4 * self.hidden

    @property
    def gated(self) -> bool:
        """True for SwiGLU MLPs (two up-projections)."""
        return self.arch == "llama"

    def linear_shapes(self) -> list[tuple[str, int, int, bool, bool]]:
        """(name, in, out, transpose, bias) of every linear layer of one block, in forward order."""
        bias = self.arch == "gpt"
        qkv_out = (self.n_heads + 2 * self.kv_heads) * self.head_dim
        shapes = [("qkv", self.hidden, qkv_out, False, bias), ("attn_out", self.hidden, self.hidden, True, bias)]
        up_out = 2 * self.ffn if self.gated else self.ffn
        shapes += [("mlp_up", self.hidden, up_out, False, bias), ("mlp_down", self.ffn, self.hidden, True, bias)]
        return shapes

    def n_params(self) -> int:
        """Number of parameters (weights, biases, norms, embeddings)."""
        per_block = sum(i * o + (o if b else 0) for _, i, o, _, b in self.linear_shapes())
        moe_block = per_block
        if self.moe:  # the MLP's GEMMs give way to the router, the experts and the shared experts
            moe_block -= sum(i * o + (o if b else 0) for n, i, o, _, b in self.linear_shapes() if n.startswith("mlp"))
            ups = 3 if self.gated else 2
            moe_block += (
                self.n_experts * self.hidden
                + (self.n_experts + self.shared_experts) * ups * self.hidden * self.expert_width
            )
        norms = 2 * self.hidden * (2 if self.arch == "gpt" else 1)  # two norms (weight, and bias for LayerNorm)
        blocks = self.moe_layers * moe_block + (self.n_layers - self.moe_layers) * per_block
        emb = self.vocab_size * self.hidden
        pos = self.seq_len * self.hidden if self.arch == "gpt" else 0
        head = self.vocab_size * self.hidden
        final_norm = self.hidden * (2 if self.arch == "gpt" else 1)
        return blocks + self.n_layers * norms + emb + pos + head + final_norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·(matmul parameters a token passes through) plus attention scores
        (causal: half). In an MoE model those are the router's, its k routed experts' and the shared
        experts' — not the experts it does not reach (MFU counts the active path)."""
        dense = sum(i * o for _, i, o, _, _ in self.linear_shapes())
        block = sum(i * o for n, i, o, _, _ in self.linear_shapes() if not (self.moe and n.startswith("mlp")))
        if self.moe:
            per_expert = (3 if self.gated else 2) * self.hidden * self.expert_width
            block += self.n_experts * self.hidden + (self.experts_per_token + self.shared_experts) * per_expert
        blocks = (
            block * self.moe_layers + dense * (self.n_layers - self.moe_layers) if self.moe else dense * self.n_layers
        )
        matmul = blocks + self.vocab_size * self.hidden
        attention = 2 * 2 * self.n_layers * self.seq_len * self.hidden / 2  # QKᵀ and AV, causal
        return 6.0 * matmul + 3.0 * attention

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
