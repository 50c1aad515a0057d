"""Peak memory per rank of the step options, measured with torch's memory tracker against the
planner's prediction (issue 31, item 6): micro-batches (with keep-for-backward too), activation
offload and ZeRO (the optimizer sharded over data, ``axon4d.shard_optimizer``), on 1–8 ranks.

Each case trains the same small model (tests/test_recompute.py's) for two warm-up steps and
measures the third (``axon4d.measure.probe.peak_bytes``: torch's ``MemTracker`` on the host, the
maximum over ranks), then prices the same job with ``axon4d.plan.memory.memory``. The planner's
figure is within ``TOLERANCE`` of the measured one.

Offload on a host: the host copies are in the same memory as everything else, so the tracker's
peak is the device's and the host's together. The offloaded bytes are all held when the backward
starts, where the step's peak is, so the device's peak is the tracker's less the offloader's peak
of host bytes (``OffloadStats``); that and the host bytes are each compared with the planner.
"""

from __future__ import annotations

import pytest
import torch

import axon4d
from axon4d.models.transformer import Transformer
from axon4d.train.batches import accumulate_one
from tests.test_recompute import MEM_BATCH, MEM_CFG

#: the planner's error allowed on each option's peak ((predicted − measured) / measured)
TOLERANCE = 0.05
#: the mixed precision the bf16 cases train in (the default on an accelerator)
BF16 = "bf16-fp32-reduce"
#: ... and the error allowed there: Llama's steps at data 4 in bf16 on the host measured +7.0% and
#: +7.7% (the planner high: the safe side), the rest within 5% (docs/planner.md, "Known limits")
TOLERANCE_BF16 = 0.08
#: ... and with every block offloaded on several ranks: Llama's measured −5.1% on (1,2,2,1) (the
#: planner low; its two blocks on the device at a time miss something the runtime holds while it
#: fetches; docs/planner.md, "Known limits")
TOLERANCE_OFFLOAD = 0.06


def _measure(grid, cfg, recompute="none", micro_batches=1, offload=None, zero=0):
    """(the device's measured peak, host bytes offloaded at their peak) of one step of ``cfg`` on ``grid``."""
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
    wl = Workload(cfg, MEM_BATCH * micro_batches, precision=preset)
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


def _check(result, what, tolerance=TOLERANCE):
    device, host, peak, planned_host = result
    error = (peak - device) / device
    assert abs(error) <= tolerance, (
        f"{what}: planner {peak / 2**20:.2f} MiB vs measured {device / 2**20:.2f} MiB ({error:+.1%})"
    )
    if planned_host:
        host_error = (planned_host - host) / host
        assert abs(host_error) <= TOLERANCE, (
            f"{what}: offloaded {host} B vs planner {planned_host:.0f} B ({host_error:+.1%})"
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
        if options.get("offload") == 1.0 and world > 1:
            tolerance = TOLERANCE_OFFLOAD
        _check(result, f"{arch} on {grid} with {options}", tolerance)
