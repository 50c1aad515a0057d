"""Token streams for training: a synthetic default and tokenized text files (memmap).

Both give, for a step, the *global* batch (B, S+1) of token ids — the same on every rank, drawn
deterministically from (seed, step) — so a run is reproducible and a resumed run sees exactly the
batches it would have seen; ``axon4d.shard_batch`` then takes this rank's rows.

``prepare_text`` turns text into a uint16 token file with a byte-level tokenizer (vocab 256), and
``demo_corpus`` writes a small English corpus made offline from the docstrings of Python's own
standard library — real text for the demo without downloading anything.
"""

from __future__ import annotations

import ast
import os
import sysconfig

import numpy as np
import torch


class SyntheticTokens:
    """A learnable synthetic language: each sequence counts t[i+1] = (t[i] + d) mod V, with noise.

    The stride d is drawn per sequence from a small fixed set, so a model can lower its loss well
    below log V by inferring d from context, which makes loss curves informative.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, rules: int = 8, noise: float = 0.1):
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise
        gen = torch.Generator().manual_seed(seed)
        self.stride = torch.randint(1, vocab_size, (rules,), generator=gen)

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The global batch (batch_size, seq_len + 1) of step ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        d = self.stride[torch.randint(0, len(self.stride), (batch_size,), generator=gen)]
        t = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=gen)
        noise = torch.rand(batch_size, self.seq_len, generator=gen) < self.noise
        random = torch.randint(0, self.vocab_size, (batch_size, self.seq_len), generator=gen)
        for i in range(self.seq_len):
            nxt = (t[:, i] + d) % self.vocab_size
            t[:, i + 1] = torch.where(noise[:, i], random[:, i], nxt)
        return t


#: the element types a token file may hold
TOKEN_DTYPES = ("uint16", "uint32")
#: the file name endings that say a token file's element type
TOKEN_SUFFIXES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}


def token_dtype(path: str, dtype: str | None = None) -> str:
    """The element type of token file ``path``: ``dtype`` if given, else the one its name's ending
    says (``TOKEN_SUFFIXES``: uint32 for .u32/.uint32) and uint16 otherwise; ``ValueError`` for a
    type token files do not use."""
    if dtype is None:
        dtype = TOKEN_SUFFIXES.get(os.path.splitext(path)[1], "uint16")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token file dtype {dtype!r} is not supported; use one of {', '.join(TOKEN_DTYPES)}")
    return dtype


def check_token_file(path: str, seq_len: int, dtype: str | None = None) -> int:
    """The number of tokens in ``path`` if it can feed sequences of ``seq_len``: it must exist
    (``FileNotFoundError``), be a file of whole ``dtype`` elements, and hold at least one window of
    seq_len + 2 tokens (``ValueError``). Reads only the file's size."""
    dtype = token_dtype(path, dtype)
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(
            f"token file {path!r} {what}; give --data synthetic, corpus, or the path of a {'/'.join(TOKEN_DTYPES)} "
            "token file (e.g. written by axon4d.data.tokens.prepare_text)"
        )
    size = os.path.getsize(path)
    item = np.dtype(dtype).itemsize
    if size % item:
        raise ValueError(
            f"token file {path!r} has {size} bytes, not a multiple of {item} ({dtype}): it is truncated or not a "
            f"{dtype} file; give its element type (a .u32 name for uint32) or rewrite it whole"
        )
    tokens = size // item
    if tokens < seq_len + 2:
        raise ValueError(
            f"token file {path!r} holds {tokens} tokens, fewer than one sequence of {seq_len + 1} "
            f"(seq_len {seq_len} + 1) and a start to draw; give a file of at least {seq_len + 2} tokens or a shorter seq_len"
        )
    return tokens


class MemmapTokens:
    """Random windows of a tokenized file (uint16 or uint32 token ids, as written by numpy)."""

    def __init__(self, path: str, seq_len: int, vocab_size: int, seed: int = 0, dtype: str | None = None):
        dtype = token_dtype(path, dtype)
        check_token_file(path, seq_len, dtype)
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.seed = seq_len, seed
        top = int(self.tokens.max())
        if top >= vocab_size:
            raise ValueError(
                f"token file {path!r} contains token id {top}, but the model's vocab_size is {vocab_size}; "
                f"give --vocab-size {top + 1} or more (the job's own models), or a file tokenized for this vocabulary "
                "(axon4d prepare-data --tokenizer with the model's own tokenizer)"
            )

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=gen)
        rows = [np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts.tolist()]
        return torch.from_numpy(np.stack(rows))


def prepare_text(text: str, out_path: str) -> int:
    """Byte-level tokenize ``text`` (UTF-8 bytes are the ids, vocab 256) into a uint16 file."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    ids.tofile(out_path)
    return int(ids.size)


def demo_corpus(out_path: str, max_bytes: int = 1_000_000) -> str:
    """Write (once) a byte-tokenized corpus of the Python standard library's docstrings."""
    if os.path.exists(out_path):
        return out_path
    stdlib = sysconfig.get_paths()["stdlib"]
    pieces: list[str] = []
    size = 0
    for root, dirs, files in sorted(os.walk(stdlib)):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "site-packages", "idlelib", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80 and doc.isascii():
                        pieces.append(doc.strip() + "\n\n")
                        size += len(pieces[-1])
            if size >= max_bytes:
                break
        if size >= max_bytes:
            break
    tmp = out_path + ".tmp"
    prepare_text("".join(pieces)[:max_bytes], tmp)
    os.replace(tmp, out_path)  # readers never see a half-written corpus
    return out_path
