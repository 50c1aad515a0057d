"""Loading a saved Hugging Face model into a parallelized one by slices (docs/parallelize.md).

A model too large for one host is built on the ``meta`` device, parallelized there, and only then
given storage: every rank reads from the checkpoint just the slices its shards hold, so no rank
ever holds the whole model.

    with torch.device("meta"):
        model = LlamaForCausalLM(config)  # no storage anywhere
    model = axon4d.auto_parallelize(model)  # the 3D layers are built on meta too
    load_pretrained_(model, directory)  # this rank's slices, on the grid's device

``directory`` is what ``save_pretrained`` wrote: ``model.safetensors``, or several files listed in
``model.safetensors.index.json``. Each parameter is read with safetensors' ``get_slice`` as the
rectangles of its global tensor that this rank's piece is (``axon4d.layout.rectangles``): a ``ShardedLinear``'s
flat z shard of its (x, y) block — rows in the layer's ``out_perm`` order, from the transposed
(in, out) tensor of a GPT-2 ``Conv1D`` — a ``ShardedNorm``'s features, a vocabulary-parallel
embedding's block; parameters left whole (replicated) are read whole. Reads go in row chunks of at
most ``CHUNK`` elements, so a rank holds its shards plus one chunk.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from axon4d.files.safetensors_files import INDEX_FILE, SINGLE_FILE
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import rectangles, tiled_init
from axon4d.nn.embedding import PositionEmbedding, VocabParallelEmbedding
from axon4d.nn.linear import Linear
from axon4d.nn.norm import SplitFeatureNorm
from axon4d.parallelize import moe_loading
from axon4d.parallelize.layers import ShardedLinear, ShardedNorm
from axon4d.parallelize.moe import moe_blocks

#: the most elements one slice read returns (reads are cut into row chunks of at most this)
CHUNK = 1 << 20


def checkpoint_files(directory: str) -> dict[str, str]:
    """``{tensor name: file path}`` of the safetensors checkpoint in ``directory`` (one file, or the
    files listed in ``model.safetensors.index.json``)."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    single = os.path.join(directory, SINGLE_FILE)
    if not os.path.exists(single):
        what = "holds" if os.path.isdir(directory) else "is not a directory, so it holds"
        raise FileNotFoundError(
            f"{directory!r} {what} neither {SINGLE_FILE} nor {INDEX_FILE}; give the directory a Hugging Face "
            "model was saved to with save_pretrained(directory, safe_serialization=True)"
        )
    from safetensors import safe_open  # an optional dependency (it comes with transformers)

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class _Reader:
    """Opens each checkpoint file once (``safe_open``) and hands out lazy slices of its tensors."""

    def __init__(self, files: dict[str, str], device: torch.device, stack: contextlib.ExitStack):
        self.files, self.device, self.stack = files, device, stack
        self.handles: dict[str, Any] = {}

    def slice(self, name: str) -> Any:
        from safetensors import safe_open  # an optional dependency (it comes with transformers)

        path = self.files[name]
        if path not in self.handles:
            dev = "cpu" if self.device.type == "meta" else str(self.device)
            self.handles[path] = self.stack.enter_context(safe_open(path, framework="pt", device=dev))
        return self.handles[path].get_slice(name)


def _linear_reads(
    name: str, layer: Linear, out_perm: torch.Tensor | None, grid: Grid
) -> dict[str, tuple[str, tuple[int, ...], list[rectangles.Piece]]]:
    """{parameter: (checkpoint tensor, its shape, rectangles)} of a 3D layer whose dense layer was
    ``name``: the weight's flat z shard of this rank's block, the bias's rows (both in
    ``out_perm``'s row order)."""
    rows, cols = layer.block_shape
    r, c = layer.block_index
    order = list(range(r * rows, (r + 1) * rows))
    if out_perm is not None:
        order = [int(i) for i in out_perm[r * rows : (r + 1) * rows]]
    out: dict[str, tuple[str, tuple[int, ...], list[rectangles.Piece]]] = {}
    for p_name, shape in (("weight", (layer.out_features, layer.in_features)), ("bias", (layer.out_features,))):
        if getattr(layer, p_name) is None:
            continue
        tensor, matrix = f"{name}.{p_name}", rectangles.matrix_shape(shape)
        sources = [rectangles.Rows(start, n, tensor, matrix, first) for start, n, first in rectangles.runs(order)]
        if p_name == "weight":  # the flat z shard of the block; past the block's end it is padding
            start = grid.coord("z") * layer.shard_numel
            parts = rectangles.pieces(sources, c * cols, cols, start, min(start + layer.shard_numel, rows * cols))
        else:
            parts = rectangles.pieces(sources, 0, 1, 0, rows)
        out[p_name] = (tensor, shape, parts)
    return out


def _block(tensor: str, shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int]) -> list[rectangles.Piece]:
    """Rows [rows) × columns [cols) of ``tensor`` (seen as a matrix), stored whole in the local tensor."""
    n, width = rows[1] - rows[0], cols[1] - cols[0]
    return rectangles.pieces(
        [rectangles.Rows(0, n, tensor, rectangles.matrix_shape(shape), rows[0])], cols[0], width, 0, n * width
    )


#: what ``_reads`` yields per parameter: (module, parameter name, checkpoint tensor, that tensor's
#: shape, the rectangles of it this rank holds, whether the checkpoint stores it transposed)
Entry = tuple[nn.Module, str, str, tuple[int, ...], list[rectangles.Piece], bool]


def _reads(model: nn.Module, grid: Grid) -> Iterator[Entry]:
    """What this rank reads for every parameter of ``model``."""
    inner_of: dict[int, tuple[str, nn.Module]] = {}  # id(inner module) → (name of the dense module, wrapper)
    for name, m in model.named_modules():
        if isinstance(m, (ShardedLinear, ShardedNorm)):
            inner_of[id(m.inner)] = (name, m)
    in_moe = {id(m) for _, block in moe_blocks(model) for m in block.moe.modules()}  # read by _load_moe_blocks
    for name, m in model.named_modules():
        params = dict(m.named_parameters(recurse=False))
        if not params or id(m) in in_moe:
            continue
        dense, wrapper = inner_of.get(id(m), (name, None))
        if isinstance(m, Linear):
            perm = wrapper.out_perm if isinstance(wrapper, ShardedLinear) else None
            conv1d = isinstance(wrapper, ShardedLinear) and wrapper.conv1d_class is not None  # (in, out) on file
            for p_name, (tensor, shape, parts) in _linear_reads(dense, m, perm, grid).items():
                yield m, p_name, tensor, shape, parts, conv1d and p_name == "weight"
        elif isinstance(m, SplitFeatureNorm):
            n = m.hidden // grid.size(m.axis)
            rows = (grid.coord(m.axis) * n, (grid.coord(m.axis) + 1) * n)
            for p_name in params:
                tensor = f"{dense}.{p_name}"
                yield m, p_name, tensor, (m.hidden,), _block(tensor, (m.hidden,), rows, (0, 1)), False
        elif isinstance(m, VocabParallelEmbedding):
            tensor, shape = f"{dense}.weight", (m.vocab_size, m.hidden)
            yield m, "weight", tensor, shape, _block(tensor, shape, m.rows, m.cols), False
        elif isinstance(m, PositionEmbedding):
            tensor, shape = f"{dense}.weight", (m.seq_len, m.hidden)
            yield m, "weight", tensor, shape, _block(tensor, shape, (0, m.seq_len), m.cols), False
        else:  # left whole on every rank: read whole
            for p_name, p in params.items():
                tensor, shape = (f"{dense}.{p_name}" if dense else p_name), tuple(p.shape)
                n_rows, n_cols = rectangles.matrix_shape(shape)
                yield m, p_name, tensor, shape, _block(tensor, shape, (0, n_rows), (0, n_cols)), False


def _resolve(candidates: list[str], available: dict[str, str], prefix: str) -> str:
    """The first of ``candidates`` the checkpoint holds, also with the base model's ``prefix``
    dropped or added (checkpoints of a base model are saved without it)."""
    tried = []
    for name in candidates:
        options = [name]
        if prefix:
            options += [name[len(prefix) + 1 :]] if name.startswith(f"{prefix}.") else [f"{prefix}.{name}"]
        for option in options:
            if option in available:
                return option
            tried.append(option)
    raise KeyError(f"the checkpoint holds none of {tried}")


def _read_into(
    dest: torch.Tensor,
    reader: _Reader,
    tensor: str,
    part: rectangles.Piece,
    global_shape: tuple[int, ...],
    transposed: bool,
) -> None:
    """Copy rectangle ``part`` of checkpoint ``tensor`` into ``dest`` (part.rows, part.cols), in row chunks."""
    sl = reader.slice(tensor)
    file_shape = tuple(sl.get_shape())
    want = tuple(reversed(global_shape)) if transposed else tuple(global_shape)
    if file_shape != want:
        raise ValueError(f"checkpoint tensor {tensor} has shape {file_shape}, the model needs {want}")
    step = max(1, CHUNK // part.cols)
    cols = slice(part.col0, part.col0 + part.cols)
    for r in range(0, part.rows, step):
        h = min(step, part.rows - r)
        rows = slice(part.row0 + r, part.row0 + r + h)
        if len(file_shape) == 1:
            got = sl[rows].view(h, 1)
        elif transposed:
            got = sl[cols, rows].t()
        elif len(file_shape) == 2:
            got = sl[rows, cols]
        else:  # a tensor of more dims is read by whole rows (only replicated ones, read whole anyway)
            got = sl[rows].reshape(h, -1)[:, cols]
        dest[r : r + h].copy_(got)


@torch.no_grad()
def load_pretrained_(
    model: nn.Module, directory: str, *, grid: Grid | None = None, device: str | torch.device | None = None
) -> nn.Module:
    """Fill ``model`` (parallelized by ``auto_parallelize``, typically built on the meta device)
    with this rank's slices of the safetensors checkpoint ``save_pretrained`` wrote in ``directory``.

    Every parameter and buffer on the meta device gets storage on ``device`` (default: the grid's)
    in its own dtype; parameters that have storage are overwritten in place. Gradient hooks and
    ties between modules are kept. Non-persistent buffers the checkpoint does not hold (the rotary
    ``inv_freq``) are recomputed by the model's own ``_init_weights`` (Hugging Face models).
    No collective is issued. Returns ``model``.
    """
    grid = runtime.resolve(grid)
    device = torch.device(device) if device is not None else grid.device
    files = checkpoint_files(directory)
    prefix = getattr(model, "base_model_prefix", "") or ""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    memo: dict[int, nn.Parameter] = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(files, device, stack)
        for module, p_name, tensor, shape, parts, transposed in _reads(model, grid):
            p = module._parameters[p_name]
            assert p is not None
            if id(p) in memo:  # tied: already read under another name
                tiled_init.replace_parameter_(module, p_name, p, memo)
                continue
            candidates = [tensor] + [a for a in aliases.get(id(p), []) if a != tensor]
            found = _resolve(candidates, files, prefix)
            local = torch.empty(p.shape, dtype=p.dtype, device=device) if p.is_meta else p.detach()
            flat, end = local.view(-1), 0
            for part in parts:
                dest = flat[part.offset : part.offset + part.numel].view(part.rows, part.cols)
                _read_into(dest, reader, found, part, shape, transposed)
                end = max(end, part.offset + part.numel)
            flat[end:].zero_()  # z padding
            if p.is_meta:
                tiled_init.replace_parameter_(module, p_name, local, memo)
            else:
                memo[id(p)] = p
        _load_moe_blocks(model, reader, files, prefix, grid, device)
        _load_buffers(model, reader, files, prefix, device)
    return model


def _load_moe_blocks(
    model: nn.Module, reader: _Reader, files: dict[str, str], prefix: str, grid: Grid, device: torch.device
) -> None:
    """Fill every MoE block's router and experts with this rank's slices, from fused or per-expert
    checkpoint tensors (``axon4d.parallelize.moe_loading``)."""

    def find(tensor: str) -> str | None:
        try:
            return _resolve([tensor], files, prefix)
        except KeyError:
            return None

    for name, block in moe_blocks(model):
        for (module, p_name), reads in moe_loading.block_reads(name, block, find, grid).items():
            buffer = p_name in module._buffers  # DeepSeek-V3's routing bias
            p = module._buffers[p_name] if buffer else module._parameters[p_name]
            assert p is not None
            local = torch.empty(p.shape, dtype=p.dtype, device=device) if p.is_meta else p.detach()
            for r in reads:
                sl = reader.slice(r.tensor)
                if tuple(sl.get_shape()) != r.shape:
                    raise ValueError(
                        f"checkpoint tensor {r.tensor} has shape {tuple(sl.get_shape())}, the model needs {r.shape}"
                    )
                local[r.dest].copy_(sl[r.index])
            if p.is_meta and buffer:
                module._buffers[p_name] = local
            elif p.is_meta:
                tiled_init.replace_parameter_(module, p_name, local)


def _load_buffers(model: nn.Module, reader: _Reader, files: dict[str, str], prefix: str, device: torch.device) -> None:
    """Give every buffer on the meta device storage: read whole from the checkpoint when it is
    there, else recomputed by the model's ``_init_weights`` (Hugging Face's non-persistent buffers)."""
    recompute: list[tuple[str, nn.Module]] = []
    for mod_name, m in model.named_modules():
        for b_name, buf in list(m._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            name = f"{mod_name}.{b_name}" if mod_name else b_name
            m._buffers[b_name] = torch.empty_like(buf, device=device)
            try:
                found = _resolve([name], files, prefix)
            except KeyError:
                recompute.append((name, m))
                continue
            rows, cols = rectangles.matrix_shape(buf.shape)
            part = _block(found, tuple(buf.shape), (0, rows), (0, cols))[0]
            _read_into(m._buffers[b_name].view(rows, cols), reader, found, part, tuple(buf.shape), False)
    init_weights = getattr(model, "_init_weights", None)
    for name, m in recompute:
        if not callable(init_weights) or any(True for _ in m.parameters(recurse=False)):
            raise ValueError(
                f"buffer {name} is on the meta device and not in the checkpoint, and the model cannot "
                "recompute it; build the module holding it off the meta device"
            )
    for m in {id(m): m for _, m in recompute}.values():
        init_weights(m)  # type: ignore[misc]  # callable: checked above
