"""Protects the FP8 GEMMs of the 3D Linear (``precision="bf16-fp8"``, issue 44, docs/design.md §2
"FP8 GEMMs"). Start here when changing ``axon4d.options.fp8_gemm``, ``axon4d.device.fp8`` or the FP8 branch
of ``axon4d.nn.linear``. What must hold:

- the scaled GEMM is its dequantised reference: forward (with bias, bf16 out), dX (bf16) and dW
  (fp32, tokens zero-padded to 16) equal (âs_a)(b̂s_b)ᵀ computed in fp32 and rounded once — bit
  for bit on the host, whose ``_scaled_mm`` dequantises and multiplies in fp32;
- the scales: current, tensorwise, amax/448 (a power of two for weights); an all-zero block, fp32
  subnormals and values near fp32's largest give finite, non-zero scales and no NaN; an inf or NaN
  input stays non-finite (the step is skipped as in bf16, not hidden);
- the weight's e4m3 copy: made once per optimizer step (however many forwards, backwards and
  gathers read it), with one power-of-two scale its z ranks share, so the gathered bytes are the
  block quantised whole — bit for bit — and reach the GEMM as a view of the gather's result;
- one layer on grids with z > 1 (FP8 gathers) and x, y split: on every rank the layer's Y, dX and dW
  are the dequantised reference of the operands it quantised — the weight block taken as gathered —
  and within e4m3's rounding of the same layer under bf16-fp32-reduce; a layer whose local block is
  not a multiple of 16 runs in bf16 and says so;
- the preset is opt-in (``auto`` never becomes it) and is refused, clearly, on a device without FP8;
- the casts are few and priced as made: per micro-batch an FP8 layer issues at most twice the ops
  of the bf16 one (X and dY quantised once each, dW's layouts copied from those bytes), and the
  bytes and kernels of its casts are the planner's (``axon4d.plan.fp8.layer_cast_passes``);
- one rounding: a 16-bit operand's quotient is formed in fp32 and rounded once to e4m3;
- the fused cast (``axon4d.device.fp8_fused``, an accelerator's default, forced here on the host)
  gives the eager path's codes and scales bit for bit, is one op to a TorchDispatchMode, keeps the
  layer within twice bf16's kernels, and falls back to the eager path, once and logged, when it fails.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import math
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import axon4d
from axon4d import activations
from axon4d.config import ModelConfig, get_config
from axon4d.device import fp8 as kernel
from axon4d.device import fp8_fused
from axon4d.grid.shape import GridShape
from axon4d.options import fp8_gemm, fp8_rows
from axon4d.options.fp8_grouped import quantise_grouped
from axon4d.options.precision import FP8, NAMED, Precision, fp8_pack, fp8_scale, gradient_fp8, resolve
from axon4d.plan import fp8 as plan_fp8
from axon4d.plan.machine import load
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload

FP8_NAME, BF16_NAME = "bf16-fp8", "bf16-fp32-reduce"
U_FP8 = 2.0**-4  # e4m3's unit roundoff
U_GRAD = 2.0**-3  # e5m2's: the gradients' float8 by default


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# -- the scaled GEMM and its reference, one process ------------------------------------------------------
@pytest.mark.parametrize("tokens", [40, 16, 7])
def test_each_scaled_gemm_is_its_dequantised_reference(tokens):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64).bfloat16()  # (b, in)
    w = torch.randn(48, 64) * 0.05  # (out, in), fp32 master
    dy = (torch.randn(tokens, 48) * 1e-3).bfloat16()  # (b, out)
    bias = torch.randn(48).bfloat16()
    xq, wq, dyq = fp8_gemm.quantise(x), fp8_gemm.quantise(w, pow2=True), fp8_gemm.quantise(dy)
    assert xq.data.dtype == wq.data.dtype == dyq.data.dtype == FP8
    y = fp8_gemm.forward(xq, wq, bias, torch.bfloat16)
    assert torch.equal(y, fp8_gemm.reference(xq, wq, torch.bfloat16, bias))
    dx = fp8_gemm.grad_input(dyq, wq, torch.bfloat16)
    assert torch.equal(dx, (fp8_gemm.dequantise(dyq) @ fp8_gemm.dequantise(wq)).bfloat16())
    dy_t = fp8_gemm.quantise(dy, dyq.scale, transpose=True, pad_to=16)
    x_t = fp8_gemm.quantise(x, xq.scale, transpose=True, pad_to=16)
    assert dy_t.data.shape == (48, -(-tokens // 16) * 16) and (dy_t.data[:, tokens:].float() == 0).all()
    dw = torch.empty(48, 64)
    fp8_gemm.grad_weight(dy_t, x_t, dw)
    assert torch.equal(dw, fp8_gemm.dequantise(dyq).t() @ fp8_gemm.dequantise(xq))  # padding adds nothing
    # and FP8 did act: within e4m3's rounding of the bf16 GEMM, but not equal to it
    ref = x.float() @ w.bfloat16().float().t() + bias.float()
    assert 2.0**-9 < _rel(y.float(), ref) < U_FP8


def test_a_16_bit_operand_is_rounded_once_to_fp8():
    """The quotient t/s is formed in fp32 and rounded once to e4m3: rounding it to bf16 first (what
    dividing a bf16 tensor by a () fp32 scale does) changes a few percent of the codes."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(64, 256, generator=g).bfloat16()  # (r, c)
    q = fp8_gemm.quantise(t)  # current scale: amax/448, not a power of two
    once = (t.float() / q.scale).clamp(-448, 448).to(FP8)
    twice = torch.div(t, q.scale).clamp(-448, 448).to(FP8)  # the bf16 quotient
    assert torch.equal(q.data.view(torch.uint8), once.view(torch.uint8))
    assert (twice.view(torch.uint8) != once.view(torch.uint8)).float().mean() > 0.01  # the test can tell them apart
    q_t = fp8_gemm.quantise(t, q.scale, transpose=True, pad_to=16)
    assert torch.equal(q_t.data.view(torch.uint8), once.t().contiguous().view(torch.uint8))


def test_scales_are_current_tensorwise_and_safe_for_zero_tiny_huge_and_non_finite_blocks():
    t = torch.tensor([[3.0, -7.0], [0.5, 1.0]])
    assert fp8_gemm.quantise(t).scale.item() == pytest.approx(7.0 / 448)
    assert fp8_gemm.quantise(t, pow2=True).scale.item() == 2.0**-6  # 7/448 = 2⁻⁶ exactly
    assert fp8_gemm.quantise(t * 1.01, pow2=True).scale.item() == 2.0**-5
    for name, block in {
        "zeros": torch.zeros(16, 16),
        "fp32 subnormals": torch.full((16, 16), 1e-42),
        "near fp32's largest": torch.full((16, 16), 3e38),
    }.items():
        for pow2 in (False, True):
            q = fp8_gemm.quantise(block, pow2=pow2)
            assert torch.isfinite(q.scale) and q.scale > 0, (name, pow2)
            y = fp8_gemm.forward(q, fp8_gemm.quantise(torch.eye(16) * 1e-38), None, torch.float32)
            assert not torch.isnan(y).any(), (name, pow2)
            assert torch.equal(fp8_gemm.dequantise(q) == 0, block == 0) or name == "fp32 subnormals", name
    assert (fp8_gemm.dequantise(fp8_gemm.quantise(torch.zeros(4, 4))) == 0).all()
    for bad in (float("inf"), float("nan")):  # not hidden: the result is non-finite, as in bf16
        block = torch.ones(16, 16)
        block[3, 5] = bad
        q = fp8_gemm.quantise(block)
        assert not torch.isfinite(q.scale)
        assert not torch.isfinite(fp8_gemm.forward(q, fp8_gemm.quantise(torch.eye(16)), None, torch.float32)).all()
    assert fp8_scale(torch.tensor(0.0), pow2=True).item() == 2.0**-126  # never above a real shard's


def test_the_preset_is_opt_in_and_validated():
    p = Precision.parse(FP8_NAME)
    assert (p.param, p.compute, p.reduce, p.gather, p.gemm) == (torch.float32, torch.bfloat16, torch.float32, FP8, FP8)
    assert resolve("auto", accelerator=True) == BF16_NAME and resolve(FP8_NAME, accelerator=True) == FP8_NAME
    assert all(p.gemm is None for n, p in NAMED.items() if n != FP8_NAME)
    with pytest.raises(ValueError, match=r"gemm=torch.bfloat16.*gemm=None.*float8_e4m3fn"):
        Precision(compute=torch.bfloat16, gemm=torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute=torch.float32, reduce=torch.float32: FP8 GEMMs run beside"):
        Precision(gemm=FP8)


def test_a_device_without_fp8_tensor_cores_is_refused(monkeypatch):
    assert kernel.gemm_available(torch.device("cpu"))
    assert not kernel.gemm_available(torch.device("meta"))
    with pytest.raises(RuntimeError, match=r"has no FP8 tensor cores .*use bf16-fp8-gather or bf16-fp32-reduce"):
        kernel.check_gemm(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert not kernel.gemm_available(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert kernel.gemm_available(torch.device("cuda", 0))


def test_one_rank_layer_runs_the_same_fp8_gemms():
    """A grid of one rank (``LocalLinear``): Y, dX and dW are the dequantised reference, bias included."""
    axon4d.init((1, 1, 1, 1), precision=FP8_NAME)
    try:
        torch.manual_seed(1)
        layer = axon4d.Linear(64, 32)
        x = torch.randn(3, 5, 64, requires_grad=True)
        dy = torch.randn(3, 5, 32).bfloat16()
        y = layer(x)
        y.backward(dy)
        xq = fp8_gemm.quantise(x.detach().bfloat16().view(15, 64))
        wq = fp8_gemm.quantise(layer.weight.detach().view(32, 64), pow2=True)
        dyq = fp8_gemm.quantise(dy.view(15, 32), dtype=torch.float8_e5m2)  # the gradients' default format
        assert layer.fp8_gemms
        assert torch.equal(y.view(15, 32), fp8_gemm.reference(xq, wq, torch.bfloat16, layer.bias.detach().bfloat16()))
        assert torch.equal(x.grad.view(15, 64), (fp8_gemm.dequantise(dyq) @ fp8_gemm.dequantise(wq)).bfloat16().float())
        dw = fp8_gemm.dequantise(dyq).t() @ fp8_gemm.dequantise(xq)
        assert torch.equal(layer.weight.grad, dw.view(-1))
    finally:
        axon4d.shutdown()


# -- one layer on grids with z > 1 (FP8 gathers) and x, y split ------------------------------------------
TOKENS = 12  # per rank not a multiple of 16: dW's token dim is padded
#: (in, out, transpose): local blocks multiples of 16 on every grid below
LAYERS = [(64, 96, False), (96, 64, True)]
GRIDS = [(1, 1, 2, 1), (1, 1, 4, 1), (2, 1, 2, 1), (1, 2, 2, 1), pytest.param((2, 2, 2, 1), marks=pytest.mark.slow)]


def _layer_run(grid, in_f, out_f, transpose):
    """One forward and backward of a seeded Linear with a fixed dY: this rank's Y, dX, dW shard,
    and — under FP8 GEMMs — the same three from the dequantised reference of the operands the
    layer quantised (its weight block gathered as the layer gathers it), reduced as the layer
    reduces them."""
    torch.manual_seed(11)
    layer = axon4d.Linear(in_f, out_f, bias=True, transpose=transpose)
    x = torch.randn(TOKENS * grid.size("batch"), in_f)
    dy = torch.randn(TOKENS * grid.size("batch"), out_f)
    xs = axon4d.shard_input(x, transpose=transpose).requires_grad_()
    dys = activations.shard_features(axon4d.shard_batch(dy), layer.out_axis).bfloat16()
    y = layer(xs)
    y.backward(dys)
    out = {"Y": y.detach().float(), "dX": xs.grad.float(), "dW": layer.weight.grad.clone(), "fp8": layer.fp8_gemms}
    if layer.fp8_gemms:
        comm = grid.comm
        wq = grid.scheduler.gather_weight(layer, layer.weight, backward=False, fp8=True)
        xq, dyq = fp8_gemm.quantise(xs.detach().bfloat16()), fp8_gemm.quantise(dys, dtype=gradient_fp8(grid.precision))
        first = grid.coord(layer.in_axis) == 0
        y_ref = fp8_gemm.reference(xq, wq, torch.bfloat16, layer.bias.detach().bfloat16() if first else None)
        dx_ref = (fp8_gemm.dequantise(dyq) @ fp8_gemm.dequantise(wq)).bfloat16()
        dw_ref = (fp8_gemm.dequantise(dyq).t() @ fp8_gemm.dequantise(xq)).reshape(-1)
        out["Y ref"] = comm.all_reduce(y_ref, layer.in_axis).wait().float()
        out["dX ref"] = comm.all_reduce(dx_ref, layer.out_axis).wait().float()
        padded = torch.zeros(layer.shard_numel * grid.size("z"))
        padded[: dw_ref.numel()] = dw_ref
        shard = comm.reduce_scatter(padded, "z").wait()
        out["dW ref"] = comm.all_reduce(shard, "data").wait() / grid.size("batch")
    return out


def _layer_runs(grid):
    return [_layer_run(grid, *layer) for layer in LAYERS]


@pytest.mark.parametrize("grid", GRIDS)
def test_one_layer_is_its_dequantised_reference_and_close_to_bf16(pools, grid):
    world = math.prod(grid)
    fp8 = pools(world).run(grid, _layer_runs, precision=FP8_NAME)
    bf16 = pools(world).run(grid, _layer_runs, precision=BF16_NAME)
    for i, layer in enumerate(LAYERS):
        a, b = [rank[i] for rank in fp8], [rank[i] for rank in bf16]
        for r in a:
            assert r["fp8"], layer
            for name in ("Y", "dX", "dW"):  # the gathered e4m3 block, used as gathered, in the GEMM
                assert torch.equal(r[name], r[f"{name} ref"]), (grid, layer, name)
        for name in ("Y", "dX", "dW"):  # over all ranks
            diff = math.sqrt(sum(float((p[name].double() - q[name].double()).square().sum()) for p, q in zip(a, b)))
            ref = math.sqrt(sum(float(q[name].double().square().sum()) for q in b))
            bound = U_FP8 if name == "Y" else U_GRAD  # dX and dW multiply dY in e5m2
            assert 2.0**-9 < diff / ref < bound, (grid, layer, name, diff / ref)


def _copies_per_step(grid):
    """Three micro-batches, an optimizer step, two more: how many e4m3 weight copies were
    made after each phase; whether the forward's block was a view of E10f's result and equal, bit
    for bit, to the whole fp32 block quantised at once."""
    torch.manual_seed(5)
    layers = [axon4d.Linear(64, 96, bias=False), axon4d.Linear(96, 64, bias=False, transpose=True)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    gathered: list[torch.Tensor] = []
    issue = grid.comm.all_gather

    def recording(tensor, axis, dim=0, tag=""):
        handle = issue(tensor, axis, dim, tag)
        if tag == "E10f":
            gathered.append(handle.buffer)
        return handle

    grid.comm.all_gather = recording
    made = []

    def run(steps):  # micro-batches of one step: all but the last accumulating
        for i in range(steps):
            x = torch.randn(TOKENS * grid.size("batch"), 64, generator=torch.Generator().manual_seed(i))
            xs = axon4d.shard_input(x).requires_grad_()
            with grid.scheduler.accumulating() if i + 1 < steps else contextlib.nullcontext():
                layers[1](layers[0](xs)).float().square().sum().backward()
        made.append(grid.scheduler.fp8_copies_made)

    run(3)
    opt.step()
    run(2)
    block = grid.scheduler.gather_weight(layers[0], layers[0].weight, backward=False, fp8=True)
    grid.comm.all_gather = issue
    whole = fp8_gemm.quantise(layers[0].weight_block().float(), pow2=True)
    # the last gathers: layer 0's, then the one OAG prefetches after it
    view = any(block.data.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() for g in gathered[-2:])
    return {
        "made": made,
        "equal": torch.equal(block.data.view(torch.uint8), whole.data.view(torch.uint8))
        and bool(block.scale == whole.scale),
        "view": grid.size("z") == 1 or view,
    }


@pytest.mark.parametrize("grid", [(1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 1, 2)])
def test_the_weight_is_quantised_once_per_step_and_its_gathered_bytes_are_the_block(pools, grid):
    for r in pools(math.prod(grid)).run(grid, _copies_per_step, precision=FP8_NAME):
        assert r["made"] == [2, 4], r  # two layers: once each before the step, once each after
        assert r["equal"], r
        assert r["view"], r


def _one_rank_copies(grid):
    """A layer on a grid of one rank (``LocalLinear``) under FP8 GEMMs: the weight copies three
    micro-batches make, counted where they are made (``fp8_gemm.cast_weight``)."""
    made = []
    cast_weight = fp8_gemm.cast_weight
    fp8_gemm.cast_weight = lambda t, scale, dtype=fp8_gemm.DTYPE: made.append(t.shape) or cast_weight(t, scale, dtype)
    try:
        layer = axon4d.Linear(64, 32, bias=False)
        for i in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).requires_grad_()
            with grid.scheduler.accumulating() if i < 2 else contextlib.nullcontext():
                layer(x).float().square().sum().backward()
    finally:
        fp8_gemm.cast_weight = cast_weight
    return len(made)


def test_a_one_rank_grid_copies_the_weight_each_forward_as_the_planner_prices_it(pools):
    """A grid of one rank makes the weight's e4m3 copy in each forward (three micro-batches: three
    copies), a larger grid once per step: ``plan.fp8.weight_copies_per_run`` prices each so."""
    assert pools(1).run((1, 1, 1, 1), _one_rank_copies, precision=FP8_NAME) == [3]
    wl = Workload(get_config("20B"), 64, precision=FP8_NAME)
    one, four = (Scenario(wl, GridShape(*g), load("h100"), micro_batches=4) for g in ((1, 1, 1, 1), (1, 2, 2, 1)))
    assert plan_fp8.weight_copies_per_run(one) == 1.0 and plan_fp8.weight_copies_per_run(four) == 0.25


def _recomputed(grid):
    """A small Llama under FP8 GEMMs, one step with and one without full recomputation (OAG on): the
    loss, the flat gradient and the e4m3 copies made in each."""
    from axon4d.models.transformer import DenseTransformer, Transformer

    cfg = ModelConfig(
        n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
    )
    torch.manual_seed(5)
    dense = DenseTransformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2 * grid.size("batch"), cfg.seq_len + 1), generator=torch.Generator())
    out = {}
    for recompute in ("none", "full"):
        model = Transformer.from_dense(dense, recompute=recompute)
        before = grid.scheduler.fp8_copies_made
        model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.to_dense(grads=True).parameters()])
        out[recompute] = (grads, grid.scheduler.fp8_copies_made - before)
    return out


def test_full_recomputation_reuses_the_step_s_e4m3_copies(pools):
    """Full recomputation's backward reads a weight through the saved tensor checkpoint hands back
    (another object, the same storage): it gathers the copy made in the forward — no second copy,
    no second scale — and the gradients are those of the step without recomputation, bit for bit
    (a KeyError in the scheduler before)."""
    for r in pools(4).run((2, 1, 2, 1), _recomputed, precision=FP8_NAME):
        assert torch.equal(r["full"][0], r["none"][0])
        assert r["full"][1] == r["none"][1] > 0


#: the fused cast's one op (``axon4d.device.fp8_fused``), and the kernels inductor makes of it on the host
FUSED_OP, FUSED_KERNELS = "fp8_quantise", 3
#: the ops FP8's casts are made of (under bf16-fp8 nothing else issues them in a layer's micro-batch)
#: the fused transposition's one op (dW's layouts and Ŵᵀ on the fused path)
FUSED_TRANSPOSE = "fp8_transpose"
CAST_OPS = {"linalg_vector_norm", "div", "clamp", "_to_copy", "copy_", "zero_", "clone", FUSED_OP, FUSED_TRANSPOSE}


class _Kernels(TorchDispatchMode):
    """Counts the ATen ops that launch work (views and aliases excluded) by name, and the bytes the
    cast ops read and write: each tensor argument and result once (an in-place op's result is its
    first argument: ``copy_`` reads its source and writes its destination, ``zero_`` only writes)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.cast_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "promote_types"):
            return out
        self.ops[name] += 1
        if name in CAST_OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name == "zero_":
                self.cast_bytes += tensors[0].nbytes
            elif name == "copy_":
                self.cast_bytes += tensors[0].nbytes + tensors[1].nbytes
            else:
                outs = out if isinstance(out, tuple) else (out,)  # the fused cast returns (q, scale)
                self.cast_bytes += sum(t.nbytes for t in tensors) + sum(o.nbytes for o in outs)
        return out


def _kernels_per_micro_batch(grid, tokens, cast="eager"):
    """The ops one layer's forward and backward issue on this rank, after a first micro-batch made
    the step's weight copies (what is counted once per step is not counted here), with the casts'
    path ``cast`` (``axon4d.device.fp8_fused.set_mode``)."""
    fp8_fused.set_mode(cast)
    try:
        torch.manual_seed(2)
        layer = axon4d.Linear(256, 512, bias=False)
        x = torch.randn(tokens * grid.size("batch"), 256, generator=torch.Generator().manual_seed(3))
        xs = axon4d.shard_input(x).bfloat16().requires_grad_()
        dy = torch.randn(xs.shape[0], layer.block_shape[0], generator=torch.Generator().manual_seed(4)).bfloat16()
        with grid.scheduler.accumulating():
            layer(xs).backward(dy)
            count = _Kernels()
            with count:
                layer(xs).backward(dy)
        assert fp8_fused.failure() is None, fp8_fused.failure()
    finally:
        fp8_fused.set_mode(None)
    return dict(count.ops), count.cast_bytes, xs.shape[0]


@pytest.mark.parametrize("cast", ["eager", pytest.param("fused", marks=pytest.mark.slow)])  # fused: a compile
@pytest.mark.parametrize("tokens", [64, 40])
def test_an_fp8_layer_issues_at_most_twice_the_kernels_of_bf16(pools, tokens, cast):
    """Per micro-batch, after the step's weight copy: X and dY quantised once each (amax, scale,
    divide, cast — eager, or the fused cast, one op ``axon4d::fp8_quantise`` whose kernels inductor
    counts: ``FUSED_KERNELS``), their transposed layouts copied from those bytes, Ŵᵀ laid out for
    dX, and three scaled GEMMs — at most twice bf16's kernels (with 40 tokens, a multiple of 16 only
    after padding, two fills more)."""
    grid = (1, 1, 2, 1)
    fp8, cast_bytes, b = pools(2).run(grid, _kernels_per_micro_batch, tokens, cast, precision=FP8_NAME)[0]
    bf16 = pools(2).run(grid, _kernels_per_micro_batch, tokens, precision=BF16_NAME)[0][0]
    n_bf16 = sum(bf16.values())
    fused = cast == "fused"
    # the fused op stands for its compiled kernels (on the host: one C++ kernel of FUSED_KERNELS loops)
    n_fp8 = sum(fp8.values()) + (FUSED_KERNELS - 1) * fp8.get(FUSED_OP, 0)
    assert fp8.get(FUSED_TRANSPOSE, 0) == (3 if fused else 0), fp8  # X̂ᵀ, dŶᵀ, Ŵᵀ: one tiled kernel each
    assert fp8.get("_scaled_mm") == 3, fp8
    assert (fp8.get(FUSED_OP, 0), fp8.get("linalg_vector_norm", 0)) == ((2, 0) if fused else (0, 2)), fp8  # X, dY
    assert n_fp8 <= 2 * n_bf16, (n_fp8, n_bf16, fp8, bf16)
    # the planner prices these passes (axon4d.plan.fp8): its bytes are the code's, its kernels too
    priced_bytes, priced_kernels = plan_fp8.layer_cast_passes(256, 512, b, 2, fused=fused)
    if fused:  # counted at the op: t read and q written; the planner adds the amax's read of t
        cast_bytes += 2 * b * (256 + 512)
    assert priced_bytes <= cast_bytes <= priced_bytes + 64, (cast_bytes, priced_bytes)  # + the scalars' bytes
    counted = sum(n for op, n in fp8.items() if op in CAST_OPS | {"empty"}) - 1  # - dW's buffer
    # priced for an accelerator: inductor's Triton reduction, then scale and cast (2 kernels a cast)
    assert priced_kernels == counted + (2 - 1) * fp8.get(FUSED_OP, 0), fp8


def _fp8_job(out_dir, fp8_gradients):
    """Three steps of the training job under bf16-fp8: its summary, log records and banner."""
    from axon4d.train import TrainConfig, train

    cfg = dict(model="tiny", layers=1, hidden=64, heads=4, vocab_size=64, seq_len=16, batch_size=8, steps=3)
    cfg.update(grid="1,1,2,1", precision=FP8_NAME, fp8_gradients=fp8_gradients, out_dir=out_dir, progress=False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train(TrainConfig(**cfg, warmup_steps=1, peak_tflops=1.0))
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return summary, records, printed.getvalue()


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_the_job_runs_the_gradients_float8_and_logs_its_underflow(pools, tmp_path, fmt):
    """--fp8-gradients picks dY's float8 (e5m2 by default); each logged step records, per layer kind,
    the share of dY's non-zero entries it flushed to zero, summed over ranks and blocks."""
    summary, records, printed = pools(2).run(None, _fp8_job, str(tmp_path), fmt)[0]
    assert f"precision bf16-fp8 (gradients {fmt})" in printed
    kinds = {"blocks.*.attn.qkv", "blocks.*.attn.out", "blocks.*.mlp.up", "blocks.*.mlp.down"}
    for rec in records:
        assert set(rec["fp8_underflow"]) == kinds and all(0 <= v < 1 for v in rec["fp8_underflow"].values()), rec
    assert summary["fp8_underflow"] == records[-1]["fp8_underflow"] and summary["fp8_gradients"] == fmt
    # every layer kind's GEMM precision, and why a kind is not FP8, in summary.json and the banner
    assert summary["gemm_precision"] == {**dict.fromkeys(kinds, "fp8"), "head": "bf16 (the LM head)"}
    assert "GEMMs: fp8: blocks.*.attn.qkv, blocks.*.attn.out, blocks.*.mlp.up, blocks.*.mlp.down; " in printed
    assert "bf16 (the LM head): head" in printed
    from axon4d.train import TrainConfig

    with pytest.raises(ValueError, match="--fp8-gradients e4m3 with --precision bf16-fp32-reduce"):
        TrainConfig(model="tiny", precision="bf16-fp32-reduce", fp8_gradients="e4m3").check()


def _kept_in_bf16(grid):
    """A layer kept in bf16 (``fp8_gemms = False``): its output and gradients, and E10f's bytes."""
    torch.manual_seed(7)
    layer = axon4d.Linear(64, 96, bias=False)
    layer.fp8_gemms = False
    x = torch.randn(TOKENS * grid.size("batch"), 64, generator=torch.Generator().manual_seed(8))
    xs = axon4d.shard_input(x).requires_grad_()
    grid.comm.log.clear()
    y = layer(xs)
    y.float().square().sum().backward()
    gathered = sum(r.payload_bytes for r in grid.comm.log.records if r.tag == "E10f")
    return y.detach().float(), layer.weight.grad.clone(), gathered, layer.shard_numel


def test_a_layer_kept_in_bf16_under_fp8_gemms_is_bf16_exactly(pools):
    """Under bf16-fp8 a layer whose GEMMs stay in bf16 (the LM head, --bf16-layers, a block not a
    multiple of 16) gathers its weight in bf16, never e4m3-rounded: it computes what bf16-fp32-reduce does."""
    fp8 = pools(2).run((1, 1, 2, 1), _kept_in_bf16, precision=FP8_NAME)
    bf16 = pools(2).run((1, 1, 2, 1), _kept_in_bf16, precision=BF16_NAME)
    for a, b in zip(fp8, bf16):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert a[2] == b[2] == 2 * 2 * a[3]  # G_z · n bf16 elements


def _fp8_step_then_save(grid, path):
    """A step of a small Llama with FP8 GEMMs (``bf16-fp8``), saved: the fp32 masters' sum."""
    from axon4d import checkpoint
    from axon4d.config import ModelConfig
    from axon4d.models.transformer import Transformer
    from axon4d.train.batches import accumulate

    cfg = ModelConfig(n_layers=1, hidden=64, n_heads=4, ffn_hidden=128, vocab_size=64, seq_len=16, arch="llama")
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert any(layer.fp8_gemms for layer in model.blocks[0].linears())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    accumulate(model, [ids], grid)
    opt.step()
    checkpoint.save(path, model, grid, opt, step=1, overwrite=True)
    return {n: p.detach().double().sum().item() for n, p in model.to_dense().named_parameters()}


def _resume_in_bf16(grid, path):
    """The same model in ``bf16-fp32-reduce`` loaded from the ``bf16-fp8`` checkpoint, and a step of it."""
    from axon4d import checkpoint
    from axon4d.config import ModelConfig
    from axon4d.models.transformer import Transformer
    from axon4d.train.batches import accumulate

    cfg = ModelConfig(n_layers=1, hidden=64, n_heads=4, ffn_hidden=128, vocab_size=64, seq_len=16, arch="llama")
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(path, model, grid, opt)
    sums = {n: p.detach().double().sum().item() for n, p in model.to_dense().named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(2))
    loss = float(accumulate(model, [ids], grid))
    return sums, loss, not any(layer.fp8_gemms for layer in model.blocks[0].linears())


def test_a_bf16_run_resumes_from_an_fp8_gemm_checkpoint(pools, tmp_path):
    """No FP8 state is saved: a checkpoint of a ``bf16-fp8`` run loads into ``bf16-fp32-reduce`` on
    another grid, the same fp32 masters, and trains on."""
    path = str(tmp_path / "fp8")
    saved = pools(2).run((1, 1, 2, 1), _fp8_step_then_save, path, precision="bf16-fp8")[0]
    for sums, loss, bf16 in pools(2).run((2, 1, 1, 1), _resume_in_bf16, path, precision="bf16-fp32-reduce"):
        assert bf16 and math.isfinite(loss)
        assert sums.keys() == saved.keys()
        assert all(abs(sums[n] - saved[n]) <= 1e-9 * max(1.0, abs(saved[n])) for n in saved), (sums, saved)


# -- the fused cast (axon4d.device.fp8_fused): the eager path's bits, one op, few kernels, a fallback ----
def _bf16_cases():
    """bf16 tensors the casts must agree on: token counts that vary (one compiled graph serves them),
    columns spanning 2⁻¹⁰⁰…2¹⁰⁰, all zeros, subnormals only, and an inf and a NaN."""
    g = torch.Generator().manual_seed(5)
    spread = torch.logspace(-100, 100, 256, base=2.0)
    cases = [(torch.randn(n, 256, generator=g) * spread).bfloat16() for n in (64, 40, 7)]
    cases += [torch.zeros(16, 32, dtype=torch.bfloat16), torch.full((16, 32), 1e-40).bfloat16()]
    for bad in (math.inf, math.nan):
        t = torch.randn(16, 32, generator=g).bfloat16()
        t[3, 3] = bad
        cases.append(t)
    return cases


@pytest.fixture
def cast_mode():
    """Restores the cast path and the fused path's state after a test that sets them."""
    yield fp8_fused.set_mode
    fp8_fused.set_mode(None)
    fp8_fused._State.failure = None


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_fused_cast_is_the_eager_one_bit_for_bit_in_one_op(cast_mode, fmt):
    """Forced on the host (``set_mode("fused")``; ``auto`` keeps the host eager): codes and scales
    equal the eager path's for every case (a NaN scale makes every code NaN on both paths); a
    TorchDispatchMode sees one op, ``axon4d::fp8_quantise``, run compiled inside it."""
    assert not fp8_fused.wanted(torch.device("cpu"))  # the host's default: eager
    assert fp8_fused._division_rounding()  # this torch can make Triton's division eager's
    cast_mode("fused")
    assert fp8_fused.wanted(torch.device("cpu"))
    for t in _bf16_cases():
        cast_mode("eager")
        eager = fp8_gemm.quantise(t, dtype=fmt)
        cast_mode("fused")
        count = _Kernels()
        with count:
            fused = fp8_gemm.quantise(t, dtype=fmt)
        assert set(count.ops) == {FUSED_OP}, count.ops
        assert count.ops[FUSED_OP] == 1 and fused.data.is_contiguous() and fused.data.dtype == fmt
        if eager.scale.isnan():
            assert fused.scale.isnan() and fused.data.float().isnan().all() and eager.data.float().isnan().all()
            continue
        assert torch.equal(fused.scale, eager.scale), (fused.scale, eager.scale)
        assert torch.equal(fused.data.view(torch.uint8), eager.data.view(torch.uint8)), t
    assert fp8_fused.failure() is None


class _ShardBytes(TorchDispatchMode):
    """The bytes ops move over tensors of at least ``n`` elements (each argument read, each result
    written once), and the ops' names: a weight shard's passes, its scale's scalar ops left out."""

    def __init__(self, n):
        super().__init__()
        self.n, self.bytes, self.ops = n, 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        big = [t for t in (*args, *(out if isinstance(out, tuple) else (out,))) if isinstance(t, torch.Tensor)]
        big = [t for t in big if t.numel() >= self.n]
        if big and not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
            self.bytes += sum(t.nbytes for t in big)
        return out


@pytest.mark.parametrize("cast", ["eager", "fused"])
def test_the_weight_copy_reads_the_master_twice_as_priced(cast_mode, cast):
    """The e4m3 copy of an fp32 master shard (``fp8_copies.fp8_shard``: its amax, its power-of-two
    scale, ``fp8_gemm.cast_weight``): the amax then one cast — fused, one op (9 bytes per element),
    eager, the division and the cast (17) — the planner's ``weight_copy_passes``; the codes are the
    same bit for bit on both paths (the scale a power of two, the quotient exact), within e4m3's
    range without a clamp, and a shard holding inf or NaN stays non-finite."""
    g = torch.Generator().manual_seed(7)
    shards = [(torch.randn(48, 64, generator=g) * torch.logspace(-3, 3, 64)).reshape(-1) for _ in range(2)]
    shards += [torch.zeros(3072), torch.full((3072,), 1e-40)]
    for bad in (math.inf, math.nan):
        shards.append(torch.randn(3072, generator=g))
        shards[-1][5] = bad
    for flat in shards:
        cast_mode("eager")
        expected = fp8_gemm.cast_weight(flat, fp8_scale(fp8_gemm.amax(flat), pow2=True))
        cast_mode(cast)
        count = _ShardBytes(flat.numel())
        with count:
            scale = fp8_scale(fp8_gemm.amax(flat), pow2=True)
            got = fp8_gemm.cast_weight(flat, scale)
        fused_ops = {"linalg_vector_norm": 1, "fp8_cast_scaled": 1}
        assert dict(count.ops) == (fused_ops if cast == "fused" else {"linalg_vector_norm": 1, "div": 1, "_to_copy": 1})
        assert count.bytes == plan_fp8.weight_copy_passes(flat.numel(), fused=cast == "fused"), count.bytes
        assert got.dtype == fp8_gemm.DTYPE and got.shape == flat.shape
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        if torch.isfinite(flat).all():
            back = got.float() * scale
            assert torch.isfinite(back).all() and ((back - flat).abs() <= flat.abs() * 2**-4 + scale * 2**-9).all()
        else:
            assert not torch.isfinite(got.float()).all()
    assert fp8_fused.failure() is None


def test_outside_a_dispatch_mode_the_fused_cast_calls_its_compiled_function_directly(cast_mode, monkeypatch):
    """The training step (no ``TorchDispatchMode``, nothing compiling around it, no gradient wanted)
    skips the custom op's dispatch; under a mode the one op runs; both give the same bits."""
    calls = []
    real = fp8_fused._op
    monkeypatch.setattr(fp8_fused, "_op", lambda *a: calls.append(a) or real(*a))
    cast_mode("fused")
    t = _bf16_cases()[0]
    direct = fp8_gemm.quantise(t)
    assert calls == []
    count = _Kernels()
    with count:
        via_op = fp8_gemm.quantise(t)
    assert len(calls) == 1 and dict(count.ops) == {FUSED_OP: 1}
    assert torch.equal(direct.data.view(torch.uint8), via_op.data.view(torch.uint8))
    assert torch.equal(direct.scale, via_op.scale) and fp8_fused.failure() is None


@pytest.mark.parametrize("rows", [64, 40, 7])
def test_the_fused_transposition_lays_out_the_eager_bytes(cast_mode, rows):
    """``fp8_gemm.transposed`` forced fused on the host (one op, ``axon4d::fp8_transpose``): the
    bytes of the eager strided copy, padding zeros included, in both float8 formats."""
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = fp8_gemm.quantise(_bf16_cases()[0][:rows].contiguous(), dtype=fmt)
        cast_mode("eager")
        eager = fp8_gemm.transposed(q, kernel.ALIGN)
        cast_mode("fused")
        count = _Kernels()
        with count:
            fused = fp8_gemm.transposed(q, kernel.ALIGN)
        assert dict(count.ops) == {FUSED_TRANSPOSE: 1}, count.ops
        assert fused.data.dtype == fmt and fused.data.shape == eager.data.shape == (256, -(-rows // 16) * 16)
        assert torch.equal(fused.data.view(torch.uint8), eager.data.view(torch.uint8)) and fused.scale is q.scale
    assert fp8_fused.failure() is None


@pytest.mark.slow
def test_inductor_makes_few_kernels_of_the_fused_cast(cast_mode):
    """The kernels of the fused cast, counted where inductor compiles it afresh (no cached graph; some
    15 s on a 2-core host): on the host one C++ kernel of ``FUSED_KERNELS`` loops (amax, scale,
    cast); on an accelerator inductor emits a Triton reduction, then scale and cast — the two the
    planner prices (not counted here: no accelerator)."""
    from torch._inductor import config, metrics

    cast_mode("fused")
    torch._dynamo.reset()
    metrics.reset()
    with config.patch(fx_graph_cache=False):
        fp8_gemm.quantise(_bf16_cases()[0])
    assert metrics.generated_kernel_count == FUSED_KERNELS, metrics.generated_kernel_count
    assert fp8_fused.failure() is None


def test_a_failing_compile_falls_back_to_the_eager_path_once(cast_mode, monkeypatch, caplog):
    """Compiling (or running) the fused cast raises: the cast is the eager one, the failure is logged
    once and remembered, and the fused path is not tried again in this process; a wrong mode is refused."""
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fp8_fused._State, "compiled", broken)
    cast_mode("fused")
    t = _bf16_cases()[1]
    with caplog.at_level("WARNING", logger=fp8_fused.__name__):
        got = [fp8_gemm.quantise(t) for _ in range(3)]
    assert len(calls) == 1 and "no compiler" in (fp8_fused.failure() or "")
    assert sum("fused FP8 cast failed" in r.getMessage() for r in caplog.records) == 1
    assert not fp8_fused.wanted(torch.device("cpu"))
    cast_mode("eager")
    expected = fp8_gemm.quantise(t)
    assert all(torch.equal(q.data.view(torch.uint8), expected.data.view(torch.uint8)) for q in got)
    with pytest.raises(ValueError, match="expected one of auto, fused, eager"):
        cast_mode("triton")
    monkeypatch.setenv(fp8_fused.ENV, "fast")
    cast_mode(None)
    with pytest.raises(ValueError, match=fp8_fused.ENV):
        fp8_fused.mode()


class _DivisionsByANumber(TorchFunctionMode):
    """Every division of a floating tensor by a Python number seen while active: on CUDA, ATen
    computes it as a product with the number's reciprocal (not the correctly rounded quotient)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if "div" in name and len(args) > 1 and isinstance(args[1], (int, float)):
            if isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                self.seen.append((name, args[1]))
        return func(*args, **(kwargs or {}))


def test_every_fp8_scale_is_the_correctly_rounded_quotient_on_every_path(cast_mode):
    """Each FP8 scale is amax/fmax rounded once (fp32), as the fused casts compute it: no eager path
    divides by fmax given as a Python number, which CUDA would compute as amax·(1/448) — an ulp off
    for some amaxes, so the eager and fused paths' scales and codes differed on an H200. Checked by
    watching the divisions of every cast (per tensor, pow2, per group, per block of rows, the gather's
    pack) and by the bits of the scales against the quotient in float64 rounded to fp32."""
    cast_mode("eager")
    g = torch.Generator().manual_seed(3)
    t = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 256)
    watch = _DivisionsByANumber()
    with watch:
        q = fp8_gemm.quantise(t)
        w = fp8_gemm.quantise(t, pow2=True)
        grouped_q = quantise_grouped(t, [16, 0, 48])
        packed = fp8_rows.pack(t.bfloat16())
        shard = fp8_pack(t.reshape(-1))
    assert watch.seen == [], watch.seen
    amax = t.abs().amax()
    assert torch.equal(q.scale, (amax.double() / 448).float())
    assert w.scale.item() == 2.0 ** math.ceil(math.log2((amax.double() / 448).item()))
    amaxes = torch.stack([t[:16].abs().amax(), torch.tensor(0.0), t[16:].abs().amax()])
    expect = (amaxes.double() / 448).float().clamp(min=torch.finfo(torch.float32).tiny)
    assert torch.equal(grouped_q.scale, expect)
    blocks = t.bfloat16().float().view(64, 2, 128).abs().amax(-1)  # (64, 2)
    scales = packed[:, 256:264].clone().view(torch.float32)  # (64, 2)
    assert torch.equal(scales, (blocks.double() / 448).float())
    assert torch.equal(shard[-4:].clone().view(torch.float32)[0], (amax.double() / 448).float())
