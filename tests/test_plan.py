"""Protects the planner (axon4d.plan, docs/design.md §6): it prices exactly the collectives that
axon4d.layout.geometry lists and the communication log counts, its parameter and memory figures match what
real layers allocate (on real gloo grids, and for 20B/80B on 512–1024 ranks of torch's fake process
group), and its search, overlap credit and machine files behave. Start here when changing the cost
or memory model."""

import dataclasses
import json
import math
import multiprocessing as mp
import os
import re
import shutil

import numpy as np
import pytest
import torch

from axon4d.config import SIZES, ModelConfig
from axon4d.grid.shape import GridShape, factorizations
from axon4d.layout.geometry import Term, chunk_sizes, linear_collectives, weight_shard_numel
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan import Workload, evaluate, load, local_param_count, memory, plan, step_breakdown, step_time
from axon4d.plan.candidate import device_need
from axon4d.plan.layers import axis_group_and_stride, comm_field, layer_cost
from axon4d.plan.machine import available
from axon4d.plan.scenario import Scenario
from axon4d.plan.tables import CommCurve, MatmulTable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = ModelConfig(n_layers=2, hidden=64, n_heads=4, ffn_hidden=256, vocab_size=128, seq_len=16, name="probe")
PROBE_WL = Workload(PROBE, batch=8, dtype="float32", embedding=False, norms=False)


def _bytes_from_volume(wl: Workload, shape: GridShape) -> dict:
    out: dict = {}
    for s in wl.linears():
        if s.embedding:
            continue
        for c in linear_collectives(
            s.in_features,
            s.out_features,
            wl.local_tokens(shape),
            shape,
            transpose=s.transpose,
            bias=s.bias,
            precision=wl.dtypes,  # bf16-fp32-reduce: E11–E13 in fp32
        ):
            out[c.axis] = out.get(c.axis, 0) + s.count * c.payload_bytes
    for c in wl.edge_collectives(shape):
        out[c.axis] = out.get(c.axis, 0) + c.payload_bytes
    return out


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 4, 1, 2), (8, 1, 1, 1), (2, 1, 2, 2)])
def test_planner_prices_exactly_the_volume_collectives(grid):
    shape = GridShape(*grid)
    wl = Workload(SIZES["5B"], batch=16, dtype="bfloat16")
    t = step_time(wl, shape, load("perlmutter"))
    assert t.bytes_by_axis == _bytes_from_volume(wl, shape)
    assert set(t.comm_by_axis) == set(t.bytes_by_axis)


def _probe_step(grid, wl):
    import torch

    from axon4d.measure.probe import ProbeModel, measure_step

    torch.manual_seed(0)
    model = ProbeModel(wl, grid)
    n_params = sum(p.numel() for p in model.parameters())
    res = measure_step(model, steps=2, warmup=1)
    return n_params, res["bytes_by_axis"], res["collectives"]


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (4, 1, 1, 2), (1, 1, 8, 1)])
@pytest.mark.slow
def test_logged_bytes_and_parameters_equal_the_planner(pools, grid):
    shape = GridShape(*grid)
    # the runtime on the host issues each reduction alone: the planner told the same (no buckets)
    t = step_time(PROBE_WL, shape, load("perlmutter"), OverlapPolicy(bucket_mb=0.0))
    for n_params, logged, calls in pools(8).run(grid, _probe_step, PROBE_WL):
        assert logged == t.bytes_by_axis
        assert calls == t.collectives  # what the in-step scale's per-collective cost counts
        assert n_params == local_param_count(PROBE_WL, shape)


def _fake_world_shapes(name, world, grid):
    """In a fresh process: a fake process group of ``world`` ranks and the real model on ``meta``."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import axon4d
    from axon4d.models.transformer import Transformer

    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        g = axon4d.init(grid=grid)
        model = Transformer(SIZES[name], device="meta", dtype=torch.bfloat16)
        total = sum(p.numel() for p in model.parameters())
        block = [tuple(p.shape) for n, p in model.blocks[0].named_parameters() if p.dim() == 1 and "norm" not in n]
        batch = g.size("batch")
        axon4d.shutdown()
        return total, block, batch
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "name,world,grid",
    [
        ("20B", 512, (8, 8, 8, 1)),
        pytest.param("20B", 1024, (4, 8, 16, 2), marks=pytest.mark.slow),
        pytest.param("80B", 1024, (8, 4, 32, 1), marks=pytest.mark.slow),
        pytest.param("80B", 512, (2, 8, 8, 4), marks=pytest.mark.slow),
    ],
)
def test_20b_80b_shards_on_a_fake_world_equal_the_planner(name, world, grid):
    with mp.get_context("spawn").Pool(1) as pool:
        total, block, batch = pool.apply(_fake_world_shapes, (name, world, grid))
    shape = GridShape(*grid)
    wl = Workload(SIZES[name], batch=batch, dtype="bfloat16")
    assert total == local_param_count(wl, shape)  # every tensor of the real GPT model, per rank

    shards = sorted(s for s in block if len(s) == 1)
    expect = sorted(
        [(weight_shard_numel(i, o, shape, t),) for _, i, o, t, _ in SIZES[name].linear_shapes()]
        + [(o // shape.size("x" if t else "y"),) for _, i, o, t, b in SIZES[name].linear_shapes() if b]
    )
    assert shards == expect  # the block's weight shards and bias slices
    mem = memory(wl, shape)
    # the parameters and gradients are the fp32 master weights (the layers cast them), Adam's two moments fp32
    assert mem.params == total * 4 and mem.grads == mem.params and mem.optimizer == total * 8


@pytest.mark.slow
def test_the_1t_moe_shards_on_a_fake_world_equal_the_planner():
    """One rank of ``moe-1t`` on 1024 ranks in the planner's placement (a fake process group, the
    model on ``meta``): the parameters it holds — router columns, its 3 of 384 experts split over
    x·y, the shared expert's and the dense layers' shards — are the planner's ``local_param_count``."""
    grid = (4, 2, 4, 32)
    with mp.get_context("spawn").Pool(1) as pool:
        total, _, batch = pool.apply(_fake_world_shapes, ("moe-1t", 1024, grid))
    wl = Workload(SIZES["moe-1t"], batch=batch, dtype="bfloat16")
    assert total == local_param_count(wl, GridShape(*grid))


#: the step options pinned as a model built without them runs (the search then varies only the grid)
PINNED = dict(recompute="none", micro_batches=1, zero=0, offload=0, fp8_gather=False, context_parallel=False)


@pytest.mark.slow
def test_search_enumerates_valid_grids_best_first_and_flags_memory():
    result = plan("20B", 512, "perlmutter", batch=512, top=None, **PINNED)
    wl = result.workload
    assert len(result.candidates) + result.invalid == len(factorizations(512)) == result.searched + result.invalid
    assert all(not wl.grid_problems(c.shape) for c in result.candidates)
    # the search's vectorised rules and the per-grid ones are the same rules (axon4d.grid.rules)
    assert result.invalid == sum(bool(wl.grid_problems(s)) for s in factorizations(512)) > 0
    assert all(c.shape.y in (1, 2, 4, 7, 8, 14, 28, 56) for c in result.candidates)  # 56 heads split over y
    fitting = [c for c in result.candidates if c.fits]
    assert fitting and fitting == result.candidates[: len(fitting)]
    assert [c.time.step_s for c in fitting] == sorted(c.time.step_s for c in fitting)
    # what does not fit needs more than the device: its peak, fragmentation and the memory the CUDA
    # context, workspaces and its grid's NCCL communicators take first (candidate.device_need)
    rest = result.candidates[len(fitting) :]
    assert rest and all(not c.fits and device_need(c.mem, result.machine) > result.memory_limit for c in rest)
    assert any(c.mem.peak <= result.memory_limit for c in rest)  # the peak alone would have fit
    assert all(c.mem.reserved > 0.5 * 2**30 for c in result.candidates)
    assert result.best is fitting[0]
    with pytest.raises(ValueError, match="no plan of 8 ranks fits: 80B needs at least .* GiB per device"):
        _ = plan("80B", 8, "perlmutter", batch=8).best


def test_overlap_credit_is_bounded_and_never_slows_a_step():
    m = load("perlmutter")
    wl = Workload(SIZES["20B"], batch=64)
    for grid in [(4, 2, 8, 8), (1, 4, 64, 2), (4, 4, 4, 8)]:
        shape = GridShape(*grid)
        base = step_time(wl, shape, m, OverlapPolicy.off())
        assert base.hidden_s == 0
        previous = base.step_s
        for ov in ["oar", "oar,ors", "oar,ors,odp", "oag,oar,ors,odp", "oag,oar,ors,odp,chunks"]:
            t = step_time(wl, shape, m, OverlapPolicy.parse(ov))
            assert t.hidden_s <= m.overlap_efficiency * t.compute_s + 1e-12
            assert t.hidden_s <= t.comm_s
            assert t.step_s <= previous + 1e-9 or ov.endswith("chunks")  # chunks pay k·α
            previous = t.step_s
    assert OverlapPolicy.parse("oag,odp,chunks").spec() == "oag,odp,chunks=4"
    assert OverlapPolicy.off().spec() == "off"


def test_deeper_overlap_hands_spare_windows_to_collectives_in_issue_order():
    from axon4d.plan.overlap_credit import deeper_overlap

    # a block of two layers, 0 then 1. Forward: window 1 credited the gather of layer 0 of the next
    # block and could not hide 0.5 s of it; window 0 has 0.3 s spare. Issued two windows ahead
    # (oag_depth=2) the gather also overlaps window 0; deeper, window 1 of the block before (no spare)
    spare_f, spare_b = {0: 0.3, 1: 0.0}, {0: 0.0, 1: 0.4}
    short = {"oag_f": {0: 0.0, 1: 0.5}, "oag_b": {}, "ors": {0: 0.25, 1: 0.0}}
    assert deeper_overlap([0, 1], spare_f, spare_b, short, OverlapPolicy(oag_depth=1, ors_inflight=1)) == []
    for depth in (2, 3):
        got = deeper_overlap([0, 1], spare_f, spare_b, dict(short, ors={}), OverlapPolicy(oag_depth=depth))
        assert got == [("oag", 0, pytest.approx(0.3))]
    # backward (order 1, 0): the reduce-scatter credited at window 0 left 0.25 s exposed; left running
    # (ors_inflight=2) it overlaps the next backward window, layer 1 of the block before, 0.4 s spare
    assert deeper_overlap([0, 1], spare_f, spare_b, dict(short, oag_f={}), OverlapPolicy(ors_inflight=2)) == [
        ("ors", 1, pytest.approx(0.25))
    ]
    # a spare window is given once: two collectives that both may use window 1 share its 0.4 s
    both = dict(short, oag_f={}, oag_b={0: 0.0, 1: 0.0}, ors={0: 0.25, 1: 0.3})
    got = deeper_overlap([0, 1], spare_f, {0: 0.1, 1: 0.4}, both, OverlapPolicy(ors_inflight=3))
    assert sum(h for _, w, h in got if w == 1) <= 0.4 + 1e-12 and sum(h for _, w, h in got if w == 0) <= 0.1 + 1e-12


def test_deeper_prefetch_and_more_reduce_scatters_in_flight_hide_more_within_the_bounds():
    m = load("perlmutter")
    wl = Workload(SIZES["20B"], batch=64)
    gained = 0.0
    for grid in [(2, 2, 8, 1), (1, 1, 16, 1), (4, 1, 16, 1)]:
        shape = GridShape(*grid)
        previous = step_time(wl, shape, m, OverlapPolicy())
        for knobs in [dict(oag_depth=2), dict(oag_depth=4), dict(oag_depth=4, ors_inflight=3)]:
            t = step_time(wl, shape, m, OverlapPolicy(**knobs))
            assert t.comm_s == previous.comm_s and t.compute_s == previous.compute_s
            assert t.hidden_s >= previous.hidden_s - 1e-12 and t.hidden_s <= t.comm_s
            assert t.hidden_s <= m.overlap_efficiency * t.compute_s + 1e-12
            gained += t.hidden_s - previous.hidden_s
            previous = t
    assert gained > 0.3  # (2, 2, 8, 1): the short attention-output window leaves the MLP-up gather exposed
    assert OverlapPolicy(oag_depth=3, ors_inflight=2).spec() == "oag,oar,ors,odp,chunks=4,oag_depth=3,ors_inflight=2"


MEMORY_POLICIES = {
    "default": {},
    "depth": {"oag_depth": 3},
    "inflight": {"ors_inflight": 3},
    "keep": {"oag_keep": True},
    "knobs": {"oag_keep": True, "oag_depth": 3, "ors_inflight": 3},
}


def _peaks_by_policy(grid, wl):
    import axon4d
    from axon4d.measure.probe import ProbeModel, measure_peak

    out = {}
    for name, policy in MEMORY_POLICIES.items():
        axon4d.overlap.configure(policy, grid)
        torch.manual_seed(0)
        out[name] = measure_peak(ProbeModel(wl, grid))
    return out, grid.comm.transport.stages_reduce_scatter


#: two small blocks whose weights are split over z alone: the memory tests of the overlap knobs
KNOBS_WL = Workload(
    ModelConfig(n_layers=2, hidden=256, n_heads=4, ffn_hidden=1024, vocab_size=512, seq_len=64),
    batch=4,
    dtype="float32",
    embedding=False,
    norms=False,
)


@pytest.mark.slow
def test_memory_follows_the_overlap_knobs(pools):
    # prefetched blocks in flight (oag_depth), reduce-scatters left running (ors_inflight, fewer at
    # the start of backward), kept blocks (oag_keep, each freed after its layer's backward)
    wl = KNOBS_WL
    shape = GridShape(1, 1, 4, 1)
    measured, staged = pools(4).run(shape.as_tuple(), _peaks_by_policy, wl)[0]
    assert staged  # gloo's reduce-scatter over 4 ranks receives the other ranks' chunks
    predicted = {
        k: memory(wl, shape, "none", OverlapPolicy(**v), staged_reduce_scatter=staged).peak
        for k, v in MEMORY_POLICIES.items()
    }
    for name in MEMORY_POLICIES:
        assert abs(predicted[name] - measured[name]) <= 0.05 * measured[name], (name, predicted, measured)
    # without the received chunks (what NCCL needs) the model falls short of what gloo holds
    unstaged = memory(wl, shape, "none", OverlapPolicy(**MEMORY_POLICIES["default"]), staged_reduce_scatter=False).peak
    assert unstaged < 0.95 * measured["default"], (unstaged, measured)
    grown, predicted_growth = measured["depth"] - measured["default"], predicted["depth"] - predicted["default"]
    assert grown > 0 and abs(predicted_growth - grown) <= 0.2 * grown, (grown, predicted_growth)


def test_received_chunks_are_priced_only_where_the_machine_stages_them():
    # gloo's exchange holds the chunks a reduce-scatter over more than two ranks receives, a buffer
    # the size of its input; NCCL/RCCL need none, so the shipped accelerator machines price none
    wl = dataclasses.replace(KNOBS_WL, batch=8)  # the peak falls inside a block's backward; a sequence per z rank
    gpu = load("perlmutter")
    host = dataclasses.replace(gpu, staged_reduce_scatter=True)
    assert not any(load(name).staged_reduce_scatter for name in available())
    up = next(s for s in wl.linears() if s.name == "mlp_up")
    for grid in [(1, 1, 4, 1), (1, 1, 8, 1)]:
        shape = GridShape(*grid)
        staged, plain = evaluate(wl, shape, host).mem.peak, evaluate(wl, shape, gpu).mem.peak
        assert staged == memory(wl, shape).peak and plain == memory(wl, shape, staged_reduce_scatter=False).peak
        block = weight_shard_numel(up.in_features, up.out_features, shape, up.transpose) * shape.z * wl.element_size
        assert staged - plain >= block, grid  # at least the largest layer's received chunks
    shape = GridShape(1, 2, 2, 1)  # over two ranks the exchange receives into the output: nothing staged
    assert evaluate(wl, shape, host).mem.peak == evaluate(wl, shape, gpu).mem.peak


def test_forward_gemm_is_priced_chunk_by_chunk_where_the_layer_chunks():
    # the layer splits its forward GEMM into token chunks only where its forward all-reduce (E8)
    # has peers (axon4d.nn.linear); the planner prices exactly those GEMMs
    m = load("perlmutter")
    wl = Workload(SIZES["20B"], batch=64)
    qkv = next(s for s in wl.linears() if s.name == "qkv")  # normal layer: E8 over x
    chunked = OverlapPolicy.parse({"forward_chunks": 4, "min_chunk_kb": 0})
    for grid, chunks in [((1, 4, 8, 4), 1), ((4, 4, 8, 2), 4)]:
        shape = GridShape(*grid)
        b, (in_l, out_l) = wl.local_tokens(shape), qkv.local(shape)
        cost = layer_cost(qkv, Scenario(wl, shape, m, chunked))
        expected = sum(
            m.matmul_time("nt", rows, in_l, out_l, wl.dtype, shape.world_size) for rows in chunk_sizes(b, chunks)
        )
        assert cost.chunks == chunks and cost.fwd_mm == pytest.approx(expected, rel=1e-12)
    assert cost.fwd_mm > m.matmul_time("nt", b, in_l, out_l, wl.dtype, shape.world_size)  # 4 GEMMs cost more


def test_the_backward_prices_no_copy_of_the_weight_gradient():
    # dW is computed straight into E11's input (axon4d.nn.linear._dw_padded): the layer's own
    # elementwise backward work is the 1/G_batch scaling of its gradient shard, never a pass over
    # the n_W-sized block
    m = load("perlmutter")
    wl = Workload(SIZES["20B"], batch=64)
    head = next(s for s in wl.linears() if s.name == "head")  # no bias: no bias-gradient sum either
    # on each grid a rank holds 1/8 of the weight, while its block n_W = shard·G_z grows from 2 to 8 shards
    costs = [
        layer_cost(head, Scenario(wl, GridShape(*g), m, OverlapPolicy())).bwd_ew
        for g in [(4, 1, 2, 1), (2, 1, 4, 1), (1, 1, 8, 1)]
    ]
    assert costs[1] == pytest.approx(costs[0], rel=1e-12) and costs[2] == pytest.approx(costs[0], rel=1e-12)
    assert costs[0] > 8 * m.op_overhead_s  # the shard's scaling is priced
    # G_batch = 1: no E11 and nothing to scale, only the ops' fixed costs
    alone = layer_cost(head, Scenario(wl, GridShape(8, 1, 1, 1), m, OverlapPolicy())).bwd_ew
    assert alone == pytest.approx(8 * m.op_overhead_s, rel=1e-12)


def test_step_is_the_scaled_sum_of_its_parts_and_unscaled_without_step_calibration():
    import dataclasses

    m = load("perlmutter")
    assert m.step_scale == {} and m.step_scale_for(8) == (1.0, 1.0, 1.0, 0.0)
    wl = Workload(SIZES["20B"], batch=64)
    shape = GridShape(4, 2, 8, 8)
    t = step_time(wl, shape, m)
    # the shipped GPU files charge interference (NCCL's kernels hold SMs: bench/machine_tables.py)
    assert t.interference_s > 0
    assert t.step_s == pytest.approx(t.compute_s + t.interference_s + t.comm_s - t.hidden_s, rel=1e-12)
    compute, activation, weight = t.parts
    assert activation > 0 and weight > 0 and activation + weight == pytest.approx(t.comm_s - t.hidden_s)
    # activations: the forward (E8) and input-gradient (E9) all-reduces and the embedding lookup's,
    # the split norms' sums over x and the loss's collectives over y (each waited on where issued)
    assert t.layers["embedding"]["comm_embedding"] > 0
    sc = Scenario(wl, shape, m)
    edge = [
        c for c in sc.edge_collectives if c.term in (Term.NORM_STATS, Term.NORM_STATS_GRAD, Term.CE_LSE, Term.CE_TARGET)
    ]
    assert {c.term for c in edge} == {Term.NORM_STATS, Term.NORM_STATS_GRAD, Term.CE_LSE, Term.CE_TARGET}
    assert t.activation_comm_s == pytest.approx(
        sum(
            v["count"] * sum(v.get(comm_field(k), 0.0) for k in (Term.E8, Term.E9, Term.EMBEDDING))
            for v in t.layers.values()
        )
        + sum(m.comm_time(c.op.value, shape.size(c.axis), shape.stride(c.axis), c.payload_bytes, 512) for c in edge),
        rel=1e-12,
    )
    scaled = dataclasses.replace(m, step_scale={"2": [9.0, 9.0, 9.0, 9.0], "512": [1.25, 1.5, 0.5, 1e-3]})
    assert scaled.step_scale_for(shape.world_size) == (1.25, 1.5, 0.5, 1e-3)  # the nearest calibrated world
    s = step_time(wl, shape, scaled)
    assert s.parts == pytest.approx(t.parts) and s.collectives == t.collectives > 0
    assert s.step_s == pytest.approx(1.25 * compute + 1.5 * activation + 0.5 * weight + 1e-3 * t.collectives, rel=1e-12)
    # recomputation adds to the parts, so it is scaled like the rest
    full = evaluate(wl, shape, scaled, recompute="full").time
    assert full.parts[0] > s.parts[0] and full.parts[1] > s.parts[1] and full.step_s > s.step_s
    again = sum(v["count"] * v["fwd_collectives"] for v in s.layers.values() if v["count"] == wl.model.n_layers)
    norms = 2 * wl.model.n_layers  # the blocks' norms' forward sums over x (G_x = 4), issued again too
    assert again > 0 and full.collectives == s.collectives + again + norms  # its forward collectives again


def test_interference_charges_every_byte_of_ring_traffic_to_compute():
    import dataclasses

    from axon4d.plan.collective_model import ring_traffic

    assert ring_traffic("all_reduce", 4, 1000) == 1500 and ring_traffic("all_gather", 4, 1000) == 750
    assert ring_traffic("reduce_scatter", 2, 1000) == 500 and ring_traffic("all_reduce", 1, 1000) == 0
    m = load("perlmutter")
    # a GPU file gives its SMs: NCCL's channels take channels/SMs of the compute overlapped with them,
    # for the time overlap hides; an exposed collective slows nothing (bench/machine_tables.py)
    assert m.overlap_slowdown == pytest.approx(m.nccl_channels / 108) and m.interference_time(1e9, 8) == 0.0
    gpu = step_time(PROBE_WL, GridShape(2, 2, 2, 1), m)
    assert gpu.hidden_s > 0 and gpu.interference_s == pytest.approx(m.overlap_slowdown * gpu.hidden_s, rel=1e-12)
    off = step_time(PROBE_WL, GridShape(2, 2, 2, 1), m, overlap=OverlapPolicy.parse("off"))
    assert off.hidden_s == 0.0 and off.interference_s == 0.0
    # the host's model: κ per byte of ring traffic, hidden or not
    m = dataclasses.replace(m, comm_interference_s_per_byte={}, compute_units=0)  # the baseline below: none
    kappa = 2e-9
    host = dataclasses.replace(
        m, comm_interference_s_per_byte={"4": kappa, "2": 1.0}, step_scale={"8": [1.25, 1.5, 0.5, 1e-3]}
    )
    # data parallel over 2 ranks: only all-reduces of 2 ranks, whose ring traffic is their payload
    dp = step_time(PROBE_WL, GridShape(1, 1, 1, 2), m)
    assert dp.traffic_bytes == sum(dp.bytes_by_axis.values()) > 0 and dp.interference_s == 0.0
    # z over 2 (gathers and reduce-scatters move half their payload) and x, y over 2 (all-reduces)
    shape = GridShape(2, 2, 2, 1)
    t = step_time(PROBE_WL, shape, m)
    by_op = {"z": 0.5, "x": 1.0, "y": 1.0, "batch": 1.0}
    assert t.traffic_bytes == pytest.approx(sum(by_op[a] * b for a, b in t.bytes_by_axis.items()), rel=1e-12)
    s = step_time(PROBE_WL, shape, host)  # 8 ranks on nodes of 4 devices: 4 compute at once
    assert s.interference_s == pytest.approx(kappa * t.traffic_bytes, rel=1e-12)
    assert s.parts[0] == pytest.approx(t.compute_s + s.interference_s) and s.parts[1:] == pytest.approx(t.parts[1:])
    assert s.step_s - dataclasses.replace(s, interference_s=0.0).step_s == pytest.approx(1.25 * s.interference_s)
    # recomputation sends the forward collectives' bytes again
    full = evaluate(PROBE_WL, shape, host, recompute="full").time
    again = sum(v["count"] * v["fwd_traffic_bytes"] for v in s.layers.values() if v["count"] == PROBE.n_layers)
    assert again > 0 and full.traffic_bytes == pytest.approx(s.traffic_bytes + again)
    assert full.interference_s == pytest.approx(kappa * full.traffic_bytes)


def test_step_fit_recovers_scales_and_keeps_them_non_negative():
    from axon4d.plan.stepfit import calibration_grids, fit, parse_model

    rng = np.random.default_rng(0)
    terms = np.c_[rng.uniform(0.05, 1.0, size=(6, 3)), rng.integers(10, 100, size=6)]
    k = np.array([1.2, 1.1, 0.7, 2e-3])
    assert fit(terms, terms @ k) == pytest.approx(tuple(k), rel=1e-9)
    # measured steps that only a negative weight would match: that weight is dropped, not negative
    terms = np.array([[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 2.0, 0.0], [1.0, 0.0, 3.0, 0.0]])
    got = fit(terms, np.array([1.0, 0.9, 0.8]))
    assert got[2] == 0.0 and got[0] > 0
    assert got[1] == 1.0 and got[3] == 0.0  # no activation traffic, no collectives measured: left unscaled
    wl = parse_model("layers=2,hidden=384,heads=8,vocab=1536,seq=96,batch=8")
    assert wl.model.ffn == 4 * 384 and wl.dtype == "float32" and wl.tokens == 768 and not wl.norms
    for bad in (
        "layers=2,hidden=384",
        "layers=2,hidden=384,heads=8,vocab=1536,seq=96,batch=8,width=3",
        "layers=2,hidden=38.4,heads=8,vocab=1536,seq=96,batch=8",
        "layers=0,hidden=384,heads=8,vocab=1536,seq=96,batch=8",
    ):
        with pytest.raises(ValueError, match="step model"):
            parse_model(bad)
    # single-axis grids, then mixed ones that put each group size on each axis as soon as possible
    assert calibration_grids(8, wl) == [
        (1, 1, 1, 8),
        (1, 1, 8, 1),
        (8, 1, 1, 1),
        (1, 8, 1, 1),
        (2, 2, 2, 1),
        (1, 4, 1, 2),
        (4, 2, 1, 1),
    ]
    assert calibration_grids(4, wl)[4:] == [(2, 2, 1, 1), (1, 1, 2, 2), (1, 2, 2, 1)] and calibration_grids(1, wl) == []


def test_axis_groups_and_machine_levels_follow_e1():
    shape = GridShape(4, 2, 8, 16)
    assert [axis_group_and_stride(shape, a, 4) for a in ("x", "y", "z", "data", "batch", "y·z")] == [
        (4, 1),
        (2, 4),
        (8, 8),
        (16, 64),
        (128, 8),
        (16, 4),
    ]
    # x·data: runs of 4 ranks, 64 apart: one run per node of 4 (stride 1 keeps 4 on a node), in one
    # node of 1024 (the stride that spans the same 3·1 + 15·64 ranks)
    assert axis_group_and_stride(shape, "x·data", 4) == (64, 1)
    assert axis_group_and_stride(shape, "x·data", 1024) == (64, (3 + 15 * 64) // 63)
    assert axis_group_and_stride(shape, "y·data", 4) == (32, 4)  # one member per node of 4: 32 nodes
    m = load("perlmutter")
    assert m.level_of(4, 1).name.startswith("node") and m.level_of(2, 4).name.startswith("network")
    fast, slow = m.comm_time("all_reduce", 4, 1, 1 << 26, 1024), m.comm_time("all_reduce", 4, 4, 1 << 26, 1024)
    assert slow > 3 * fast


def test_calibration_tables_interpolate():
    dims = [16, 64, 256]
    rates = np.full((3, 3, 3), 1e9)
    rates[2, 2, 2] = 4e9
    table = MatmulTable(dims, rates)
    assert table.rate(16, 64, 256) == pytest.approx(1e9) and table.rate(256, 256, 256) == pytest.approx(4e9)
    assert table.rate(4096, 4096, 4096) == pytest.approx(4e9)  # clamped at the lattice edge
    assert 1e9 < table.rate(128, 256, 256) < 4e9
    curve = CommCurve("all_reduce", 2, 1, 2, [1000, 2000, 4000], [1.0, 2.0, 3.0])
    assert curve.time(1500) == pytest.approx(1.5) and curve.time(8000) == pytest.approx(5.0)
    alpha, beta = CommCurve("all_gather", 2, 1, 2, [0, 1000], [1e-3, 2e-3]).alpha_beta()
    assert alpha == pytest.approx(1e-3) and beta == pytest.approx(1e6)


def test_calibration_measures_the_longer_gemm_lattice_on_an_accelerator(monkeypatch):
    """kernels.gemm_dims: a host keeps the 5-point lattice up to 4096 (minutes of GEMMs already);
    an accelerator (injected: a grid whose device is cuda, no GPU needed) adds 2048, 8192 and
    16384, past a true-width block's GEMMs; ``measure_world`` measures the device's unless given
    ``dims``."""
    import types

    from axon4d.measure import calibrate, kernels

    host, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert kernels.gemm_dims(host) == kernels.DIMS == [16, 64, 256, 1024, 4096]
    assert kernels.gemm_dims(gpu) == [16, 64, 256, 1024, 2048, 4096, 8192, 16384]
    assert set(kernels.DIMS) < set(kernels.gemm_dims(gpu))  # the host's points, and more
    measured = []
    monkeypatch.setattr(
        calibrate, "_measure_compute", lambda timer, dtypes, seqs, keys, dims, log: measured.append(dims) or {}
    )
    for device, dims in ((host, None), (gpu, None), (gpu, [16, 64])):
        grid = types.SimpleNamespace(
            world_size=1, rank=0, device=device, scheduler=types.SimpleNamespace(accelerator=False)
        )
        calibrate.measure_world(grid, ["float32"], reps=1, log=lambda s: None, dims=dims, parts=["compute"])
    assert measured == [kernels.DIMS, kernels.ACCELERATOR_DIMS, [16, 64]]


def _power_rate(m, k, n):
    """A GEMM rate linear in log2 dims (1e9 · m^0.3 · k^0.2 · n^0.1): a table of it interpolates exactly."""
    return 1e9 * m**0.3 * k**0.2 * n**0.1


def _power_table(dims: list[int]) -> MatmulTable:
    return MatmulTable(list(dims), _power_rate(*np.meshgrid(*[np.asarray(dims, float)] * 3, indexing="ij")))


def test_machine_files_of_either_gemm_lattice_load_and_price(tmp_path):
    """A machine file calibrated on an accelerator (lattice to 16384) prices a true-width GEMM from
    measured points; one of the host's lattice (every file written before, e.g. the H200's) still
    loads and prices it at its 4096 edge; a table whose dims or rates do not form a lattice is refused."""
    from axon4d.measure import kernels

    true_width = (2048, 7168, 12288)  # tokens × hidden × a 20B FFN slice
    h200 = load(os.path.join(ROOT, "bench", "results", "machine_h200_one_gpu.json"))  # calibrated on the 5 points
    edge = h200.matmul["bfloat16"]["1"]["nt"]
    assert edge.dims == kernels.DIMS  # clamped at 4096: why an accelerator now measures more
    assert edge.rate(*true_width) == pytest.approx(edge.rate(2048, 4096, 4096))
    base = h200.to_json()
    for dims, priced_at in ((kernels.ACCELERATOR_DIMS, true_width), (kernels.DIMS, (2048, 4096, 4096))):
        table = _power_table(dims).to_json()
        base["matmul"] = {"bfloat16": {"1": {f: table for f in ("nt", "nn", "tn")}}}
        path = tmp_path / f"machine_{len(dims)}.json"
        path.write_text(json.dumps(base))
        m = load(str(path))
        assert m.matmul["bfloat16"]["1"]["nt"].dims == list(dims)
        flops = 2.0 * np.prod(true_width)
        assert m.matmul_time("nt", *true_width, "bfloat16") == pytest.approx(
            flops / _power_rate(*priced_at) + m.op_overhead_s
        )
    for bad, said in (
        ({"dims": [16, 4096, 1024], "rates": np.ones((3, 3, 3)).tolist()}, "ascending"),
        ({"dims": [16, 64], "rates": np.ones((3, 3, 3)).tolist()}, "must be (2, 2, 2)"),
        ({"dims": [16, 64], "rates": np.zeros((2, 2, 2)).tolist()}, "above 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            MatmulTable.from_json(bad)


def test_shipped_machines_state_their_sources():
    for name in available():
        m = load(name)
        assert m.sources and m.levels and m.peak_flops
        assert json.loads(json.dumps(m.to_json()))["name"] == m.name
    with pytest.raises(ValueError, match="unknown machine"):
        load("summit-2099")


def test_memory_policies_order_and_count_parameters():
    wl = Workload(SIZES["20B"], batch=64)
    shape = GridShape(4, 4, 8, 4)
    none, sel, full = (memory(wl, shape, r) for r in ("none", "selective", "full"))
    assert full.activations < sel.activations < none.activations
    assert full.peak < none.peak
    total = sum(local_param_count(wl, GridShape(*s)) for s in [(1, 1, 1, 1)])
    assert abs(total - SIZES["20B"].n_params()) / SIZES["20B"].n_params() < 1e-9
    c = evaluate(wl, shape, load("perlmutter"), recompute="full")
    assert c.time.step_s > evaluate(wl, shape, load("perlmutter")).time.step_s


@pytest.mark.slow
def test_plan_cli_prints_a_table_and_json(capsys, tmp_path):
    import argparse

    from axon4d.plan import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    out = tmp_path / "plan.json"
    code = cli.main(
        p.parse_args(
            [
                "--model",
                "20B",
                "--gpus",
                "64",
                "--machine",
                "h100",
                "--batch",
                "64",
                "--recompute",
                "full",
                "--top",
                "3",
                "--json",
                str(out),
            ]
        )
    )
    text = capsys.readouterr().out
    assert code == 0 and "grid (x,y,z,d)" in text and "t_data" in text
    data = json.loads(out.read_text())
    assert len(data["candidates"]) == 3 and data["world"] == 64
    # the best plan's step in its parts, which add up to it where no in-step scale weights them
    (line,) = [line for line in text.splitlines() if line.startswith("step ")]
    seconds = re.match(
        r"step (\S+) s \(predicted, one rank\) = compute (\S+) s \(GEMMs (\S+) s outside recomputation, "
        r"optimizer (\S+) s\) \+ collectives left exposed (\S+) s \(of (\S+) s issued; overlap hides (\S+) s\) "
        r"\+ compute lost to their traffic (\S+) s$",
        line,
    )
    assert seconds, line
    step, compute, gemms, optimizer, exposed, issued, hidden, lost = map(float, seconds.groups())
    best = data["candidates"][0]
    assert step == pytest.approx(best["step_s"], rel=1e-3) and gemms == pytest.approx(best["matmul_s"], rel=1e-2)
    assert compute + exposed + lost == pytest.approx(step, rel=2e-3)
    assert issued - hidden == pytest.approx(exposed, rel=2e-2) and gemms + optimizer < compute
    assert "in-step scale" not in text  # shipped machines have no step calibration
    from axon4d.plan.stepfit import model_fields

    scaled = load("h100")
    scaled.step_scale = {"64": [1.5, 1.0, 0.5, 2e-3]}
    scaled.step_samples = [
        {
            "grid": [1, 1, 1, 64],
            "measured_s": 1.0,
            "model": model_fields(SIZES["20B"]),
            "batch": 64,
            "dtype": "bfloat16",
            "rounds_s": [1.0],
        }
    ]
    scaled.save(str(tmp_path / "scaled.json"))
    args = ["--gpus", "64", "--machine", str(tmp_path / "scaled.json"), "--top", "3", "--json", str(out)]
    # recomputation pinned to the calibrated steps' (none): the search may choose another mode
    cli.main(p.parse_args(["--model", "20B", "--batch", "64", "--recompute", "none", *args]))
    text = capsys.readouterr().out
    assert (
        "in-step scale compute ×1.50, activation all-reduces ×1.00, weight/gradient collectives ×0.50, 2.00 ms" in text
    )
    assert re.search(
        r"^step \S+ s \(predicted, one rank\), weighted by the machine's in-step scale, from compute ", text, re.M
    )
    assert (
        "fitted to steps of layers=32,hidden=7168,heads=56,kv_heads=56,ffn=28672,vocab=51200," in text
    )  # the --step-model form
    assert "warning" not in text and json.loads(out.read_text())["step_scale_caveat"] is None  # the calibrated job
    # another model, twice the sequences per rank, recomputation: the weights are applied and the plan says why
    # they may not fit
    cli.main(p.parse_args(["--model", "80B", "--batch", "128", "--recompute", "full", *args]))
    warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "fitted to steps on 64 ranks" in warning[0]
    for part in ("hidden 12288 here, 7168 there", "sequences per rank (2 here, 1 there)", "recomputation (full here"):
        assert part in warning[0], (part, warning[0])
    assert json.loads(out.read_text())["step_scale_caveat"] in warning[0]
    # each difference is named on its own; the calibrated job has none
    from axon4d.plan.stepfit import caveat

    same = Workload(SIZES["20B"], 64, "bfloat16")
    assert caveat(scaled, same, 64) is None and caveat(load("h100"), same, 64) is None  # none: no step calibration
    assert "dtype (float32 here, bfloat16 there)" in caveat(scaled, Workload(SIZES["20B"], 64, "float32"), 64)
    assert "overlap policy (not the default)" in caveat(scaled, same, 64, overlap="off")
    assert caveat(scaled, same, 64, overlap="all") is None  # "all" is the default policy


def _auto_grid(cfg):
    import axon4d

    grid = axon4d.init(grid="auto", plan={"model": cfg, "batch": 8, "machine": "perlmutter", "dtype": "float32"})
    try:
        return grid.shape.as_tuple(), grid.scheduler.policy
    finally:
        axon4d.shutdown()


@pytest.mark.slow
def test_init_auto_builds_the_planners_choice_on_every_rank(pools):
    """grid="auto" with init's default overlap="auto": the planner's grid and its tuned knobs."""
    best = plan(PROBE, 8, "perlmutter", batch=8, dtype="float32", overlap="auto", **PINNED).best
    assert pools(8).run(None, _auto_grid, PROBE) == [(best.shape.as_tuple(), best.overlap)] * 8


def test_auto_prints_the_chosen_plans_step_in_its_parts(capsys):
    from axon4d.plan.auto import ranked

    best = ranked(8, model=PROBE, batch=8, machine="perlmutter", dtype="float32").best
    err = capsys.readouterr().err
    assert f"grid='auto' chose {best.shape.as_tuple()}" in err
    (line,) = [line for line in err.splitlines() if line.startswith("axon4d: step ")]
    assert line == f"axon4d: {step_breakdown(best.time)}" and f"step {best.time.step_s:.4g} s" in line
    ranked(8, model=PROBE, batch=8, machine="perlmutter", dtype="float32", rank=1)
    assert capsys.readouterr().err == ""  # rank 0 alone prints


def test_auto_without_a_model_or_machine_says_what_to_pass(monkeypatch, tmp_path):
    from axon4d.plan.auto import choose_grid

    with pytest.raises(ValueError, match="needs the model"):
        choose_grid(8, machine="perlmutter")
    monkeypatch.delenv("AXON4D_MACHINE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="axon4d calibrate"):
        choose_grid(8, model=PROBE)


def _calibrate_small(grid):
    from axon4d.measure import calibrate

    result = calibrate.measure_world(
        grid,
        ["float32"],
        reps=1,
        log=lambda s: None,
        dims=[16, 64],
        payloads=[4096, 65536],
        attention_seqs=[64, 128],
        prefix_keys=[256, 1024],
        step_rounds=1,
        step_model="layers=1,hidden=64,heads=8,ffn=128,vocab=64,seq=16,batch=8",
    )
    measured = {k: result[k] for k in ("overlap_efficiency", "comm_interference_s_per_byte")}
    return calibrate.merge(None, result, "test-host", 2**30).to_json(), measured


def test_a_calibration_on_an_accelerator_yields_a_file_that_prices_offload():
    """What the compute ran on is the file's ``accelerator``, and an accelerator's measured host link
    (``kernels.host_link``) lets the planner price offload; a network-only merge keeps both."""
    import copy

    from axon4d.measure import calibrate

    result = {
        "world": 1,
        "accelerator": True,
        "elementwise_Bps": 3e12,
        "activation_s": [1e-12, 2e-12],
        "adam_s": 5e-11,
        "op_overhead_s": 1e-5,
        "host_link_Bps": 5.5e10,
        "step_samples": [],
    }
    m = calibrate.merge(None, result, "gpu-host", 2**30)
    assert m.accelerator and m.host_link_Bps == 5.5e10 and m.can_offload and m.pinned_host_per_node > 0
    host = calibrate.merge(None, {**result, "accelerator": False} | {"host_link_Bps": 0.0}, "cpu-host", 2**30)
    assert not host.accelerator
    network = {"world": 2, "accelerator": False, "comm": [], "staged_reduce_scatter": True, "step_samples": []}
    network |= {"overlap_efficiency": 0.5, "comm_interference_s_per_byte": 0.0}
    kept = calibrate.merge(copy.deepcopy(m), network, "gpu-host", 2**30)
    assert kept.accelerator and kept.host_link_Bps == 5.5e10  # the links re-measured through gloo on a host


def test_attention_is_measured_on_enough_heads_to_fill_an_accelerator():
    """kernels._units: on a host one measurement is ~2²² elements of work; on an accelerator 64 times
    that (one head of a long sequence leaves most multiprocessors idle), within 2²⁸ elements per tensor
    and 4096 units."""
    import types

    from axon4d.measure import kernels

    host, gpu = types.SimpleNamespace(device=torch.device("cpu")), types.SimpleNamespace(device=torch.device("cuda", 0))
    assert kernels._units(host, 2**22, 2048 * 2048, 2048 * 128) == 1
    assert kernels._units(gpu, 2**22, 2048 * 2048, 2048 * 128) == 64
    assert kernels._units(gpu, 2**22, 64 * 64, 64 * 128) == kernels.MAX_UNITS  # 65536 failed in cuDNN
    assert kernels._units(gpu, 2**22, 2**10, 2**20) == 2**28 // 2**20  # the memory cap
    assert kernels._units(gpu, 2**24, 512 * 65536, 65536 * 128) == 32


@pytest.mark.slow
def test_calibrate_shows_each_stage_as_it_measures(tmp_path, capfd):
    """`axon4d calibrate` draws a bar per stage on rank 0 (``Timer.stage``: named, counted, with an
    estimate where the count is known) and a line when each is done — not minutes of silence."""
    from axon4d import cli

    out = tmp_path / "host.json"
    shutil.copy(os.path.join(ROOT, "bench", "results", "planner_machine_host_2026-11-26.json"), out)
    argv = ["calibrate", "--ranks", "1", "--parts", "kernels", "--reps", "1", "--out", str(out)]
    assert cli.main(argv) == 0  # the rank it spawns writes to this process's stdout and stderr
    printed = capfd.readouterr()
    text = (printed.out + printed.err).replace("\r", "\n")
    assert "[1 ranks] elementwise, activation, optimizer: " in text and "point" in text  # the bar
    assert "[1 ranks] elementwise, activation, optimizer done" in text  # the stage's line
    m = load(str(out))  # and what a small read to the host costs a loop of queued ops (MoE's E15)
    assert m.host_sync_s is not None and math.isfinite(m.host_sync_s) and m.host_sync_s >= 0
    assert "kernels.host_sync" in m.sources["host_sync_s"]


def test_calibration_clamps_only_what_timing_noise_puts_out_of_range():
    from axon4d.measure.collectives import hidden_share, interference_per_byte

    # GEMMs beside an all-reduce of 1 MB ring traffic lost 1 ms, beside one of 2 MB 3 ms: 2 ns per
    # byte (the slope; what every collective costs cancels), not clamped
    assert interference_per_byte([1e-3, 3e-3], [1e6, 2e6]) == pytest.approx(2e-9, rel=1e-12)
    assert interference_per_byte([3e-3, 3e-3], [1e6, 2e6]) == 0.0  # a per-collective cost only
    # less excess beside the larger all-reduce is noise: clamped at 0, never a negative cost
    assert interference_per_byte([3e-3, 1e-3], [1e6, 2e6]) == 0.0
    # an all-reduce of 2 ms beside GEMMs of 4 ms: together in 5 ms hid half the all-reduce
    assert hidden_share(2e-3, 4e-3, 5e-3) == pytest.approx(0.5, rel=1e-12)
    assert hidden_share(2e-3, 4e-3, 7e-3) == 0.0  # slower than one after the other: nothing hidden
    assert hidden_share(2e-3, 4e-3, 3.5e-3) == 1.0  # faster than the GEMMs alone: all of it hidden


@pytest.mark.slow
def test_calibration_measures_every_axis_and_yields_a_usable_machine(pools):
    from axon4d.measure import collectives
    from axon4d.plan.machine import Machine

    data, measured = pools(4).run((1, 1, 1, 4), _calibrate_small)[0]
    m = Machine.from_json(json.loads(json.dumps(data)))
    assert sorted((c.op, c.group, c.stride) for c in m.comm) == sorted(
        (op, g, s) for op in collectives.OPS for g, s in [(2, 1), (2, 2), (4, 1)]
    )
    assert all(c.world == 4 and len(c.seconds) == 2 and min(c.seconds) > 0 for c in m.comm)
    table = m.matmul["float32"]["4"]["nt"]
    assert table.dims == [16, 64] and (table.rates > 0).all()
    assert sorted({r[0] for r in m.attention_prefix["float32"]["4"]}) == [256, 1024]  # the prefix table
    assert all(r[2] > 0 for r in m.attention_prefix["float32"]["4"] + m.attention["float32"]["4"])
    assert m.overlap_efficiency == measured["overlap_efficiency"] and m.peak_flops["float32"] > 0
    assert m.staged_reduce_scatter  # measured under gloo, whose reduce-scatter receives chunks
    t = step_time(PROBE_WL, GridShape(2, 1, 2, 1), m)
    assert t.step_s > 0 and t.comm_by_axis["x"] > 0 and t.comm_by_axis["z"] > 0
    # the whole calibration steps: one per grid of stepfit.calibration_grids, and a fitted scale
    assert [s["grid"] for s in m.step_samples] == [
        [1, 1, 1, 4],
        [1, 1, 4, 1],
        [4, 1, 1, 1],
        [1, 4, 1, 1],
        [2, 2, 1, 1],
        [1, 1, 2, 2],
        [1, 2, 2, 1],
    ]
    # what a collective's bytes take from the GEMMs beside it, priced into every step
    assert m.comm_interference_s_per_byte == {"4": measured["comm_interference_s_per_byte"]}
    assert t.interference_s == pytest.approx(m.comm_interference_s_per_byte["4"] * t.traffic_bytes)
    assert all(s["measured_s"] > 0 and s["model"]["hidden"] == 64 for s in m.step_samples)
    k = m.step_scale["4"]
    assert len(k) == 4 and min(k) >= 0 and t.scale == tuple(k)  # the fit itself: bench/planner_accuracy.py


def _network_only(grid):
    from axon4d.measure import calibrate

    return calibrate.measure_world(grid, [], reps=1, log=lambda s: None, payloads=[4096, 65536], parts=["network"])


def _sweep(grid, payloads):
    from axon4d.measure import collectives
    from axon4d.measure.timing import Timer

    return collectives.comm_curves(Timer(grid, reps=1), torch.float32, 1, payloads)


def test_the_sweep_measures_an_all_to_all_curve_on_every_axis_geometry(pools):
    """``collectives.comm_curves`` on 4 ranks: an all-to-all curve (``axon4d.comm.communicator``'s, one row of
    payload/(4·G) fp32 elements to each rank) per geometry, beside the other three collectives',
    its payloads the bytes each rank sends, its own row included (what the log records, E16)."""
    from axon4d.measure.collectives import all_to_all_payload

    curves = pools(4).run((1, 1, 1, 4), _sweep, [4096, 65536])[0]
    a2a = {(c.group, c.stride): c for c in curves if c.op == "all_to_all"}
    assert sorted(a2a) == [(2, 1), (2, 2), (4, 1)] and len(curves) == 4 * len(a2a)
    for c in a2a.values():
        assert c.world == 4 and c.payload == [4096, 65536] and min(c.seconds) > 0
    assert all_to_all_payload(4096, 3, 4) == 4092  # a group that does not divide it: ⌊1024/3⌋ elements a row


def test_network_only_calibration_replaces_the_links_and_keeps_the_compute(pools, tmp_path):
    """`axon4d calibrate --parts network` (e.g. on an emulated cluster): the collectives are measured
    anew and merged into the machine file already at --out; its compute tables stay as they were."""
    import argparse
    import copy
    import dataclasses

    from axon4d.measure import calibrate

    before = dataclasses.replace(load("perlmutter"), devices_per_node=2, comm=[])  # as if its node had 2 ranks
    result = pools(2).run((1, 1, 1, 2), _network_only)[0]
    assert "matmul" not in result and "elementwise_Bps" not in result  # nothing but the network measured
    after = calibrate.merge(copy.deepcopy(before), result, "re-measured", 2**30)
    assert sorted((c.op, c.group, c.stride, c.world) for c in after.comm) == [
        (op, 2, 1, 2) for op in ("all_gather", "all_reduce", "all_to_all", "reduce_scatter")
    ]
    assert all(c.payload == [4096, 65536] and min(c.seconds) > 0 for c in after.comm)  # the bytes each rank sends
    assert after.overlap_efficiency == result["overlap_efficiency"] and "network" in after.sources
    assert not before.staged_reduce_scatter and after.staged_reduce_scatter  # now the links of gloo
    assert after.matmul == before.matmul and after.attention == before.attention
    assert after.elementwise_Bps == before.elementwise_Bps and after.peak_flops == before.peak_flops
    # without a file to take the compute from, the command refuses before measuring anything
    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    missing = str(tmp_path / "none.json")
    with pytest.raises(SystemExit, match="does not exist to take it from"):
        calibrate.main(p.parse_args(["--parts", "network", "--out", missing]))
    with pytest.raises(SystemExit, match="choose some of compute, kernels, network"):
        calibrate.main(p.parse_args(["--parts", "links", "--out", missing]))


def test_context_parallel_attention_is_priced_as_the_rank_runs_it():
    """Under context parallelism a z-rank runs, per sequence and head, two causal squares of
    C = S/(2·G_z) (its own chunks) and its chunks against the keys before them, unmasked:
    (2·G_z−1)·C² pairs in all; the key/value all-gather hides behind the squares' forward."""
    import dataclasses

    from axon4d.plan.block_extras import attention_seconds, context_hidden

    cfg = ModelConfig(n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, ffn_hidden=512, vocab_size=128, seq_len=4096)
    shape = GridShape(1, 2, 4, 1)
    per_pair = 1e-9  # seconds per (query, key) pair at head_dim 32, any key length
    causal = [[s, 32, per_pair * s * s / 2] for s in (64, 256, 1024, 4096)]  # a causal square: S²/2 pairs
    m = dataclasses.replace(
        load("perlmutter"),
        attention={"float32": {"8": causal}},
        attention_prefix={"float32": {"8": [[k, 32, per_pair] for k in (256, 4096, 65536)]}},
        overlap_efficiency=0.5,
    )
    wl = Workload(cfg, batch=2, dtype="float32", context_parallel=True)
    units = 2 * cfg.n_heads // shape.y  # both sequences, this rank's heads
    c = cfg.seq_len // (2 * shape.z)
    local, prefix = attention_seconds(Scenario(wl, shape, m))
    overhead = 4 * m.op_overhead_s
    assert local == pytest.approx(2 * (units * per_pair * c * c / 2 + overhead))
    # the slowest z-rank: the last holds chunks 3 and 4 (3·C and 4·C keys before them); all hold 7·C² pairs
    assert prefix == pytest.approx(units * per_pair * (2 * shape.z - 1) * c * c + 2 * overhead)
    whole = attention_seconds(Scenario(dataclasses.replace(wl, context_parallel=False), GridShape(1, 2, 1, 1), m))
    assert whole == (pytest.approx(units * per_pair * cfg.seq_len**2 / 2 + overhead), 0.0)
    # hidden: each collective up to the squares' forward (0.3) or backward (0.7) share, at efficiency 0.5
    gather, scatter = wl.context_collectives(shape)[0], wl.context_collectives(shape)[-1]
    seconds = [m.comm_time(col.op.value, 4, 2, col.payload_bytes, 8) for col in (gather, scatter)]
    expect = cfg.n_layers * 0.5 * (min(seconds[0], 0.3 * local) + min(seconds[1], 0.7 * local))
    assert context_hidden(Scenario(wl, shape, m)) == pytest.approx(expect)
    assert step_time(wl, shape, m).hidden_by_mechanism["context"] == pytest.approx(expect)


def test_overlap_auto_tunes_the_knobs_to_the_fastest_policy_that_fits():
    """``overlap="auto"``: every knob variant of the all-on policy is priced and the fastest that
    fits is taken (never slower than the default knobs), for the grids the plan ranks first."""
    from axon4d.options.overlap_policy import OverlapPolicy
    from axon4d.plan.candidate import tune_overlap

    variants = OverlapPolicy().knob_variants()
    assert len(variants) == 3 * 2 * 3 * 4 and OverlapPolicy() in variants
    assert all((v.oag, v.oar, v.ors, v.odp) == (True,) * 4 for v in variants)  # knobs only, never mechanisms
    assert OverlapPolicy.only("oar").knob_variants() == [OverlapPolicy.only("oar")]  # nothing to tune
    m = load("perlmutter")
    wl = Workload(SIZES["20B"], batch=64)
    shape = GridShape(2, 4, 8, 2)
    best = tune_overlap(wl, shape, m)
    priced = [evaluate(wl, shape, m, v) for v in variants]
    fastest = min(c.time.step_s for c in priced if c.fits)
    assert best.fits and best.time.step_s == pytest.approx(fastest, rel=1e-9)
    assert best.time.step_s <= evaluate(wl, shape, m).time.step_s
    # a memory limit the deeper policies break: the choice fits it
    tight = evaluate(wl, shape, m).mem.peak * 1.0001
    assert tune_overlap(wl, shape, m, memory_limit=tight).mem.peak <= tight
    # plan(overlap="auto"): the best grid carries its tuned policy, and it is never slower
    auto = plan(SIZES["20B"], 128, m, 64, overlap="auto", **PINNED)
    default = plan(SIZES["20B"], 128, m, 64, **PINNED)
    assert auto.overlap == auto.best.overlap and auto.best.time.step_s <= default.best.time.step_s
    assert auto.to_json(1)["candidates"][0]["overlap"] == auto.best.overlap.spec()


def test_overlap_auto_for_a_given_grid_uses_the_planners_knobs_where_it_can_price_the_job(monkeypatch, tmp_path):
    from axon4d.options.overlap_policy import OverlapPolicy
    from axon4d.plan.auto import choose_overlap
    from axon4d.plan.candidate import tune_overlap

    monkeypatch.delenv("AXON4D_MACHINE", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./local.json
    shape = GridShape(2, 4, 8, 2)
    assert choose_overlap(shape) == OverlapPolicy()  # no model: the default knobs
    assert choose_overlap(shape, model="20B", batch=64) == OverlapPolicy()  # no machine description
    chosen = choose_overlap(shape, model="20B", batch=64, machine="perlmutter")
    assert chosen == tune_overlap(Workload(SIZES["20B"], batch=64), shape, load("perlmutter")).overlap
    monkeypatch.setenv("AXON4D_MACHINE", "perlmutter")
    assert choose_overlap(shape, model="20B", batch=64) == chosen
    with pytest.raises(ValueError, match="chosen by the planner"):
        OverlapPolicy.parse("auto")


def _timed_in_lockstep(grid):
    import time

    from axon4d.measure.timing import LOCKSTEP_S, Timer

    pause = 3 * LOCKSTEP_S * (1 + 2 * grid.rank)  # rank 0 the shortest, the last rank the longest
    return Timer(grid, reps=2).measure(lambda: time.sleep(pause))


@pytest.mark.slow
def test_long_work_is_timed_until_the_slowest_rank_is_done(pools):
    """Work of LOCKSTEP_S or more per call is timed with a barrier around each call: every rank
    gets the slowest rank's time, as in a step, not the mean of ranks that drifted apart."""
    from axon4d.measure.timing import LOCKSTEP_S

    times = pools(2).run((1, 1, 1, 2), _timed_in_lockstep)
    # the slower rank's pause, 9·LOCKSTEP_S, less the ranks' skew leaving the first barrier (one
    # rank starts its clock late; 0.3 ms measured on a loaded host): far above the 6·LOCKSTEP_S
    # mean of the two pauses that ranks timed apart would give
    assert times[0] == times[1] and times[0] >= 0.95 * 3 * LOCKSTEP_S * 3


def test_norms_are_priced_as_the_kernel_that_runs():
    """LayerNorm with G_x = 1 runs torch's fused kernel (axon4d.nn.norm.whole): ~2 + 3 passes over
    the activations; split over x both norms run axon4d's fused Function (LayerNorm ~4 + 7, RMSNorm
    ~2 + 6); RMSNorm with G_x = 1 (``F.rms_norm``) and balanced recomputation (which keeps the
    statistics and re-runs ``normalize``) take the elementwise chain's ~5 + 8 — for balanced the
    recomputed work adds back the difference from what the step priced."""
    from axon4d.plan.block_extras import norm_passes
    from axon4d.plan.recompute import recomputed_seconds

    gpt = Workload(SIZES["5B"], batch=16, dtype="bfloat16")
    llama = Workload(dataclasses.replace(SIZES["5B"], arch="llama"), batch=16, dtype="bfloat16")
    whole, split = GridShape.parse((1, 4, 2, 1), 8), GridShape.parse((2, 2, 2, 1), 8)
    assert norm_passes(gpt, whole) == (2, 3)
    assert norm_passes(gpt, split) == (4, 7) and norm_passes(llama, split) == (2, 6)
    assert norm_passes(llama, whole) == norm_passes(gpt, whole, "balanced") == norm_passes(gpt, split, "balanced")
    assert norm_passes(llama, whole) == (5, 8)
    m = load("perlmutter")
    b, h = gpt.local_tokens(whole), gpt.model.hidden
    chain = 2 * m.elementwise_time(8 * b * h * gpt.element_size, 8)  # two norms, (5 + 8) − (2 + 3) passes
    act = m.activation_time(b * gpt.model.ffn // 4, 8)[0]
    normalize = m.elementwise_time(3 * b * h * gpt.element_size, 8)
    balanced = Scenario(gpt, whole, m, recompute="balanced")
    assert recomputed_seconds(balanced) == pytest.approx(2 * (act + 2 * normalize) + chain)
    # split norms: balanced adds back (5 + 8) − (4 + 7) passes of the chain over the fused Function
    bs, hs = gpt.local_tokens(split), h // 2
    act_s = m.activation_time(bs * gpt.model.ffn // 2, 8)[0]
    norm_s = m.elementwise_time(3 * bs * hs * gpt.element_size, 8)
    chain_s = 2 * m.elementwise_time(2 * bs * hs * gpt.element_size, 8)
    assert recomputed_seconds(Scenario(gpt, split, m, recompute="balanced")) == pytest.approx(
        2 * (act_s + 2 * norm_s) + chain_s
    )


def test_balanced_recomputation_re_makes_the_activation_of_the_mlp_a_block_has():
    """Balanced recomputation re-makes each block's MLP activation in backward: a dense block's, of
    ``ffn``; an MoE block's shared experts' (``axon4d.nn.moe``, shared_experts · expert_ffn wide) —
    the dense width an MoE block does not have changes nothing, and without shared experts there is
    no activation to re-make."""
    from axon4d.plan.recompute import recomputed_seconds

    moe = ModelConfig(n_layers=2, hidden=256, n_heads=4, vocab_size=256, seq_len=64, arch="llama")
    moe = moe.replace(n_experts=8, experts_per_token=2, expert_ffn=128, shared_experts=1)
    m, shape = load("perlmutter"), GridShape(1, 2, 2, 1)

    def rerun(cfg):
        return recomputed_seconds(Scenario(Workload(cfg, 8, dtype="bfloat16"), shape, m, recompute="balanced"))

    assert rerun(moe) == pytest.approx(rerun(moe.replace(ffn_hidden=4096)))  # the dense MLP's width: not in it
    b = Workload(moe, 8, dtype="bfloat16").local_tokens(shape)
    act = m.activation_time(b * 128 * 2 // 2, 4)[0]  # the shared experts' SwiGLU, f/G_y columns of gate and up
    assert rerun(moe) - rerun(moe.replace(shared_experts=0)) == pytest.approx(2 * act)


def test_the_loss_chunk_the_planner_prices_is_the_loss_s():
    """The planner may not import the layers: its copy of the vocabulary-parallel loss's row chunk
    (fp32 bytes, bounding the loss's temporaries in ``BackwardWalk.head``) must be the loss's own."""
    from axon4d.nn.loss import CHUNK_BYTES
    from axon4d.plan.backward_walk import CE_CHUNK_BYTES

    assert CE_CHUNK_BYTES == CHUNK_BYTES
