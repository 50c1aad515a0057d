"""Protects OLMoE and Qwen2-MoE under ``auto_parallelize`` (axon4d/parallelize/moe.py:
``FeatureNorm``, ``GatedSharedMoEBlock``, ``SharedGate``; docs/parallelize.md,
"Mixture-of-Experts models").

A tiny random ``OlmoeForCausalLM`` (q/k norms over all heads' features, no renormalised gates)
and ``Qwen2MoeForCausalLM`` (q/k/v biases, a dense ``mlp_only_layers`` layer, the shared expert
scaled by sigmoid(``shared_expert_gate``)) are parallelized on grids of 2 and 4 ranks and must
equal transformers' model in one process, fp32, to 1e-5: logits, loss, every parameter's gradient
under its own name (``to_dense``) and the dense copy's logits. Then the round trip: ``axon4d train
--hf`` of a saved model for 2 steps equals the one-process run, ``axon4d export-hf`` of its
checkpoint loads with ``from_pretrained`` holding the trained weights, whose logits are the trained
model's.
"""

import copy

import hf_round_trip
import pytest
import torch
from hf_round_trip import rel_err

import axon4d
from axon4d.parallelize import auto_parallelize, to_dense
from axon4d.parallelize.moe import FeatureNorm, GatedSharedMoEBlock, HFMoEBlock, SharedGate

TOL = 1e-5
VOCAB, BATCH, SEQ = 128, 8, 8


def _config(family, vocab=VOCAB):
    from transformers import OlmoeConfig, Qwen2MoeConfig

    small = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "olmoe":
        cfg = OlmoeConfig(**small, intermediate_size=32, num_hidden_layers=2)
    else:
        cfg = Qwen2MoeConfig(
            **small,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=3,
            mlp_only_layers=[1],
        )
    cfg._attn_implementation = "eager"
    return cfg


def _model(family, vocab=VOCAB, seed=0):
    from transformers import OlmoeForCausalLM, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    model = (OlmoeForCausalLM if family == "olmoe" else Qwen2MoeForCausalLM)(_config(family, vocab))
    with torch.no_grad():  # norm weights and router away from their trivial values: slices must matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.5)
    return model


def _compare(grid, family):
    model = _model(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    par = auto_parallelize(model)
    kinds = {
        "moe": sum(isinstance(m, HFMoEBlock) for m in par.modules()),
        "shared": sum(isinstance(m, GatedSharedMoEBlock) for m in par.modules()),
        "gate": sum(isinstance(m, SharedGate) for m in par.modules()),
        "norm": sum(isinstance(m, FeatureNorm) for m in par.modules()),
    }
    local = axon4d.shard_batch(ids)
    out = par(input_ids=local, labels=local)
    out.loss.backward()
    rout = ref(input_ids=ids, labels=ids)
    rout.loss.backward()
    errs = {"logits": rel_err(axon4d.gather_batch(out.logits), rout.logits)}
    errs["loss"] = rel_err(axon4d.gather_batch(out.loss.detach().reshape(1)).mean(), rout.loss)
    dense = to_dense(par, grads=True)
    got = dict(dense.named_parameters())
    assert set(got) == set(dict(ref.named_parameters())), "to_dense must give transformers' parameter names"
    for name, p in ref.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    with torch.no_grad():
        errs["dense_copy_logits"] = rel_err(dense(input_ids=ids).logits, rout.logits)
    return errs, kinds


@pytest.mark.parametrize("grid", [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2)])
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_olmoe_and_qwen2_moe_match_transformers(pools, family, grid):
    results = pools(grid[0] * grid[1] * grid[2] * grid[3]).run(grid, _compare, family)
    want = (
        {"moe": 2, "shared": 0, "gate": 0, "norm": 4}
        if family == "olmoe"
        else {"moe": 2, "shared": 2, "gate": 2, "norm": 0}
    )
    for rank, (errs, kinds) in enumerate(results):
        assert kinds == want
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{family} {grid} rank {rank}: {worst} error {errs[worst]:.2e} > {TOL:.0e}"


@pytest.mark.parametrize("family,grid", [("olmoe", "1,2,2,1"), ("qwen2_moe", "2,1,1,2")])
def test_train_hf_export_round_trip(pools, tmp_path, family, grid):
    from axon4d.train import hf

    path = str(tmp_path / family)
    _model(family, hf_round_trip.VOCAB).save_pretrained(path)
    assert hf.model_config(path, hf_round_trip.SEQ).n_experts == 4
    done = hf_round_trip.round_trip(pools, tmp_path, path, grid, steps=2)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(done.exported.state_dict()[gate_up], done.original.state_dict()[gate_up])  # fine-tuned


def _aux(grid, family):
    """``output_router_logits`` on: the ranks' ``aux_loss`` and ``loss`` averaged, and every gradient,
    are transformers' (its pooled load-balancing loss, weight 0.5)."""
    model = _model(family)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.5
    model.router_aux_loss_coef = 0.5
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    par = auto_parallelize(model)
    local = axon4d.shard_batch(ids)
    out = par(input_ids=local, labels=local)
    out.loss.backward()
    rout = ref(input_ids=ids, labels=ids)
    rout.loss.backward()
    mean = lambda t: axon4d.gather_batch(t.detach().reshape(1)).mean()  # noqa: E731
    errs = {"aux_loss": rel_err(mean(out.aux_loss), rout.aux_loss), "loss": rel_err(mean(out.loss), rout.loss)}
    dense = dict(to_dense(par, grads=True).named_parameters())
    for name, p in ref.named_parameters():
        errs[f"{name}.grad"] = rel_err(dense[name].grad, p.grad)
    return errs


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_output_router_logits_of_olmoe_and_qwen2_moe(pools, family):
    grid = (1, 1, 2, 2)
    for rank, errs in enumerate(pools(4).run(grid, _aux, family)):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{family} rank {rank}: {worst} error {errs[worst]:.2e}"
