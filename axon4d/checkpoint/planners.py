"""DCP's planners for a rank's pieces (``axon4d.checkpoint.pieces``): what a save writes and a load reads.

A save writes each piece straight from the view of the rank's storage that holds it. Its items
never cross DCP's gathers: a rank already knows which pieces it alone writes
(``pieces.writes``), so rank 0 has nothing to deduplicate, and the plan it gathers, plans
globally and scatters back is empty (O(world) of work on rank 0, not O(items)); each rank puts its
own items back when DCP hands it its plan (``SavePieces.finish_plan``). A load asks the index for
the saved chunks each piece overlaps (``read_items``) and reads them into the piece's view, in
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
    """DCP's save planner, plus one write of each piece, straight from this rank's storage; the
    items stay on the rank (DCP's coordinator sees an empty plan from each)."""

    def __init__(self, parts: list[Piece]):
        super().__init__()
        self.parts = {(b.key, b.offsets): (b, view) for b, view in parts}
        self.items: list[dcp.WriteItem] = []

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
        self.items = [*plan.items, *writes]
        return dataclasses.replace(plan, items=[])  # what DCP gathers to rank 0: nothing per item

    def finish_plan(self, new_plan: dcp.SavePlan) -> dcp.SavePlan:
        """The plan DCP hands back (its file prefix for this rank) with this rank's items."""
        return super().finish_plan(dataclasses.replace(new_plan, items=self.items))

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
                f"{path}'s index does not cover {b.key} at {b.offsets} (sizes {b.sizes}) with its "
                "chunks: the index is damaged; resume from another checkpoint"
            )
        reads += [dataclasses.replace(r, dest_index=MetadataIndex(b.key, b.offsets, i)) for r in found]
    return reads
