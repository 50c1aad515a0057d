"""What the training job logs of FP8 GEMMs (precision ``bf16-fp8``, docs/design.md §2 "FP8 GEMMs"): the
share of the output gradients' non-zero entries that their float8 format flushed to zero, per layer
kind (a block's ``attn.qkv``, … with the block's index left out: ``blocks.*.attn.qkv``), summed over
every rank and every block — one all-reduce over the world of two counts per kind.

It is counted on the steps the job logs (``--log-every``) only: the count reads dY and its codes
once more in each FP8 layer's backward (``fp8_gemm.count_flushes``), which other steps need not pay.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.nn.linear import Linear
from axon4d.nn.moe_experts import GridExperts

#: a block's index in a module's name, left out of its layer kind
_INDEX = re.compile(r"\.\d+\.")


def layer_kinds(model: nn.Module) -> dict[str, list[Linear]]:
    """The model's 3D Linear layers by layer kind (module name, block index as ``*``)."""
    kinds: dict[str, list[Linear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            kinds.setdefault(_INDEX.sub(".*.", f".{name}.").strip("."), []).append(module)
    return kinds


def fp8_layers(model: nn.Module) -> dict[str, list[Linear]]:
    """The model's Linear layers whose GEMMs run in FP8, by layer kind."""
    kinds = {k: [m for m in v if m.fp8_gemms] for k, v in layer_kinds(model).items()}
    return {k: v for k, v in kinds.items() if v}


def gemm_precisions(model: nn.Module) -> dict[str, str]:
    """{layer kind: what its GEMMs multiply, and why not FP8} (``Linear.gemm_precision``, and an MoE
    layer's experts' ``GridExperts.gemm_precision`` as kind ``blocks.*.moe.experts``; the kinds
    whose layers differ list each answer once, joined by " / "): the banner's and summary.json's."""
    kinds: dict[str, list[Linear | GridExperts]] = {k: list(v) for k, v in layer_kinds(model).items()}
    for name, module in model.named_modules():
        if isinstance(module, GridExperts):
            kinds.setdefault(_INDEX.sub(".*.", f".{name}.").strip("."), []).append(module)
    return {k: " / ".join(dict.fromkeys(m.gemm_precision for m in v)) for k, v in kinds.items()}


def gemm_line(precisions: dict[str, str]) -> str:
    """The banner's line of ``gemm_precisions``: each answer once, with its layer kinds."""
    by: dict[str, list[str]] = {}
    for kind, what in precisions.items():
        by.setdefault(what, []).append(kind)
    return "GEMMs: " + "; ".join(f"{what}: {', '.join(kinds)}" for what, kinds in by.items())


def count_underflow(model: nn.Module, on: bool) -> None:
    """Start counting (``on``: a zeroed counter on each FP8 layer) or stop (no counter: no work)."""
    for layers in fp8_layers(model).values():
        for layer in layers:
            layer.fp8_flushes = torch.zeros(2, dtype=torch.int64, device=layer.weight.device) if on else None


def underflow_record(model: nn.Module, grid: Grid) -> dict[str, float] | None:
    """The step record's ``fp8_underflow`` field — {layer kind: flushed share of dY's non-zero entries}
    over what was counted since ``count_underflow(model, True)`` — and stop counting; None when
    nothing was counted. Call on every rank (one all-reduce over the world)."""
    kinds = {k: [m for m in v if m.fp8_flushes is not None] for k, v in fp8_layers(model).items()}
    kinds = {k: v for k, v in kinds.items() if v}
    if not kinds:
        return None
    counters = [[t for m in v if (t := m.fp8_flushes) is not None] for v in kinds.values()]
    counts = torch.stack([torch.stack(c).sum(0) for c in counters])  # (kinds, 2): flushed, non-zero
    total = grid.comm.all_reduce(counts.contiguous(), "world", tag="fp8.log").wait().tolist()
    count_underflow(model, False)
    return {k: flushed / max(nonzero, 1) for k, (flushed, nonzero) in zip(kinds, total)}
