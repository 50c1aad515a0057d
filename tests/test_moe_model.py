"""Protects Mixture-of-Experts models on the grid (docs/moe.md): a ``Transformer`` whose config has
MoE fields equals ``DenseTransformer`` — loss (cross-entropy plus balance and z-loss), every
gradient, and the global gradient norm clipping uses (each expert weight counted once) — under every
recompute mode (full recomputation re-runs no routing decision and no host sync) and over
micro-batches, on grids with z > 1 and data > 1."""

import pytest
import torch
from test_moe import TOL, rel_err

import axon4d
from axon4d import checkpoint
from axon4d.config import ModelConfig
from axon4d.grads import clip_grad_norm_, grad_norm
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.moe import MoE
from axon4d.nn.moe_dense import DenseMoE

CFG = ModelConfig(
    n_layers=2,
    hidden=32,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    seq_len=8,
    arch="llama",
    n_experts=4,
    experts_per_token=2,
    expert_ffn=16,
    shared_experts=1,
    moe_aux_coef=0.05,
    moe_z_coef=1e-3,
)
BATCH = 8


def _micro_rows(world_rows, g_batch, micro):
    """The global rows of each micro-batch when each rank splits its shard of ``world_rows`` into ``micro``."""
    b = world_rows // g_batch
    per = b // micro
    return [[r * b + m * per + i for r in range(g_batch) for i in range(per)] for m in range(micro)]


def _check_model(grid, cfg, recompute, micro, probes=0):
    """``probes``: forwards with gradients enabled and no backward (an evaluation written without
    ``no_grad``) on other tokens before the step, whose routing must not reach the step's backward."""
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense, recompute=recompute)
    for layer in dense.modules():  # the reference casts the rows as an FP8 dispatch moves them
        if isinstance(layer, DenseMoE):
            layer.fp8_dispatch = ExpertLayout.parse(grid.expert_layout).fp8_dispatches(grid.shape)
    gen = torch.Generator().manual_seed(1)
    for _ in range(probes):
        other = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=gen)
        model.loss(axon4d.shard_batch(other), axon4d.shard_batch(other))  # dropped: no backward
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=gen)
    local_ids, local_targets = axon4d.shard_batch(ids), axon4d.shard_batch(targets)
    per = local_ids.shape[0] // micro
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
    for rows in _micro_rows(BATCH, grid.size("batch"), micro):
        ref = dense.loss(ids[rows], targets[rows]) / micro
        ref.backward()
        ref_total += ref.detach()
    mean = grid.comm.all_reduce(total.reshape(1).clone(), "batch").wait() / grid.size("batch")
    errs = {"loss": rel_err(mean, ref_total.reshape(1))}
    norm = grad_norm(model, grid)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])
    errs["grad_norm"] = rel_err(norm.reshape(1), ref_norm.reshape(1))
    got = dict(model.to_dense(grads=True).named_parameters())
    for name, p in dense.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    # one host sync per forward, none in a re-run: full recomputation reused each routing
    errs["extra_exchanges"] = float(sum(m.exchanges for m in moes) - len(moes) * (micro + probes))
    # nor an all-to-all: the re-run adopts the rows its forward's dispatches delivered and stops
    # before the combines (the backward's own exchanges are the dispatch's and combine's ".grad")
    rerun = [r for r in grid.comm.log.records if r.phase == "backward" and str(r.tag) in EXCHANGES]
    errs["rerun_all_to_alls"] = float(len(rerun))
    return errs


#: the MoE layer's forward all-to-alls (E16), which a re-run of a recomputed forward would log in backward
EXCHANGES = ("moe.dispatch", "moe.combine")


def _check_without_early_stop(grid, cfg, layout):
    """``_check_model`` under full recomputation with torch's checkpoint told not to stop a re-run
    early: the re-run then reaches its combines, which exchange there (lazily) and are exact too."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        errs = _check_model(grid, cfg, "full", 1)
    errs["rerun_all_to_alls"] = 0.0 if errs["rerun_all_to_alls"] > 0 else 1.0  # the combines, re-run
    return errs


def _assert_small(results, label):
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{label} rank {rank}: {bad}"


@pytest.mark.parametrize("recompute", ["none", "selective", "balanced", "full"])
def test_moe_model_equals_the_dense_model_under_every_recompute_mode(pools, recompute):
    _assert_small(pools(2).run((1, 1, 2, 1), _check_model, CFG, recompute, 1), f"{recompute} on (1,1,2,1)")


@pytest.mark.parametrize("layout", ["ep=batch,tp=1", "ep=batch,tp=1,dispatch=fp8"])
def test_full_recomputation_exchanges_no_rows_again_and_stays_exact(pools, layout):
    """Under full recomputation each MoE block's re-run takes the payload its forward's dispatch
    delivered (in FP8 too) and stops before its combines: no all-to-all in backward but the
    gradients' own, and the step equals the dense model's; with torch's early stop off the re-run
    reaches its combines, which then exchange, and the step is exact still."""
    cfg = CFG.replace(hidden=128, n_heads=4)  # FP8 rows: whole blocks of 128 features
    grid = (1, 1, 2, 1)
    _assert_small(pools(2).run(grid, _check_model, cfg, "full", 1, expert_layout=layout), f"{layout} on {grid}")
    _assert_small(
        pools(2).run(grid, _check_without_early_stop, cfg, layout, expert_layout=layout), f"{layout}, no early stop"
    )


def _combine_gradients_in_flight(grid):
    """For each combine gradient's all-to-all of a fully recomputed one-block MoE model's backward:
    whether one of the block's re-run weight gathers (E10f, which only the re-run issues in
    backward) was issued after it and before it was waited for."""
    torch.manual_seed(0)
    cfg = CFG.replace(n_layers=1)
    model = Transformer(cfg, recompute="full")
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    loss = model.loss(axon4d.shard_batch(ids), axon4d.shard_batch(ids))
    grid.comm.log.clear()
    loss.backward()
    records = grid.comm.log.records
    rerun = [r.t_issue for r in records if r.phase == "backward" and str(r.tag) == "E10f"]
    combines = [r for r in records if str(r.tag) == "moe.combine.grad"]
    return [any(c.t_issue < t < c.t_wait_start for t in rerun) for c in combines]


def test_under_full_recomputation_the_combine_gradients_travel_during_the_re_run(pools):
    """The overlap the planner credits (``cost``'s ``moe_rerun``): the combine gradients' all-to-alls
    are issued before the block's re-run and waited for after it has started."""
    for rank, flags in enumerate(pools(2).run((1, 1, 2, 1), _combine_gradients_in_flight)):
        assert flags and all(flags), f"rank {rank}: combine gradients in flight during the re-run: {flags}"


@pytest.mark.parametrize("grid", [(1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1)])
def test_a_forward_without_backward_leaves_no_routing_for_the_next_backward(pools, grid):
    """Full recomputation re-runs each block's forward in backward with the routing that forward
    chose, kept with its autograd state: forwards never differentiated (two here, on other tokens)
    leave none behind for the step's re-runs to take."""
    _assert_small(pools(2).run(grid, _check_model, CFG, "full", 1, 2), f"probes then a step on {grid}")


def test_moe_model_over_micro_batches_equals_the_dense_model(pools):
    _assert_small(pools(2).run((1, 1, 1, 2), _check_model, CFG, "full", 2), "micro-batches on (1,1,1,2)")


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 1, 4)])
def test_moe_model_on_eight_ranks_equals_the_dense_model(pools, grid):
    gpt = CFG.replace(arch="gpt", experts_per_token=1, shared_experts=0, n_experts=8, n_kv_heads=None)
    for cfg in (CFG.replace(n_experts=8), gpt):
        _assert_small(pools(8).run(grid, _check_model, cfg, "none", 1), f"{cfg.arch} on {grid}")


def _step_and_save(grid, cfg, path, zero):
    """One AdamW step of the model made from the seeded dense one, saved with its optimizer."""
    torch.manual_seed(7)
    model = Transformer.from_dense(DenseTransformer(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if zero:
        opt = axon4d.shard_optimizer(opt, model, grid, stage=zero)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
    model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    opt.step()
    checkpoint.save(path, model, grid, opt, step=1)
    return _second_step(grid, model, opt, cfg)


def _second_step(grid, model, opt, cfg):
    """The dense weights after one more step on a fixed batch: equal when the optimizer state came back whole."""
    opt.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
    model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.to_dense().named_parameters()}


def _load_and_step(grid, cfg, path, zero):
    torch.manual_seed(99)  # other weights: the load must replace them all
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if zero:
        opt = axon4d.shard_optimizer(opt, model, grid, stage=zero)
    checkpoint.load(path, model, grid, opt)
    return _second_step(grid, model, opt, cfg)


@pytest.mark.parametrize(
    "saved_on,loaded_on,zero",
    [
        ((2, (1, 1, 2, 1)), (2, (1, 2, 1, 1)), 0),  # expert-parallel size 2 → 1
        pytest.param((4, (1, 1, 2, 2)), (2, (1, 1, 1, 2)), 1, marks=pytest.mark.slow),  # EP 4 → 2, ZeRO-1 over data
        pytest.param((4, (1, 2, 2, 1)), (4, (2, 1, 2, 1)), 2, marks=pytest.mark.slow),  # x·y split changes, ZeRO-2
    ],
)
def test_a_moe_checkpoint_resumes_on_another_grid_and_expert_parallel_size(pools, tmp_path, saved_on, loaded_on, zero):
    cfg = CFG.replace(n_experts=4)
    path = str(tmp_path / "ckpt")
    before = pools(saved_on[0]).run(saved_on[1], _step_and_save, cfg, path, zero)[0]
    after = pools(loaded_on[0]).run(loaded_on[1], _load_and_step, cfg, path, zero)
    for rank, got in enumerate(after):
        bad = {n: rel_err(got[n], p) for n, p in before.items() if not rel_err(got[n], p) <= TOL}
        assert not bad, f"rank {rank} after resuming on {loaded_on[1]}: {bad}"


def _steps(grid, stage, cfg=CFG):
    """Three clipped AdamW steps, with the optimizer sharded over data (``stage``) or not (0): the
    dense weights after them."""
    torch.manual_seed(7)
    model = Transformer.from_dense(DenseTransformer(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stage:
        opt = axon4d.shard_optimizer(opt, model, grid, stage=stage)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
        clip_grad_norm_(model, 0.5, grid)
        opt.step()
    if stage:
        opt.release()
    return {n: p.detach().clone() for n, p in model.to_dense().named_parameters()}


def _sharded_and_not(grid, stage, cfg=CFG):
    return _steps(grid, stage, cfg), _steps(grid, 0, cfg)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_data_steps_expert_weights_whole_on_the_rank_that_holds_them(pools, stage):
    """ZeRO over data equals the unsharded optimizer on the same grid (≤ 1e-6 per tensor), expert
    weights included, which each data rank steps whole; and the model follows the one-process one
    (≤ 1e-5 over the whole model: Adam turns a gradient at rounding level into a step of up to lr)."""
    torch.manual_seed(7)
    dense = DenseTransformer(CFG)
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        dense.loss(ids[:, :-1], ids[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
        opt.step()
    ref = dict(dense.named_parameters())
    for rank, (sharded, plain) in enumerate(pools(2).run((1, 1, 1, 2), _sharded_and_not, stage)):
        bad = {n: rel_err(sharded[n], p) for n, p in plain.items() if not rel_err(sharded[n], p) <= 1e-6}
        assert not bad, f"ZeRO-{stage} rank {rank} against the unsharded optimizer: {bad}"
        diff = torch.cat([(sharded[n] - p).detach().reshape(-1) for n, p in ref.items()]).norm()
        whole = torch.cat([p.detach().reshape(-1) for p in ref.values()]).norm()
        assert diff / whole <= TOL, f"ZeRO-{stage} rank {rank}: {diff / whole:.1e} from the one-process model"
