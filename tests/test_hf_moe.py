"""Protects Hugging Face Mixture-of-Experts models under ``axon4d.auto_parallelize`` and
``load_pretrained_`` (axon4d/parallelize/moe.py, moe_loading.py; docs/parallelize.md).

A tiny random Mixtral (top-2, gates renormalised; and top-1, where Mixtral's single gate is 1) and
Qwen3-MoE (per-head q/k norms, a dense ``mlp_only_layers`` layer, gates renormalised or not) are
parallelized on grids of 2, 4 and 8 ranks — experts over batch = data × z, x·y splits of each —
and must equal transformers' own model in one process: logits, loss and every parameter's gradient
(gathered back with ``to_dense`` under transformers' names). The same models loaded by slices from
a ``save_pretrained`` directory (per-expert tensors) and from one holding the fused tensors must give
the same logits. Unsupported MoE families get one line naming their class. The router option for
un-normalised gates (Qwen3-MoE's norm_topk_prob=False) is checked against ``DenseMoE``.
"""

import copy

import hf_round_trip
import pytest
import torch
from hf_models import mixtral_config, qwen3_moe_config, save_moe
from hf_round_trip import rel_err

import axon4d
from axon4d.parallelize import auto_parallelize, load_pretrained_, to_dense
from axon4d.parallelize.moe import HFMoEBlock

TOL = 1e-5
VOCAB, BATCH, SEQ = 128, 8, 8


def _model(family, **kw):
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    if family.startswith("mixtral"):
        return MixtralForCausalLM(mixtral_config(VOCAB, top_k=1 if family == "mixtral_top1" else 2, attn="eager"))
    return Qwen3MoeForCausalLM(qwen3_moe_config(VOCAB, norm_topk_prob=family == "qwen3_norm", attn="eager"))


def _compare(grid, family, expert_layout=None, built=None):
    """``family``'s tiny model parallelized on ``grid`` (its experts in ``expert_layout``; None: the
    grid's) against transformers' one: the relative errors of the logits, the loss, every parameter
    and gradient and the dense copy's logits. ``built``: a list the parallelized model is put in."""
    torch.manual_seed(0)
    model = _model(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    par = auto_parallelize(model, expert_layout=expert_layout)
    if built is not None:
        built.append(par)
    assert sum(isinstance(m, HFMoEBlock) for m in par.modules()) == (2 if family.startswith("mixtral") else 2)
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
    return errs


def _assert_close(results, what):
    for rank, errs in enumerate(results):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{what} rank {rank}: {worst} error {errs[worst]:.2e} > {TOL:.0e}"


def _world(grid):
    return grid[0] * grid[1] * grid[2] * grid[3]


@pytest.mark.parametrize(
    "grid",
    [
        (2, 2, 1, 1),
        (1, 2, 2, 1),
        pytest.param((2, 1, 1, 2), marks=pytest.mark.slow),
        pytest.param((1, 2, 2, 2), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_moe_families_match_transformers(pools, family, grid):
    _assert_close(pools(_world(grid)).run(grid, _compare, family), f"{family} {grid}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral_top1", "qwen3_norm"])
def test_router_variants_match_transformers(pools, family):
    grid = (1, 1, 2, 2)
    _assert_close(pools(_world(grid)).run(grid, _compare, family), f"{family} {grid}")


def _fused_copy(src, dst):
    """``src`` (a ``save_pretrained`` directory: per-expert tensors) saved again as one file of
    the fused tensors transformers 5 keeps in memory (experts.gate_up_proj, experts.down_proj)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{src}/config.json", dst / "config.json")
    return str(dst)


def _loaded_logits(grid, directory):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = auto_parallelize(model)
    load_pretrained_(model, directory)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = axon4d.gather_batch(model(input_ids=axon4d.shard_batch(ids)).logits)
    # this rank read only its experts: E/G_batch of them
    return logits, [tuple(b.moe.experts.up.shape) for m in model.modules() if isinstance(b := m, HFMoEBlock)]


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_loading_by_slices_reads_per_expert_and_fused_checkpoints(pools, tmp_path, family):
    from transformers import AutoModelForCausalLM

    per_expert = save_moe(str(tmp_path / "saved"), family, VOCAB)
    fused = _fused_copy(per_expert, tmp_path / "fused")
    ref = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    grid = (2, 1, 1, 2)  # x = 2, experts over data = 2
    for directory in (per_expert, fused):
        for logits, shapes in pools(_world(grid)).run(grid, _loaded_logits, directory):
            assert rel_err(logits, want) <= TOL, directory
            assert shapes == [(2, 2 * 32, 32)] * 2  # 4 experts / G_data, [gate | up] of FFN 32, hidden 64 / G_x


def _unsupported():
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
    )

    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        return [
            DeepseekV3ForCausalLM(DeepseekV3Config(**small, moe_intermediate_size=32, n_routed_experts=4)),
            GptOssForCausalLM(GptOssConfig(**small, intermediate_size=32, num_local_experts=4)),
        ]


def _refusals(grid):
    from axon4d.parallelize.moe import check_supported

    out = []
    for model in _unsupported():
        try:
            auto_parallelize(model)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    try:
        check_supported(_model("mixtral"), "general")
    except ValueError as e:
        out.append(str(e))
    return out


def test_unsupported_moe_models_get_one_line_naming_their_class(pools):
    results = pools(2).run((1, 1, 1, 2), _refusals)
    assert results[0] == results[1]  # every rank, the same line
    names = ["DeepseekV3ForCausalLM", "GptOssForCausalLM", "MixtralForCausalLM"]
    assert len(results[0]) == len(names)
    for name, msg in zip(names, results[0]):
        assert msg is not None and msg.startswith(f"{name}: ") and "\n" not in msg
        assert "MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM" in msg and "OlmoeForCausalLM" in msg
    assert "style='sharded'" in results[0][-1]
    assert "num_key_value_heads = 2 ≠ num_attention_heads = 4" in results[0][0]  # DeepSeek-V3: why, in the line


@pytest.mark.slow
@pytest.mark.parametrize("family,grid", [("qwen3", "2,1,1,2"), ("mixtral", "1,2,2,1")])
def test_train_hf_fine_tunes_a_saved_moe_model_as_one_process_does(pools, tmp_path, family, grid):
    from axon4d.train import hf

    path = save_moe(str(tmp_path / family), family, hf_round_trip.VOCAB)
    assert hf.model_config(path, hf_round_trip.SEQ).n_experts == 4
    # axon4d export-hf of the job's checkpoint: what transformers loads is the fine-tuned model
    done = hf_round_trip.round_trip(pools, tmp_path, path, grid, steps=3)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(done.exported.state_dict()[gate_up], done.original.state_dict()[gate_up])


def _live_export(grid, family, out):
    """One SGD step of a parallelized model, then ``save_pretrained_``; the dense model's logits."""
    from axon4d.export import save_pretrained_

    torch.manual_seed(0)
    par = auto_parallelize(_model(family))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    local = axon4d.shard_batch(ids)
    par(input_ids=local, labels=local).loss.backward()
    with torch.no_grad():
        for p in par.parameters():
            p -= 0.5 * p.grad
    save_pretrained_(par, out)
    with torch.no_grad():
        return to_dense(par)(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen3", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_save_pretrained_writes_fused_tensors_transformers_loads(pools, tmp_path, family):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "out")
    want = pools(4).run((1, 2, 2, 1), _live_export, family, out)[0]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, want) <= TOL
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        assert tuple(f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()) == (4, 64, 64)


def _router_norms(grid):
    from axon4d.config import ModelConfig
    from axon4d.nn.moe import MoE

    out = {}
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    for k, norm in ((2, False), (1, True), (2, None)):
        torch.manual_seed(0)
        cfg = ModelConfig(
            n_layers=1,
            hidden=64,
            n_heads=4,
            arch="llama",
            n_experts=4,
            experts_per_token=k,
            expert_ffn=32,
            router_topk_norm=norm,
            moe_aux_coef=0.0,
        )
        layer = MoE(cfg)
        dense = layer.to_dense()
        y = axon4d.gather_batch(layer(axon4d.shard_batch(x)))
        out[(k, norm)] = (rel_err(y, dense(x)), dense(x).detach())
    return out


def test_router_topk_norm_matches_dense_moe(pools):
    got = pools(2).run((1, 1, 2, 1), _router_norms)[0]
    for key, (err, _) in got.items():
        assert err <= TOL, key
    # un-normalised top-2 gates differ from the default normalised ones, on the same weights
    assert rel_err(got[(2, False)][1], got[(2, None)][1]) > 1e-2
