"""The machine side of the planner: NCCL's choice of algorithm, the all-to-all's price, a node's
memory, the memory a device leaves to the job, and the shipped GPU files' GEMM tables."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from axon4d.grid.shape import GridShape
from axon4d.plan import collective_model as cm
from axon4d.plan import load
from axon4d.plan.device_memory import grid_communicators
from axon4d.plan.machine import Machine, available
from axon4d.plan.tables import CommCurve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6


def test_a_256_rank_z_all_gather_runs_as_a_ring_of_g_minus_1_steps():
    """z of (2, 2, 256, 1): 256 ranks 4 apart. On H100 nodes of 8 two share a node (no PAT): a ring of
    255 steps, 127 of them across the network at 14 µs; on Perlmutter (4 per node) every rank has a
    node of its own, and a large all-gather still runs as the ring."""
    h100 = load("h100")
    span = cm.span_of(256, 4, 8)
    assert span == cm.Span(256, 128, 2)
    for payload in (38 * MB, 302 * MB):
        choice = h100.collective_algorithm("all_gather", 256, 4, payload)
        assert choice.algorithm == "ring" and choice.steps == 255
        latency = cm.BASE_LATENCY_S + 128 * 3.4e-6 + 127 * 14e-6
        assert choice.seconds == pytest.approx(latency + 255 / 256 * payload / 40e9, rel=1e-9)
        assert h100.comm_time("all_gather", 256, 4, payload, 1024) == choice.seconds
    perlmutter = load("perlmutter")
    ring = perlmutter.collective_algorithm("reduce_scatter", 256, 4, 302 * MB)
    assert ring.algorithm == "ring" and ring.steps == 255
    assert ring.seconds == pytest.approx(cm.BASE_LATENCY_S + 255 * 14e-6 + 255 / 256 * 302 * MB / 20e9, rel=1e-9)


def test_pat_where_nccl_would_take_it_one_rank_per_node_and_smaller_payloads():
    """PAT (NCCL ≥ 2.23) for all-gather and reduce-scatter only where every rank has its own node,
    and only while its log-latency beats the ring's g − 1 network steps: its bandwidth is 0.75."""
    m = load("perlmutter")
    small = m.collective_algorithm("all_gather", 256, 4, 38 * MB)
    assert small.algorithm == "pat" and small.steps == 8  # ⌊log2 256⌋
    pat_latency = cm.PAT_BASE_S + 8 * 14e-6 / cm.PAT_LOG_DIVISOR + 256 * cm.PAT_PER_RANK_S
    assert small.seconds == pytest.approx(pat_latency + 38 * MB / (0.75 * 20e9), rel=1e-9)
    priced = {p.algorithm: p.seconds for p in cm.candidates("all_gather", 38 * MB, cm.span_of(256, 4, 4), *_links(m))}
    assert set(priced) == {"ring", "pat"} and priced["pat"] < priced["ring"]
    # never with two ranks on a node, never for an all-reduce, never inside one node
    assert all(p.algorithm != "pat" for p in cm.candidates("all_gather", 1e3, cm.Span(256, 128, 2), *_links(m)))
    assert all(p.algorithm != "pat" for p in cm.candidates("all_reduce", 1e3, cm.Span(256, 256, 1), *_links(m)))
    assert m.collective_algorithm("all_gather", 4, 1, 1e3).algorithm == "ring"


def _links(m: Machine) -> tuple[cm.Link, cm.Link]:
    return m.levels[0].link, m.levels[-1].link


def test_all_reduce_is_a_tree_when_latency_rules_and_a_ring_when_bandwidth_does():
    """The tuner's choice for all-reduce: a tree of 2·((per node − 1) + log2 nodes) steps for small
    payloads over many nodes; a ring of 2(g − 1) steps for large ones and inside a node."""
    m = load("h100")
    small = m.collective_algorithm("all_reduce", 512, 8, 64e3)  # data axis: 512 ranks, one per node
    assert small.algorithm == "tree" and small.steps == 2 * (0 + 9)
    large = m.collective_algorithm("all_reduce", 8, 1, 512 * MB)  # a node's x axis
    assert large.algorithm == "ring" and large.steps == 14
    assert large.seconds == pytest.approx(cm.BASE_LATENCY_S + 14 * 3.4e-6 + 2 * 7 / 8 * 512 * MB / 360e9)
    big_net = m.collective_algorithm("all_reduce", 16, 8, 1e9)  # 16 nodes, 1 GB: bandwidth-bound, ring
    assert big_net.algorithm == "ring" and big_net.steps == 30
    # the cheapest of the candidates, whatever they are
    for op, g, s, p in (("all_reduce", 64, 8, 1e6), ("all_gather", 64, 8, 1e6), ("reduce_scatter", 32, 1, 1e8)):
        span = cm.span_of(g, s, m.devices_per_node)
        intra = m.level_of(span.per_node, s) if span.nodes > 1 else m.level_of(g, s)
        best = min(cm.candidates(op, p, span, intra.link, m.levels[-1].link, m.nccl_channels), key=lambda c: c.seconds)
        assert m.collective_algorithm(op, g, s, p) == best


def test_host_files_keep_the_fewer_of_ring_and_tree_steps():
    """A host file (gloo, MPI; ``accelerator`` false) without a measured curve keeps its model: α per
    step, the fewer of a ring's and a tree's steps, the ring traffic at β."""
    m = load(os.path.join(ROOT, "bench", "results", "planner_machine_host_2026-11-26.json"))
    assert not m.accelerator
    lv = dataclasses.replace(m, comm=[]).levels[0]
    t = dataclasses.replace(m, comm=[]).comm_time("all_gather", 8, 1, 1e6, 8)
    assert t == pytest.approx(lv.alpha_s * 3 + 7 / 8 * 1e6 / lv.beta_Bps)


def test_an_all_to_all_is_grouped_sends_until_a_curve_of_its_geometry_is_measured():
    """``Machine.comm_time("all_to_all", …)``: without a curve (every shipped GPU file, a host file
    calibrated before all-to-alls were) each level's peers in rounds of ``P2P_PEERS_IN_FLIGHT``
    (grouped point-to-point sends), one α of the level per round, and the bytes to the other ranks
    at each level's β, never NCCL's tuner (which prices no all-to-all) nor a host ring; with a curve
    of the op, group and stride, that curve; the file round-trips with it."""
    h100 = load("h100")
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        h100.collective_algorithm("all_to_all", 8, 1, MB)
    p = 64 * MB
    # in a node (8 ranks, stride 1): 7 NVLink peers, one round; over 128 nodes (batch of (4, 2, 4, 32)):
    # 127 network peers, ⌈127/16⌉ = 8 rounds
    assert h100.comm_time("all_to_all", 8, 1, p, 8) == pytest.approx(3.4e-6 + p * 7 / 8 / 360e9, rel=1e-12)
    across = 8 * 14e-6 + p * 127 / 128 / 40e9
    assert h100.comm_time("all_to_all", 128, 8, p, 1024) == pytest.approx(across, rel=1e-12)
    # 16 ranks on 2 nodes: one round in a node, one across, the slower of the two parts' bytes
    mixed = 3.4e-6 + 14e-6 + max(p * 7 / 16 / 360e9, p * 8 / 16 / 40e9)
    assert h100.comm_time("all_to_all", 16, 1, p, 16) == pytest.approx(mixed, rel=1e-12)
    host = load(os.path.join(ROOT, "bench", "results", "planner_machine_host_2026-11-26.json"))
    assert host.comm and all(c.op != "all_to_all" for c in host.comm)  # calibrated before the all-to-all
    lv = host.levels[0]
    assert host.comm_time("all_to_all", 4, 1, MB, 8) == pytest.approx(lv.alpha_s + MB * 3 / 4 / lv.beta_Bps)
    curve = CommCurve("all_to_all", 4, 1, 8, [4096, 65536], [1e-4, 4e-4])
    measured = Machine.from_json(json.loads(json.dumps(dataclasses.replace(host, comm=[*host.comm, curve]).to_json())))
    assert measured.comm[-1] == curve and measured.host_sync_s is None
    assert measured.comm_time("all_to_all", 4, 1, 8192, 8) == curve.time(8192)
    assert measured.comm_time("all_gather", 4, 1, 8192, 8) == host.comm_time("all_gather", 4, 1, 8192, 8)


def _gpu_file(**changes) -> dict:
    d = load("h100").to_json()
    d.update(changes)
    return d


def test_a_node_s_memory_and_its_reserve_are_checked_by_name():
    m = load("perlmutter")
    assert m.host_memory_per_node == 256e9 and m.host_reserve_per_node == 24 * 2**30
    assert m.pinned_host_per_node == pytest.approx(256e9 - 24 * 2**30)
    assert m.can_offload
    for name in available():  # every shipped accelerator file gives both, with a reserve below the memory
        g = load(name)
        assert g.accelerator and 0 < g.host_reserve_per_node < g.host_memory_per_node
    d = _gpu_file()
    del d["host_reserve_per_node"]
    with pytest.raises(ValueError, match="gives no host_reserve_per_node"):
        Machine.from_json(d)
    with pytest.raises(ValueError, match=r"host_reserve_per_node is 2e\+12 bytes .* must be at least 0 and below"):
        Machine.from_json(_gpu_file(host_reserve_per_node=2e12))
    old = _gpu_file(host_memory_per_device=2**38)
    del old["host_memory_per_node"], old["host_reserve_per_node"]
    with pytest.raises(ValueError, match="host_memory_per_device .* replaced: give host_memory_per_node"):
        Machine.from_json(old)
    with pytest.raises(ValueError, match="fragmentation is 1.5"):
        Machine.from_json(_gpu_file(fragmentation=1.5))
    # a host's file needs none of them (an old one's host_memory_per_device of 0 is dropped)
    host = load(os.path.join(ROOT, "bench", "results", "planner_machine_host_2026-11-26.json"))
    assert host.pinned_host_per_node == 0 and host.can_offload and host.fragmentation == 0
    assert host.usable_device_memory(6) == host.memory_per_device


def test_usable_device_memory_is_what_context_workspace_and_communicators_leave():
    m = load("h100")
    taken = m.cuda_context_bytes + m.device_workspace_bytes
    assert m.usable_device_memory(0) == m.memory_per_device - taken
    assert m.usable_device_memory(5) == pytest.approx(m.memory_per_device - taken - 5 * m.nccl_buffer_bytes)
    # NCCL 2.27's defaults: LL 512 KiB + LL128 4.69 MiB + Simple 4 MiB per connection, two per channel
    assert m.nccl_buffer_bytes == m.nccl_channels * 2 * (524288 + 4915200 + 4 * 2**20)
    assert 0 < m.fragmentation < 0.2
    one = dataclasses.replace(m, cuda_context_bytes=2**29, device_workspace_bytes=2**25, nccl_buffer_bytes=2**28)
    assert one.usable_device_memory(3) == m.memory_per_device - 2**29 - 2**25 - 3 * 2**28


def test_grid_communicators_on_named_grids():
    assert grid_communicators(GridShape(2, 2, 2, 1)) == 5  # world, x, y, z, batch (z's ranks, its own group)
    assert grid_communicators(GridShape(4, 2, 8, 16)) == 6
    assert grid_communicators(GridShape(1, 1, 4, 2)) == 3  # world, z, data; batch is the world
    assert grid_communicators(GridShape(2, 1, 4, 1)) == 4  # world, x, z, batch (z's ranks, its own group)
    assert grid_communicators(GridShape(1, 1, 1, 1)) == 0 and grid_communicators(GridShape(8, 1, 1, 1)) == 1


def test_the_shipped_gemm_tables_load_and_rate_small_shapes_below_large():
    """bench/machine_tables.py's tables: on calibrate's accelerator lattice, below the large-GEMM rate
    for small and skinny shapes (memory-bound, too few tiles), near it for large ones; rewriting the
    files from the script changes nothing."""
    from axon4d.measure.kernels import ACCELERATOR_DIMS

    for name in available():
        m = load(name)
        peak = m.peak("bfloat16")
        table = m.matmul["bfloat16"][str(m.devices_per_node)]["nt"]
        assert table.dims == ACCELERATOR_DIMS
        large, skinny, small = table.rate(8192, 8192, 8192), table.rate(16, 8192, 8192), table.rate(256, 256, 256)
        assert 0.5 * peak < large < peak and skinny < 0.2 * large and small < 0.5 * large
        assert m.matmul_time("nt", 64, 64, 64, "bfloat16") > 2 * 64**3 / large  # slower than the large rate
        assert 0 < m.overlap_slowdown < 0.25 and not m.comm_interference_s_per_byte  # SMs, not a host κ
    with open(os.path.join(ROOT, "axon4d", "plan", "machines", "h100.json")) as f:
        raw = json.load(f)
    import sys

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import machine_tables

    assert machine_tables.dumps(machine_tables.derived(raw, "h100")) == machine_tables.dumps(raw)


def test_calibration_times_queued_calls_not_one_synchronize_per_call():
    """``timing.timeit`` synchronizes once per batch of calls, not after each: on an accelerator a
    synchronize's round trip (here 2 ms) added to every call priced an H200's GEMMs as if each ran
    alone (the 25% of docs/planner.md's Known limits). Work longer than the window is still timed
    call by call; collectives (no window) one call per sample. The seconds are a clock the calls
    and synchronizes advance (1 µs a call, 2 ms a synchronize), so the figures are exact."""
    from axon4d.measure.timing import timeit

    now = [0.0]

    def spend(seconds: float) -> None:
        now[0] += seconds

    calls, syncs = [], []
    t = timeit(
        lambda: calls.append(spend(1e-6)),
        reps=3,
        sync=lambda: syncs.append(spend(2e-3)),
        window_s=0.05,
        clock=lambda: now[0],
    )
    assert 1e-6 < t < 2e-6 and len(syncs) < len(calls) / 1000  # each synchronize shared by many calls
    calls.clear()
    slow = timeit(lambda: calls.append(spend(3e-3)), reps=3, sync=lambda: None, window_s=1e-3, clock=lambda: now[0])
    assert slow == pytest.approx(3e-3, rel=1e-9) and len(calls) == 4  # the warm-up, then one call a sample
    calls.clear()
    timeit(lambda: calls.append(1), reps=4, sync=lambda: None, budget_s=None, window_s=0.0)
    assert len(calls) == 5  # the warm-up and one per sample


#: what a shipped machine file holds besides figures
NOT_FIGURES = {"name", "comment", "sources", "levels"}


@pytest.mark.parametrize("name", available())
def test_every_figure_of_a_shipped_file_has_a_source_its_text_agrees_with(name):
    """Each figure of a shipped machine file has a source (measured, published, or marked an
    assumption), and a level's source states the per-step latency the level prices, no other."""
    import re

    from axon4d.plan.machine import MACHINE_DIR

    with open(os.path.join(MACHINE_DIR, f"{name}.json")) as f:
        d = json.load(f)
    sourced = {key.strip() for keys in d["sources"] for key in keys.split(",")}
    assert not [k for k in d if k not in NOT_FIGURES and k not in sourced], sorted(sourced)
    for i, level in enumerate(d["levels"]):
        text = d["sources"][f"levels[{i}]"]
        stated = [float(v) for v in re.findall(r"(\d+(?:\.\d+)?) us per (?:ring )?step", text)]
        stated += [float(v) for v in re.findall(r"Latency per step (\d+(?:\.\d+)?) us", text)]
        assert stated and all(abs(v - level["alpha_s"] * 1e6) < 1e-6 for v in stated), (i, level["alpha_s"], text)


def test_a_machine_forgets_what_it_priced_when_a_field_is_set():
    """``Machine.remembered`` keeps prices only while the machine is unchanged: calibration's merge
    sets fields of a machine it has priced with (``axon4d.measure.merge``)."""
    from axon4d.config import get_config
    from axon4d.layout.geometry import Collective, Op, Term
    from axon4d.plan.layers import priced
    from axon4d.plan.scenario import Scenario
    from axon4d.plan.workload import Workload

    m = load("h100")
    sc = Scenario(Workload(get_config("20B"), 64), GridShape(2, 2, 4, 16), m)
    c = Collective(Op.ALL_GATHER, "data", 64 * MB, "forward", Term.E12)
    before = priced(c, sc)
    assert priced(c, sc) == before  # remembered
    gemm = m.matmul_time("nt", 4096, 4096, 4096, "bfloat16", 64)
    m.levels = [dataclasses.replace(lv, beta_Bps=lv.beta_Bps / 4) for lv in m.levels]
    assert priced(c, sc)[0] > 2 * before[0]
    m.matmul = {}  # no tables: the efficiency × peak model
    assert m.matmul_time("nt", 4096, 4096, 4096, "bfloat16", 64) != gemm
