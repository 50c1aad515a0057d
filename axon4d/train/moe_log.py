"""What the training job logs of Mixture-of-Experts blocks (docs/moe.md): per MoE layer, the tokens
each expert received over the step's last micro-batch (every rank's: the counts the dispatch plan
already read on the host), their imbalance max/mean, and the balance loss E19 of the whole
micro-batch — each rank's share summed over batch in one all-reduce of one value per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.nn.moe import MoE


def moe_record(model: nn.Module, grid: Grid) -> dict[str, Any] | None:
    """The step record's ``moe`` field: {"tokens_per_expert": [[…] per layer], "imbalance": [max/mean
    per layer], "balance_loss": [E19 per layer]}; None for a model without MoE layers. Call on every
    rank (one all-reduce over batch)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.tokens_per_expert is not None]
    if not layers:
        return None
    shares = torch.stack([m.balance if m.balance is not None else torch.zeros(()) for m in layers]).float()
    total = grid.comm.all_reduce(shares.contiguous(), "batch", tag="moe.log").wait() / grid.size("batch")
    counts = [list(m.tokens_per_expert or ()) for m in layers]
    return {
        "tokens_per_expert": counts,
        "imbalance": [max(c) * len(c) / max(sum(c), 1) for c in counts],
        "balance_loss": total.tolist(),
    }
