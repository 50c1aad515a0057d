"""Protects the training job: the gradient norm counts every element once however it is sharded
or replicated, a run is reproducible and resumes on the same loss curve, gradient accumulation
equals one big batch, and every TrainConfig field is a documented command-line flag."""

import argparse
import dataclasses
import json

import pytest
import torch

import axon4d
from axon4d import params
from axon4d.config import ModelConfig
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.train import TrainConfig, add_arguments, train

CFG = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama")


def _norms(grid, cfg):
    torch.manual_seed(4)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1))
    model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    dense.loss(ids[:, :-1], ids[:, 1:]).backward()
    ref = torch.sqrt(sum(p.grad.double().square().sum() for p in dense.parameters())).item()
    return params.grad_norm(model, grid).item(), ref


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(arch="gpt", n_kv_heads=None)], ids=["llama", "gpt"])
@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 1, 4)])
def test_grad_norm_counts_each_element_once(pools, cfg, grid):
    for got, ref in pools(8).run(grid, _norms, cfg):
        assert abs(got - ref) / ref < 1e-5


def _run(cfg_dict):
    summary = train(TrainConfig(**cfg_dict))
    return summary["losses"]


def _base(tmp, **kw):
    cfg = dict(grid="2,2,2,1", model="tiny", layers=1, hidden=32, heads=4, kv_heads=2, vocab_size=64, seq_len=8,
               batch_size=8, steps=4, warmup_steps=2, out_dir=str(tmp), progress=False, peak_tflops=1.0)
    cfg.update(kw)
    return cfg


def test_resume_of_an_interrupted_run_matches_exactly(pools, tmp_path):
    straight = pools(8).run(None, _run, _base(tmp_path / "a", steps=6, save_every=3))[0]
    assert straight == pools(8).run(None, _run, _base(tmp_path / "b", steps=6))[0]  # same seed, same run
    # simulate an interruption after step 3: keep only the step-3 checkpoint, then resume
    ckpts = tmp_path / "a" / "checkpoints"
    import shutil

    shutil.rmtree(ckpts / "step_6")
    resumed = pools(8).run(None, _run, _base(tmp_path / "a", steps=6, save_every=3, resume=True))[0]
    assert resumed == straight[3:]


def test_gradient_accumulation_equals_one_big_batch(pools, tmp_path):
    big = pools(8).run(None, _run, _base(tmp_path / "a", batch_size=16))[0]
    acc = pools(8).run(None, _run, _base(tmp_path / "b", batch_size=8, micro_batches=2))[0]
    assert max(abs(a - b) / b for a, b in zip(acc, big)) < 1e-5


def test_every_config_field_is_a_documented_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text
    args = parser.parse_args(["--grid", "2,1,2,2", "--steps", "7", "--no-progress", "--lr", "0.5"])
    assert args.grid == "2,1,2,2" and args.steps == 7 and args.progress is False and args.lr == 0.5
    assert "Peak learning rate" in text


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="precision 'fp8' is not supported; use one of fp32, bf16"):
        train(TrainConfig(precision="fp8"))
