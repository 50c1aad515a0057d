"""Protects the Mixture-of-Experts layer on the grid (axon4d/nn/moe.py, docs/moe.md): forward output,
input gradient, router, expert and shared-expert gradients, the auxiliary losses and the tokens per
expert equal the single-process ``DenseMoE`` within fp32 rounding (≤ 1e-5 relative) on grids with x,
y, z and data split, top-1 and top-2, softmax and sigmoid scoring, with and without shared experts,
and when a rank of the expert-parallel axis receives no token at all. The inputs give every token's
top-k scores a margin, so a different reduction order cannot flip a choice. Start here when
changing the routing, the dispatch plan or the grouped GEMMs."""

import pytest
import torch
from harness import value_errors

import axon4d
from axon4d.config import ModelConfig
from axon4d.device import grouped
from axon4d.nn.moe import MoE
from axon4d.nn.moe_dense import DenseMoE
from axon4d.nn.moe_routes import share_sizes

TOL = 1e-5
FLOOR = 1e-3


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(FLOOR))


def moe_config(k=2, shared=1, scoring="softmax", arch="llama", experts=8, z_coef=1e-3):
    return ModelConfig(
        n_layers=1,
        hidden=32,
        n_heads=4,
        vocab_size=64,
        seq_len=8,
        arch=arch,
        n_experts=experts,
        experts_per_token=k,
        expert_ffn=16,
        shared_experts=shared,
        router_scoring=scoring,
        moe_aux_coef=0.05,
        moe_z_coef=z_coef,
    )


def margin_inputs(dense, tokens, seed, starve=0):
    """(tokens, hidden) inputs whose router logits are a per-token permutation of well separated
    levels (a gap of 0.6 between neighbours) plus small noise, so the top-k order has a margin;
    ``starve``: the last ``starve`` experts always get the lowest levels (no token reaches them)."""
    gen = torch.Generator().manual_seed(seed)
    e, h = dense.router.weight.shape
    q, _ = torch.linalg.qr(torch.randn(h, e, generator=gen))  # (h, E) orthonormal columns
    with torch.no_grad():
        dense.router.weight.copy_(q.t())
    levels = torch.arange(e, dtype=torch.float32) * 0.6 - 1.5
    rows = []
    for _ in range(tokens):
        perm = torch.randperm(e - starve, generator=gen)
        order = torch.cat([torch.arange(e - starve, e), perm])  # expert order[i] gets levels[i], the lowest first
        a = torch.empty(e)
        a[order] = levels
        rows.append(q @ a + 0.01 * torch.randn(h, generator=gen))
    return torch.stack(rows)


def _check_layer(grid, cfg, starve, policy=None):
    if policy is not None:
        with grid.scheduler.using(policy):
            errs = _check_layer(grid, cfg, starve)
        dispatches = [r for r in grid.comm.log.records if str(r.tag) == "moe.dispatch"]
        errs["dispatch_chunks"] = 0.0 if len(dispatches) == policy["forward_chunks"] else float(len(dispatches))
        return errs
    grid.comm.log.clear()
    torch.manual_seed(5)
    dense = DenseMoE(cfg)
    b, s = 4, cfg.seq_len
    x_full = margin_inputs(dense, b * s, seed=9, starve=starve).view(b, s, cfg.hidden)
    mod = MoE(cfg).load_dense_(dense)
    v = torch.randn(cfg.hidden)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    y = mod(x)
    loss = (y * axon4d.shard_features(v, "x")).sum().div(y.shape[0] * y.shape[1]) + mod.aux_loss
    loss.backward()
    xr = x_full.clone().requires_grad_()
    yr = dense(xr)
    ref = (yr * v).sum().div(b * s) + dense.aux_loss
    ref.backward()
    errs = {"forward": rel_err(axon4d.gather_batch(axon4d.gather_features(y, "x")), yr)}
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch")
    errs["input_grad"] = rel_err(dx, xr.grad)
    aux = grid.comm.all_reduce(mod.aux_loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
    errs["aux_loss"] = rel_err(aux, dense.aux_loss.reshape(1))
    got = dict(mod.to_dense(grads=True).named_parameters())
    for name, p in dense.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    # each y rank dispatches only its share of the tokens: over y the rows cross batch once (E16),
    # each row with its gate's 4 bytes
    sent = sum(r.payload_bytes for r in grid.comm.log.records if str(r.tag) == "moe.dispatch")
    share = share_sizes(b * s // grid.size("batch"), grid.size("y"))[grid.coord("y")]
    features = cfg.hidden // grid.size("x")
    if mod.rows_over_x:  # its expert layout does not split experts over x: the share is cut over x too
        share, features = share_sizes(share, grid.size("x"))[grid.coord("x")], cfg.hidden
    want = share * cfg.experts_per_token * (features + 1) * 4 if mod.experts.ep_axis is not None else 0
    errs["dispatch_bytes"] = abs(sent - want) / max(want, 1)
    counts = dense.tokens_per_expert.tolist()
    errs["tokens_per_expert"] = 0.0 if mod.tokens_per_expert == counts else 1.0
    errs["starved"] = 0.0 if not starve or sum(counts[-starve:]) == 0 else 1.0
    return errs


def _assert_small(results, label):
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{label} rank {rank}: {bad}"


CASES = {
    "top2-shared-softmax": (moe_config(), 0),
    "top1-plain-softmax": (moe_config(k=1, shared=0, arch="gpt"), 0),
    "top2-sigmoid": (moe_config(scoring="sigmoid", shared=0), 0),
    "top2-starved": (moe_config(shared=1), 4),  # experts 4..7 get no token: their ranks receive nothing
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_on_one_rank_equals_the_dense_layer(pools, case):
    cfg, starve = CASES[case]
    _assert_small(pools(1).run((1, 1, 1, 1), _check_layer, cfg, starve), f"{case} on (1,1,1,1)")


@pytest.mark.parametrize(
    "world,grid",
    [
        (2, (1, 1, 2, 1)),  # z: experts over z
        pytest.param(2, (1, 1, 1, 2), marks=pytest.mark.slow),  # data: experts over data
        (4, (2, 2, 1, 1)),  # x, y: each expert split over x·y, shares over y
        pytest.param(8, (2, 2, 2, 1), marks=pytest.mark.slow),
        pytest.param(8, (1, 2, 2, 2), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_on_grids_equals_the_dense_layer(pools, world, grid, case):
    cfg, starve = CASES[case]
    _assert_small(pools(world).run(grid, _check_layer, cfg, starve), f"{case} on {grid}")


CHUNKED = {"forward_chunks": 3, "min_chunk_kb": 0}  # tiny test tensors: chunk anyway


@pytest.mark.parametrize("world,grid", [(2, (1, 1, 2, 1)), pytest.param(8, (2, 2, 1, 2), marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", ["top2-shared-softmax", "top2-starved"])
def test_moe_layer_dispatched_in_overlapped_chunks_equals_the_dense_layer(pools, world, grid, case):
    """Each share's tokens in 3 chunks: every chunk's all-to-all is issued before the first chunk's
    expert GEMMs, the combine of chunk i left in flight behind chunk i+1's (docs/moe.md)."""
    cfg, starve = CASES[case]
    _assert_small(pools(world).run(grid, _check_layer, cfg, starve, CHUNKED), f"{case} chunked on {grid}")


def _backward_order(grid):
    """The backward's exchanges of a layer dispatched in 3 chunks: (tag, issue time, wait start) in issue order."""
    with grid.scheduler.using(CHUNKED):
        _check_layer(grid, *CASES["top2-shared-softmax"])
    return [(str(r.tag), r.t_issue, r.t_wait_start) for r in grid.comm.log.records if str(r.tag).endswith(".grad")]


def test_in_backward_each_chunks_exchanges_travel_behind_other_chunks_experts(pools):
    """Backward mirrors the forward's overlap (``Exchange``): the three combine gradients are issued
    together and each waited for just before its chunk's expert backward, and chunk i's reverse
    dispatch is issued after its expert backward and waited for only after the other chunks'."""
    for records in pools(2).run((1, 1, 2, 1), _backward_order):
        moe = [r for r in records if r[0] in ("moe.combine.grad", "moe.dispatch.grad")]
        assert [t for t, _, _ in moe] == ["moe.combine.grad"] * 3 + ["moe.dispatch.grad"] * 3
        c2, c1, c0, d2, d1, d0 = moe  # the last chunk's first
        assert c1[2] > d2[1]  # chunk 1's combine gradient was in flight during chunk 2's expert backward
        assert d2[2] > d0[1]  # chunk 2's dispatch gradient was in flight during chunks 1 and 0's


def _placement_errors(grid):
    return value_errors(
        {
            "experts": lambda: MoE(moe_config(experts=6)),
            "width": lambda: MoE(moe_config().replace(expert_ffn=10)),
        }
    )


def test_experts_that_do_not_divide_over_the_placement_fail_alike_on_every_rank(pools):
    msgs = pools(4).run((1, 1, 2, 2), _placement_errors)
    assert all(m == msgs[0] for m in msgs)
    assert "n_experts = 6 is not divisible by G_z·G_data = 4" in msgs[0]["experts"]
    assert msgs[0]["width"] is None  # y = 1: any width splits
    msgs = pools(4).run((1, 4, 1, 1), _placement_errors)
    assert "expert_ffn = 10 is not divisible by G_y = 4" in msgs[0]["width"]


def test_top_k_above_the_expert_count_is_refused_by_the_config():
    with pytest.raises(ValueError, match="experts_per_token = 3 exceeds n_experts = 2"):
        moe_config(k=3, experts=2)
    with pytest.raises(ValueError, match="router_scoring 'relu'"):
        moe_config(scoring="relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_a_loop_over_groups_with_empty_groups(dtype):
    torch.manual_seed(0)
    sizes = [3, 0, 5, 0]
    a = torch.randn(8, 16, dtype=dtype)
    w = torch.randn(4, 8, 16, dtype=dtype)  # (G, N, K)
    out = grouped.grouped_mm_t(a, w, sizes)
    ref = torch.cat([a[:3] @ w[0].t(), a[3:8] @ w[2].t()])
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    dw = grouped.grouped_weight_grad(out, a, sizes)
    assert torch.equal(dw[1], torch.zeros_like(dw[1])) and torch.equal(dw[3], torch.zeros_like(dw[3]))
    assert torch.allclose(
        dw[2].float(), (out[3:8].t() @ a[3:8]).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5
    )


def test_the_planner_prices_moe_models_but_not_with_context_parallelism():
    """The planner prices MoE layers (tests/test_plan_moe.py checks what); context parallelism with
    them it refuses, naming what to do."""
    from axon4d.config import get_config
    from axon4d.plan.workload import Workload

    assert Workload(get_config("tiny-moe"), batch=8).flops() > 0
    with pytest.raises(ValueError, match="context_parallel=False"):
        Workload(get_config("tiny-moe"), batch=8, context_parallel=True)


def test_moe_layer_in_mixed_precision_routes_in_fp32_and_follows_the_fp32_layer(pools):
    """Under bf16-fp32-reduce the router still runs in fp32 (the same choices and tokens per expert)
    and the experts' GEMMs in bf16: within bf16 rounding of the fp32 reference."""
    cfg, starve = CASES["top2-shared-softmax"]
    for errs in pools(2).run((1, 1, 2, 1), _check_layer, cfg, starve, precision="bf16-fp32-reduce"):
        assert errs["tokens_per_expert"] == 0.0
        bad = {k: v for k, v in errs.items() if not v <= 3e-2}
        assert not bad, bad


def _initialised(grid, cfg):
    """``MoE(cfg)`` and ``DenseMoE(cfg)`` built from the same seed: whether the layer gathered
    whole is the dense one, bit for bit (router and experts), and whether building the layer built
    a whole ``DenseMoE`` (it must not: at a trillion parameters that is a layer's every expert)."""
    from axon4d.nn import moe as moe_module

    built = []
    real = moe_module.DenseMoE

    class Watched(real):  # counts whole dense layers built while the grid layer initialises
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    moe_module.DenseMoE = Watched
    try:
        torch.manual_seed(5)
        layer = MoE(cfg)
    finally:
        moe_module.DenseMoE = real
    torch.manual_seed(5)
    dense = DenseMoE(cfg)
    whole = layer.to_dense()
    names = ["router.weight", "experts.up", "experts.down"] + (["experts.gate"] if cfg.gated else [])
    got, want = dict(whole.named_parameters()), dict(dense.named_parameters())
    return all(torch.equal(got[n], want[n]) for n in names), len(built)


@pytest.mark.parametrize(
    "world,grid", [(2, (1, 1, 2, 1)), (4, (2, 1, 1, 2)), pytest.param(8, (1, 2, 2, 2), marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_each_rank_draws_only_its_part_of_the_dense_layer_s_initialisation(pools, world, grid, arch):
    cfg = moe_config(arch=arch)
    for equal, whole_layers in pools(world).run(grid, _initialised, cfg):
        assert equal
        assert whole_layers == 0


def test_the_dispatch_plan_s_sizes_are_the_sums_of_the_counts():
    """``DispatchPlan``'s sizes (numpy sums over the gathered counts K[m, e] of the count group's
    members) against their definitions written as loops, on every (ep index, y index) of a grid of
    G_z = 4 (experts over z) by G_y = 2 (experts split over y) with 12 experts."""
    import numpy as np

    from axon4d.grid.shape import GridShape
    from axon4d.nn.moe_routes import DispatchPlan, Peers

    g_ep, g_y, e = 4, 2, 12
    local = e // g_ep
    c = np.random.default_rng(0).integers(0, 9, size=(g_ep, g_y, e))  # (source, its y share, expert)
    counts = np.stack([c[m // g_y, m % g_y] for m in range(g_ep * g_y)])  # count group y·z: y fastest
    shape = GridShape(1, g_y, g_ep, 1)

    def to(s, j, r):  # rows source s's share j sends to rank r
        return int(sum(c[s, j, r * local : (r + 1) * local]))

    for r in range(g_ep):
        for j in range(g_y):
            peers = Peers.of(shape, r * g_y + j, ("z",), ("y", "z"), True, e)
            plan = DispatchPlan(counts, peers)
            assert plan.tokens_per_expert().tolist() == [int(c[:, :, i].sum()) for i in range(e)]


def test_the_counts_are_gathered_over_the_dispatch_s_peers_and_summed_over_the_micro_batch():
    """E15 on Mixtral's planned grid (1, 2, 8, 16) with experts over z split over y: the counts are
    all-gathered over y·z alone (16 ranks: the dispatch's peers and their y-neighbours, one node)
    and summed over y·z·data (every share of the micro-batch once), as the planner prices it; where
    the two groups are one (the default layout), nothing is summed besides the gather. A plan's
    tokens per expert are the sums."""
    import numpy as np

    from axon4d.grid.expert_layout import ExpertLayout
    from axon4d.grid.shape import GridShape
    from axon4d.layout.geometry import Op, Term
    from axon4d.nn.moe_routes import DispatchPlan, Peers
    from axon4d.plan.moe_cost import layer_collectives

    shape, lay = GridShape(1, 2, 8, 16), ExpertLayout.parse("ep=z,tp=y")
    assert lay.count_axes(shape) == ("y", "z") and lay.total_axes(shape) == ("y", "z", "data")
    peers = Peers.of(shape, 5, lay.ep_axes(shape), lay.count_axes(shape), True, 8, lay.summed_axes(shape))
    assert (peers.count_axis, peers.total_axis) == ("y·z", "y·z·data")
    cfg = ModelConfig(
        n_layers=1, hidden=64, n_heads=4, vocab_size=64, seq_len=8, n_experts=8, experts_per_token=2, expert_ffn=32
    )
    counted = [c for c in layer_collectives(cfg, 64, shape, 2, 2, 1.0, lay) if c.term == Term.MOE_COUNTS]
    assert [(c.op, c.axis, c.payload_bytes) for c in counted] == [
        (Op.ALL_REDUCE, "y·z·data", 2 * 8 * 8),  # (C, E) int64 sums
        (Op.ALL_GATHER, "y·z", 16 * 2 * 8 * 8),  # every peer's (C, E)
    ]
    default, small = ExpertLayout(), GridShape(2, 2, 2, 2)
    assert default.count_axes(small) == default.total_axes(small) == ("y", "z", "data")
    one = Peers.of(small, 3, default.ep_axes(small), default.count_axes(small), True, 8, default.summed_axes(small))
    assert one.total_axis is None
    gathered = np.arange(16 * 8).reshape(16, 8)
    assert DispatchPlan(gathered, peers, np.arange(8) * 7).tokens_per_expert().tolist() == [7 * i for i in range(8)]
    assert DispatchPlan(gathered, peers).tokens_per_expert().tolist() == gathered.sum(axis=0).tolist()
