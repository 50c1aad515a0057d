"""A checkpoint's index, read without running code from it and without any collective: the piece
index (``PieceIndex``: pieces.json and a numpy array of records, ``RECORD``, looked up by the part
a rank needs; written by ``axon4d.checkpoint.index``), DCP's index of older checkpoints (its
``.metadata``, through a restricted unpickler), DCP's whole ``Metadata`` rebuilt from either
(``read_index``), the check that the shard files it lists are there (``check_shards``), and DCP's
file reader fed by them (``SafeReader``).

The names of the index's files (``DCP_INDEX``, ``PIECES``, ``CHUNKS``), their checksums and the
rest of the checkpoint directory are ``axon4d.files.ckptfiles``'.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from axon4d.files.ckptfiles import CHUNKS, DCP_INDEX, META, PIECES, CheckpointError

# --- reading DCP's index without running code from it -------------------------------------------

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset(
    {(_DCP_META, c) for c in "Metadata MetadataIndex StorageMeta TensorStorageMetadata TensorProperties".split()}
    | {(_DCP_META, "ChunkStorageMetadata"), (_DCP_META, "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size")}
    | {("torch.serialization", "_get_layout")}  # torch.layout pickles as _get_layout("torch.strided"): a dict lookup
    # StorageMeta.checkpoint_id is the directory DCP wrote to; Python 3.13+ defines paths in pathlib._local
    | {(m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")}
)
# BytesStorageMetadata is deliberately absent: DCP loads such an entry with torch.load(weights_only=
# False), which runs code, and axon4d checkpoints hold only tensors.


def _allowed(module: str, name: str) -> bool:
    """Whether DCP's tensor metadata legitimately refers to ``module.name`` (found by listing what
    real indexes reference: the classes above and torch dtypes such as ``torch.float32``)."""
    return (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))


class _IndexUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the classes DCP's tensor metadata is made of."""

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointError(
                f"refusing to read {self.where}: its pickle references {module}.{name}, which is not one of the "
                "classes of DCP tensor metadata (torch.distributed.checkpoint.metadata, _StorageInfo, torch.Size, "
                "torch dtypes and layouts, pathlib paths); the file was not written by axon4d.checkpoint.save or "
                "was tampered with; load only checkpoints from a trusted run"
            )
        return super().find_class(module, name)


def read_index(path: str) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint at ``path``, unpickled without importing or calling
    anything outside DCP's metadata classes, and checked to describe only tensors stored in plain
    files inside ``path``. A checkpoint written with a piece index and no DCP index (every save since
    the piece index) has it built from the piece index: every chunk, for a tool that reads the whole
    checkpoint in one process (an export); a load reads only its part (``PieceIndex``)."""
    if not os.path.isfile(os.path.join(path, DCP_INDEX)) and os.path.isfile(os.path.join(path, PIECES)):
        index = PieceIndex(path)
        return index.metadata(dict.fromkeys(index.keys))
    where = os.path.join(path, DCP_INDEX)
    if not os.path.isfile(where):
        raise CheckpointError(
            f"{path} has no {DCP_INDEX} (DCP's index of the shards): the save did not finish or the file was "
            "removed; resume from another checkpoint (axon4d.checkpoint.list_checkpoints)"
        )
    try:
        with open(where, "rb") as f:
            md = _IndexUnpickler(f, where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{where} is not a readable DCP index ({type(e).__name__}: {e}); the file is truncated or corrupt; "
            "resume from another checkpoint"
        ) from e
    if not (isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict)):
        raise CheckpointError(f"{where} holds a {type(md).__name__}, not DCP Metadata; the file is not DCP's index")
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{where} has no table of shard files (storage_data); the file is not DCP's index")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{where} describes {key!r} as {type(entry).__name__}; axon4d checkpoints hold only tensors"
            )
    for info in md.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
            raise CheckpointError(f"{where} points at {name!r}, which is not a file name inside {path}")
        if not all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0 for f in ("offset", "length")):
            raise CheckpointError(f"{where} gives {name} a byte range that is not two integers >= 0")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{where} stores {name} with stream transforms {info.transform_descriptors}, which axon4d never "
                "writes; the file was not written by axon4d.checkpoint.save"
            )
    return md


def check_shards(path: str, md: Metadata, recorded: dict[str, Any] | None = None) -> list[str]:
    """The shard files DCP's index ``md`` refers to, sorted; raise ``CheckpointError`` if one is
    missing, too short, or (given meta.json's ``recorded`` files) has no recorded checksum."""
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        if recorded is not None and name not in recorded:
            raise CheckpointError(
                f"{META} records no checksum for shard {file}, which its index lists; the two files are not "
                "from the same save: resume from another checkpoint"
            )
        if not os.path.isfile(file):
            raise CheckpointError(
                f"shard {file} is missing (its index lists it); the checkpoint is incomplete: restore the file "
                "or resume from another checkpoint"
            )
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointError(
                f"shard {file} is truncated: {size} bytes, its index needs at least {end}; restore the file or "
                "resume from another checkpoint"
            )
    return sorted(needed)


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by ``read_index`` (no code from the directory runs), or
    given: ``md``, the part of the piece index a rank reads (``PieceIndex.metadata``)."""

    def __init__(self, path: str, md: Metadata | None = None):
        super().__init__(path)
        self.md = md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP asks for a per-rank index only when the global one failed
            raise CheckpointError(f"{self.path} has no usable {DCP_INDEX}; per-rank indexes are not read")
        md = self.md if self.md is not None else read_index(str(self.path))
        stamp = md.storage_meta if isinstance(md.storage_meta, StorageMeta) else StorageMeta()
        stamp.load_id = self.load_id
        md.storage_meta = stamp
        return md


# --- the piece index: every saved chunk, of which a load reads only those its pieces overlap ---------

#: one saved chunk (pieces.npy): its tensor (``key_hash`` of the name), where it lies in the tensor
#: (offsets and sizes, padded to ``DIMS`` dims with 0 and 1), its file (an index into pieces.json's
#: files) and its bytes there (position, length)
RECORD = np.dtype(
    [("key", "<u8"), ("off", "<i8", (3,)), ("size", "<i8", (3,)), ("file", "<i4"), ("pos", "<i8"), ("len", "<i8")]
)
DIMS = 3  # the most dims a saved tensor has (a stacked expert weight: experts, rows, columns)
INDEX_VERSION = 1


def key_hash(key: str) -> int:
    """The 64-bit name of saved tensor ``key`` in the piece index's records."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def has_piece_index(path: str) -> bool:
    """Whether the checkpoint at ``path`` has a piece index (every save since it exists does)."""
    return os.path.isfile(os.path.join(path, PIECES))


class PieceIndex:
    """The piece index of the checkpoint at ``path``, read without running code from it.

    pieces.json holds ``keys`` (each saved tensor: its shape, dtype, and its records' ``start``,
    ``count`` and tallest chunk ``hmax`` in pieces.npy) and ``files`` (the shard files' names);
    pieces.npy holds one ``RECORD`` per chunk, sorted by tensor and offsets, memory-mapped: a
    lookup (``chunks``) bisects the tensor's records on the first offset and reads only the few
    whose rows can overlap the rectangle asked for, so a rank's load touches pages of its own
    chunks' records, not the whole index."""

    def __init__(self, path: str):
        self.path = path
        where = os.path.join(path, PIECES)
        try:
            with open(where) as f:
                table = json.load(f)
            self.records = np.load(os.path.join(path, CHUNKS), mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path}'s piece index ({PIECES}, {CHUNKS}) is unreadable ({type(e).__name__}: {e}); the files are "
                "missing, truncated or corrupt; resume from another checkpoint"
            ) from e
        ok = isinstance(table, dict) and table.get("version") == INDEX_VERSION
        files, keys = (table.get("files"), table.get("keys")) if ok else (None, None)
        ok = ok and isinstance(files, list) and all(isinstance(n, str) for n in files) and _plain_names(files)
        ok = ok and isinstance(keys, dict) and all(_entry_ok(e, len(self.records)) for e in keys.values())
        if not ok or self.records.dtype != RECORD or self.records.ndim != 1:
            raise CheckpointError(
                f"{where} is not an axon4d piece index of version {INDEX_VERSION} (a table of tensors and shard "
                f"file names inside {path}, with {CHUNKS} of {RECORD.itemsize}-byte records); the file was not "
                "written by axon4d.checkpoint.save or was damaged; resume from another checkpoint"
            )
        self.files: list[str] = list(files or ())
        self.keys: dict[str, dict[str, Any]] = dict(keys or {})

    def chunks(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] = ()) -> np.ndarray:
        """The records of ``key``'s chunks overlapping the rectangle at ``offsets`` of ``sizes``
        (all of them if ``offsets`` is None)."""
        e = self.keys[key]
        lo, hi = e["start"], e["start"] + e["count"]
        if offsets is None or not offsets:
            return np.array(self.records[lo:hi])
        first = self._bisect(lo, hi, offsets[0] - e["hmax"] + 1)  # a chunk starting before can't reach
        found = np.array(self.records[first : self._bisect(first, hi, offsets[0] + sizes[0])])
        o = np.zeros(DIMS, np.int64)
        s = np.ones(DIMS, np.int64)
        o[: len(offsets)], s[: len(sizes)] = offsets, sizes
        hit = np.all((found["off"] < o + s) & (found["off"] + found["size"] > o), axis=1)
        return found[hit & (found["key"] == np.uint64(key_hash(key)))]

    def _bisect(self, lo: int, hi: int, row: int) -> int:
        """The first record in [lo, hi) whose first offset is at least ``row`` (they are sorted)."""
        while lo < hi:
            mid = (lo + hi) // 2
            if int(self.records[mid]["off"][0]) < row:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def metadata(self, wanted: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None]) -> Metadata:
        """DCP's ``Metadata`` of the chunks of each tensor of ``wanted`` that overlap its rectangles
        (offsets, sizes), or of all its chunks (None), with their files and bytes: what a load of
        those rectangles reads; a tensor absent from the index is absent from it."""
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for key, boxes in wanted.items():
            e = self.keys.get(key)
            if e is None:
                continue
            ndim = len(e["shape"])
            found = [self.chunks(key)] if boxes is None else [self.chunks(key, o, s) for o, s in boxes]
            chunks: dict[tuple[int, ...], ChunkStorageMetadata] = {}
            for r in np.concatenate(found) if found else np.empty(0, RECORD):
                off = tuple(int(v) for v in r["off"][:ndim])
                if off in chunks:
                    continue
                if not (0 <= int(r["file"]) < len(self.files) and int(r["pos"]) >= 0 and int(r["len"]) >= 0):
                    raise CheckpointError(
                        f"{self.path}/{CHUNKS} gives {key} at {off} a file or byte range out of range"
                    )
                chunks[off] = ChunkStorageMetadata(torch.Size(off), torch.Size(int(v) for v in r["size"][:ndim]))
                storage[MetadataIndex(key, off)] = _StorageInfo(
                    self.files[int(r["file"])], int(r["pos"]), int(r["len"])
                )
            props = TensorProperties(dtype=getattr(torch, e["dtype"]))
            entries[key] = TensorStorageMetadata(props, torch.Size(e["shape"]), list(chunks.values()))
        return Metadata(entries, storage_data=storage)


def _plain_names(names: list[str]) -> bool:
    """Whether every one of ``names`` names a file inside the directory (no separator, not . or ..)."""
    joined = "\n".join(names)
    return "/" not in joined and "\0" not in joined and os.sep not in joined and not {"", ".", ".."} & set(names)


def _entry_ok(e: Any, n: int) -> bool:
    """Whether ``e`` is a well-formed pieces.json tensor entry over ``n`` records."""
    if not isinstance(e, dict):
        return False
    ints = [e.get(f) for f in ("start", "count", "hmax")]
    shape = e.get("shape")
    return (
        all(isinstance(v, int) and v >= 0 for v in ints)
        and int(ints[0] or 0) + int(ints[1] or 0) <= n
        and isinstance(shape, list)
        and len(shape) <= DIMS
        and all(isinstance(v, int) and v >= 0 for v in shape)
        and isinstance(getattr(torch, str(e.get("dtype")), None), torch.dtype)
    )
