"""Protects DeepSeek-V3's routing options of axon4d's MoE (docs/moe.md, "DeepSeek-V3 routing"):
auxiliary-loss-free bias balancing, group-limited routing, the routed scaling factor, dense first
blocks and the sequence-wise balance loss. A tiny DeepSeek-style model with all of them on a 2-rank
and a 4-rank grid equals the one-process ``DenseTransformer`` (loss and every gradient ≤ 1e-5
relative in fp32, the bias after each forward), the bias is the same on every rank, moves toward
balance and comes back from a checkpoint on another grid; the defaults change nothing, and the
options refuse bad values with a ValueError naming the field."""

import pytest
import torch
from test_moe import TOL, rel_err

import axon4d
from axon4d import checkpoint
from axon4d.config import MOE_FIELDS, ModelConfig, get_config, moe_overrides
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn import moe_router
from axon4d.nn.mlp import DenseMLP
from axon4d.nn.moe import MoE
from axon4d.nn.moe_dense import DenseMoE

CFG = ModelConfig(
    n_layers=3,
    hidden=32,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    seq_len=8,
    arch="llama",
    n_experts=8,
    experts_per_token=2,
    expert_ffn=16,
    shared_experts=1,
    router_scoring="sigmoid",
    moe_aux_coef=0.0,
    moe_z_coef=1e-3,
    moe_bias_update_rate=0.02,
    n_groups=4,
    topk_groups=2,
    routed_scaling_factor=2.5,
    first_k_dense=1,
    moe_seq_aux_coef=0.05,
)
BATCH = 8


# -- the config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes,words",
    [
        (dict(n_groups=3), "not divisible by n_groups"),
        (dict(topk_groups=5), "topk_groups = 5 exceeds n_groups = 4"),
        (dict(topk_groups=1, experts_per_token=3), "exceeds the 2 experts"),
        (dict(topk_groups=0), "topk_groups = 0 must be at least 1"),
        (dict(n_groups=0), "n_groups = 0 must be at least 1"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor = 0.0 must be a finite number above 0"),
        (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor"),
        (dict(first_k_dense=4), "first_k_dense = 4 exceeds n_layers = 3"),
        (dict(first_k_dense=-1), "first_k_dense = -1 must be at least 0"),
        (dict(moe_bias_update_rate=-0.1), "moe_bias_update_rate = -0.1 must be a finite number ≥ 0"),
        (dict(moe_seq_aux_coef=float("nan")), "moe_seq_aux_coef"),
    ],
)
def test_the_deepseek_fields_refuse_bad_values_naming_the_field(changes, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        CFG.replace(**changes)


def test_the_defaults_keep_every_block_moe_and_the_counts_of_before():
    plain = ModelConfig(n_layers=3, hidden=32, n_heads=4, n_experts=8, experts_per_token=2)
    assert (plain.n_groups, plain.topk_groups, plain.first_k_dense) == (1, None, 0)
    assert (plain.moe_bias_update_rate, plain.routed_scaling_factor, plain.moe_seq_aux_coef) == (0.0, 1.0, 0.0)
    assert [plain.moe_block(i) for i in range(3)] == [True] * 3 and plain.moe_layers == 3
    dense = plain.replace(n_experts=0)
    assert dense.moe_layers == 0 and not dense.moe_block(0)
    # a dense first block counts the dense MLP's parameters and FLOPs, the others the MoE's
    mixed = plain.replace(first_k_dense=1)
    assert 3 * mixed.n_params() == 2 * plain.n_params() + dense.n_params()
    assert mixed.flops_per_token() == pytest.approx((2 * plain.flops_per_token() + dense.flops_per_token()) / 3)


def test_the_fields_reach_the_job_and_tiny_deepseek_is_in_the_size_table():
    got = moe_overrides("moe_bias_update_rate=0.001,n_groups=4,topk_groups=2,routed_scaling_factor=2.5,first_k_dense=1")
    assert got == dict(
        moe_bias_update_rate=0.001, n_groups=4, topk_groups=2, routed_scaling_factor=2.5, first_k_dense=1
    )
    assert "moe_seq_aux_coef" in MOE_FIELDS
    cfg = get_config("tiny-deepseek")
    assert cfg.moe and cfg.first_k_dense == 1 and cfg.n_groups == 4 and cfg.moe_bias_update_rate > 0
    model = DenseTransformer(cfg)
    assert isinstance(model.blocks[0].mlp, DenseMLP) and isinstance(model.blocks[1].mlp, DenseMoE)
    assert "blocks.1.mlp.expert_bias" in model.state_dict()  # a buffer, saved with the model
    assert "blocks.1.mlp.expert_bias" not in dict(model.named_parameters())


# -- the router -----------------------------------------------------------------------------------
def test_defaults_route_bit_for_bit_as_before():
    s = torch.rand(64, 8, generator=torch.Generator().manual_seed(0))
    chosen = torch.topk(s, 2, dim=-1).indices
    assert torch.equal(moe_router.choose(s, 2), chosen)
    assert torch.equal(moe_router.choose(s, 2, None, 4, 4), chosen)  # every group kept: no limit
    g = s.gather(1, chosen)
    assert torch.equal(moe_router.gates(s, chosen), g / g.sum(dim=-1, keepdim=True))


def test_group_limited_routing_chooses_within_the_best_groups_by_their_top_two():
    # 4 groups of 2; group 0 has the single highest score but a low second one
    s = torch.tensor([[0.99, 0.0, 0.6, 0.55, 0.5, 0.5, 0.1, 0.1]])
    chosen = moe_router.choose(s, 2, None, 4, 2)  # groups by top-2 sum: 1 (1.15), 2 (1.0), 0 (0.99)
    assert sorted(chosen[0].tolist()) == [2, 3]
    chosen = moe_router.choose(s, 3, None, 4, 2)
    assert set(chosen[0].tolist()) <= {2, 3, 4, 5}
    # the bias enters the group ranking: group 0 lifted above group 2
    bias = torch.tensor([0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert sorted(moe_router.choose(s, 2, bias, 4, 2)[0].tolist()) == [0, 2]


def test_the_bias_changes_the_choice_but_not_the_gates_and_the_factor_scales_them():
    s = torch.tensor([[0.9, 0.8, 0.7, 0.1]])
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0])
    chosen = moe_router.choose(s, 2, bias)
    assert chosen[0].tolist() == [2, 0]  # 1.2 and 0.9: expert 2 by its bias
    g = moe_router.gates(s, chosen, True, 2.5)
    assert torch.allclose(g, 2.5 * torch.tensor([[0.7, 0.9]]) / 1.6)  # the unbiased scores


def test_the_bias_step_follows_the_sign_of_mean_minus_count():
    bias = torch.zeros(4)
    moe_router.bias_step(bias, [5, 3, 4, 4], 0.1)  # mean 4
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])


def test_the_sequence_wise_loss_is_the_mean_of_each_sequence_s_balance():
    s = torch.rand(12, 4, generator=torch.Generator().manual_seed(3))
    chosen = moe_router.choose(s, 2)
    got = moe_router.sequence_balance_loss(s, chosen, 4, "sigmoid")
    want = []
    for q in range(3):
        rows = slice(4 * q, 4 * q + 4)
        f = torch.bincount(chosen[rows].reshape(-1), minlength=4).float() * 4 / (2 * 4)
        p = (s[rows] / s[rows].sum(-1, keepdim=True)).mean(0)
        want.append((f * p).sum())
    assert torch.allclose(got, torch.stack(want).mean())


def test_bias_balancing_moves_toward_balance():
    """A router skewed toward expert 0: forwards in training mode lower its bias and raise the
    starved ones', and the imbalance (max/mean of the assignments) falls; evaluation leaves the bias."""
    cfg = CFG.replace(n_groups=1, topk_groups=None, moe_bias_update_rate=0.01)
    torch.manual_seed(0)
    layer = DenseMoE(cfg)
    with torch.no_grad():
        layer.router.weight[0] += 0.3  # every token leans to expert 0
    x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(1))

    def imbalance():
        c = layer.tokens_per_expert.float()
        return float(c.max() / c.mean())

    with torch.no_grad():
        layer(x)
        first = imbalance()
        layer.eval()
        layer(x)
        assert float(layer.expert_bias.abs().max()) == pytest.approx(0.01)  # one step: eval moved nothing
        layer.train()
        for _ in range(60):
            layer(x)
    assert imbalance() < 0.75 * first, (first, imbalance())
    assert float(layer.expert_bias[0]) < 0


# -- on the grid ----------------------------------------------------------------------------------
def _check(grid, cfg, recompute, micro, warm):
    """``warm`` training-mode forwards (no backward) on other tokens move the bias first; then a
    step over ``micro`` micro-batches. Returns the errors against the one-process model and this
    rank's biases (to compare across ranks)."""
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense, recompute=recompute)
    gen = torch.Generator().manual_seed(1)
    errs = {}
    for _ in range(warm):
        other = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=gen)
        with torch.no_grad():
            model(axon4d.shard_batch(other))
            dense(other)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=gen)
    local_ids, local_targets = axon4d.shard_batch(ids), axon4d.shard_batch(targets)
    per, b = local_ids.shape[0] // micro, local_ids.shape[0]
    total = 0.0
    for m in range(micro):
        part = slice(m * per, (m + 1) * per)
        loss = model.loss(local_ids[part], local_targets[part]) / micro
        if m < micro - 1:
            with grid.scheduler.accumulating():
                loss.backward()
        else:
            loss.backward()
        total += loss.detach()
    ref_total = torch.zeros(())
    g_batch = grid.size("batch")
    for m in range(micro):
        rows = [r * b + m * per + i for r in range(g_batch) for i in range(per)]
        ref = dense.loss(ids[rows], targets[rows]) / micro
        ref.backward()
        ref_total += ref.detach()
    mean = grid.comm.all_reduce(total.reshape(1).clone(), "batch").wait() / g_batch
    errs["loss"] = rel_err(mean, ref_total.reshape(1))
    got = dict(model.to_dense(grads=True).named_parameters())
    for name, p in dense.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    biases = {n: t.clone() for n, t in model.named_buffers() if n.endswith("expert_bias")}
    for name, t in dense.named_buffers():
        if name.endswith("expert_bias"):
            errs[f"{name} (bias)"] = float((biases[name] - t).abs().max())
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    errs["moe layers"] = float(len(moes) != cfg.n_layers - cfg.first_k_dense)
    errs["bias moved"] = float(not all(bool(t.abs().max() > 0) for t in biases.values()))
    return errs, biases


def _assert(results, label):
    for rank, (errs, _) in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{label} rank {rank}: {bad}"
    first = results[0][1]
    for rank, (_, biases) in enumerate(results):
        for name, t in biases.items():
            assert torch.equal(t, first[name]), f"{label}: rank {rank}'s {name} differs from rank 0's"


@pytest.mark.parametrize("grid,recompute", [((1, 1, 2, 1), "none"), ((1, 2, 1, 1), "full")])
def test_a_deepseek_model_on_two_ranks_equals_one_process(pools, grid, recompute):
    _assert(pools(2).run(grid, _check, CFG, recompute, 1, 2), f"{recompute} on {grid}")


def test_a_deepseek_model_over_micro_batches_equals_one_process(pools):
    """Each micro-batch's forward moves the bias, on the grid as in one process."""
    _assert(pools(2).run((1, 1, 1, 2), _check, CFG, "full", 2, 1), "micro-batches on (1,1,1,2)")


@pytest.mark.parametrize("grid", [(1, 2, 2, 1), (2, 1, 1, 2)])
def test_a_deepseek_model_on_four_ranks_equals_one_process(pools, grid):
    _assert(pools(4).run(grid, _check, CFG, "none", 1, 2), f"on {grid}")


def _save(grid, cfg, path):
    torch.manual_seed(7)
    model = Transformer.from_dense(DenseTransformer(cfg))
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    checkpoint.save(path, model, grid, step=1)
    return {n: t.clone() for n, t in model.named_buffers() if n.endswith("expert_bias")}


def _load(grid, cfg, path):
    model = Transformer(cfg)
    checkpoint.load(path, model, grid)
    return {n: t.clone() for n, t in model.named_buffers() if n.endswith("expert_bias")}


def test_the_bias_comes_back_from_a_checkpoint_on_another_grid(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools(2).run((1, 1, 2, 1), _save, CFG, path)[0]
    assert saved and all(bool(t.abs().max() > 0) for t in saved.values())
    for rank, got in enumerate(pools(2).run((1, 2, 1, 1), _load, CFG, path)):
        for name, t in saved.items():
            assert torch.equal(got[name], t), f"rank {rank}: {name}"


def _meta_and_context(grid, cfg):
    from axon4d.materialize import materialize_

    model = materialize_(Transformer(cfg, device="meta"), 3)
    biases = [t for n, t in model.named_buffers() if n.endswith("expert_bias")]
    made = len(biases) == cfg.n_layers - cfg.first_k_dense and all(
        not t.is_meta and not bool(t.abs().max() > 0) for t in biases
    )
    try:
        Transformer(cfg, context_parallel=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return made, refused


def test_meta_models_get_zero_biases_and_context_parallelism_refuses_the_sequence_loss(pools):
    for made, refused in pools(2).run((1, 1, 2, 1), _meta_and_context, CFG):
        assert made
        assert "moe_seq_aux_coef > 0 (the sequence-wise balance loss) needs whole sequences" in refused
