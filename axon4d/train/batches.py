"""What a step trains on: the token stream ``--data`` names, and a step's micro-batches.

``make_data`` opens the stream (``axon4d.data.tokens``): synthetic, the byte-level demo corpus (written
once, by rank 0, to ``build/corpus.u16``), or a token file. A step's global batch is drawn from
(seed, step), the same on every rank; ``accumulate`` runs forward and backward over its
micro-batches, each rank on its own rows (``axon4d.activations.shard_batch``, tokens split over
batch = data × z, docs/design.md §1; under ``--context-parallel`` each sequence's tokens split
head–tail over z, ``axon4d.activations.shard_sequence``), so the gradients add up to those of the whole batch. The
single-process reference run calls it with no grid and trains on all rows. A step's micro-batches
are ``MicroBatch``es: a rank builds only the rows it trains on (the same bits as those rows of the
whole batch), on the host (the same bits on every machine), and moves them to the model's device
(``axon4d.device.to_device``), where the loss is accumulated too. With packed documents (``eos``,
``--packed-documents``) a rank reads the document boundaries of its rows on the host, before the
step (``axon4d.data.documents.Documents.from_eos``), and gives them to the model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from axon4d import activations
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.data.documents import Documents
from axon4d.data.tokens import MemmapBatch, MemmapTokens, SyntheticBatch, SyntheticTokens, demo_corpus
from axon4d.grid.mesh import Grid
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.options.context_mode import context_axis
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


@dataclass(frozen=True)
class MicroBatch:
    """Micro-batch ``index`` of a step: rows ``index·size`` to ``(index + 1)·size`` of the step's
    global ``batch`` (``axon4d.data.tokens``: one for all the step's micro-batches, its random draws
    made once), built only as far as they are read (``rows``, ``tensor``)."""

    batch: SyntheticBatch | MemmapBatch
    index: int
    size: int

    @property
    def seq_len(self) -> int:
        return self.batch.seq_len

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Its rows ``lo:hi`` (hi − lo, S+1): the same bits as those rows of the whole batch."""
        if not 0 <= lo < hi <= self.size:
            raise ValueError(f"rows {lo}:{hi} are not rows of a micro-batch of {self.size}")
        start = self.index * self.size
        return self.batch.rows(start + lo, start + hi)

    def tensor(self) -> torch.Tensor:
        """All of it (size, S+1)."""
        return self.rows(0, self.size)


def step_batches(data: SyntheticTokens | MemmapTokens, step: int, cfg: TrainConfig) -> tuple[MicroBatch, ...]:
    """The global micro-batches of ``step`` (``cfg.micro_batches`` of ``cfg.batch_size`` sequences
    each, in order, of the step's global batch), none built yet."""
    batch = data.global_batch(step, cfg.batch_size * cfg.micro_batches)
    return tuple(MicroBatch(batch, i, cfg.batch_size) for i in range(cfg.micro_batches))


def accumulate(
    model: Trained, batches: Sequence[torch.Tensor | MicroBatch], grid: Grid | None, eos: int | None = None
) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns the mean loss (this rank's tokens).

    With a grid each rank trains on its rows of each micro-batch; with ``grid=None`` (one
    process) on all of them. The rows go to the device of the model's parameters (the grid's).
    ``eos``: packed documents, each ending after an ``eos`` token (``rank_documents``)."""
    total = torch.zeros((), device=_device(model, grid))
    for i, full in enumerate(batches):
        total += accumulate_one(model, full, grid, last=i == len(batches) - 1, parts=len(batches), eos=eos)
    return total


def _device(model: Trained, grid: Grid | None) -> torch.device:
    return grid.device if grid is not None else next(model.parameters()).device


def accumulate_one(
    model: Trained, full: torch.Tensor | MicroBatch, grid: Grid | None, last: bool, parts: int, eos: int | None = None
) -> torch.Tensor:
    """Forward and backward of one micro-batch ``full`` (B, S+1: a tensor, or a ``MicroBatch`` of
    which only this rank's rows are built) — inputs are the first S tokens of each row, targets the
    last S — its loss divided by ``parts`` (the step's micro-batches); returns that loss, detached.
    Unless it is the ``last`` of its step, its backward holds the data-axis reductions
    (axon4d.scheduler, accumulation): the last one's reduces the step's sums once."""
    device = _device(model, grid)
    context_parallel = getattr(model, "context_parallel", False)
    axes = "z,data" if getattr(model, "context_axis", "z") == "batch" else "z"  # hierarchical: z × data
    if eos is None:
        inputs, targets = rank_tokens(full, grid, context_parallel, axes)
    else:
        inputs, targets, documents = rank_documents(full, grid, context_parallel, eos, axes)
    inputs, targets = devices.to_device(inputs, device), devices.to_device(targets, device)
    if eos is None:
        loss = model.loss(inputs, targets) / parts
    else:
        assert not isinstance(model, HFCausalLM)  # TrainConfig.check refuses --packed-documents with --hf
        loss = model.loss(inputs, targets, documents) / parts
    hold = grid is not None and not last
    with grid.scheduler.accumulating() if hold else contextlib.nullcontext():  # type: ignore[union-attr]
        loss.backward()
    return loss.detach()


def rank_documents(
    full: torch.Tensor | MicroBatch, grid: Grid | None, context_parallel: bool, eos: int, axes: str = "z"
) -> tuple[torch.Tensor, torch.Tensor, Documents]:
    """``rank_tokens`` of packed documents: this rank's (inputs, targets) and the ``Documents`` of its
    rows, a document ending after each ``eos`` input token, read on the host. Under
    ``context_parallel`` the layout describes each row's whole sequence, and the rank's tokens are the
    two chunks ``Documents.chunks`` gives its z coordinate (balanced by attention work)."""
    if grid is None or not context_parallel:
        inputs, targets = rank_tokens(full, grid, False)
        return inputs, targets, Documents.from_eos(inputs, eos)
    total = full.size if isinstance(full, MicroBatch) else full.shape[0]
    axis = context_axis(axes)
    split = grid.size("data") if axis == "z" else 1  # hierarchical: every rank reads every sequence
    n = total // split
    if n * split != total:
        raise ValueError(
            f"a micro-batch of {total} sequences cannot be split over data = {grid.size('data')} with context "
            f"parallelism: give a batch size that is a multiple of {grid.size('data')}"
        )
    lo = grid.coord("data") * n if axis == "z" else 0  # this rank's sequences (over data), whole
    rows = full.rows(lo, lo + n) if isinstance(full, MicroBatch) else full[lo : lo + n]
    documents = Documents.from_eos(rows[:, :-1], eos)
    index = documents.index(grid.coord(axis), grid.size(axis))  # (b, S/G): this rank's tokens
    return rows[:, :-1].gather(1, index), rows[:, 1:].gather(1, index), documents


def rank_tokens(
    full: torch.Tensor | MicroBatch, grid: Grid | None, context_parallel: bool = False, axes: str = "z"
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of micro-batch ``full``: its rows over batch = data × z
    (``axon4d.activations.shard_batch``), or under ``context_parallel`` its rows over data and its
    head–tail tokens over z (``axon4d.activations.shard_sequence``; with ``axes="z,data"`` every row,
    its tokens over z × data); all of them without a grid. A
    ``MicroBatch`` builds only those rows, which the two functions pick out of an index."""
    if grid is None:
        rows = full.tensor() if isinstance(full, MicroBatch) else full
        return rows[:, :-1], rows[:, 1:]
    if not isinstance(full, MicroBatch):
        if context_parallel:
            inputs, targets = full[:, :-1], full[:, 1:]
            return activations.shard_sequence(inputs, grid, axes=axes), activations.shard_sequence(
                targets, grid, axes=axes
            )
        rows = activations.shard_batch(full, grid)
        return rows[:, :-1], rows[:, 1:]
    n, seq = full.size, full.seq_len
    if context_parallel:  # the rows over data and the positions over z, picked out of indices
        mine = activations.shard_sequence(torch.arange(n)[:, None].expand(n, seq), grid, axes=axes)[:, 0]
        positions = activations.shard_sequence(torch.arange(seq)[None, :].expand(n, seq), grid, axes=axes)[0]
        rows = full.rows(int(mine[0]), int(mine[-1]) + 1)
        return rows[:, :-1].index_select(1, positions), rows[:, 1:].index_select(1, positions)
    mine = activations.shard_batch(torch.arange(n), grid)
    rows = full.rows(int(mine[0]), int(mine[-1]) + 1)
    return rows[:, :-1], rows[:, 1:]
