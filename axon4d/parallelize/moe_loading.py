"""What each rank reads of a saved Hugging Face MoE block (docs/parallelize.md, "Mixture-of-Experts
models"): only its experts, and of each only its x·y rectangle, from either layout a checkpoint
may hold:

- **fused** (what transformers 5 keeps in memory): ``<block>.experts.gate_up_proj`` (E, 2I, hidden)
  = [gate | up] and ``<block>.experts.down_proj`` (E, hidden, I);
- **per expert** (what ``save_pretrained`` writes, and the checkpoints published before transformers
  5): ``<block>.experts.<e>.{w1, w3, w2}.weight`` (Mixtral, whose block is saved as
  ``block_sparse_moe``) or ``<block>.experts.<e>.{gate_proj, up_proj, down_proj}.weight``, each
  (I, hidden) or (hidden, I).

The router ``<block>.gate.weight`` (E, hidden) is read by this rank's x columns. Every read is one
safetensors slice of at most one expert's f/G_y × hidden/G_x block. Nothing here opens a file:
``axon4d.parallelize.loading`` runs the reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.parallelize.moe import HFMoEBlock

#: per-expert tensor names (gate, up, down) under ``<block>.experts.<e>.``, as families save them
PER_EXPERT = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
#: names a block of ``mlp`` is saved under (Mixtral's checkpoints call it ``block_sparse_moe``)
SAVED_AS = ("mlp", "block_sparse_moe")

Index = tuple[int | slice, ...]


@dataclasses.dataclass(frozen=True)
class Read:
    """Copy ``tensor[index]`` (a checkpoint tensor of shape ``shape``) into ``local[dest]``."""

    dest: Index
    tensor: str
    index: Index
    shape: tuple[int, ...]


def _block_name(name: str, find: Callable[[str], str | None]) -> str:
    """The name the checkpoint stores block ``name`` under (its router ``<block>.gate.weight`` found)."""
    parent, _, last = name.rpartition(".")
    candidates = [name] + [f"{parent}.{alias}" for alias in SAVED_AS if last in SAVED_AS and alias != last]
    for c in candidates:
        if find(f"{c}.gate.weight") is not None:
            return c
    raise KeyError(
        f"the checkpoint holds no router for MoE block {name} (tried {[f'{c}.gate.weight' for c in candidates]})"
    )


def block_reads(
    name: str, block: HFMoEBlock, find: Callable[[str], str | None], grid: Grid
) -> dict[tuple[nn.Module, str], list[Read]]:
    """{(module, parameter or buffer name): reads} filling this rank's router columns and experts of
    the ``HFMoEBlock`` called ``name`` (and DeepSeek-V3's routing bias, ``expert_bias``, whole). ``find(tensor)`` is the name the checkpoint holds ``tensor``
    under (the base model's prefix resolved), None if it holds none."""
    moe, ex = block.moe, block.moe.experts
    saved = _block_name(name, find)
    e_all, hidden, ffn = ex.n_experts, ex.hidden, ex.ffn
    h_x = hidden // grid.size("x")
    router_cols = slice(grid.coord("x") * h_x, (grid.coord("x") + 1) * h_x)  # the router splits hidden over x
    cols, rows = ex.hidden_slice, ex.ffn_slice  # the experts' blocks, as their layout splits them
    f_y = rows.stop - rows.start
    router = find(f"{saved}.gate.weight")
    assert router is not None  # found by _block_name
    out: dict[tuple[nn.Module, str], list[Read]] = {
        (moe.router, "weight"): [Read((slice(None),), router, (slice(None), router_cols), (e_all, hidden))]
    }
    up: list[Read] = []
    down: list[Read] = []
    gate_up, fused_down = find(f"{saved}.experts.gate_up_proj"), find(f"{saved}.experts.down_proj")
    if gate_up is not None and fused_down is not None:
        up_rows = slice(ffn + rows.start, ffn + rows.stop)
        for li in range(ex.local):
            e = ex.first + li
            up.append(Read((li, slice(0, f_y)), gate_up, (e, rows, cols), (e_all, 2 * ffn, hidden)))
            up.append(Read((li, slice(f_y, 2 * f_y)), gate_up, (e, up_rows, cols), (e_all, 2 * ffn, hidden)))
            down.append(Read((li,), fused_down, (e, cols, rows), (e_all, hidden, ffn)))
    else:
        names = next((n for n in PER_EXPERT if find(f"{saved}.experts.0.{n[0]}.weight") is not None), None)
        if names is None:
            tried = [f"{saved}.experts.gate_up_proj"] + [f"{saved}.experts.0.{n[0]}.weight" for n in PER_EXPERT]
            raise KeyError(f"the checkpoint holds none of {tried} (the experts of MoE block {name})")
        for li in range(ex.local):
            e = ex.first + li
            found = [find(f"{saved}.experts.{e}.{n}.weight") for n in names]
            if any(f is None for f in found):
                raise KeyError(f"the checkpoint holds no {saved}.experts.{e}.{{{', '.join(names)}}}.weight")
            g, u, d = (str(f) for f in found)
            up.append(Read((li, slice(0, f_y)), g, (rows, cols), (ffn, hidden)))
            up.append(Read((li, slice(f_y, 2 * f_y)), u, (rows, cols), (ffn, hidden)))
            down.append(Read((li,), d, (cols, rows), (hidden, ffn)))
    out[(ex, "up")] = up
    out[(ex, "down")] = down
    bias = find(f"{saved}.gate.e_score_correction_bias")
    if moe.expert_bias is not None:  # DeepSeek-V3's fixed routing bias (E,), whole: a buffer
        if bias is None:
            raise KeyError(f"the checkpoint holds no {saved}.gate.e_score_correction_bias (MoE block {name}'s bias)")
        out[(moe, "expert_bias")] = [Read((slice(None),), bias, (slice(None),), (e_all,))]
    return out
