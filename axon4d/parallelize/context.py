"""Context parallelism for a parallelized Hugging Face model (docs/context.md): the tokens of each
sequence split head–tail over z, attention across the split, through the model's own code.

``enable(model, grid)`` registers an attention function with transformers' ``AttentionInterface``
(and a mask function with ``AttentionMaskInterface``) and points the model's configuration at it;
no model code is patched. The model's attention modules compute q, k, v of this rank's heads and
tokens and rotate them at the positions they are given — the tokens' *global* positions, which
``inputs`` supplies as ``position_ids`` — and the registered function runs
``axon4d.nn.context.split_sequence_attention``: keys and values of this rank's key/value heads
all-gathered over z, each query chunk against exactly the prefix it needs, dK and dV
reduce-scattered in backward — or, in the ring mode, ``axon4d.nn.context_ring.ring_sequence_attention``
(keys and values passed around z, memory O(chunk)).

``inputs(ids, grid)`` makes the keyword arguments of one forward from full sequences (B, S): this
rank's ``input_ids`` and ``position_ids``, and for training ``labels`` with ``shift_labels`` (the
next-token targets, shifted on the full sequence before it is split, so no target crosses a chunk
boundary) and ``num_items_in_batch``, so that the mean loss each rank computes over its tokens
averages, over data × z, to the mean over every target of the global batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from axon4d import activations
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.nn.context import split_sequence_attention
from axon4d.nn.context_ring import ring_sequence_attention
from axon4d.options.context_mode import MODES, context_mode
from axon4d.parallelize.styles import RESTORE_ATTR

#: the name the attention and mask functions are registered under
ATTENTION_NAME = "axon4d_context"
#: the attribute of an attention module holding its grid ("grid", as axon4d's own modules do, so
#: that ``axon4d.to_dense`` shares it instead of copying it; the dense copy gets None back)
GRID_ATTR = "grid"
#: the attribute of an attention module naming the attention implementation it had before
BASE_ATTR = "_axon4d_context_base"
#: the attribute of an attention module saying whether core attention is recomputed (selective)
RECOMPUTE_ATTR = "_axon4d_context_recompute"
#: the attribute of an attention module naming how keys and values travel ("all-gather" or "ring")
MODE_ATTR = "_axon4d_context_mode"
#: each mode's split attention
SPLIT_ATTENTION = {"all-gather": split_sequence_attention, "ring": ring_sequence_attention}
#: what transformers' loss ignores
IGNORE_INDEX = -100


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (b, hq, s, d), k and v (b, hkv, s, d) of this
    rank's heads and head–tail tokens → ((b, s, hq, d), no weights). k and v come with the model's
    own key/value heads (transformers repeats them only inside its attention functions), and the
    split attention reads grouped-query heads from the shapes without repeating them."""
    grid = getattr(module, GRID_ATTR, None)
    if grid is None:  # the unparallelized copy (axon4d.to_dense): whole sequences, the model's own attention
        from transformers import AttentionInterface

        base = getattr(module, BASE_ATTR, "sdpa")
        fn = AttentionInterface()[base] if base in AttentionInterface() else AttentionInterface()["sdpa"]
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if dropout and module.training:
        raise ValueError(
            f"attention dropout {dropout} is not supported with context parallelism; set the model's "
            "attention_dropout to 0"
        )
    d = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, d**-0.5, rel_tol=1e-6):
        query = query * (scaling * math.sqrt(d))  # the kernel scales by 1/√d
    attend = SPLIT_ATTENTION[getattr(module, MODE_ATTR, MODES[0])]
    out = attend(query, key, value, grid, recompute_core=getattr(module, RECOMPUTE_ATTR, False))
    return out.transpose(1, 2).contiguous(), None


def _mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """No mask tensor: the attention function builds the causal prefix masks of its chunks. A
    padding mask cannot be honoured across the split, so one with padding is refused."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "context parallelism takes unpadded sequences of one length: the attention_mask has padding; "
            "pack the sequences to full length or train without context_parallel"
        )
    return None


def enable(model: nn.Module, grid: Grid, recompute_core: bool = False, mode: str = MODES[0]) -> None:
    """Run ``model``'s attention across sequences split over z (module docstring), the keys and
    values all-gathered (``mode`` "all-gather", ``axon4d.nn.context``) or passed around z ("ring",
    ``axon4d.nn.context_ring``); with ``recompute_core`` (selective recomputation) the scores are
    recomputed in backward — from q and the gathered keys and values (no collective runs twice), or
    by the ring run again."""
    if context_mode(mode) is None or mode is True:
        raise ValueError(f"context parallelism's mode {mode!r}: choose one of {', '.join(MODES)} (docs/context.md)")
    from transformers import AttentionInterface  # optional dependency: only Hugging Face models get here
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) is None:
        raise ValueError(
            f"context_parallel=True needs a Hugging Face model whose attention goes through "
            f"AttentionInterface; {type(model).__name__} has no config._attn_implementation"
        )
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask)
    base = config._attn_implementation
    found = 0
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION_NAME
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "v_proj"):
            setattr(m, GRID_ATTR, grid)
            setattr(m, RECOMPUTE_ATTR, recompute_core)
            setattr(m, MODE_ATTR, mode)
            setattr(m, BASE_ATTR, base)
            m.__dict__.setdefault(RESTORE_ATTR, {})[GRID_ATTR] = None  # axon4d.to_dense's copy: no grid
            found += 1
    if not found:
        raise ValueError(
            f"context_parallel=True: no attention module (with q_proj, k_proj, v_proj) found in {type(model).__name__}"
        )


def position_ids(rows: int, seq_len: int, grid: Grid, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``position_ids`` (rows, S/G_z) of the tokens this rank holds of ``rows`` sequences of
    ``seq_len`` tokens split head–tail over z: their global positions, chunk z then chunk 2·G_z−1−z."""
    positions = activations.sequence_positions(seq_len, grid.coord("z"), grid.size("z"), device)  # (S/G_z,)
    return positions.unsqueeze(0).expand(rows, -1)


def inputs(ids: torch.Tensor, grid: Grid | None = None, labels: bool = True) -> dict[str, torch.Tensor]:
    """Keyword arguments of one forward of a context-parallel Hugging Face causal LM on full
    sequences ``ids`` (B, S), the same on every rank: this rank's ``input_ids`` and global
    ``position_ids`` (b, S/G_z), and with ``labels`` the targets (module docstring). S must be a
    multiple of 2·G_z; B of G_data."""
    grid = runtime.resolve(grid)
    if ids.dim() != 2:
        raise ValueError(f"inputs takes token ids of shape (batch, seq), got {tuple(ids.shape)}")
    local = activations.shard_sequence(ids, grid)
    out = {"input_ids": local, "position_ids": position_ids(local.shape[0], ids.shape[1], grid, ids.device)}
    if labels:
        shifted = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)  # (B, S)
        out["labels"] = local
        out["shift_labels"] = activations.shard_sequence(shifted, grid)
        counted = (shifted != IGNORE_INDEX).sum().to(torch.float32)
        out["num_items_in_batch"] = counted / grid.size("batch")  # see the module docstring
    return out
