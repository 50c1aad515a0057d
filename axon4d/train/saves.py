"""The training run's checkpoints (``axon4d.checkpoint``): what a resumed run loads, and each save —
blocking, or written in the background while training goes on (``--async-save``).

A checkpoint holds the model and optimizer, the run's config, its data position and random state,
the non-finite steps skipped so far, and with ``--hf`` the saved model's directory; ``resume``
restores the random state it recorded, so a resumed run continues on the same loss curve. Every
load and save is a marked wait of the watchdog (``axon4d.reliability.watchdog``), bounded by
``--startup-timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from typing import Any

import torch
from torch import nn

from axon4d import checkpoint
from axon4d import device as devices
from axon4d.grid.mesh import Grid
from axon4d.reliability import watchdog
from axon4d.train.config import TrainConfig


def resume(
    cfg: TrainConfig, resume_from: str | None, model: nn.Module, grid: Grid, opt: torch.optim.Optimizer, ckpt_dir: str
) -> tuple[int, int]:
    """Load ``resume_from`` into the model and optimizer (restoring the random state it recorded),
    or clear the old checkpoints under --overwrite; return (first step, non-finite steps so far)."""
    if resume_from is None:
        if cfg.overwrite and grid.rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        return 0, 0
    with watchdog.waiting("the checkpoint load", cfg.startup_timeout):
        meta = checkpoint.load(resume_from, model, grid, opt)
    if meta.get("rng"):
        devices.restore_rng(meta["rng"], grid.device)
    return int(meta["step"]), int(meta.get("nonfinite_skipped", 0))


def saver(grid: Grid, cfg: TrainConfig) -> contextlib.AbstractContextManager[checkpoint.AsyncSaver | None]:
    """With --async-save the run's background saver (``checkpoint.AsyncSaver``; its writes' collectives
    time out as the saves' waits do), released when the run ends; else nothing (saves block)."""
    return checkpoint.AsyncSaver(grid, cfg.startup_timeout) if cfg.async_save else contextlib.nullcontext()


def save(
    cfg: TrainConfig,
    ckpt_dir: str,
    model: nn.Module,
    grid: Grid,
    opt: torch.optim.Optimizer,
    step: int,
    skipped: int,
    saver: checkpoint.AsyncSaver | None,
) -> float:
    """Checkpoint ``step`` (with the run's config, data position and random state, and the --hf
    model's directory), marked as a wait; return the seconds training was blocked. With ``saver``
    (--async-save) that is the wait for the previous save's write and this one's snapshot, and the
    write goes on in the background; the last step's save is waited for (the run ends with it
    published). A checkpoint already at ``step`` is replaced: a resumed run's steps lie beyond its
    checkpoint, and one found there is of the continuation it replays (published by a run ended
    before it pointed ``latest`` at it)."""
    extra: dict[str, Any] = {"train_config": dataclasses.asdict(cfg), "nonfinite_skipped": skipped}
    if cfg.hf:
        extra[checkpoint.HF_PATH] = os.path.realpath(cfg.hf)
    t0 = time.perf_counter()
    doing = "the background write of the previous checkpoint and " if saver and saver.in_flight else ""
    with watchdog.waiting(f"{doing}the checkpoint save of step {step}", cfg.startup_timeout):
        args: dict[str, Any] = {
            "step": step,
            "extra": extra,
            "keep_last": cfg.keep_last,
            "data_position": {"step": step, "batches_per_step": cfg.micro_batches},
            "rng": devices.rng_state(grid.device),
            "overwrite": True,
        }
        path = os.path.join(ckpt_dir, f"step_{step}")
        if saver is None:
            checkpoint.save(path, model, grid, opt, **args)
        else:
            saver.save(path, model, opt, **args)
            if step == cfg.steps:
                saver.wait()
    return time.perf_counter() - t0
