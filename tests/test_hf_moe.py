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

import pytest
import torch
from hf_models import mixtral_config, qwen3_moe_config, save_moe

import axon4d
from axon4d.parallelize import auto_parallelize, load_pretrained_, to_dense
from axon4d.parallelize.moe import HFMoEBlock

TOL = 1e-5
VOCAB, BATCH, SEQ = 128, 8, 8


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _model(family, **kw):
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    if family.startswith("mixtral"):
        return MixtralForCausalLM(mixtral_config(VOCAB, top_k=1 if family == "mixtral_top1" else 2, attn="eager"))
    return Qwen3MoeForCausalLM(qwen3_moe_config(VOCAB, norm_topk_prob=family == "qwen3_norm", attn="eager"))


def _compare(grid, family):
    torch.manual_seed(0)
    model = _model(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    par = auto_parallelize(model)
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
    [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2), pytest.param((1, 2, 2, 2), marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_moe_families_match_transformers(pools, family, grid):
    _assert_close(pools(_world(grid)).run(grid, _compare, family), f"{family} {grid}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral_top1", "qwen3_norm"])
def test_router_variants_match_transformers(pools, family):
    grid = (1, 1, 2, 2)
    _assert_close(pools(_world(grid)).run(grid, _compare, family), f"{family} {grid}")
