"""Protects ``output_router_logits=True`` of Hugging Face MoE models under ``auto_parallelize``
(axon4d/parallelize/moe.py, ``HFMoE``, ``RouterAux``; docs/parallelize.md, "Auxiliary loss").

A tiny random Mixtral and Qwen3-MoE whose config asks for the router logits (and so for
transformers' load-balancing loss, weight ``router_aux_loss_coef``), on grids whose batch axis is
split (so the pooled statistics must be the whole batch's): each rank's router logits are its
tokens' rows of transformers' (gathered, they are transformers' per layer), the ranks' ``aux_loss``
and ``loss`` averaged are transformers', and every parameter's gradient is transformers' — with no
attention mask, and with one whose padding differs between the ranks.
"""

import copy

import pytest
import torch
from hf_models import mixtral_config, qwen3_moe_config

import axon4d
from axon4d.parallelize import auto_parallelize, to_dense

TOL = 1e-5
VOCAB, BATCH, SEQ = 128, 8, 8


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _model(family):
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    if family == "mixtral":
        cfg = mixtral_config(VOCAB, attn="eager")
    else:
        cfg = qwen3_moe_config(VOCAB, attn="eager")
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5  # large: a wrong aux loss shows in the loss and every router gradient
    return MixtralForCausalLM(cfg) if family == "mixtral" else Qwen3MoeForCausalLM(cfg)


def _compare(grid, family, masked, recompute="none"):
    torch.manual_seed(0)
    model = _model(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = None
    if masked:  # right padding, more of it in the first rows: the ranks' unmasked tokens differ
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[:3, -3:] = 0
        mask[5, -1:] = 0
    par = auto_parallelize(model, recompute=recompute)
    kw = {} if mask is None else {"attention_mask": axon4d.shard_batch(mask)}
    local = axon4d.shard_batch(ids)
    out = par(input_ids=local, labels=local, **kw)
    out.loss.backward()
    rout = ref(input_ids=ids, labels=ids, **({} if mask is None else {"attention_mask": mask}))
    rout.loss.backward()
    assert len(out.router_logits) == len(rout.router_logits) == 2
    errs = {"logits": rel_err(axon4d.gather_batch(out.logits), rout.logits)}
    for i, (got, want) in enumerate(zip(out.router_logits, rout.router_logits)):
        whole = axon4d.gather_batch(got.reshape(local.shape[0], SEQ, -1))
        errs[f"router_logits.{i}"] = rel_err(whole.reshape(want.shape), want)
    mean = lambda t: axon4d.gather_batch(t.detach().reshape(1)).mean()  # noqa: E731
    errs["aux_loss"] = rel_err(mean(out.aux_loss), rout.aux_loss)
    errs["loss"] = rel_err(mean(out.loss), rout.loss)
    dense = dict(to_dense(par, grads=True).named_parameters())
    for name, p in ref.named_parameters():
        errs[f"{name}.grad"] = rel_err(dense[name].grad, p.grad)
    return errs, float(rout.aux_loss)


@pytest.mark.parametrize(
    "family,grid,masked,recompute",
    [
        ("mixtral", (1, 1, 2, 2), False, "none"),
        ("mixtral", (2, 1, 1, 2), True, "none"),
        ("qwen3", (1, 2, 2, 1), True, "none"),
        ("qwen3", (2, 1, 1, 2), False, "none"),
        ("mixtral", (1, 2, 1, 2), True, "full"),  # the logits' graph kept through the re-run forward
    ],
)
def test_output_router_logits_matches_transformers(pools, family, grid, masked, recompute):
    results = pools(grid[0] * grid[1] * grid[2] * grid[3]).run(grid, _compare, family, masked, recompute)
    for rank, (errs, aux) in enumerate(results):
        assert aux > 0.5  # E·Σ f·P ≈ k for a near-uniform router: a real loss was compared
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{family} {grid} rank {rank}: {worst} error {errs[worst]:.2e}"


def _train(cfg_dict):
    import warnings

    from axon4d.train import TrainConfig, train

    warnings.simplefilter("ignore")
    summary = train(TrainConfig(**cfg_dict))
    return {k: summary.get(k) for k in ("losses", "single_process_losses", "max_rel_diff")}


def test_train_hf_adds_transformers_aux_loss_as_one_process_does(pools, tmp_path):
    """``axon4d train --hf`` of a Mixtral asking for its router logits: the job's loss is the
    cross-entropy plus transformers' pooled balance loss, the one-process run's (transformers'
    model, its ``aux_loss``) to 1e-5 over 2 steps on a grid whose batch axis is split."""
    from axon4d.data.tokens import SyntheticTokens

    vocab, seq = 320, 16
    torch.manual_seed(0)
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(vocab)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5
    path = str(tmp_path / "mixtral")
    MixtralForCausalLM(cfg).save_pretrained(path)
    job = dict(
        hf=path,
        grid="1,1,2,2",
        seq_len=seq,
        batch_size=4,
        micro_batches=2,
        steps=2,
        warmup_steps=1,
        lr=1e-2,
        out_dir=str(tmp_path / "run"),
        progress=False,
        peak_tflops=1.0,
        compare_single=True,
    )
    got = pools(4).run(None, _train, job)[0]
    assert got["max_rel_diff"] < 1e-5 and len(got["single_process_losses"]) == 2
    first = SyntheticTokens(vocab, seq, seed=0).batch(0, 8)
    model = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert model(input_ids=first, labels=first).aux_loss > 0.5  # 0.5·aux ≈ 1: the losses compared carry it
