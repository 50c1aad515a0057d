"""Protects DeepSeek-V3 from Hugging Face under ``auto_parallelize`` (axon4d/parallelize/deepseek.py:
``HFMLA``; axon4d/parallelize/moe.py: ``SharedMoEBlock``, the routing bias; docs/moe.md).

A tiny random ``DeepseekV3ForCausalLM`` — a dense first block, 8 routed experts in 4 groups of which a
token keeps 2 (top-2 experts), a non-zero ``e_score_correction_bias``, ``routed_scaling_factor``
2.5, a shared expert, MLA with a q latent (``q_lora_rank``) or a plain ``q_proj`` and interleaved
rotary features — is parallelized on grids of 4 ranks and must equal transformers' model in one
process, fp32, to 1e-5: logits, loss, every parameter's gradient under its own name (``to_dense``)
and the dense copy's logits. Then the round trip: ``axon4d train --hf`` of a saved model for 2 steps
equals the one-process run, ``axon4d export-hf`` of its checkpoint loads with ``from_pretrained``
holding the trained weights and the routing bias, and its logits are the trained model's.
"""

import copy

import hf_round_trip
import pytest
import torch
from hf_round_trip import rel_err
from test_hf_moe_families import BATCH, SEQ, TOL, VOCAB

import axon4d
from axon4d.parallelize import auto_parallelize, to_dense
from axon4d.parallelize.deepseek import HFMLA
from axon4d.parallelize.moe import SharedMoEBlock, check_supported

#: DeepSeek-V3's published rotary scaling, shrunk: YaRN's frequency ramps and softmax mscale
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _model(q_lora_rank, vocab=VOCAB, seed=0, rope=None):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=64,
        rope_parameters=rope,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # norms, router and bias away from their trivial values: slices must matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


def _compare(grid, q_lora_rank, rope, recompute, out_dir=None):
    model = _model(q_lora_rank, rope=rope)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    par = auto_parallelize(model, recompute=recompute)
    kinds = (
        sum(isinstance(m, HFMLA) for m in par.modules()),
        sum(isinstance(m, SharedMoEBlock) for m in par.modules()),
    )
    local = axon4d.shard_batch(ids)
    out = par(input_ids=local, labels=local, use_cache=False)
    out.loss.backward()
    rout = ref(input_ids=ids, labels=ids, use_cache=False)
    rout.loss.backward()
    errs = {"logits": rel_err(axon4d.gather_batch(out.logits), rout.logits)}
    errs["loss"] = rel_err(axon4d.gather_batch(out.loss.detach().reshape(1)).mean(), rout.loss)
    dense = to_dense(par, grads=True)
    got = dict(dense.named_parameters())
    assert set(got) == set(dict(ref.named_parameters())), "to_dense must give transformers' parameter names"
    for name, p in ref.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    errs["bias"] = rel_err(dense.state_dict()[bias], ref.state_dict()[bias])
    with torch.no_grad():
        errs["dense_copy_logits"] = rel_err(dense(input_ids=ids, use_cache=False).logits, rout.logits)
    stepped = None
    if out_dir is not None:  # the live export after an SGD step: the logits from_pretrained must give
        from axon4d.export import save_pretrained_

        with torch.no_grad():
            for p in par.parameters():
                p -= 0.5 * p.grad
            save_pretrained_(par, out_dir)
            stepped = to_dense(par)(input_ids=ids, use_cache=False).logits
            assert rel_err(stepped, rout.logits) > 1e-3  # the step changed the model
    return errs, kinds, stepped


@pytest.mark.parametrize(
    "grid,q_lora_rank,rope,recompute",
    [((2, 2, 1, 1), 24, None, "selective"), ((1, 2, 2, 1), None, YARN, "full")],
    ids=["q_lora-selective", "q_proj-yarn-full"],
)
def test_deepseek_v3_matches_transformers(pools, tmp_path, grid, q_lora_rank, rope, recompute):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "live") if q_lora_rank is None else None  # one grid also exports live
    results = pools(4).run(grid, _compare, q_lora_rank, rope, recompute, out)
    for rank, (errs, kinds, _) in enumerate(results):
        assert kinds == (2, 1)  # MLA in both blocks, the second sparse
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{grid} q_lora_rank={q_lora_rank} rank {rank}: {worst} {errs[worst]:.2e}"
    if out is not None:
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert torch.equal(exported.state_dict()[bias], _model(None, rope=rope).state_dict()[bias])
        with torch.no_grad():
            assert rel_err(exported(input_ids=ids, use_cache=False).logits, results[0][2]) <= TOL


def test_deepseek_v3_refuses_what_is_not_built():
    from transformers import DeepseekV3ForCausalLM

    config = _model(24).config
    config.num_key_value_heads = 2
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM: num_key_value_heads = 2 ≠ num_attention_heads = 4"):
        check_supported(model, "sharded")  # what auto_parallelize asks first, the same on every rank


def test_train_hf_export_round_trip(pools, tmp_path):
    from axon4d.train import hf

    path = str(tmp_path / "deepseek")
    _model(24, hf_round_trip.VOCAB).save_pretrained(path)
    cfg = hf.model_config(path, hf_round_trip.SEQ)
    assert (cfg.n_experts, cfg.n_groups, cfg.topk_groups, cfg.first_k_dense, cfg.router_scoring) == (
        8,
        4,
        2,
        1,
        "sigmoid",
    )
    done = hf_round_trip.round_trip(pools, tmp_path, path, "2,1,1,2", steps=2)
    state, original = done.exported.state_dict(), done.original.state_dict()
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(state[bias], original[bias])  # fixed, as transformers keeps it
    for tuned in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.kv_b_proj.weight"):
        assert not torch.equal(state[tuned], original[tuned])  # fine-tuned


def _context_parallel_refusal(grid):
    try:  # refused by auto_parallelize (MLA has no q/k/v projections to split the sequence for)
        auto_parallelize(_model(24), context_parallel=True)
    except ValueError as e:
        return str(e)
    return None


def test_deepseek_v3_refuses_context_parallelism_on_every_rank(pools):
    results = pools(4).run((1, 1, 2, 2), _context_parallel_refusal)  # the 4-rank pool of the tests above
    assert all(r == results[0] for r in results)
    assert results[0] is not None and "context_parallel=True" in results[0] and "DeepseekV3ForCausalLM" in results[0]
