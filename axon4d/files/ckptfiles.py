"""A checkpoint directory's files, read and written without trusting them and without any
collective: their names, meta.json (written, read, checked against the run resuming from it),
per-file checksums, durable writes, the publication of a finished save, the ``latest`` pointer
and the listing of complete checkpoints. Reading the index (the piece index, DCP's index of older
checkpoints) is ``axon4d.files.ckptindex``'s; deleting old checkpoints in the background,
``axon4d.files.ckptdelete``'s.

A run's checkpoints live side by side as ``<dir>/step_<N>``; a save in progress is the hidden
sibling ``.step_<N>.partial`` and becomes ``step_<N>`` by one rename; ``<dir>/latest`` names the
last one published. ``axon4d.checkpoint`` drives these from every rank; everything here is plain
file work, so the training job can call ``read_meta``, ``latest`` and ``check_compatible`` before
its process group exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Collection
from typing import Any

from axon4d.config import ModelConfig
from axon4d.files import ckptdelete

DCP_INDEX = ".metadata"  # the file in which DCP pickled its Metadata (checkpoints written before the piece index)
PIECES = "pieces.json"  # the piece index's table of tensors and files (``ckptindex.PieceIndex``)
CHUNKS = "pieces.npy"  # the piece index's chunks, one fixed-size record each, sorted (``ckptindex.RECORD``)
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
    ckptdelete.wait_deletions()  # the previous save's deletions end before their scratch names are touched
    for name in os.listdir(parent):
        if name.startswith(".") and name.endswith(_SCRATCH):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    os.makedirs(partial_path(path))
    return partial_path(path)


def _discard(path: str) -> str:
    """Take a checkpoint directory out of sight by one rename, so that no half-deleted copy ever
    looks complete; return the hidden name it now has, for ``ckptdelete.delete_in_background``."""
    doomed = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.deleting")
    os.rename(path, doomed)
    return doomed


def publish(path: str, meta: dict[str, Any], overwrite: bool, keep_last: int) -> None:
    """Finish the save of ``path`` from its partial directory: write meta.json, make everything
    durable, rename it into place, point ``latest`` at it (a ``step_<N>`` name), then take all but
    the newest ``keep_last`` checkpoints beside it out of sight (0 keeps all; ``path`` itself is
    always kept) and delete them in the background (``ckptdelete.delete_in_background``)."""
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
        ckptdelete.delete_in_background([_discard(old) for old in list_checkpoints(parent)[:-keep_last] if old != path])


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
