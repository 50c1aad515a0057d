"""The fused FP8 cast of an activation or a gradient (docs/design.md §2 "FP8 GEMMs"): amax, scale,
fp32 quotient and cast compiled by ``torch.compile`` into few kernels, in place of the eager path's
five (``axon4d.options.fp8_gemm.quantise``, which calls ``quantise`` here and keeps its own eager
path as the fallback).

What runs where:

- on an accelerator, by default: inductor generates Triton kernels — the amax reduction, then the
  scale and the cast in one pointwise pass, its fp32 division correctly rounded (``div_rn``, asked
  of inductor: ``_division_rounding``; a torch without that option keeps the eager path there) (bytes: the reduction reads t, the cast reads t and writes
  one byte: 2·elem + 1 per element, against the eager path's 2·elem + 9; priced so by
  ``axon4d.plan.fp8.quantise_passes``). Shapes are dynamic (``dynamic=True``): a new token count does
  not recompile; a new input dtype or float8 format does, once. Nothing is read back to the host.
- on the host, by default the eager path: inductor's C++ codegen needs a compiler and its first
  compile costs seconds, for no speed that matters on the host. ``set_mode("fused")`` (or
  ``AXON4D_FP8_CAST=fused``) forces the fused path anywhere; ``"eager"`` forces the fallback.

The compiled function is wrapped in one custom op, ``axon4d::fp8_quantise``: a
``TorchDispatchMode`` (which ``torch.compile`` does not run under) sees that one op and runs it
compiled, and a model compiled whole sees an opaque op with a shape rule. Outside both — the
training step — the compiled function is called directly (``_call``), without the op's dispatch:
the host's time per call is what bounds a small FP8 layer on a GPU. Its kernels are counted by
inductor when it compiles (``torch._inductor.metrics.generated_kernel_count``;
``tests/test_fp8_gemm.py``). If compiling or running it fails, the failure is logged once and the
eager path is used from then on in this process (``failure``).

The result is bit for bit the eager path's: the amax is exact in any order, the scale the same two
fp32 operations, the quotient the fp32 division of t widened exactly, rounded once to float8.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _python_dispatch

from axon4d.device import is_accelerator

log = logging.getLogger(__name__)

#: the environment variable that chooses the path when ``set_mode`` was not called
ENV = "AXON4D_FP8_CAST"
#: ``auto``: fused on an accelerator, eager on the host; ``fused``: fused on every device; ``eager``: never fused
MODES = ("auto", "fused", "eager")
#: fp32's smallest normal, the least scale (``axon4d.options.precision.fp8_scale``)
_TINY = torch.finfo(torch.float32).tiny


class _State:
    """This process's choice (``set_mode``), its compiled function and the failure that disabled it."""

    mode: str | None = None
    compiled: Callable[..., Any] | None = None
    failure: str | None = None


def set_mode(mode: str | None) -> None:
    """Choose the cast path for this process: one of ``MODES``, or None to read ``AXON4D_FP8_CAST``
    again (unset: ``auto``)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"FP8 cast mode {mode!r}: expected one of {', '.join(MODES)}")
    _State.mode = mode


def mode() -> str:
    """The cast path chosen: ``set_mode``'s, else ``AXON4D_FP8_CAST``'s, else ``auto``."""
    chosen = _State.mode or os.environ.get(ENV, "auto")
    if chosen not in MODES:
        raise ValueError(f"{ENV}={chosen!r}: expected one of {', '.join(MODES)}")
    return chosen


def failure() -> str | None:
    """Why the fused path was given up in this process (compiling or running it raised), or None."""
    return _State.failure


def wanted(device: torch.device) -> bool:
    """Whether a cast on ``device`` takes the fused path: the mode asks for it (``auto``: on an
    accelerator) and it has not failed in this process."""
    chosen = mode()
    on = chosen == "fused" or (chosen == "auto" and is_accelerator(device))
    if on and is_accelerator(device) and not _division_rounding():
        return False  # Triton's division would not be eager's: the codes could differ
    return on and _State.failure is None


def _quantise(t: torch.Tensor, fmax: float | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The function compiled: the eager path's operations, in its order (see the module docstring)."""
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)  # () fp32
    scale = torch.clamp(amax / fmax, min=_TINY)  # () fp32, NaN and inf kept
    return (t.float() / scale).to(dtype), scale  # (r, c) fp32 quotient, rounded once


@functools.cache
def _division_rounding() -> dict[str, str | int | bool | Callable[..., Any]]:
    """Inductor's options that make a compiled fp32 division correctly rounded, as eager's is: Triton's
    ``/`` is approximate (``div.full.f32``, up to 2 ulp) unless inductor is asked for ``div_rn``
    (``eager_numerics.division_rounding`` in torch 2.13; the key's name is looked up, not assumed).
    Empty where this torch has no such option."""
    import torch._inductor.config as inductor

    return {key: True for key in inductor.get_config_copy() if key.endswith("division_rounding")}


def divisor(fmax: float, device: torch.device) -> torch.Tensor:
    """``fmax`` as a () fp32 tensor on ``device``, made once per (value, device): what every FP8 scale
    divides its amax by, eager and compiled, so that each path computes the correctly rounded
    quotient amax/fmax. Divided by a Python float, neither would: ATen on CUDA computes
    ``tensor / float`` as a product with the float's reciprocal, and inductor does the same with a
    constant of the graph — 1/448 is not an fp32 value, so scales (and with them codes) would come
    out an ulp apart between paths and devices (seen on an H200). Divided by a tensor, both divide.
    While ``torch.compile`` traces, a fresh tensor is returned (nothing traced is cached)."""
    if torch.compiler.is_compiling():
        return torch.full((), fmax, dtype=torch.float32, device=device)
    return _divisor(fmax, torch.device(device))


@functools.cache
def _divisor(fmax: float, device: torch.device) -> torch.Tensor:
    return torch.full((), fmax, dtype=torch.float32, device=device)


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled as every fused cast is: dynamic shapes, one graph, a correctly rounded division."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options=_division_rounding() or None)


def _compiled() -> Callable[..., Any]:
    if _State.compiled is None:
        _State.compiled = _compile(_quantise)
    return _State.compiled


def _call(op: Any, direct: Callable[..., Any], t: torch.Tensor, *rest: Any) -> Any:
    """``direct(t, *rest)`` — the compiled function — where nothing needs the custom op ``op``: no
    ``TorchDispatchMode`` is active, nothing is being compiled around the call and ``t`` needs no
    gradient; ``op(t, *rest)`` otherwise (module docstring)."""
    if t.requires_grad or torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None:
        return op(t, *rest)
    return direct(t, *rest)


def _fused(op: Callable[..., Any], *args: Any) -> Any:
    """``op(*args)`` (a compiled cast), or None when it fails here — logged once, and the fused path
    not tried again in this process (``failure``)."""
    try:
        return op(*args)
    except Exception as e:  # compilation is best effort: any failure falls back to the eager path
        _State.failure = f"{type(e).__name__}: {e}"
        log.warning("the fused FP8 cast failed (%s); the eager path is used from now on", _State.failure)
        return None


@torch.library.custom_op("axon4d::fp8_quantise", mutates_args=())
def _op(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _direct(t, fmax, dtype)
    return q, scale


@_op.register_fake
def _(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(t, dtype=dtype), t.new_empty((), dtype=torch.float32)


def quantise(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, s) of the contiguous 2-D ``t``: s = max(amax(t)/``fmax``, fp32's smallest normal) as a ()
    fp32 tensor and q = round(t/s) as ``dtype`` (row-major), by the compiled kernels; None when the
    fused path fails here — logged once, and not tried again in this process."""
    return _fused(_call, _op, _direct, t, fmax, dtype)


def _direct(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_op`` runs, called without it (``_call``)."""
    return _compiled()(t, divisor(fmax, t.device), dtype)


# -- a cast under a given power-of-two scale (the weight's e4m3 copy, ``axon4d.scheduler.fp8_copies``) ---
def cast_scaled_eager(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round(t/``scale``) as ``dtype``, the quotient in fp32 (t widened exactly), for a () fp32
    ``scale`` that is a power of two at or above t's own (amax/fmax): the division is exact, so any
    division gives these codes, and no quotient passes the format's largest value (no clamp). Eager:
    the division reads t and writes fp32, the cast reads that and writes one byte."""
    return torch.div(t, scale.reshape(1)).to(dtype)  # a (1,) scale promotes: the quotient is fp32


@functools.cache
def _compiled_cast() -> Callable[..., Any]:
    return torch.compile(cast_scaled_eager, dynamic=True, fullgraph=True)


@torch.library.custom_op("axon4d::fp8_cast_scaled", mutates_args=())
def _cast_op(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _compiled_cast()(t, scale, dtype)


@_cast_op.register_fake
def _(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(t, dtype=dtype)


def cast_scaled(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``cast_scaled_eager`` of the contiguous ``t`` in one compiled pass (t read, one byte written);
    the same codes bit for bit, whatever the division's rounding (the scale is a power of two); None
    when the fused path fails here (``_fused``)."""
    return _fused(_call, _cast_op, _compiled_cast(), t, scale, dtype)


# -- a float8 tensor laid out transposed (dW's operands, Ŵᵀ for dX) ----------------------------------
def transpose_padded_eager(t: torch.Tensor, padded: int) -> torch.Tensor:
    """tᵀ (c, ``padded``) row-major of a 2-D (r, c) tensor of one-byte elements, columns r…padded−1
    zero bytes (+0 in both float8 formats): the copy of bytes ``axon4d.options.fp8_gemm.transposed``
    makes. Eager: an empty tensor, a strided copy (one read and one write per element) and, where
    there is padding, a fill."""
    r, c = t.shape
    out = torch.empty((c, padded), dtype=t.dtype, device=t.device)  # (c, r')
    if padded != r:
        out[:, r:].view(torch.uint8).zero_()
    out[:, :r].copy_(t.t())
    return out


def _transpose_bytes(t: torch.Tensor, padded: int) -> torch.Tensor:
    """The function compiled: the same bytes as uint8 (tiled by inductor: coalesced reads and writes)."""
    return torch.nn.functional.pad(t.t(), (0, padded - t.shape[0])).contiguous()


@functools.cache
def _compiled_transpose() -> Callable[..., Any]:
    return torch.compile(_transpose_bytes, dynamic=True, fullgraph=True)


@torch.library.custom_op("axon4d::fp8_transpose", mutates_args=())
def _transpose_op(t: torch.Tensor, padded: int) -> torch.Tensor:
    return _compiled_transpose()(t, padded)


@_transpose_op.register_fake
def _(t: torch.Tensor, padded: int) -> torch.Tensor:
    return t.new_empty((t.shape[1], padded))


def transpose_padded(t: torch.Tensor, padded: int) -> torch.Tensor | None:
    """``transpose_padded_eager`` of the contiguous (r, c) float8 ``t`` in one compiled kernel (each
    byte read once and written once, the padding written as zeros) — ATen's strided copy of one-byte
    elements reads across rows uncoalesced, several times slower than the bytes need; None when the
    fused path fails here (``_fused``)."""
    made = _fused(_call, _transpose_op, _compiled_transpose(), t.view(torch.uint8), padded)
    return None if made is None else made.view(t.dtype)


# -- rows cast per block of features (the MoE's FP8 dispatch, ``axon4d.options.fp8_rows``) --------------
def quantise_blocks(
    t: torch.Tensor, fmax: float | torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) of ``t`` (n, blocks, B) of any float dtype, a scale per block: s = max(amax(|block|)/``fmax``,
    fp32's smallest normal) as (n, blocks, 1) fp32 and q = round(t/s) as ``dtype``, the quotient in
    fp32 (t widened exactly), clamped to ±``fmax`` so a non-finite input stays non-finite, never
    out of range. The eager path runs these operations as written (bytes: the largest and the
    smallest value per block read t twice, the division reads t and writes fp32, the clamp reads
    and writes it, the cast reads it and writes e4m3: 3·elem + 17 per element — max(amax, −amin)
    rather than an ∞-norm over the last dim: the same value, without that norm's slow CPU path);
    the fused path compiles them (``quantise_rows``)."""
    top, bottom = t.amax(dim=-1, keepdim=True), t.amin(dim=-1, keepdim=True)  # (n, blocks, 1)
    amax = torch.maximum(top, -bottom).float()  # max |t| per block, exact; NaN kept
    by = divisor(fmax, t.device) if isinstance(fmax, float) else fmax  # a tensor: the division (``divisor``)
    scale = torch.clamp(amax / by, min=_TINY)  # NaN and inf kept
    quotient = torch.div(t, scale).clamp_(-fmax, fmax)  # type: ignore[arg-type]  # torch takes a float or a () tensor
    return quotient.to(dtype), scale  # fp32 quotient, rounded once


@functools.cache
def _compiled_rows() -> Callable[..., Any]:
    return _compile(quantise_blocks)


@torch.library.custom_op("axon4d::fp8_quantise_rows", mutates_args=())
def _rows_op(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _direct_rows(t, fmax, dtype)
    return q, scale


@_rows_op.register_fake
def _(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(t, dtype=dtype), t.new_empty((*t.shape[:-1], 1), dtype=torch.float32)


def quantise_rows(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantise_blocks`` of the contiguous (n, blocks, B) ``t`` by compiled kernels (the amax per
    block, then the scale and the cast in one pass: 2·elem + 1 bytes per element), bit for bit the
    eager result; None when the fused path fails here (``_fused``)."""
    return _fused(_call, _rows_op, _direct_rows, t, fmax, dtype)


def _direct_rows(t: torch.Tensor, fmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_rows_op`` runs, called without it (``_call``)."""
    return _compiled_rows()(t, divisor(fmax, t.device), dtype)
