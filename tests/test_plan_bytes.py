"""Protects one source for what is sent (docs/planner.md rule 1; ``axon4d.layout.geometry.wire_dtype``):
the planner prices exactly the bytes the runtime sends, in the part of the step it sends them.

A real ``Transformer`` (GPT and Llama, tiny) trains a step on a real gloo grid and the
communication log's calls and payload bytes per (axis, term, phase) — forward, backward (a
recomputed forward's included) or optimizer (ZeRO's all-gathers) — must equal the planner's
(``axon4d.plan.sent.step_collectives_by_phase``) exactly, and their sums per axis the step estimate's
``bytes_by_axis`` and ``collectives``, for every precision preset (fp32, bf16, bf16-fp32-reduce,
bf16-fp8-gather — FP8 gathers given to the planner as the preset or as ``fp8_gather`` on
bf16-fp32-reduce — and bf16-fp8, ``FP8``), ZeRO 0, 1 and 2, micro-batches 1 and 4 with and without keep-for-backward, and
context parallelism on and off, on four grids of 8 ranks: pairwise (``CASES``: every pair of two
options' values in some case, checked by ``test_the_cases_cover_every_pair_of_option_values``),
not the whole product. A few cases on 4 ranks run in the fast tier.

Every logged term is priced: the split norms' per-token sums over x and the vocabulary-parallel
loss's collectives over y too. Recomputation (``RECOMPUTE``: full, balanced, selective, with and
without context parallelism) is checked the same way: under full recomputation every block's
forward collectives are issued again (``recompute.rerun_collectives``). Ring context parallelism
(``RING``) is checked alike, with selective and full recomputation, and activation offload
(``OFFLOAD``: every saved tensor of the offloaded blocks to host memory and back, with every
recompute mode, ZeRO stage and context mode): its copies send nothing, so the step's collectives
and their phases are those without it.
"""

import dataclasses
import itertools
import math

import pytest
import torch

from axon4d.config import ModelConfig
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Term, wire_dtype
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.precision import NAMED
from axon4d.plan import fp8 as fp8_plan
from axon4d.plan import load
from axon4d.plan.cost import step_estimate
from axon4d.plan.scenario import Scenario
from axon4d.plan.sent import step_collectives_by_phase
from axon4d.plan.walk import zero_gathers
from axon4d.plan.workload import Workload
from axon4d.train.fields import FP8_KINDS

SEQ = 16  # 2·G_z chunks of whole tokens for G_z up to 4 (context parallelism)
CONFIGS = {
    "gpt": ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, seq_len=SEQ, arch="gpt"),
    "llama": ModelConfig(
        n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=SEQ, arch="llama"
    ),
}

GRIDS = {"g1": (2, 1, 2, 2), "g2": (1, 2, 2, 2), "g3": (2, 2, 2, 1), "g4": (1, 1, 4, 2)}
#: the options each case sets: the run's precision; how the planner is told of FP8 gathers ("preset":
#: precision bf16-fp8-gather; "option": bf16-fp32-reduce with fp8_gather=True; "-" none)
OPTIONS = {
    # bf16-fp8 (FP8 GEMMs) on a machine of its own: ``FP8``
    "precision": tuple(n for n in NAMED if n != "bf16-fp8"),
    "grid": tuple(GRIDS),
    "zero": (0, 1, 2),
    "micro": (1, 4),
    "keep": (False, True),
    "cp": (False, True),
    "arch": ("gpt", "llama"),
}
#: pairwise over OPTIONS (a greedy cover: 16 cases where the product has 768)
CASES = [
    ("bf16-fp32-reduce", "g2", 1, 1, False, False, "llama", "-"),
    ("bf16", "g3", 2, 4, True, True, "gpt", "-"),
    ("fp32", "g1", 0, 4, False, False, "gpt", "-"),
    ("fp32", "g4", 0, 1, True, True, "llama", "-"),
    ("bf16-fp8-gather", "g4", 1, 4, True, False, "gpt", "option"),
    ("bf16-fp8-gather", "g3", 2, 1, False, True, "llama", "preset"),
    ("bf16-fp32-reduce", "g1", 1, 1, True, True, "gpt", "-"),
    ("bf16", "g2", 0, 4, True, True, "llama", "-"),
    ("bf16", "g1", 1, 1, False, False, "llama", "-"),
    ("bf16-fp32-reduce", "g4", 2, 4, False, False, "gpt", "-"),
    ("fp32", "g3", 1, 1, False, False, "gpt", "-"),
    ("fp32", "g2", 2, 4, False, True, "gpt", "-"),
    ("bf16-fp32-reduce", "g3", 0, 1, False, True, "llama", "-"),
    ("bf16-fp8-gather", "g2", 0, 4, False, True, "llama", "option"),
    ("bf16-fp8-gather", "g1", 2, 1, False, False, "gpt", "preset"),
    ("bf16", "g4", 2, 1, False, True, "gpt", "-"),
]
#: the fast tier: 4 ranks, the options that changed the priced bytes (fp32 E11–E13 and replicated
#: gradients under bf16-fp32-reduce, FP8 E10, ZeRO-2's padded reduce-scatter, ZeRO's 16-bit gathers)
FAST = [
    ((1, 1, 2, 2), "bf16-fp32-reduce", 2, 4, True, True, "llama", "-"),
    ((1, 2, 2, 1), "bf16-fp8-gather", 0, 1, False, False, "gpt", "option"),
    ((2, 1, 1, 2), "bf16", 1, 4, False, False, "gpt", "-"),
]


def case_id(case):
    grid, precision, zero, micro, keep, cp, arch, fp8 = case
    grid = "x{}y{}z{}d{}".format(*grid)
    cp = "ring" if cp == "ring" else "cp" if cp else ""
    parts = [grid, precision, f"zero{zero}", f"mb{micro}", "keep" if keep else "", cp, arch]
    return "-".join(p for p in parts if p) + ("" if fp8 == "-" else f"-fp8{fp8}")


def _host(precision=""):
    """A machine whose ranks compute on the host, as the test's do (the host's forward chunking of E8);
    under FP8 GEMMs (``precision`` "bf16-fp8") one with FP8 tensor cores whose FP8 GEMMs are cheap
    enough that the planner runs every layer that fits in FP8, as the runtime does."""
    if precision == "bf16-fp8":
        fast = {"op_overhead_s": 0.0, "elementwise_Bps": {"1": 1e18}, "elementwise_curve": {}}
        return dataclasses.replace(
            load("h100"), accelerator=False, name="host", fp8_gemm_speedup=[[1.0, 50.0], [1e15, 50.0]], **fast
        )
    return dataclasses.replace(load("perlmutter"), accelerator=False, name="host")


#: recomputation, on 4 ranks with a split norm (G_x > 1) and the loss over y where they fit: (grid,
#: precision, zero, micro-batches, keep, context parallel, arch, fp8, recompute); the first is fast
RECOMPUTE = [
    ((2, 1, 2, 1), "bf16-fp32-reduce", 0, 2, False, True, "llama", "-", "full"),
    ((2, 2, 1, 1), "fp32", 0, 1, True, False, "gpt", "-", "full"),
    ((2, 1, 1, 2), "bf16", 1, 1, False, False, "gpt", "-", "balanced"),
    ((1, 2, 2, 1), "fp32", 0, 1, False, True, "llama", "-", "selective"),
    ((2, 1, 2, 1), "fp32", 0, 1, False, True, "gpt", "-", "balanced"),
]
#: ring context parallelism (``cp`` "ring": axon4d.nn.context_ring), its shifts over z priced as the
#: runtime issues them — forward, backward (keys and values again, their gradients' accumulators) and
#: selective recomputation's forward ring again; the first is fast
RING = [
    ((1, 1, 4, 1), "bf16-fp32-reduce", 0, 2, False, "ring", "llama", "-", "none"),
    ((1, 2, 2, 1), "fp32", 0, 1, False, "ring", "llama", "-", "selective"),
    ((2, 1, 2, 1), "bf16", 1, 1, True, "ring", "gpt", "-", "full"),
]


def _logged(grid, arch, cp, micro, zero, recompute="none", axes="z", bf16="", offload=0):
    """One step of a tiny ``arch`` Transformer (after one that warms it up): Adam (sharded over data
    at ``zero``), ``micro`` micro-batches of G_data·G_z sequences, the first ``offload`` blocks'
    saved tensors offloaded (every one but the parameters: the size threshold at 0). The
    communication log's {(axis, tag, phase): [calls, payload bytes]}."""
    from axon4d.models.transformer import Transformer
    from axon4d.train.batches import accumulate
    from axon4d.zero import shard_optimizer

    cfg = CONFIGS[arch]
    torch.manual_seed(0)
    blocks = list(range(offload)) or None
    model = Transformer(cfg, context_parallel=cp, recompute=recompute, context_parallel_axes=axes, offload=blocks)
    if model.offloader is not None:
        model.offloader.min_bytes = 0  # these tiny blocks save nothing of 64 KiB: move every saved tensor
    model.keep_in_bf16({k for k in bf16.split(",") if k})  # under FP8 GEMMs: the planner's bf16 layer kinds
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    if zero:
        opt = shard_optimizer(opt, model, grid, stage=zero)
    gen = torch.Generator().manual_seed(1)
    seqs = grid.size("data") * grid.size("z") if axes == "z" else grid.size("z")  # hierarchical: any batch

    def step():
        batch = torch.randint(0, cfg.vocab_size, (seqs * micro, SEQ + 1), generator=gen)
        accumulate(model, batch.chunk(micro), grid)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    grid.comm.log.clear()
    if model.offloader is not None:
        model.offloader.reset_peaks()
    step()
    if model.offloader is not None:  # the case proves something: the blocks' tensors went and came back
        moved = model.offloader.stats()
        assert moved.copies_out > 0 and moved.copies_in == moved.copies_out, moved
        assert all(moved.peak_block_bytes.get(b, 0) > 0 for b in range(offload)), moved
    out: dict = {}
    for r in grid.comm.log.records:
        calls, sent = out.get((r.axis, str(r.tag), r.phase), (0, 0))
        out[(r.axis, str(r.tag), r.phase)] = (calls + 1, sent + r.payload_bytes)
    if zero:
        opt.release()
    return out


def _priced(grid, precision, zero, micro, keep, cp, arch, fp8, recompute="none", bucket_mb=None, axes="z", offload=0):
    """The planner's {(axis, term, phase): (calls, payload bytes)} of the same step, the step estimate
    and, under FP8 GEMMs, the layer kinds it keeps in bf16."""
    shape = GridShape(*grid)
    seqs = shape.data * shape.z if axes == "z" else shape.z
    wl_precision = "bf16-fp32-reduce" if fp8 == "option" else precision
    mode = "ring" if cp == "ring" else "all-gather"
    wl = Workload(
        CONFIGS[arch],
        seqs * micro,
        precision=wl_precision,
        context_parallel=bool(cp),
        context_mode=mode,
        context_axes=axes,
    )
    sc = Scenario(
        wl,
        shape,
        _host(precision),
        OverlapPolicy(oag_keep=keep, bucket_mb=bucket_mb),
        recompute,
        micro_batches=micro,
        zero=zero,
        offload=offload,
        fp8_gather=fp8 == "option",
    )
    assert sc.precision == NAMED[precision]  # the option and the preset are the same precision
    calls, sent = step_collectives_by_phase(sc)
    priced = {(axis, str(term), phase): (calls[key], sent[key]) for key in calls for axis, term, phase in [key]}
    if precision == "bf16-fp8":  # the layer kinds the planner keeps in bf16, which the runtime is told
        micro = sc.micro()
        kept = [s.name for s in micro.linears if s.name in FP8_KINDS and not fp8_plan.layer_choice(s, micro)[0]]
        assert len(kept) < len(FP8_KINDS)  # FP8 is priced: some block layer runs it
        return priced, step_estimate(sc), ",".join(kept)
    return priced, step_estimate(sc), ""


def _check(pools, case, recompute="none", bucket_mb=None, axes="z", offload=0):
    grid, precision, zero, micro, keep, cp, arch, fp8 = case
    priced, estimate, bf16 = _priced(
        grid, precision, zero, micro, keep, cp, arch, fp8, recompute, bucket_mb, axes, offload
    )
    by_axis: dict = {}
    for (axis, *_), (_, sent) in priced.items():
        by_axis[axis] = by_axis.get(axis, 0) + sent
    assert by_axis == estimate.bytes_by_axis  # the list is the one the step's time is priced from
    assert sum(calls for calls, _ in priced.values()) == estimate.collectives
    results = pools(math.prod(grid)).run(
        grid,
        _logged,
        arch,
        cp,
        micro,
        zero,
        recompute,
        axes,
        bf16,
        offload,
        precision=precision,
        overlap=OverlapPolicy(oag_keep=keep, bucket_mb=bucket_mb),
    )
    for rank, logged in enumerate(results):
        differ = {
            k: (logged.get(k), priced.get(k)) for k in logged.keys() | priced.keys() if logged.get(k) != priced.get(k)
        }
        assert not differ, f"rank {rank}: (axis, term, phase): (logged, priced) (calls, bytes) differ: {differ}"


@pytest.mark.parametrize("case", FAST, ids=case_id)
def test_logged_bytes_per_axis_and_term_equal_the_planner_s(pools, case):
    _check(pools, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [(GRIDS[c[1]], c[0], *c[2:]) for c in CASES], ids=case_id)
def test_logged_bytes_per_axis_and_term_equal_the_planner_s_pairwise(pools, case):
    _check(pools, case)


@pytest.mark.parametrize(
    "case",
    [RECOMPUTE[0], *(pytest.param(c, marks=pytest.mark.slow) for c in RECOMPUTE[1:])],
    ids=lambda c: f"{case_id(c[:-1])}-{c[-1]}",
)
def test_logged_bytes_under_recomputation_equal_the_planner_s(pools, case):
    _check(pools, case[:-1], recompute=case[-1])


#: FP8 GEMMs (bf16-fp8): E10 moves the e4m3 shards without per-shard scales, and each FP8 layer's
#: z ranks all-gather their scales once per weight and step (axon4d.scheduler.fp8_copies)
FP8 = [
    ((1, 2, 2, 1), "bf16-fp8", 0, 2, False, False, "llama", "-", "none"),
    ((1, 1, 2, 2), "bf16-fp8", 2, 4, True, True, "gpt", "-", "none"),
    ((2, 1, 2, 1), "bf16-fp8", 1, 1, False, False, "llama", "-", "full"),
    ((1, 2, 2, 1), "bf16-fp8", 0, 2, False, "ring", "llama", "-", "selective"),
]


@pytest.mark.parametrize(
    "case",
    [FP8[0], *(pytest.param(c, marks=pytest.mark.slow) for c in FP8[1:])],
    ids=lambda c: f"{case_id(c[:-1])}-{c[-1]}",
)
def test_logged_bytes_under_fp8_gemms_equal_the_planner_s(pools, case):
    _check(pools, case[:-1], recompute=case[-1])


@pytest.mark.parametrize(
    "case",
    [RING[0], *(pytest.param(c, marks=pytest.mark.slow) for c in RING[1:])],
    ids=lambda c: f"{case_id(c[:-1])}-{c[-1]}",
)
def test_logged_bytes_of_ring_context_parallelism_equal_the_planner_s(pools, case):
    _check(pools, case[:-1], recompute=case[-1])


@pytest.mark.parametrize(
    "case",
    [
        ((1, 1, 2, 2), "bf16-fp32-reduce", 1, 2, False, "ring", "llama", "-", "none"),
        pytest.param(((1, 2, 2, 2), "fp32", 0, 1, False, True, "gpt", "-", "full"), marks=pytest.mark.slow),
    ],
    ids=lambda c: f"{case_id(c[:-1])}-{c[-1]}",
)
def test_logged_bytes_of_hierarchical_context_parallelism_equal_the_planner_s(pools, case):
    """Each sequence split over z × data (``context_axes`` "z,data"): the key/value collectives run
    over the batch axis, G_z·G_data ranks, every rank holding every sequence."""
    _check(pools, case[:-1], recompute=case[-1], axes="z,data")


#: activation offload (``Transformer(offload=)``, the planner's ``Scenario.offload``: the first n of the
#: 2 blocks), every saved tensor moved (the size threshold at 0): its copies send nothing, so the step's
#: collectives and their phases are the same as without it — a hook on a block's output gradient, a
#: recomputation inside an offloaded block or an FP8 layer's saved shards must not add, drop or move
#: one. (grid, precision, zero, micro-batches, keep, context parallel, arch, fp8, recompute, offloaded
#: blocks): every recompute mode, ZeRO stage, micro-batch count, context mode and four presets with
#: offload (``test_the_offload_cases_pair_offload_with_every_option_value``); the first is fast
OFFLOAD = [
    ((2, 1, 1, 2), "bf16-fp32-reduce", 1, 2, False, False, "llama", "-", "none", 1),
    ((2, 1, 2, 1), "fp32", 0, 1, False, True, "gpt", "-", "full", 2),
    ((1, 2, 1, 2), "bf16", 2, 4, True, False, "gpt", "-", "selective", 1),
    ((1, 1, 2, 2), "bf16-fp8-gather", 2, 1, False, True, "llama", "preset", "balanced", 2),
    ((1, 2, 2, 1), "bf16-fp8", 0, 2, False, False, "llama", "-", "full", 1),
    ((2, 1, 2, 1), "bf16", 0, 2, True, "ring", "gpt", "-", "selective", 2),
]


@pytest.mark.parametrize(
    "case",
    [OFFLOAD[0], *(pytest.param(c, marks=pytest.mark.slow) for c in OFFLOAD[1:])],
    ids=lambda c: f"{case_id(c[:-2])}-{c[-2]}-offload{c[-1]}",
)
def test_logged_bytes_under_activation_offload_equal_the_planner_s(pools, case):
    _check(pools, case[:-2], recompute=case[-2], offload=case[-1])


def test_the_offload_cases_pair_offload_with_every_option_value():
    """Offload meets every recompute mode, ZeRO stage, micro-batch count and context mode, and more
    than one preset, in ``OFFLOAD``."""
    columns = list(zip(*OFFLOAD))
    assert set(columns[-2]) == {"none", "selective", "balanced", "full"}
    assert set(columns[2]) == {0, 1, 2} and set(columns[3]) >= {1, 2} and set(columns[4]) == {False, True}
    assert set(columns[5]) == {False, True, "ring"} and len(set(columns[1])) >= 2
    assert set(columns[-1]) == {1, 2}  # some of the blocks, and all of them


def _gathers_logged(grid):
    """{(axis, tag): (calls, payload bytes)} of ZeRO-1's all-gathers over data in a logged step."""
    return {k: v for k, v in _logged(grid, "llama", False, 1, 1).items() if k[1] == str(Term.ZERO_GATHER)}


@pytest.mark.parametrize("bucket_mb", [0.0, 0.004, 1.0])
def test_zero_s_bucketed_gathers_are_the_planner_s(pools, bucket_mb):
    """ZeRO's all-gathers in buckets of ``bucket_mb`` (4 KiB: a few parameters each; 1 MiB: one
    bucket per dtype) are issued as the planner prices them: calls and bytes per (axis, term)."""
    grid, precision = (1, 1, 1, 2), "bf16"
    policy = OverlapPolicy(bucket_mb=bucket_mb)
    wl = Workload(CONFIGS["llama"], 2, precision=precision)
    gathers = zero_gathers(Scenario(wl, GridShape(*grid), _host(), policy, zero=1))
    priced = {("data", str(Term.ZERO_GATHER), "optimizer"): (len(gathers), sum(g.payload_bytes for g in gathers))}
    for logged in pools(2).run(grid, _gathers_logged, precision=precision, overlap=policy):
        assert logged == priced
    assert (len(gathers) == 2) == (bucket_mb == 1.0)  # the 16-bit weights' bucket and the fp32 rest's


def test_the_cases_cover_every_pair_of_option_values():
    names = list(OPTIONS)
    seen = {
        (a, case[i], b, case[j]) for case in CASES for (i, a), (j, b) in itertools.combinations(enumerate(names), 2)
    }
    every = {
        (a, va, b, vb)
        for (i, a), (j, b) in itertools.combinations(enumerate(names), 2)
        for va in OPTIONS[a]
        for vb in OPTIONS[b]
    }
    assert every <= seen, sorted(every - seen)
    fp8 = {c[-1] for c in CASES if c[0] == "bf16-fp8-gather"}
    assert fp8 == {"preset", "option"} and all(c[-1] == "-" for c in CASES if c[0] != "bf16-fp8-gather")


def test_each_term_moves_what_the_precision_says():
    """geometry.wire_dtype, the one answer the runtime casts to and the planner prices."""
    f32, b16 = torch.float32, torch.bfloat16
    for name, compute, reduce in [
        ("fp32", f32, f32),
        ("bf16", b16, b16),
        ("bf16-fp32-reduce", b16, f32),
        ("bf16-fp8-gather", b16, f32),
    ]:
        p = NAMED[name]
        for term in (Term.E8, Term.E9, Term.EMBEDDING, Term.CP_KV, Term.CP_KV_GRAD):
            assert wire_dtype(p, term) == compute, (name, term)
        for term in (Term.E11, Term.E12, Term.E13, Term.EMBEDDING_GRAD, Term.POSITION_GRAD, Term.NORM_GRAD):
            assert wire_dtype(p, term) == reduce, (name, term)
        assert wire_dtype(p, Term.E10F, g_z=2) == (torch.uint8 if name == "bf16-fp8-gather" else compute)
        assert wire_dtype(p, Term.E10B, g_z=1) == compute  # no gather on G_z = 1: nothing cast to fp8
        assert wire_dtype(p, Term.CE_LSE) == f32
        # ZeRO's all-gather: the 16-bit Linear weights it stores (mixed precision, G_data > 1), the rest as they are
        assert wire_dtype(p, Term.ZERO_GATHER, linear_weight=True, g_data=2) == compute
        assert wire_dtype(p, Term.ZERO_GATHER, linear_weight=True, g_data=1) == f32
        assert wire_dtype(p, Term.ZERO_GATHER, linear_weight=False, g_data=2) == f32
        # a model whose parameters are bf16 without mixed precision moves bf16 throughout
        assert wire_dtype(NAMED["fp32"], Term.E11, b16) == b16
    with pytest.raises(ValueError, match="'dense' moves its tensor in the tensor's own dtype"):
        wire_dtype(NAMED["fp32"], Term.DENSE)


def test_a_workload_s_precision_follows_its_dtype_and_contradictions_are_refused():
    cfg = CONFIGS["gpt"]
    assert (Workload(cfg, 8, "bfloat16").preset, Workload(cfg, 8, "float32").preset) == ("bf16-fp32-reduce", "fp32")
    assert (Workload(cfg, 8).dtype, Workload(cfg, 8).preset) == ("bfloat16", "bf16-fp32-reduce")
    assert Workload(cfg, 8, precision="fp32").dtype == "float32"  # the precision alone sets the dtype
    assert Workload(cfg, 8, precision="bf16").dtypes == NAMED["bf16"]
    wl = Workload(cfg, 8, "bfloat16")
    assert dataclasses.replace(wl, dtype="float32").preset == "fp32"  # a precision by dtype follows it
    with pytest.raises(ValueError, match="precision 'fp32' computes in float32, not dtype 'bfloat16'"):
        Workload(cfg, 8, "bfloat16", precision="fp32")
    with pytest.raises(ValueError, match="precision 'fp16' is not supported; use one of fp32, bf16"):
        Workload(cfg, 8, precision="fp16")
    with pytest.raises(ValueError, match="dtype 'float16' is not supported"):
        Workload(cfg, 8, "float16")
    shape = GridShape(1, 1, 2, 1)
    # FP8 gathers: bf16-fp32-reduce becomes bf16-fp8-gather; bf16-fp8-gather has them whatever is asked on G_z > 1
    assert Scenario(wl, shape, _host(), fp8_gather=True).precision == NAMED["bf16-fp8-gather"]
    fp8 = Scenario(Workload(cfg, 8, precision="bf16-fp8-gather"), shape, _host())
    assert fp8.fp8_gather and fp8.precision == NAMED["bf16-fp8-gather"]
    assert not Scenario(Workload(cfg, 8, precision="bf16-fp8-gather"), GridShape(1, 1, 1, 2), _host()).fp8_gather
    with pytest.raises(ValueError, match="fp8_gather with dtype float32"):
        Scenario(Workload(cfg, 8, "float32"), shape, _host(), fp8_gather=True)


def test_the_plan_command_takes_a_precision():
    from axon4d.plan import cli

    p = cli.argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--gpus", "8", "--batch", "8", "--precision", "bf16"])
    assert (args.precision, args.dtype) == ("bf16", "")
    assert cli.fp8_option("bf16-fp32-reduce", "auto") == "auto" and cli.fp8_option("bf16-fp8-gather", "auto") is True
    assert cli.fp8_option("bf16", "auto") is False
    with pytest.raises(ValueError, match="--fp8-gather off with --precision bf16-fp8-gather"):
        cli.fp8_option("bf16-fp8-gather", "off")
    with pytest.raises(ValueError, match="--fp8-gather on with --precision bf16: "):
        cli.fp8_option("bf16", "on")


def test_the_search_never_plans_fp8_gathers_no_preset_runs():
    """FP8 gathers exist only as bf16-fp8-gather (fp32 reductions): a bf16-preset workload is never
    planned with them, and a scenario asking for them is refused naming the presets that work."""
    from axon4d.plan.search import plan

    cfg = ModelConfig(n_layers=2, hidden=64, n_heads=4, vocab_size=128, seq_len=16)
    result = plan(cfg, 8, _host(), 16, precision="bf16", top=None)
    assert result.candidates and not any(c.option("fp8_gather") for c in result.candidates)
    with_fp8 = plan(cfg, 8, _host(), 16, precision="bf16-fp32-reduce", top=None)
    assert any(c.option("fp8_gather") for c in with_fp8.candidates if c.shape.z > 1)
    with pytest.raises(ValueError, match="no preset gathers in FP8 beside bf16 reductions"):
        Scenario(Workload(cfg, 16, precision="bf16"), GridShape(1, 1, 2, 1), _host(), fp8_gather=True)


#: buckets of 10 KiB on these tiny models: E12 two or three weight shards a bucket, E13's biases
#: and each kind of replicated gradient one bucket each (``axon4d.plan.buckets``)
BUCKETED = [
    ((1, 1, 2, 2), "fp32", 0, 1, False, False, "gpt", "-"),
    ((2, 1, 1, 2), "bf16-fp32-reduce", 2, 4, True, False, "llama", "-"),
]


@pytest.mark.parametrize("case", [BUCKETED[0], pytest.param(BUCKETED[1], marks=pytest.mark.slow)], ids=case_id)
def test_bucketed_reductions_are_priced_as_the_runtime_issues_them(pools, case):
    priced, *_ = _priced(*case, bucket_mb=10 / 1024)
    unbucketed, *_ = _priced(*case)
    fewer = [k for k in priced if k[1] in ("E12", "E13", "norm.grad") and priced[k][0] < unbucketed[k][0]]
    assert fewer, f"nothing was bucketed: the case proves nothing ({priced})"
    _check(pools, case, bucket_mb=10 / 1024)
