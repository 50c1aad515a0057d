"""The start and end of a save, shared by the blocking save and the background one.

``begin`` checks a save's arguments and meta.json content on every rank before any collective and
makes the empty partial directory; ``publish``, once DCP's files are written and hashed
(``axon4d.checkpoint.writer``), shares every rank's digests or error in one all-gather, then rank 0
writes meta.json and publishes the directory by one rename (``axon4d.files.ckptfiles``); every rank
raises the same error if any failed (``axon4d.reliability.agreement``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from axon4d.checkpoint.pieces import State, rank_state
from axon4d.checkpoint.writer import FILES, Writer
from axon4d.files import ckptfiles
from axon4d.grid.mesh import Grid
from axon4d.reliability.agreement import SLOT, agree, exchange, on_rank0, raise_first, verdict


def begin(
    path: str,
    model: nn.Module,
    grid: Grid,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict[str, Any] | None,
    keep_last: int,
    position: Any,
    rng: Any,
    overwrite: bool,
) -> tuple[str, dict[str, Any], State]:
    """The start of a save to ``path``: its meta.json content and the pieces it writes, checked on
    every rank before any collective; then the empty partial directory, made by rank 0 (every rank
    raises its error alike). Returns the absolute path, the meta and the pieces."""
    meta = new_meta(model, grid, step, extra, keep_last, position, rng)
    state = rank_state(
        model, optimizer, grid, load=False
    )  # views only; raises alike on every rank, before any collective
    path = os.path.abspath(path)
    agree(grid, on_rank0(grid, lambda: ckptfiles.prepare(path, overwrite)), f"preparing {path}")
    return path, meta, state


def publish(
    grid: Grid,
    path: str,
    meta: dict[str, Any],
    writer: Writer,
    err: BaseException | None,
    overwrite: bool,
    keep_last: int,
) -> None:
    """The end of a save to ``path`` whose files ``writer`` wrote and hashed (``err``: this rank's
    failure in the write, None if it had none): every rank's digests or error shared (``digests_of``),
    then meta.json with them written and the directory published by rank 0; on every rank the same
    error if any rank failed, and then nothing is published."""
    meta["files"] = digests_of(grid, path, writer.digests, err)
    agree(grid, on_rank0(grid, lambda: ckptfiles.publish(path, meta, overwrite, keep_last)), f"publishing {path}")


def own_failure(e: dcp.CheckpointException, rank: int) -> BaseException | None:
    """This rank's own error in the failure DCP raised alike on every rank (None if it had none):
    each rank reports what it raised, and the lowest failing rank's error is raised (``raise_first``)."""
    return e.failures[rank][0] if rank in e.failures else None


RESERVED = ("step", "grid", "model_config", "files", "data_position", "rng")


def new_meta(
    model: nn.Module, grid: Grid, step: int, extra: dict[str, Any] | None, keep_last: int, position: Any, rng: Any
) -> dict[str, Any]:
    """meta.json's content for a save, with every argument checked on every rank before any collective."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"save: step {step!r} must be an integer >= 0 (the optimizer steps done)")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 0:
        raise ValueError(f"save: keep_last {keep_last!r} must be an integer >= 0 (0 keeps every checkpoint)")
    clash = sorted(set(extra or {}) & set(RESERVED))
    if clash:
        raise ValueError(f"save: extra keys {clash} are reserved by meta.json ({RESERVED}); rename them")
    meta: dict[str, Any] = {"step": step, "grid": list(grid.shape.as_tuple())}
    cfg = getattr(model, "cfg", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        meta["model_config"] = dataclasses.asdict(cfg)
    for key, value in (("data_position", position), ("rng", rng)):
        if value is not None:
            meta[key] = value
    meta.update(extra or {})
    for key, value in meta.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"save: {key} = {type(value).__name__} cannot be written to meta.json ({e}); pass JSON data "
                "(dicts, lists, numbers, strings; a tensor as .tolist())"
            ) from e
    return meta


def digests_of(
    grid: Grid, path: str, mine: dict[str, dict[str, Any]], err: BaseException | None
) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file of the save at ``path`` (DCP's shards and index): ``mine``,
    those this rank wrote and hashed (``Writer.digests``), shared with all in one all-gather
    over world; if any rank failed (``err`` here), raise the lowest such rank's error on every rank."""
    verdicts = exchange(grid, {"files": mine} if err is None else verdict(err), DIGESTS_SLOT)
    raise_first(verdicts, err, f"writing {path}")
    return {name: rec for v in verdicts for name, rec in v["files"].items()}


#: bytes each rank contributes to ``digests_of``: a verdict, or the records of its files (at most
#: FILES + 1 shards and the index, each name, sha256 and size well within 256 bytes of JSON)
DIGESTS_SLOT = SLOT + (FILES + 2) * 256
