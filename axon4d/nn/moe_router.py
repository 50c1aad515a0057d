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

DeepSeek-V3's routing options (docs/moe.md, "DeepSeek-V3 routing"): a per-expert ``bias`` added to
the scores for the top-k choice only (auxiliary-loss-free balancing; the gates are the unbiased
scores), group-limited routing (``n_groups`` groups of experts, each token choosing among the
experts of its ``topk_groups`` best groups, a group ranked by the sum of its two highest biased
scores), the gates multiplied by a scaling factor, the bias update sign(mean − count) from the
global counts (``bias_step``) and the sequence-wise balance loss (``sequence_balance_loss``).
"""

from __future__ import annotations

import torch


def scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """(T, E) fp32 scores of (T, E) logits: softmax over experts, or an elementwise sigmoid."""
    logits = logits.float()
    return torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)


def choose(
    s: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int | None = None,
) -> torch.Tensor:
    """(T, k) int64: each token's k experts, highest score first (no autograd). With ``bias`` (E,)
    the choice ranks s + bias (the gates stay the scores'); with ``n_groups`` > 1 and
    ``topk_groups`` < ``n_groups`` a token first keeps the ``topk_groups`` groups of E/n_groups
    consecutive experts whose two highest (biased) scores add to the most, then chooses its k
    experts among theirs (DeepSeek-V3)."""
    ranked = s.detach()
    if bias is not None:
        ranked = ranked + bias.to(ranked.dtype)
    groups = topk_groups if topk_groups is not None else n_groups
    if n_groups > 1 and groups < n_groups:
        t, e = ranked.shape
        per = ranked.view(t, n_groups, e // n_groups)  # (T, G, E/G)
        group_scores = per.topk(min(2, e // n_groups), dim=-1).values.sum(dim=-1)  # (T, G)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(groups, dim=-1).indices, True)
        ranked = per.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(t, e)
    return torch.topk(ranked, k, dim=-1).indices


def gates(s: torch.Tensor, experts: torch.Tensor, normalize: bool | None = None, scale: float = 1.0) -> torch.Tensor:
    """(T, k) fp32 gates of the chosen ``experts``: their scores, divided by their sum per token when
    ``normalize`` is True, left as they are when False; None: normalised when k > 1; then multiplied
    by ``scale`` (the config's ``routed_scaling_factor``; 1: left as they are)."""
    g = s.gather(1, experts)  # (T, k)
    if normalize is None:
        normalize = experts.shape[1] > 1
    g = g / g.sum(dim=-1, keepdim=True) if normalize else g
    return g * scale if scale != 1.0 else g


@torch.no_grad()
def bias_step(bias: torch.Tensor, counts: list[int], rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): bias_e += rate · sign(mean_count − count_e), in
    place, from the micro-batch's assignments per expert ``counts`` (every rank's: the same host
    ints on every rank, so every rank's bias stays the same). The mean is compared in integers
    (count_e·E against the total), so no rounding can make ranks or grids differ."""
    total, e = sum(counts), len(counts)
    sign = [(total > c * e) - (total < c * e) for c in counts]  # sign(total/E − c)
    bias.add_(torch.tensor(sign, dtype=torch.float32, device=bias.device).to(bias.dtype), alpha=rate)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64: how many of the (T, k) assignments went to each expert."""
    return value_counts(experts.reshape(-1), n_experts)


def value_counts(index: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64: how often each of 0 … n−1 occurs in the 1-D int64 ``index`` (every value below
    n), by a scatter-add into n zeros on index's device — ``torch.bincount`` would be the same
    counts, but on CUDA it reads index's largest value back to the host first (a sync per call,
    seen by ``make gpu-check``'s watch on an H200)."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def balance_loss(s: torch.Tensor, counts: torch.Tensor, assignments: int, tokens: int, scoring: str) -> torch.Tensor:
    """E19 for the tokens of ``s`` (T, E): E·Σ_e f_e·P_e with f_e = counts_e / ``assignments`` (the
    micro-batch's, every rank's: no gradient) and P_e = Σ_t p_te / ``tokens``. Each rank passes its
    own T as ``tokens``: the mean over the ranks of their losses is then the one-process loss,
    and so is the gradient under the batch average of docs/design.md §2 (docs/moe.md)."""
    p = s if scoring == "softmax" else s / s.sum(dim=-1, keepdim=True)  # (T, E), each row adds to 1
    f = counts.to(torch.float32) / max(assignments, 1)  # (E,)
    return s.shape[1] * (p.sum(dim=0) / tokens * f).sum()


def sequence_balance_loss(s: torch.Tensor, experts: torch.Tensor, seq_len: int, scoring: str) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, the mean over the sequences of the
    tokens of ``s`` (T, E) (T/``seq_len`` whole sequences of ``seq_len`` consecutive tokens) of
    Σ_e f_e·P_e, with f_e = E/(k·seq_len) · (the sequence's assignments to e, from the chosen
    ``experts`` (T, k), no gradient) and P_e the sequence's mean of e's normalised score."""
    t, e = s.shape
    k = experts.shape[1]
    p = s if scoring == "softmax" else s / s.sum(dim=-1, keepdim=True)  # (T, E), each row adds to 1
    n = t // seq_len
    counts = torch.zeros(n, e, dtype=torch.float32, device=s.device)
    counts.scatter_add_(1, experts.view(n, seq_len * k), torch.ones(n, seq_len * k, device=s.device))
    f = counts * (e / (k * seq_len))  # (n, E)
    big_p = p.view(n, seq_len, e).mean(dim=1)  # (n, E)
    return (f * big_p).sum(dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """E20: mean over tokens of logsumexp(logits)², in fp32."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
