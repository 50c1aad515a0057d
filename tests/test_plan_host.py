"""Protects what the planner prices on the host side of a GPU (axon4d/plan/host_memory.py,
axon4d/plan/offload_cost.py, docs/planner.md "A node, not a device"): page-locked buffers at the
size they really take (one allocation carved into many buffers, at most 5% over their bytes on
the 80B showcase rank), the host memory a plan pins per node (offload and the
asynchronous checkpoint's snapshot), and the host link shared by offload's copies and the network
traffic that crosses it."""

import collections
import dataclasses
import math

import pytest
import torch

from axon4d.config import SIZES, ModelConfig
from axon4d.device.pinned import ALIGN, PAGE, carve, pinned_footprint, power_of_two_footprint
from axon4d.grid.shape import GridShape
from axon4d.memory import host_pool, host_snapshot
from axon4d.memory.offload import MIN_BYTES
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.options.recompute_mode import RECOMPUTE_MODES
from axon4d.plan.block_extras import block_extras
from axon4d.plan.host_memory import offload_pinned, pinned_per_node, snapshot_pinned, snapshot_tensors
from axon4d.plan.layers import layer_cost
from axon4d.plan.machine import load
from axon4d.plan.offload_cost import link_traffic, network_share, offload_seconds
from axon4d.plan.persistent import local_param_tensors, sixteen_bit_weights
from axon4d.plan.saved import block_bytes, block_storages
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload

PERLMUTTER = load("perlmutter")
ALL = OverlapPolicy()


def test_buffers_are_carved_at_aligned_offsets_from_one_allocation_of_whole_pages():
    offsets, total = carve([1, ALIGN, ALIGN + 1, 0, 8])
    assert offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN, 4 * ALIGN] and total == 5 * ALIGN
    assert all(o % 8 == 0 for o in offsets)  # a view of any dtype starts on an element
    assert pinned_footprint(0) == 0
    assert pinned_footprint(1) == PAGE and pinned_footprint(PAGE) == PAGE and pinned_footprint(PAGE + 1) == 2 * PAGE
    assert pinned_footprint(201 * 10**6, accelerator=False) == 201 * 10**6  # a plain host tensor: its bytes
    # what one caching-allocator buffer per tensor would take instead: a 201 MB buffer holds 256 MiB
    assert power_of_two_footprint(201 * 10**6) == 256 * 2**20 and power_of_two_footprint(4097) == 8192


#: the 80B showcase job (bench/plan_showcase.py) on one of its grids, with its checkpoint's snapshot
SHOWCASE = Workload(SIZES["80B"], 2048, async_save=True)


def _locked(nbytes):
    """Host memory one page-locked allocation of ``nbytes`` holds: whole pages (cudaHostRegister
    locks pages), computed here rather than by ``pinned_footprint``."""
    return -(-nbytes // PAGE) * PAGE


def _aligned(sizes):
    """Bytes of one allocation holding pieces of ``sizes`` bytes, each starting at a multiple of
    ALIGN: their sizes each rounded up to ALIGN, computed here rather than by ``carve``."""
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


def _pool_allocations(monkeypatch, storages, blocks, steps=2):
    """The allocations the runtime's offload pool (``axon4d.memory.host_pool.HostPool``) holds at the
    end of the forward of step ``steps`` when every step takes a buffer for each of ``storages`` in
    each of ``blocks`` blocks, in order, and gives them all back in the backward (``axon4d.memory.
    offload``): the bytes of each allocation it asked for. The allocations are made on the meta
    device (an 80B rank's buffers are tens of GB): their sizes are what the pool asked for."""
    asked = []

    def meta_bytes(nbytes, accelerator):
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    monkeypatch.setattr(host_pool, "pinned_bytes", meta_bytes)
    pool = host_pool.HostPool(torch.device("cpu"))
    for step in range(steps):
        ids = [pool.take(n)[0] for _ in range(blocks) for n in storages]
        held = [c.numel() for c in pool.chunks]
        if step < steps - 1:
            for i in reversed(ids):
                pool.give(i)
    assert asked  # the pool allocated through pinned_bytes
    return held


class _Asked(Exception):
    pass


def _snapshot_allocation(monkeypatch, sizes):
    """The bytes of the one allocation the runtime's snapshot (``axon4d.memory.host_snapshot.
    HostSnapshot``) asks for to copy host tensors of ``sizes`` bytes (each its own storage; the
    tensors are allocated, never touched, and the take stops at the allocation)."""
    asked = []

    def record(nbytes, accelerator):
        asked.append(nbytes)
        raise _Asked

    monkeypatch.setattr(host_snapshot, "pinned_bytes", record)
    with pytest.raises(_Asked):
        host_snapshot.HostSnapshot().take([torch.empty(n, dtype=torch.uint8) for n in sizes])
    (nbytes,) = asked
    return nbytes


@pytest.mark.parametrize("grid,offload", [((2, 2, 256, 1), 32), ((1, 2, 32, 16), 21)])
def test_the_showcase_ranks_pinned_memory_is_within_5_percent_of_its_bytes(monkeypatch, grid, offload):
    """What the runtime allocates for an 80B showcase rank's offload pool (from its second step on)
    and its checkpoint's snapshot, each page-locked: the planner's price of it to the byte, equal to
    the bytes they copy each rounded up to ALIGN (computed here) in whole pages, and at most 1.05×
    the bytes they copy; one caching-allocator buffer per tensor (a power of two each) would take
    far more."""
    sc = Scenario(SHOWCASE, GridShape(*grid), PERLMUTTER, ALL, "balanced", zero=2, offload=offload)
    storages = [math.ceil(s) for s in block_storages(sc.workload, sc.shape, "balanced") if s >= MIN_BYTES]
    pool = _pool_allocations(monkeypatch, storages, offload)
    assert len(pool) == 1  # the second step's buffers in the one allocation the pool merged
    snapshot = snapshot_tensors(sc)
    for sizes, allocations, planned in (
        (storages * offload, pool, offload_pinned(sc)),
        (snapshot, [_snapshot_allocation(monkeypatch, snapshot)], snapshot_pinned(sc)),
    ):
        held = sum(_locked(n) for n in allocations)
        assert planned == held == _locked(_aligned(sizes)), (planned, held, grid)
        needed = sum(sizes)
        assert needed <= held <= 1.05 * needed, (held / needed, grid)
        assert sum(power_of_two_footprint(n) for n in sizes) > 1.1 * held


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("context_parallel", [False, True])
def test_a_blocks_storages_are_its_saved_bytes_one_by_one(arch, context_parallel):
    cfg = ModelConfig(
        n_layers=2,
        hidden=256,
        n_heads=8,
        n_kv_heads=4 if arch == "llama" else None,
        vocab_size=512,
        seq_len=64,
        arch=arch,
    )
    for dtype in ("float32", "bfloat16"):
        wl = Workload(cfg, 8, dtype, context_parallel=context_parallel)
        for grid in [(1, 1, 1, 1), (2, 2, 2, 1), (1, 2, 4, 1)]:
            for mode in RECOMPUTE_MODES:
                shape = GridShape(*grid)
                storages = block_storages(wl, shape, mode)
                assert sum(storages) == pytest.approx(block_bytes(wl, shape, mode), rel=1e-12)
                assert all(s > 0 for s in storages)
                if mode == "full":
                    assert storages == [block_bytes(wl, shape, mode)]  # the block input alone


def test_offload_pins_each_storage_rounded_up_and_leaves_small_ones_on_the_device():
    wl = Workload(SIZES["80B"], 256)  # 2048 tokens per rank: the per-token statistics are under MIN_BYTES
    shape = GridShape(2, 2, 256, 1)
    sc = Scenario(wl, shape, PERLMUTTER, ALL, "balanced", offload=32)
    storages = block_storages(wl, shape, "balanced")
    big = [s for s in storages if s >= MIN_BYTES]
    assert len(big) < len(storages)  # the per-token statistics stay on the device
    expect = 32 * sum(-(-math.ceil(s) // ALIGN) * ALIGN for s in big)  # one allocation, whole pages
    assert offload_pinned(sc) == -(-expect // PAGE) * PAGE
    assert pinned_per_node(sc) == PERLMUTTER.devices_per_node * offload_pinned(sc)
    # on a host nothing is page-locked: the buffers take the bytes they hold
    host = Scenario(wl, shape, dataclasses.replace(PERLMUTTER, accelerator=False), ALL, "balanced", offload=32)
    assert offload_pinned(host) == pytest.approx(32 * sum(big), rel=1e-4)
    # a world smaller than a node pins only its own ranks' share
    small = Scenario(Workload(SIZES["small"], 2), GridShape(1, 1, 2, 1), PERLMUTTER, ALL, offload=1)
    assert pinned_per_node(small) == 2 * offload_pinned(small)


def test_the_async_snapshot_copies_the_state_as_saved():
    wl = Workload(SIZES["small"], 8, async_save=True)
    shape = GridShape(1, 2, 1, 4)
    params = local_param_tensors(wl, shape)
    plain = Scenario(wl, shape, PERLMUTTER, ALL)
    # each parameter's fp32 master and Adam's two moments, carved from one allocation
    assert sorted(snapshot_tensors(plain)) == sorted([4 * n for n in params] * 3 + [4] * len(params))
    # one allocation of them, each rounded up to ALIGN, in whole pages
    assert snapshot_pinned(plain) == _locked(_aligned([4 * n for n in params] * 3 + [4] * len(params)))
    # ZeRO-1 in bf16 on 4 data ranks: moments and the Linear weights' masters are this rank's part
    zero = Scenario(wl, shape, PERLMUTTER, ALL, zero=1)
    assert sum(snapshot_tensors(zero)) < sum(snapshot_tensors(plain)) / 2
    sixteen = list(sixteen_bit_weights(wl, shape, 1))
    assert sixteen  # the Linear weights are stored in bf16, their fp32 masters sharded
    expect = []
    for n in params:
        part = math.ceil(n / 4) * 4  # bytes of this rank's part, fp32
        expect += [part if n in sixteen and not sixteen.remove(n) else 4 * n, part, part, 4]
    assert sorted(snapshot_tensors(zero)) == sorted(expect)
    # only where the job asks for it
    assert snapshot_pinned(dataclasses.replace(plain, workload=dataclasses.replace(wl, async_save=False))) == 0.0


def test_the_network_share_of_an_axis_is_what_leaves_the_node():
    wl = Workload(SIZES["80B"], 2048)
    sc = Scenario(wl, GridShape(2, 2, 256, 1), PERLMUTTER, ALL)  # 4 GPUs per node: x·y one node
    assert network_share(sc, "x") == network_share(sc, "y") == 0.0
    assert network_share(sc, "z") == 1.0  # one rank of each z group per node: every byte leaves
    sc2 = Scenario(wl, GridShape(1, 2, 512, 1), PERLMUTTER, ALL)
    assert network_share(sc2, "z") == 0.5  # two of a z group on each node: half of the ring crosses
    # a host: nothing crosses a host link
    host = dataclasses.replace(PERLMUTTER, accelerator=False)
    assert link_traffic(Scenario(wl, sc.shape, host, ALL)) == {"forward": 0.0, "backward": 0.0}


def test_offload_shares_the_host_link_with_the_network_phase_by_phase():
    """Each phase's copies run at the share of the link that phase's network leaves them — the
    backward, which carries most of the step's network traffic (dW's reductions), leaves its fetches
    less of it than the step's average — and no phase is shorter than all its link bytes at the
    full rate."""
    wl = Workload(SIZES["80B"], 2048)
    shape = GridShape(2, 2, 256, 1)
    sc = Scenario(wl, shape, PERLMUTTER, ALL, "balanced", offload=32)
    extras = block_extras(sc)
    layers = [layer_cost(s, sc, extras.get(s.name, (0.0, 0.0))) for s in sc.linears]
    network = link_traffic(sc)
    assert network["backward"] > 2 * network["forward"] > 0
    shared = offload_seconds(sc, layers)
    # the same copies on a link the network does not use (a machine whose nodes hold the whole job)
    alone = dataclasses.replace(PERLMUTTER, devices_per_node=1024)
    sc_alone = dataclasses.replace(sc, machine=alone)
    layers_alone = [layer_cost(s, sc_alone, extras.get(s.name, (0.0, 0.0))) for s in sc.linears]
    assert link_traffic(sc_alone) == {"forward": 0.0, "backward": 0.0}
    free = offload_seconds(sc_alone, layers_alone)
    assert shared > free
    # priced by phase, more is exposed than with the step's traffic spread over the whole step
    link = PERLMUTTER.host_link_Bps
    moved = block_bytes(wl, shape, "balanced")
    compute = sum(lc.spec.count * lc.compute_s for lc in layers if not lc.spec.embedding)
    total = network["forward"] + network["backward"]
    average = alone.host_copy_time(moved, sc.world) / (1 - min(total / (link * compute), 0.95))
    from axon4d.plan.offload_cost import copy_queue, offload_windows

    _, fwd, bwd, between = offload_windows(sc, layers)
    assert shared > copy_queue(average, 32, wl.model.n_layers, fwd, bwd, between)
    # the floor: each phase's link bytes in one direction at the full rate, beyond the phase's compute
    floor = sum(max((network[p] + 32 * moved) / link - compute, 0.0) for p in network)  # compute: a bound on each
    assert shared >= floor - 1e-9
    # no offload, nothing added
    assert offload_seconds(dataclasses.replace(sc, offload=0), layers) == 0.0


def _snapshot_footprint(grid, cfg, stage, batch, out):
    """On this rank after one AdamW step (ZeRO ``stage``) and a background save: the bytes of the
    host allocation the snapshot holds, as torch reports its storage; the bytes of each storage it
    copied; the bytes of each distinct storage of the rank's state (the model's parameters and the
    optimizer's state tensors); and the planner's price of the snapshot (a host machine: no
    page-locking)."""
    import os

    import torch

    from axon4d import checkpoint
    from axon4d.models.transformer import Transformer
    from axon4d.train.batches import accumulate
    from axon4d.zero import shard_optimizer

    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stage:
        opt = shard_optimizer(opt, model, grid, stage=stage)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    accumulate(model, [ids], grid)
    opt.step()
    state = [*model.parameters(), *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state}
    with checkpoint.AsyncSaver(grid) as saver:
        saver.save(os.path.join(out, "ckpt"), model, opt, step=1)
        saver.wait()
        allocated = saver._snapshots.memory.untyped_storage().nbytes()
        copied = list(saver._snapshots.sizes)
    host = dataclasses.replace(PERLMUTTER, accelerator=False)
    wl = Workload(cfg, batch, "float32", async_save=True)
    return allocated, copied, list(storages.values()), snapshot_pinned(Scenario(wl, grid.shape, host, ALL, zero=stage))


@pytest.mark.parametrize("grid,stage", [((1, 1, 1, 1), 0), ((2, 1, 1, 2), 1), ((1, 2, 1, 2), 2)])
def test_the_snapshot_the_runtime_pins_is_the_planners(pools, tmp_path, grid, stage):
    """The planner prices each rank's snapshot as the rank's whole state — its distinct storages,
    each rounded up to ALIGN (counted here from the model and the optimizer, not by the planner's
    tensor list nor ``carve``) — to the byte; what the runtime allocates (the storage's bytes, not
    ``footprint``) holds the storages it copied, each rounded up to ALIGN, all of them storages of
    the state."""
    cfg = ModelConfig(
        n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
    )
    world = math.prod(grid)
    results = pools(world).run(grid, _snapshot_footprint, cfg, stage, 8, str(tmp_path))
    for allocated, copied, storages, priced in results:
        assert priced == _aligned(storages)
        assert allocated == _aligned(copied)
        assert not collections.Counter(copied) - collections.Counter(storages)  # the state's storages
    # a piece several ranks hold alike is copied by the one that writes it (axon4d.checkpoint.pieces):
    # the planner prices every rank as holding all of its pieces, which one rank alone does exactly
    if world == 1:
        assert sorted(results[0][1]) == sorted(results[0][2])
    else:
        assert sum(r[0] for r in results) < sum(r[3] for r in results)  # the shared pieces, written once


def test_an_accelerators_rms_norm_keeps_what_one_h200_offloaded():
    """On an accelerator ``F.rms_norm`` is torch's fused kernel (its widened input and 1/rms kept), on
    the host an elementwise chain (an fp32 x̂ too): a Scenario takes the kernel from its machine, and
    the planner's storages per block then match what one H200 offloaded per block
    (bench/results/gpu_check_nvidia_h200.json, gpu_check's OFFLOAD_SPEED and OFFLOAD_WIDE Llamas) to
    within 0.2% (the planner leaves out ~1 MiB of small tensors)."""
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "bench", "results", "gpu_check_nvidia_h200.json")) as f:
        cases = {c["name"]: c["metrics"] for c in json.load(f)["cases"] if "offload speed" in c["name"]}
    llama = ModelConfig(
        n_layers=8, hidden=1024, n_heads=8, n_kv_heads=2, ffn_hidden=2816, vocab_size=32000, seq_len=2048, arch="llama"
    )
    wide = dataclasses.replace(llama, n_layers=4, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=11008)
    for name, cfg, seqs in (("offload speed x1y1z1d1", llama, 8), ("offload speed wide x1y1z1d1", wide, 4)):
        measured = cases[name][0]["offloaded"]["block_bytes"]["0"]
        sc = Scenario(Workload(cfg, seqs, optimizer="sgd"), GridShape(1, 1, 1, 1), PERLMUTTER, ALL, offload=1)
        assert sc.workload.accelerator and sc.workload.norm_kernel(sc.shape) == "torch"
        planned = sum(s for s in block_storages(sc.workload, sc.shape) if s >= MIN_BYTES)
        assert planned == pytest.approx(measured, rel=2e-3), (name, planned, measured)
        host = dataclasses.replace(PERLMUTTER, accelerator=False)
        chain = Scenario(Workload(cfg, seqs, optimizer="sgd"), GridShape(1, 1, 1, 1), host, ALL)
        assert chain.workload.norm_kernel(chain.shape) == "chain"
        assert block_bytes(chain.workload, chain.shape) > 1.15 * measured  # the host's chain keeps x̂ too
