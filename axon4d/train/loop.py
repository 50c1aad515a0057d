"""The training loop on the 4D grid: ``train(cfg)`` and the command's ``main(args)``.

``train`` builds the grid (``axon4d.runtime.init``; ``--grid auto`` asks the planner), the model
(``axon4d.models.transformer.Transformer``) on it and the optimizer, resumes from the newest
checkpoint if asked, and runs the steps: this step's micro-batches (``batches``) → gradient
clipping and AdamW on the schedule (``optim``) → the step record, with the communication the
grid's ``CommLog`` saw during the step (``report``). Rank 0 shows the progress bar and writes the
log; checkpoints (``axon4d.checkpoint``) are saved every ``save_every`` steps and at the end, and a
resumed run continues on the same loss curve. With ``--compare-single`` rank 0 afterwards trains
the same model in one process (``reference``).

Everything the job computes lives on the grid's device (``grid.device``: a GPU under NCCL, the
host under gloo or MPI): the model, each rank's rows of a batch, the loss and its all-reduce, the
gradient norm, the peak probe. Step times are taken after synchronising that device. At start-up
rank 0 warns when the compute dtype's matmuls are much slower than fp32's (``peak``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import torch
from tqdm import tqdm

from axon4d import checkpoint, runtime
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.grid import Grid
from axon4d.models.transformer import Transformer
from axon4d.policy import check_recompute
from axon4d.precision import Precision
from axon4d.train import reference, report
from axon4d.train.batches import accumulate, make_data, step_batches
from axon4d.train.config import TrainConfig, from_args
from axon4d.train.optim import clip, make_optimizer, set_lr
from axon4d.train.peak import check_compute_dtype, mfu, world_peak_tflops


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training job described by ``cfg`` on the grid; return the run summary (all ranks)."""
    Precision.parse(cfg.precision)  # a bad name fails here, on every rank, before any communication
    check_recompute(cfg.recompute)  # likewise
    mcfg = cfg.model_config()
    grid_spec = "auto" if cfg.grid == "auto" else tuple(int(s) for s in cfg.grid.split(","))
    grid = runtime.init(
        grid=grid_spec,
        seed=cfg.seed,
        precision=cfg.precision,
        comm=cfg.comm,
        plan={
            "model": mcfg,
            "batch": cfg.batch_size,
            "machine": cfg.machine or None,
            "dtype": "float32" if cfg.precision == "fp32" else "bfloat16",
            "recompute": cfg.recompute,
        },
    )
    try:
        return _train_on(grid, cfg, mcfg)
    finally:
        runtime.shutdown()


def main(args: argparse.Namespace) -> int:
    """Train with the config of the parsed flags (``config.add_arguments``)."""
    train(from_args(args))
    return 0


def build_model(mcfg: ModelConfig, grid: Grid, recompute: str = "none") -> Transformer:
    """The run's model on ``grid`` with activation recomputation ``recompute`` (axon4d.nn.recompute)."""
    return Transformer(mcfg, grid=grid, recompute=recompute)


def _global_mean(value: torch.Tensor, grid: Grid) -> float:
    """Mean over the batch axis of a per-rank scalar (each rank's loss is over its own tokens)."""
    local = devices.to_device(value.detach().float().reshape(1).clone(), grid.device)
    total = grid.comm.all_reduce(local, "batch", tag="log").wait()
    return float(total) / grid.size("batch")


def _train_on(grid: Grid, cfg: TrainConfig, mcfg: ModelConfig) -> dict[str, Any]:
    """The run on a built grid: resume, train, checkpoint, report; the summary plus every step's loss."""
    rank0 = grid.rank == 0
    model = build_model(mcfg, grid, cfg.recompute)
    initial_dense = model.to_dense() if cfg.compare_single else None
    opt = make_optimizer(model, cfg)
    data = make_data(cfg, mcfg, grid)
    ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
    start = 0
    if cfg.resume:
        found = checkpoint.latest(ckpt_dir)
        if found is not None:
            start = int(checkpoint.load(found, model, grid, opt)["step"])
    check_compute_dtype(grid)
    peak_total = world_peak_tflops(grid, cfg.peak_tflops)
    if rank0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(report.banner(grid, cfg.model, mcfg, peak_total, start, cfg.recompute))
    log = report.LogFile(cfg.out_dir, cfg.log_every, enabled=rank0)
    tokens_per_step = cfg.batch_size * cfg.micro_batches * mcfg.seq_len
    bar = tqdm(total=cfg.steps, initial=start, disable=not (rank0 and cfg.progress), ncols=110, desc="train")
    records, losses = [], []
    for step in range(start, cfg.steps):
        grid.comm.log.clear()
        t0 = time.perf_counter()
        lr = set_lr(opt, step, cfg)
        loss = accumulate(model, step_batches(data, step, cfg), grid)
        norm = clip(model, cfg, grid)
        opt.step()
        opt.zero_grad(set_to_none=True)
        devices.synchronize(grid.device)  # an accelerator runs the step asynchronously
        dt = time.perf_counter() - t0
        comm = grid.comm.log.summary()  # this step's collectives (the loss all-reduce below is not one)
        mean_loss = _global_mean(loss, grid)
        losses.append(mean_loss)
        tps = tokens_per_step / dt
        rec = report.step_record(
            step + 1, mean_loss, lr, norm, dt, tps, mfu(mcfg.flops_per_token(), tps, peak_total), comm
        )
        records.append(rec)
        log.write(rec)
        bar.set_postfix_str(report.progress_line(rec))
        bar.update()
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            checkpoint.save(
                os.path.join(ckpt_dir, f"step_{step + 1}"),
                model,
                grid,
                opt,
                step=step + 1,
                extra={"train_config": dataclasses.asdict(cfg)},
            )
    bar.close()
    final = os.path.join(ckpt_dir, f"step_{cfg.steps}")
    checkpoint.save(final, model, grid, opt, step=cfg.steps, extra={"train_config": dataclasses.asdict(cfg)})
    summary = report.summarize(records, cfg.steps, grid, final, recompute=cfg.recompute)
    log.close()
    if rank0:
        print(report.format_summary(summary))
        report.write_summary(cfg.out_dir, summary)
    if initial_dense is not None and rank0 and start == 0:
        reference.compare(initial_dense, cfg, mcfg, losses, summary)
    summary["losses"] = losses
    return summary
