"""The planner's context parallelism at long sequences (docs/context.md, "Which mode the planner
picks"): both modes priced — the all-gather's keys and values of the whole sequence against the
ring's shifts of one rank's — memory that does not grow with the sequence in the ring mode, the
mode chosen by time among the plans that fit, and a physically valid plan for a Llama-3-8B shape
at a million tokens on 1024 H100s (a prediction)."""

import dataclasses

import pytest

from axon4d.config import get_config
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Op, Term
from axon4d.plan import load, plan
from axon4d.plan.block_extras import context_hidden
from axon4d.plan.candidate import device_need, evaluate
from axon4d.plan.recompute import rerun_collectives
from axon4d.plan.saved import block_saved
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload

MILLION = 1 << 20


def _llama(seq_len: int) -> Workload:
    return Workload(get_config("llama3-8b", seq_len=seq_len), batch=8, context_parallel=True)


def test_the_ring_moves_one_rank_s_keys_per_step_and_their_gradients_home():
    """Per layer: G_z − 1 forward shifts of the rank's own keys and values, G_z − 1 backward shifts
    of them again and G_z of their gradients' accumulators, each of b · 2 · n_kv/G_y · d elements
    (axon4d.nn.context_ring); the all-gather moves G_z times that payload once each way."""
    shape = GridShape(1, 8, 16, 8)
    ring = dataclasses.replace(_llama(MILLION), context_mode="ring")
    m = ring.model
    own = ring.local_tokens(shape) * 2 * (m.kv_heads // shape.y) * m.head_dim * 2  # bf16
    sent = ring.context_collectives(shape)
    by = {(c.term, c.phase): 0 for c in sent}
    for c in sent:
        assert c.op == Op.SHIFT and c.axis == "z" and c.payload_bytes == own
        by[(c.term, c.phase)] += 1
    assert by == {
        (Term.CP_KV_RING, "forward"): 15 * m.n_layers,
        (Term.CP_KV_RING, "backward"): 15 * m.n_layers,
        (Term.CP_KV_RING_GRAD, "backward"): 16 * m.n_layers,
    }
    gathered = dataclasses.replace(ring, context_mode="all-gather").context_collectives(shape)
    assert {(c.op, c.payload_bytes) for c in gathered} == {(Op.ALL_GATHER, 16 * own), (Op.REDUCE_SCATTER, 16 * own)}
    # selective recomputation runs the forward's ring again in backward; full, the block's forward
    h100 = load("h100")
    for mode, again in (("selective", 15), ("full", 15), ("none", 0)):
        issued = rerun_collectives(Scenario(ring, shape, h100, recompute=mode))
        assert sum(n for c, n in issued if c.term == Term.CP_KV_RING) == again * m.n_layers, mode


def test_the_ring_s_saved_keys_do_not_grow_with_the_sequence():
    """What attention keeps per block: the all-gather mode the whole sequence's keys and values of
    the rank's kv heads, the ring its own chunks' only — at a fixed chunk per rank (S/G_z), a
    16× longer sequence over a 16× longer z leaves the ring's activations where they were."""
    short, long = GridShape(1, 8, 2, 1), GridShape(1, 8, 32, 1)
    saved = {}
    for mode in ("all-gather", "ring"):
        for seq, shape in ((65536, short), (MILLION, long)):
            wl = dataclasses.replace(_llama(seq), batch=1, context_mode=mode)
            saved[(mode, seq)] = block_saved(wl, shape)["attention"]
    assert saved[("ring", MILLION)] == saved[("ring", 65536)]
    m = get_config("llama3-8b")
    kv_whole = MILLION * 2 * (m.kv_heads // 8) * m.head_dim  # the gathered keys and values
    assert saved[("all-gather", MILLION)] - saved[("ring", MILLION)] == kv_whole - kv_whole // 32


def test_ring_shifts_hide_behind_one_ring_step_s_attention_each():
    """``context_hidden`` for the ring: each forward shift up to a ring step's forward attention, each
    backward step's two shifts up to its backward share, at the machine's overlap efficiency; at a
    million tokens every shift is far shorter than a step's attention, so all but the last
    accumulator's trip home hide."""
    shape = GridShape(1, 8, 16, 8)
    wl = dataclasses.replace(_llama(MILLION), context_mode="ring")
    m = load("h100")
    sc = Scenario(wl, shape, m)
    kv = next(c for c in sc.context_collectives if c.term == Term.CP_KV_RING)
    grad = next(c for c in sc.context_collectives if c.term == Term.CP_KV_RING_GRAD)
    kv_s = m.comm_time("shift", 16, shape.stride("z"), kv.payload_bytes, 1024)
    grad_s = m.comm_time("shift", 16, shape.stride("z"), grad.payload_bytes, 1024)
    expect = wl.model.n_layers * 15 * (kv_s + (kv_s + grad_s)) * m.overlap_efficiency
    assert context_hidden(sc) == pytest.approx(expect)


@pytest.mark.slow
def test_a_million_tokens_of_llama3_8b_on_1024_h100s_plan_within_the_machine():
    """``axon4d plan --model llama3-8b --seq-len 1048576 --gpus 1024 --machine h100 --batch 8``: the
    best plan splits the sequences over z, fits by the dense plans' checks (device need within 80
    GiB, the node's pinned host memory within its own), and its MFU (a prediction) is one a GPU can
    reach with FlashAttention-2's 35% of peak in attention: above 20%, below that of a step whose
    every FLOP ran at the attention kernel's share."""
    result = plan("llama3-8b", 1024, "h100", 8, workload=_llama(MILLION), context_parallel=True)
    best, m = result.best, result.machine
    assert best.fits and best.context_parallel and best.shape.z > 1
    assert device_need(best.mem, m) <= m.memory_per_device
    assert best.mem.pinned_node <= m.host_memory_per_node - m.host_reserve_per_node
    assert 0.2 < best.mfu < m.matmul_efficiency
    # the two modes were both priced; pinned, each gives its own best
    modes = {c.context_mode for c in result.candidates}
    assert modes <= {"all-gather", "ring"} and modes
    for mode in ("all-gather", "ring"):
        pinned = plan("llama3-8b", 1024, "h100", 8, workload=_llama(MILLION), context_parallel=mode, top=2)
        assert all(c.context_mode == mode for c in pinned.candidates)


def test_the_ring_fits_where_the_gathered_keys_do_not():
    """At a fixed grid and options, the all-gather mode's peak holds every block's whole-sequence
    keys and values; under a memory limit between the two peaks the ring's plan fits and the
    all-gather's does not — the planner, searching both, finds the ring's plan on that grid (and on
    another grid with offload, whatever is fastest)."""
    shape = GridShape(1, 2, 32, 1)
    wl = Workload(get_config("llama3-8b", seq_len=MILLION), batch=1, context_parallel=True)
    m = load("h100")
    need = {
        mode: device_need(evaluate(dataclasses.replace(wl, context_mode=mode), shape, m).mem, m)
        for mode in ("all-gather", "ring")
    }
    assert need["ring"] < need["all-gather"]
    limit = (need["ring"] + need["all-gather"]) / 2
    fits = {
        mode: evaluate(dataclasses.replace(wl, context_mode=mode), shape, m, memory_limit=limit).fits
        for mode in ("all-gather", "ring")
    }
    assert fits == {"all-gather": False, "ring": True}
    result = plan(
        "llama3-8b", 64, m, 1, workload=wl, context_parallel=True, memory_limit=limit, recompute="none", top=None
    )
    on_grid = {c.context_mode: c.fits for c in result.candidates if c.shape == shape and c.option("offload") == 0}
    assert on_grid.get("ring") and not on_grid.get("all-gather")


def test_context_parallel_values_are_checked():
    with pytest.raises(ValueError, match="'all-gather', 'ring' or 'auto'"):
        plan("tiny", 8, "perlmutter", 8, context_parallel="rings")
    with pytest.raises(ValueError, match="context_mode = 'rings'"):
        Workload(get_config("tiny"), 8, context_parallel=True, context_mode="rings")


def test_packed_documents_price_attention_within_each_document():
    """``document_tokens`` D: the document mask leaves (S/D)·D(D+1)/2 of S(S+1)/2 causal pairs; whole
    sequences run S/D causal squares of D, a split sequence its parts' share of the pairs, and the
    model FLOPs count the attention done. Bad values are refused naming the range."""
    from axon4d.plan.block_extras import attention_seconds

    seq, d = 65536, 4096
    wl = Workload(get_config("llama3-8b", seq_len=seq), batch=8)
    packed = dataclasses.replace(wl, document_tokens=d)
    assert packed.attention_share == pytest.approx((d + 1) / (seq + 1))
    assert dataclasses.replace(wl, document_tokens=seq).attention_share == 1.0
    odd = dataclasses.replace(wl, document_tokens=5000)  # 13 documents of 5000 and one of 536
    assert odd.attention_share == pytest.approx((13 * 5000 * 5001 + 536 * 537) / (seq * (seq + 1)))
    m = load("h100")
    shape = GridShape(1, 8, 1, 8)
    units = packed.local_sequences(shape) * 32 // 8
    expect = m.attention_time(d, 128, units * seq // d, "bfloat16", 64)
    assert attention_seconds(Scenario(packed, shape, m)) == (pytest.approx(expect), 0.0)
    split = dataclasses.replace(packed, context_parallel=True)
    whole_split = attention_seconds(Scenario(dataclasses.replace(split, document_tokens=0), GridShape(1, 8, 8, 1), m))
    parts = attention_seconds(Scenario(split, GridShape(1, 8, 8, 1), m))
    assert parts == pytest.approx(tuple(t * packed.attention_share for t in whole_split))
    att = 3 * 2 * 2 * 32 * seq * 4096 / 2 * packed.tokens
    assert wl.flops() - packed.flops() == pytest.approx(att * (1 - packed.attention_share))
    with pytest.raises(ValueError, match="from 1 to the sequence length 65536"):
        dataclasses.replace(wl, document_tokens=seq + 1)


@pytest.mark.slow
def test_hierarchical_context_parallelism_splits_a_sequence_over_z_and_data():
    """``context_axes`` "z,data": each sequence over G_z·G_data ranks (the batch axis), every rank
    holding every sequence — one 1M-token sequence fits a grid with data ranks, its key/value
    traffic over batch, its attention that of a split over as many z-ranks; the search prices it
    beside the split over z and says which in the plan."""
    from axon4d.plan.block_extras import attention_seconds

    cfg = get_config("llama3-8b", seq_len=MILLION)
    over_z = Workload(cfg, batch=1, context_parallel=True, context_mode="ring")
    both = dataclasses.replace(over_z, context_axes="z,data")
    shape, tall = GridShape(1, 8, 16, 8), GridShape(1, 8, 128, 1)
    assert over_z.grid_problems(shape) and not both.grid_problems(shape)  # one sequence cannot split over data
    assert both.context_group(shape) == over_z.context_group(tall) == 128
    sent = both.context_collectives(shape)
    assert {c.axis for c in sent} == {"batch"} and len(sent) == (127 + 127 + 128) * cfg.n_layers
    m = load("h100")
    assert attention_seconds(Scenario(both, shape, m)) == pytest.approx(attention_seconds(Scenario(over_z, tall, m)))
    result = plan("llama3-8b", 1024, m, 1, workload=Workload(cfg, batch=1), top=8)
    assert result.best.fits and result.best.context_parallel
    assert any(c.context_axes == "z,data" for c in result.candidates)
    pinned = plan("llama3-8b", 1024, m, 1, workload=Workload(cfg, batch=1), context_axes="z", top=3)
    assert all(c.context_axes in ("z", "") for c in pinned.candidates)
    with pytest.raises(ValueError, match="'z' .* or 'z,data'"):
        plan("llama3-8b", 1024, m, 1, workload=Workload(cfg, batch=1), context_axes="x")
