"""What a step trains on: the token stream ``--data`` names, and a step's micro-batches.

``make_data`` opens the stream (``axon4d.data.tokens``): synthetic, the byte-level demo corpus (written
once, by rank 0, to ``build/corpus.u16``), or a token file. A step's global batch is drawn from
(seed, step), the same on every rank; ``accumulate`` runs forward and backward over its
micro-batches, each rank on its own rows (``axon4d.activations.shard_batch``, tokens split over
batch = data × z, docs/design.md §1; under ``--context-parallel`` each sequence's tokens split
head–tail over z, ``axon4d.activations.shard_sequence``), so the gradients add up to those of the whole batch. The
single-process reference run calls it with no grid and trains on all rows. Batches are made on the
host (the same bits on every machine); a rank moves only its rows to the model's device
(``axon4d.device.to_device``), where the loss is accumulated too.
"""

from __future__ import annotations

import contextlib
import os

import torch

from axon4d import activations
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.data.tokens import MemmapTokens, SyntheticTokens, demo_corpus
from axon4d.grid.mesh import Grid
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.train.config import TrainConfig
from axon4d.train.hf import HFCausalLM

#: what ``accumulate`` trains: axon4d's models, or a Hugging Face one (``axon4d.train.hf``)
Trained = Transformer | DenseTransformer | HFCausalLM

CORPUS_PATH = os.path.join("build", "corpus.u16")


def make_data(cfg: TrainConfig, mcfg: ModelConfig, grid: Grid | None = None) -> SyntheticTokens | MemmapTokens:
    """The token stream ``cfg.data`` names; the demo corpus is written once, by rank 0. A token
    file that is missing is a ``FileNotFoundError``, one that is too short or holds ids outside the
    vocabulary a ``ValueError`` (``axon4d.data.tokens.MemmapTokens``)."""
    if cfg.data == "synthetic":
        return SyntheticTokens(mcfg.vocab_size, mcfg.seq_len, seed=cfg.seed)
    path = cfg.data
    if cfg.data == "corpus":
        path = CORPUS_PATH
        if grid is None or grid.rank == 0:
            demo_corpus(path)
        if grid is not None:
            grid.comm.barrier()
    return MemmapTokens(path, mcfg.seq_len, mcfg.vocab_size, seed=cfg.seed)


def step_batches(data: SyntheticTokens | MemmapTokens, step: int, cfg: TrainConfig) -> tuple[torch.Tensor, ...]:
    """The global micro-batches of ``step`` (``cfg.micro_batches`` of ``cfg.batch_size`` sequences each)."""
    return data.batch(step, cfg.batch_size * cfg.micro_batches).chunk(cfg.micro_batches)


def accumulate(model: Trained, batches: tuple[torch.Tensor, ...], grid: Grid | None) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns the mean loss (this rank's tokens).

    With a grid each rank trains on its rows of each micro-batch; with ``grid=None`` (one
    process) on all of them. The rows go to the device of the model's parameters (the grid's)."""
    total = torch.zeros((), device=_device(model, grid))
    for i, full in enumerate(batches):
        total += accumulate_one(model, full, grid, last=i == len(batches) - 1, parts=len(batches))
    return total


def _device(model: Trained, grid: Grid | None) -> torch.device:
    return grid.device if grid is not None else next(model.parameters()).device


def accumulate_one(model: Trained, full: torch.Tensor, grid: Grid | None, last: bool, parts: int) -> torch.Tensor:
    """Forward and backward of one micro-batch ``full`` (B, S+1) — inputs are the first S tokens of
    each row, targets the last S — its loss divided by ``parts`` (the step's micro-batches); returns that
    loss, detached. Unless it is the ``last`` of its step, its backward holds the data-axis
    reductions (axon4d.scheduler, accumulation): the last one's reduces the step's sums once."""
    device = _device(model, grid)
    if grid is not None and getattr(
        model, "context_parallel", False
    ):  # tokens split head–tail over z (docs/context.md)
        inputs, targets = (activations.shard_sequence(t, grid) for t in (full[:, :-1], full[:, 1:]))
    else:
        rows = activations.shard_batch(full, grid) if grid is not None else full
        inputs, targets = rows[:, :-1], rows[:, 1:]
    inputs, targets = devices.to_device(inputs, device), devices.to_device(targets, device)
    loss = model.loss(inputs, targets) / parts
    hold = grid is not None and not last
    with grid.scheduler.accumulating() if hold else contextlib.nullcontext():  # type: ignore[union-attr]
        loss.backward()
    return loss.detach()
