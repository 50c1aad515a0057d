"""The linear layer on a grid of one rank: Y = X Wᵀ + b as ``torch.nn.Linear`` computes it, in the
grid's compute dtype (docs/design.md §2 with every G = 1: E8–E13 move nothing).

``axon4d.Linear`` runs ``LocalLinear`` there: the forward is one ``addmm`` (``F.linear``) and the
backward the two matmuls and the sum of ``torch.nn.Linear``'s; gradients are cast to the reduction
and then the parameter dtype as the 3D path casts them. No scheduler work, no comm log, no
collective (``bench/overhead.py``).

Mixed precision (fp32 master weights, bf16 compute; axon4d.options.precision): the weight is cast to the
compute dtype once per forward and the backward's dX GEMM multiplies by that same copy, as
``torch.autocast`` does (its cast is cached for the forward and the matmul saves the bf16 copy for
backward). The copy costs the weight's elements in the compute dtype — 2 bytes each in bf16, half
the fp32 master — from the layer's forward to its backward, which frees it after the dX GEMM (before
the dW GEMM); a forward whose input needs no gradient keeps none. It is held on the autograd context, not saved,
so saved-tensor hooks (activation offload, axon4d.memory.offload) never see it: a weight's copy is not an
activation. Under full recomputation (``Scheduler.recomputing``) it is saved through autograd
instead, so it is dropped with the block's tensors and made again by the re-run forward. Where the
dtypes already match (fp32, pure bf16) the block is a view of the weight: no copy at all. Each
forward casts the weight as it is then, so an optimizer step or a load between steps is seen by
the next forward; autograd refuses a weight written in place between a forward and its backward.

FP8 GEMMs (``layer.fp8_gemms``, precision ``bf16-fp8``): the copy is the e4m3 block quantised from
the fp32 master with its power-of-two scale (one byte per element), and the three GEMMs are
``axon4d.options.fp8_gemm``'s, as on a grid of many ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from axon4d import device as devices
from axon4d.device.fp8 import ALIGN
from axon4d.options import fp8_gemm
from axon4d.options.precision import compute_dtype, gradient_fp8, reduce_dtype


class LocalLinear(torch.autograd.Function):
    """Forward and backward of ``axon4d.Linear`` on a grid of one rank (module docstring); ``layer``
    is the Linear (its grid, block shape and bias)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        x = cast(x, compute_dtype(layer.grid.precision, weight))  # mixed precision: the compute dtype
        if layer.fp8_gemms:  # (out, in) e4m3 from the fp32 master, its power-of-two scale
            w: Any = fp8_gemm.quantise(weight.view(layer.block_shape), pow2=True)
            copy, scale = (w.data, w.scale) if ctx.needs_input_grad[0] else (None, None)
            b = None if bias is None else cast(bias, x.dtype)
            xq = fp8_gemm.quantise(rows(x))  # (b, in) e4m3: the forward's and dW's
            y = fp8_gemm.forward(xq, w, b, x.dtype).view(*x.shape[:-1], -1)
        else:
            w = block(weight, layer.block_shape, x.dtype)  # (out, in): a view, or this step's one cast copy
            copy = w if w.dtype != weight.dtype and ctx.needs_input_grad[0] else None  # what dX reuses
            scale = None
            y = linear(x, w, bias)
            xq = None
        ctx.layer = layer
        ctx.x_shape = x.shape
        saved_x, ctx.x_scale = (xq.data, xq.scale) if xq is not None else (x, None)  # FP8: X's e4m3 copy
        # x and weight through autograd: recomputation and saved-tensor hooks see them
        if layer.grid.scheduler.recomputing:  # full recomputation: the copy is dropped and made again
            ctx.w_copy = ctx.w_scale = None
            ctx.save_for_backward(saved_x, weight, copy, scale)
        else:  # held here, not saved: activation offload never ships a weight's copy
            ctx.w_copy, ctx.w_scale = copy, scale  # the scale: FP8's, else None
            ctx.save_for_backward(saved_x, weight, None, None)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer = ctx.layer  # the axon4d.Linear
        x, weight, saved, saved_scale = ctx.saved_tensors
        copy, scale = (saved, saved_scale) if saved is not None else (ctx.w_copy, ctx.w_scale)
        ctx.w_copy = ctx.w_scale = None
        precision = layer.grid.precision
        dy2 = rows(dy)  # (b, out)
        dx = dweight = dbias = None
        fp8 = layer.fp8_gemms
        dyq = fp8_gemm.quantise(dy2, dtype=gradient_fp8(precision)) if fp8 else None  # (b, out), its own scale
        if dyq is not None and layer.fp8_flushes is not None:  # the job's underflow counter, on its steps
            fp8_gemm.count_flushes(dy2, dyq, layer.fp8_flushes)
        if ctx.needs_input_grad[0]:
            if dyq is not None:  # (b, out) @ (out, in) in FP8
                dx = fp8_gemm.grad_input(dyq, fp8_gemm.Quantised(copy, scale), dy.dtype)
            else:
                w = copy if copy is not None else block(weight, layer.block_shape, dy.dtype)  # (out, in)
                dx = dy2.mm(w)  # (b, out) @ (out, in) = (b, in)
                del w
            dx = dx if len(ctx.x_shape) == 2 else dx.view(ctx.x_shape)
        del copy, saved  # a held copy is freed here, before the dW GEMM
        if ctx.needs_input_grad[1]:
            wide = torch.promote_types(dy2.dtype, reduce_dtype(precision, weight))  # fp32 sums stay fp32
            if dyq is not None:  # (out, b') @ (b', in) in FP8, tokens zero-padded to 16
                dw = torch.empty(layer.block_shape, dtype=wide, device=dy.device)
                dy_t = fp8_gemm.transposed(dyq, ALIGN)  # (out, b'): dŶ's bytes, tokens zero-padded to 16
                x_t = fp8_gemm.transposed(fp8_gemm.Quantised(x, ctx.x_scale), ALIGN)  # (in, b'): the forward's X̂
                fp8_gemm.grad_weight(dy_t, x_t, dw)
                dw = dw.view(-1)
            else:
                dw = devices.mm_widening(dy2.t(), rows(x), wide).view(-1)  # (out, b) @ (b, in), flattened
            dweight = cast(dw, weight.dtype)
        if ctx.needs_input_grad[2]:
            bias = layer.bias
            assert bias is not None  # it needs a gradient
            db = dy2.sum(dim=0, dtype=torch.float32)  # (out,), accumulated in fp32
            dbias = cast(cast(db, reduce_dtype(precision, bias)), bias.dtype)
        return dx, dweight, dbias, None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """X Wᵀ + b on one rank for the (out, in) block ``w`` in ``x``'s dtype: ``F.linear``, one
    ``addmm`` like ``torch.nn.Linear``."""
    b = None if bias is None else cast(bias, x.dtype)
    return F.linear(x, w, b)  # (..., in) @ (in, out) + (out,) = (..., out)


def block(weight: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The (rows, cols) weight block of a one-rank grid from its flat weight (its whole z shard):
    a view, or a copy cast to ``dtype`` under mixed precision."""
    return cast(weight.view(shape), dtype)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is (not even a dispatched no-op)."""
    return t if t.dtype == dtype else t.to(dtype)


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., f) as rows (n, f): ``t`` itself when it is already 2D."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
