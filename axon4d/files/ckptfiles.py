"""The files of a checkpoint directory, read and written without trusting them and without any
collective: the piece index (``PieceIndex``: JSON and a numpy array of records, looked up by the
part a rank needs) and the DCP index of older checkpoints (a restricted unpickler), per-file
checksums, durable writes, the publication of a finished save and the deletion of old ones in the
background, the ``latest`` pointer, and the checks a resumed run makes.

A run's checkpoints live side by side as ``<dir>/step_<N>``; a save in progress is the hidden
sibling ``.step_<N>.partial`` and becomes ``step_<N>`` by one rename; ``<dir>/latest`` names the
last one published. ``axon4d.checkpoint`` drives these from every rank; everything here is plain
file work, so the training job can call ``read_meta``, ``latest`` and ``check_compatible`` before
its process group exists.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import threading
from collections.abc import Collection
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

from axon4d.config import ModelConfig

DCP_INDEX = ".metadata"  # the file in which DCP pickled its Metadata (checkpoints written before the piece index)
PIECES = "pieces.json"  # the piece index's table of tensors and files (``PieceIndex``)
CHUNKS = "pieces.npy"  # the piece index's chunks, one fixed-size record each, sorted (``RECORD``)
META = "meta.json"
POINTER = "latest"
_STEP_DIR = re.compile(r"step_(\d+)")
_SCRATCH = (".partial", ".replaced", ".deleting")  # suffixes of hidden siblings a later save removes

#: training-config fields that may differ between a checkpoint's run and the run resuming it
RESUMABLE_CHANGES = frozenset(
    "steps save_every keep_last async_save resume overwrite progress log_every out_dir grid comm machine timeout "
    "startup_timeout on_nonfinite max_nonfinite compare_single peak_tflops context_parallel".split()
)


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupt, unsafe to read, or not this run's."""


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


# --- checksums and durable writes ----------------------------------------------------------------


def digest(file: str) -> tuple[str, int]:
    """The sha256 (hex) and size in bytes of ``file``."""
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def verify(path: str, recorded: dict[str, Any], names: Collection[str]) -> None:
    """Raise ``CheckpointError`` naming the first of ``names`` whose size or sha256 differs from
    ``recorded`` (meta.json's ``files``: name -> {"sha256", "bytes"}). ``DCP_INDEX`` stands for
    the checkpoint's index, whichever it has: DCP's, or the piece index (``PIECES``, ``CHUNKS``)."""
    if DCP_INDEX in names and DCP_INDEX not in recorded and PIECES in recorded:
        names = [n for name in names for n in ((PIECES, CHUNKS) if name == DCP_INDEX else (name,))]
    for name in names:
        file, want = os.path.join(path, name), recorded.get(name)
        if want is None:
            raise CheckpointError(f"{META} records no checksum for {file}; the checkpoint was not written by save")
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{file} is missing: {META} records it ({want['bytes']} bytes); restore it or resume from another "
                "checkpoint"
            )
        sha, size = digest(file)
        if size != want["bytes"]:
            raise CheckpointError(
                f"{file} is {size} bytes, {META} records {want['bytes']} (truncated or replaced after the save); "
                "restore it or resume from another checkpoint"
            )
        if sha != want["sha256"]:
            raise CheckpointError(
                f"{file} has sha256 {sha}, {META} records {want['sha256']}: its bytes changed after the save "
                "(disk or copy corruption); restore it or resume from another checkpoint"
            )


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(file: str, text: str) -> None:
    """Replace ``file`` by ``text`` in one step: a reader sees the old or the new content, never a mix."""
    tmp = f"{file}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    fsync_dir(os.path.dirname(os.path.abspath(file)))


# --- a save's life: prepare, publish, prune -------------------------------------------------------


def partial_path(path: str) -> str:
    """The hidden sibling a save of ``path`` is written into before it is published."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.partial")


def prepare(path: str, overwrite: bool) -> str:
    """Refuse an existing ``path`` unless ``overwrite``; remove the leftovers of interrupted saves
    and deletions beside it; create and return the empty partial directory."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(
            f"{path} already exists; a checkpoint is never silently replaced: pass overwrite=True to replace it, "
            "or save under another step or directory"
        )
    os.makedirs(parent, exist_ok=True)
    wait_deletions()  # the previous save's deletions end before their scratch names are touched
    for name in os.listdir(parent):
        if name.startswith(".") and name.endswith(_SCRATCH):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    os.makedirs(partial_path(path))
    return partial_path(path)


def _discard(path: str) -> str:
    """Take a checkpoint directory out of sight by one rename, so that no half-deleted copy ever
    looks complete; return the hidden name it now has, for ``delete_in_background``."""
    doomed = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.deleting")
    os.rename(path, doomed)
    return doomed


_log = logging.getLogger(__name__)
_deleting: threading.Thread | None = None  # the thread removing old checkpoints, one at a time
_deletion_failures: list[str] = []


def delete_in_background(doomed: list[str]) -> None:
    """Remove the directories ``doomed`` (hidden names, ``_discard``) in a thread of their own, so
    that no rank waits for a deletion of 16·W files. A failure is logged (logger
    ``axon4d.files.ckptfiles``, ERROR) and kept for ``wait_deletions``; the leftover is removed by
    the next save. The thread is not a daemon: the process waits for it at exit."""
    global _deleting
    wait_deletions()

    def remove() -> None:
        for d in doomed:
            try:
                shutil.rmtree(d)
            except OSError as e:
                message = f"could not delete the old checkpoint {d}: {type(e).__name__}: {e}"
                _log.error("%s; the next save removes what is left", message)
                _deletion_failures.append(message)

    _deleting = threading.Thread(target=remove, name="axon4d-ckpt-delete", daemon=False)
    _deleting.start()


def wait_deletions() -> list[str]:
    """Wait for the old checkpoints being deleted in the background (``delete_in_background``);
    return the failures since the last call (each also logged when it happened)."""
    global _deleting
    if _deleting is not None:
        _deleting.join()
        _deleting = None
    failures = list(_deletion_failures)
    _deletion_failures.clear()
    return failures


atexit.register(wait_deletions)


def publish(path: str, meta: dict[str, Any], overwrite: bool, keep_last: int) -> None:
    """Finish the save of ``path`` from its partial directory: write meta.json, make everything
    durable, rename it into place, point ``latest`` at it (a ``step_<N>`` name), then take all but
    the newest ``keep_last`` checkpoints beside it out of sight (0 keeps all; ``path`` itself is
    always kept) and delete them in the background (``delete_in_background``)."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    partial = partial_path(path)
    write_atomic(os.path.join(partial, META), meta_text(meta))
    fsync_dir(partial)
    replaced = None
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(f"{path} appeared during the save; pass overwrite=True to replace it")
        replaced = os.path.join(parent, f".{name}.replaced")
        os.rename(path, replaced)
    os.rename(partial, path)
    fsync_dir(parent)
    if _STEP_DIR.fullmatch(name):
        write_atomic(os.path.join(parent, POINTER), name + "\n")
    if replaced is not None:
        shutil.rmtree(replaced)
    if keep_last > 0:  # out of sight now, deleted in the background
        delete_in_background([_discard(old) for old in list_checkpoints(parent)[:-keep_last] if old != path])


# --- finding and checking checkpoints -------------------------------------------------------------


def meta_text(meta: dict[str, Any]) -> str:
    """meta.json's text: one top-level key a line, each value compact (json's C encoder: meta.json
    lists every file of the world, 65 k at 4096 ranks, which an indented dump takes a second for)."""
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()) + "\n}\n"


def list_checkpoints(directory: str) -> list[str]:
    """The complete checkpoints ``step_<N>`` under ``directory`` (with meta.json), oldest first;
    other names (``step_final``, notes, saves in progress) are ignored."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _STEP_DIR.fullmatch(name)
        if m and os.path.isfile(os.path.join(directory, name, META)):
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return [path for _, path in sorted(found)]


def latest(directory: str) -> str | None:
    """The checkpoint ``<directory>/latest`` names (the last one published) if it is complete, else
    the newest complete ``step_<N>``, else None."""
    try:
        with open(os.path.join(directory, POINTER)) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if _STEP_DIR.fullmatch(name) and os.path.isfile(os.path.join(directory, name, META)):
        return os.path.join(directory, name)
    found = list_checkpoints(directory)
    return found[-1] if found else None


def read_meta(path: str) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint at ``path`` (step, grid it was written on, model and
    training config, file checksums, data position, RNG states, extras)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no checkpoint at {path}: {'it is not a directory' if os.path.exists(path) else 'no such directory'}; "
            "give a step_<N> directory written by axon4d.checkpoint.save (axon4d.checkpoint.latest finds the newest)"
        )
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"{path} is not a complete axon4d checkpoint (no {META}): the save did not finish or this is not a "
            "checkpoint directory; resume from another one (axon4d.checkpoint.list_checkpoints)"
        )
    try:
        with open(file) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{file} is not valid JSON ({e}); the file is corrupt: restore it or resume from another checkpoint"
        ) from e
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{file} records step {step!r}; a checkpoint's meta.json is an object whose 'step' is an integer >= 0 "
            "(written by axon4d.checkpoint.save)"
        )
    files = meta.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("sha256"), str) and isinstance(r.get("bytes"), int)
        for r in files.values()
    ):
        raise CheckpointError(
            f"{file} records files {str(files)[:200]}; 'files' maps each file name to its "
            '{"sha256": hex, "bytes": size} (written by axon4d.checkpoint.save)'
        )
    return meta


def check_compatible(
    meta: dict[str, Any],
    model_config: ModelConfig | None = None,
    train_config: dict[str, Any] | None = None,
    ignore: Collection[str] = RESUMABLE_CHANGES,
) -> None:
    """Raise ``ValueError`` naming the first field in which the checkpoint of ``meta`` differs from
    this run: its model configuration, or its training configuration outside ``ignore``."""
    checks: list[tuple[str, Any, dict[str, Any]]] = []
    if model_config is not None:
        checks.append(("model", meta.get("model_config"), dataclasses.asdict(model_config)))
    if train_config is not None:
        checks.append(("training", meta.get("train_config"), train_config))
    for kind, saved, current in checks:
        if not isinstance(saved, dict):
            raise ValueError(
                f"the checkpoint records no {kind} configuration (meta.json {kind}_config is {saved!r}), so it "
                "cannot be checked against this run; start afresh in another --out-dir"
            )
        for key, value in current.items():
            if key in ignore or key == "name":
                continue
            was = saved.get(key, "<absent>")
            if _plain(was) != _plain(value):
                raise ValueError(
                    f"the checkpoint's {kind} configuration differs in {key!r}: saved {was!r}, this run {value!r}; "
                    f"resume with the same {key}, or start afresh in another --out-dir"
                )


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists), so saved and current compare alike."""
    return json.loads(json.dumps(value, default=str)) if isinstance(value, (tuple, list, dict)) else value
