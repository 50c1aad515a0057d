"""Token streams for training: a synthetic default and tokenized text files (memmap).

Both define, for a step, the *global* batch (B, S+1) of token ids — the same on every rank, drawn
deterministically from (seed, step) — so a run is reproducible and a resumed run sees exactly the
batches it would have seen. ``global_batch`` builds its rows range by range as they are read (a
rank's share: the training loop's ``axon4d.train.batches.MicroBatch``), the same bits as those rows
of the whole ``batch``.

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
        return self.global_batch(step, batch_size).rows(0, batch_size)

    def global_batch(self, step: int, batch_size: int) -> SyntheticBatch:
        """Step ``step``'s global batch of ``batch_size`` sequences, built as far as its rows are read."""
        return SyntheticBatch(self, step, batch_size)


class SyntheticBatch:
    """One step's global batch of ``SyntheticTokens``, built row range by row range (``rows``), each
    the same bits as those rows of the whole batch: the random draws are the whole batch's, made
    once and in order by one generator (the last, the tokens noise draws, only as far as the rows
    read), the counting only that of the rows read."""

    def __init__(self, tokens: SyntheticTokens, step: int, size: int):
        self.size, self.seq_len, self.vocab_size = size, tokens.seq_len, tokens.vocab_size
        self._gen = gen = torch.Generator().manual_seed(tokens.seed * 1_000_003 + step)
        self._d = tokens.stride[torch.randint(0, len(tokens.stride), (size,), generator=gen)]
        self._first = torch.randint(0, self.vocab_size, (size,), generator=gen)
        self._noise = torch.rand(size, self.seq_len, generator=gen) < tokens.noise
        self._random = torch.empty(size, self.seq_len, dtype=torch.long)
        self._drawn = 0  # rows of _random drawn so far

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (hi − lo, seq_len + 1)."""
        _check_rows(self.size, lo, hi)
        if hi > self._drawn:  # the generator's next numbers are those of the rows after the last drawn
            self._random[self._drawn : hi].random_(0, self.vocab_size, generator=self._gen)
            self._drawn = hi
        out = torch.empty(hi - lo, self.seq_len + 1, dtype=torch.long)
        for i in range(lo, hi, COUNT_ROWS):
            j = min(i + COUNT_ROWS, hi)
            at = slice(i, j)
            out[i - lo : j - lo] = _count(
                self._first[at, None], self._noise[at], self._random[at], self._d[at, None], self.vocab_size
            )
        return out


#: rows counted at once by ``SyntheticTokens.rows`` (a few MB: in cache, 4× faster than the whole batch at once)
COUNT_ROWS = 32


def _count(first: torch.Tensor, noise: torch.Tensor, random: torch.Tensor, d: torch.Tensor, v: int) -> torch.Tensor:
    """Rows (b, S+1) of the counting language: t[0] = ``first``, t[i+1] = ``random[i]`` where
    ``noise[i]``, else (t[i] + d) mod V — computed at once: each token counts on from the last
    token k <= i that was drawn (the first, or a noisy one), t[i] = (t[k] + (i − k)·d) mod V."""
    b, s = noise.shape
    at = torch.arange(s + 1).expand(b, s + 1)
    drawn = torch.cat([torch.ones_like(noise[:, :1]), noise], dim=1)
    last = torch.where(drawn, at, 0).cummax(dim=1).values
    return (torch.cat([first, random], dim=1).gather(1, last) + (at - last) * d) % v


def _check_rows(batch_size: int, lo: int, hi: int) -> None:
    if not 0 <= lo < hi <= batch_size:
        raise ValueError(f"rows {lo}:{hi} are not rows of a batch of {batch_size}: give 0 <= lo < hi <= {batch_size}")


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
        """The global batch (batch_size, seq_len + 1) of step ``step``: windows of the file."""
        return self.global_batch(step, batch_size).rows(0, batch_size)

    def global_batch(self, step: int, batch_size: int) -> MemmapBatch:
        """Step ``step``'s global batch of ``batch_size`` windows, read as far as its rows are."""
        return MemmapBatch(self, step, batch_size)


class MemmapBatch:
    """One step's global batch of ``MemmapTokens``: where its windows start, drawn for the whole
    batch, and the windows of the rows read (``rows``)."""

    def __init__(self, tokens: MemmapTokens, step: int, size: int):
        self.size, self.seq_len, self._tokens = size, tokens.seq_len, tokens.tokens
        gen = torch.Generator().manual_seed(tokens.seed * 1_000_003 + step)
        self._starts = torch.randint(0, len(self._tokens) - self.seq_len - 1, (size,), generator=gen).tolist()

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (hi − lo, seq_len + 1): only their windows are read."""
        _check_rows(self.size, lo, hi)
        n = self.seq_len + 1
        return torch.from_numpy(
            np.stack([np.asarray(self._tokens[s : s + n], dtype=np.int64) for s in self._starts[lo:hi]])
        )


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
