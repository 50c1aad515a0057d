"""Protects the token streams: batches are a pure function of (seed, step), text files are read
as uint16/uint32 memmaps with their ids checked against the vocabulary, and the synthetic language
is learnable (it follows its rule). A rank builds only its rows of a step's global batch
(``SyntheticTokens.rows``, ``MemmapTokens.rows``, ``axon4d.train.batches.MicroBatch``): the same
bits as those rows of the whole batch built as it was before (``_whole_batch_as_before``, kept
here as the reference), on every rank of a few grids, with and without context parallelism."""

import numpy as np
import pytest
import torch

from axon4d import activations
from axon4d.data.tokens import MemmapTokens, SyntheticTokens, prepare_text
from axon4d.grid.shape import GridShape
from axon4d.train.batches import MicroBatch, rank_tokens


def _whole_batch_as_before(data, step: int, batch_size: int) -> torch.Tensor:
    """A step's whole global batch as every rank built it before it built only its rows."""
    gen = torch.Generator().manual_seed(data.seed * 1_000_003 + step)
    if isinstance(data, MemmapTokens):
        starts = torch.randint(0, len(data.tokens) - data.seq_len - 1, (batch_size,), generator=gen)
        rows = [np.asarray(data.tokens[s : s + data.seq_len + 1], dtype=np.int64) for s in starts.tolist()]
        return torch.from_numpy(np.stack(rows))
    d = data.stride[torch.randint(0, len(data.stride), (batch_size,), generator=gen)]
    t = torch.empty(batch_size, data.seq_len + 1, dtype=torch.long)
    t[:, 0] = torch.randint(0, data.vocab_size, (batch_size,), generator=gen)
    noise = torch.rand(batch_size, data.seq_len, generator=gen) < data.noise
    random = torch.randint(0, data.vocab_size, (batch_size, data.seq_len), generator=gen)
    for i in range(data.seq_len):
        t[:, i + 1] = torch.where(noise[:, i], random[:, i], (t[:, i] + d) % data.vocab_size)
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize(
    "vocab, seq, noise", [(97, 16, 0.0), (256, 64, 0.1), (128_256, 300, 0.5), (7, 5, 1.0), (50_000, 1, 0.1)]
)
def test_synthetic_rows_are_those_of_the_whole_batch_as_before(vocab, seq, noise):
    data = SyntheticTokens(vocab, seq, seed=3, noise=noise)
    for step, n in ((0, 1), (4, 12), (9, 16)):
        before = _whole_batch_as_before(data, step, n)
        assert _same(data.batch(step, n), before)
        for lo, hi in {(0, 1), (0, n), (n - 1, n), (n // 2, n), (n // 4, n // 2 or 1)}:
            if lo < hi:
                assert _same(data.global_batch(step, n).rows(lo, hi), before[lo:hi]), (step, n, lo, hi)
        batch = data.global_batch(step, n)  # its rows in any order, its draws made once
        for lo in reversed(range(0, n, 3)):
            assert _same(batch.rows(lo, min(lo + 3, n)), before[lo : lo + 3])
    with pytest.raises(ValueError, match="rows 3:3 are not rows of a batch of 4"):
        data.global_batch(0, 4).rows(3, 3)


def test_file_rows_are_those_of_the_whole_batch_as_before(tmp_path):
    path = str(tmp_path / "text.u16")
    prepare_text("the rows of a rank, read alone. " * 40, path)
    data = MemmapTokens(path, seq_len=8, vocab_size=256, seed=2)
    before = _whole_batch_as_before(data, 3, 10)
    assert _same(data.batch(3, 10), before)
    batch = data.global_batch(3, 10)
    assert all(_same(batch.rows(lo, hi), before[lo:hi]) for lo, hi in ((0, 1), (2, 7), (9, 10)))


class _Rank:
    """One rank of a grid of ``shape`` as ``shard_batch`` and ``shard_sequence`` see it."""

    def __init__(self, shape: GridShape, rank: int) -> None:
        self.shape, self.rank = shape, rank

    def size(self, axis: str) -> int:
        return self.shape.size(axis)

    def coord(self, axis: str) -> int:
        return self.shape.coordinate(self.rank, axis)


@pytest.mark.parametrize(
    "shape", [GridShape(1, 1, 1, 1), GridShape(2, 1, 2, 2), GridShape(1, 2, 4, 1), GridShape(1, 1, 1, 8)]
)
@pytest.mark.parametrize("context_parallel", [False, True])
def test_every_rank_builds_only_its_rows_and_trains_on_the_tokens_it_did_before(shape, context_parallel):
    data = SyntheticTokens(1000, 32, seed=7)
    size, parts, step = 8, 3, 5  # micro-batches of 8 sequences, 3 to a step
    before = _whole_batch_as_before(data, step, size * parts)
    for rank in range(shape.world_size):
        grid = _Rank(shape, rank)
        batch = data.global_batch(step, size * parts)  # one a step, read by its micro-batches
        built: list[tuple[int, int]] = []
        rows = batch.rows
        batch.rows = lambda lo, hi: (built.append((lo, hi)), rows(lo, hi))[1]  # type: ignore[method-assign]
        for i in range(parts):
            full = before[i * size : (i + 1) * size]
            if context_parallel:
                expected = tuple(activations.shard_sequence(t, grid) for t in (full[:, :-1], full[:, 1:]))
            else:
                expected = activations.shard_batch(full, grid)[:, :-1], activations.shard_batch(full, grid)[:, 1:]
            got = rank_tokens(MicroBatch(batch, i, size), grid, context_parallel)
            assert all(_same(a, b) for a, b in zip(got, expected)), (rank, i)
            assert all(_same(a, b) for a, b in zip(rank_tokens(full, grid, context_parallel), expected))
        share = size // shape.size("data" if context_parallel else "batch")
        assert [hi - lo for lo, hi in built] == [share] * parts  # only its rows
    whole = rank_tokens(MicroBatch(data.global_batch(step, size * parts), 1, size), None)
    assert _same(whole[0], before[size : 2 * size, :-1]) and _same(whole[1], before[size : 2 * size, 1:])


def test_synthetic_batches_are_deterministic_and_follow_their_rule():
    data = SyntheticTokens(vocab_size=97, seq_len=16, seed=3, noise=0.0)
    a, b = data.batch(5, 4), data.batch(5, 4)
    assert torch.equal(a, b) and not torch.equal(a, data.batch(6, 4))
    assert a.shape == (4, 17) and int(a.max()) < 97
    stride = (a[:, 1] - a[:, 0]) % 97
    assert torch.equal((a[:, 1:] - a[:, :-1]) % 97, stride[:, None].expand(4, 16))


def test_text_file_round_trip_and_windows(tmp_path):
    path = str(tmp_path / "text.u16")
    n = prepare_text("hello, axon4d! " * 50, path)
    assert n == 15 * 50
    data = MemmapTokens(path, seq_len=8, vocab_size=256, seed=1)
    batch = data.batch(0, 3)
    assert batch.shape == (3, 9) and torch.equal(batch, data.batch(0, 3))
    text = "hello, axon4d! " * 3
    assert all(bytes(row.tolist()).decode() in text for row in batch)


def test_uint32_files_and_bad_inputs(tmp_path):
    path = str(tmp_path / "ids.u32")
    np.arange(100, dtype=np.uint32).tofile(path)
    assert MemmapTokens(path, seq_len=10, vocab_size=100).batch(0, 2).max() < 100
    with pytest.raises(ValueError, match="contains token id 99, but the model's vocab_size is 50"):
        MemmapTokens(path, seq_len=10, vocab_size=50)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        MemmapTokens(path, seq_len=200, vocab_size=100)
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        MemmapTokens(path, seq_len=10, vocab_size=100, dtype="int8")
