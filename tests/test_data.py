"""Protects the token streams: batches are a pure function of (seed, step), text files are read
as uint16/uint32 memmaps with their ids checked against the vocabulary, and the synthetic language
is learnable (it follows its rule)."""

import numpy as np
import pytest
import torch

from axon4d.data.tokens import MemmapTokens, SyntheticTokens, prepare_text


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
