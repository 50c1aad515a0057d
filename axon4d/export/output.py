"""The output of an export (axon4d.export): the directory it is written into and published from,
the config, the tokenizer's files, and the one buffer each tensor passes through.

An export is written into a hidden sibling of its directory (``make_partial``) and renamed into
place when complete (``publish``): an interrupted export leaves no half-written model where one is
expected, and a directory that is not empty is refused unless it is to be replaced.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
from typing import Any

import torch

from axon4d.files import ckptfiles

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


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse an ``out_dir`` that is a file, or a directory that is not empty without ``overwrite``."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory; give a directory to export into")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty ({len(os.listdir(out_dir))} entries); an export never mixes with "
            "other files: give a new or empty directory, or pass --overwrite (overwrite=True) to replace it"
        )


def make_partial(out_dir: str, overwrite: bool) -> str:
    """Check ``out_dir`` and create the empty hidden directory the export is written into."""
    check_out_dir(out_dir, overwrite)
    partial = ckptfiles.partial_path(out_dir)
    shutil.rmtree(partial, ignore_errors=True)  # the leftovers of an interrupted export
    os.makedirs(partial)
    return partial


def publish(partial: str, out_dir: str) -> None:
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


def check_tokenizer(source: str) -> None:
    """Refuse a tokenizer directory that does not exist."""
    if not os.path.isdir(source):
        raise FileNotFoundError(
            f"tokenizer directory {source} does not exist; give the directory a tokenizer was saved to "
            "(tokenizer.save_pretrained), or none"
        )


def copy_tokenizer(source: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files (``TOKENIZER_FILES``) that directory ``source`` holds into
    ``out_dir``; the names copied."""
    check_tokenizer(source)
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))]
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    return names


def write_config(config: Any, out_dir: str, dtype: torch.dtype) -> list[str]:
    """Write ``config.json`` (a copy of ``config``, for weights of ``dtype``) and the generation
    defaults it implies (``generation_config.json``, as ``save_pretrained`` writes for a causal LM)."""
    from transformers import GenerationConfig  # an optional dependency

    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    return ["config.json", "generation_config.json"]


def buffer_view(scratch: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on the first bytes of the byte buffer ``scratch``."""
    return scratch[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
