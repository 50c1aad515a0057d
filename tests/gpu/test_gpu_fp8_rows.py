"""FP8 dispatch's row cast on the GPU (axon4d/options/fp8_rows.py, docs/moe.md "FP8 dispatch"): the
fused cast an accelerator takes by default (``axon4d.device.fp8_fused.quantise_rows``, Triton with a
correctly rounded division) packs the eager path's bytes, for bf16 and fp32 rows of a large MoE
layer's width, zero blocks and a non-finite value included; the round trip is within e4m3's
rounding. The bytes per second of pack and unpack are printed (what ``moe_cost.pack_passes`` prices
from the machine's elementwise rate)."""

from __future__ import annotations

import time

import pytest
import torch

from axon4d.device import fp8_fused
from axon4d.options import fp8_rows

pytestmark = pytest.mark.gpu


@pytest.fixture
def cast_mode():
    yield fp8_fused.set_mode
    fp8_fused.set_mode(None)
    fp8_fused._State.failure = None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_fused_row_cast_packs_the_eager_bytes(grid, cast_mode, dtype):
    device = grid.device
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(4096, 7168, device=device, generator=gen) * torch.logspace(-3, 2, 7168, device=device)
    rows[1, :128] = 0.0
    rows[2, 300] = float("inf")
    rows = rows.to(dtype)
    cast_mode("eager")
    eager = fp8_rows.pack(rows)
    cast_mode("fused" if device.type == "cpu" else "auto")
    assert fp8_fused.wanted(device)
    fused = fp8_rows.pack(rows)
    assert fp8_fused.failure() is None
    _same_bytes(fused, eager, rows)
    back = fp8_rows.unpack(fused, 7168, dtype).float()
    finite = torch.isfinite(rows.float()).all(dim=1)
    big = rows.float().abs() >= rows.float().abs().view(4096, -1, 128).amax(-1).repeat_interleave(128, 1) * 2**-6
    ok = (back - rows.float()).abs() <= rows.float().abs() * 2**-4
    assert ok[finite][big[finite]].all()
    if device.type != "cpu":  # the rates the planner prices from the elementwise table
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            packed = fp8_rows.pack(rows)
        torch.cuda.synchronize()
        pack_s = (time.perf_counter() - start) / 10
        start = time.perf_counter()
        for _ in range(10):
            fp8_rows.unpack(packed, 7168, dtype)
        torch.cuda.synchronize()
        unpack_s = (time.perf_counter() - start) / 10
        n = rows.numel()
        print(
            f"fp8 rows {dtype}: pack {n * (2 * dtype.itemsize + 3) / pack_s / 1e9:.0f} GB/s as priced, "
            f"unpack {n * (1 + 3 * dtype.itemsize) / unpack_s / 1e9:.0f} GB/s as priced"
        )


def _same_bytes(fused, eager, rows):
    """``fused`` and ``eager`` (n, F + 4·F/128) packed rows are equal; where not, fails saying how
    many blocks' scales and how many codes differ, with the first differing scale beside the amax
    divided by 448 in float64 and rounded once to fp32 (which path's scale is the quotient)."""
    n, f = rows.shape
    nb = f // fp8_rows.BLOCK
    scales = {k: v[:, f:].contiguous().view(torch.float32).view(n, nb) for k, v in (("fused", fused), ("eager", eager))}
    codes_off = int((fused[:, :f] != eager[:, :f]).sum())
    scale_off = scales["fused"] != scales["eager"]
    if not codes_off and not scale_off.any():
        return
    detail = f"{int(scale_off.sum())} of {n * nb} blocks' scales and {codes_off} of {n * f} codes differ"
    if scale_off.any():
        r, b = (int(i) for i in scale_off.nonzero()[0])
        amax = rows[r, b * fp8_rows.BLOCK : (b + 1) * fp8_rows.BLOCK].double().abs().max()
        quotient = (amax / 448).float().item()
        detail += (
            f"; row {r} block {b}: fused {scales['fused'][r, b].item()!r}, eager {scales['eager'][r, b].item()!r}, "
            f"amax/448 rounded once {quotient!r}"
        )
    raise AssertionError(detail)
