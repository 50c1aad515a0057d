"""Export a checkpoint by slices, in one process: ``export_checkpoint`` (``axon4d export-hf``).

No process group: after the checks a load makes (meta.json, checksums, DCP's index read without
running code from it), DCP reads each tensor whole, one at a time, straight into the one buffer it
is written from (``axon4d.export.output``). The model is axon4d's Transformer (meta.json's
model_config) or the Hugging Face model ``axon4d train --hf`` fine-tuned (its ``hf_path``: the model
is built on the meta device from its config, and its tokenizer files come along).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from axon4d.config import ModelConfig
from axon4d.export.output import (
    MAX_SHARD_SIZE,
    buffer_view,
    check_out_dir,
    check_tokenizer,
    copy_tokenizer,
    make_partial,
    publish,
    write_config,
)
from axon4d.files import ckptfiles, ckptindex
from axon4d.files.safetensors_files import ShardedWriter, TensorSpec, parse_size
from axon4d.models.hf import Exported, hf_config, hf_tensors, stacked
from axon4d.parallelize.layers import is_conv1d
from axon4d.parallelize.moe import saved_sources


def _checked_index(path: str, meta: dict[str, Any]) -> dcp.Metadata:
    """DCP's index of the checkpoint at ``path`` (whose meta.json is ``meta``) after a load's checks:
    the index read without running code from it, its shards present, every file's checksum."""
    files = meta.get("files")
    if files is not None:
        ckptfiles.verify(path, files, [ckptfiles.DCP_INDEX])
    index = ckptindex.read_index(path)
    shards = ckptindex.check_shards(path, index, files)
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


#: where ``axon4d train --hf`` keeps the model in its checkpoints: model.module.<name>
JOB_PREFIX = "module."


def _hf_checkpoint_tensors(
    path: str, hf_path: str, saved: dict[str, tuple[int, ...]], prefix: str = ""
) -> tuple[Any, list[Exported]]:
    """(config, exported tensors) of the checkpoint at ``path`` of the Hugging Face model in
    ``hf_path`` parallelized by ``auto_parallelize``, whose checkpoint holds ``saved`` ({name: global
    shape}): each parameter of the model (built on the meta device) under its own name, or under
    ``<module>.inner.<name>`` where a ``ShardedLinear`` or ``ShardedNorm`` replaced its module (its
    fused segments stacked back; a ``Conv1D`` weight transposed back); ``prefix``: what the saved names
    carry before the model's own (``JOB_PREFIX`` for the training job's checkpoints)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # an optional dependency

    config = AutoConfig.from_pretrained(hf_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = []
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        mod_name, _, p_name = name.rpartition(".")
        wrapped = f"{mod_name}.inner.{p_name}"
        segments = [k for k in saved if k.startswith(f"{wrapped}.")]
        moe = saved_sources(name, saved)  # a tensor of an MoE block: the grid MoE layer's tensors
        if moe is not None:
            out.append(stacked(name, [(prefix + k, saved[k]) for k in moe[0]], False, moe[1]))
            continue
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
        entry = stacked(name, [(prefix + k, saved[k]) for k in keys], transposed)
        if entry.shape != tuple(p.shape):
            raise ValueError(
                f"{path} holds {name} as {[saved[k] for k in keys]}, which make {entry.shape}; the model in {hf_path} "
                f"has {tuple(p.shape)}: the checkpoint is not of that model"
            )
        out.append(entry)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name in model.state_dict():  # saved buffers: an MoE block's routing bias (DeepSeek-V3's)
        moe = saved_sources(name, saved) if name not in params else None
        if moe is not None:
            out.append(stacked(name, [(prefix + k, saved[k]) for k in moe[0]], False, moe[1]))
    return config, out


def _checkpoint_plan(path: str, meta: dict[str, Any], saved: dict[str, tuple[int, ...]]) -> tuple[Any, list[Exported]]:
    """(transformers config, exported tensors) of the checkpoint at ``path``: of axon4d's
    Transformer (meta.json's model_config), or of the Hugging Face model the run fine-tuned (its
    ``hf_path``; such a run records a model_config too, for its FLOPs and checks, and keeps the model
    under ``JOB_PREFIX``)."""
    hf_path = recorded_hf_path(meta)
    job = bool(saved) and all(k.startswith(JOB_PREFIX) for k in saved)  # axon4d train --hf's checkpoint
    if not job and isinstance(meta.get("model_config"), dict):
        cfg = ModelConfig(**meta["model_config"])
        return hf_config(cfg), hf_tensors(cfg)
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
    # the training job keeps the Hugging Face model as the .module of its wrapper (axon4d.train.hf)
    if job:
        return _hf_checkpoint_tensors(path, hf_path, {k[len(JOB_PREFIX) :]: v for k, v in saved.items()}, JOB_PREFIX)
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
    check_out_dir(out_dir, overwrite)
    limit = parse_size(max_shard_size)
    meta = ckptfiles.read_meta(path)
    if tokenizer is None:
        recorded = recorded_hf_path(meta)
        tokenizer = recorded if recorded is not None and os.path.isdir(recorded) else None
    else:
        check_tokenizer(tokenizer)  # before anything is written
    if isinstance(meta.get("model_config"), dict) and recorded_hf_path(meta) is None:  # refused before the checksums
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
    partial = make_partial(out_dir, overwrite)
    writer = ShardedWriter(partial, specs, limit)
    total = sum(spec.nbytes for spec in specs)
    scratch = torch.empty(max(spec.nbytes for spec in specs), dtype=torch.uint8)  # the one buffer of the export
    for entry, spec in zip(plan, specs):
        buffer = buffer_view(scratch, spec.shape, spec.dtype)
        if entry.scale == 0.0:  # zeros: the sources gave the dtype only
            buffer.zero_()
        for s in entry.sources if entry.scale != 0.0 else ():
            end = s.row0 + s.shape[s.dim]
            if entry.transposed:
                rows = buffer[:, s.row0 : end].t()
            else:  # s's global shape
                rows = buffer.narrow(s.dim, s.row0, end - s.row0)
            with warnings.catch_warnings():  # that it loads in one process, as asked
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load({f"model.{s.key}": rows}, storage_reader=ckptindex.SafeReader(path), no_dist=True)
        if entry.scale not in (0.0, 1.0):
            buffer.mul_(entry.scale)
        writer.write(entry.name, buffer)
        if progress is not None:
            progress(spec.nbytes, total)
    written = writer.close()
    written.extend(write_config(config, partial, specs[0].dtype))
    if tokenizer is not None:
        written.extend(copy_tokenizer(tokenizer, partial))
    publish(partial, out_dir)
    return written
