"""Export to Hugging Face format by slices: ``save_pretrained_`` and ``axon4d export-hf``.

What ``save_pretrained`` writes — ``config.json``, ``model.safetensors`` (or shards of at most
``max_shard_size`` and ``model.safetensors.index.json``) and the tokenizer's files — from a model
no process holds whole (docs/parallelize.md, "Exporting"):

- **A live model** (``save_pretrained_(model, out_dir)``, every rank calls it): axon4d's
  ``Transformer`` exports as ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (``axon4d.models.hf``), a
  model ``auto_parallelize`` parallelized under its own names (GPT-2's ``Conv1D`` weights
  transposed back, packed q | k | v stacked back). One tensor at a time, every rank writes the
  pieces it holds (``axon4d.param_layout``; one replica of each) into the zeroed buffer and one
  all-reduce over the world fills it (each element comes from one rank: the sum is exact); rank 0
  appends its bytes to the file (``axon4d.safetensors_files``). The buffer is one, allocated once
  for the largest tensor and reused, so a process holds its shards plus one whole tensor. A
  tensor left whole on every rank is written from rank 0's copy, with no collective.
- **A checkpoint** (``export_checkpoint(path, out_dir)``; ``axon4d export-hf CHECKPOINT OUT``): one
  process, no process group. After the checks a load makes (meta.json, checksums, DCP's index read
  without running code from it), DCP reads each tensor whole, one at a time, straight into the
  one buffer it is written from. The model is axon4d's Transformer (meta.json's model_config) or
  the Hugging Face model ``axon4d train --hf`` fine-tuned (its ``hf_path``: the model is built on the
  meta device from its config, and its tokenizer files come along).

The export is written into a hidden sibling directory and renamed into place at the end: an
interrupted export leaves no half-written model at ``out_dir``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from axon4d import ckptfiles, runtime
from axon4d.checkpoint import _agree, _on_rank0
from axon4d.config import ModelConfig
from axon4d.grid import Grid
from axon4d.models.hf import Exported, Source, hf_config, hf_tensors, stacked
from axon4d.models.transformer import Transformer
from axon4d.parallelize.layers import ShardedLinear, ShardedNorm, is_conv1d
from axon4d.param_layout import ParamLayout, param_layouts
from axon4d.safetensors_files import ShardedWriter, TensorSpec, parse_size
from axon4d.shape import AXES

#: transformers' default shard size
MAX_SHARD_SIZE = "5GB"

#: the files a Hugging Face tokenizer is saved as (whichever of them a directory holds are copied)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


# --- the plan: which tensors, from which pieces ---------------------------------------------------


def _parallelized_tensors(model: nn.Module) -> list[Exported]:
    """The tensors of a model ``auto_parallelize`` parallelized, under the names the model had:
    a ``ShardedLinear``'s and ``ShardedNorm``'s parameters under the module they replaced."""
    layouts = param_layouts(model)
    replaced: dict[int, tuple[str, nn.Module]] = {}  # id(inner module) → (the replaced module's name, wrapper)
    for name, m in model.named_modules():
        if isinstance(m, (ShardedLinear, ShardedNorm)):
            replaced[id(m.inner)] = (name, m)
    out = []
    for name, _ in model.named_parameters():  # a tied parameter once, under its first name
        mod_name, _, p_name = name.rpartition(".")
        module = model.get_submodule(mod_name)
        dense, wrapper = replaced.get(id(module), (mod_name, None))
        conv1d = isinstance(wrapper, ShardedLinear) and wrapper.conv1d_class is not None and p_name == "weight"
        parts = list(layouts[name].saved_tensors(name).items())
        out.append(stacked(f"{dense}.{p_name}" if dense else p_name, parts, conv1d))
    for name, buf in _persistent_buffers(model):
        out.append(stacked(name, [(name, tuple(buf.shape))], False))
    return out


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
        index[0] = slice(index[0].start + source.row0, index[0].stop + source.row0)
    if entry.transposed:
        buffer[index[1], index[0]] = piece.t()
    else:
        buffer[tuple(index)] = piece


def _held_whole(entry: Exported, found: dict[str, tuple[str, torch.Tensor, ParamLayout]]) -> bool:
    """Whether ``entry`` is one parameter (or buffer) as it is, held whole on every rank."""
    source = found[entry.sources[0].key]
    return len(entry.sources) == 1 and not entry.transposed and source[2].replicated_over() == AXES


def _on(scratch: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on the first bytes of the byte buffer ``scratch``."""
    return scratch[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def _gathered(
    entry: Exported, found: dict[str, tuple[str, torch.Tensor, ParamLayout]], grid: Grid, scratch: torch.Tensor
) -> torch.Tensor | None:
    """The whole tensor ``entry`` on rank 0 (None elsewhere): a view of rank 0's own copy when one
    parameter holds it whole on every rank (no collective), else ``scratch`` (bytes enough for the
    largest tensor, the one buffer of the export) zeroed, filled by every rank with its pieces (one
    replica of each) and summed by one all-reduce over the world."""
    parts = [found[s.key] for s in entry.sources]
    if _held_whole(entry, found):
        return parts[0][1].detach().view(entry.shape) if grid.rank == 0 else None
    buffer = _on(scratch, entry.shape, parts[0][1].dtype).zero_()
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


# --- the output directory -------------------------------------------------------------------------


def _check_out(out_dir: str, overwrite: bool) -> None:
    """Refuse an ``out_dir`` that is a file, or a directory that is not empty without ``overwrite``."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory; give a directory to export into")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty ({len(os.listdir(out_dir))} entries); an export never mixes with "
            "other files: give a new or empty directory, or pass --overwrite (overwrite=True) to replace it"
        )


def _start(out_dir: str, overwrite: bool) -> str:
    """Check ``out_dir`` and create the empty hidden directory the export is written into."""
    _check_out(out_dir, overwrite)
    partial = ckptfiles.partial_path(out_dir)
    shutil.rmtree(partial, ignore_errors=True)  # the leftovers of an interrupted export
    os.makedirs(partial)
    return partial


def _publish(partial: str, out_dir: str) -> None:
    """Put the finished export at ``out_dir`` in one rename (replacing what was there)."""
    out_dir = os.path.abspath(out_dir)
    ckptfiles.fsync_dir(partial)
    replaced = None
    if os.path.exists(out_dir):
        replaced = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(out_dir, replaced)
    os.rename(partial, out_dir)
    ckptfiles.fsync_dir(os.path.dirname(out_dir))
    if replaced is not None:
        shutil.rmtree(replaced)


def _check_tokenizer(source: str) -> None:
    if not os.path.isdir(source):
        raise FileNotFoundError(
            f"tokenizer directory {source} does not exist; give the directory a tokenizer was saved to "
            "(tokenizer.save_pretrained), or none"
        )


def copy_tokenizer(source: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files (``TOKENIZER_FILES``) that directory ``source`` holds into
    ``out_dir``; the names copied."""
    _check_tokenizer(source)
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))]
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    return names


def _write_config(config: Any, out_dir: str, dtype: torch.dtype) -> list[str]:
    """Write ``config.json`` (a copy of ``config``, for weights of ``dtype``) and the generation
    defaults it implies (``generation_config.json``, as ``save_pretrained`` writes for a causal LM)."""
    from transformers import GenerationConfig  # an optional dependency

    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    return ["config.json", "generation_config.json"]


# --- the two entry points -------------------------------------------------------------------------


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
            _check_tokenizer(tokenizer)
        config, plan = _plan(model)
        found = _lookup(model, plan)
        specs = [TensorSpec(e.name, e.shape, found[e.sources[0].key][1].dtype) for e in plan]
        writer = ShardedWriter(ckptfiles.partial_path(out_dir), specs, parse_size(max_shard_size))  # rank 0 writes
    except Exception as e:  # the same on every rank: every rank raises it, before any collective
        err = e
    _agree(grid, err, f"planning the export to {out_dir}")
    _agree(grid, _on_rank0(grid, lambda: _start(out_dir, overwrite)), f"preparing {out_dir}")
    gathered = [spec.nbytes for e, spec in zip(plan, specs) if not _held_whole(e, found)]
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
        written.extend(_write_config(config, writer.directory, specs[0].dtype if specs else torch.float32))
        if tokenizer is not None:
            written.extend(copy_tokenizer(tokenizer, writer.directory))
        _publish(writer.directory, out_dir)

    _agree(grid, _on_rank0(grid, finish), f"writing {out_dir}")
    return written


def _checked_index(path: str, meta: dict[str, Any]) -> dcp.Metadata:
    """DCP's index of the checkpoint at ``path`` (whose meta.json is ``meta``) after a load's checks:
    the index read without running code from it, its shards present, every file's checksum."""
    files = meta.get("files")
    if files is not None:
        ckptfiles.verify(path, files, [ckptfiles.DCP_INDEX])
    index = ckptfiles.read_index(path)
    shards = ckptfiles.check_shards(path, index, files)
    if files is not None:
        ckptfiles.verify(path, files, shards)
    return index


def recorded_hf_path(meta: dict[str, Any]) -> str | None:
    """The Hugging Face directory a run recorded in its checkpoint's meta.json (``hf_path``: the
    model ``axon4d train --hf`` fine-tuned: its config, and the tokenizer an export copies); None
    if none."""
    train = meta.get("train_config")
    train = train if isinstance(train, dict) else {}
    for value in (meta.get("hf_path"), train.get("hf_path"), train.get("hf")):  # the extra, or the --hf flag
        if isinstance(value, str) and value:
            return value
    return None


#: the stacking order of fused rows' segments (``rectangles.FusedRows``) in axon4d: attention's and
#: GPT-2's packed q | k | v, SwiGLU's gate | up
SEGMENTS = ("q", "k", "v", "gate", "up")


def _hf_checkpoint_tensors(path: str, hf_path: str, saved: dict[str, tuple[int, ...]]) -> tuple[Any, list[Exported]]:
    """(config, exported tensors) of the checkpoint at ``path`` of the Hugging Face model in
    ``hf_path`` parallelized by ``auto_parallelize``, whose checkpoint holds ``saved`` ({name: global
    shape}): each parameter of the model (built on the meta device) under its own name, or under
    ``<module>.inner.<name>`` where a ``ShardedLinear`` or ``ShardedNorm`` replaced its module (its
    fused segments stacked back; a ``Conv1D`` weight transposed back)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # an optional dependency

    config = AutoConfig.from_pretrained(hf_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = []
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        mod_name, _, p_name = name.rpartition(".")
        wrapped = f"{mod_name}.inner.{p_name}"
        segments = [k for k in saved if k.startswith(f"{wrapped}.")]
        if name in saved or wrapped in saved:
            keys = [name if name in saved else wrapped]
        elif segments and all(k.rpartition(".")[2] in SEGMENTS for k in segments):
            keys = sorted(segments, key=lambda k: SEGMENTS.index(k.rpartition(".")[2]))
        else:
            raise ValueError(
                f"{path} holds no tensor for {name} of the model in {hf_path} (neither model.{name} nor "
                f"model.{wrapped}): the checkpoint is not of that model"
            )
        transposed = keys[0] != name and is_conv1d(model.get_submodule(mod_name)) and p_name == "weight"
        entry = stacked(name, [(k, saved[k]) for k in keys], transposed)
        if entry.shape != tuple(p.shape):
            raise ValueError(
                f"{path} holds {name} as {[saved[k] for k in keys]}, which make {entry.shape}; the model in {hf_path} "
                f"has {tuple(p.shape)}: the checkpoint is not of that model"
            )
        out.append(entry)
    return config, out


def _checkpoint_plan(path: str, meta: dict[str, Any], saved: dict[str, tuple[int, ...]]) -> tuple[Any, list[Exported]]:
    """(transformers config, exported tensors) of the checkpoint at ``path``: of axon4d's
    Transformer (meta.json's model_config), or of the Hugging Face model the run fine-tuned (its
    ``hf_path``)."""
    if isinstance(meta.get("model_config"), dict):
        cfg = ModelConfig(**meta["model_config"])
        return hf_config(cfg), hf_tensors(cfg)
    hf_path = recorded_hf_path(meta)
    if hf_path is None:
        raise ValueError(
            f"{path}/meta.json records neither a model_config (axon4d's Transformer) nor an hf_path (a Hugging Face "
            "model fine-tuned by axon4d train --hf): there is no model to export"
        )
    if not os.path.isdir(hf_path):
        raise FileNotFoundError(
            f"{path} is a fine-tune of the Hugging Face model in {hf_path}, which is gone: its config.json says what "
            "the model is; restore the directory"
        )
    return _hf_checkpoint_tensors(path, hf_path, saved)


def export_checkpoint(
    path: str,
    out_dir: str,
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    tokenizer: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write the model of axon4d checkpoint ``path`` to ``out_dir`` in Hugging Face's format, in
    this process alone (no process group): each tensor is read whole from the checkpoint (DCP)
    into the export's one buffer, written, and overwritten by the next. The checkpoint is of axon4d's
    Transformer, or of a Hugging Face model ``axon4d train --hf`` fine-tuned (meta.json's
    ``hf_path``). ``tokenizer``: a directory whose tokenizer files are copied along (default: the
    ``hf_path`` the run recorded, if it still exists). ``progress`` is called after each tensor
    with its bytes and the bytes of them all. Returns the files written."""
    _check_out(out_dir, overwrite)
    limit = parse_size(max_shard_size)
    meta = ckptfiles.read_meta(path)
    if tokenizer is None:
        recorded = recorded_hf_path(meta)
        tokenizer = recorded if recorded is not None and os.path.isdir(recorded) else None
    else:
        _check_tokenizer(tokenizer)  # before anything is written
    if isinstance(meta.get("model_config"), dict):  # a shape no export has is refused before the checksums
        hf_tensors(ModelConfig(**meta["model_config"]))
    index = _checked_index(path, meta)
    entries = {  # the model's tensors (read_index admits only tensors)
        k[len("model.") :]: md
        for k, md in index.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, dcp.TensorStorageMetadata)
    }
    saved = {k: tuple(md.size) for k, md in entries.items()}
    config, plan = _checkpoint_plan(path, meta, saved)
    specs = []
    for e in plan:
        for s in e.sources:
            if saved.get(s.key) != s.shape:
                got = "no such tensor" if s.key not in saved else f"shape {saved[s.key]}"
                raise ValueError(
                    f"{path} holds model.{s.key} with {got}, its model_config needs {s.shape}: the checkpoint does "
                    "not match its meta.json"
                )
        dtypes = {entries[s.key].properties.dtype for s in e.sources}
        if len(dtypes) != 1:
            raise ValueError(f"{e.name} stacks tensors of dtypes {sorted(map(str, dtypes))} in {path}")
        specs.append(TensorSpec(e.name, e.shape, dtypes.pop()))
    partial = _start(out_dir, overwrite)
    writer = ShardedWriter(partial, specs, limit)
    total = sum(spec.nbytes for spec in specs)
    scratch = torch.empty(max(spec.nbytes for spec in specs), dtype=torch.uint8)  # the one buffer of the export
    for entry, spec in zip(plan, specs):
        buffer = _on(scratch, spec.shape, spec.dtype)
        for s in entry.sources:
            end = s.row0 + s.shape[0]
            rows = buffer[:, s.row0 : end].t() if entry.transposed else buffer[s.row0 : end]  # s's global shape
            with warnings.catch_warnings():  # that it loads in one process, as asked
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load({f"model.{s.key}": rows}, storage_reader=ckptfiles.SafeReader(path), no_dist=True)
        writer.write(entry.name, buffer)
        if progress is not None:
            progress(spec.nbytes, total)
    written = writer.close()
    written.extend(_write_config(config, partial, specs[0].dtype))
    if tokenizer is not None:
        written.extend(copy_tokenizer(tokenizer, partial))
    _publish(partial, out_dir)
    return written


# --- axon4d export-hf -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="an axon4d checkpoint directory (step_<N>, with meta.json)")
    parser.add_argument("out", help="the directory to write the Hugging Face model into (new or empty)")
    parser.add_argument(
        "--max-shard-size", default=MAX_SHARD_SIZE, help="largest safetensors file (default %(default)s; e.g. 500MB)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a directory whose tokenizer files to copy (default: the run's --hf model's)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a refused input")


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        meta = ckptfiles.read_meta(args.checkpoint)
        print(f"checking {args.checkpoint} (step {meta['step']}): meta.json, DCP's index, every file's checksum")
        with tqdm(unit="B", unit_scale=True, desc=f"writing {args.out}", file=sys.stdout, mininterval=1.0) as bar:

            def advance(nbytes: int, total: int) -> None:
                bar.total = total
                bar.update(nbytes)

            written = export_checkpoint(
                args.checkpoint,
                args.out,
                max_shard_size=args.max_shard_size,
                tokenizer=args.tokenizer,
                overwrite=args.overwrite,
                progress=advance,
            )
    except (ValueError, TypeError, OSError, ckptfiles.CheckpointError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"axon4d export-hf: error: {e}", file=sys.stderr)
        return 2
    shards = [n for n in written if n.endswith(".safetensors")]
    rest = [n for n in written if n not in shards]
    print(f"wrote {args.out}: {len(shards)} safetensors file{'s' * (len(shards) > 1)}, {', '.join(rest)}")
    return 0
