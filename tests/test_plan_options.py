"""The planner's step options (issue 31): micro-batches, ZeRO, activation offload, FP8 weight gathers,
and the one search over them (``axon4d.plan.scenario``, ``cost``, ``memory``, ``search``).

Pure pricing, no process group: each option's effect on time, bytes and memory follows from what the
runtime does with it, and the search's choice is the best of what it prices.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from axon4d.config import SIZES, ModelConfig
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Op, Term
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import SCALE_BYTES
from axon4d.plan import cli
from axon4d.plan.candidate import device_need, fits, scenario_memory
from axon4d.plan.cost import step_estimate
from axon4d.plan.layers import in_block, layer_cost
from axon4d.plan.machine import load
from axon4d.plan.memory import memory
from axon4d.plan.offload_cost import copy_queue
from axon4d.plan.options import Choices, best_options, lower_bound
from axon4d.plan.persistent import local_param_count, local_param_tensors, sixteen_bit_weights
from axon4d.plan.saved import block_bytes
from axon4d.plan.scenario import Scenario
from axon4d.plan.search import plan
from axon4d.plan.walk import ONCE_PER_STEP, zero_gathers
from axon4d.plan.workload import Workload

ALL = OverlapPolicy.parse("all")
PERLMUTTER = load("perlmutter")
WL_20B = Workload(SIZES["20B"], batch=256)
SHAPE = GridShape(2, 2, 4, 4)


def _sc(**options):
    return Scenario(WL_20B, SHAPE, PERLMUTTER, ALL, options.pop("recompute", "none"), **options)


def test_micro_batches_repeat_the_passes_and_reduce_over_data_once():
    one, four = step_estimate(_sc()), step_estimate(_sc(micro_batches=4))
    micro = step_estimate(_sc().__class__(dataclasses.replace(WL_20B, batch=64), SHAPE, PERLMUTTER, ALL))
    # the data axis (E12) and the batch axis (E13, replicated gradients) move the bytes of one step
    assert four.bytes_by_axis["data"] == one.bytes_by_axis["data"]
    assert four.bytes_by_axis["batch"] == one.bytes_by_axis["batch"]
    # the z axis (E10, E11) and the activation axes once per micro-batch
    assert four.bytes_by_axis["z"] == 4 * micro.bytes_by_axis["z"]
    assert four.bytes_by_axis["y"] == 4 * micro.bytes_by_axis["y"] == one.bytes_by_axis["y"]
    # compute: four passes of a quarter of the tokens, the optimizer once
    assert four.compute_s == pytest.approx(4 * (micro.compute_s - micro.optimizer_s) + micro.optimizer_s)
    assert four.optimizer_s == one.optimizer_s and four.micro_batches == 4
    assert four.step_s > one.step_s  # smaller GEMMs, the weight gathers four times
    # memory: a quarter of the activations, the gradient sums held through every backward
    m1, m4 = memory(WL_20B, SHAPE, "none", ALL), memory(WL_20B, SHAPE, "none", ALL, micro_batches=4)
    assert m4.activations == pytest.approx(m1.activations / 4, rel=0.01) and m4.peak < m1.peak
    assert ONCE_PER_STEP >= {Term.E12, Term.E13, Term.NORM_GRAD, Term.EMBEDDING_GRAD}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_kept_weight_blocks_are_gathered_once_per_step(recompute):
    keep = OverlapPolicy.parse("all,keep")
    for policy in (ALL, keep):
        sc = Scenario(WL_20B, SHAPE, PERLMUTTER, policy, recompute, micro_batches=4)
        four, one = step_estimate(sc), step_estimate(sc.micro())
        layers = [layer_cost(s, sc.micro()) for s in sc.linears]
        # one pass's E10f (bytes, seconds) over every layer and over the blocks' layers
        every = [sum(lc.spec.count * f(lc) for lc in layers) for f in (_e10f_bytes, _e10f_seconds)]
        blocks = [
            sum(lc.spec.count * f(lc) for lc in layers if in_block(lc.spec, sc)) for f in (_e10f_bytes, _e10f_seconds)
        ]
        # the step's E10f: its z collectives less four passes' others (E10b, E11)
        step = [
            four.bytes_by_axis["z"] - 4 * (one.bytes_by_axis["z"] - every[0]),
            four.comm_by_axis["z"] - 4 * (one.comm_by_axis["z"] - every[1]),
        ]
        if policy is ALL:  # gathered by every micro-batch
            expected = [4 * e for e in every]
        elif recompute == "full":  # carried, but for the blocks' layers, which gather in every micro-batch
            expected = [e + 3 * b for e, b in zip(every, blocks)]
        else:  # carried from the first micro-batch to the others: once per step
            expected = every
        assert step == pytest.approx(expected, rel=1e-9), (policy.spec(), recompute)
        assert 0 < blocks[0] < every[0]


def _e10f_bytes(lc):
    return lc.term_bytes.get(Term.E10F, 0)


def _e10f_seconds(lc):
    return lc.comm.get(Term.E10F, 0.0)


def test_micro_batch_counts_must_split_the_batch_on_the_grid():
    with pytest.raises(ValueError, match="micro_batches = 3 does not divide the batch of 256"):
        _sc(micro_batches=3)
    # a rank holds 256 / (4 · 4) = 16 sequences: a micro-batch count must divide them
    assert best_options(WL_20B, SHAPE, PERLMUTTER, ALL, Choices(micro_batches=32)) is None


def test_zero_shards_the_optimizer_and_gathers_the_parameters_over_data():
    n = local_param_count(WL_20B, SHAPE)
    m0, m1, m2 = (memory(WL_20B, SHAPE, "none", ALL, zero=z) for z in (0, 1, 2))
    assert m0.optimizer == n * 8  # two fp32 moments (the parameters are the fp32 master weights)
    assert m1.optimizer == m2.optimizer == math.ceil(n / 4) * 8
    # training in bf16 with data 4: the Linear weights (w of the n; not the token table) in bf16, 1/4
    # of their fp32 masters
    weights = sixteen_bit_weights(WL_20B, SHAPE, zero=1)
    w, parts = sum(weights), sum(math.ceil(k / 4) for k in weights)
    assert 0.9 * n < w < n and sixteen_bit_weights(WL_20B, SHAPE, zero=0) == []
    assert m0.params == m0.grads == n * 4
    assert m1.params == m2.params == (n - w) * 4 + w * 2 + parts * 4 < 0.8 * m0.params
    assert m1.grads == (n - w) * 4 + parts * 4 and m2.grads == math.ceil(n / 4) * 4  # the masters' parts
    assert m2.peak <= m1.peak < m0.peak
    # under accumulation the held sums are whole, but the step sees the masters' parts
    assert memory(WL_20B, SHAPE, "none", ALL, zero=2, micro_batches=2).grads == m1.grads
    fp32 = dataclasses.replace(WL_20B, dtype="float32")  # fp32 training: the parameters are the masters
    assert sixteen_bit_weights(fp32, SHAPE, zero=1) == []
    assert memory(fp32, SHAPE, "none", ALL, zero=1).params == memory(fp32, SHAPE, "none", ALL).params == n * 4
    t0, t1, t2 = (step_estimate(_sc(zero=z)) for z in (0, 1, 2))
    per_tensor = dataclasses.replace(ALL, bucket_mb=0.0)
    gathers = zero_gathers(Scenario(WL_20B, SHAPE, PERLMUTTER, per_tensor, zero=1))  # one per parameter
    assert len(gathers) == len(local_param_tensors(WL_20B, SHAPE))
    assert all((g.op, g.axis) == (Op.ALL_GATHER, "data") for g in gathers)
    # the bf16 weights' parts and the fp32 rest, padded to 4 parts each
    gathered = sum(g.payload_bytes for g in gathers)
    assert w * 2 + (n - w) * 4 <= gathered <= w * 2 + (n - w) * 4 + 4 * 4 * len(gathers)
    assert t1.bytes_by_axis["data"] == t0.bytes_by_axis["data"] + sum(g.payload_bytes for g in gathers)
    one = dataclasses.replace(ALL, bucket_mb=1e6)  # a bucket big enough for every parameter: one gather per dtype
    assert len(zero_gathers(Scenario(WL_20B, SHAPE, PERLMUTTER, one, zero=1))) == 2
    assert len(zero_gathers(Scenario(fp32, SHAPE, PERLMUTTER, one, zero=1))) == 1
    # the default on an accelerator: 25 MiB buckets (OverlapPolicy.bucket_bytes), as the runtime makes them
    bucketed = zero_gathers(_sc(zero=1))
    assert len(tensors := local_param_tensors(WL_20B, SHAPE)) > len(bucketed) > 2
    assert sum(g.payload_bytes for g in bucketed) == gathered
    host = dataclasses.replace(PERLMUTTER, accelerator=False)  # one gather per parameter on the host
    assert len(zero_gathers(Scenario(WL_20B, SHAPE, host, ALL, zero=1))) == len(tensors)
    assert t0.optimizer_s / 4 < t1.optimizer_s < t0.optimizer_s  # a quarter of the step, and the copies of the gathers
    # ZeRO-2: E12 is a reduce-scatter (half an all-reduce's ring traffic)
    e12 = [lc for lc in (layer_cost(s, _sc(zero=2)) for s in _sc().linears) if Term.E12 in lc.comm]
    assert e12 and all(lc.comm[Term.E12] < layer_cost(lc.spec, _sc()).comm[Term.E12] for lc in e12)
    assert t2.traffic_bytes < t1.traffic_bytes
    assert zero_gathers(Scenario(WL_20B, GridShape(2, 2, 16, 1), PERLMUTTER, ALL, zero=1)) == []  # G_data = 1


def test_the_copy_queue_exposes_what_the_side_stream_cannot_fit_behind_the_compute():
    """offload_cost.copy_queue, worked by hand: 4 blocks, the first 2 offloaded, forward 1, backward 2, head 1,
    copy 3 — the second block's copy out queues behind the first (ends at 6), block 1's fetch is issued
    when block 2's gradient arrives (7, ready 10), block 0's at 9 (after block 1's fetch: ready 13); the
    backward ends at 15 instead of 13."""
    assert copy_queue(3.0, 2, 4, 1.0, 2.0, 1.0) == pytest.approx(2.0)
    assert copy_queue(0.0, 4, 4, 1.0, 2.0, 1.0) == 0.0  # an infinitely fast link hides everything
    assert copy_queue(0.5, 2, 4, 1.0, 2.0, 1.0) == 0.0  # each copy fits its window
    exposed = [copy_queue(c, 2, 8, 1.0, 2.0, 1.0) for c in (1.0, 2.0, 4.0, 8.0)]
    assert exposed == sorted(exposed) and exposed[-1] > exposed[0]  # a slower link exposes more
    assert copy_queue(4.0, 4, 8, 1.0, 2.0, 1.0) > copy_queue(4.0, 2, 8, 1.0, 2.0, 1.0)  # more blocks, more
    # a link far slower than the compute: all 2k copies in a row, less the compute they overlap
    big = copy_queue(100.0, 3, 8, 1.0, 2.0, 1.0)
    assert 2 * 3 * 100.0 - (8 * 3.0 + 1.0) <= big <= 2 * 3 * 100.0
    # every block offloaded: the last one fetches its own activations when its backward starts
    assert copy_queue(3.0, 4, 4, 1.0, 2.0, 1.0) > copy_queue(3.0, 3, 4, 1.0, 2.0, 1.0)


def test_offload_moves_blocks_to_host_memory_and_prices_the_copies():
    n_layers = WL_20B.model.n_layers
    block = block_bytes(WL_20B, SHAPE, "balanced")
    base = memory(WL_20B, SHAPE, "balanced", ALL)
    for blocks in (1, 8, n_layers):
        m = memory(WL_20B, SHAPE, "balanced", ALL, offload=blocks)
        assert m.activations == pytest.approx(base.activations - blocks * block)  # the backward starts without them
        assert m.peak <= base.peak
        assert m.host == pytest.approx(blocks * block)
    # the copies: each block's bytes over the host link, hidden behind its block's forward and backward
    t0, t8 = step_estimate(_sc(recompute="balanced")), step_estimate(_sc(recompute="balanced", offload=8))
    copy = block / PERLMUTTER.host_link_Bps
    assert 0 <= t8.offload_s <= 8 * 2 * copy and t8.compute_s == pytest.approx(t0.compute_s + t8.offload_s)
    slow = dataclasses.replace(PERLMUTTER, host_link_Bps=PERLMUTTER.host_link_Bps / 100)
    t_slow = step_estimate(Scenario(WL_20B, SHAPE, slow, ALL, "balanced", offload=8))
    assert t_slow.offload_s > 8 * copy * 100  # a link too slow to hide: exposed
    # on a host (no accelerator) the copy is a memory copy on the compute cores: all of it exposed
    host = dataclasses.replace(PERLMUTTER, accelerator=False)
    t_host = step_estimate(Scenario(WL_20B, SHAPE, host, ALL, "balanced", offload=8))
    assert t_host.offload_s == pytest.approx(2 * 8 * host.elementwise_time(2 * block, SHAPE.world_size))
    # a machine file without its host link cannot price offload
    blind = dataclasses.replace(PERLMUTTER, host_link_Bps=0.0)
    assert not blind.can_offload
    with pytest.raises(ValueError, match="no host_link_Bps"):
        step_estimate(Scenario(WL_20B, SHAPE, blind, ALL, offload=2))
    with pytest.raises(ValueError, match="offload = 33 blocks"):
        _sc(offload=33)


def test_fp8_gathers_move_a_byte_per_weight_and_a_scale_per_rank():
    bf16, fp8 = _sc(), _sc(fp8_gather=True)
    for spec in bf16.linears:
        if spec.embedding:
            continue
        a, b = layer_cost(spec, bf16), layer_cost(spec, fp8)
        for term in (Term.E10F, Term.E10B):
            if term in a.term_bytes:
                assert b.term_bytes[term] == a.term_bytes[term] // 2 + SCALE_BYTES * SHAPE.z
        assert b.term_bytes[Term.E11] == a.term_bytes[Term.E11]  # gradients unchanged
        assert b.fwd > a.fwd  # the casts
    assert step_estimate(fp8).step_s < step_estimate(bf16).step_s
    # memory: a gathered block is restored beside its e4m3 bytes (one byte per element)
    m16, m8 = memory(WL_20B, SHAPE, "none", ALL), memory(WL_20B, SHAPE, "none", ALL, fp8_gather=True)
    assert m8.peak > m16.peak and m8.peak - m16.peak <= max(
        s.in_features * s.out_features // (SHAPE.x * SHAPE.y) for s in WL_20B.linears()
    ) * (1 + ALL.oag_depth)
    with pytest.raises(ValueError, match="fp8_gather with dtype float32"):
        Scenario(dataclasses.replace(WL_20B, dtype="float32"), SHAPE, PERLMUTTER, fp8_gather=True)


def test_each_grid_gets_its_fastest_fitting_options():
    """``best_options`` against every combination priced exhaustively on a few grids."""
    import itertools

    wl = Workload(SIZES["20B"], batch=128)
    limit = 30 * 2**30
    for grid in [(1, 4, 8, 4), (2, 2, 4, 8), (1, 4, 32, 1)]:
        shape = GridShape(*grid)
        chosen = best_options(wl, shape, PERLMUTTER, ALL, Choices(), limit)
        assert chosen is not None
        fitting = []
        for rc, k, z, off, fp8 in itertools.product(
            ("none", "selective", "balanced", "full"), (1, 2, 4), (0, 1, 2), (0, 5, 10, 15, 20), (False, True)
        ):
            if 128 // shape.size("batch") % k or (fp8 and shape.z == 1):
                continue
            sc = Scenario(wl, shape, PERLMUTTER, ALL, rc, k, z, off, fp8)
            if fits(scenario_memory(sc), PERLMUTTER, limit):
                fitting.append(step_estimate(sc).step_s)
        assert chosen.fits == bool(fitting)
        if fitting:
            assert chosen.time.step_s <= min(fitting) * 1.02, (grid, chosen.options, min(fitting))
            assert device_need(chosen.mem, PERLMUTTER) <= limit
        # the bound the search orders grids by is below what any option reaches
        assert lower_bound(wl, shape, PERLMUTTER, ALL, Choices()) <= chosen.time.step_s


@pytest.mark.slow
def test_the_bounded_search_finds_what_pricing_every_grid_finds():
    # the 20B with every sequence split (whole, and over z or z·data in both modes); the 10B on more
    # ranks with whole sequences (each split multiplies the grids to price exhaustively)
    for model, gpus, batch, cp in [("20B", 32, 32, "auto"), ("10B", 64, 128, False)]:
        bounded = plan(model, gpus, "perlmutter", batch, overlap="all", top=3, context_parallel=cp)
        everything = plan(model, gpus, "perlmutter", batch, overlap="all", top=None, context_parallel=cp)
        assert bounded.searched < everything.searched == everything.valid
        assert [c.time.step_s for c in bounded.candidates if c.fits][:3] == pytest.approx(
            [c.time.step_s for c in everything.candidates if c.fits][:3]
        )


def test_pinned_options_are_kept_and_bad_ones_refused():
    result = plan("20B", 64, "perlmutter", 64, recompute="full", micro_batches=2, zero=1, offload=0, fp8_gather=False)
    chosen = {
        (c.recompute, c.option("micro_batches"), c.option("zero"), c.option("fp8_gather")) for c in result.candidates
    }
    assert chosen == {("full", 2, 1, False)}
    with pytest.raises(ValueError, match="zero = 3: use auto or one of"):
        plan("20B", 64, "perlmutter", 64, zero=3)
    with pytest.raises(ValueError, match="offload = 99 blocks, but the model has 32"):
        plan("20B", 64, "perlmutter", 64, offload=99)
    with pytest.raises(ValueError, match="fp8_gather = 'yes'"):
        plan("20B", 64, "perlmutter", 64, fp8_gather="yes")
    # on a host (a calibrated CPU machine) offload gains nothing: the search leaves it off
    host = dataclasses.replace(PERLMUTTER, accelerator=False, name="host")
    assert all(c.option("offload") == 0 for c in plan("20B", 64, host, 64, top=3).candidates)


@pytest.mark.slow
def test_nothing_that_does_not_fit_is_shown_as_a_result(capsys):
    args = cli.argparse.ArgumentParser()
    cli.add_arguments(args)
    assert cli.main(args.parse_args(["--model", "80B", "--gpus", "8", "--batch", "8"])) == 1
    out = capsys.readouterr().out
    assert "no plan fits: 80B needs at least" in out and "--memory-gib" in out and "grid (x,y,z,d)" not in out
    assert cli.main(args.parse_args(["--model", "20B", "--gpus", "64", "--batch", "64", "--top", "3"])) == 0
    out = capsys.readouterr().out
    assert "best: (" in out and "recompute searched" in out and "grid (x,y,z,d)" in out


#: NCCL 2.24–2.27's tuner constants (src/graph/tuning.cc, Simple protocol), written out here so the
#: test's prices do not come from ``axon4d.plan.collective_model``: each collective's base latency,
#: and PAT's base, per-rank latency, divisor of the network latency per log2 of the nodes, and share
#: of the bus bandwidth
NCCL_BASE_S, PAT_BASE_S, PAT_PER_RANK_S, PAT_LOG_DIVISOR, PAT_BANDWIDTH = 8.4e-6, 8e-6, 2.8e-6, 3.5, 0.75


def _z_reduce_scatter_by_hand(shape, m, payload):
    """The prices of E11 (a reduce-scatter of ``payload`` bytes over the z group of rank 0) from the
    machine file's figures alone: a ring's G_z − 1 steps, those between consecutive members on
    different nodes at the network's latency, the rest at the NVLink level's, and (G_z − 1)/G_z of
    the payload at the network's per-rank bandwidth (the group spans nodes); PAT where every member
    is on its own node. Returns {algorithm: (steps, seconds)}."""
    nvlink, network = m.levels[0], m.levels[-1]
    nodes_of = [i * shape.stride("z") // m.devices_per_node for i in range(shape.z)]
    nodes = len(set(nodes_of))
    across = nodes - 1  # a ring through the node-ordered members crosses each node boundary once
    steps = shape.z - 1
    beta = network.beta_Bps if nodes > 1 else nvlink.beta_Bps
    ring = NCCL_BASE_S + (steps - across) * nvlink.alpha_s + across * network.alpha_s
    prices = {"ring": (steps, ring + (shape.z - 1) / shape.z * payload / beta)}
    if nodes == shape.z:
        log_nodes = int(math.log2(nodes))
        pat = PAT_BASE_S + log_nodes * network.alpha_s / PAT_LOG_DIVISOR + shape.z * PAT_PER_RANK_S
        prices["pat"] = (log_nodes, pat + payload / (beta * PAT_BANDWIDTH))
    return prices


@pytest.mark.slow  # a whole 80B search on 1024 ranks: ~8 s
def test_the_80B_showcase_plan_is_one_perlmutter_can_run():
    """AxoNN's showcase job as the planner now chooses it must be one a Perlmutter node can run: its
    device need (peak, fragmentation, the CUDA context, workspaces and its grid's NCCL buffers)
    within 40 GiB, the host memory its node's ranks pin within 256 GB less the reserve, dW's
    reduce-scatters priced in the fp32 the runtime sends, the z collectives as NCCL's tuner runs
    them, priced here by hand from the machine file's figures: on the chosen grid (one member of a
    z group per node) the cheaper of a ring whose every step crosses the network and PAT; on the
    best grid that fits with two or more members of a z group on a node, a ring of G_z − 1 steps
    (no PAT). Its MFU is whatever the model gives (bench/plan_showcase.py; docs/planner.md): no
    bound is asserted on it."""
    from axon4d.layout.geometry import Term, weight_shard_numel
    from axon4d.plan.device_memory import grid_communicators

    result = plan("80B", 1024, "perlmutter", 2048)
    best, m = result.best, result.machine
    assert best.fits and result.workload.preset == "bf16-fp32-reduce"
    assert device_need(best.mem, m) <= 40 * 2**30
    assert best.mem.reserved == pytest.approx(
        m.cuda_context_bytes + m.device_workspace_bytes + grid_communicators(best.shape) * m.nccl_buffer_bytes
    )
    assert best.mem.pinned_node <= m.host_memory_per_node - m.host_reserve_per_node < 256e9
    # the chosen grid's z groups have one member per node; the best that fits with two or more per
    # node is where the ring check applies
    shared = next(c for c in result.candidates if c.fits and c.shape.stride("z") < m.devices_per_node and c.shape.z > 1)
    assert best.shape.stride("z") >= m.devices_per_node
    for c in (shared, best):
        shape = c.shape
        sc = Scenario(
            result.workload,
            shape,
            m,
            c.overlap,
            c.recompute,
            **{k: v for k, v in c.options.items() if k != "recompute"},
        )
        qkv = next(s for s in sc.linears if s.name == "qkv")
        lc = layer_cost(qkv, sc)
        shard = weight_shard_numel(qkv.in_features, qkv.out_features, shape, qkv.transpose)
        payload = lc.term_bytes[Term.E11]
        assert payload == shard * shape.z * 4 and lc.term_calls[Term.E11] == 1  # fp32 dW blocks, as sent
        by_hand = _z_reduce_scatter_by_hand(shape, m, payload)
        algorithm = m.collective_algorithm("reduce_scatter", shape.z, shape.stride("z"), payload)
        if shape.stride("z") < m.devices_per_node:  # two or more of a z group on a node: no PAT, a ring
            assert algorithm.algorithm == "ring" and algorithm.steps == shape.z - 1
        else:  # one per node: PAT is a candidate; at this payload the ring's bandwidth wins
            assert set(by_hand) == {"ring", "pat"} and by_hand["ring"][1] < by_hand["pat"][1], by_hand
        chosen = min(by_hand, key=lambda a: by_hand[a][1])
        assert (algorithm.algorithm, algorithm.steps) == (chosen, by_hand[chosen][0])
        assert lc.comm[Term.E11] == pytest.approx(by_hand[chosen][1], rel=1e-12), (shape, by_hand)
    assert 0.2 < best.mfu < 0.75  # a figure a GPU can reach, reported as it comes out


def test_a_model_without_an_even_sequence_is_searched_whole():
    cfg = ModelConfig(n_layers=2, hidden=256, n_heads=4, vocab_size=512, seq_len=127)
    result = plan(cfg, 8, "perlmutter", 16, top=2)
    assert result.best.fits and not any(c.context_parallel for c in result.candidates)


def test_elementwise_work_is_priced_at_the_rate_measured_for_its_size():
    """A host's elementwise rate falls with the op's size (caches; outputs too large for the
    allocator to reuse are faulted in afresh): calibrate's curve prices each op at its size."""
    flat = dataclasses.replace(load("perlmutter"), accelerator=False, elementwise_Bps={"8": 6e9})
    curve = dataclasses.replace(flat, elementwise_curve={"8": [[12e6, 12e9], [50e6, 6e9], [200e6, 1.5e9]]})
    assert flat.elementwise_time(200e6, 8) == pytest.approx(200e6 / 6e9)
    assert curve.elementwise_time(200e6, 8) == pytest.approx(200e6 / 1.5e9)  # at a measured size
    assert curve.elementwise_time(1e6, 8) == pytest.approx(1e6 / 12e9)  # flat beyond the ends
    assert 200e6 / 1.5e9 > curve.elementwise_time(100e6, 8) > 100e6 / 6e9  # log-linear between
    act = dict(activation_s={"8": [1e-9, 2e-9]})
    f0, b0 = dataclasses.replace(flat, **act).activation_time(1e6, 8)
    f1, b1 = dataclasses.replace(curve, **act).activation_time(200e6 / 12, 8)  # 200 MB streamed
    assert (f1, b1) == pytest.approx((200e6 / 12 * 1e-9 * 4, 200e6 / 12 * 2e-9 * 4))  # 4× slower than the flat rate
    assert (f0, b0) == pytest.approx((1e-3, 2e-3))
