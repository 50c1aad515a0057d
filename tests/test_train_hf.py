"""Protects ``axon4d train --hf``: a Hugging Face causal LM saved with ``save_pretrained`` (a small
Llama with grouped-query attention and a GPT-2 with its tied head, made on the spot) is fine-tuned
by the training job on a 4-rank grid. Its first loss is the loss transformers computes for the same
batch in one process; a run interrupted and resumed from a checkpoint gives the same losses as one
that was not; ``--compare-single`` trains the unparallelized model alike, also with micro-batches,
ZeRO, recomputation and context parallelism, on a token file ``axon4d prepare-data`` wrote. The
saved model's configuration becomes the run's ``ModelConfig``, and flags that cannot apply are
refused before anything starts, each with one clear message."""

import os
import shutil
import warnings

import pytest
import torch
from hf_models import bpe_tokenizer, save_gpt2, save_llama

from axon4d import checkpoint
from axon4d.config import ModelConfig
from axon4d.data.prepare import prepare
from axon4d.data.tokens import MemmapTokens, SyntheticTokens
from axon4d.export.from_checkpoint import export_checkpoint
from axon4d.plan.job import plan_job
from axon4d.train import TrainConfig, hf, planned, train
from axon4d.train.batches import make_data

VOCAB, SEQ = 320, 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": save_llama(str(root / "llama"), VOCAB), "gpt2": save_gpt2(str(root / "gpt2"), VOCAB)}


def _base(path, out, **kw):
    cfg = dict(
        hf=path,
        grid="1,2,2,1",
        seq_len=SEQ,
        batch_size=4,
        steps=4,
        warmup_steps=1,
        lr=1e-3,
        out_dir=str(out),
        progress=False,
        peak_tflops=1.0,
    )
    cfg.update(kw)
    return cfg


def _train(cfg_dict):
    warnings.simplefilter("ignore")  # auto_parallelize lists GPT-2's tied head, left whole
    summary = train(TrainConfig(**cfg_dict))
    return {k: summary.get(k) for k in ("losses", "single_process_losses", "max_rel_diff")}


def _transformers_loss(path, batch):
    """The loss transformers computes for ``batch`` (B, S+1) in one process: the model's own shift."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # eval: dropout off, as --hf
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def test_a_fine_tune_resumes_on_the_same_curve(pools, saved, tmp_path):
    straight = pools(4).run(None, _train, _base(saved["llama"], tmp_path / "a", save_every=2))[0]["losses"]
    first = SyntheticTokens(VOCAB, SEQ, seed=0).batch(0, 4)
    assert straight[0] == pytest.approx(_transformers_loss(saved["llama"], first), rel=1e-6)
    ckpts = tmp_path / "a" / "checkpoints"
    meta = checkpoint.read_meta(str(ckpts / "step_4"))
    assert meta["hf_path"] == os.path.realpath(saved["llama"]) and meta["model_config"]["n_kv_heads"] == 2
    shutil.rmtree(ckpts / "step_4")  # interrupted after step 2
    resumed = pools(4).run(None, _train, _base(saved["llama"], tmp_path / "a", save_every=2, resume="always"))[0]
    assert resumed["losses"] == straight[2:]
    # a resume of another model is refused before anything starts
    for cfg, says in (
        (_base(saved["gpt2"], tmp_path / "a", steps=6, resume="always"), "fine-tunes the Hugging Face model in"),
        (
            dict(model="tiny", grid="1,1,1,1", out_dir=str(tmp_path / "a"), steps=6, resume="always"),
            "this one has no --hf; resume --hf",
        ),
    ):
        with pytest.raises(ValueError, match=says):
            train(TrainConfig(**cfg))
    with pytest.raises(ValueError, match=r"axon4d export-hf"):
        checkpoint.export_dense(str(ckpts / "step_4"), str(tmp_path / "dense.pt"))
    # the fine-tuned checkpoint exports to Hugging Face format (axon4d export-hf) as the weights it holds
    export_checkpoint(str(ckpts / "step_4"), str(tmp_path / "exported"))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32).state_dict()
    trained = pools(4).run((1, 2, 2, 1), _dense_after, saved["llama"], str(ckpts / "step_4"))[0]
    assert sorted(trained) == sorted(k for k in exported if k in trained) and len(trained) >= len(exported) - 1
    for name, value in trained.items():
        assert torch.equal(exported[name], value), name


def _dense_after(grid, path, ckpt):
    """The dense Hugging Face model of ``path`` with the weights of the job's checkpoint ``ckpt``."""
    warnings.simplefilter("ignore")
    model = hf.build(path, hf.model_config(path, SEQ), grid)
    checkpoint.load(ckpt, model, grid, check_model=False)
    return {k: v.detach().clone() for k, v in model.to_dense().module.state_dict().items()}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A token file of the GPT-2's vocabulary, written by axon4d prepare-data."""
    from hf_models import TEXT

    root = tmp_path_factory.mktemp("tokens")
    text = root / "text.txt"
    text.write_text("\n\n".join([TEXT] * 8))
    return prepare(str(text), str(root / "tokens.u16"), bpe_tokenizer(str(root / "bpe")), progress=False).path


@pytest.mark.parametrize(
    "family,options",
    [
        ("gpt2", dict(grid="2,1,1,2", micro_batches=2, zero=1, recompute="full")),
        # the ring mode through --hf (the model-level tests cover both modes: test_parallelize_context)
        ("llama", dict(grid="1,2,2,1", context_parallel=True, context_parallel_mode="ring", recompute="selective")),
    ],
    ids=["gpt2-zero-microbatches", "llama-context-parallel-ring"],
)
def test_a_fine_tune_equals_the_model_trained_in_one_process(pools, saved, tokens, tmp_path, family, options):
    cfg = _base(saved[family], tmp_path, data=tokens, compare_single=True, lr=1e-2, **options)
    got = pools(4).run(None, _train, cfg)[0]
    assert got["max_rel_diff"] < 1e-5 and len(got["single_process_losses"]) == 4
    assert got["losses"][-1] < got["losses"][0] - 1  # it learns the repeated text
    step = cfg["batch_size"] * cfg.get("micro_batches", 1)
    first = MemmapTokens(tokens, SEQ, VOCAB, seed=0).batch(0, step)
    assert got["losses"][0] == pytest.approx(_transformers_loss(saved[family], first), rel=1e-6)


def _loss_paths(grid, paths):
    """For each saved model: whether its loss runs on its head's slices of the vocabulary (the
    logits never gathered), and the loss's relative difference from torch's over the whole logits."""
    import torch.nn.functional as F

    import axon4d

    warnings.simplefilter("ignore")
    ids = SyntheticTokens(VOCAB, SEQ, seed=0).batch(0, 4)  # (4, SEQ + 1)
    x, y = axon4d.shard_batch(ids[:, :-1], grid), axon4d.shard_batch(ids[:, 1:], grid)
    out = {}
    for family, path in paths.items():
        model = hf.build(path, hf.model_config(path, SEQ), grid)
        with torch.no_grad():
            loss = model.loss(x, y).item()
            whole = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item()
        out[family] = (model.split_head() is not None, abs(loss / whole - 1))
    return out


def test_the_loss_runs_on_the_heads_vocabulary_slices_where_the_head_is_split(pools, saved):
    """The Llama's untied head is split over y: its loss is the vocabulary-parallel one over this
    rank's slice of the logits; GPT-2's tied head is whole: the same chunked loss over its logits."""
    for paths in pools(4).run((1, 2, 2, 1), _loss_paths, saved):
        assert paths["llama"][0] and not paths["gpt2"][0]
        assert all(diff <= 1e-6 for _, diff in paths.values()), paths


def _auto(cfg_dict):
    """The planner's plan for the run (as every rank asks it) and the summary of the run."""
    warnings.simplefilter("ignore")
    cfg = TrainConfig(**cfg_dict)
    run = planned.apply(cfg, plan_job(planned.request(cfg, accelerator=False)))
    return run, train(cfg)


@pytest.mark.slow
def test_grid_auto_runs_the_planner_s_plan_for_a_saved_model(pools, saved, tmp_path):
    machine = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "results", "planner_machine_local.json")
    cfg = _base(saved["llama"], tmp_path, grid="auto", machine=machine, batch_size=8, steps=2)
    run, summary = pools(4).run(None, _auto, cfg)[0]
    assert summary["grid"] == "(x={}, y={}, z={}, data={})".format(*run.grid.split(","))
    assert summary["recompute"] == run.recompute and run.offload == "" and len(summary["losses"]) == 2


def test_the_saved_configuration_is_the_run_s_model(saved):
    llama = TrainConfig(hf=saved["llama"]).model_config()
    assert llama == ModelConfig(
        n_layers=2,
        hidden=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        vocab_size=VOCAB,
        seq_len=64,  # the model's positions (at most 2048)
        arch="llama",
        rope_theta=10000.0,
        norm_eps=1e-6,
        name="LlamaForCausalLM",
    )
    gpt2 = TrainConfig(hf=saved["gpt2"], seq_len=32).model_config()
    assert (gpt2.arch, gpt2.ffn, gpt2.kv_heads, gpt2.seq_len, gpt2.name) == ("gpt", 256, 4, 32, "GPT2LMHeadModel")
    # --grid auto may not choose to offload: a Hugging Face model has no axon4d blocks
    assert planned.question(TrainConfig(hf=saved["llama"], grid="auto"), accelerator=False)["offload"] == 0


def test_flags_that_cannot_apply_are_refused(saved, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM, ViTConfig

    qwen = str(tmp_path / "qwen")
    Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    ).save_pretrained(qwen)
    vit = str(tmp_path / "vit")
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64).save_pretrained(vit)
    llama = saved["llama"]
    cases = {
        "offload": (dict(offload="0.5"), "--offload 0.5: the saved model's configuration gives"),
        "shape": (dict(layers=4, hidden=128), "with --layers 4, --hidden 128"),
        "model": (dict(model="tiny", arch="gpt"), "with --model tiny, --arch gpt"),
        "vocab": (dict(vocab_size=512), "--vocab-size 512"),
        "positions": (dict(seq_len=65), "--seq-len 65: the model in .* has 64 positions"),
        "corpus": (dict(data="corpus"), "--data corpus: the corpus holds byte ids"),
        "missing": (dict(hf=str(tmp_path / "none")), "is not a directory with a config.json"),
        "no config": (dict(hf=str(tmp_path)), "holds no config.json"),
        "not a causal LM": (dict(hf=vit), "a 'vit' model has no causal LM class in transformers"),
        "auto": (dict(hf=qwen, grid="auto"), "model type 'qwen2'.*prices the parallel styles of llama, gpt2"),
    }
    for kw, says in cases.values():
        with pytest.raises((ValueError, FileNotFoundError), match=says):
            TrainConfig(**{"hf": llama, **kw})
    ids = tmp_path / "ids.u32"
    torch.arange(VOCAB + 1, dtype=torch.int32).numpy().astype("uint32").tofile(ids)
    cfg = TrainConfig(hf=llama, data=str(ids), seq_len=SEQ)
    with pytest.raises(ValueError, match=f"contains token id {VOCAB}, but the model's vocab_size is {VOCAB}"):
        make_data(cfg, cfg.model_config())
