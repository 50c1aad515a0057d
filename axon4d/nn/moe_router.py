"""Routing of a Mixture-of-Experts layer: scores, top-k choice, gates and the router's losses
(docs/moe.md, E14 and E19–E20). Plain tensor functions, the same for the single-process reference
(``axon4d.nn.moe_dense``) and the grid layer (``axon4d.nn.moe``); nothing here communicates.

Everything runs in fp32 on logits (T, E) of T tokens and E experts:

- scores s = softmax(logits) or sigmoid(logits) (``scoring``);
- the k experts of a token are its k highest scores (``torch.topk``; ties go to the lower index);
- gates g = the chosen scores, divided by their sum when k > 1 (so a token's gates add to 1), taken
  as they are when k = 1 (a normalised single gate would be 1 and teach the router nothing) —
  unless the config's ``router_topk_norm`` says always (Mixtral) or never (Qwen3-MoE's
  ``norm_topk_prob=False``);
- the balance loss (E19) E·Σ_e f_e·P_e, with f_e the share of the micro-batch's token–expert
  assignments that went to e (counted over the whole micro-batch, all ranks) and P_e the mean over
  tokens of e's probability (the scores normalised to add to 1 per token);
- the z-loss (E20) mean_t logsumexp(logits_t)².
"""

from __future__ import annotations

import torch


def scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """(T, E) fp32 scores of (T, E) logits: softmax over experts, or an elementwise sigmoid."""
    logits = logits.float()
    return torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)


def choose(s: torch.Tensor, k: int) -> torch.Tensor:
    """(T, k) int64: each token's k experts, highest score first (no autograd)."""
    return torch.topk(s.detach(), k, dim=-1).indices


def gates(s: torch.Tensor, experts: torch.Tensor, normalize: bool | None = None) -> torch.Tensor:
    """(T, k) fp32 gates of the chosen ``experts``: their scores, divided by their sum per token when
    ``normalize`` is True, left as they are when False; None: normalised when k > 1."""
    g = s.gather(1, experts)  # (T, k)
    if normalize is None:
        normalize = experts.shape[1] > 1
    return g / g.sum(dim=-1, keepdim=True) if normalize else g


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64: how many of the (T, k) assignments went to each expert."""
    return torch.bincount(experts.reshape(-1), minlength=n_experts)


def balance_loss(s: torch.Tensor, counts: torch.Tensor, assignments: int, tokens: int, scoring: str) -> torch.Tensor:
    """E19 for the tokens of ``s`` (T, E): E·Σ_e f_e·P_e with f_e = counts_e / ``assignments`` (the
    micro-batch's, every rank's: no gradient) and P_e = Σ_t p_te / ``tokens``. Each rank passes its
    own T as ``tokens``: the mean over the ranks of their losses is then the one-process loss,
    and so is the gradient under the batch average of docs/design.md §2 (docs/moe.md)."""
    p = s if scoring == "softmax" else s / s.sum(dim=-1, keepdim=True)  # (T, E), each row adds to 1
    f = counts.to(torch.float32) / max(assignments, 1)  # (E,)
    return s.shape[1] * (p.sum(dim=0) / tokens * f).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """E20: mean over tokens of logsumexp(logits)², in fp32."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
