"""Safetensors files written tensor by tensor, cut into shards by size, with their index.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a model exported
by slices (axon4d.export) holds one whole tensor at a time. The format is simple enough to stream:
an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
``data_offsets`` (begin, end) into the bytes that follow, then the raw bytes, row-major, in
little-endian order. Since every tensor's name, shape and dtype is known before any is gathered,
``ShardedWriter`` lays the files out first (``layout``: Hugging Face's ``max_shard_size`` rule), writes
each file's header when the file opens, and then appends each tensor's bytes as it arrives, in the
planned order. What it writes is what ``save_pretrained`` writes: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json`` (total size and
each tensor's file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import BinaryIO

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: torch dtype → the safetensors dtype name
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

#: host bytes a tensor on another device is copied in, at most, per write
CHUNK_BYTES = 1 << 24

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes of a shard size limit: an integer, or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"``
    (transformers' ``max_shard_size`` units: KB, MB, GB = powers of 1000; KiB, MiB, GiB of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"shard size {size!r} is not a size; give bytes (an integer) or a number with a unit "
                f"({', '.join(u for u in _UNITS if u)}), e.g. '5GB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"shard size {size!r} must be at least 1 byte, e.g. '5GB'")
    return value


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name in the file, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def layout(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """``specs`` cut, in order, into files of at most ``max_shard_bytes`` bytes of tensor data
    each; a tensor larger than that gets a file of its own (as transformers' ``save_pretrained``)."""
    files: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if files[-1] and size + spec.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


def _header(specs: list[TensorSpec]) -> bytes:
    """The length-prefixed JSON header of a file holding ``specs`` in order (padded with spaces to
    8 bytes, as safetensors writes it)."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_bytes(f: BinaryIO, t: torch.Tensor) -> None:
    """Append ``t``'s raw bytes, row-major, to ``f``: straight from its storage in host memory (no
    copy of a contiguous tensor), in host copies of at most ``CHUNK_BYTES`` from another device."""
    flat = t.detach().contiguous().view(-1)
    if flat.numel() == 0:
        return
    step = max(1, CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        part = part if part.device.type == "cpu" else part.cpu()
        f.write(part.view(torch.uint8).numpy().data)


class ShardedWriter:
    """Writes ``specs`` in order into safetensors files in ``directory`` (``layout``), each tensor's
    bytes as ``write`` gets them; ``close`` writes the index when there are several files."""

    def __init__(self, directory: str, specs: list[TensorSpec], max_shard_bytes: int):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {dup!r} is planned twice; every tensor of a checkpoint has one name")
        for spec in specs:
            if spec.dtype not in DTYPES:
                raise ValueError(
                    f"{spec.name} has dtype {spec.dtype}, which safetensors cannot store; "
                    f"cast it to one of {', '.join(str(d) for d in DTYPES)}"
                )
        self.directory = directory
        self.files = layout(specs, max_shard_bytes)
        n = len(self.files)
        self.file_names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self.order = [(k, spec) for k, specs_k in enumerate(self.files) for spec in specs_k]
        self.next = 0
        self.handle: BinaryIO | None = None
        self.open_file = -1

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append tensor ``name`` (the next one planned; of its planned shape and dtype)."""
        if self.next >= len(self.order):
            raise RuntimeError(f"{name} is written after every planned tensor")
        k, spec = self.order[self.next]
        if (name, tuple(t.shape), t.dtype) != (spec.name, spec.shape, spec.dtype):
            raise RuntimeError(
                f"writing {name} {tuple(t.shape)} {t.dtype}, the plan's next tensor is {spec.name} {spec.shape} "
                f"{spec.dtype}"
            )
        if k != self.open_file:
            self._close_file()
            self.handle = open(os.path.join(self.directory, self.file_names[k]), "wb")
            self.handle.write(_header(self.files[k]))
            self.open_file = k
        assert self.handle is not None
        write_bytes(self.handle, t)
        self.next += 1

    def _close_file(self) -> None:
        if self.handle is not None:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            self.handle = None

    def discard(self) -> None:
        """Close the file being written, after a failure (what was written stays incomplete)."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def close(self) -> list[str]:
        """Finish the last file and write the index; the names of the files written."""
        self._close_file()
        if self.next != len(self.order):
            missing = [spec.name for _, spec in self.order[self.next :]]
            raise RuntimeError(f"export ended with {len(missing)} planned tensors unwritten: {missing[:3]}")
        written = list(self.file_names)
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(spec.nbytes for _, spec in self.order)},
                "weight_map": {spec.name: self.file_names[k] for k, spec in self.order},
            }
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
            written.append(INDEX_FILE)
        return written
