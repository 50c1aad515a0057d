"""Sharded checkpoints that load onto any grid, written and read piece by piece with DCP.

Every parameter and AdamW moment is a piece of a *global* tensor of the single-process model
(``axon4d.layout.param_layout``; fused q|k|v and gate|up are saved as their parts). A rank saves its piece as it
stores it, cut into rectangles of the global tensors (``ParamLayout.boxes``), each written by
``torch.distributed.checkpoint`` (DCP) from a view of the rank's storage; a piece several ranks
hold alike is planned and written by one of them (``pieces.writes``), so each rank's plan holds
few items. Nothing is gathered, and a save holds only DCP's copies of the one file it writes
(``axon4d.checkpoint.writer``). DCP coordinates a save on the grid's host group
(``Grid.host_group``, gloo), in host memory, never through an accelerator's; its plans carry no
items (each rank keeps its own) and each rank returns its chunks as one array of records, which
rank 0 merges into the *piece index* (``axon4d.checkpoint.index``) in place of DCP's
``.metadata``: O(world + tensors) of Python on rank 0, whatever the number of chunks. A load cuts
this grid's pieces alike and plans its own reads from the index entries its pieces overlap
(``index.plan_load``: a bisection of the memory-mapped records, never the whole index), so DCP
reads into each piece, in place, the saved rectangles it overlaps — with nothing coordinated
(``no_dist``: no plan leaves the rank, whatever the world size); so a checkpoint loads onto any
grid. A checkpoint written before the piece index loads from DCP's whole index, as before. A
directory holds DCP's shard files, the piece index and ``meta.json`` (step, grid, model config,
each file's sha256 and size, data position, RNG states, extras), published by one rename
(axon4d.files.ckptfiles); older checkpoints beyond ``keep_last`` are deleted in the background. A
load reads the index without running code from it (numpy without pickles, JSON; DCP's index of an
older checkpoint with a restricted unpickler), checks the sizes of the files it reads and its
share of every file's checksum, and that the index covers every piece, first; a step whose failure
one rank alone could see ends with one all-gather of the ranks' verdicts, so all raise the same
error (``axon4d.reliability.agreement``). Files record no device (DCP writes host copies), so
checkpoints move between GPUs and CPUs; a step count goes back where torch.optim keeps it.

``AsyncSaver`` saves while training goes on: it snapshots a rank's pieces into host memory and
DCP's ``async_save`` writes the snapshot from a background thread; the next save (or the end)
publishes it as ``save`` does, with the same checksums and the same agreement of every rank.

The modules: ``pieces`` (a rank's pieces and which it writes), ``planners`` (DCP's planners for
them), ``index`` (the piece index: a rank's records, their merge, a load's plan), ``writer`` (DCP's file writer: bounded files, checksums, the writing thread's device),
``publish`` (a save's start and end, every rank agreeing), ``background`` (``AsyncSaver``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from axon4d import device as devices
from axon4d.checkpoint import index
from axon4d.checkpoint.background import AsyncSaver
from axon4d.checkpoint.pieces import State, rank_state
from axon4d.checkpoint.planners import LoadPieces, SavePieces
from axon4d.checkpoint.publish import begin, own_failure, publish
from axon4d.checkpoint.writer import Writer
from axon4d.config import ModelConfig
from axon4d.files import ckptfiles, ckptindex
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.models.transformer import Transformer
from axon4d.reliability.agreement import agree
from axon4d.zero import ShardedOptimizer, masters_holder

# the file-level API, usable before any process group exists (axon4d.files.ckptfiles)
CheckpointError = ckptfiles.CheckpointError
RESUMABLE_CHANGES = ckptfiles.RESUMABLE_CHANGES
check_compatible = ckptfiles.check_compatible
latest = ckptfiles.latest
list_checkpoints = ckptfiles.list_checkpoints
read_meta = ckptfiles.read_meta

#: the meta.json key (an extra of ``save``) holding the absolute path of the Hugging Face model a
#: checkpoint fine-tunes (``axon4d train --hf``): a resume checks it, an export reads its config there
HF_PATH = "hf_path"

__all__ = [
    "HF_PATH",
    "RESUMABLE_CHANGES",
    "AsyncSaver",
    "CheckpointError",
    "check_compatible",
    "export_dense",
    "latest",
    "list_checkpoints",
    "load",
    "read_meta",
    "save",
]


def save(
    path: str,
    model: nn.Module,
    grid: Grid,
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    keep_last: int = 0,
    *,
    data_position: Any = None,
    rng: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Write a sharded checkpoint of ``model`` (and AdamW-style ``optimizer`` state) to ``path``,
    published atomically: every rank returns once ``path`` is complete, or raises the same error.

    meta.json records ``step``, the grid, the model's config, each file's sha256 and size, and (as
    rank 0 passes them) ``data_position`` and ``rng`` (JSON data, e.g. ``axon4d.device.rngrank_state()``) beside the
    keys of ``extra``. An existing ``path`` is an error unless ``overwrite``. With ``keep_last`` K > 0
    all but the newest K ``step_<N>`` checkpoints beside ``path`` are deleted afterwards.
    """
    path, meta, state = begin(path, model, grid, optimizer, step, extra, keep_last, data_position, rng, overwrite)
    writer, err = Writer(ckptfiles.partial_path(path), grid.device, sources=grid.device), None
    try:
        dcp.save(state.steps, storage_writer=writer, planner=SavePieces(state.parts), process_group=grid.host_group())
    except dcp.CheckpointException as e:  # raised alike on every rank
        err = own_failure(e, grid.rank)
    publish(grid, path, meta, writer, err, overwrite, keep_last)


@torch.no_grad()
def load(
    path: str,
    model: nn.Module,
    grid: Grid,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    check_model: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written on any grid into ``model`` (and ``optimizer``); return its meta
    (with ``data_position`` and ``rng`` when the save recorded them, for the caller to restore).

    Before DCP reads anything (straight into the parameters and moments), every rank checks
    meta.json, the model config, the index entries its pieces overlap (read without running code;
    they must cover each piece) and the sizes of the shards they name, each file's checksum
    verified by one rank (``index.plan_load``). All ranks agree: a bad
    checkpoint raises the same error on every rank (``CheckpointError``, ``FileNotFoundError``, or
    ``ValueError`` for another model; with ``check_model=False`` only the tensors' shapes must match).
    """
    err = None
    meta: dict[str, Any] = {}
    state, plan = State([], {}, [], []), index.LoadPlan(dcp.Metadata({}), [], [])
    try:
        meta = read_meta(path)
        cfg = getattr(model, "cfg", None)
        if check_model and isinstance(cfg, ModelConfig) and "model_config" in meta:
            check_compatible(meta, model_config=cfg)
        holder = masters_holder(model, grid)
        if holder is not None and optimizer is not holder:
            raise ValueError(
                "the model's Linear weights are stored in bf16 and their fp32 master weights belong to a sharded "
                "optimizer (axon4d.shard_optimizer, training in 16 bits): pass it, load(path, model, grid, "
                "optimizer), or its next step would overwrite what this load wrote"
            )
        state = rank_state(model, optimizer, grid, load=True)
        plan = index.plan_load(path, meta, state.parts, list(state.steps), grid.rank, grid.size("world"))
    except Exception as e:
        err = e
    agree(grid, err, f"checking {path}")
    try:  # each rank reads its own pieces: nothing to coordinate (its reads are planned above)
        dcp.load(
            state.steps,
            storage_reader=ckptindex.SafeReader(path, plan.md),
            planner=LoadPieces(state.parts, plan.reads),
            no_dist=True,
        )
    except Exception as e:
        err = e
    agree(grid, err, f"reading {path}")
    for pad in state.pads:
        pad.zero_()
    states = optimizer.state if optimizer is not None else {}
    for p, key, t in state.made:  # the moments made and the step counts (made where the optimizer keeps them)
        states[p][key] = t
    if isinstance(optimizer, ShardedOptimizer):  # 16-bit weights: DCP filled their masters; round them back
        optimizer.refresh_params()
    return meta


def export_dense(path: str, out_file: str) -> str:
    """Write a checkpoint's model as one plain ``torch.save`` state dict of ``DenseTransformer``.

    Runs in a single process: it loads the checkpoint onto a 1-rank grid (on this machine's
    default device) and converts; the file holds host tensors, so ``torch.load`` needs no
    ``map_location`` anywhere.
    """
    meta = read_meta(path)
    if "model_config" not in meta:
        raise ValueError(f"{path} has no model_config in meta.json; only axon4d models can be exported")
    if HF_PATH in meta:
        raise ValueError(
            f"{path} fine-tunes the Hugging Face model in {meta[HF_PATH]!r} (axon4d train --hf), not one of "
            "axon4d's own models; export it in that model's format (axon4d export-hf)"
        )
    grid = runtime.init(grid=(1, 1, 1, 1))
    try:
        model = Transformer(ModelConfig(**meta["model_config"]), grid=grid)
        load(path, model, grid)
        torch.save({k: devices.to_host(v) for k, v in model.to_dense().state_dict().items()}, out_file)
    finally:
        runtime.shutdown()
    return out_file
