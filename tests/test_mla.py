"""Protects multi-head latent attention on the grid (axon4d/nn/mla.py): ``MLA`` on 8-rank grids
equals the one-process ``DenseMLA`` in fp32 to 1e-5 — output, input gradient, every parameter and
its gradient (``to_dense``) — with a q latent (q_lora_rank) and without (q_proj), interleaved and
half-split rotary, biases, and selective recomputation of the core; bad sizes and context
parallelism are refused in one line."""

import pytest
import torch

import axon4d
from axon4d.nn.mla import MLA, DenseMLA

TOL = 1e-5
FLOOR = 1e-3  # gradients that vanish in theory are compared against this scale
HIDDEN, HEADS = 32, 4
SMALL = dict(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
#: (q_lora_rank, rope_interleave, bias, recompute_core)
VARIANTS = {
    "q_lora": dict(q_lora_rank=12, rope_interleave=True, bias=False),
    "q_proj": dict(q_lora_rank=None, rope_interleave=False, bias=True),
}


def rel_err(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(FLOOR))


def _compare(grid, variant, recompute):
    options = {**SMALL, **VARIANTS[variant]}
    torch.manual_seed(3)
    dense = DenseMLA(HIDDEN, HEADS, **options)
    with torch.no_grad():  # norm weights away from 1: their slices and gradients must matter
        for name, p in dense.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    mla = MLA(HIDDEN, HEADS, recompute_core=recompute, **options).load_dense_(dense)
    x_full = torch.randn(4, 8, HIDDEN)
    v = torch.randn(HIDDEN)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    y = mla(x)
    (y * axon4d.shard_features(v, "x")).sum().div(y.shape[0] * y.shape[1]).backward()
    xr = x_full.clone().requires_grad_()
    yr = dense(xr)
    (yr * v).sum().div(yr.shape[0] * yr.shape[1]).backward()
    errs = {"forward": rel_err(axon4d.gather_batch(axon4d.gather_features(y, "x")), yr)}
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch")
    errs["input_grad"] = rel_err(dx, xr.grad)
    got = dict(mla.to_dense(grads=True).named_parameters())
    for name, p in dense.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    return errs


@pytest.mark.parametrize(
    "grid,variant,recompute",
    [((2, 2, 2, 1), "q_lora", False), ((1, 2, 1, 4), "q_proj", True), ((2, 1, 2, 2), "q_lora", True)],
)
def test_mla_matches_one_process(pools, grid, variant, recompute):
    for rank, errs in enumerate(pools(8).run(grid, _compare, variant, recompute)):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, f"{grid} {variant} rank {rank}: {worst} error {errs[worst]:.2e} > {TOL:.0e}"


def _refusals(grid):
    out = []
    for kw in (dict(kv_lora_rank=6), dict(qk_rope_head_dim=3), dict(context_parallel=True)):
        try:
            MLA(HIDDEN, HEADS, **{**SMALL, **kw})
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("")
    return out


def test_mla_refuses_bad_sizes_and_context_parallel(pools):
    errors = pools(8).run((4, 1, 1, 2), _refusals)[0]  # the 8-rank pool of the test above
    assert "kv_lora_rank" in errors[0] and "x" in errors[0]
    assert "qk_rope_head_dim = 3" in errors[1]
    assert "context_parallel" in errors[2]
