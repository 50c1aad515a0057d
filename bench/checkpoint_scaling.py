"""A checkpoint of the 80B model on 4096 ranks, simulated metadata-only in one process: rank 0's
coordination of a save and one rank's load against the piece index of the whole world.

The job is the planner's 80B layout scaled to 4096 ranks: grid (x=1, y=4, z=4, data=256), ZeRO-2
with 16-bit weights (every data rank saves its own part of the fp32 masters and both moments, the
layout that writes the most chunks). The model is built on the meta device as one rank of a fake
process group (no tensor is allocated); ``world_parts`` lists what each of the 4096 ranks writes
with the checkpoint's own layout code (``ParamLayout.boxes`` cut to each data rank's ZeRO part by
``pieces._owned_views``, written by the rank ``pieces.writes`` names), computed once per rank and
parameter *kind* (the 42 blocks' tensors have the same geometry) and checked against
``rank_state`` for the simulated rank; each rank's byte offsets and files follow ``Writer``'s
16 files per rank.

- **save** (rank 0's coordination, what grows with the world): DCP's global plan over 4096 empty
  plans and the file prefixes it deals (``SavePieces``, ``Writer.prepare_global_plan``), the
  unpickling of every rank's part of the piece index (what DCP's gather of write results
  delivers), their merge and the writing, reading back and hashing of pieces.json and pieces.npy
  (``Writer.finish``), and meta.json with the sha256 of every file (``ckptfiles.publish``).
- **load** (one rank, ``axon4d.checkpoint.index.plan_load``): meta.json (all 65 k files), the
  sha256 of pieces.json, the piece index opened memory-mapped, the records its pieces overlap,
  DCP's reads of them, and the sizes of the files they lie in (empty sparse files here). The sha256
  of its share of the shard files is data, not metadata, and is left out.

With ``--legacy`` it also times what the same world cost before the piece index: rank 0 pickling
DCP's whole index (the last step of its coordination then) and one rank's load from it (every
rank unpickled all of it and stat()ed every file), once each.

Each is timed ``--rounds`` times (median) with its Python peak (``tracemalloc``: numpy's arrays
included; pages of pieces.npy mapped but not copied are not). Writes
``bench/results/checkpoint_scaling.json`` and prints one line::

    checkpoint at 4096 ranks (80B, grid G, ZeRO-2, N chunks): save coordination on rank 0 S s, P MB; load on one rank L s, Q MB
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
import tracemalloc
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

GRID = (1, 4, 4, 256)
OUT = os.path.join(common.RESULTS, "checkpoint_scaling.json")
MOMENTS = ("exp_avg", "exp_avg_sq")


def build(grid_shape: tuple[int, ...], rank: int) -> tuple[Any, Any, Any]:
    """The 80B model on the meta device as ``rank`` of a fake world of ``grid_shape``, its ZeRO-2
    AdamW (both moments and a step count, as after a step) and the grid."""
    world = int(np.prod(grid_shape))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    import axon4d
    from axon4d.models import get_config
    from axon4d.models.transformer import Transformer
    from axon4d.zero import shard_optimizer

    grid = axon4d.init(grid=grid_shape, precision="bf16-fp32-reduce", overlap=False)
    model = Transformer(get_config("80B"), device="meta")
    opt = shard_optimizer(torch.optim.AdamW(model.parameters()), model, grid, stage=2)
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
                "step": torch.tensor(1.0),
            }
    return model, opt, grid


class _As:
    """The grid as another rank of it sees it: what the layout code asks (sizes, coordinates), each
    answer kept (``sizes`` shared by every rank of the shape)."""

    def __init__(self, shape: Any, rank: int, sizes: dict[str, int]):
        self.shape, self.rank, self.coords, self.sizes = shape, rank, shape.coordinates(rank), sizes

    def size(self, axis: str) -> int:
        if axis not in self.sizes:
            self.sizes[axis] = int(self.shape.size(axis))
        return self.sizes[axis]

    def coord(self, axis: str) -> int:
        if axis not in self.coords:
            self.coords[axis] = int(self.shape.coordinate(self.rank, axis))
        return int(self.coords[axis])


def _kind(name: str) -> str:
    """A parameter's kind: blocks.<i>.<rest> is blocks.*.<rest>."""
    return re.sub(r"\.\d+\.", ".*.", name, count=1)


def _kinds(model: Any) -> dict[str, list[str]]:
    """The model's parameters grouped by kind (``_kind``)."""
    kinds: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        kinds.setdefault(_kind(name), []).append(name)
    return kinds


def world_parts(model: Any, opt: Any, grid: Any, ranks: range) -> tuple[list[dict[str, Any]], list[set[tuple]]]:
    """What each rank of ``ranks`` writes: its part of the piece index (``index.rank_records``'
    form: records, files, the tensors whose first chunk it writes) and, for checking, its boxes."""
    from axon4d.checkpoint.pieces import _owned_views, place, replicated_axes, writer
    from axon4d.files.ckptindex import RECORD, key_hash
    from axon4d.grid.shape import AXES
    from axon4d.layout.geometry import data_part_numel
    from axon4d.layout.param_layout import param_layouts

    layouts, params = param_layouts(model), dict(model.named_parameters())
    g_data = grid.size("data")
    kinds = _kinds(model)
    named = (lambda n: f"model.{n}", *(lambda n, m=m: f"optim.{n}.{m}" for m in MOMENTS))  # rank_state's keys
    known: dict[str, int] = {}  # key -> its hash in the index
    writer_of = functools.cache(writer)  # the same few thousand tensors asked of by every rank

    @functools.cache
    def names_of(tensor: Any, rep: str) -> list[str]:
        """The saved names of ``tensor`` (a ``named`` entry) for every layer of ``rep``'s kind."""
        return [tensor(m) for m in kinds[_kind(rep)]]

    sizes: dict[str, int] = {}
    steps: dict[int, list[str]] = {}  # a step count's writer over every axis (pieces.writer) -> its keys
    world = math.prod(grid.shape.size(a) for a in AXES)
    for name in params:
        key = f"optim.{name}.step"
        steps.setdefault(writer(key, world), []).append(key)
    parts, boxes_of = [], []
    for r in ranks:
        me = _As(grid.shape, r, sizes)
        rows: list[tuple[int, ...]] = []  # (hash, 3 offsets, 3 sizes, bytes)
        keys: dict[str, dict[str, Any]] = {}
        boxes: set[tuple] = set()
        for members in kinds.values():
            rep = members[0]
            layout, numel = layouts[rep], params[rep].numel()
            whole = opt.owned(params[rep])[1].numel() == numel and g_data > 1  # not replicated over data
            chunk = numel if whole else data_part_numel(numel, g_data)  # ZeRO: this data rank's part
            start = min(numel, me.coord("data") * chunk) if not whole else 0
            size = min(numel, start + chunk) - start
            for tensor in named:
                part = not (tensor is named[0] and opt.master_copy(params[rep]) is None)  # else the parameter
                index, count = place(me, replicated_axes(layout, part=part))  # among those holding it alike
                if part:
                    t = torch.empty(size, device="meta")
                    mine, _ = _owned_views(layout, tensor(rep), numel, start, t, me)
                else:
                    mine = layout.views(tensor(rep), torch.empty(numel, device="meta"), me)
                cut = len(tensor(rep))  # the representative's name: a piece's key is it and a suffix
                names = [n for n in names_of(tensor, rep) if writer_of(n, count) == index]  # pieces.writes
                for b, _ in mine:
                    where = (*_pad(b.offsets, 0), *_pad(b.sizes, 1), 4 * math.prod(b.sizes))
                    first = not any(b.offsets)
                    for name in names:
                        key = name + b.key[cut:]
                        if key not in known:
                            known[key] = key_hash(key)
                        rows.append((known[key], *where))
                        boxes.add((key, b.offsets, b.sizes))
                        if first:
                            keys[key] = {"shape": list(b.shape), "dtype": "float32"}
        for key in steps.get(place(me, AXES)[0], []):  # step counts: one rank of the world each
            rows.append((key_hash(key), 0, 0, 0, 1, 1, 1, 8))
            boxes.add((key, (), ()))
            keys[key] = {"shape": [], "dtype": "float32"}
        records = np.zeros(len(rows), RECORD)  # as index.rank_records makes them
        table = np.array([r[1:] for r in rows], np.int64).reshape(-1, 7)
        nbytes = table[:, 6]
        at = np.concatenate([[0], np.cumsum(nbytes)[:-1]]) if len(rows) else nbytes
        file_of = at * 16 // max(int(nbytes.sum()), 1)  # Writer: file k holds the items starting in its 1/16
        records["key"] = np.array([r[0] for r in rows], np.uint64)
        records["off"], records["size"] = table[:, 0:3], table[:, 3:6]
        used = sorted(set(file_of.tolist()))
        first = {k: int(at[file_of == k][0]) for k in used}
        records["file"] = [used.index(int(k)) for k in file_of]
        records["pos"] = at - np.array([first[int(k)] for k in file_of], np.int64)
        records["len"] = nbytes
        parts.append({"records": records.tobytes(), "files": [f"__{r}_{k}_0.distcp" for k in used], "keys": keys})
        boxes_of.append(boxes)
    return parts, boxes_of


def _read(r: Any) -> tuple[Any, ...]:
    """A read as a comparable tuple: where from, where to, how much (not DCP's position hints)."""
    src, dst = r.storage_index, r.dest_index
    return (
        dst.fqn,
        tuple(dst.offset),
        dst.index,
        src.fqn,
        tuple(src.offset),
        *map(tuple, (r.storage_offsets, r.dest_offsets, r.lengths)),
    )


def _pad(values: tuple[int, ...], fill: int) -> tuple[int, ...]:
    return (*values, *[fill] * (3 - len(values)))


def _timed(fn: Any, rounds: int) -> tuple[float, float, Any]:
    """Median seconds of ``rounds`` calls of ``fn``, the Python peak (MB) of one more call under
    ``tracemalloc`` (which slows Python several-fold, so it is not timed); its last value."""
    times = []
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    value = fn()
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return statistics.median(times), peak, value


def measure(
    grid_shape: tuple[int, ...] = GRID,
    rank: int | None = None,
    rounds: int = 3,
    check: bool = False,
    legacy: bool = False,
) -> dict[str, Any]:
    """Simulate the save's coordination on rank 0 and ``rank``'s load (default: the last) at
    ``grid_shape``; the figures. ``check``: also plan the load from DCP's whole index (built from
    the piece index: O(chunks), for small worlds) and require the same reads. ``legacy``: also
    time what the same world cost before the piece index — rank 0 pickling DCP's whole index
    (the last step of its coordination then) and a load from it (every rank unpickling all of it)."""
    from torch.distributed.checkpoint import SavePlan

    from axon4d.checkpoint import index
    from axon4d.checkpoint.pieces import rank_state
    from axon4d.checkpoint.planners import SavePieces, read_items
    from axon4d.checkpoint.writer import Writer
    from axon4d.files import ckptfiles, ckptindex
    from axon4d.files.ckptindex import RECORD

    world = int(np.prod(grid_shape))
    rank = world - 1 if rank is None else rank
    model, opt, grid = build(grid_shape, rank)
    t0 = time.perf_counter()
    parts, boxes = world_parts(model, opt, grid, range(world))
    built = time.perf_counter() - t0
    state = rank_state(model, opt, grid, load=False)  # the layout code's own pieces for this rank
    own = {(b.key, b.offsets, b.sizes) for b, _ in state.parts} | {(k, (), ()) for k in state.steps}
    assert own == boxes[rank], (len(own), len(boxes[rank]), sorted(own ^ boxes[rank])[:4])
    del boxes, own  # 2 M tuples the real rank 0 never holds (the collector would walk them)
    arriving = [pickle.dumps([index.result(p)]) for p in parts]  # what DCP's gather of results delivers
    chunks = sum(len(p["records"]) // RECORD.itemsize for p in parts)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step_1")
        os.makedirs(path)

        def coordinate() -> dict[str, Any]:
            planner = SavePieces([])
            planner.set_up_planner({}, None, True)
            plans = [pickle.loads(pickle.dumps(SavePlan([], planner_data={}))) for _ in range(world)]
            plans, _ = planner.create_global_plan(plans)
            writer = Writer(path, torch.device("cpu"), sources=torch.device("cpu"))
            writer.prepare_global_plan(plans)
            writer.finish(None, [pickle.loads(b) for b in arriving])  # type: ignore[arg-type]
            files = {f: {"sha256": "0" * 64, "bytes": 0} for p in parts for f in p["files"]}
            files.update(writer.digests)
            meta = {"step": 1, "grid": list(grid_shape), "files": files}
            ckptfiles.write_atomic(os.path.join(path, ckptfiles.META), ckptfiles.meta_text(meta))
            return meta

        save_s, save_mb, meta = _timed(coordinate, rounds)
        load_state = rank_state(model, opt, grid, load=True)
        steps = list(load_state.steps)
        md = ckptindex.PieceIndex(path).metadata(
            {**dict.fromkeys(steps), **{b.key: [(b.offsets, b.sizes)] for b, _ in load_state.parts}}
        )
        for info in md.storage_data.values():  # the files it reads, sparse, long enough
            with open(os.path.join(path, info.relative_path), "ab") as f:
                f.truncate(max(os.path.getsize(f.name), info.offset + info.length))

        def load() -> index.LoadPlan:
            return index.plan_load(path, ckptfiles.read_meta(path), load_state.parts, steps, rank, world, share=False)

        load_s, load_mb, plan = _timed(load, rounds)
        if check:
            whole = read_items(path, ckptindex.read_index(path), load_state.parts)
            assert sorted(map(_read, whole)) == sorted(map(_read, plan.reads)), "the piece index planned other reads"
        before: dict[str, Any] = {}
        if legacy:  # the same checkpoint with DCP's .metadata only, as saves wrote it before the piece index
            whole_md = ckptindex.read_index(path)

            def pickle_index() -> None:
                with open(os.path.join(path, ckptfiles.DCP_INDEX), "wb") as f:
                    pickle.dump(whole_md, f)

            before["legacy_index_pickle_s"], before["legacy_index_pickle_peak_mb"], _ = _timed(pickle_index, 1)
            del whole_md
            meta = ckptfiles.read_meta(path)
            for name in (ckptfiles.PIECES, ckptfiles.CHUNKS):
                os.rename(os.path.join(path, name), os.path.join(tmp, name))
                meta["files"].pop(name)
            sha, size = ckptfiles.digest(os.path.join(path, ckptfiles.DCP_INDEX))  # each rank checked it whole
            meta["files"][ckptfiles.DCP_INDEX] = {"sha256": sha, "bytes": size}
            ckptfiles.write_atomic(os.path.join(path, ckptfiles.META), ckptfiles.meta_text(meta))
            for info in ckptindex.read_index(path).storage_data.values():  # the old check stat()ed every file
                with open(os.path.join(path, info.relative_path), "ab") as f:
                    f.truncate(max(os.path.getsize(f.name), info.offset + info.length))
            before["legacy_load_s"], before["legacy_load_peak_mb"], _ = _timed(load, 1)
            before["legacy_index_bytes"] = os.path.getsize(os.path.join(path, ckptfiles.DCP_INDEX))
            for name in (ckptfiles.PIECES, ckptfiles.CHUNKS):
                os.rename(os.path.join(tmp, name), os.path.join(path, name))
        index_bytes = {n: os.path.getsize(os.path.join(path, n)) for n in (ckptfiles.PIECES, ckptfiles.CHUNKS)}
        meta_bytes = os.path.getsize(os.path.join(path, ckptfiles.META))
    return {
        "model": "80B",
        "grid": list(grid_shape),
        "world": world,
        "zero": 2,
        "rank_loaded": rank,
        "chunks": chunks,
        "files": len(meta["files"]),
        "index_bytes": index_bytes,
        "meta_json_bytes": meta_bytes,
        "world_built_s": round(built, 2),
        "rounds": rounds,
        "save_coordination_s": round(save_s, 3),
        "save_coordination_peak_mb": round(save_mb, 1),
        "load_s": round(load_s, 3),
        "load_peak_mb": round(load_mb, 1),
        "load_pieces": len(load_state.parts),
        "load_reads": len(plan.reads),
        "load_chunks": len(plan.md.storage_data),
        "load_files": len(plan.shards),
        "checked_against_whole_index": check,
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in before.items()},
    }


def headline(r: dict[str, Any]) -> str:
    return (
        f"checkpoint at {r['world']} ranks (80B, grid {tuple(r['grid'])}, ZeRO-2, {r['chunks']} chunks): save "
        f"coordination on rank 0 {r['save_coordination_s']:.2f} s, {r['save_coordination_peak_mb']:.0f} MB; load on "
        f"one rank {r['load_s']:.2f} s, {r['load_peak_mb']:.0f} MB"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default=",".join(map(str, GRID)), help="x,y,z,data (default %(default)s)")
    ap.add_argument("--rank", type=int, default=None, help="the rank whose load is simulated (default: the last)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="compare the load's reads with the whole index's")
    ap.add_argument("--legacy", action="store_true", help="also time DCP's whole index (before the piece index)")
    ap.add_argument("--out", default=OUT, help="result JSON (default %(default)s); '-' prints it only")
    args = ap.parse_args(argv)
    head = common.header()
    result = measure(tuple(int(s) for s in args.grid.split(",")), args.rank, args.rounds, args.check, args.legacy)
    if args.out == "-":
        print(json.dumps(result))
    else:
        common.save(args.out, result, head)
    print(headline(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
