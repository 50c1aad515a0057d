"""Whole-model gradient operations: the global gradient norm, the first non-finite gradient, and
clipping by that norm.

Each gradient element is counted once however its parameter is split or replicated over the grid
(``axon4d.param_layout``), so the norm is that of the single-process model's gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from axon4d.grid import Grid
from axon4d.param_layout import param_layouts


def grad_norm(model: nn.Module, grid: Grid) -> torch.Tensor:
    """The global L2 norm of all gradients, each element counted once however it is sharded."""
    layouts = param_layouts(model)
    device = next(model.parameters()).device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        copies = math.prod(grid.size(a) for a in layouts[name].replicated_over())
        total += p.grad.detach().double().square().sum() / copies
    total = grid.comm.all_reduce(total, "world", tag="grad_norm").wait()
    return total.sqrt().float()


def first_nonfinite_grad(model: nn.Module, grid: Grid) -> str | None:
    """The name of the first parameter (in ``named_parameters`` order) whose gradient holds a NaN
    or inf on any rank, or None; every rank gets the same answer (one all-reduce over the world)."""
    named = [(n, p) for n, p in model.named_parameters()]
    if not named:
        return None
    flags = torch.stack(
        [
            torch.zeros((), device=p.device) if p.grad is None else (~torch.isfinite(p.grad)).any().float()
            for _, p in named
        ]
    )
    if grid.world_size > 1:
        flags = grid.comm.all_reduce(flags, "world", tag="nonfinite").wait()
    bad = torch.nonzero(flags > 0)
    return named[int(bad[0])][0] if len(bad) else None


def clip_grad_norm_(model: nn.Module, max_norm: float, grid: Grid) -> float:
    """Scale every gradient so the global norm is at most ``max_norm``; return the norm before.
    A non-finite norm (a NaN or inf gradient somewhere) is returned with the gradients untouched:
    the caller decides about that step (the training job skips it)."""
    norm = grad_norm(model, grid)
    if not math.isfinite(float(norm)):
        return float(norm)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if scale.item() < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
    return float(norm)
