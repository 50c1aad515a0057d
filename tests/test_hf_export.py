"""Protects the export to Hugging Face format (axon4d.export): what transformers loads back is the
model that was trained, and no process ever holds more than one whole tensor of it.

- Round trip: axon4d's Llama (GQA) and GPT, trained a step on a (1,2,2,1) grid, exported live
  (``save_pretrained_``, sharded files with an index) and from their checkpoint (``axon4d
  export-hf``, in this process, with no process group): ``from_pretrained`` gives the trained
  model's logits (≤ 1e-5 relative, fp32; a bf16 Llama's export holds its bf16 weights, config
  dtype bfloat16, and gives its logits computed in fp32), and the run's tokenizer comes along.
- A Hugging Face Llama and GPT-2 parallelized by ``auto_parallelize`` and trained a step export
  live and from their checkpoint (as ``axon4d train --hf`` saves one: meta.json's ``hf_path``)
  under their own names, every tensor equal to ``to_dense``'s (GPT-2's Conv1D and packed q|k|v).
- Memory (torch's MemTracker): on a (1,2,2,1) grid the export's peak beyond the rank's model is
  the largest tensor plus the exchange of the ranks' verdicts at the end (4 KiB a rank), where
  the whole model is many times that; from a checkpoint, the buffer plus DCP's reads of saved
  pieces (at most one more tensor).
- Refusals: a non-empty OUT without --overwrite (on every rank, and by the command), a directory
  that is no checkpoint, a model with no Hugging Face counterpart: one clear message.
"""

import json
import os
import warnings

import pytest
import torch
from test_materialize import _hf_model
from torch.distributed._tools.mem_tracker import MemTracker

import axon4d
from axon4d import checkpoint, cli
from axon4d.config import ModelConfig
from axon4d.export import export_checkpoint, save_pretrained_
from axon4d.models.hf import hf_tensors
from axon4d.models.transformer import Transformer

GRID = (1, 2, 2, 1)
LLAMA = ModelConfig(
    n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128, seq_len=16, arch="llama",
    rope_theta=5000.0,
)  # fmt: skip
GPT = ModelConfig(n_layers=2, hidden=64, n_heads=4, ffn_hidden=96, vocab_size=128, seq_len=16, arch="gpt")
IDS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(7))


def _tokenizer(directory):
    """A small word-level tokenizer saved by transformers (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(127)}}
    inner = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]").save_pretrained(directory)
    return directory


def _step(model, loss_of, grid):
    """One AdamW step on a fixed batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(3))
    loss_of(axon4d.shard_batch(ids[:, :-1], grid), axon4d.shard_batch(ids[:, 1:], grid)).backward()
    opt.step()
    return opt


def _train_and_export(grid, cfg, dtype, out, ckpt, hf_path):
    """A Transformer trained a step, exported live and checkpointed; its dense logits of IDS (fp32)."""
    torch.manual_seed(0)
    model = Transformer(cfg, dtype=dtype)
    opt = _step(model, model.loss, grid)
    written = save_pretrained_(model, out, max_shard_size="40KB")
    checkpoint.save(ckpt, model, grid, opt, step=1, extra={"hf_path": hf_path})
    with torch.no_grad():
        return written, model.to_dense().float()(IDS)


def _logits(directory, dtype):
    """Logits of IDS of the model saved in ``directory`` (weights of ``dtype``), computed in fp32."""
    from transformers import AutoModelForCausalLM

    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["dtype"] == str(dtype).removeprefix("torch.")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _close(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize(
    "cfg,dtype",
    [(LLAMA, torch.float32), (GPT, torch.float32), (LLAMA, torch.bfloat16)],
    ids=["llama", "gpt", "llama-bf16"],
)
def test_trained_transformer_round_trips_live_and_from_its_checkpoint(pools, tmp_path, cfg, dtype, capsys):
    from transformers import AutoTokenizer

    live, ckpt, from_ckpt = (str(tmp_path / n) for n in ("live", "ckpt", "from_ckpt"))
    hf_path = _tokenizer(str(tmp_path / "hf"))
    written, ref = pools(4).run(GRID, _train_and_export, cfg, dtype, live, ckpt, hf_path)[0]
    assert "model.safetensors.index.json" in written and len(written) > 3  # sharded, with an index
    assert _close(_logits(live, dtype), ref) <= 1e-5  # bf16: the same bf16 weights, both computed in fp32
    assert cli.main(["export-hf", ckpt, from_ckpt, "--max-shard-size", "40KB"]) == 0
    assert _close(_logits(from_ckpt, dtype), ref) <= 1e-5
    assert "checking" in capsys.readouterr().out
    assert cli.main(["export-hf", ckpt, from_ckpt]) == 2  # OUT is not empty: refused, left as it was
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err and "Traceback" not in err
    assert cli.main(["export-hf", ckpt, from_ckpt, "--overwrite", "--max-shard-size", "40KB"]) == 0
    tok = AutoTokenizer.from_pretrained(from_ckpt)  # the run's hf_path tokenizer came along
    assert tok("w3 w5")["input_ids"] == [4, 6]
    from safetensors import safe_open

    with open(os.path.join(from_ckpt, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    assert names == {e.name for e in hf_tensors(cfg)}
    for name in ("lm_head.weight",):  # a sample tensor: the two exports agree bit for bit
        files = [os.path.join(d, json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"][name]) for d in (live, from_ckpt)]  # fmt: skip
        tensors = []
        for file in files:
            with safe_open(file, framework="pt") as f:
                tensors.append(f.get_tensor(name))
        assert torch.equal(*tensors)


def _parallelized_export(grid, family, out, ckpt, hf_path):
    """A Hugging Face model parallelized and trained a step; its export and its checkpoint (as
    ``axon4d train --hf`` saves one), then exports the model cannot make (refused); returns
    to_dense's state dict and the refusals."""
    torch.manual_seed(0)
    model = _hf_model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's tied head is left whole, with a warning
        model = axon4d.auto_parallelize(model, grid=grid)
    opt = _step(model, lambda ids, targets: model(input_ids=ids, labels=ids).loss, grid)
    save_pretrained_(model, out)
    checkpoint.save(ckpt, model, grid, opt, step=1, extra={"hf_path": hf_path})
    refused = []
    for what in (model, torch.nn.Linear(2, 2)):
        try:
            save_pretrained_(what, out)
        except Exception as e:
            refused.append(str(e))
    dense = {k: v.clone() for k, v in axon4d.to_dense(model).state_dict().items()}
    return dense, refused


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_parallelized_hf_model_exports_under_its_names(pools, tmp_path, family):
    from safetensors import safe_open

    out, ckpt, from_ckpt = (str(tmp_path / n) for n in ("out", "ckpt", "from_ckpt"))
    original = str(tmp_path / "original")  # the saved model a fine-tune starts from, with its tokenizer
    _hf_model(family).save_pretrained(original)
    _tokenizer(original)
    results = pools(4).run(GRID, _parallelized_export, family, out, ckpt, original)
    dense, _ = results[0]
    for rank, (_, (exists, not_a_model)) in enumerate(results):  # every rank raises the same error
        assert "not empty" in exists and "overwrite" in exists, (rank, exists)
        assert "got a Linear" in not_a_model, (rank, not_a_model)
    written = export_checkpoint(ckpt, from_ckpt)  # one process: the model from hf_path's config
    assert "tokenizer.json" in written
    with safe_open(os.path.join(original, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for directory in (out, from_ckpt):
        with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
            assert set(f.keys()) == names  # the original's names (a tied head once)
            for name in names:
                assert torch.equal(f.get_tensor(name), dense[name]), (directory, name)


def _export_memory(grid, out):
    """(peak bytes beyond the rank's model during the export, bytes of the largest exported tensor)."""
    torch.manual_seed(0)
    model = Transformer(LLAMA.replace(n_layers=4))
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tracker.track_external(model)
        with tracker:
            before = tracker.get_tracker_snapshot("current")[grid.device]["Total"]
            save_pretrained_(model, out)
    return tracker.get_tracker_snapshot("peak")[grid.device]["Total"] - before


def _save_untrained(grid, cfg, path):
    torch.manual_seed(0)
    checkpoint.save(path, Transformer(cfg), grid, step=0)


def test_export_holds_one_whole_tensor_at_a_time(pools, tmp_path):
    cfg = LLAMA.replace(n_layers=4)
    sizes = [4 * torch.Size(e.shape).numel() for e in hf_tensors(cfg)]
    largest, whole = max(sizes), sum(sizes)
    slack = 6 * 4096  # the exchange of the ranks' verdicts at the end: 4 KiB from each of 4 ranks, and its own
    assert whole > 4 * (largest + slack)  # gathering the whole model would fail the bound
    out = str(tmp_path / "out")
    for rank, extra in enumerate(pools(4).run(GRID, _export_memory, out)):
        assert extra <= largest + slack, (rank, extra, largest)
    ckpt = str(tmp_path / "ckpt")
    pools(4).run(GRID, _save_untrained, cfg, ckpt)
    tracker = MemTracker()
    with tracker:
        export_checkpoint(ckpt, str(tmp_path / "from_ckpt"))
    extra = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    # beside the buffer, DCP's reads: a saved piece at a time (at most half a tensor here, G_y = G_z = 2),
    # the next one read before the last is dropped
    assert extra <= 2 * largest + slack, (extra, largest)


def test_refusals_name_what_is_wrong(tmp_path, capsys):
    not_ckpt = tmp_path / "not_a_checkpoint"
    not_ckpt.mkdir()
    assert cli.main(["export-hf", str(not_ckpt), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert "not a complete axon4d checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()
    gqa_gpt = tmp_path / "gqa_gpt"
    gqa_gpt.mkdir()
    cfg = ModelConfig(n_layers=1, hidden=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8, arch="gpt")
    (gqa_gpt / "meta.json").write_text(json.dumps({"step": 1, "model_config": cfg.__dict__}))
    assert cli.main(["export-hf", str(gqa_gpt), str(tmp_path / "new")]) == 2
    assert "GPT2LMHeadModel has no grouped-query attention" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        export_checkpoint(str(gqa_gpt), str(tmp_path / "a_file"))
