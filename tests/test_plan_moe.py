"""Protects the planner's Mixture-of-Experts pricing (axon4d/plan/moe_cost.py, moe_memory.py;
docs/planner.md "Mixture of Experts"): the collectives it prices are the ones the runtime logs.

- One MoE layer (``axon4d.nn.moe.MoE``) on inputs whose routing is *uniform* by construction —
  token g's k experts are (g·k + q) mod E, every share and chunk covering the experts evenly —
  logs exactly the planner's calls and payload bytes per (axis, term, phase) on every rank
  (``moe_cost.layer_collectives``; the phase the communication log records, forward or backward),
  in one chunk and in overlapped chunks, under each expert layout kind.
- A whole MoE ``Transformer`` step under random routing: every term the routing does not change
  (the router's, the counts', the dispatch's own rows, the combine's gradient, the router weight's
  gradient, the shared experts' and the dense layers') equals the planner's per (axis, term,
  phase) on every rank (``sent.step_collectives_by_phase``); the terms the routing moves have the
  planner's calls on every rank and, summed over the ranks, its bytes — what one rank receives another sent (the y gathers, padded to the largest share, at
  least the planner's over the ranks).

Start here when the MoE layer's collectives change: the planner mirrors them (it may not import
the layers).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

import axon4d
from axon4d.config import ModelConfig
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import MOE_LAYER_TERMS, Term
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan import load
from axon4d.plan.cost import step_estimate
from axon4d.plan.moe_cost import layer_collectives
from axon4d.plan.moe_placement import moe_chunks
from axon4d.plan.scenario import Scenario
from axon4d.plan.sent import step_collectives_by_phase
from axon4d.plan.workload import Workload

SEQ = 16


def moe_cfg(arch="llama", shared=1, k=2, experts=8, layers=2, dense=0, hidden=32):
    return ModelConfig(
        n_layers=layers,
        hidden=hidden,
        n_heads=4,
        n_kv_heads=2 if arch == "llama" else None,
        vocab_size=64,
        seq_len=SEQ,
        arch=arch,
        n_experts=experts,
        experts_per_token=k,
        expert_ffn=16,
        shared_experts=shared,
        moe_z_coef=1e-3,
        first_k_dense=dense,
    )


#: the MoE layer's tags (what the runtime logs for it), the router weight's gradient apart
LAYER_TERMS = {str(t) for t in MOE_LAYER_TERMS}
#: the terms whose bytes on one rank depend on where the router sends the tokens
ROUTED = {
    str(t)
    for t in (
        Term.MOE_COMBINE,
        Term.MOE_DISPATCH_GRAD,
        Term.MOE_ROWS_Y,
        Term.MOE_ROWS_Y_GRAD,
        Term.MOE_EXPERT,
        Term.MOE_EXPERT_UP,
        Term.MOE_EXPERT_UP_GRAD,
    )
}


def _host():
    return dataclasses.replace(load("perlmutter"), accelerator=False, name="host")


def _tally(records, keep=lambda tag: True):
    """{(axis, tag, phase): (calls, payload bytes)} of the log's ``records`` whose tag ``keep`` takes."""
    out: dict = {}
    for r in records:
        if keep(str(r.tag)):
            key = (r.axis, str(r.tag), r.phase)
            calls, sent = out.get(key, (0, 0))
            out[key] = (calls + 1, sent + r.payload_bytes)
    return out


def _priced_layer(collectives):
    """{(axis, term, phase): (calls, payload bytes)} of one layer's ``collectives`` (the planner's)."""
    out: dict = {}
    for c in collectives:
        key = (c.axis, str(c.term), c.phase)
        calls, sent = out.get(key, (0, 0))
        out[key] = (calls + 1, sent + c.payload_bytes)
    return out


def _uniform_layer(grid, cfg, tokens, policy):
    """One MoE layer's forward + backward on inputs routed uniformly (module docstring): the log's
    {(axis, tag, phase): (calls, bytes)} of the layer's terms, and the chunks the planner gives the layer."""
    from axon4d.nn.moe import MoE
    from axon4d.nn.moe_dense import DenseMoE

    with grid.scheduler.using(policy):
        torch.manual_seed(3)
        dense = DenseMoE(cfg)
        e, h, k = cfg.n_experts, cfg.hidden, cfg.experts_per_token
        gen = torch.Generator().manual_seed(4)
        q, _ = torch.linalg.qr(torch.randn(h, e, generator=gen))  # (h, E) orthonormal columns
        with torch.no_grad():
            dense.router.weight.copy_(q.t())
        levels = torch.full((tokens, e), -1.5)
        for g in range(tokens):
            for j in range(k):
                levels[g, (g * k + j) % e] = 3.0 - 0.6 * j  # token g's experts, a margin to the rest
        x_full = (levels @ q.t()).view(tokens // SEQ, SEQ, h)
        mod = MoE(cfg).load_dense_(dense)
        grid.comm.log.clear()
        x = axon4d.shard_input(x_full).detach().requires_grad_()
        y = mod(x)
        (y.square().sum() + mod.aux_loss).backward()
        logged = _tally(grid.comm.log.records, lambda tag: tag in LAYER_TERMS)
        local = tokens // grid.size("batch")
        chunks = moe_chunks(cfg, local, grid.shape, 4, grid.scheduler.policy, False, mod.layout)
    return logged, chunks


@pytest.mark.parametrize(
    "grid,policy",
    [
        ((1, 1, 2, 1), None),
        ((2, 1, 1, 2), None),
        ((1, 2, 2, 1), {"forward_chunks": 2, "min_chunk_kb": 0}),
        pytest.param((1, 2, 2, 2), None, marks=pytest.mark.slow),
        pytest.param((2, 2, 1, 2), {"forward_chunks": 2, "min_chunk_kb": 0}, marks=pytest.mark.slow),
    ],
)
def test_a_uniformly_routed_layer_logs_the_planner_s_collectives(pools, grid, policy):
    cfg = moe_cfg(shared=0)
    tokens = 4 * SEQ  # every share (and chunk) of every rank covers the 8 experts evenly
    shape = GridShape(*grid)
    local = tokens // shape.size("batch")
    for rank, (logged, chunks) in enumerate(pools(math.prod(grid)).run(grid, _uniform_layer, cfg, tokens, policy)):
        assert chunks == (2 if policy and shape.size("batch") > 1 else 1)
        priced = _priced_layer(layer_collectives(cfg, local, shape, 4, chunks))
        assert logged == priced, f"rank {rank} on {grid}: logged {logged} priced {priced}"


#: (grid, expert layout) of each layout kind: whole experts over every rank; split over x·y with
#: expert parallelism over data; over z with replicas over data; split over y with the rows moved over x
LAYOUT_CASES = [
    ((2, 2, 2, 1), "ep=world,tp=1"),
    ((2, 2, 1, 2), "ep=data,tp=x·y"),
    ((2, 1, 2, 2), "ep=z,tp=x·y"),
    ((2, 2, 2, 1), "ep=x·z,tp=y"),
]


@pytest.mark.parametrize("grid,layout", LAYOUT_CASES)
def test_each_expert_layout_logs_the_planner_s_collectives(pools, grid, layout):
    """The planner's calls and bytes per (axis, term, phase) for one uniformly routed layer under
    each layout kind, in two overlapped chunks, equal the comm log's on every rank."""
    cfg = moe_cfg(shared=0)
    tokens = 16 * SEQ  # every share of every rank (cut over y and x) and chunk covers the 8 experts evenly
    shape = GridShape(*grid)
    local = tokens // shape.size("batch")
    policy = {"forward_chunks": 2, "min_chunk_kb": 0}
    results = pools(math.prod(grid)).run(grid, _uniform_layer, cfg, tokens, policy, expert_layout=layout)
    for rank, (logged, chunks) in enumerate(results):
        assert chunks == 2
        priced = _priced_layer(layer_collectives(cfg, local, shape, 4, chunks, 1.0, layout))
        assert logged == priced, f"rank {rank} on {grid} under {layout}: logged {logged} priced {priced}"


def _model_step(grid, cfg, micro, recompute="none", zero=0, offload=0):
    """One logged training step of an MoE Transformer (after a warm-up step) under ``recompute``,
    Adam sharded over data at ``zero`` and the first ``offload`` blocks' saved tensors offloaded
    (every one: the size threshold at 0): the log's tally."""
    from axon4d.models.transformer import Transformer
    from axon4d.train.batches import accumulate
    from axon4d.zero import shard_optimizer

    torch.manual_seed(0)
    model = Transformer(cfg, recompute=recompute, offload=list(range(offload)) or None)
    if model.offloader is not None:
        model.offloader.min_bytes = 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    if zero:
        opt = shard_optimizer(opt, model, grid, stage=zero)
    gen = torch.Generator().manual_seed(1)
    seqs = 2 * grid.size("batch")

    def step():
        batch = torch.randint(0, cfg.vocab_size, (seqs * micro, SEQ + 1), generator=gen)
        accumulate(model, batch.chunk(micro), grid)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    grid.comm.log.clear()
    step()
    assert model.offloader is None or model.offloader.stats().copies_out > 0  # offload did move tensors
    if zero:
        opt.release()
    return _tally(grid.comm.log.records)


def _priced_step(cfg, grid, precision, micro, recompute="none", layout=None, zero=0, offload=0):
    shape = GridShape(*grid)
    wl = Workload(cfg, 2 * shape.size("batch") * micro, precision=precision, expert_layout=layout)
    sc = Scenario(wl, shape, _host(), OverlapPolicy(), recompute, micro_batches=micro, zero=zero, offload=offload)
    calls, sent = step_collectives_by_phase(sc)
    priced = {(axis, str(term), phase): (calls[key], sent[key]) for key in calls for axis, term, phase in [key]}
    est = step_estimate(sc)
    by_axis = Counter()
    for (axis, *_), (_, nbytes) in priced.items():
        by_axis[axis] += nbytes
    assert dict(by_axis) == est.bytes_by_axis and sum(c for c, _ in priced.values()) == est.collectives
    return priced


#: routed terms whose blocks over y are padded to the largest: E17's gather and its gradient's
#: reduce-scatter, the experts' reduce-scatter after the down GEMM
PADDED = {str(Term.MOE_ROWS_Y), str(Term.MOE_ROWS_Y_GRAD), str(Term.MOE_EXPERT)}

MODEL_CASES = [
    ((1, 1, 2, 1), "fp32", "llama", 1, None),
    ((2, 1, 1, 2), "bf16-fp32-reduce", "gpt", 2, None),
    ((1, 1, 2, 2), "bf16-fp32-reduce", "llama", 2, "ep=z,tp=x·y"),  # replicas over data: their gradients' sums
    pytest.param((1, 2, 2, 2), "fp32", "llama", 1, None, marks=pytest.mark.slow),
    pytest.param((2, 2, 1, 2), "bf16", "llama", 2, None, marks=pytest.mark.slow),
    pytest.param((2, 1, 1, 2), "fp32", "llama", 1, "ep=world,tp=1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("grid,precision,arch,micro,layout", MODEL_CASES)
def test_a_model_step_logs_the_planner_s_collectives(pools, grid, precision, arch, micro, layout):
    _check_step(pools, grid, precision, arch, micro, layout)


#: MoE with the step's other options, each expert layout kind (on 4 ranks): (grid, precision, arch,
#: micro-batches, layout, recompute, ZeRO stage, offloaded blocks). Under full recomputation every
#: block's MoE forward collectives but the counts exchange are issued again in the backward
#: (``recompute.rerun_collectives``), up to the layer's last saved tensor: torch's checkpoint stops
#: a block's re-run there, so the output's rows back to features over x and its gather over y are not
#: issued again (``moe_cost.output_moves``; the last two cases); ZeRO's all-gathers run in the
#: optimizer phase; offload moves none. The first is fast.
OPTION_CASES = [
    ((2, 1, 2, 1), "bf16-fp32-reduce", "llama", 2, "ep=x·z,tp=y", "selective", 0, 1),
    ((1, 2, 1, 2), "bf16", "gpt", 1, "ep=data,tp=x·y", "balanced", 1, 2),
    ((1, 1, 2, 2), "fp32", "llama", 2, "ep=z,tp=x·y", "full", 2, 0),
    ((2, 2, 1, 1), "bf16", "gpt", 1, "ep=world,tp=1", "none", 0, 2),
    ((2, 1, 1, 2), "bf16-fp32-reduce", "llama", 1, None, "full", 1, 1),
    ((1, 1, 2, 2), "bf16-fp8-gather", "gpt", 2, None, "selective", 0, 2),
    ((2, 2, 1, 1), "bf16", "llama", 1, "ep=x·z,tp=y", "full", 0, 0),
    ((1, 2, 2, 1), "bf16", "llama", 1, None, "full", 0, 0),
]


@pytest.mark.parametrize(
    "case",
    [OPTION_CASES[0], *(pytest.param(c, marks=pytest.mark.slow) for c in OPTION_CASES[1:])],
    ids=lambda c: "-".join(str(v) for v in (*c[:2], f"mb{c[3]}", c[4] or "default", c[5], f"zero{c[6]}", f"off{c[7]}")),
)
def test_a_model_step_with_recompute_zero_and_offload_logs_the_planner_s_collectives(pools, case):
    _check_step(pools, *case)


#: FP8 dispatch (``dispatch=fp8``: the dispatch and the combine's gradient move e4m3 rows and a scale
#: per 128 features) on a model of hidden 256: one layer in two chunks under two layout kinds, and
#: a step under full recomputation, whose re-run dispatches in FP8 again
FP8_LAYOUT_CASES = [((2, 2, 2, 1), "ep=world,tp=1,dispatch=fp8"), ((2, 2, 1, 2), "ep=data,tp=x·y,dispatch=fp8")]


@pytest.mark.parametrize("grid,layout", FP8_LAYOUT_CASES)
def test_fp8_dispatch_logs_the_planner_s_packed_bytes(pools, grid, layout):
    cfg = moe_cfg(shared=0, hidden=256)
    tokens = 16 * SEQ
    shape = GridShape(*grid)
    local = tokens // shape.size("batch")
    policy = {"forward_chunks": 2, "min_chunk_kb": 0}
    results = pools(math.prod(grid)).run(grid, _uniform_layer, cfg, tokens, policy, expert_layout=layout)
    for rank, (logged, chunks) in enumerate(results):
        priced = _priced_layer(layer_collectives(cfg, local, shape, 4, chunks, 1.0, layout))
        assert logged == priced, f"rank {rank} on {grid} under {layout}: logged {logged} priced {priced}"
        plain = _priced_layer(layer_collectives(cfg, local, shape, 4, chunks, 1.0, layout.replace(",dispatch=fp8", "")))
        assert priced != plain  # the packed rows are priced, not the fp32 ones


@pytest.mark.slow
def test_a_step_under_fp8_dispatch_and_full_recomputation_logs_the_planner_s_collectives(pools):
    _check_step(
        pools, (1, 1, 2, 2), "bf16-fp32-reduce", "llama", 1, "ep=z·data,tp=1,dispatch=fp8", "full", 2, 0, hidden=256
    )


#: dense blocks first (DeepSeek-V3's ``first_k_dense``): 3 blocks, the first dense, the other two MoE
#: — a step of two block kinds, priced as each kind's step weighted by its share of the blocks
#: (``Workload.kinds``), with each expert layout kind and the step's options; the first is fast
DENSE_FIRST_CASES = [
    ((1, 1, 2, 2), "bf16-fp32-reduce", "llama", 2, "ep=z,tp=x·y", "none", 2, 0),
    ((2, 1, 1, 2), "fp32", "gpt", 1, None, "full", 1, 1),
    ((2, 2, 1, 1), "bf16", "llama", 1, "ep=world,tp=1", "selective", 0, 2),
]


@pytest.mark.parametrize(
    "case",
    [DENSE_FIRST_CASES[0], *(pytest.param(c, marks=pytest.mark.slow) for c in DENSE_FIRST_CASES[1:])],
    ids=lambda c: "-".join(str(v) for v in (*c[:2], f"mb{c[3]}", c[4] or "default", c[5], f"zero{c[6]}", f"off{c[7]}")),
)
def test_a_step_with_dense_blocks_first_logs_the_planner_s_collectives(pools, case):
    _check_step(pools, *case, layers=3, dense=1)


def _check_step(
    pools, grid, precision, arch, micro, layout, recompute="none", zero=0, offload=0, layers=2, dense=0, hidden=32
):
    """A whole MoE model's logged step against the planner's per (axis, term, phase) (module docstring)."""
    cfg = moe_cfg(arch, shared=1 if arch == "llama" else 0, layers=layers, dense=dense, hidden=hidden)
    priced = _priced_step(cfg, grid, precision, micro, recompute, layout, zero, offload)
    results = pools(math.prod(grid)).run(
        grid, _model_step, cfg, micro, recompute, zero, offload, precision=precision, expert_layout=layout
    )
    for rank, logged in enumerate(results):
        assert logged.keys() == priced.keys(), (
            f"rank {rank}: (axis, term, phase) differ {logged.keys() ^ priced.keys()}"
        )
        for key, (calls, nbytes) in priced.items():
            got_calls, got_bytes = logged[key]
            assert got_calls == calls, f"rank {rank} {key}: {got_calls} calls logged, {calls} priced"
            if key[1] not in ROUTED:
                assert got_bytes == nbytes, f"rank {rank} {key}: {got_bytes} B logged, {nbytes} priced"
    for key in priced:
        if key[1] in ROUTED:  # over the ranks: what one rank receives another sent
            total, want = sum(logged[key][1] for logged in results), len(results) * priced[key][1]
            if key[1] in PADDED:  # blocks padded to the largest y share: at least the mean's
                assert total >= want, f"{key}: {total} B over the ranks < {want} priced"
            else:
                assert total == want, f"{key}: {total} B over the ranks, {want} priced"


#: an MoE model of tests/test_recompute.py's memory model's size (MEM_CFG's Llama, its MLP now 8
#: experts of 128, top-2, and one shared expert)
MEM_MOE = ModelConfig(
    n_layers=2,
    hidden=128,
    n_heads=8,
    n_kv_heads=2,
    vocab_size=256,
    seq_len=128,
    arch="llama",
    n_experts=8,
    experts_per_token=2,
    expert_ffn=128,
    shared_experts=1,
)


def _memory_case(grid, cfg, options):
    from tests.test_plan_memory_options import _case

    return _case(grid, cfg, options)


#: MEM_MOE with a dense block first and two MoE blocks (``first_k_dense``: two block kinds)
MEM_DENSE_FIRST = MEM_MOE.replace(n_layers=3, first_k_dense=1)


@pytest.mark.parametrize(
    "world,grid,options,cfg",
    [
        (2, (1, 1, 2, 1), {}, MEM_MOE),
        (2, (1, 1, 2, 1), {"recompute": "full"}, MEM_MOE),
        (2, (1, 1, 2, 1), {}, MEM_DENSE_FIRST),
        # experts split over x (the default layout's tp = x·y): the up GEMM's sums all-reduced over x
        (2, (2, 1, 1, 1), {}, MEM_MOE),
        pytest.param(2, (2, 1, 1, 1), {"recompute": "full"}, MEM_MOE, marks=pytest.mark.slow),
        pytest.param(2, (2, 1, 1, 1), {}, MEM_MOE.replace(expert_ffn=256), marks=pytest.mark.slow),
        pytest.param(
            2, (2, 1, 1, 1), {"recompute": "full"}, MEM_MOE.replace(experts_per_token=1), marks=pytest.mark.slow
        ),
        pytest.param(4, (2, 1, 1, 2), {"micro_batches": 2}, MEM_MOE, marks=pytest.mark.slow),
        pytest.param(4, (1, 2, 1, 2), {"zero": 1}, MEM_MOE, marks=pytest.mark.slow),
        pytest.param(2, (1, 1, 2, 1), {"recompute": "full"}, MEM_DENSE_FIRST, marks=pytest.mark.slow),
        pytest.param(4, (1, 2, 1, 2), {"zero": 2, "offload": 1 / 3}, MEM_DENSE_FIRST, marks=pytest.mark.slow),
        # full recomputation with the first block offloaded: its MoE layer's kept rows go to the host
        # too (every token to every expert: the rows each rank receives are the planner's uniform ones)
        pytest.param(
            2,
            (1, 1, 2, 1),
            {"recompute": "full", "offload": 1 / 2},
            MEM_MOE.replace(n_experts=4, experts_per_token=4),
            marks=pytest.mark.slow,
        ),
        # balanced: the shared experts' MLP re-makes its activation in backward, as a dense MLP does
        pytest.param(2, (1, 1, 2, 1), {"recompute": "balanced"}, MEM_MOE, marks=pytest.mark.slow),
        pytest.param(2, (1, 2, 1, 1), {"recompute": "balanced"}, MEM_MOE, marks=pytest.mark.slow),
        # FP8 dispatch: priced as the compute dtype's exchange (docs/moe.md "FP8 dispatch")
        pytest.param(
            2,
            (1, 1, 2, 1),
            {"recompute": "full", "expert_layout": "ep=batch,dispatch=fp8"},
            MEM_MOE,
            marks=pytest.mark.slow,
        ),
    ],
    ids=lambda v: (
        f"dense{v.first_k_dense}-f{v.expert_ffn}-top{v.experts_per_token}"
        if isinstance(v, ModelConfig)
        else ".".join(map(str, v))
        if isinstance(v, tuple)
        else None
    ),
)
def test_an_moe_step_s_peak_memory_is_the_planner_s(pools, world, grid, options, cfg):
    """Peak bytes per rank of an MoE model's step, measured with torch's memory tracker (max over
    ranks; tests/test_plan_memory_options.py's measurement) against ``plan.memory``: within 5% —
    with every block MoE and with a dense block first (two block kinds), with the experts whole and
    split over x, wider and top-1 (the MoE layer's forward and backward as ``moe_memory`` counts
    them: the old single backward transient priced (2,1,1,1) +6% without recomputation, +10% at
    twice the width and +14% under full recomputation)."""
    from tests.test_plan_memory_options import TOLERANCE, _check

    options = dict(options)
    layout = options.pop("expert_layout", None)  # the grid's: measured and priced under it
    result = pools(world).run(grid, _memory_case, cfg, options, expert_layout=layout)[0]
    _check(result, f"MoE ({cfg.first_k_dense} dense first) on {grid} with {options}", TOLERANCE)


def test_full_recomputation_keeps_no_moe_layer_s_rebuilt_activations_past_its_backward(pools):
    """Under full recomputation each MoE block keeps only its input (and, where rows are exchanged,
    the rows its dispatches delivered; none on (2,1,1,1)) until its backward, so one more block
    adds its parameters, gradients and Adam states and that input alone: the measured peak's
    growth from 2 to 3 MoE blocks equals the planner's within 5%. Each block's re-run computes the
    auxiliary losses again (its ops must save what the forward's did); kept as the layer's
    ``aux_loss`` that re-run's graph held the rebuilt block's activations to the end of the backward
    — 2.96 MiB per block more here (slope 6.66 MiB measured against 3.70 priced). The peak itself,
    on (2,1,1,1) with the experts split over x, is the planner's within 5% too."""
    two, three = (
        pools(2).run((2, 1, 1, 1), _memory_case, MEM_MOE.replace(n_layers=n), {"recompute": "full"})[0] for n in (2, 3)
    )
    measured, priced = three[0] - two[0], three[2] - two[2]
    assert abs(measured - priced) <= 0.05 * priced, (
        f"one more MoE block under full recomputation: {measured / 2**20:.3f} MiB measured, {priced / 2**20:.3f} priced"
    )
    from tests.test_plan_memory_options import TOLERANCE, _check

    _check(two, "MoE on (2,1,1,1) under full recomputation", TOLERANCE)


def test_the_search_offers_only_grids_the_runtime_accepts():
    """The search's valid grids keep to the placement the MoE layer accepts (``axon4d.grid.rules.
    moe_placement``, the one home of the runtime's and the planner's rules)."""
    import numpy as np

    from axon4d.grid import rules
    from axon4d.grid.shape import factorizations
    from axon4d.nn.moe_experts import placement_rules
    from axon4d.plan.search import valid_mask

    refused = accepted = 0
    for cfg in (moe_cfg(), moe_cfg("gpt", shared=0, experts=12), moe_cfg(shared=3, experts=6)):
        for world in (8, 12, 16):
            shapes = factorizations(world)
            runtime = []
            for s in shapes:
                try:
                    rules.check(s, placement_rules(cfg))
                    runtime.append(True)
                except ValueError:
                    runtime.append(False)
            refused += runtime.count(False)
            accepted += runtime.count(True)
            wl = Workload(cfg, 48)
            mask = valid_mask(wl, np.array([s.as_tuple() for s in shapes]))
            assert not any(m and not ok for m, ok in zip(mask, runtime))
    assert refused > 0 and accepted > 0  # the rules do refuse grids, and not all


def test_the_size_table_s_moe_models_have_their_sources_sizes():
    from axon4d.config import get_config
    from axon4d.plan.moe_cost import param_counts

    total, active = param_counts(get_config("mixtral-8x7b"))  # the Mixtral paper: 46.7B, 12.9B active
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9
    total, active = param_counts(get_config("deepseek-v3-scale"))  # 671B, 37B: 3 dense blocks, MHA (+5% active)
    assert 1.0 < total / 671e9 < 1.01 and 1.0 < active / 37e9 < 1.06
    ds = get_config("deepseek-v3-scale")  # DeepSeek-V3's routing: its config's n_group, topk_group, scaling
    routing = (ds.router_scoring, ds.n_groups, ds.topk_groups, ds.routed_scaling_factor, ds.moe_aux_coef)
    assert routing == ("sigmoid", 8, 4, 2.5, 0.0) and ds.moe_bias_update_rate > 0 and ds.moe_seq_aux_coef > 0
    total, active = param_counts(get_config("moe-1t"))  # Kimi K2: 1.04T, 32B active; MHA
    assert 1.0e12 < total < 1.05e12 and active < 0.05 * total
    assert get_config("tiny-moe").moe


def test_an_moe_model_whose_blocks_are_all_dense_is_priced_as_the_dense_model():
    """``first_k_dense`` = n_layers: every block keeps the dense MLP (the runtime builds no MoE
    layer), so the step's time, bytes and memory are the dense model's."""
    from axon4d.plan.memory import memory

    cfg = moe_cfg(layers=2, dense=2)
    dense = cfg.replace(n_experts=0, shared_experts=0, first_k_dense=0)
    shape = GridShape(1, 2, 2, 1)
    a, b = Workload(cfg, 8), Workload(dense, 8)
    sa, sb = Scenario(a, shape, load("h100")), Scenario(b, shape, load("h100"))
    assert step_estimate(sa).step_s == step_estimate(sb).step_s
    assert step_collectives_by_phase(sa) == step_collectives_by_phase(sb)
    assert memory(a, shape).peak == memory(b, shape).peak
    assert a.flops() == b.flops()


def test_the_dense_blocks_step_is_priced_once_for_every_expert_layout():
    """A model with dense blocks before its MoE blocks: the dense blocks' step, which no expert
    layout changes, is made once per grid and options and shared by every layout the search prices
    (``cost._kind_estimate``): each layout's step equals the one priced on a machine that has
    priced no other layout, field for field."""
    cfg = moe_cfg(layers=3, dense=1)
    shape = GridShape(2, 2, 2, 2)
    layouts = ["ep=z·data,tp=x·y", "ep=x·y·z,tp=1", "ep=data,tp=x"]
    shared = load("h100")
    for layout in layouts:
        wl = Workload(cfg, 16, expert_layout=layout)
        alone = step_estimate(Scenario(wl, shape, load("h100")))
        reused = step_estimate(Scenario(wl, shape, shared))
        assert dataclasses.asdict(reused) == dataclasses.asdict(alone), layout
    kept = [key for key in shared.__dict__["_remembered"] if key[0] == "dense kind"]
    assert len(kept) == 1  # one dense step for the three layouts


def test_evaluate_refuses_a_grid_the_job_cannot_run_naming_each_broken_rule():
    """``axon4d.plan.evaluate`` (the public price of one grid) of a grid whose expert layout leaves
    a rank no whole expert: a ValueError naming the rule, the layout and what to do — not a
    division by zero deep in the MoE layer's price."""
    from axon4d.plan import evaluate

    wl = Workload(moe_cfg(layers=3, dense=1), 16, expert_layout="ep=world,tp=1")  # 8 experts, 16 ranks
    with pytest.raises(ValueError) as refused:
        evaluate(wl, GridShape(2, 2, 2, 2), load("h100"))
    message = str(refused.value)
    assert "grid (2, 2, 2, 2)" in message and "experts ep=world,tp=1" in message
    assert "n_experts = 8 is not divisible by G_x·G_y·G_z·G_data = 16" in message and "axon4d plan" in message
    assert evaluate(wl, GridShape(2, 2, 1, 2), load("h100")).mfu > 0  # 8 ranks: one expert each


def test_mfu_counts_the_active_parameters():
    """One more routed expert per token adds its 6·(3·hidden·f) FLOPs per token and layer; the
    experts a token does not reach add none."""
    cfg = moe_cfg(k=2)
    two, three = Workload(cfg, 8), Workload(cfg.replace(experts_per_token=3), 8)
    per_expert = 3 * cfg.hidden * cfg.expert_width
    assert three.flops() - two.flops() == pytest.approx(two.tokens * 6 * cfg.n_layers * per_expert)
    more = Workload(cfg.replace(n_experts=16), 8)  # more experts, the same active path but the router
    assert more.flops() - two.flops() == pytest.approx(two.tokens * 6 * cfg.n_layers * 8 * cfg.hidden)


def test_imbalance_prices_the_busiest_rank():
    """ρ > 1: more time (the busiest rank's GEMMs and all-to-alls) and more memory (its rows)."""
    from axon4d.plan.memory import memory

    shape = GridShape(1, 2, 2, 2)
    even, skewed = (Workload(moe_cfg(), 8, imbalance=rho) for rho in (1.0, 1.5))
    t_even = step_estimate(Scenario(even, shape, load("h100")))
    t_skew = step_estimate(Scenario(skewed, shape, load("h100")))
    assert t_skew.step_s > t_even.step_s and t_skew.comm_by_axis["batch"] > t_even.comm_by_axis["batch"]
    assert memory(skewed, shape).peak > memory(even, shape).peak
    with pytest.raises(ValueError, match="imbalance"):
        Workload(moe_cfg(), 8, imbalance=0.5)


def test_full_recomputation_hides_the_combine_gradients_behind_the_re_run():
    """Under full recomputation each MoE layer's combine gradients travel during its block's re-run
    (tests/test_moe_model.py checks the runtime does so): credited at most the machine's overlap
    efficiency times those all-to-alls' seconds, and not at all without full recomputation."""
    from axon4d.plan.layers import priced

    shape, m = GridShape(1, 2, 2, 2), load("h100")
    wl = Workload(moe_cfg(), 8)
    full, balanced = (step_estimate(Scenario(wl, shape, m, recompute=r)) for r in ("full", "balanced"))
    sc = Scenario(wl, shape, m, recompute="full")
    grads = sum(priced(c, sc)[0] for c in sc.moe_collectives if c.term == Term.MOE_COMBINE_GRAD)
    credit = full.hidden_by_mechanism.get("moe_rerun", 0.0)
    assert 0.0 < credit <= m.overlap_efficiency * grads * wl.model.moe_layers + 1e-12
    assert "moe_rerun" not in balanced.hidden_by_mechanism


@pytest.mark.slow
def test_the_plan_command_prices_the_1t_moe_on_1024_gpus_and_shows_its_placement(capsys):
    from axon4d.cli import main

    assert (
        main(
            ["plan", "--model", "moe-1t", "--gpus", "1024", "--machine", "h100", "--batch", "1024", "--top", "1"]
            + ["--expert-layout", "ep=batch,tp=x·y"]  # pinned: the search over layouts is bench/plan_moe.py's
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "39.2B active" in out
    line = next(x for x in out.splitlines() if x.startswith("expert layout "))
    # over batch: the expert-parallel axes z·data, named as the grid has them (data alone where G_z = 1)
    assert "384 experts over " in line and "(G_ep = 128)" in line and "per rank" in line


@pytest.mark.parametrize("name", ["tiny-moe", "mixtral-8x7b", "deepseek-v3-scale", "moe-1t", "small"])
def test_the_job_s_mfu_counts_the_planner_s_active_flops(name):
    """The training job's MFU (``ModelConfig.flops_per_token``) and the planner's (``Workload.flops``)
    count the same FLOPs per token: for an MoE model its active path, below the dense width's."""
    from axon4d.config import get_config
    from axon4d.plan.workload import Workload

    cfg = get_config(name)
    wl = Workload(cfg, 8)
    assert cfg.flops_per_token() == pytest.approx(wl.flops() / wl.tokens, rel=1e-12)
    if cfg.moe:
        all_experts = cfg.replace(experts_per_token=cfg.n_experts, n_groups=1, topk_groups=None)  # no group limit
        assert cfg.flops_per_token() < all_experts.flops_per_token()


def _moe_probe_step(grid, wl):
    """``ProbeModel`` of an MoE workload (bench/planner_accuracy.py --moe) after one step: its
    parameters on this rank, the collectives of a step, its MoE layers and whether each one's
    auxiliary loss is in the graph."""
    from axon4d.measure.probe import ProbeModel, measure_step
    from axon4d.nn.moe import MoE

    torch.manual_seed(0)
    model = ProbeModel(wl, grid)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    res = measure_step(model, steps=1, warmup=1)
    return (
        sum(p.numel() for p in model.parameters()),
        res["collectives"],
        len(layers),
        all(m.aux_loss is not None and m.aux_loss.requires_grad for m in layers),
    )


@pytest.mark.parametrize("grid", [(1, 1, 2, 1), (2, 1, 1, 2)])
def test_the_accuracy_probe_runs_the_moe_layer_the_planner_prices(pools, grid):
    """The accuracy bench's MoE probe puts an MoE layer in each block's MLP place: the planner's
    parameters per rank and collectives per step (random routing moves bytes between ranks, not calls),
    and the layers' auxiliary losses in the loss."""
    from axon4d.plan import local_param_count

    cfg = moe_cfg("gpt", shared=0).replace(vocab_size=64)
    wl = Workload(cfg, 4, "float32", embedding=False, norms=False, precision="fp32")
    shape = GridShape(*grid)
    t = step_estimate(Scenario(wl, shape, _host(), OverlapPolicy(bucket_mb=0.0)))
    for n_params, calls, layers, aux in pools(math.prod(grid)).run(grid, _moe_probe_step, wl):
        assert layers == cfg.n_layers and aux
        assert n_params == local_param_count(wl, shape)
        assert calls == t.collectives


def test_an_all_to_all_is_priced_from_the_machine_s_curve_where_it_has_one():
    """``all_to_all_seconds``: the machine's measured all-to-all curve of the batch axis' geometry
    where calibration wrote one, else grouped point-to-point sends (``Machine.comm_time``); the rows a
    rank sends of its own share (``OWN_SHARE_TERMS``) wait for the busiest peer, ρ times the mean."""
    from axon4d.layout.geometry import Collective, Op
    from axon4d.plan.moe_cost import OWN_SHARE_TERMS, all_to_all_seconds
    from axon4d.plan.tables import CommCurve

    shape = GridShape(1, 1, 2, 2)  # batch: 4 ranks, stride 1
    dispatch = Collective(Op.ALL_TO_ALL, "batch", 1 << 16, "forward", Term.MOE_DISPATCH)
    combine = dataclasses.replace(dispatch, term=Term.MOE_COMBINE)
    assert dispatch.term in OWN_SHARE_TERMS and combine.term not in OWN_SHARE_TERMS
    plain = load("h100")
    for c, payload in ((dispatch, 1.5 * (1 << 16)), (combine, 1 << 16)):
        assert all_to_all_seconds(plain, shape, c, 1.5) == plain.comm_time("all_to_all", 4, 1, payload, 4)
    # three peers in a node: one round of grouped sends, one latency of the level
    assert all_to_all_seconds(plain, shape, combine, 1.5) == pytest.approx(3.4e-6 + (1 << 16) * 3 / 4 / 360e9)
    curve = CommCurve("all_to_all", 4, 1, 4, [4096, 1 << 20], [1e-3, 2e-3])
    measured = dataclasses.replace(plain, comm=[curve])
    assert all_to_all_seconds(measured, shape, dispatch, 1.5) == curve.time(1.5 * (1 << 16))
    assert all_to_all_seconds(measured, shape, combine, 1.5) == curve.time(1 << 16)
    assert all_to_all_seconds(measured, shape, combine, 1.5) > 10 * all_to_all_seconds(plain, shape, combine, 1.5)
    other = dataclasses.replace(plain, comm=[dataclasses.replace(curve, group=2)])  # another geometry's curve
    assert all_to_all_seconds(other, shape, combine, 1.0) == all_to_all_seconds(plain, shape, combine, 1.0)


def test_an_all_to_all_pays_one_latency_per_round_of_peers_in_flight():
    """NCCL runs an all-to-all as point-to-point sends fused in one group call, ``P2P_PEERS_IN_FLIGHT``
    peers at a time: 128 ranks on 16 nodes pay one node-local round (7 peers) and ⌈120/16⌉ = 8
    network rounds, not 127 latencies in series; the bytes are the slower level's, as before."""
    from axon4d.plan.collective_model import P2P_PEERS_IN_FLIGHT, Link, Span, all_to_all_time

    assert P2P_PEERS_IN_FLIGHT == 16
    intra, net = Link(3e-6, 300e9), Link(12e-6, 25e9)
    payload = 128 * 4096.0  # 4 KiB to every rank
    local, remote = payload * 7 / 128 / 300e9, payload * 120 / 128 / 25e9
    assert all_to_all_time(payload, Span(128, 16, 8), intra, net) == pytest.approx(3e-6 + 8 * 12e-6 + remote)
    assert remote > local
    # 17 remote peers: two rounds; one rank per node: no node-local round
    assert all_to_all_time(payload, Span(18, 18, 1), intra, net) == pytest.approx(2 * 12e-6 + payload * 17 / 18 / 25e9)
    assert all_to_all_time(payload, Span(1, 1, 1), intra, net) == 0.0


def test_the_counts_host_sync_is_measured_where_calibrated_assumed_otherwise_and_free_on_the_host():
    """The forward of an MoE layer pays the counts exchange's host read (E15) on an accelerator: the
    machine's measured ``host_sync_s``, else the assumption ``HOST_SYNC_S``; on the host nothing
    (its ranks compute synchronously). Every shipped GPU file keeps the assumption, and says so."""
    from axon4d.plan.machine import available
    from axon4d.plan.moe_cost import HOST_SYNC_S, host_sync_seconds, layer_seconds

    gpu = load("h100")
    measured = dataclasses.replace(gpu, host_sync_s=2e-5)
    host = dataclasses.replace(measured, accelerator=False)
    assert host_sync_seconds(gpu) == HOST_SYNC_S and host_sync_seconds(measured) == 2e-5
    assert host_sync_seconds(host) == 0.0
    cfg, shape = moe_cfg(), GridShape(1, 1, 2, 1)

    def fwd(m):
        return layer_seconds(cfg, 64, shape, m, "bfloat16", 2, 1.0).fwd

    assert fwd(gpu) - fwd(measured) == pytest.approx(HOST_SYNC_S - 2e-5, rel=1e-9)
    assert fwd(measured) - fwd(dataclasses.replace(measured, host_sync_s=0.0)) == pytest.approx(2e-5, rel=1e-9)
    assert fwd(host) == fwd(dataclasses.replace(host, host_sync_s=1.0))
    for name in available():
        shipped = load(name)
        assert shipped.host_sync_s is None and "HOST_SYNC_S" in shipped.sources["host_sync_s"]


def _probe_peak(grid, wl):
    from axon4d.measure.probe import ProbeModel, measure_peak

    torch.manual_seed(0)
    return measure_peak(ProbeModel(wl, grid))


#: the probe's MoE model of the small grids (hidden 256, experts of 512)
PROBE_SMALL = ModelConfig(
    n_layers=2,
    hidden=256,
    n_heads=4,
    vocab_size=1024,
    seq_len=64,
    arch="gpt",
    n_experts=8,
    experts_per_token=2,
    expert_ffn=512,
)
#: the accuracy bench's own MoE probe model (bench/planner_accuracy.py --moe: hidden 512, 8 heads,
#: vocab 2048, 8 experts of 1024, top-2, sequences of 128)
PROBE_BENCH = PROBE_SMALL.replace(hidden=512, n_heads=8, vocab_size=2048, seq_len=128, expert_ffn=1024)


@pytest.mark.parametrize(
    "world,grid,cfg,batch",
    [
        # y splits the experts, dispatched in two overlapped chunks: autograd sums each chunk's dW of
        # up and down out of place (moe_memory.BackwardPhases): priced -8.4% without that sum
        (4, (1, 2, 2, 1), PROBE_BENCH, 4),
        pytest.param(4, (1, 1, 4, 1), PROBE_SMALL, 8, marks=pytest.mark.slow),
        pytest.param(4, (1, 4, 1, 1), PROBE_SMALL, 8, marks=pytest.mark.slow),
        # experts whole on one rank, each split over y: the optimizer step is the peak, Adam holding
        # the previous tensor's denominator beside sqrt(v) and its quotient of experts.down (3 of the
        # largest tensor, ``persistent.adam_step_temporaries``): priced -11.9% with 2 of the largest linear's
        pytest.param(2, (1, 2, 1, 1), PROBE_BENCH, 2, marks=pytest.mark.slow),
        # the bench's (1,2,4,1), priced -6.6% there (and here) without the chunks' dW sums
        pytest.param(8, (1, 2, 4, 1), PROBE_BENCH, 8, marks=pytest.mark.slow),
        # one expert per rank (nothing sorted): whole experts over z; four experts over z, split over y
        pytest.param(8, (1, 1, 8, 1), PROBE_SMALL, 8, marks=pytest.mark.slow),
        pytest.param(8, (1, 2, 4, 1), PROBE_SMALL.replace(n_experts=4), 8, marks=pytest.mark.slow),
    ],
    ids=lambda v: (
        ".".join(map(str, v)) if isinstance(v, tuple) else f"h{v.hidden}" if isinstance(v, ModelConfig) else None
    ),
)
def test_the_moe_probe_s_peak_memory_is_the_planner_s(pools, world, grid, cfg, batch):
    """The accuracy bench's MoE probe (no norms, no embedding: the MoE layers weigh more in its peak
    than in a whole model's) on a z = 4 grid, a y = 4 grid and grids where y = 2 splits the experts
    (the bench's model): torch's memory tracker against ``plan.memory``, within 5%
    (bench/planner_accuracy.py --moe checks all 20 grids of 8 ranks). On the small model's grids the
    backward walk's MoE terms move the price by less than the tolerance: those cases guard the whole
    price, not those terms one by one."""
    from axon4d.plan.memory import memory
    from tests.test_plan_memory_options import TOLERANCE

    wl = Workload(cfg, batch, "float32", embedding=False, norms=False, precision="fp32")
    measured = pools(world).run(grid, _probe_peak, wl)[0]
    planned = memory(wl, GridShape(*grid), staged_reduce_scatter=True).peak
    error = (planned - measured) / measured
    assert abs(error) <= TOLERANCE, f"{grid}: planner {planned} B, measured {measured} B ({error:+.2%})"
