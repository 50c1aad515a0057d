"""Protects the training job with MoE blocks (docs/moe.md): ``--moe`` sets the model's MoE fields
(a bad item fails before anything starts), and every step's record in log.jsonl holds, per MoE
layer, the tokens each expert received over the whole micro-batch, their imbalance and the balance
loss."""

import contextlib
import io
import json
import os

import pytest

from axon4d.train import TrainConfig, train


def test_the_moe_flag_sets_the_models_moe_fields_and_refuses_what_is_not_one():
    cfg = TrainConfig(model="tiny", moe="n_experts=4, experts_per_token=2,router_scoring=sigmoid,moe_aux_coef=0.02")
    mcfg = cfg.model_config()
    assert (mcfg.n_experts, mcfg.experts_per_token, mcfg.router_scoring, mcfg.moe_aux_coef) == (4, 2, "sigmoid", 0.02)
    assert not TrainConfig(model="tiny-moe", moe="n_experts=0").model_config().moe
    with pytest.raises(ValueError, match="--moe item 'experts=4': give field=value with a field of n_experts"):
        TrainConfig(model="tiny", moe="experts=4").model_config()
    with pytest.raises(ValueError, match="--moe n_experts='four': n_experts takes an int"):
        TrainConfig(model="tiny", moe="n_experts=four").model_config()
    with pytest.raises(ValueError, match="experts_per_token = 5 exceeds n_experts = 4"):
        TrainConfig(model="tiny", moe="n_experts=4,experts_per_token=5").model_config()


def _job(cfg):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return train(TrainConfig(**cfg))["losses"]


def test_the_job_logs_tokens_per_expert_and_the_balance_loss(pools, tmp_path):
    cfg = dict(
        grid="1,1,2,1",
        model="tiny-moe",
        steps=2,
        batch_size=4,
        out_dir=str(tmp_path),
        log_every=1,
        progress=False,
        comm="torch",
    )
    losses = pools(2).run(None, _job, cfg)[0]
    with open(os.path.join(tmp_path, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2] and len(losses) == 2
    for r in records:
        moe = r["moe"]
        assert len(moe["tokens_per_expert"]) == 2  # two MoE layers
        for counts, imbalance, balance in zip(moe["tokens_per_expert"], moe["imbalance"], moe["balance_loss"]):
            assert len(counts) == 8 and sum(counts) == 4 * 32 * 2  # every token of the micro-batch, top-2
            assert imbalance == pytest.approx(max(counts) * 8 / sum(counts)) and imbalance >= 1
            assert 0.5 < balance < 8  # E·Σ f·P: 1 when balanced, at most E


def test_the_hugging_face_export_refuses_moe_models_before_writing_anything():
    import dataclasses

    from axon4d.config import get_config
    from axon4d.models.hf import hf_config

    # tiny-moe exports (Qwen2MoeForCausalLM); with sigmoid scores no Hugging Face class computes it
    sigmoid = dataclasses.replace(get_config("tiny-moe"), router_scoring="sigmoid")
    with pytest.raises(
        ValueError, match="Mixture-of-Experts model .* router_scoring 'sigmoid' .* has no Hugging Face export"
    ):
        hf_config(sigmoid)
    assert hf_config(get_config("tiny-moe")).architectures == ["Qwen2MoeForCausalLM"]
