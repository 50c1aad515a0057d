"""Whole-model gradient operations: the global gradient norm, the first non-finite gradient, and
clipping by that norm.

Each gradient element is counted once however its parameter is split or replicated over the grid
(``axon4d.layout.param_layout``), so the norm is that of the single-process model's gradients. Under
ZeRO-2 (``axon4d.zero``) the weights' gradients live in parts, one per data rank, beside
``.grad``: each part is counted on the rank that holds it, clipped and checked with the rest.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.layout.param_layout import param_layouts
from axon4d.zero import sharded_grads


def grad_norm(model: nn.Module, grid: Grid) -> torch.Tensor:
    """The global L2 norm of all gradients, each element counted once however it is sharded: a
    0-dim fp32 tensor on the gradients' device, the same on every rank; nothing is read on the host.

    The gradients are grouped by how many ranks hold each element (the product of the grid sizes
    of ``ParamLayout.replicated_over``) and by device and dtype; each group's per-tensor norms come
    from one ``torch._foreach_norm`` computed in fp32, and the sum over groups of (squared norms /
    copies) is all-reduced once over the world (docs/design.md §8, equal to the dense model:
    ``torch.nn.utils.clip_grad_norm_``'s norm of the single-process model's gradients). A ZeRO-2
    gradient part (``axon4d.zero``) is one data rank's alone: its copies are those of its parameter
    over G_data."""
    layouts = param_layouts(model)
    groups: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    parts = {id(p): g for p, g in sharded_grads(model, grid)}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else parts.get(id(p))
        if grad is None:
            continue
        copies = math.prod(grid.size(a) for a in layouts[name].replicated_over())
        copies //= grid.size("data") if id(p) in parts and p.grad is None else 1
        groups.setdefault((copies, grad.device, grad.dtype), []).append(grad.detach())
    device = next(model.parameters()).device
    squares = [
        torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum().div(copies).to(device)
        for (copies, _, _), tensors in groups.items()
    ]
    total = (torch.stack(squares).sum() if squares else torch.zeros((), device=device)).reshape(1)  # (1,)
    total = grid.comm.all_reduce(total, "world", tag="grad_norm").wait()
    return total.sqrt().reshape(())


def first_nonfinite_grad(model: nn.Module, grid: Grid) -> str | None:
    """The name of the first parameter (in ``named_parameters`` order) whose gradient holds a NaN
    or inf on any rank, or None; every rank gets the same answer (one all-reduce over the world).
    A ZeRO-2 gradient part (``axon4d.zero``) is checked on the data rank that holds it."""
    named = [(n, p) for n, p in model.named_parameters()]
    if not named:
        return None
    parts = {id(p): g for p, g in sharded_grads(model, grid)}
    grads = [p.grad if p.grad is not None else parts.get(id(p)) for _, p in named]
    flags = torch.stack(
        [
            torch.zeros((), device=p.device) if g is None else (~torch.isfinite(g)).any().float()
            for (_, p), g in zip(named, grads)
        ]
    )
    if grid.world_size > 1:
        flags = grid.comm.all_reduce(flags, "world", tag="nonfinite").wait()
    bad = torch.nonzero(flags > 0)
    return named[int(bad[0])][0] if len(bad) else None


#: added to the norm before dividing max_norm by it (as ``torch.nn.utils.clip_grad_norm_``)
CLIP_EPS = 1e-6


def clip_grad_norm_(model: nn.Module, max_norm: float, grid: Grid) -> torch.Tensor:
    """Scale every gradient so the global norm is at most ``max_norm``; return the norm before
    (``grad_norm``: a 0-dim fp32 tensor on the device, not read on the host).

    The scale min(1, max_norm / (norm + ``CLIP_EPS``)) is computed on the device and applied to
    every gradient unconditionally with ``torch._foreach_mul_`` (a factor of exactly 1 changes no
    bit), so the host never waits for the norm here. A non-finite norm (a NaN or inf gradient
    somewhere) gives the scale 1: the gradients are left as they are and the caller decides about
    the step once it reads the norm (the training job skips it)."""
    norm = grad_norm(model, grid)
    scale = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
    scale = torch.where(torch.isfinite(norm), scale, torch.ones_like(scale))
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    every = [p.grad for p in model.parameters() if p.grad is not None] + [g for _, g in sharded_grads(model, grid)]
    for grad in every:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), tensors in groups.items():
        torch._foreach_mul_(tensors, scale.to(device=device, dtype=dtype))
    return norm
