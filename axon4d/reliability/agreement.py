"""Every rank reaches the same verdict on a step that one rank alone may see fail.

A step whose failure only some ranks can see — a file rank 0 writes, a checkpoint a rank reads,
an export planned on every rank — is followed by ``agree``: each rank contributes its outcome (None,
or the exception it caught) and **one all-gather over the world** shares them; if any rank failed,
**every rank raises the same error**: the lowest failing rank's, with its type (one of ``KINDS``,
else ``RuntimeError`` naming the original type) and message, and ``(rank r of n, <doing>)``
appended. No rank goes on while another raises, so no rank is left waiting in a later collective.
``exchange`` is the collective itself, for a step that shares more than a verdict (a checkpoint's
file digests, ``axon4d.checkpoint``), and ``raise_first`` the verdict read from its rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from axon4d import device as devices
from axon4d.files.ckptfiles import CheckpointError
from axon4d.grid.mesh import Grid

#: the error types a verdict keeps (by name) and every rank raises again; any other becomes a
#: ``RuntimeError`` whose message names its type
KINDS: dict[str, type[Exception]] = {
    k.__name__: k
    for k in (CheckpointError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, OSError)
}
KINDS["ValueError"] = ValueError
SLOT = 4096  # bytes each rank contributes to an exchange: a verdict, or a few file digests


def on_rank0(grid: Grid, work: Callable[[], object]) -> BaseException | None:
    """Run ``work`` on rank 0 only; the exception it raised, if any."""
    if grid.rank != 0:
        return None
    try:
        work()
    except Exception as e:
        return e
    return None


def exchange(grid: Grid, payload: dict[str, Any], width: int = SLOT) -> list[dict[str, Any]]:
    """Every rank's JSON ``payload``, in rank order (one all-gather over the world). The gathered
    (world, ``width``) table reaches the host in one copy — one transfer and one wait on an
    accelerator, not one per rank's row — and is read row by row there."""
    data = json.dumps(payload).encode()
    if len(data) > width:
        raise AssertionError(f"exchange payload of {len(data)} bytes exceeds its {width}-byte slot")
    mine = torch.zeros((1, width), dtype=torch.uint8)
    mine[0, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    table = devices.to_host(grid.comm.all_gather(mine.to(grid.device), "world", tag="checkpoint").wait())
    return [json.loads(row.tobytes().rstrip(b"\0")) for row in table.numpy()]


def verdict(err: BaseException | None) -> dict[str, Any]:
    """A rank's outcome as JSON: {} for success, else the error's type name and message."""
    if err is None:
        return {}
    kind = next((k.__name__ for k in type(err).__mro__ if k.__name__ in KINDS), "RuntimeError")
    message = str(err) if kind != "RuntimeError" else f"{type(err).__name__}: {err}"
    while len(json.dumps([kind, message])) > SLOT - 64:  # a message fits its slot, cut if it must
        message = message[: len(message) * 3 // 4]
    return {"error": [kind, message]}


def agree(grid: Grid, err: BaseException | None, doing: str) -> None:
    """Share each rank's outcome of a step (``err``: None if it succeeded); if any rank failed,
    raise the lowest such rank's error, with the same type and message on every rank."""
    raise_first(exchange(grid, verdict(err)), err, doing)


def raise_first(verdicts: list[dict[str, Any]], err: BaseException | None, doing: str) -> None:
    """Raise the error of the lowest rank whose verdict holds one (nothing if none does)."""
    for r, v in enumerate(verdicts):
        if "error" in v:
            kind, message = v["error"]
            where = f" (rank {r} of {len(verdicts)}, {doing})" if len(verdicts) > 1 else ""
            raise KINDS.get(kind, RuntimeError)(message + where) from err
