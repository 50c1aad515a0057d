"""DCP's file writer for a rank's pieces: files of bounded size, each hashed as soon as it is written,
from a thread bound to the rank's device.

torch's file writer (``torch.distributed.checkpoint.filesystem._write_files_from_queue``) reads
the tensors it writes through one of two loaders: ``_OverlappingCpuLoader``, which copies them to
the host ahead of writing on the *current device's* current stream and synchronises it, when it
writes with one thread, copy-ahead is above 0 and ``torch.cuda.is_available()``; else
``_SerialCpuLoader``, which calls ``.cpu()`` on each and touches no device for host tensors.
``Writer`` makes the choice explicit: copy-ahead only for pieces on an accelerator (a blocking save
on a GPU), none for host pieces (the background save's snapshot, a host run), so those always take
the serial loader; and it binds the rank's device (``axon4d.device.bind``) in the thread DCP writes
from before any of torch's calls there, so a thread that never set a device (DCP's background
thread) never opens a context on device 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from axon4d import device as devices
from axon4d.checkpoint import index
from axon4d.files import ckptfiles, ckptindex

FILES = 16  # a rank writes its pieces into about this many files (Writer)
#: bytes of accelerator tensors torch's writer copies to the host ahead of writing them (its default)
COPY_AHEAD = 10_000_000


class Writer(dcp.FileSystemWriter):
    """DCP's file writer, with this rank's items cut in order into files of about 1/``FILES``
    of its bytes (an item larger than that alone). DCP keeps each tensor it writes (a copy of a
    view, a host copy of a device tensor) until its file is closed: a file bounds what a save holds.
    Each file is hashed as soon as it is written and synced, by the rank that wrote it. A rank
    returns to DCP, instead of a result per chunk, its part of the piece index (one array of
    records, ``axon4d.checkpoint.index``); the coordinator (rank 0) merges them into the piece index
    in place of DCP's ``.metadata``, reads it back as a load does and hashes it (``digests``:
    name -> {"sha256", "bytes"}); a background save hashes in the background too.

    ``device`` is the rank's device, bound in the writing thread (``set_up_storage_writer``, DCP's
    first call of the writer in a save); ``sources`` is where the tensors it writes live: copy-ahead
    (``COPY_AHEAD``, torch's overlapping loader) only when that is an accelerator."""

    def __init__(self, path: str, device: torch.device, sources: torch.device):
        super().__init__(path, per_thread_copy_ahead=COPY_AHEAD if devices.is_accelerator(sources) else 0)
        self.device = device
        self.digests: dict[str, dict[str, Any]] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        devices.bind(self.device)  # this thread's CUDA calls (streams, syncs) go to the rank's own device
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def _hash(self, name: str) -> None:
        sha, size = ckptfiles.digest(os.path.join(str(self.path), name))
        self.digests[name] = {"sha256": sha, "bytes": size}

    def write_data(self, plan: dcp.SavePlan, planner: dcp.SavePlanner) -> Future[list[WriteResult]]:
        sizes = [
            math.prod(d.chunk.sizes) * d.properties.dtype.itemsize if (d := i.tensor_data) else 0 for i in plan.items
        ]
        files: dict[int, list[dcp.WriteItem]] = {}
        total = max(sum(sizes), 1)
        for start, item in zip(itertools.accumulate(sizes, initial=0), plan.items):  # file j: those starting in
            files.setdefault(start * FILES // total, []).append(item)  # the j-th 1/FILES of the bytes
        results: list[WriteResult] = []
        for k, items in files.items():  # file k of rank r: __<r>_<k>_0.distcp
            prefix = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{k}_")
            written = super().write_data(dataclasses.replace(plan, items=items, storage_data=prefix), planner).wait()
            for name in sorted({r.storage_data.relative_path for r in written}):
                self._hash(name)
            results += written
        done: Future[list[WriteResult]] = Future()
        done.set_result([index.result(index.rank_records(plan.items, results))])
        return done

    def finish(self, metadata: dcp.Metadata, results: list[list[WriteResult]]) -> None:
        index.write(str(self.path), index.merge(index.parts_of(results)))
        ckptindex.PieceIndex(str(self.path))  # what a load will read: well-formed, files inside
        for name in (ckptfiles.PIECES, ckptfiles.CHUNKS):
            self._hash(name)
