"""Protects the MoE layer's experts in FP8 (``precision="bf16-fp8"``, axon4d/nn/moe_experts.py
``ExpertFP8GEMM``, docs/moe.md "FP8", issue 53 item 4): on 8-rank grids under two expert layouts —
the default (experts over z, each split over x·y) and whole experts over the world — every grouped
GEMM the layer runs (forward, dX, dW of up and down) is the FP8 one and equals its dequantised
reference bit for bit (the host's ``_scaled_mm`` sums the dequantised operands exactly in fp32);
the layer's output and gradients stay within FP8 rounding of the same layer under
``bf16-fp32-reduce``; and experts whose blocks are not multiples of 16 run in bf16 and say so.
Start here when changing how experts multiply in FP8."""

import pytest
import torch
from test_moe import margin_inputs, rel_err

import axon4d
from axon4d.config import ModelConfig
from axon4d.device import grouped
from axon4d.nn.moe import MoE
from axon4d.nn.moe_dense import DenseMoE
from axon4d.options import fp8_grouped
from axon4d.options.fp8_gemm import Quantised
from axon4d.train import fp8_log

#: (grid, expert layout)
LAYOUTS = {"default": ((2, 2, 2, 1), None), "whole-over-world": ((2, 2, 2, 1), "ep=world,tp=1")}
#: the layer against bf16-fp32-reduce, the largest error relative to the largest value: X and W are
#: e4m3 (unit roundoff 2⁻⁴), dY e5m2 (2⁻³); measured 0.04-0.08 on both layouts
FP8_TOL = 0.125


def moe_config(hidden=64, ffn=32, gated=True):
    return ModelConfig(
        n_layers=1,
        hidden=hidden,
        n_heads=4,
        vocab_size=64,
        seq_len=8,
        arch="llama" if gated else "gpt",
        n_experts=8,
        experts_per_token=2,
        expert_ffn=ffn,
        shared_experts=0,
        moe_aux_coef=0.0,
        moe_z_coef=0.0,
    )


def _run_layer(grid, cfg, check_gemms):
    """Forward and backward of the MoE layer on margin inputs; with ``check_gemms`` each FP8 grouped
    GEMM is compared with its dequantised reference as it runs. Returns the gathered output, input
    gradient and expert gradients, what the experts multiply, and the FP8 GEMMs checked and differing."""
    checked, differ = [0], [0]
    plain_mm, plain_dw = grouped.scaled_grouped_mm, grouped.scaled_grouped_weight_grad

    def mm(a, b, sa, sb, sizes, out_dtype, **kw):
        out = plain_mm(a, b, sa, sb, sizes, out_dtype, **kw)
        ref = fp8_grouped.grouped_reference(Quantised(a, sa), Quantised(b, sb), sizes, out_dtype)
        checked[0], differ[0] = checked[0] + 1, differ[0] + int(not torch.equal(out, ref))
        return out

    def dw(dy_t, a_t, sd, sa, sizes, out_dtype):
        out = plain_dw(dy_t, a_t, sd, sa, sizes, out_dtype)
        ref = fp8_grouped.grouped_weight_reference(Quantised(dy_t.t(), sd), Quantised(a_t.t(), sa), sizes, out_dtype)
        checked[0], differ[0] = checked[0] + 1, differ[0] + int(not torch.equal(out, ref))
        return out

    if check_gemms:
        grouped.scaled_grouped_mm, grouped.scaled_grouped_weight_grad = mm, dw
    try:
        torch.manual_seed(5)
        dense = DenseMoE(cfg)
        b, s = 4, cfg.seq_len
        x_full = margin_inputs(dense, b * s, seed=9).view(b, s, cfg.hidden)
        mod = MoE(cfg).load_dense_(dense)
        v = torch.randn(cfg.hidden)
        x = axon4d.shard_input(x_full).detach().requires_grad_()
        y = mod(x)
        (y.float() * axon4d.shard_features(v, "x")).sum().backward()
    finally:
        grouped.scaled_grouped_mm, grouped.scaled_grouped_weight_grad = plain_mm, plain_dw
    out = {
        "y": axon4d.gather_batch(axon4d.gather_features(y.float(), "x")),
        "dx": axon4d.gather_batch(axon4d.gather_features(x.grad, "x")),
    }
    got = dict(mod.to_dense(grads=True).named_parameters())
    out.update({name: p.grad for name, p in got.items() if name.startswith("experts.")})
    listed = fp8_log.gemm_precisions(torch.nn.ModuleDict({"moe": mod}))
    return out, mod.experts.gemm_precision, listed, checked[0], differ[0]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_expert_gemms_run_in_fp8_equal_their_reference_and_stay_near_bf16(pools, kind):
    grid, layout = LAYOUTS[kind]
    cfg = moe_config()
    fp8 = pools(8).run(grid, _run_layer, cfg, True, precision="bf16-fp8", expert_layout=layout)
    bf16 = pools(8).run(grid, _run_layer, cfg, False, precision="bf16-fp32-reduce", expert_layout=layout)
    for rank, ((got, what, listed, checked, differ), (want, *_)) in enumerate(zip(fp8, bf16)):
        assert what == "fp8" and listed["moe.experts"] == "fp8", (rank, what, listed)
        # up and down: forward and dX (scaled_grouped_mm) and dW, each checked against its reference
        assert checked == 6 and differ == 0, f"{kind} rank {rank}: {differ} of {checked} FP8 GEMMs differ"
        errs = {name: rel_err(got[name], want[name]) for name in want}
        assert all(e <= FP8_TOL for e in errs.values()), f"{kind} rank {rank}: {errs}"
        assert any(e > 0 for e in errs.values()), "the FP8 layer computed exactly what bf16 does"


def _fp8_or_not(grid, cfg):
    mod = MoE(cfg)
    return mod.experts.fp8_gemms, mod.experts.gemm_precision


def test_experts_whose_blocks_are_not_multiples_of_16_run_in_bf16_and_say_so(pools):
    cfg = moe_config(hidden=32, ffn=16)  # split over x·y on (2,2,2,1): blocks (16, 8)
    for fp8, what in pools(8).run((2, 2, 2, 1), _fp8_or_not, cfg, precision="bf16-fp8"):
        assert not fp8 and what == "bf16 (expert block (16, 8) not a multiple of 16)"
    # whole experts (ep=world) hold the whole (32, 16) blocks: FP8
    for fp8, what in pools(8).run((2, 2, 2, 1), _fp8_or_not, cfg, precision="bf16-fp8", expert_layout="ep=world"):
        assert fp8 and what == "fp8"
