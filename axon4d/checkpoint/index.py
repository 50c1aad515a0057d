"""The piece index: a checkpoint's chunks in a form whose cost follows what a rank needs, not the world.

DCP's own index (``.metadata``) is one pickle of every chunk of the world: 0.5 M chunks at 1024
ranks, 2 M at 4096. Each rank of a load read and unpickled all of it (≈ 1 GB of Python objects at
1024 ranks), and rank 0 of a save gathered every rank's plan and results and pickled it (tens of
seconds). A save now writes a *piece index* instead, and a load reads of it only its part:

- **Save.** Each rank describes the chunks it wrote as fixed-size records (``rank_records``:
  ``ckptindex.RECORD``, 76 bytes each; no Python object per chunk leaves it) and DCP's gather of
  write results carries that one array per rank to rank 0, which concatenates and sorts them by
  tensor and offsets with numpy (``merge``: O(items) in C, no Python loop over items) and writes
  ``pieces.npy`` (the records) and ``pieces.json`` (each tensor's shape, dtype and range of records;
  the shard files' names). DCP's plans carry no items through its gathers (``SavePieces``), so
  what rank 0 handles in Python is O(world + tensors) every save, the first included; nothing needs
  caching across saves.
- **Load.** A rank opens the index memory-mapped and, for each of its pieces, bisects its tensor's
  records on the first offset and reads only those whose rows can reach the piece
  (``ckptindex.PieceIndex.chunks``): the pages of its own chunks' records, ≈ 1 k of them, not
  the world's (``plan_load``). It checks the sizes of the files those chunks lie in only, and the
  sha256 of every file is verified once over the world (each rank its share of meta.json's files).

A checkpoint written before the piece index has DCP's ``.metadata`` and no ``pieces.json``: it
loads as before, from the whole index (``plan_load`` falls back). ``ckptindex.read_index`` builds
DCP's whole ``Metadata`` from a piece index for tools that read every chunk in one process (the
Hugging Face export). ``bench/checkpoint_scaling.py`` measures both sides for the 80B model on
4096 ranks.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

import numpy as np
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from axon4d.checkpoint.pieces import Piece
from axon4d.checkpoint.planners import read_items
from axon4d.files import ckptfiles, ckptindex
from axon4d.files.ckptindex import DIMS, RECORD

#: the name of the one write result each rank returns to DCP: its chunks' records (``rank_records``)
RESULT = "axon4d.pieces"


def rank_records(items: list[dcp.WriteItem], written: list[WriteResult]) -> dict[str, Any]:
    """This rank's part of the piece index, from its write items and DCP's results of writing
    them: ``records`` (one ``RECORD`` per chunk, its file an index into ``files``), ``files`` (the
    shard files it wrote) and ``keys`` (shape and dtype of each tensor whose first chunk, at offsets
    0, it wrote: so every tensor is described by exactly one rank). The records travel as raw bytes."""
    by_index = {(i.index.fqn, tuple(i.index.offset or ())): i for i in items}
    files: dict[str, int] = {}
    records = np.zeros(len(written), RECORD)
    keys: dict[str, dict[str, Any]] = {}
    for n, w in enumerate(written):
        item = by_index[(w.index.fqn, tuple(w.index.offset or ()))]
        data = item.tensor_data
        if data is None:
            raise ValueError(f"{w.index.fqn} is not a tensor; axon4d checkpoints hold only tensors")
        offsets, sizes = tuple(data.chunk.offsets), tuple(data.chunk.sizes)
        if len(offsets) > DIMS:
            raise ValueError(f"{w.index.fqn} has {len(offsets)} dims; the piece index holds tensors of at most {DIMS}")
        r = records[n]
        r["key"] = ckptindex.key_hash(w.index.fqn)
        r["off"][: len(offsets)] = offsets
        r["size"][:] = 1
        r["size"][: len(sizes)] = sizes
        r["file"] = files.setdefault(w.storage_data.relative_path, len(files))
        r["pos"], r["len"] = w.storage_data.offset, w.storage_data.length
        if not any(offsets):
            dtype = str(data.properties.dtype).removeprefix("torch.")
            keys[w.index.fqn] = {"shape": list(data.size), "dtype": dtype}
    return {"records": records.tobytes(), "files": list(files), "keys": keys}  # bytes: no dtype to pickle


class Merged(NamedTuple):
    """The piece index of a whole save: ``records`` sorted, ``table`` pieces.json's content."""

    records: np.ndarray
    table: dict[str, Any]


def merge(parts: list[dict[str, Any]]) -> Merged:
    """The piece index of a save from every rank's part (``rank_records``): the records
    concatenated, their files renumbered into one list, sorted by tensor then first offset; each
    tensor's shape, dtype, range of records and tallest chunk (``hmax``, which bounds a load's
    search); the chunks of each tensor must hold as many elements as its shape (the ranks' writes
    neither overlap nor leave a gap, as DCP's global plan checked). Numpy does the per-record work;
    Python loops over ranks and tensors only."""
    files: list[str] = []
    first: list[int] = []  # each part's first file's number in ``files``
    keys: dict[str, dict[str, Any]] = {}
    for part in parts:
        first.append(len(files))
        files += part["files"]
        keys.update(part["keys"])
    raw = [np.frombuffer(part["records"], np.uint8) for part in parts]
    records = np.concatenate(raw).view(RECORD) if raw else np.empty(0, RECORD)  # bytes: a plain copy
    records["file"] += np.repeat(np.array(first, np.int32), [len(r) // RECORD.itemsize for r in raw])
    order = np.lexsort((records["off"][:, 0], records["key"]))  # by tensor, then first offset (what a load bisects)
    records = records.view(np.uint8).reshape(-1, RECORD.itemsize)[order].reshape(-1).view(RECORD)
    hashes, starts, counts = np.unique(records["key"], return_index=True, return_counts=True)
    hmax = np.maximum.reduceat(records["size"][:, 0], starts) if len(starts) else starts
    volume = np.add.reduceat(np.prod(records["size"], axis=1), starts) if len(starts) else starts
    where = {int(h): i for i, h in enumerate(hashes)}
    table: dict[str, Any] = {"version": ckptindex.INDEX_VERSION, "files": files, "keys": {}}
    for name in sorted(keys):
        i = where.pop(ckptindex.key_hash(name), None)
        if i is None:
            raise ValueError(f"the piece index describes {name} but holds none of its chunks")
        if int(volume[i]) != math.prod(keys[name]["shape"]):  # what DCP's global plan checked before
            raise ValueError(
                f"the chunks saved of {name} hold {int(volume[i])} elements, its shape {keys[name]['shape']} has "
                f"{math.prod(keys[name]['shape'])}: the ranks' writes (pieces.writes) overlap or leave a gap"
            )
        table["keys"][name] = {**keys[name], "start": int(starts[i]), "count": int(counts[i]), "hmax": int(hmax[i])}
    if where:
        raise ValueError(f"{len(where)} saved tensors have chunks but no chunk at offsets 0 (no shape): not written")
    return Merged(records, table)


def write(path: str, index: Merged) -> None:
    """Write ``index`` into the checkpoint directory ``path``, each file synced."""
    for name, dump in ((ckptfiles.CHUNKS, lambda f: np.save(f, index.records)), (ckptfiles.PIECES, None)):
        with open(os.path.join(path, name), "wb") as f:
            if dump is not None:
                dump(f)
            else:
                f.write(json.dumps(index.table, separators=(",", ":")).encode())
            f.flush()
            os.fsync(f.fileno())


class LoadPlan(NamedTuple):
    """What a rank's load reads: DCP's metadata of its chunks and their files, its reads."""

    md: dcp.Metadata  # the index's entries this rank reads (all of DCP's index for an old checkpoint)
    reads: list[dcp.ReadItem]  # into its pieces (``planners.read_items``)
    shards: list[str]  # the shard files those lie in, their sizes checked


def plan_load(
    path: str, meta: dict[str, Any], parts: list[Piece], whole: list[str], rank: int, world: int, share: bool = True
) -> LoadPlan:
    """Check the checkpoint at ``path`` (meta.json ``meta``) and plan this rank's reads of its
    pieces ``parts`` and of the tensors ``whole`` (step counts: read whole): the index entries
    they overlap (from the piece index; DCP's whole index for a checkpoint written before it),
    the sizes of the files those lie in, and this rank's share — every ``world``-th by name from
    ``rank`` on — of the sha256 checks of all the files meta.json records (unless not ``share``:
    the simulation of ``bench/checkpoint_scaling.py``, whose shards hold no data)."""
    files = meta.get("files")  # absent only in checkpoints written before checksums
    if ckptindex.has_piece_index(path):
        if files is not None:
            ckptfiles.verify(path, files, [ckptfiles.PIECES])  # each rank reads it whole; pieces.npy below
        index = ckptindex.PieceIndex(path)
        wanted: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None] = dict.fromkeys(whole)
        for b, _ in parts:
            boxes = wanted.setdefault(b.key, [])
            if boxes is not None:
                boxes.append((b.offsets, b.sizes))
        md = index.metadata(wanted)  # only the chunks this rank reads, and their files
        reads = read_items(path, md, parts)
        shards = ckptindex.check_shards(path, md, files)
    else:
        if files is not None:
            ckptfiles.verify(path, files, [ckptfiles.DCP_INDEX])
        md = ckptindex.read_index(path)
        reads = read_items(path, md, parts)
        mine = [r.storage_index for r in reads] + [  # this rank's chunks: only their files are checked
            MetadataIndex(k, c.offsets) for k in whole for c in _chunks(md, k)
        ]
        needed = dcp.Metadata({}, storage_data={i: md.storage_data[i] for i in mine if i in md.storage_data})
        shards = ckptindex.check_shards(path, needed, files)
    if files is not None and share:
        ckptfiles.verify(path, files, sorted(files)[rank::world])
    return LoadPlan(md, reads, shards)


def _chunks(md: dcp.Metadata, key: str) -> list[dcp.ChunkStorageMetadata]:
    entry = md.state_dict_metadata.get(key)
    return entry.chunks if isinstance(entry, dcp.TensorStorageMetadata) else []


def result(part: dict[str, Any]) -> WriteResult:
    """The one write result a rank returns to DCP, carrying its part of the piece index."""
    return WriteResult(MetadataIndex(RESULT), len(part["records"]), part)


def parts_of(results: list[list[WriteResult]]) -> list[dict[str, Any]]:
    """Every rank's part of the piece index, from DCP's gathered write results (``result``)."""
    out = []
    for rank, written in enumerate(results):
        if len(written) != 1 or written[0].index.fqn != RESULT:
            raise ValueError(f"rank {rank} returned {len(written)} write results, not its part of the piece index")
        out.append(written[0].storage_data)
    return out
