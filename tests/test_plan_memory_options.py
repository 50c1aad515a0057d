"""Peak memory per rank of the step options, measured with torch's memory tracker against the
planner's prediction (issue 31, item 6): micro-batches (with keep-for-backward too), activation
offload and ZeRO (the optimizer sharded over data, ``axon4d.shard_optimizer``), on 1–8 ranks.

Each case trains the same small model (tests/test_recompute.py's) for two warm-up steps and
measures the third (``axon4d.measure.probe.peak_bytes``: torch's ``MemTracker`` on the host, the
maximum over ranks), its collectives on private copies so that the tracker counts the program's
tensors alone, each freed where the program drops it (tests/collective_copies.py), then prices the
same job with ``axon4d.plan.memory.memory``.

Offload on a host: the host copies are in the same memory as everything else, so the tracker's
peak is the device's and the host's together. The offloader's host pool is held the whole step,
so the device's peak is the tracker's less the pool (``OffloadStats.peak_pinned_bytes``); that
and the host bytes are each compared with the planner.

The bounds. A plan priced below what its step holds does not fit, so the planner must not be low:
where its model of the step is complete, the bound is one-sided. With offload (the backward's
last two blocks, ``axon4d.plan.memory.offload_peak``, where its peak is here)

    measured − unpriced ≤ predicted ≤ (1 + TOLERANCE) · measured,

``unpriced`` being the few small tensors the planner leaves out, counted to the byte
(``_unpriced``: at most 53 KB here, 0.9% of the smallest rank's peak) — the planner is exact but
for them — and for the host bytes offloaded ≤ planned ≤ (1 + TOLERANCE) · offloaded (the planner
prices the offloaded blocks' whole saved bytes; the runtime leaves the tensors under 64 KiB on the
device, 0.1–3.1% here). The other options are held to |predicted − measured| ≤ TOLERANCE · measured
(``TOLERANCE_BF16`` in bf16): their walks are not exact yet — the planner low by up to 1.4%
(Llama's micro-batches under balanced recomputation on (2,1,1,2)) and high by up to 4.9% in fp32
(Llama's ZeRO-2 under full recomputation on (1,1,2,4)).
"""

from __future__ import annotations

import pytest
import torch
from collective_copies import private_collectives

import axon4d
from axon4d.config import get_config
from axon4d.grid.shape import GridShape
from axon4d.models.transformer import Transformer
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.backward_walk import BackwardWalk, walk_kinds
from axon4d.plan.workload import Workload
from axon4d.train.batches import accumulate_one
from tests.test_recompute import MEM_BATCH, MEM_CFG

#: the planner's error allowed on each option's peak ((predicted − measured) / measured)
TOLERANCE = 0.05
#: the mixed precision the bf16 cases train in (the default on an accelerator)
BF16 = "bf16-fp32-reduce"
#: ... and the error allowed there: Llama's steps at data 4 in bf16 on the host measured +7.0% and
#: +7.7% (the planner high: the safe side), the rest within 5% (docs/planner.md, "Known limits")
TOLERANCE_BF16 = 0.08


def _measure(grid, cfg, recompute="none", micro_batches=1, offload=None, zero=0):
    """(the device's measured peak, host bytes offloaded at their peak) of one step of ``cfg`` on
    ``grid``, every step's collectives on private copies (module docstring)."""
    with private_collectives():
        return _measured_step(grid, cfg, recompute, micro_batches, offload, zero)


def _measured_step(grid, cfg, recompute, micro_batches, offload, zero):
    """``_measure``'s measurement."""
    from axon4d.measure.probe import peak_bytes

    torch.manual_seed(0)
    model = Transformer(cfg, grid=grid, recompute=recompute, offload=offload)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    if zero:
        opt = axon4d.shard_optimizer(opt, model, grid, stage=zero, overlap_gathers=True)  # the job's
    ids = torch.randint(0, cfg.vocab_size, (MEM_BATCH * micro_batches, cfg.seq_len + 1))
    batches = ids.chunk(micro_batches)

    def step(next_pass=lambda: None):
        opt.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):  # the training job's accumulation, one micro-batch at a time
            if i:
                next_pass()
            accumulate_one(model, batch, grid, last=i == len(batches) - 1, parts=len(batches))
        opt.step()

    step(), step()
    if model.offloader is not None:
        model.offloader.reset_peaks()
    measured = peak_bytes(grid, model, opt, step, passes=True)
    stats = model.offloader.stats() if model.offloader is not None else None
    host = stats.peak_host_bytes if stats is not None else 0
    pool = stats.peak_pinned_bytes if stats is not None else 0
    # the tracker counts the offloader's host pool as one allocation (its aligned views and free
    # ranges too): the device's own peak is the tracker's less the pool; the planner's host bytes
    # are the copies' own (``OffloadStats.peak_host_bytes``)
    pools = grid.comm.all_gather(torch.tensor([float(pool)]), "world").wait()
    hosts = grid.comm.all_gather(torch.tensor([float(host)]), "world").wait()
    return measured - int(pools.max()), int(hosts.max())


def _predicted(grid, cfg, recompute="none", micro_batches=1, offload_blocks=0, zero=0):
    from axon4d.options.precision import NAMED
    from axon4d.plan.memory import memory
    from axon4d.plan.workload import Workload

    preset = next(name for name, p in NAMED.items() if p == grid.precision)  # the grid's, by name
    wl = Workload(cfg, MEM_BATCH * micro_batches, precision=preset, expert_layout=grid.expert_layout)
    return memory(
        wl,
        grid.shape,
        recompute,
        grid.scheduler.policy,
        micro_batches=micro_batches,
        zero=zero,
        offload=offload_blocks,
        widened_gemms=True,  # the host's dW GEMMs (axon4d.device.mm_widening)
    )


def _case(grid, cfg, options):
    options = dict(options)
    options.pop("precision", None)  # the grid's (``pools(...).run(..., precision=)``)
    axon4d.overlap.configure(options.pop("overlap", None), grid)  # None: every mechanism on, the default
    offload = options.get("offload")
    blocks = 0 if not offload else round(offload * cfg.n_layers + 1e-9)
    measured, host = _measure(grid, cfg, **options)
    predicted = _predicted(
        grid,
        cfg,
        options.get("recompute", "none"),
        options.get("micro_batches", 1),
        blocks,
        options.get("zero", 0),
    )
    return measured, host, predicted.peak, predicted.host


def _unpriced(cfg, grid, options):
    """Bytes an offloaded step holds at its peak, the backward of its last two blocks, that the
    planner does not price (fp32; module docstring): the rotary tables each of the two blocks on the
    device keeps, cos and sin, (S, d) each (Llama; selective recomputation re-makes them with core
    attention); the embedding's saved indices (int64) and mask, b each; the step's token ids, the
    global batch of (B, S + 1) int64 that every rank holds (``axon4d.train.batches``; host memory on
    an accelerator); the loss, its token count (int64) and the backward's seed, 0-dim; Adam's step
    count of each parameter tensor, a 0-dim fp32."""
    from axon4d.grid.shape import GridShape
    from axon4d.plan.persistent import local_param_tensors
    from axon4d.plan.workload import Workload

    shape = GridShape(*grid)
    batch = MEM_BATCH * options.get("micro_batches", 1)
    wl = Workload(cfg, batch, precision="fp32")
    rotary = cfg.arch == "llama" and options.get("recompute", "none") in ("none", "balanced")
    tables = min(cfg.n_layers, 2) * 2 * cfg.seq_len * cfg.head_dim * 4 if rotary else 0
    embedding = wl.local_tokens(shape) * (8 + 4)
    token_ids = batch * (cfg.seq_len + 1) * 8
    scalars = 4 + 8 + 4 + 4 * len(local_param_tensors(wl, shape))
    return tables + embedding + token_ids + scalars


def _check(result, what, tolerance=TOLERANCE, unpriced=None):
    """The planner's peak within ``tolerance`` of the measured one; with ``unpriced`` (an offloaded
    step, its bytes the planner leaves out) not below the measured peak less them, nor its host
    bytes below the offloaded ones (module docstring)."""
    device, host, peak, planned_host = result
    error = (peak - device) / device
    said = f"{what}: planner {peak / 2**20:.4f} MiB vs measured {device / 2**20:.4f} MiB ({error:+.2%})"
    if unpriced is None:
        assert abs(error) <= tolerance, said
    else:
        assert device - unpriced <= peak <= (1 + tolerance) * device, f"{said}, {unpriced} B unpriced"
    if planned_host:
        host_error = (planned_host - host) / host
        assert host <= planned_host <= (1 + TOLERANCE) * host, (
            f"{what}: offloaded {host} B vs planner {planned_host:.0f} B ({host_error:+.2%})"
        )


@pytest.mark.parametrize(
    "world,grid,options",
    [
        (1, (1, 1, 1, 1), {"micro_batches": 2}),
        (1, (1, 1, 1, 1), {"micro_batches": 4, "recompute": "full"}),
        (1, (1, 1, 1, 1), {"offload": 0.5}),
        (1, (1, 1, 1, 1), {"offload": 1.0, "recompute": "selective"}),
        pytest.param(4, (1, 2, 2, 1), {"micro_batches": 2}, marks=pytest.mark.slow),
        pytest.param(4, (2, 1, 1, 2), {"micro_batches": 4, "recompute": "balanced"}, marks=pytest.mark.slow),
        pytest.param(4, (1, 2, 2, 1), {"offload": 1.0}, marks=pytest.mark.slow),
        pytest.param(8, (2, 2, 2, 1), {"offload": 0.5, "recompute": "balanced"}, marks=pytest.mark.slow),
        (2, (1, 1, 1, 2), {"zero": 1}),
        (2, (1, 1, 1, 2), {"zero": 2}),
        pytest.param(4, (1, 1, 1, 4), {"zero": 2}, marks=pytest.mark.slow),
        pytest.param(8, (1, 1, 2, 4), {"zero": 2, "recompute": "full"}, marks=pytest.mark.slow),
        pytest.param(8, (1, 1, 1, 8), {"zero": 2, "recompute": "full"}, marks=pytest.mark.slow),
        pytest.param(4, (1, 2, 1, 2), {"zero": 1, "micro_batches": 2}, marks=pytest.mark.slow),
        # keep-for-backward: the blocks carried over the held backward passes, a re-run's own blocks
        (2, (1, 1, 2, 1), {"micro_batches": 3, "overlap": "all,keep"}),
        (2, (1, 1, 2, 1), {"micro_batches": 3, "recompute": "full", "overlap": "all,keep"}),
        pytest.param(4, (2, 1, 2, 1), {"micro_batches": 2, "overlap": "all,keep"}, marks=pytest.mark.slow),
        pytest.param(8, (1, 1, 2, 4), {"zero": 1, "recompute": "full"}, marks=pytest.mark.slow),
        # training in bf16: ZeRO stores the Linear weights in bf16 and shards their fp32 masters
        (2, (1, 1, 1, 2), {"zero": 1, "precision": BF16}),
        pytest.param(4, (1, 1, 1, 4), {"zero": 2, "precision": BF16}, marks=pytest.mark.slow),
        pytest.param(4, (1, 1, 2, 2), {"zero": 1, "precision": BF16}, marks=pytest.mark.slow),
        # one rank in bf16 over fp32 masters: each Linear keeps its weight's bf16 copy for backward
        (1, (1, 1, 1, 1), {"precision": BF16}),
        (1, (1, 1, 1, 1), {"precision": BF16, "recompute": "full", "micro_batches": 2}),
        # bf16 gradient reductions: the dW blocks and their reduce-scatters over z in bf16
        (2, (1, 1, 2, 1), {"precision": "bf16"}),
        pytest.param(4, (2, 1, 2, 1), {"precision": "bf16", "recompute": "balanced"}, marks=pytest.mark.slow),
    ],
)
def test_peak_memory_of_micro_batches_and_offload_is_the_planners(pools, world, grid, options):
    for arch in ("llama", "gpt"):
        result = pools(world).run(grid, _case, MEM_CFG[arch], options, precision=options.get("precision", "fp32"))[0]
        tolerance = TOLERANCE_BF16 if "precision" in options else TOLERANCE
        unpriced = _unpriced(MEM_CFG[arch], grid, options) if options.get("offload") else None
        _check(result, f"{arch} on {grid} with {options}", tolerance, unpriced)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3-scale", "20B"])
@pytest.mark.parametrize("recompute", ["none", "balanced", "full"])
def test_the_backward_walk_s_peak_moves_with_the_bytes_it_starts_from(model, recompute):
    """``memory`` walks the backward once from zero live bytes and adds where it starts
    (``memory._walk_added``; under offload the last two blocks' too, ``memory._last_blocks_added``):
    that holds only while every event of ``BackwardWalk`` moves the live bytes by its own. A walk
    from any start must peak that much higher."""
    wl = Workload(get_config(model), 256, precision="bf16-fp32-reduce")
    shape = GridShape(2, 2, 4, 16)
    kinds = [(kind, round(share * wl.model.n_layers)) for kind, share in reversed(wl.kinds())]
    for overlap in (OverlapPolicy(), OverlapPolicy.parse("all,keep,oag_depth=2")):

        def peak(start: float, carried: bool) -> float:
            walks = [
                (BackwardWalk(kind, shape, recompute, overlap, True, start, 0.5, carried=carried), n)
                for kind, n in kinds
            ]
            return walk_kinds(walks)

        def last(start: float, carried: bool) -> float:
            first = kinds[-1][0]  # the model's first blocks' kind, whose last two the backward ends with
            walk = BackwardWalk(first, shape, recompute, overlap, True, start, 0.5, carried=carried)
            return walk.last_blocks(first=first.model.n_layers <= 2)

        for carried in (False, True):
            zero, last_zero = peak(0.0, carried), last(0.0, carried)
            assert zero > 0 and last_zero > 0
            for start in (1e9, 3.7e10):
                assert peak(start, carried) == pytest.approx(start + zero, rel=1e-12)
                assert last(start, carried) == pytest.approx(start + last_zero, rel=1e-12)
