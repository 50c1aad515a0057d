"""How a step updates the weights: the learning-rate schedule, AdamW, and gradient clipping.

``lr_at`` is linear warmup to ``lr`` followed by cosine decay to ``min_lr`` at the last step.
``make_optimizer`` is AdamW with weight decay on matrices and embeddings only, decided by each
parameter's *global* shape (``axon4d.layout.param_layout``), so a flat Linear shard counts as the matrix it is
part of; its implementation is torch's fused kernel on an accelerator and the multi-tensor
("foreach") one on the host (``axon4d.device.adamw_kernel``). ``clip`` clips by the global
gradient norm, which counts every element once however it is sharded or replicated over the grid
(``axon4d.grads.grad_norm``), on the device: the norm is returned as a tensor, which the loop
reads with the loss in one host read. With ``--zero 1|2`` the AdamW is sharded over the data axis
(``axon4d.zero.shard_optimizer``): the same param groups, so ``set_lr`` works unchanged; its
all-gathers over data are left in flight into the next forward (``overlap_gathers``).

``step`` takes the optimizer step unless the step's loss or gradient norm is not finite. A fused
kernel (an accelerator's) decides on the device — torch's ``found_inf`` flag, the fused AdamW
skipping the update, its moments and its step count — so the step is queued before the host reads
the loss and the norm and the device never idles on that read; the host's foreach kernel is
stepped after the read (on the host nothing runs asynchronously). Every rank decides alike: the
loss and the norm are reduced over the grid before either test.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from axon4d import device as devices
from axon4d import grads, zero
from axon4d.grid.mesh import Grid
from axon4d.layout import param_layout
from axon4d.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(opt: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Set every parameter group's learning rate to the schedule's value at ``step``; return it."""
    lr = lr_at(step, cfg)
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def make_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, grid: Grid | None = None
) -> torch.optim.AdamW | zero.ShardedOptimizer:
    """AdamW with weight decay on matrices and embeddings only (norm weights and biases excluded);
    under ``cfg.zero`` 1 or 2 sharded over ``grid``'s data axis (``axon4d.zero``).

    Decided by the parameter's *global* shape, so flat Linear shards count as matrices; for a
    plain single-process model the global shape is the parameter's own."""
    layouts = param_layout.param_layouts(model)
    decay = [p for n, p in model.named_parameters() if len(layouts[n].global_shape) >= 2]
    other = [p for n, p in model.named_parameters() if len(layouts[n].global_shape) < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kernel = devices.adamw_kernel(next(model.parameters()).device)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **{kernel: True})
    if not cfg.zero:
        return opt
    if grid is None:
        raise ValueError(f"--zero {cfg.zero} shards the optimizer over a grid's data axis: pass the grid")
    return zero.shard_optimizer(opt, model, grid, stage=cfg.zero, overlap_gathers=True)


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` skips a non-finite step on the device (its kernel is fused: ``step``)."""
    return optimizer_kernel(opt) == "fused"


def step(opt: torch.optim.Optimizer, loss_sum: torch.Tensor, norm: torch.Tensor, read: Callable[[], bool]) -> bool:
    """Step ``opt`` unless the step's summed loss or gradient norm (device tensors, alike on every
    rank) is not finite; ``read`` is the step's one host read, returning whether both are finite.
    Returns what ``read`` returned. A fused ``opt`` is stepped before the read, the skip decided on
    the device (``found_inf``); any other after it, on the host's verdict."""
    if not skips_on_device(opt):
        finite = read()
        if finite:
            opt.step()
        return finite
    found_inf = (~(torch.isfinite(loss_sum).all() & torch.isfinite(norm).all())).float()  # 0-dim, 1: skip
    opt.found_inf = found_inf  # type: ignore[attr-defined]  # torch's fused kernels read it
    try:
        opt.step()
    finally:
        opt.found_inf = None  # type: ignore[attr-defined]
    return read()


def optimizer_kernel(opt: torch.optim.Optimizer) -> str:
    """Which implementation ``opt`` runs (``make_optimizer``'s choice): "fused", "foreach" or "for-loop"."""
    defaults = opt.defaults
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """``optimizer_kernel``, and the ZeRO stage where the optimizer is sharded: "foreach",
    "foreach, ZeRO-2 over 4 data ranks", "fused, ZeRO-1 (a no-op: data 1)"."""
    kernel = optimizer_kernel(opt)
    if not isinstance(opt, zero.ShardedOptimizer):
        return kernel
    if opt.data_size == 1:
        return f"{kernel}, ZeRO-{opt.stage} (a no-op: data 1)"
    return f"{kernel}, ZeRO-{opt.stage} over {opt.data_size} data ranks"


def clip(model: torch.nn.Module, cfg: TrainConfig, grid: Grid) -> torch.Tensor:
    """Clip the gradients to ``cfg.grad_clip`` by their global norm (no clipping at 0); return the
    norm as a 0-dim tensor on the device (``axon4d.grads``): nothing here waits for the device, and
    the training loop reads the norm together with the step's loss, once."""
    if cfg.grad_clip > 0:
        return grads.clip_grad_norm_(model, cfg.grad_clip, grid)
    return grads.grad_norm(model, grid)
