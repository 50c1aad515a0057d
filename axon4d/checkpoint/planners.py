"""DCP's planners for a rank's pieces (``axon4d.checkpoint.pieces``): what a save writes and a load reads.

A save writes each piece straight from the view of the rank's storage that holds it; a load asks
DCP for the saved chunks each piece overlaps (``read_items``) and reads them into the piece's view, in
place, so a checkpoint loads onto any grid.
"""

from __future__ import annotations

import dataclasses
import io
import math

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from axon4d.checkpoint.pieces import Piece, chunk
from axon4d.files import ckptfiles


class SavePieces(dcp.DefaultSavePlanner):
    """DCP's save planner, plus one write of each piece, straight from this rank's storage."""

    def __init__(self, parts: list[Piece]):
        super().__init__()
        self.parts = {(b.key, b.offsets): (b, view) for b, view in parts}

    def create_local_plan(self) -> dcp.SavePlan:
        plan = super().create_local_plan()
        # one object per kind of tensor and per global shape: a plan pickles each once, then refers to it
        alike: dict[tuple[object, ...], TensorProperties] = {}
        shapes: dict[tuple[int, ...], torch.Size] = {}
        writes = []
        for b, view in self.parts.values():
            props = TensorProperties.create_from_tensor(view)
            props = alike.setdefault(dataclasses.astuple(props), props)
            data = TensorWriteData(chunk(b), props, shapes.setdefault(b.shape, torch.Size(b.shape)))
            writes.append(dcp.WriteItem(MetadataIndex(b.key, b.offsets), WriteItemType.SHARD, tensor_data=data))
        return dataclasses.replace(plan, items=[*plan.items, *writes])

    def resolve_data(self, write_item: dcp.WriteItem) -> torch.Tensor | io.BytesIO:
        part = self.parts.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return part[1] if part is not None else super().resolve_data(write_item)


class LoadPieces(dcp.DefaultLoadPlanner):
    """DCP's load planner, plus ``reads`` (``read_items``) straight into the pieces' views."""

    def __init__(self, parts: list[Piece], reads: list[dcp.ReadItem]):
        super().__init__()
        self.parts, self.reads, self.keys = parts, reads, {b.key for b, _ in parts}

    def create_local_plan(self) -> dcp.LoadPlan:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[*plan.items, *self.reads])

    def resolve_tensor(self, read_item: dcp.ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn not in self.keys:
            return super().resolve_tensor(read_item)
        return self.transform_tensor(read_item, self.parts[read_item.dest_index.index or 0][1])


def read_items(path: str, md: dcp.Metadata, parts: list[Piece]) -> list[dcp.ReadItem]:
    """DCP's reads filling every piece from the checkpoint at ``path`` whose index is ``md``; a
    tensor absent, of another shape, or not wholly covered by the saved chunks is an error."""
    reads: list[dcp.ReadItem] = []
    for i, (b, _) in enumerate(parts):
        entry = md.state_dict_metadata.get(b.key)
        if not isinstance(entry, dcp.TensorStorageMetadata):
            raise ValueError(
                f"{path} holds no tensor {b.key}: it was saved from another model, or without optimizer state (then "
                "load it with optimizer=None)"
            )
        if tuple(entry.size) != b.shape:
            raise ValueError(
                f"{path} holds {b.key} of shape {tuple(entry.size)}, this model's is {b.shape}: it is another model's "
                "checkpoint; load it into a model of the configuration in its meta.json"
            )
        found = create_read_items_for_chunk_list(b.key, entry, [chunk(b)])
        if sum(math.prod(r.lengths) for r in found) != math.prod(b.sizes):
            raise ckptfiles.CheckpointError(
                f"{path}/{ckptfiles.DCP_INDEX} does not cover {b.key} at {b.offsets} (sizes {b.sizes}) with its "
                "chunks: the index is damaged; resume from another checkpoint"
            )
        reads += [dataclasses.replace(r, dest_index=MetadataIndex(b.key, b.offsets, i)) for r in found]
    return reads
