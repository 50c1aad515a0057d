"""Protects mixed precision (axon4d.options.precision): fp32 master weights and gradients with bf16
compute stay close to the fp32 model, the weight all-gathers move bf16 bytes and the gradient
reductions move the bytes of the chosen reduction dtype (geometry.linear_collectives agrees), and
bad names fail early."""

from collections import Counter

import pytest
import torch

import axon4d
from axon4d import activations
from axon4d.config import ModelConfig
from axon4d.layout.geometry import Op, linear_collectives
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.options.precision import Precision

CFG = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama")
BF16_TOL = 5e-2


def _mixed_vs_fp32(grid):
    torch.manual_seed(7)
    dense = DenseTransformer(CFG)
    model = Transformer.from_dense(dense)
    ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1))
    loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
    loss.backward()
    dense.loss(ids[:, :-1], ids[:, 1:]).backward()
    got = model.to_dense(grads=True)
    dtypes = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()}
    logits_dtype = model(axon4d.shard_batch(ids[:, :-1])).dtype
    ref = dict(dense.named_parameters())
    errs = {}
    for name, p in got.named_parameters():
        r = ref[name].grad
        errs[name] = float((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-3))
    return dtypes, logits_dtype, errs


@pytest.mark.parametrize("precision", ["bf16", "bf16-fp32-reduce"])
@pytest.mark.slow
def test_mixed_precision_keeps_fp32_masters_and_tracks_the_fp32_gradients(pools, precision):
    for dtypes, logits_dtype, errs in pools(8).run((2, 2, 2, 1), _mixed_vs_fp32, precision=precision):
        assert dtypes == {torch.float32}  # parameters and .grad stay fp32 (master weights)
        assert logits_dtype == torch.bfloat16  # the matmuls ran in bf16
        worst = max(errs, key=errs.get)
        assert errs[worst] < BF16_TOL, f"{worst}: {errs[worst]:.2e}"


LAYERS = [(24, 40, True, False), (40, 24, True, True)]


def _bytes(grid):
    torch.manual_seed(0)
    layers = [axon4d.Linear(i, o, bias=b, transpose=t) for i, o, b, t in LAYERS]
    x = axon4d.shard_input(torch.randn(8, 3, 24)).requires_grad_()
    grid.comm.log.clear()
    layers[1](layers[0](x)).float().sum().backward()
    return Counter((r.op, r.axis, r.payload_bytes) for r in grid.comm.log.records)


@pytest.mark.parametrize("precision,grad_bytes", [("bf16", 2), ("bf16-fp32-reduce", 4)])
@pytest.mark.slow
def test_collectives_move_compute_and_reduction_dtype_bytes(pools, precision, grad_bytes):
    grid = (2, 2, 2, 1)
    shape = axon4d.GridShape(*grid)
    expected = Counter()
    for i, o, b, t in LAYERS:
        for c in linear_collectives(
            i, o, 8 * 3 // shape.size("batch"), shape, transpose=t, bias=b, element_size=2, grad_element_size=grad_bytes
        ):
            expected[(c.op, c.axis, c.payload_bytes)] += 1
    for counted in pools(8).run(grid, _bytes, precision=precision):
        assert counted == expected
        assert any(op == Op.REDUCE_SCATTER for op, _, _ in counted)


def test_precision_names():
    assert Precision.parse("bf16").compute == torch.bfloat16 and Precision.parse("bf16").param == torch.float32
    assert Precision.parse("bf16-fp32-reduce").reduce == torch.float32
    assert not Precision.parse(None).mixed
    with pytest.raises(
        ValueError, match="precision 'fp16-ish' is not supported; use one of fp32, bf16, bf16-fp32-reduce"
    ):
        Precision.parse("fp16-ish")


def _dw_relative_error(grid):
    torch.manual_seed(3)
    layer = axon4d.Linear(64, 48, bias=False)
    x = torch.randn(16, 64).bfloat16().float()  # (tokens, in), exact in bf16
    g = torch.randn(16, 48).bfloat16().float()  # dY (tokens, out), exact in bf16
    y = layer(axon4d.shard_input(x))
    y.backward(activations.shard_features(axon4d.shard_batch(g), "y").to(y.dtype))  # the output layout
    got = layer.to_dense(grads=True).weight.grad.double()
    exact = g.double().t() @ x.double() / grid.size("batch")  # DDP's average over the batch ranks
    return float((got - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("grid", [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 1, 1)])
def test_an_fp32_reduction_keeps_the_dW_gemm_sums_in_fp32(pools, grid):
    """Under bf16-fp32-reduce the dW GEMM writes fp32 (device.mm_widening): the gradient equals the
    exact dYᵀ X of the bf16 operands to fp32 precision, where a product rounded to bf16 before its
    fp32 reduction is off by ~1e-3. Both the one-rank path and the 3D path (E11 over z at G_z = 2; x split at G_x = 2)."""
    world = grid[0] * grid[1] * grid[2] * grid[3]
    for err in pools(world).run(grid, _dw_relative_error, precision="bf16-fp32-reduce"):
        assert err < 1e-5


def _fp16_refusals(grid):
    from harness import value_errors

    return value_errors(
        {
            "linear": lambda: axon4d.Linear(8, 8, dtype=torch.float16),
            "precision": lambda: Precision(compute=torch.float16),
        }
    )


def test_fp16_parameters_are_refused_on_every_rank_naming_bf16(pools):
    """fp16 has no loss scaling here, so its gradients would silently underflow: a layer of fp16
    parameters (or an fp16 compute dtype) is a ValueError on every rank that says what to use."""
    for msgs in pools(2).run((1, 2, 1, 1), _fp16_refusals):
        for msg in msgs.values():
            assert msg is not None and "torch.float16 is not supported" in msg
            assert "loss scaling" in msg and "torch.bfloat16" in msg and "bf16-fp32-reduce" in msg
