"""Context parallelism for Hugging Face models (axon4d.parallelize.context, docs/context.md): a Llama
(GQA) parallelized with ``auto_parallelize(model, context_parallel=True)`` on grids that split
sequences over z, fed ``axon4d.parallelize.context.inputs(ids)``, equals the unparallelized model on
the full sequences — logits, loss and every gradient — through transformers' AttentionInterface,
with no model code patched; GQA ratios 1, 2 and 4 (8 query heads, 8, 4 or 2 key/value heads) with
the heads split over y; and in the ring mode (``context_parallel="ring"``)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import llama_config
from test_parallelize import rel_err

from axon4d import activations
from axon4d.layout.geometry import Term
from axon4d.parallelize import auto_parallelize, to_dense
from axon4d.parallelize.context import ATTENTION_NAME, inputs

pytest.importorskip("transformers")

TOL = 2e-5
VOCAB, BATCH, SEQ = 128, 4, 16


def _llama(kv_heads: int):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(VOCAB, attn="sdpa", heads=8, kv_heads=kv_heads))


def _compare(grid, kv_heads, recompute, mode=True):
    torch.manual_seed(0)
    model = _llama(kv_heads)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    par = auto_parallelize(model, grid=grid, context_parallel=mode, recompute=recompute)
    assert model.config._attn_implementation == ATTENTION_NAME
    par.train()
    out = par(**inputs(ids, grid))
    out.loss.backward()
    rout = ref(input_ids=ids, labels=ids)
    rout.loss.backward()
    # this rank's logits are its head–tail chunks of every sequence of its data rank: put them back
    full = activations.gather_sequence(out.logits.detach(), grid)
    errs = {"logits": rel_err(full, rout.logits)}
    tags = (Term.CP_KV_RING, Term.CP_KV_RING_GRAD) if mode == "ring" else (Term.CP_KV, Term.CP_KV_GRAD)
    kv = [r for r in grid.comm.log.records if r.tag in tags]
    dense = to_dense(par, grads=True)
    got = dict(dense.named_parameters())
    for name, p in ref.named_parameters():
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    loss = grid.comm.all_reduce(out.loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
    errs["loss"] = rel_err(loss, rout.loss.detach().reshape(1))
    return errs, len(kv)


@pytest.mark.parametrize(
    "grid,kv_heads,recompute",
    [
        ((1, 1, 2, 1), 2, "none"),
        pytest.param((1, 2, 2, 1), 8, "none", marks=pytest.mark.slow),  # GQA ratios 1, 2 and 4, kv heads over y
        pytest.param((1, 2, 2, 1), 4, "none", marks=pytest.mark.slow),
        pytest.param((1, 2, 2, 1), 2, "none", marks=pytest.mark.slow),
        ((1, 1, 4, 1), 2, "selective"),
        pytest.param((2, 1, 2, 1), 2, "full", marks=pytest.mark.slow),
        pytest.param((1, 1, 2, 2), 2, "none", marks=pytest.mark.slow),
    ],
)
def test_context_parallel_llama_matches_the_unparallelized_model(pools, grid, kv_heads, recompute):
    world = grid[0] * grid[1] * grid[2] * grid[3]
    for rank, (errs, kv) in enumerate(pools(world).run(grid, _compare, kv_heads, recompute)):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"rank {rank} on {grid}: {worst} error {errs[worst]:.2e}"
        assert kv >= 2 * 2  # one K/V all-gather and one reduce-scatter per layer, through the comm log


@pytest.mark.parametrize(
    "grid,recompute", [((1, 2, 4, 1), "none"), pytest.param((1, 1, 4, 1), "selective", marks=pytest.mark.slow)]
)
def test_the_ring_mode_runs_through_the_model_s_own_attention(pools, grid, recompute):
    """``context_parallel="ring"``: the keys and values passed around z (axon4d.nn.context_ring),
    the same logits, loss and gradients as the unparallelized model; G_z − 1 forward shifts, G_z − 1
    and G_z backward per layer (selective: the forward's ring again)."""
    world = grid[0] * grid[1] * grid[2] * grid[3]
    shifts = 2 * (3 + 3 + 4 + (3 if recompute == "selective" else 0))  # two layers, G_z = 4
    for rank, (errs, kv) in enumerate(pools(world).run(grid, _compare, 2, recompute, "ring")):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"rank {rank} on {grid}: {worst} error {errs[worst]:.2e}"
        assert kv == shifts


def _refused(grid):
    model = auto_parallelize(_llama(2), grid=grid, context_parallel=True)
    ids = torch.randint(0, VOCAB, (BATCH, 12))
    with pytest.raises(ValueError, match="multiple of 8"):
        inputs(ids, grid)
    with pytest.raises(ValueError, match="padding"):
        model(
            **inputs(torch.randint(0, VOCAB, (BATCH, SEQ)), grid),
            attention_mask=torch.zeros(BATCH, SEQ // 4, dtype=torch.long),
        )
    return True


def test_sequences_that_do_not_split_are_refused_on_every_rank(pools):
    assert all(pools(4).run((1, 1, 4, 1), _refused))
