"""Mixed precision in one place: the dtypes of parameters, compute and gradient reductions.

A grid carries one ``Precision`` (``axon4d.init(..., precision="bf16")``). Parameters — and so
the optimizer's state and ``.grad`` — stay in ``param`` (fp32 master weights); the layers cast
what they compute with to ``compute`` (bf16: matmuls, activations, and the weight all-gathers of
E10, which then move half the bytes) and reduce gradients (E11–E13 and replicated parameters) in
``reduce`` before writing them back in ``param``.

Names: ``fp32`` (everything fp32), ``bf16`` (bf16 compute, bf16 gradient reductions),
``bf16-fp32-reduce`` (bf16 compute, fp32 gradient reductions: the dW GEMMs write their fp32 sums,
which are reduced without a round trip through bf16), ``bf16-fp8-gather`` (``bf16-fp32-reduce``
whose weight all-gathers over z, E10f/E10b, move float8 e4m3 shards with one fp32 scale each —
``fp8_pack``/``fp8_unpack``, docs/design.md §3 — restored to bf16 before the GEMM; with G_z = 1
there is no gather and it computes exactly what ``bf16-fp32-reduce`` does), ``bf16-fp8``
(``bf16-fp8-gather`` whose 3D Linear GEMMs — forward, dX and dW — run in float8 e4m3 with one
tensorwise scale per local block, ``torch._scaled_mm``; the gathered e4m3 block feeds the GEMM
without a bf16 round trip: ``axon4d.options.fp8_gemm``, docs/design.md §2 "FP8 GEMMs"). ``bf16-fp8`` is
opt-in: ``auto`` never becomes it.

``auto`` (the training job's default, ``resolve``) is ``bf16-fp32-reduce`` on an accelerator —
bf16 tensor cores, fp32 master weights and fp32 gradient sums — and ``fp32`` on the host, where
bf16 matmuls are slow without AVX-512 BF16 (docs/design.md §7).

fp16 is refused (``device.check_dtype``): without dynamic loss scaling, which axon4d does not do,
its gradients underflow; bf16 has the same bytes and fp32's range.
"""

from __future__ import annotations

import dataclasses

import torch

from axon4d import device as devices
from axon4d.device import fp8_fused


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of parameters (master weights), compute, gradient reductions and weight gathers."""

    param: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    #: what E10 moves a weight shard in: None (the compute dtype) or ``FP8`` (scaled per shard,
    #: ``fp8_pack``, and restored to the compute dtype before the GEMM, ``fp8_unpack``)
    gather: torch.dtype | None = None
    #: what the 3D Linear's GEMMs multiply: None (the compute dtype) or ``FP8`` (e4m3 operands, one
    #: tensorwise scale per local block, sums in fp32: ``axon4d.options.fp8_gemm``)
    gemm: torch.dtype | None = None
    #: under FP8 GEMMs, the float8 format of the output gradient dY (dX's and dW's first operand):
    #: ``FP8_GRAD`` (e5m2, the default: its range keeps small gradients that e4m3 flushes) or ``FP8``
    grad: torch.dtype | None = None

    def __post_init__(self) -> None:
        for d in (self.param, self.compute, self.reduce):
            devices.check_dtype(d)
        if self.gather not in (None, FP8):
            raise ValueError(
                f"Precision(gather={self.gather}): weight gathers move the compute dtype (gather=None) or "
                f"{FP8} with a per-shard scale (gather=torch.float8_e4m3fn, the bf16-fp8-gather precision)"
            )
        if self.gemm not in (None, FP8):
            raise ValueError(
                f"Precision(gemm={self.gemm}): the Linear's GEMMs multiply the compute dtype (gemm=None) or "
                f"{FP8} with a tensorwise scale per block (gemm=torch.float8_e4m3fn, the bf16-fp8 precision)"
            )
        if self.grad not in (None, FP8, FP8_GRAD) or (self.grad is not None and self.gemm != FP8):
            raise ValueError(
                f"Precision(grad={self.grad}, gemm={self.gemm}): the gradients' float8 format is {FP8_GRAD} or {FP8}, "
                f"and only under FP8 GEMMs (gemm={FP8})"
            )
        if self.gemm == FP8 and (self.compute != torch.bfloat16 or self.reduce != torch.float32):
            raise ValueError(
                f"Precision(gemm={FP8}) with compute={self.compute}, reduce={self.reduce}: FP8 GEMMs run beside "
                "bf16 compute and fp32 gradient reductions (compute=torch.bfloat16, reduce=torch.float32, "
                "the bf16-fp8 precision)"
            )

    @property
    def mixed(self) -> bool:
        return self.compute != self.param

    @classmethod
    def parse(cls, spec: Precision | str | None) -> Precision:
        """A Precision from itself, None (fp32) or a name listed in the module docstring."""
        if spec is None:
            return cls()
        if isinstance(spec, Precision):
            return spec
        if spec not in NAMED:
            raise ValueError(f"precision {spec!r} is not supported; use one of {', '.join(NAMED)}")
        return NAMED[spec]


#: the 8-bit float E10 can move (``Precision.gather``): e4m3, 3 mantissa bits, largest finite 448
FP8 = torch.float8_e4m3fn
#: the 8-bit float of gradients under FP8 GEMMs by default (``Precision.grad``): e5m2, 2 mantissa bits
#: and e4m3's range times 2¹⁴ — on a small Llama's layer gradients e4m3 flushed up to 4.5% of dY's
#: entries to zero where e5m2 flushed 0.04% (``bench/fp8_underflow.py``; docs/design.md §2 "FP8 GEMMs")
FP8_GRAD = torch.float8_e5m2

NAMED = {
    "fp32": Precision(),
    "bf16": Precision(compute=torch.bfloat16, reduce=torch.bfloat16),
    "bf16-fp32-reduce": Precision(compute=torch.bfloat16, reduce=torch.float32),
    "bf16-fp8-gather": Precision(compute=torch.bfloat16, reduce=torch.float32, gather=FP8),
    "bf16-fp8": Precision(compute=torch.bfloat16, reduce=torch.float32, gather=FP8, gemm=FP8, grad=FP8_GRAD),
}


#: the name that picks a precision by device (``resolve``)
AUTO = "auto"
#: what ``AUTO`` becomes on an accelerator and on the host
AUTO_ACCELERATOR, AUTO_HOST = "bf16-fp32-reduce", "fp32"
#: every name a configuration may give: the precisions themselves and ``AUTO``
NAMES = (*NAMED, AUTO)


def resolve(spec: str, accelerator: bool) -> str:
    """The precision name ``spec`` means on a grid whose device is an accelerator (``accelerator``)
    or the host: ``AUTO`` becomes ``AUTO_ACCELERATOR`` or ``AUTO_HOST``; any name of ``NAMED``
    stays itself; anything else raises ``ValueError`` naming the choices."""
    if spec == AUTO:
        return AUTO_ACCELERATOR if accelerator else AUTO_HOST
    if spec not in NAMED:
        raise ValueError(f"precision {spec!r} is not supported; use one of {', '.join(NAMES)}")
    return spec


def layer_precision(precision: Precision, fp8_gemms: bool) -> Precision:
    """The precision one 3D Linear layer runs in: ``precision``, except that under FP8 GEMMs a layer
    whose GEMMs stay in the compute dtype (``Linear.fp8_gemms`` False: the LM head, a block not a
    multiple of 16, ``--bf16-layers``) runs as without FP8 at all — its weight gathered in the compute
    dtype, never e4m3-rounded."""
    if precision.gemm is None or fp8_gemms:
        return precision
    return dataclasses.replace(precision, gather=None, gemm=None, grad=None)


def gradient_fp8(precision: Precision) -> torch.dtype:
    """The float8 format dY is quantised to under FP8 GEMMs (``Precision.grad``; e5m2 when unset)."""
    return precision.grad if precision.grad is not None else FP8_GRAD


def compute_dtype(precision: Precision, param: torch.Tensor) -> torch.dtype:
    """The dtype a layer holding ``param`` computes in (its own dtype unless precision is mixed)."""
    return precision.compute if precision.mixed else param.dtype


def reduce_dtype(precision: Precision, param: torch.Tensor) -> torch.dtype:
    """The dtype ``param``'s gradient is reduced in (its own dtype unless precision is mixed)."""
    return precision.reduce if precision.mixed else param.dtype


# -- FP8 weight gathers (E10 under ``gather=FP8``, docs/design.md §3) ------------------------------------
#: the largest finite e4m3 value: a shard is scaled so that its largest magnitude lands here
FP8_MAX = float(torch.finfo(FP8).max)
#: the bytes of a shard's scale, an fp32 that rides at the end of its uint8 chunk
SCALE_BYTES = 4


def gathers_fp8(precision: Precision, g_z: int) -> bool:
    """Whether E10 over a z axis of ``g_z`` ranks moves fp8: ``precision.gather`` is ``FP8`` and
    there is a gather at all (with G_z = 1 the shard is the block and nothing is cast)."""
    return precision.gather == FP8 and g_z > 1


#: the smallest normal fp32: no scale is below it, so x/s never overflows fp32 for |x| ≤ amax
_TINY = float(torch.finfo(torch.float32).tiny)


def fp8_scale(amax: torch.Tensor, pow2: bool = False, fmax: float = FP8_MAX) -> torch.Tensor:
    """The float8 scale s of a tensor whose largest magnitude is ``amax`` (a () fp32 tensor, on its
    device: nothing is read back to the host), so that amax/s lands on the format's largest value
    ``fmax`` (e4m3: 448): s = amax/fmax, or with ``pow2`` the power of two 2^⌈log₂(amax/fmax)⌉
    (amax/s in (fmax/2, fmax]: a bit of range given up so that the scales of a block's shards
    compare exactly, ``axon4d.scheduler.fp8_copies``). s is never below fp32's smallest normal — the
    scale of an all-zero tensor (with ``pow2``, 2⁻¹²⁶, so a zero shard never sets its block's
    scale) — so no 0 or inf scale, hence no NaN, comes from a block of zeros or of fp32 subnormals.
    A non-finite amax gives itself as s, so an inf or NaN input stays non-finite (the step is then
    skipped, as it would be in bf16). Without ``pow2``: two kernels (a division and a clamp, which
    keeps NaN and inf as they are)."""
    by = fp8_fused.divisor(fmax, amax.device)  # a tensor: the correctly rounded quotient on every device
    ratio = torch.clamp(amax / by, min=_TINY)  # () fp32, ≥ the smallest normal; NaN and inf kept
    if not pow2:
        return ratio
    mantissa, exponent = torch.frexp(ratio)  # ratio = m·2^e, m in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(ratio), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return torch.where(torch.isfinite(amax), scale, amax)  # inf or NaN stays so


def fp8_pack(shard: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """One rank's chunk of an fp8 E10: the flat z shard (n,) cast to e4m3 with the per-shard
    scale s = amax(|shard|)/448 (``fp8_scale``; fp32's smallest normal for an all-zero shard; a power of two with
    ``pow2``, under FP8 GEMMs), as raw bytes, followed by s's 4 bytes (fp32): a (n + 4,) uint8
    tensor on the shard's device. The scale is computed there; no value is read back to the host.
    Each element is q = round_e4m3(w/s), so |q·s − w| ≤ 2⁻⁴·|w| in e4m3's normal range and
    ≤ 2⁻¹⁰·s below it (its subnormals, spaced 2⁻⁹)."""
    n = shard.numel()
    w = shard.detach().reshape(-1).float()  # (n,) fp32
    amax = w.abs().amax()  # () fp32, on the device
    scale = fp8_scale(amax, pow2)  # () fp32
    packed = torch.empty(n + SCALE_BYTES, dtype=torch.uint8, device=shard.device)  # (n + 4,)
    # w may be the master shard itself (fp32): divide into a new tensor, never in place
    packed[:n].view(FP8).copy_(torch.div(w, scale).clamp_(-FP8_MAX, FP8_MAX))  # (n,) e4m3 bytes
    packed[n:].copy_(scale.reshape(1).view(torch.uint8))  # (4,): the scale's bytes
    return packed


def fp8_unpack(gathered: torch.Tensor, parts: int, dtype: torch.dtype) -> torch.Tensor:
    """The flat padded weight block in ``dtype`` from E10's fp8 result: ``gathered`` is ``parts``
    chunks of ``fp8_pack`` in z order, (parts·(n + 4),) uint8; chunk i is restored as
    fp32(q_i)·s_i and rounded once to ``dtype``. Returns (parts·n,)."""
    chunks = gathered.view(parts, -1)  # (G_z, n + 4)
    n = chunks.shape[1] - SCALE_BYTES
    scale_bytes = torch.empty(parts, SCALE_BYTES, dtype=torch.uint8, device=gathered.device)  # aligned
    scales = scale_bytes.copy_(chunks[:, n:]).view(torch.float32)  # (G_z, 1) fp32
    block = chunks[:, :n].view(FP8).to(dtype)  # (G_z, n): exact (e4m3 values are bf16 and fp32 values)
    # q·s is computed in fp32 (bf16 × fp32 promotes) and rounded once into the block: no fp32 copy
    torch.mul(block, scales, out=block)
    return block.view(-1)  # (G_z·n,)


def gather_payload_bytes(precision: Precision, shard_numel: int, g_z: int, param_dtype: torch.dtype) -> int:
    """E10's payload (one E10f or E10b, the gathered result's bytes) on a z axis of ``g_z`` ranks
    for a z shard of ``shard_numel`` elements of a parameter of ``param_dtype``: under fp8 gathers
    G_z·(n + 4) — one byte per element and each rank's 4-byte scale — except under FP8 GEMMs, whose
    z ranks share one scale per weight all-gathered once per step (``Term.FP8_SCALE``,
    ``axon4d.scheduler.fp8_copies``): G_z·n; else G_z·n elements of the compute dtype; 0 when
    G_z = 1 (no gather)."""
    if g_z == 1:
        return 0
    if gathers_fp8(precision, g_z):
        return g_z * (shard_numel + (0 if precision.gemm is not None else SCALE_BYTES))
    dtype = precision.compute if precision.mixed else param_dtype
    return g_z * shard_numel * dtype.itemsize
