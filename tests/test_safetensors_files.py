"""Protects the safetensors files written tensor by tensor (axon4d.files.safetensors_files): safetensors
reads back every dtype, shape and byte the writer was given, shards are cut by transformers' rule
and listed in an index, and a writer refuses a tensor out of its planned order."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from axon4d.files.safetensors_files import INDEX_FILE, SINGLE_FILE, ShardedWriter, TensorSpec, layout, parse_size


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=gen).t(),  # a view that is not contiguous
        "b.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d.empty": torch.zeros(0, 4),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.mask": torch.tensor([True, False, True]),
    }


def _write(directory, tensors, limit):
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = ShardedWriter(str(directory), specs, limit)
    for name, t in tensors.items():
        writer.write(name, t)
    return writer.close()


def test_safetensors_reads_back_what_was_written(tmp_path):
    tensors = _tensors()
    written = _write(tmp_path, tensors, parse_size("1GB"))
    assert written == [SINGLE_FILE]
    with open(tmp_path / SINGLE_FILE, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % 8 == 0  # the data begins 8-byte aligned
    with safe_open(str(tmp_path / SINGLE_FILE), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name


def test_shards_follow_the_size_limit_and_the_index_lists_them(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    tensors["big"] = torch.ones(30)  # 120 bytes: over the limit, a file of its own
    written = _write(tmp_path, tensors, 100)
    assert written[-1] == INDEX_FILE and len(written) == 5
    with open(tmp_path / INDEX_FILE) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == 5 * 40 + 120
    assert index["weight_map"]["t0"] == index["weight_map"]["t1"] == "model-00001-of-00004.safetensors"
    assert len({index["weight_map"][n] for n in ("t4", "big")}) == 2
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(tmp_path, file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), tensors[name])
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    assert [len(f) for f in layout(specs, 100)] == [2, 2, 1, 1]


def test_refusals(tmp_path):
    for bad in ("5XB", "-1", 0, "GB"):
        with pytest.raises(ValueError, match="shard size"):
            parse_size(bad)
    assert parse_size("2GiB") == 2**31 and parse_size("500MB") == 5 * 10**8 and parse_size(1234) == 1234
    specs = [TensorSpec("x", (2,), torch.float32), TensorSpec("y", (2,), torch.float32)]
    writer = ShardedWriter(str(tmp_path), specs, 100)
    with pytest.raises(RuntimeError, match="next tensor is x"):
        writer.write("y", torch.zeros(2))
    with pytest.raises(RuntimeError, match="next tensor is x"):
        writer.write("x", torch.zeros(3))
    writer.write("x", torch.zeros(2))
    with pytest.raises(RuntimeError, match="unwritten"):
        writer.close()
    with pytest.raises(ValueError, match="planned twice"):
        ShardedWriter(str(tmp_path), specs + specs[:1], 100)
    with pytest.raises(ValueError, match="safetensors cannot store"):
        _write(tmp_path / "c", {"z": torch.zeros(2, dtype=torch.complex64)}, 100)
