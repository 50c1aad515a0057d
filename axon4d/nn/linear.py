"""The 3D-parallel linear layer, Y = X Wᵀ + b, decomposed as in docs/design.md §2 (collectives E8–E13).

A **normal** layer splits input features over x and output features over y; the weight block of
position (y, x), shape (out/G_y, in/G_x), is flattened and split again over z, so a rank stores
⌈out·in/(G_x G_y G_z)⌉ elements (padded when G_z does not divide the block). ``transpose=True``
swaps x and y, so a normal layer's output layout is a transposed layer's input layout.

Tokens are split over batch = data × z. Parameter gradients are averaged over the batch axis
like DDP: if each rank's loss is the mean over its own tokens, ``.grad`` is the gradient of the
mean over all tokens, complete on every rank when ``backward()`` returns.

On a grid of one rank no axis has anything to communicate (every G of E8–E13 is 1): the layer
then runs ``LocalLinear`` (axon4d.nn.local_linear), the ops ``torch.nn.Linear`` runs, in the grid's
compute dtype, and involves neither the overlap scheduler nor the comm log (issue 18:
``bench/overhead.py``).

Under FP8 GEMMs (``precision="bf16-fp8"``, docs/design.md §2 "FP8 GEMMs") the forward, dX and dW
GEMMs multiply e4m3 operands, each with its own tensorwise scale (``axon4d.options.fp8_gemm``): the
gathered e4m3 weight block is used as gathered and the forward's block is what keep-for-backward
keeps. A layer whose local block is not a multiple of 16 in both dims runs in bf16 (logged:
logger "axon4d.fp8", INFO); ``fp8_gemms`` says which, and setting it False runs a layer in bf16.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from axon4d import device as devices
from axon4d.activations import mark_features
from axon4d.device import fp8 as fp8_kernel
from axon4d.grid import rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import geometry, rectangles, tiled_init
from axon4d.layout.geometry import Term
from axon4d.nn.local_linear import LocalLinear, block, cast, linear
from axon4d.nn.weight_grad import dw_padded, kept_tensors
from axon4d.options import fp8_gemm
from axon4d.options.precision import FP8, compute_dtype, gradient_fp8

log = logging.getLogger("axon4d.fp8")


class _Linear3D(torch.autograd.Function):
    """Forward (E10f, E8) and backward (E10b, E9, E11–E13) of one 3D linear layer.

    When each collective is issued and waited on is the grid's overlap scheduler's decision
    (axon4d.overlap): OAG prefetches weight blocks, OAR overlaps the dX all-reduce with the dW
    matmul, ORS/ODP leave the gradient reductions running, and the forward all-reduce runs in
    token chunks, chunk i on the wire while chunk i+1 is multiplied.

    Under FP8 gathers (``bf16-fp8-gather``) E10 moves e4m3 shards with their scales and
    ``gather_weight`` hands back the block restored to the compute dtype (docs/design.md §3): the
    GEMMs, the kept block and the gradients are those of bf16 gathers. Under FP8 GEMMs
    (``layer.fp8_gemms``) it hands back the e4m3 block with its scale, which the three GEMMs take as
    it is (``axon4d.options.fp8_gemm``; X and dY are quantised here, each with its own scale).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Linear
    ) -> torch.Tensor:
        comm, sched = layer.grid.comm, layer.grid.scheduler
        fp8 = layer.fp8_gemms
        w = sched.gather_weight(layer, weight, backward=False, fp8=fp8)  # (out_l, in_l) — E10f, all-gather over z
        x = x.to(compute_dtype(layer.grid.precision, weight))  # mixed precision: the compute dtype
        x2 = x.reshape(-1, x.shape[-1])  # (b, in_l)
        tokens, out_l = x2.shape[0], layer.block_shape[0]
        xq = fp8_gemm.quantise(x2) if fp8 else None  # (b, in_l) e4m3, this rank's own scale
        y = x2.new_empty((tokens, out_l))  # (b, out_l)
        # the bias joins the partial sums of the input axis' first rank inside its GEMM (one addmm,
        # no extra pass over y); E8's all-reduce then adds it to every rank's output exactly once
        b = bias.to(y.dtype) if bias is not None and layer.grid.coord(layer.in_axis) == 0 else None  # (out_l,)
        handles, start = [], 0
        for rows in sched.forward_chunks(tokens, out_l * y.element_size(), layer.grid.size(layer.in_axis)):
            part = y[start : start + rows]  # a contiguous row block of y
            with sched.compute("fwd.matmul"):
                if xq is not None:  # (rows, in_l) @ (in_l, out_l) in FP8, + bias, written into y
                    fp8_gemm.forward(
                        fp8_gemm.Quantised(xq.data[start : start + rows], xq.scale), w, b, y.dtype, out=part
                    )
                elif b is None:
                    torch.matmul(x2[start : start + rows], w.t(), out=part)  # (rows, in_l) @ (in_l, out_l)
                else:
                    torch.addmm(b, x2[start : start + rows], w.t(), out=part)  # the same, + bias
            handles.append(comm.all_reduce(part, layer.in_axis, tag=Term.E8))  # partial sums over the input axis
            start += rows
        for h in handles:
            h.wait()
        y = y.view(*x.shape[:-1], out_l)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        # FP8: dW multiplies X's e4m3 copy made here (one byte per element kept, and no second quantisation)
        saved_x, ctx.x_scale = (xq.data, xq.scale) if xq is not None else (x, None)
        kept = w if sched.policy.oag_keep else None  # OAG keep-for-backward: no E10b (FP8: the e4m3 block)
        sched.will_gather_in_backward(layer, ctx.needs_input_grad[0] and kept is None)
        if sched.recomputing:  # full recomputation: the kept block is the recomputed forward's
            ctx.w_block = None
            ctx.save_for_backward(saved_x, weight, *kept_tensors(kept))
        else:  # held on ctx, so backward can free it before the dW matmul
            ctx.w_block = kept
            ctx.save_for_backward(saved_x, weight, None, None)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer: Linear = ctx.layer
        comm, sched = layer.grid.comm, layer.grid.scheduler
        sched.backward_started()  # pending reductions land in .grad before backward() returns
        x, weight, kept, kept_scale = ctx.saved_tensors  # x: X (..., in_l), or under FP8 its e4m3 copy (b, in_l)
        kept = kept if kept_scale is None else fp8_gemm.Quantised(kept, kept_scale)
        x2 = x.reshape(-1, x.shape[-1])  # (b, in_l)
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()  # (b, out_l)
        fp8 = layer.fp8_gemms
        # (b, out_l) in the gradients' float8 (e5m2 by default), its own scale: dX's and dW's
        dyq = fp8_gemm.quantise(dy2, dtype=gradient_fp8(layer.grid.precision)) if fp8 else None
        if dyq is not None and layer.fp8_flushes is not None:  # the job's underflow counter, on its steps
            fp8_gemm.count_flushes(dy2, dyq, layer.fp8_flushes)
        dx_handle = None
        if ctx.needs_input_grad[0]:
            if kept is None:
                kept = ctx.w_block
            w = kept if kept is not None else sched.gather_weight(layer, weight, backward=True, fp8=fp8)
            with sched.compute("bwd.dX"):
                if dyq is not None:  # (b, out_l) @ (out_l, in_l) in FP8
                    dx = fp8_gemm.grad_input(dyq, w, dy2.dtype)
                else:
                    dx = torch.matmul(dy2, w)  # (b, out_l) @ (out_l, in_l) = (b, in_l)
            dx_handle = comm.all_reduce(dx, layer.out_axis, tag=Term.E9)  # issued before dW
            if not sched.policy.oar:
                dx_handle.wait()
        sched.carry_block(layer, ctx.w_block)  # kept for the next micro-batch inside accumulating, else freed
        ctx.w_block = None
        dweight = dbias = None
        scale = 1.0 / layer.grid.size("batch")
        if ctx.needs_input_grad[1]:
            with sched.compute("bwd.dW"):
                # E11's dtype (geometry.wire_dtype): fp32 sums stay fp32 under bf16-fp32-reduce
                dtype = geometry.wire_dtype(layer.grid.precision, Term.E11, layer.weight.dtype)
                g_z = layer.grid.size("z")
                # with G_z = 1 the GEMM writes into the layer's slice of its E12 bucket, if it has one
                slot = (
                    sched.weight_grad_slot(layer.weight, dy2.shape[1] * x2.shape[1], dtype, dy2.device)
                    if g_z == 1
                    else None
                )
                if dyq is not None:  # dŶ's and X̂'s bytes laid out transposed, tokens padded to 16 (zeros add nothing)
                    pad = fp8_kernel.ALIGN
                    dy_t = fp8_gemm.transposed(dyq, pad)  # (out_l, b')
                    x_t = fp8_gemm.transposed(
                        fp8_gemm.Quantised(x2, ctx.x_scale), pad
                    )  # (in_l, b'): the forward's copy
                    dw = dw_padded(dy_t, x_t, g_z, dtype, out=slot)
                else:
                    dw = dw_padded(dy2, x2, g_z, dtype, out=slot)  # (shard_numel·G_z,): E11's input
            dweight = sched.reduce_weight_grad(layer.weight, dw, scale)  # E11 over z, E12 over data
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(dim=0, dtype=torch.float32)  # (out_l,), accumulated in fp32
            assert layer.bias is not None  # ctx.has_bias
            dbias = sched.reduce_bias_grad(layer.bias, db, scale)  # E13 over batch
        dx_out = None
        if dx_handle is not None:
            dx_out = dx_handle.wait().view(ctx.x_shape)
        return dx_out, dweight, dbias, None


class Linear(nn.Module):
    """Drop-in replacement for ``torch.nn.Linear`` decomposed over the 3D grid (docs/design.md §2).

    Input: this rank's shard (..., in_features/G_in) of tokens split over batch (data × z);
    output: (..., out_features/G_out), where (G_in, G_out) = (G_x, G_y), or (G_y, G_x) when
    ``transpose``. ``weight`` is this rank's flat Z shard of its weight block; ``bias`` is the
    block's slice of the bias (out_features/G_out,), replicated over the other axes.
    """

    #: fused outputs (q | k | v, gate | up) interleaved by y group, so a checkpoint stores them apart
    #: (axon4d.layout.param_layout); None for a plain layer
    fused_rows: rectangles.FusedRows | None = None
    #: under FP8 GEMMs, a (2,) int64 counter the backward adds [dY's entries flushed to zero, dY's
    #: non-zero entries] to (``fp8_gemm.count_flushes``); None (the default): nothing counted
    fp8_flushes: torch.Tensor | None = None
    #: under FP8 GEMMs, why a layer that fits runs in bf16 when ``fp8_gemms`` is set False (``gemm_precision``)
    bf16_why = "kept in bf16"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        transpose: bool = False,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.grid = runtime.resolve(grid)
        rules.count(in_features, "in_features", example=1024)
        rules.count(out_features, "out_features", example=1024)
        self.in_features, self.out_features, self.transpose = in_features, out_features, transpose
        self.in_axis, self.out_axis = geometry.layer_axes(transpose)
        shape = self.grid.shape
        #: a grid of one rank: nothing to communicate, forward and backward are ``LocalLinear``
        self.local = shape.world_size == 1
        rules.check(shape, rules.linear(in_features, out_features, transpose))
        self.block_shape = geometry.weight_block_shape(in_features, out_features, shape, transpose)
        self.shard_numel = geometry.weight_shard_numel(in_features, out_features, shape, transpose)
        dtype = devices.check_dtype(dtype or torch.get_default_dtype())
        device = torch.device(device) if device is not None else self.grid.device
        self.weight = nn.Parameter(torch.empty(self.shard_numel, device=device, dtype=dtype))
        rows = self.block_shape[0]
        self.bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None
        #: whether this layer's GEMMs run in FP8 (module docstring); False runs it in bf16
        self.fp8_gemms = self.grid.precision.gemm == FP8 and self._fp8_fits(device)
        self.reset_parameters()

    @property
    def gemm_precision(self) -> str:
        """What this layer's GEMMs multiply, and under FP8 GEMMs why not FP8: "fp8", "bf16 (the LM
        head)", "bf16 (block (24, 64) not a multiple of 16)", … — what the job's banner and
        summary.json list."""
        precision = self.grid.precision
        name = str(precision.compute).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
        if precision.gemm is None:
            return name
        if self.fp8_gemms:
            return "fp8"
        if not fp8_gemm.layer_fits(*self.block_shape):
            return f"{name} (block {tuple(self.block_shape)} not a multiple of {fp8_kernel.ALIGN})"
        return f"{name} ({self.bf16_why})"

    def _fp8_fits(self, device: torch.device) -> bool:
        """Under FP8 GEMMs: the device must have them (else RuntimeError, ``device.fp8.check_gemm``)
        and the local block (out_l, in_l) must be a multiple of 16 in both dims, else the layer runs
        in bf16, logged."""
        fp8_kernel.check_gemm(device)
        if fp8_gemm.layer_fits(*self.block_shape):
            return True
        log.info(
            "%s: local block (out_l, in_l) = %s is not a multiple of %d in both dims; its GEMMs run in bf16",
            self._name(),
            self.block_shape,
            fp8_kernel.ALIGN,
        )
        return False

    # -- layout ---------------------------------------------------------------------------------
    @property
    def block_index(self) -> tuple[int, int]:
        """(row block, column block) of W this rank's (x, y) position owns."""
        return self.grid.coord(self.out_axis), self.grid.coord(self.in_axis)

    def _my_shard(self, flat_block: torch.Tensor) -> torch.Tensor:
        """This rank's Z shard of a flat block (padded with zeros to G_z shards)."""
        return geometry.z_shard(flat_block, self.grid.coord("z"), self.grid.size("z"))

    def weight_block(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The full (out/G_out, in/G_in) block of this (x, y) position: E10's all-gather over z, outside
        a step (tag ``dense``)."""
        weight = self.weight if weight is None else weight
        rows, cols = self.block_shape
        flat = self.grid.comm.all_gather(weight.detach(), "z", tag=Term.DENSE).wait()
        return flat[: rows * cols].view(rows, cols)

    # -- parameters -----------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise like ``torch.nn.Linear``: U(−1/√in, 1/√in) for weight and bias.

        Every rank draws one seed from torch's default generator (so it stays in step across
        ranks). The layer then holds this rank's part of the full (out, in) weight and (out,) bias
        initialised tile by tile from that seed (``axon4d.layout.tiled_init``, tensors "weight" and "bias"),
        drawing only the tiles its shard overlaps: replicas agree, and the values of a block depend
        on neither G_z nor the other ranks.
        """
        seed = tiled_init.draw_seed()
        if self.weight.is_meta:
            return
        init = tiled_init.Init.uniform(1.0 / math.sqrt(self.in_features))
        rows, cols = self.block_shape
        row, col = self.block_index
        start = self.grid.coord("z") * self.shard_numel
        stop = min(start + self.shard_numel, rows * cols)
        shape = (self.out_features, self.in_features)
        weight = rectangles.pieces(
            [rectangles.Rows(0, rows, "weight", shape, row * rows)], col * cols, cols, start, stop
        )
        tiled_init.fill_pieces_(self.weight, weight, {"weight": init}, seed)
        if self.bias is not None:
            bias = rectangles.pieces(
                [rectangles.Rows(0, rows, "bias", (self.out_features, 1), row * rows)], 0, 1, 0, rows
            )
            tiled_init.fill_pieces_(self.bias, bias, {"bias": init}, seed)

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """Copy this rank's part of a full (out, in) weight and (out,) bias, given on every rank."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"dense weight has shape {tuple(weight.shape)}, this layer needs "
                f"(out_features, in_features) = ({self.out_features}, {self.in_features})"
            )
        rows, cols = self.block_shape
        r, c = self.block_index
        block = weight[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols]
        self.weight.copy_(self._my_shard(block.reshape(-1).to(self.weight)))
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias but the dense layer has none")
            self.bias.copy_(bias[r * rows : (r + 1) * rows].to(self.bias))
        elif bias is not None:
            raise ValueError("the dense layer has a bias but this layer was built with bias=False")
        return self

    @classmethod
    def from_dense(cls, dense: nn.Linear, transpose: bool = False, *, grid: Grid | None = None) -> Linear:
        """A 3D layer holding this rank's part of ``dense`` (which must be equal on every rank)."""
        layer = cls(
            dense.in_features,
            dense.out_features,
            bias=dense.bias is not None,
            transpose=transpose,
            grid=grid,
            dtype=dense.weight.dtype,
        )
        return layer.load_dense_(dense.weight, dense.bias)

    def _assemble(self, flat_shard: torch.Tensor) -> torch.Tensor:
        """The full (out, in) matrix from every rank's flat shard (gathers over z, in, out axes)."""
        block = self.weight_block(flat_shard)
        block = self.grid.comm.all_gather(block.contiguous(), self.in_axis, dim=1, tag=Term.DENSE).wait()
        return self.grid.comm.all_gather(block.contiguous(), self.out_axis, dim=0, tag=Term.DENSE).wait()

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Linear:
        """A plain ``torch.nn.Linear`` with the full weight and bias (and their ``.grad``), on every rank."""
        dense = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        dense.weight.copy_(self._assemble(self.weight))
        if self.bias is not None:
            dense.bias.copy_(self.grid.comm.all_gather(self.bias.detach(), self.out_axis, tag=Term.DENSE).wait())
        if grads:
            if self.weight.grad is not None:
                dense.weight.grad = self._assemble(self.weight.grad).clone()
            if self.bias is not None and self.bias.grad is not None:
                dense.bias.grad = (
                    self.grid.comm.all_gather(self.bias.grad, self.out_axis, tag=Term.DENSE).wait().clone()
                )
        return dense

    # -- compute --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output shard (..., out/G_out) of its input shard x (..., in/G_in).

        The input must be a floating tensor of a parameter dtype (fp32 or bf16: a mixed
        precision layer computes in its compute dtype) on the parameters' device, with the shard's
        last dim; anything else is refused before any communication."""
        self._check_input(x)
        if self.local:
            if torch.is_grad_enabled():
                return mark_features(LocalLinear.apply(x, self.weight, self.bias, self), self.out_axis)
            x = cast(x, compute_dtype(self.grid.precision, self.weight))  # nothing to save: no Function
            w = block(self.weight, self.block_shape, x.dtype)  # (out, in)
            return mark_features(linear(x, w, self.bias), self.out_axis)
        if torch.is_grad_enabled():
            self.grid.scheduler.note_forward(self)  # the order OAG prefetches in
        return mark_features(_Linear3D.apply(x, self.weight, self.bias, self), self.out_axis)

    def _check_input(self, x: torch.Tensor) -> None:
        """Raise ``TypeError`` or ``ValueError`` naming what is wrong with input ``x`` and what works."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._name()} takes a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in devices.SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in devices.SUPPORTED_DTYPES)
            raise TypeError(
                f"{self._name()} got input of dtype {x.dtype}; it computes in one of {names} "
                f"(its parameters are {self.weight.dtype}): cast the input, e.g. x.to({self.weight.dtype})"
            )
        if x.device != self.weight.device:
            raise ValueError(
                f"{self._name()} got input on {x.device} but its parameters are on {self.weight.device}; "
                f"move the input with x.to({str(self.weight.device)!r})"
            )
        cols = self.block_shape[1]
        if x.dim() < 1 or x.shape[-1] != cols:
            g = self.grid.size(self.in_axis)
            raise ValueError(
                f"{self._name()} expects this rank's input shard with last dim in_features/G_{self.in_axis} "
                f"= {self.in_features}/{g} = {cols}, got shape {tuple(x.shape)}; shard a full input with "
                f"axon4d.shard_input(x, transpose={self.transpose})"
            )

    def _name(self) -> str:
        return f"axon4d.Linear({self.in_features}, {self.out_features}, transpose={self.transpose})"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, transpose={self.transpose}, "
            f"block={self.block_shape}, shard={self.shard_numel}" + (", fp8" if self.fp8_gemms else "")
        )
