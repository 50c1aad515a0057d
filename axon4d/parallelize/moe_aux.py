"""transformers' router outputs for Hugging Face MoE models under ``auto_parallelize``
(``output_router_logits``; docs/parallelize.md): ``HFMoE``, the grid MoE layer that records its
router logits for transformers' output, and ``RouterAux``, transformers' pooled load-balancing loss
computed exactly as each rank's share.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from axon4d.config import ModelConfig
from axon4d.grid.mesh import Grid
from axon4d.nn.moe import MoE


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
        """The model's grid MoE layers, one per sparse block, in module order."""
        return [m for m in module.modules() if isinstance(m, HFMoE)]

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
