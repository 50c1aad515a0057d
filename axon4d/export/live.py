"""Export a live model by slices: ``save_pretrained_`` (docs/parallelize.md, "Exporting").

Every rank calls it; rank 0 writes. axon4d's ``Transformer`` exports as ``GPT2LMHeadModel`` /
``LlamaForCausalLM`` (``axon4d.models.hf``), a model ``auto_parallelize`` parallelized under the
names it had (GPT-2's ``Conv1D`` weights transposed back, packed q | k | v stacked back). One tensor
at a time, every rank writes the pieces it holds (``axon4d.layout.param_layout``; one replica of each) into
the zeroed buffer and one all-reduce over the world fills it (each element comes from one rank: the
sum is exact); rank 0 appends its bytes to the file (``axon4d.files.safetensors_files``). The buffer is
one, allocated once for the largest tensor and reused, so a process holds its shards plus one whole
tensor. A tensor left whole on every rank is written from rank 0's copy, with no collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from axon4d.export.output import (
    MAX_SHARD_SIZE,
    buffer_view,
    check_tokenizer,
    copy_tokenizer,
    make_partial,
    publish,
    write_config,
)
from axon4d.files import ckptfiles
from axon4d.files.safetensors_files import ShardedWriter, TensorSpec, parse_size
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import AXES
from axon4d.layout.param_layout import ParamLayout, param_layouts
from axon4d.models.hf import Exported, Source, hf_config, hf_tensors, stacked
from axon4d.models.transformer import Transformer
from axon4d.parallelize.layers import ShardedLinear, ShardedNorm
from axon4d.parallelize.moe import HF_TENSORS, moe_blocks, saved_sources
from axon4d.reliability.agreement import agree, on_rank0

# --- the plan: which tensors, from which pieces ---------------------------------------------------


def _parallelized_tensors(model: nn.Module) -> list[Exported]:
    """The tensors of a model ``auto_parallelize`` parallelized, under the names the model had:
    a ``ShardedLinear``'s and ``ShardedNorm``'s parameters under the module they replaced, an
    ``HFMoEBlock``'s as transformers keeps them (``axon4d.parallelize.moe.HF_TENSORS``)."""
    layouts = param_layouts(model)
    replaced: dict[int, tuple[str, nn.Module]] = {}  # id(inner module) → (the replaced module's name, wrapper)
    for name, m in model.named_modules():
        if isinstance(m, (ShardedLinear, ShardedNorm)):
            replaced[id(m.inner)] = (name, m)
    out = []
    blocks = [n for n, _ in moe_blocks(model)]
    moe_saved: dict[str, tuple[int, ...]] = {}  # the saved tensors of MoE blocks' router and experts
    for name, _ in model.named_parameters():  # a tied parameter once, under its first name
        if any(name.startswith(f"{b}.moe.") for b in blocks):
            moe_saved.update(layouts[name].saved_tensors(name))
            continue
        mod_name, _, p_name = name.rpartition(".")
        module = model.get_submodule(mod_name)
        dense, wrapper = replaced.get(id(module), (mod_name, None))
        conv1d = isinstance(wrapper, ShardedLinear) and wrapper.conv1d_class is not None and p_name == "weight"
        parts = list(layouts[name].saved_tensors(name).items())
        out.append(stacked(f"{dense}.{p_name}" if dense else p_name, parts, conv1d))
    buffers = []
    for name, buf in _persistent_buffers(model):
        if any(name.startswith(f"{b}.moe.") for b in blocks):  # DeepSeek-V3's routing bias: under the router's name
            moe_saved[name] = tuple(buf.shape)
        else:
            buffers.append(stacked(name, [(name, tuple(buf.shape))], False))
    for block in blocks:  # as transformers keeps them: fused [gate | up] experts, down, the router (its bias)
        for rel in HF_TENSORS:
            found = saved_sources(f"{block}.{rel}", moe_saved)
            if found is None and rel.endswith("e_score_correction_bias"):
                continue  # only DeepSeek-V3's blocks hold one
            assert found is not None  # every HFMoEBlock holds a router and gated experts
            keys, dim = found
            out.append(stacked(f"{block}.{rel}", [(k, moe_saved[k]) for k in keys], False, dim))
    return out + buffers


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer ``state_dict`` holds (not a non-persistent one)."""
    for mod_name, m in model.named_modules():
        for b_name, buf in m._buffers.items():
            if buf is not None and b_name not in m._non_persistent_buffers_set:
                yield (f"{mod_name}.{b_name}" if mod_name else b_name), buf


def _plan(model: nn.Module) -> tuple[Any, list[Exported]]:
    """(transformers config, exported tensors) of a live model."""
    if isinstance(model, Transformer):
        return hf_config(model.cfg), hf_tensors(model.cfg)
    config = getattr(model, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        return config, _parallelized_tensors(model)
    raise TypeError(
        f"save_pretrained_ exports axon4d's Transformer (GPT, Llama) or a Hugging Face model parallelized by "
        f"auto_parallelize (one with a transformers config); got a {type(model).__name__}"
    )


# --- gathering one tensor at a time ---------------------------------------------------------------


def _place(
    buffer: torch.Tensor, entry: Exported, source: Source, offsets: tuple[int, ...], piece: torch.Tensor
) -> None:
    """Copy ``piece``, the rectangle at ``offsets`` of ``source``, where it lies in ``buffer`` (the
    exported tensor: sources stacked along dim 0, (in, out) if ``entry.transposed``)."""
    index = [slice(o, o + n) for o, n in zip(offsets, piece.shape)]
    if index:
        d = source.dim
        index[d] = slice(index[d].start + source.row0, index[d].stop + source.row0)
    if entry.transposed:
        buffer[index[1], index[0]] = piece.t()
    else:
        buffer[tuple(index)] = piece


def _held_whole(entry: Exported, found: dict[str, tuple[str, torch.Tensor, ParamLayout]]) -> bool:
    """Whether ``entry`` is one parameter (or buffer) as it is, held whole on every rank."""
    source = found[entry.sources[0].key]
    return len(entry.sources) == 1 and not entry.transposed and source[2].replicated_over() == AXES


def _gathered(
    entry: Exported, found: dict[str, tuple[str, torch.Tensor, ParamLayout]], grid: Grid, scratch: torch.Tensor
) -> torch.Tensor | None:
    """The whole tensor ``entry`` on rank 0 (None elsewhere): a view of rank 0's own copy when one
    parameter holds it whole on every rank (no collective), else ``scratch`` (bytes enough for the
    largest tensor, the one buffer of the export) zeroed, filled by every rank with its pieces (one
    replica of each) and summed by one all-reduce over the world."""
    parts = [found[s.key] for s in entry.sources]
    if entry.scale != 1.0:  # scaled (exactly: a power of two) or, at 0, zeros read from nothing
        if entry.scale == 0.0:
            return buffer_view(scratch, entry.shape, parts[0][1].dtype).zero_() if grid.rank == 0 else None
        t = _gathered(dataclasses.replace(entry, scale=1.0), found, grid, scratch)
        if t is None:
            return None
        if t.data_ptr() != scratch.data_ptr():  # rank 0's own parameter: not to be scaled in place
            t = buffer_view(scratch, entry.shape, t.dtype).copy_(t)
        return t.mul_(entry.scale)
    if _held_whole(entry, found):
        return parts[0][1].detach().view(entry.shape) if grid.rank == 0 else None
    buffer = buffer_view(scratch, entry.shape, parts[0][1].dtype).zero_()
    for source, (name, t, layout) in zip(entry.sources, parts):
        if any(grid.coord(a) for a in layout.replicated_over()):
            continue  # another rank holds the same piece
        for box, view in layout.views(name, t, grid):
            if box.key == source.key:
                _place(buffer, entry, source, box.offsets, view)
    if any(layout.replicated_over() != AXES for _, _, layout in parts):
        grid.comm.all_reduce(buffer, "world", tag="export").wait()
    return buffer if grid.rank == 0 else None


def _lookup(model: nn.Module, plan: list[Exported]) -> dict[str, tuple[str, torch.Tensor, ParamLayout]]:
    """{source key: (parameter or buffer name, the tensor, its layout)} for every source of ``plan``."""
    layouts = param_layouts(model)
    out: dict[str, tuple[str, torch.Tensor, ParamLayout]] = {}
    for name, p in model.named_parameters():
        for key in layouts[name].saved_tensors(name):
            out[key] = (name, p, layouts[name])
    for name, buf in _persistent_buffers(model):
        out[name] = (name, buf, ParamLayout(tuple(buf.shape)))
    missing = [s.key for e in plan for s in e.sources if s.key not in out]
    if missing:
        raise ValueError(f"the model has no tensor {missing[0]!r} that the export needs ({len(missing)} missing)")
    for e in plan:
        dtypes = {out[s.key][1].dtype for s in e.sources}
        if len(dtypes) != 1:
            raise ValueError(f"{e.name} stacks tensors of dtypes {sorted(map(str, dtypes))}; they must share one")
    return out


@torch.no_grad()
def save_pretrained_(
    model: nn.Module,
    out_dir: str,
    grid: Grid | None = None,
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    tokenizer: str | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write ``model`` to ``out_dir`` in Hugging Face's format, one whole tensor at a time; every
    rank calls it (all-reduces over the world) and rank 0 writes. Returns the files written (on
    rank 0; [] elsewhere).

    ``model`` is axon4d's ``Transformer`` (exported as ``GPT2LMHeadModel`` / ``LlamaForCausalLM``)
    or a Hugging Face model parallelized by ``auto_parallelize`` (exported under its own names).
    Shards hold at most ``max_shard_size`` (bytes, or "5GB"); ``tokenizer``: a directory whose
    tokenizer files are copied along. A non-empty ``out_dir`` is refused unless ``overwrite``; a
    refusal or a failed write raises the same error on every rank.
    """
    grid = runtime.resolve(grid)
    err: BaseException | None = None
    plan: list[Exported] = []
    found: dict[str, tuple[str, torch.Tensor, ParamLayout]] = {}
    try:
        if tokenizer is not None:
            check_tokenizer(tokenizer)
        config, plan = _plan(model)
        found = _lookup(model, plan)
        specs = [TensorSpec(e.name, e.shape, found[e.sources[0].key][1].dtype) for e in plan]
        writer = ShardedWriter(ckptfiles.partial_path(out_dir), specs, parse_size(max_shard_size))  # rank 0 writes
    except Exception as e:  # the same on every rank: every rank raises it, before any collective
        err = e
    agree(grid, err, f"planning the export to {out_dir}")
    agree(grid, on_rank0(grid, lambda: make_partial(out_dir, overwrite)), f"preparing {out_dir}")
    gathered = [spec.nbytes for e, spec in zip(plan, specs) if e.scale != 1.0 or not _held_whole(e, found)]
    device = next(iter(found.values()))[1].device if found else grid.device
    scratch = torch.empty(max(gathered, default=0), dtype=torch.uint8, device=device)  # the one buffer of the export
    for entry in plan:  # every rank gathers every tensor, so a failed write on rank 0 cannot hang the others
        t = _gathered(entry, found, grid, scratch)
        if t is not None and err is None:  # rank 0
            try:
                writer.write(entry.name, t)
            except Exception as e:
                err = e
    written: list[str] = []

    def finish() -> None:
        if err is not None:
            writer.discard()
            raise err
        written.extend(writer.close())
        written.extend(write_config(config, writer.directory, specs[0].dtype if specs else torch.float32))
        if tokenizer is not None:
            written.extend(copy_tokenizer(tokenizer, writer.directory))
        publish(writer.directory, out_dir)

    agree(grid, on_rank0(grid, finish), f"writing {out_dir}")
    return written
