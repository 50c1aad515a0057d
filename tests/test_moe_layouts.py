"""Protects MoE expert layouts (axon4d/grid/expert_layout.py, docs/moe.md "Placement and expert layouts"): on
8-rank grids, for each kind of layout — whole experts over x·y·z·data; experts split over x·y with
expert parallelism over data; expert parallelism over z with replicas over data; and mixed ones
(split over x only, over y only with the rows moved over x) — the MoE layer and an MoE model equal
the single-process ones (forward, every gradient, the loss, the gradient norm; ≤ 1e-5 relative),
under full recomputation and ZeRO-2, and a checkpoint saved under one layout resumes under another.
Start here when changing where experts run."""

import pytest
from test_moe import CASES, TOL, _check_layer
from test_moe import _assert_small as assert_layer
from test_moe_model import CFG, _check_model, _load_and_step, _step_and_save, _steps, rel_err

from axon4d.grid.expert_layout import ExpertLayout, candidates
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Term

#: (grid, layout): one of each kind the issue names, then mixed ones
LAYOUTS = {
    "whole-over-world": ((2, 2, 2, 1), "ep=world,tp=1"),
    "split-xy-ep-data": ((2, 2, 1, 2), "ep=data,tp=x·y"),
    "ep-z-replicas-data": ((2, 1, 2, 2), "ep=z,tp=x·y"),
    "split-x-ep-y-data": ((2, 2, 1, 2), "ep=y·data,tp=x"),
    "split-y-ep-x-z": ((2, 2, 2, 1), "ep=x·z,tp=y"),
    "whole-replicated": ((2, 2, 1, 2), "ep=1,tp=1"),
}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_the_moe_layer_under_each_expert_layout_equals_the_dense_layer(pools, kind):
    grid, layout = LAYOUTS[kind]
    cfg, starve = CASES["top2-shared-softmax"]
    results = pools(8).run(grid, _check_layer, cfg, starve, expert_layout=layout)
    assert_layer(results, f"{layout} on {grid}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_starved_top1_layer_under_each_expert_layout_equals_the_dense_layer(pools, kind):
    """Experts no token reaches (their ranks receive nothing), top-1 without shared experts."""
    grid, layout = LAYOUTS[kind]
    cfg = CASES["top1-plain-softmax"][0]
    assert_layer(pools(8).run(grid, _check_layer, cfg, 4, expert_layout=layout), f"starved {layout} on {grid}")


def _assert_small(results, label):
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{label} rank {rank}: {bad}"


@pytest.mark.parametrize("kind", ["whole-over-world", "split-xy-ep-data", "ep-z-replicas-data"])
def test_an_moe_model_under_each_layout_kind_with_full_recomputation_equals_the_dense_model(pools, kind):
    grid, layout = LAYOUTS[kind]
    cfg = CFG.replace(n_experts=8)
    _assert_small(pools(8).run(grid, _check_model, cfg, "full", 1, expert_layout=layout), f"{layout} on {grid}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["split-x-ep-y-data", "split-y-ep-x-z"])
def test_an_moe_model_under_a_mixed_layout_over_micro_batches_equals_the_dense_model(pools, kind):
    grid, layout = LAYOUTS[kind]
    cfg = CFG.replace(n_experts=8)
    _assert_small(pools(8).run(grid, _check_model, cfg, "full", 2, expert_layout=layout), f"{layout} on {grid}")


def _apart(sharded, plain, tol=1e-6):
    """The parameters whose sharded-optimizer values differ from the unsharded ones by more than
    ``tol`` relative, with their errors."""
    return {n: rel_err(sharded[n], p) for n, p in plain.items() if not rel_err(sharded[n], p) <= tol}


def _zero_and_the_replicas_reductions(grid, stage, cfg):
    """``_sharded_and_not``, and the ops the sharded steps reduced the expert replicas' gradients with."""
    grid.comm.log.clear()
    sharded = _steps(grid, stage, cfg)
    ops = {r.op.value for r in grid.comm.log.records if r.tag == Term.MOE_EXPERT_WEIGHT_GRAD}
    return sharded, _steps(grid, 0, cfg), sorted(ops)


@pytest.mark.parametrize("kind", ["whole-over-world", "split-xy-ep-data", "ep-z-replicas-data"])
def test_zero_2_under_each_layout_kind_equals_the_unsharded_optimizer(pools, kind):
    """Expert weights replicated over data (ep-z-replicas-data) are sharded by ZeRO like any
    replicated parameter — their gradients reduce-scattered over data, each rank receiving the sum
    of its own parts, as the 3D Linear weights' E12; held by one data rank each, they are stepped
    whole there and reduced over nothing."""
    grid, layout = LAYOUTS[kind]
    results = pools(8).run(grid, _zero_and_the_replicas_reductions, 2, CFG.replace(n_experts=8), expert_layout=layout)
    for rank, (sharded, plain, ops) in enumerate(results):
        assert not _apart(sharded, plain), f"{layout} on {grid} rank {rank}: {_apart(sharded, plain)}"
        assert ops == (["reduce_scatter"] if kind == "ep-z-replicas-data" else []), ops


@pytest.mark.slow
def test_under_zero_2_expert_replicas_over_an_axis_beyond_data_are_all_reduced_and_stay_exact(pools):
    """Replicas over z·data (whole experts over x): ZeRO shards over data alone, so their
    gradients are all-reduced over z·data and each rank's parts handed to the optimizer."""
    cfg = CFG.replace(n_experts=8)
    results = pools(8).run((2, 1, 2, 2), _zero_and_the_replicas_reductions, 2, cfg, expert_layout="ep=x,tp=1")
    for rank, (sharded, plain, ops) in enumerate(results):
        assert not _apart(sharded, plain), f"ep=x,tp=1 on (2,1,2,2) rank {rank}: {_apart(sharded, plain)}"
        assert ops == ["all_reduce"], ops


@pytest.mark.parametrize(
    "saved,loaded,zero",
    [
        (LAYOUTS["split-xy-ep-data"], LAYOUTS["whole-over-world"], 0),
        pytest.param(LAYOUTS["whole-over-world"], LAYOUTS["ep-z-replicas-data"], 2, marks=pytest.mark.slow),
        pytest.param(LAYOUTS["ep-z-replicas-data"], LAYOUTS["split-y-ep-x-z"], 1, marks=pytest.mark.slow),
    ],
)
def test_a_checkpoint_saved_under_one_expert_layout_resumes_under_another(pools, tmp_path, saved, loaded, zero):
    cfg = CFG.replace(n_experts=8)
    path = str(tmp_path / "ckpt")
    before = pools(8).run(saved[0], _step_and_save, cfg, path, zero, expert_layout=saved[1])[0]
    after = pools(8).run(loaded[0], _load_and_step, cfg, path, zero, expert_layout=loaded[1])
    for rank, got in enumerate(after):
        bad = {n: rel_err(got[n], p) for n, p in before.items() if not rel_err(got[n], p) <= TOL}
        assert not bad, f"rank {rank} after resuming {saved[1]} on {saved[0]} as {loaded[1]} on {loaded[0]}: {bad}"


def test_layout_text_round_trips_and_bad_layouts_name_what_would_work():
    for text in ("ep=world,tp=1", "ep=z·data,tp=x·y", "ep=y+data,tp=x", "ep=1,tp=y"):
        layout = ExpertLayout.parse(text)
        assert ExpertLayout.parse(str(layout)) == layout
    assert ExpertLayout.parse(None) == ExpertLayout.parse("ep=batch,tp=xy") == ExpertLayout()
    assert ExpertLayout.parse("ep=y·data,tp=x").dp == ("z",)
    assert ExpertLayout.parse("ep=world") == ExpertLayout.parse("ep=world,tp=1")  # tp: what ep leaves of x·y
    assert ExpertLayout.parse("ep=y·z") == ExpertLayout.parse("ep=y·z,tp=x")
    with pytest.raises(ValueError, match="axis x cannot both"):
        ExpertLayout.parse("ep=x,tp=x")
    with pytest.raises(ValueError, match="experts split only over x"):
        ExpertLayout.parse("ep=x,tp=z")
    with pytest.raises(ValueError, match="ep=<axes>,tp=<axes>"):
        ExpertLayout.parse("ep=x,ep=y")
    with pytest.raises(ValueError, match=r"n_experts = 6 is not divisible by G_x·G_y·G_z·G_data = 8.*ep=world,tp=1"):
        ExpertLayout.parse("ep=world,tp=1").check(GridShape(2, 2, 2, 1), 6, 16, 0, 32)


def test_candidates_are_every_distinct_layout_that_fits():
    shape = GridShape(2, 2, 1, 2)
    found = {str(c) for c in candidates(shape, 8, 16, 0, 32)}
    # 4 tensor-parallel choices × the subsets of the other live axes: 8 + 4 + 4 + 2
    assert len(found) == 18 and "ep=x·y·data,tp=1" in found and "ep=data,tp=x·y" in found
    assert "ep=z,tp=x·y" not in found  # z has one rank: it splits nothing
    assert {str(c) for c in candidates(shape, 2, 16, 0, 32)} >= {"ep=x,tp=y", "ep=1,tp=x·y"}
    assert not any("x·y·data" in str(c) for c in candidates(shape, 4, 16, 0, 32))  # 4 experts over 8 ranks


def _bf16_steps(grid, stage, cfg, micro):
    """Three AdamW steps in bf16-fp32-reduce, each of ``micro`` accumulated micro-batches, the
    optimizer sharded over data (``stage``, its gathers left in flight into the next forward as the
    training job does) or not (0): the model and its optimizer."""
    import torch

    import axon4d
    from axon4d.models.transformer import DenseTransformer, Transformer

    torch.manual_seed(7)
    model = Transformer.from_dense(DenseTransformer(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stage:
        opt = axon4d.shard_optimizer(opt, model, grid, stage=stage, overlap_gathers=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
        local = axon4d.shard_batch(ids)
        opt.zero_grad(set_to_none=True)
        for m, part in enumerate(local.chunk(micro)):
            loss = model.loss(part[:, :-1], part[:, 1:]) / micro
            if m < micro - 1:
                with grid.scheduler.accumulating():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    return model, opt


def _bf16_masters_against_unsharded(grid, stage, cfg, micro):
    """The dtypes the sharded run stores its experts in, and its fp32 masters' relative difference
    from the unsharded run's fp32 parameters (this rank's parts, over the whole model)."""
    import math

    import torch

    from axon4d.nn.moe_experts import GridExperts

    model, opt = _bf16_steps(grid, stage, cfg, micro)
    ref = dict(_bf16_steps(grid, 0, cfg, micro)[0].named_parameters())
    num = den = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            start, master = opt.owned(p)
            part = ref[name].detach().reshape(-1)[start : start + master.numel()]
            num += float((master - part).square().sum())
            den += float(part.square().sum())
    stored = {str(p.dtype) for m in model.modules() if isinstance(m, GridExperts) for p in m.parameters()}
    opt.release()
    return stored, math.sqrt(num / den)


@pytest.mark.parametrize("stage,micro", [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_zero_stores_expert_replicas_over_data_in_16_bits_and_steps_them_as_the_unsharded_optimizer(
    pools, stage, micro
):
    """Expert weights a layout replicates over data are stored in bf16 under ZeRO in mixed precision
    (their fp32 masters sharded over data, as the 3D Linear weights'); their gradients — summed over
    the micro-batches in fp32, reduced over the replicas (all-reduced under ZeRO-1, reduce-scattered
    under ZeRO-2), handed to the masters — step them as
    the unsharded optimizer steps its fp32 parameters (≤ 1e-6 relative over the model), with the
    gathers over data left in flight into the next forward, where the MoE layer's forward settles them."""
    grid, layout = LAYOUTS["ep-z-replicas-data"]
    cfg = CFG.replace(n_experts=8)
    results = pools(8).run(
        grid, _bf16_masters_against_unsharded, stage, cfg, micro, expert_layout=layout, precision="bf16-fp32-reduce"
    )
    for rank, (stored, gap) in enumerate(results):
        assert stored == {"torch.bfloat16"}, stored
        assert gap <= 1e-6, f"ZeRO-{stage} rank {rank}: masters differ from the unsharded parameters by {gap:.3g}"
