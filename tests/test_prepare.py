"""Protects ``axon4d prepare-data``: text tokenized by a saved Hugging Face tokenizer comes back
from the token file as the same text (documents split as asked, each followed by EOS), the file's
element type is the one its name says and fits the vocabulary (uint32 past 65,536 ids), the
training job's reader takes the file, and bad input ends with one clear message and no file."""

import json
import os

import numpy as np
import pytest
from hf_models import TEXT, bpe_tokenizer, word_tokenizer

from axon4d import cli
from axon4d.data.prepare import prepare
from axon4d.data.tokens import MemmapTokens


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return bpe_tokenizer(str(root / "bpe")), word_tokenizer(str(root / "words"), 70_000)


def _decode(tokenizer_path, path, dtype):
    from transformers import AutoTokenizer

    ids = np.fromfile(path, dtype=dtype)
    return AutoTokenizer.from_pretrained(tokenizer_path).decode(ids.tolist()), ids


def test_text_and_jsonl_round_trip(tokenizers, tmp_path, capsys):
    bpe, _ = tokenizers
    lines = TEXT.strip().split("\n")
    txt = tmp_path / "in.txt"
    txt.write_text(f"{lines[0]}\n{lines[1]}\n\n\n{lines[0]}\n")
    out = str(tmp_path / "blank.u16")
    assert cli.main(["prepare-data", "--tokenizer", bpe, str(txt), out, "--no-progress"]) == 0
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(f"2 documents, {np.fromfile(out, 'uint16').size} tokens (uint16) -> {out}")
    )
    text, ids = _decode(bpe, out, "uint16")
    assert text == f"{lines[0]}\n{lines[1]}<eos>{lines[0]}<eos>" and ids.max() < 300
    done = prepare(str(txt), str(tmp_path / "lines.u32"), bpe, split="line", progress=False)
    assert (done.documents, done.dtype) == (3, "uint32")
    assert _decode(bpe, done.path, "uint32")[0] == "".join(f"{line}<eos>" for line in (*lines, lines[0]))
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": line}) + "\n" for i, line in enumerate(lines)) + "\n")
    done = prepare(str(jsonl), str(tmp_path / "j.u16"), bpe, field="body", progress=False)
    assert done.documents == 2 and _decode(bpe, done.path, "uint16")[0] == "".join(f"{line}<eos>" for line in lines)
    # the training job reads it as it is
    assert MemmapTokens(done.path, seq_len=8, vocab_size=300).batch(0, 2).shape == (2, 9)


def test_a_vocabulary_past_uint16_needs_a_u32_file(tokenizers, tmp_path):
    _, words = tokenizers
    txt = tmp_path / "in.txt"
    txt.write_text("w0 w69999 w65536\nw7\n")
    with pytest.raises(ValueError, match=r"uint16 file, but the tokenizer has 70,002 token ids .* name it .*ids\.u32"):
        prepare(str(txt), str(tmp_path / "ids.u16"), words, progress=False)
    assert not os.path.exists(tmp_path / "ids.u16")
    done = prepare(str(txt), str(tmp_path / "ids.u32"), words, split="line", progress=False)
    ids = np.fromfile(done.path, dtype="uint32")
    assert ids.tolist() == [2, 70001, 65538, 1, 9, 1] and done.tokens == 6


def test_bad_input_is_one_clear_message(tokenizers, tmp_path, capsys):
    bpe, _ = tokenizers
    txt = tmp_path / "in.txt"
    txt.write_text("hello\n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    (tmp_path / "exists.u16").write_bytes(b"")
    cases = {
        "no tokenizer": (["--tokenizer", str(tmp_path / "none"), str(txt), "o.u16"], "is not a directory"),
        "not a tokenizer": (["--tokenizer", str(tmp_path), str(txt), "o.u16"], "found no tokenizer there"),
        "no input": (["--tokenizer", bpe, str(tmp_path / "none.txt"), "o.u16"], "does not exist"),
        "input kind": (["--tokenizer", bpe, str(tmp_path / "in.csv"), "o.u16"], "give a .txt or .jsonl file"),
        "output suffix": (["--tokenizer", bpe, str(txt), str(tmp_path / "o.bin")], "must end in .u16"),
        "exists": (["--tokenizer", bpe, str(txt), str(tmp_path / "exists.u16")], "pass --overwrite"),
        "field": (["--tokenizer", bpe, str(bad_json), str(tmp_path / "f.u16")], "line 2 has no string field 'text'"),
    }
    for name, (argv, says) in cases.items():
        assert cli.main(["prepare-data", "--no-progress", *argv]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("axon4d prepare-data: error: ") and says in err and err.count("\n") == 1, (name, err)
    assert not os.path.exists(tmp_path / "f.u16") and not os.path.exists(tmp_path / "f.u16.partial")
    assert (tmp_path / "exists.u16").read_bytes() == b""
