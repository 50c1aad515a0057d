"""``axon4d prepare-data``: text tokenized by a Hugging Face tokenizer into the token file that
``axon4d train --data`` reads.

    axon4d prepare-data --tokenizer runs/llama corpus.txt build/corpus.u32
    axon4d prepare-data --tokenizer runs/llama --field text chats.jsonl build/chats.u16

The tokenizer is ``transformers.AutoTokenizer.from_pretrained(PATH)`` of a directory that
``save_pretrained`` wrote (nothing is downloaded). A document is a blank-line-separated paragraph of
a .txt file (``--split blank``, the default) or one of its lines (``--split line``), or the
``--field`` string of each line of a .jsonl file. Each document is tokenized as the tokenizer does
by default (a Llama tokenizer puts BOS first) and followed by the tokenizer's EOS.

The output is the raw token ids, the format of ``axon4d.data.tokens`` (``MemmapTokens``): uint16 for a
.u16 name, uint32 for .u32 (``axon4d.data.tokens.TOKEN_SUFFIXES``). A vocabulary of more than 65,536 ids
needs .u32. The input is read as a stream, a batch of documents at a time, so the corpus is never
held whole; the ids are written to ``OUT.partial``, which is renamed to ``OUT`` once it is complete.
A progress bar counts the bytes read, and a last line gives the documents, tokens and file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from axon4d.data.tokens import TOKEN_SUFFIXES, token_dtype

#: how a .txt file is cut into documents
SPLITS = ("blank", "line")
#: the input file name endings it reads
INPUT_SUFFIXES = (".txt", ".jsonl")
#: documents are tokenized in batches of about this many characters
BATCH_CHARS = 1 << 20
#: the most token ids a uint16 file holds
UINT16_IDS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What ``prepare`` wrote."""

    path: str
    documents: int
    tokens: int
    dtype: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``axon4d prepare-data``."""
    p.add_argument("input", help="the text: a .txt file, or a .jsonl file with one JSON object per line")
    p.add_argument(
        "output",
        help="the token file to write: NAME.u16 (uint16, vocabularies up to 65,536 ids) or NAME.u32 (uint32)",
    )
    p.add_argument(
        "--tokenizer", required=True, help="a directory save_pretrained wrote with the model's tokenizer files"
    )
    p.add_argument("--field", default="text", help="the string field of each .jsonl object (default: text)")
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="blank",
        help="a .txt document: each paragraph between blank lines (blank, the default) or each line (line)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")


def main(args: argparse.Namespace) -> int:
    """Prepare the token file (a refused input raises: the ``axon4d`` command prints its one message
    and exits with status 2, ``axon4d.reliability.errors``)."""
    done = prepare(
        args.input,
        args.output,
        args.tokenizer,
        field=args.field,
        split=args.split,
        overwrite=args.overwrite,
        progress=args.progress,
    )
    print(f"prepare-data: {done.documents:,} documents, {done.tokens:,} tokens ({done.dtype}) -> {done.path}")
    return 0


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` of a local directory, with an EOS token; ``ValueError``
    (``FileNotFoundError`` for a missing directory) naming what is wrong."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--tokenizer {path!r} is not a directory; give the directory a tokenizer (or a model with its "
            "tokenizer) was saved to with save_pretrained"
        )
    from transformers import AutoTokenizer  # an optional dependency: only this command needs it

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"--tokenizer {path!r}: transformers found no tokenizer there ({first}); give a directory holding "
            "tokenizer.json or the tokenizer files save_pretrained writes"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer {path!r} has no EOS token, which separates the documents; set one "
            "(tokenizer.eos_token = ...) and save the tokenizer again"
        )
    tokenizer.model_max_length = sys.maxsize  # documents are not cut (and no length warning is printed)
    return tokenizer


def output_dtype(path: str, vocab: int, overwrite: bool) -> str:
    """The element type the name ``path`` asks for, checked: a known ending (``TOKEN_SUFFIXES``),
    room for ``vocab`` ids, and no existing file unless ``overwrite``."""
    suffix = os.path.splitext(path)[1]
    if suffix not in TOKEN_SUFFIXES:
        raise ValueError(
            f"output {path!r}: the name must end in {', '.join(TOKEN_SUFFIXES)}, which says the element type "
            f"the training job reads; e.g. {os.path.splitext(path)[0]}.u32"
        )
    dtype = token_dtype(path)
    if dtype == "uint16" and vocab > UINT16_IDS:
        raise ValueError(
            f"output {path!r} is a uint16 file, but the tokenizer has {vocab:,} token ids (uint16 holds "
            f"{UINT16_IDS:,}); name it {os.path.splitext(path)[0]}.u32"
        )
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"output {path!r} exists; pass --overwrite to replace it, or give another name")
    return dtype


def _check_input(path: str) -> str:
    """The input's kind ("txt" or "jsonl"), checked to exist."""
    suffix = os.path.splitext(path)[1]
    if suffix not in INPUT_SUFFIXES:
        raise ValueError(f"input {path!r}: give a {' or '.join(INPUT_SUFFIXES)} file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input {path!r} does not exist (or is not a file)")
    return suffix[1:]


def documents(f: BinaryIO, kind: str, split: str, field: str, bar: tqdm) -> Iterator[str]:
    """The documents of the open input ``f`` (module docstring), read line by line; ``bar`` counts
    the bytes read. ``ValueError`` names the line of a bad UTF-8 or JSON line."""
    paragraph: list[str] = []
    for number, raw in enumerate(f, 1):
        bar.update(len(raw))
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"input line {number} is not UTF-8 ({e.reason} at byte {e.start})") from None
        if kind == "jsonl":
            if line.strip():
                yield _field(line, number, field)
        elif split == "line":
            if line.strip():
                yield line.rstrip("\r\n")
        elif line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\r\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _field(line: str, number: int, field: str) -> str:
    """The ``field`` string of JSON line ``number``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"input line {number} is not JSON ({e.msg}, column {e.colno})") from None
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"input line {number} has no string field {field!r} (it holds: {keys}); give the field with --field"
        )
    return value


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    """``docs`` in lists of about ``BATCH_CHARS`` characters."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def prepare(
    input_path: str,
    output: str,
    tokenizer_path: str,
    *,
    field: str = "text",
    split: str = "blank",
    overwrite: bool = False,
    progress: bool = True,
) -> Prepared:
    """Tokenize the documents of ``input_path`` with the tokenizer saved in ``tokenizer_path``, each
    followed by EOS, into the token file ``output`` (module docstring). Every input is checked before
    anything is written; a failure midway leaves no ``output``."""
    if split not in SPLITS:
        raise ValueError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    kind = _check_input(input_path)
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = output_dtype(output, len(tokenizer), overwrite)
    eos = int(tokenizer.eos_token_id)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    partial = output + ".partial"
    n_docs = n_tokens = 0
    bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True, desc="prepare-data", disable=not progress)
    try:
        with open(input_path, "rb") as f, open(partial, "wb") as out:
            for batch in _batches(documents(f, kind, split, field, bar)):
                for ids in tokenizer(batch)["input_ids"]:
                    row = np.asarray(ids if ids and ids[-1] == eos else [*ids, eos], dtype=dtype)  # (tokens,)
                    row.tofile(out)
                    n_tokens += row.size
                n_docs += len(batch)
                bar.set_postfix_str(f"{n_docs:,} documents, {n_tokens:,} tokens", refresh=False)
        os.replace(partial, output)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    finally:
        bar.close()
    return Prepared(output, n_docs, n_tokens, dtype)
