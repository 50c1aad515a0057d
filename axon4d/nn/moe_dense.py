"""The single-process Mixture-of-Experts layer: what ``axon4d.nn.moe.MoE`` computes, in plain
PyTorch (docs/moe.md). ``MoE.to_dense`` returns it, the exactness tests compare against it and the
bench (bench/moe_block.py) times it.

    logits = x Wᵣᵀ (fp32)   →  top-k experts and gates (axon4d.nn.moe_router)
    y = Σ_k gate_k · FFN_{expert_k}(x)  [+ shared(x)]

An expert's FFN is the dense MLP's without biases: down(gelu(up x)), or down(silu(gate x)·up x)
for gated (llama) models. Experts are stored stacked: ``gate``/``up`` (E, f, hidden) and ``down``
(E, hidden, f), nn.Linear's (out, in) orientation, initialised as nn.Linear would each expert's
matrices but tile by tile from one seed (``expert_matrices``, ``axon4d.layout.tiled_init``), so that a
rank of the grid draws just its experts' slices and gets these values. Each forward leaves its auxiliary loss
(``aux_loss``: the weighted balance loss plus z-loss, E19–E20) and the tokens per expert
(``tokens_per_expert``) on the module; ``DenseTransformer.loss`` adds the aux losses. DeepSeek-V3's
routing options (bias balancing, groups, scaling, the sequence-wise loss) are the config's
(docs/moe.md, "DeepSeek-V3 routing").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from axon4d.config import ModelConfig
from axon4d.layout import tiled_init
from axon4d.nn import moe_router
from axon4d.nn.mlp import DenseMLP
from axon4d.options import fp8_rows


def expert_matrices(n_experts: int, hidden: int, ffn: int, gated: bool) -> dict[str, tuple[int, int]]:
    """The global matrices the experts' weights are drawn as (``axon4d.layout.tiled_init`` names and
    (rows, cols), ``tiled_init.init_shape`` of the stacked tensors): "experts.gate" and "experts.up"
    (E·f, hidden), expert e's rows e·f … (e + 1)·f; "experts.down" (E·hidden, f), expert e's rows
    e·hidden … (e + 1)·hidden."""
    up, down = tiled_init.init_shape((n_experts, ffn, hidden)), tiled_init.init_shape((n_experts, hidden, ffn))
    return (
        {"experts.gate": up, "experts.up": up, "experts.down": down}
        if gated
        else {"experts.up": up, "experts.down": down}
    )


#: the router weight's global matrix name (E, hidden) for ``axon4d.layout.tiled_init``
ROUTER = "router.weight"


def uniform_for(cols: int) -> tiled_init.Init:
    """torch.nn.Linear's U(−1/√in, 1/√in) for a matrix of ``cols`` inputs."""
    return tiled_init.Init.uniform(1.0 / math.sqrt(cols))


class DenseExperts(nn.Module):
    """E expert FFNs stacked in three (or two) tensors; ``forward_expert(e, x)`` runs one."""

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        ffn: int,
        gated: bool,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.n_experts, self.hidden, self.ffn, self.gated = n_experts, hidden, ffn, gated
        self.gate = nn.Parameter(torch.empty(n_experts, ffn, hidden, **kw)) if gated else None  # type: ignore[arg-type]
        self.up = nn.Parameter(torch.empty(n_experts, ffn, hidden, **kw))  # type: ignore[arg-type]
        self.down = nn.Parameter(torch.empty(n_experts, hidden, ffn, **kw))  # type: ignore[arg-type]
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """As ``torch.nn.Linear`` would each expert's matrices, U(−1/√in, 1/√in), drawn tile by tile
        from ``seed`` (one drawn from torch's generator if None) as ``expert_matrices``."""
        seed = tiled_init.draw_seed() if seed is None else seed
        if self.up.is_meta:
            return
        for name, shape in expert_matrices(self.n_experts, self.hidden, self.ffn, self.gated).items():
            p = getattr(self, name.split(".")[1])
            tiled_init.fill_(p.view(shape), uniform_for(shape[1]), seed, name, shape, 0, 0)

    def forward_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s FFN of rows (n, hidden) → (n, hidden)."""
        h = x @ self.up[e].t()  # (n, f)
        a = F.silu(x @ self.gate[e].t()) * h if self.gate is not None else F.gelu(h)
        return a @ self.down[e].t()  # (n, hidden)


class DenseMoE(nn.Module):
    """The reference MoE layer: (…, hidden) → (…, hidden), routing each token to its top-k experts."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if not cfg.moe:
            raise ValueError("DenseMoE needs a config with n_experts > 0 (ModelConfig(n_experts=8, ...))")
        self.cfg = cfg
        seed = tiled_init.draw_seed()  # the router's and the experts' (``axon4d.nn.moe.MoE`` draws it alike)
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False, device=device, dtype=dtype)
        if not self.router.weight.is_meta:
            shape = (cfg.n_experts, cfg.hidden)
            tiled_init.fill_(self.router.weight.data, uniform_for(cfg.hidden), seed, ROUTER, shape, 0, 0)
        self.experts = DenseExperts(cfg.n_experts, cfg.hidden, cfg.expert_width, cfg.gated, device, dtype, seed)
        shared = cfg.shared_experts * cfg.expert_width
        self.shared = DenseMLP(cfg.hidden, shared, cfg.gated, False, device, dtype) if shared else None
        #: auxiliary-loss-free balancing's per-expert bias (E,) fp32 (``moe_bias_update_rate`` > 0; a
        #: buffer: saved with the model, moved after each training-mode forward, no gradient)
        self.expert_bias: torch.Tensor | None
        bias = torch.zeros(cfg.n_experts, device=device) if cfg.moe_bias_update_rate else None
        self.register_buffer("expert_bias", bias)
        #: the last forward's weighted balance loss + z-loss (0-dim fp32), None before one
        self.aux_loss: torch.Tensor | None = None
        #: the last forward's assignments per expert (E,)
        self.tokens_per_expert: torch.Tensor | None = None
        #: cast each expert's input rows, and in backward its gated output's gradient, as an FP8 dispatch
        #: moves them (``axon4d.options.fp8_rows``; ``MoE.to_dense`` sets it under ``dispatch=fp8``)
        self.fp8_dispatch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x2 = x.reshape(-1, x.shape[-1])  # (T, hidden)
        logits = x2.float() @ self.router.weight.float().t()  # (T, E), fp32
        s = moe_router.scores(logits, cfg.router_scoring)
        experts = moe_router.choose(s, cfg.experts_per_token, self.expert_bias, cfg.n_groups, cfg.topk_groups)
        g = moe_router.gates(s, experts, cfg.router_topk_norm, cfg.routed_scaling_factor)  # (T, k)
        counts = moe_router.expert_counts(experts, cfg.n_experts)
        self.tokens_per_expert = counts
        seq_len = x.shape[-2] if x.dim() > 2 else x2.shape[0]
        self.aux_loss = self._aux(logits, s, counts, x2.shape[0], experts, seq_len)
        if self.expert_bias is not None and self.training:
            moe_router.bias_step(self.expert_bias, counts.tolist(), cfg.moe_bias_update_rate)
        out = torch.zeros_like(x2)  # (T, hidden)
        for e in range(cfg.n_experts):
            token, slot = torch.nonzero(experts == e, as_tuple=True)  # the assignments to e
            if token.numel():
                rows = fp8_rows.cast_rows(x2[token]) if self.fp8_dispatch else x2[token]  # (n_e, hidden)
                y = self.experts.forward_expert(e, rows) * g[token, slot, None].to(x2.dtype)  # gated by the expert
                y = fp8_rows.grad_round_trip(y) if self.fp8_dispatch else y
                out = out.index_add(0, token, y)
        out = out.view(x.shape)
        return out + self.shared(x) if self.shared is not None else out

    def _aux(
        self,
        logits: torch.Tensor,
        s: torch.Tensor,
        counts: torch.Tensor,
        tokens: int,
        experts: torch.Tensor,
        seq_len: int,
    ) -> torch.Tensor:
        """The weighted balance loss, z-loss and sequence-wise balance loss of this forward's tokens
        (E19, E20; sequences of ``seq_len`` tokens)."""
        cfg = self.cfg
        aux = logits.new_zeros(())
        if cfg.moe_aux_coef:
            k = cfg.experts_per_token
            aux = aux + cfg.moe_aux_coef * moe_router.balance_loss(s, counts, tokens * k, tokens, cfg.router_scoring)
        if cfg.moe_z_coef:
            aux = aux + cfg.moe_z_coef * moe_router.z_loss(logits)
        if cfg.moe_seq_aux_coef:
            seq = moe_router.sequence_balance_loss(s, experts, seq_len, cfg.router_scoring)
            aux = aux + cfg.moe_seq_aux_coef * seq
        return aux
