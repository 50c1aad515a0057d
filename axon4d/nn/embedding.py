"""Vocabulary-parallel token embedding and position embedding on the grid (docs/design.md §2, edges).

The table E (vocab, hidden) is split in both dims: rank (x, y) holds rows vocab/G_y · y … and
columns hidden/G_x · x …, replicated over z and data. A lookup takes the rows this rank owns
(zeros for the others) and sums over y, producing the residual-stream layout — (b, s, hidden/G_x),
replicated over y — with no rank ever holding the whole table or the whole activation width.
Gradients are averaged over batch = data × z.
"""

from __future__ import annotations

import torch
from torch import nn

from axon4d import device as devices
from axon4d.grid import rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import tiled_init
from axon4d.layout.geometry import Term, wire_dtype
from axon4d.nn.functional import average_grad_over_batch, sum_to_replicas
from axon4d.options.precision import compute_dtype


def _block(full: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    return full[rows[0] : rows[1], cols[0] : cols[1]]


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str, ignore_index: int | None = None) -> None:
    """Raise ``TypeError`` unless ``ids`` is an integer tensor, ``ValueError`` unless every id
    (other than ``ignore_index``) lies in [0, vocab_size); the message names the first bad id.

    On the host this reads one flag (no cost worth a name). On an accelerator a host read would
    stall the queue of kernels in the middle of every forward, so the check is queued as a
    device-side assertion instead (``torch._assert_async``): the step still fails, without the
    value in the message; the training job checks its batches on the host before they move."""
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dtype.is_floating_point
        or ids.dtype.is_complex
        or ids.dtype == torch.bool
    ):
        kind = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{what} must be an integer tensor (torch.long), got {kind}; convert with ids.long()")
    if ids.is_meta or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if not devices.is_host(ids.device):
        torch._assert_async(~bad.any(), f"{what} hold ids outside the vocabulary [0, {vocab_size})")
        return
    if bool(bad.any()):  # a host tensor: reading the flag costs nothing
        first = int(ids[bad][0])
        skip = f" (or {ignore_index}, ignored)" if ignore_index is not None else ""
        raise ValueError(
            f"{what} hold {first}, outside the vocabulary [0, {vocab_size}): ids must lie in 0 … {vocab_size - 1}"
            f"{skip}; check the tokenizer or give a vocab_size above the largest id"
        )


class VocabParallelEmbedding(nn.Module):
    """``torch.nn.Embedding(vocab, hidden)`` with vocab split over y and hidden over x."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.grid = runtime.resolve(grid)
        self.vocab_size, self.hidden = vocab_size, hidden
        rules.count(vocab_size, "vocab_size", example=50304)
        rules.count(hidden, "hidden", example=1024)
        rules.check(self.grid.shape, rules.embedding(vocab_size, hidden))
        v, h = vocab_size // self.grid.size("y"), hidden // self.grid.size("x")
        self.rows = (self.grid.coord("y") * v, (self.grid.coord("y") + 1) * v)
        self.cols = (self.grid.coord("x") * h, (self.grid.coord("x") + 1) * h)
        device = device if device is not None else self.grid.device
        self.weight = nn.Parameter(torch.empty(v, h, device=device, dtype=dtype))
        average_grad_over_batch(self.weight, self.grid, Term.EMBEDDING_GRAD)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 1) like ``torch.nn.Embedding``: this rank's block of the full (vocab, hidden) table
        initialised tile by tile (``axon4d.layout.tiled_init``, tensor "weight") from one seed drawn from
        torch's default generator, so a block's values depend on the seed and its position only."""
        seed = tiled_init.draw_seed()
        if self.weight.is_meta:
            return
        shape = (self.vocab_size, self.hidden)
        tiled_init.fill_(self.weight, tiled_init.Init.normal(1.0), seed, "weight", shape, self.rows[0], self.cols[0])

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor) -> VocabParallelEmbedding:
        """Copy this rank's block of a full (vocab, hidden) table given on every rank."""
        if tuple(weight.shape) != (self.vocab_size, self.hidden):
            raise ValueError(
                f"dense embedding has shape {tuple(weight.shape)}, expected ({self.vocab_size}, {self.hidden})"
            )
        self.weight.copy_(_block(weight, self.rows, self.cols))
        return self

    def _assemble(self, block: torch.Tensor) -> torch.Tensor:
        comm = self.grid.comm
        t = comm.all_gather(block.detach().contiguous(), "x", dim=1, tag=Term.DENSE).wait()
        return comm.all_gather(t.contiguous(), "y", dim=0, tag=Term.DENSE).wait().clone()

    def to_dense(self, grads: bool = False) -> nn.Embedding:
        dense = nn.Embedding(self.vocab_size, self.hidden, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(self._assemble(self.weight))
        if grads and self.weight.grad is not None:
            dense.weight.grad = self._assemble(self.weight.grad)
        return dense

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids → (b, s, hidden/G_x), replicated over y.

        Ids must be integers in [0, vocab_size) of the whole vocabulary (checked here: one
        reduction and one host sync per call, no communication)."""
        check_token_ids(ids, self.vocab_size, "token ids")
        lo, hi = self.rows
        mine = (ids >= lo) & (ids < hi)
        local = torch.where(mine, ids - lo, torch.zeros_like(ids))
        dtype = wire_dtype(self.grid.precision, Term.EMBEDDING, self.weight.dtype)  # what the all-reduce moves
        out = nn.functional.embedding(local, self.weight).to(dtype) * mine.unsqueeze(-1).to(dtype)
        return sum_to_replicas(out, "y", self.grid, Term.EMBEDDING, in_place=True)  # out: a temporary


class PositionEmbedding(nn.Module):
    """Learned absolute positions (GPT): a (seq_len, hidden/G_x) slice per rank, added to the stream."""

    def __init__(
        self,
        seq_len: int,
        hidden: int,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.grid = runtime.resolve(grid)
        self.seq_len, self.hidden = seq_len, hidden
        rules.positions(hidden).check(self.grid.shape)
        h = hidden // self.grid.size("x")
        self.cols = (self.grid.coord("x") * h, (self.grid.coord("x") + 1) * h)
        device = device if device is not None else self.grid.device
        self.weight = nn.Parameter(torch.zeros(seq_len, h, device=device, dtype=dtype))
        average_grad_over_batch(self.weight, self.grid, Term.POSITION_GRAD)
        if not self.weight.is_meta:  # N(0, 0.02²): this rank's columns of the full table, drawn tile by tile
            seed = tiled_init.draw_seed()
            tiled_init.fill_(
                self.weight, tiled_init.Init.normal(0.02), seed, "weight", (seq_len, hidden), 0, self.cols[0]
            )

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor) -> PositionEmbedding:
        self.weight.copy_(weight[:, self.cols[0] : self.cols[1]])
        return self

    def to_dense(self, grads: bool = False) -> nn.Embedding:
        dense = nn.Embedding(self.seq_len, self.hidden, device=self.weight.device, dtype=self.weight.dtype)
        gather = lambda t: self.grid.comm.all_gather(t.detach().contiguous(), "x", dim=1, tag=Term.DENSE).wait().clone()  # noqa: E731
        with torch.no_grad():
            dense.weight.copy_(gather(self.weight))
        if grads and self.weight.grad is not None:
            dense.weight.grad = gather(self.weight.grad)
        return dense

    def forward(self, seq: int) -> torch.Tensor:
        """(seq, hidden/G_x) positions 0 … seq−1."""
        if seq > self.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the position table's seq_len = {self.seq_len}")
        return self.weight[:seq].to(compute_dtype(self.grid.precision, self.weight))
