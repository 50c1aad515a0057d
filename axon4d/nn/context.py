"""Causal attention across a sequence split over z: context parallelism (docs/context.md).

Under context parallelism (``axon4d.layout.shard_sequence``) a sequence of S tokens is cut into
2·G_z chunks of C = S/(2·G_z) and z-rank r holds chunks r and 2·G_z−1−r, head then tail. Every
linear layer, norm and MLP works on those 2·C rows unchanged; only attention needs the keys and
values of earlier positions, which live on other z-ranks:

1. each rank all-gathers over z the keys (already rotated at their global positions) and values
   of its *own* key/value heads only — n_kv/G_y heads, so GQA shrinks the traffic by n/n_kv — in
   one collective (tag ``cp_kv``), and puts them in global order;
2. query chunk c (global positions c·C … (c+1)·C−1) attends to exactly the keys it needs,
   [0, (c+1)·C): the earlier chunks in full and its own chunk causally — a lower-right causal
   bias (``torch.nn.attention.bias.causal_lower_right``), which accelerators run in their fused
   kernels without building a mask. On the host the mask is materialised (a plain boolean tensor,
   ``lower_right_mask``, which torch's memory tracker can follow where it cannot follow the bias's
   tensor subclass), and the attention kernel keeps it — as floats — for its backward: C × (c+1)·C
   of them, O(S²/G_z), would undo what the split saves. So on the host each chunk runs in blocks of
   ``HOST_ROWS`` queries, each block checkpointed: no mask is kept, and the backward rebuilds one
   block's at a time (its forward runs again, attention only). Rank r's two chunks need
   (r+1)·C and (2·G_z−r)·C keys — (2·G_z+1)·C on every rank, which is the causal balance;
3. backward: the gradient of the gathered keys and values is reduce-scattered over z (the autograd
   of the all-gather, ``axon4d.nn.functional.gather_shared``), so each rank receives, for its own
   tokens, the sum of what every rank's queries contributed.

Bytes per layer and rank, each way (forward all-gather, backward reduce-scatter), for b sequences
of S tokens, head_dim d and element size e:  2 · b · S · (n_kv/G_y) · d · e · (G_z−1)/G_z.
"""

from __future__ import annotations

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from axon4d import device as devices
from axon4d.grid import Grid
from axon4d.layout import sequence_chunks, sequence_order
from axon4d.nn.functional import gather_shared
from axon4d.nn.recompute import checkpointed

#: queries per attention block on the host (module docstring): the transient mask is this × keys
HOST_ROWS = 256

#: the tag of the key/value all-gather (and, with ``.grad``, of its reduce-scatter) in the comm log
KV_TAG = "cp_kv"


def gather_keys_values(k: torch.Tensor, v: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Every z-rank's keys and values (b, heads, S/G_z, d), gathered in one all-gather over z and put
    in global token order: two (b, heads, S, d) tensors. Differentiable: the backward reduce-scatters
    the gradients over z."""
    g_z = grid.size("z")
    if g_z == 1:
        return k, v
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)  # (s, 2, b, heads, d): tokens first, gathered on dim 0
    full = gather_shared(kv, "z", grid, dim=0, tag=KV_TAG)  # (S, 2, b, heads, d), z-rank order
    full = full.index_select(0, sequence_order(full.shape[0], g_z, full.device))  # global order
    full = full.permute(1, 2, 3, 0, 4)  # (2, b, heads, S, d)
    return full[0], full[1]


def lower_right_mask(rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """(rows, keys) booleans: query i sees key j when j ≤ keys − rows + i (the lower-right causal
    mask of the last ``rows`` queries of a sequence of ``keys`` tokens)."""
    return torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    """Attention of the last q.shape[2] queries of k.shape[2] tokens, lower-right causal, with a mask."""
    mask = lower_right_mask(q.shape[2], k.shape[2], q.device)
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _host_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, gqa: bool) -> torch.Tensor:
    """One query chunk q (b, hq, C, d) against keys [0, end), lower-right causal, in checkpointed
    blocks of ``HOST_ROWS`` queries (module docstring)."""
    c = q.shape[2]
    outs = []
    for a in range(0, c, HOST_ROWS):
        rows = min(HOST_ROWS, c - a)
        stop = end - c + a + rows  # the block's last query sees keys up to here
        outs.append(
            checkpointed(_masked_attention, q.narrow(2, a, rows), k.narrow(2, 0, stop), v.narrow(2, 0, stop), gqa)
        )
    return torch.cat(outs, dim=2)


def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, int], gqa: bool
) -> torch.Tensor:
    """Causal attention of a rank's two query chunks q (b, hq, 2·C, d), global chunk indices
    ``chunks``, against the whole sequence's keys and values (b, hkv, S, d) in global order: chunk c
    sees keys [0, (c+1)·C), the last C causally. Returns (b, hq, 2·C, d)."""
    c = q.shape[2] // 2
    outs = []
    for half, chunk in enumerate(chunks):
        end = (chunk + 1) * c
        if devices.is_host(q.device):
            outs.append(_host_chunk(q.narrow(2, half * c, c), k, v, end, gqa))
            continue
        outs.append(
            scaled_dot_product_attention(
                q.narrow(2, half * c, c),
                k.narrow(2, 0, end),
                v.narrow(2, 0, end),
                attn_mask=causal_lower_right(c, end),  # query i sees keys ≤ chunk·C + i
                enable_gqa=gqa,
            )
        )
    return torch.cat(outs, dim=2)


def split_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, recompute_core: bool = False
) -> torch.Tensor:
    """softmax(q kᵀ/√d, causal) v for this rank's tokens of sequences split head–tail over z:
    q (b, hq, 2·C, d), k and v (b, hkv, 2·C, d), positions already applied (rotary at global
    positions). Returns (b, hq, 2·C, d). With ``recompute_core`` only q and the gathered keys and
    values are kept; the scores are recomputed in backward (the all-gather is not run again)."""
    if q.shape[2] % 2:
        raise ValueError(
            f"a rank holds {q.shape[2]} tokens per sequence, but under context parallelism it holds two equal "
            "chunks (an even count): shard the sequences with axon4d.layout.shard_sequence"
        )
    k_full, v_full = gather_keys_values(k, v, grid)
    chunks = sequence_chunks(grid.coord("z"), grid.size("z"))
    gqa = k.shape[1] != q.shape[1]
    if recompute_core:
        return checkpointed(prefix_attention, q, k_full, v_full, chunks, gqa)
    return prefix_attention(q, k_full, v_full, chunks, gqa)
