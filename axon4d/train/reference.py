"""The single-process reference run: the same model trained in one process with plain PyTorch.

With ``--compare-single``, rank 0 takes the model's initial weights as a ``DenseTransformer``
(``Transformer.to_dense``; with ``--hf`` the unparallelized Hugging Face model,
``HFCausalLM.to_dense``) and trains it on the same batches with the same schedule, optimizer and
clipping (``torch.nn.utils.clip_grad_norm_``) — no grid, no axon4d layers — so its loss curve
is what the 4D-parallel run must reproduce (docs/design.md §8, "equal to the dense model"). Mixed
precision uses ``torch.autocast``, the usual single-process way. ``compare`` then adds the
reference curve and the largest relative difference to the run summary and plots both curves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from tqdm import tqdm

from axon4d.config import ModelConfig
from axon4d.models.transformer import DenseTransformer
from axon4d.options.precision import Precision
from axon4d.train import report
from axon4d.train.batches import accumulate, make_data, step_batches
from axon4d.train.config import TrainConfig
from axon4d.train.hf import HFCausalLM
from axon4d.train.optim import make_optimizer, set_lr


def train_single(dense: DenseTransformer | HFCausalLM, cfg: TrainConfig, mcfg: ModelConfig) -> list[float]:
    """The same run in one process with plain PyTorch; returns the loss of every step."""
    opt = make_optimizer(dense, dataclasses.replace(cfg, zero=0))  # one process: no data axis to shard over
    data = make_data(cfg, mcfg)
    precision, p0 = Precision.parse(cfg.precision), next(dense.parameters())  # mixed: autocast, the usual way
    losses = []
    for step in tqdm(range(cfg.steps), desc="1 process", ncols=110, disable=not cfg.progress):
        set_lr(opt, step, cfg)
        batches = step_batches(data, step, cfg)
        with torch.autocast(p0.device.type, dtype=precision.compute, enabled=precision.mixed):
            loss = accumulate(dense, batches, None, eos=cfg.packed_documents if cfg.packed_documents >= 0 else None)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(dense.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def compare(
    dense: DenseTransformer | HFCausalLM,
    cfg: TrainConfig,
    mcfg: ModelConfig,
    losses: list[float],
    summary: dict[str, Any],
) -> None:
    """Train ``dense`` (the initial weights) in one process, then report both curves (rank 0).

    Adds ``single_process_losses`` and ``max_rel_diff`` to ``summary``, prints the difference,
    writes ``loss.png`` and rewrites ``summary.json``."""
    ref = train_single(dense, cfg, mcfg)
    summary["single_process_losses"] = ref
    summary["max_rel_diff"] = max(abs(a - b) / b for a, b in zip(losses, ref))
    print(
        f"single process vs 4D grid: max relative loss difference over {len(ref)} steps = {summary['max_rel_diff']:.1e}"
    )
    png = report.plot_curves(os.path.join(cfg.out_dir, "loss.png"), losses, ref, cfg.grid)
    print(f"loss curves: {png}")
    report.write_summary(cfg.out_dir, summary)
