"""Mixed precision in one place: the dtypes of parameters, compute and gradient reductions.

A grid carries one ``Precision`` (``axon4d.init(..., precision="bf16")``). Parameters — and so
the optimizer's state and ``.grad`` — stay in ``param`` (fp32 master weights); the layers cast
what they compute with to ``compute`` (bf16: matmuls, activations, and the weight all-gathers of
E10, which then move half the bytes) and reduce gradients (E11–E13 and replicated parameters) in
``reduce`` before writing them back in ``param``.

Names: ``fp32`` (everything fp32), ``bf16`` (bf16 compute, bf16 gradient reductions),
``bf16-fp32-reduce`` (bf16 compute, fp32 gradient reductions: the dW GEMMs write their fp32 sums,
which are reduced without a round trip through bf16).

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


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of parameters (master weights), compute, and gradient reductions."""

    param: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for d in (self.param, self.compute, self.reduce):
            devices.check_dtype(d)

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


NAMED = {
    "fp32": Precision(),
    "bf16": Precision(compute=torch.bfloat16, reduce=torch.bfloat16),
    "bf16-fp32-reduce": Precision(compute=torch.bfloat16, reduce=torch.float32),
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


def compute_dtype(precision: Precision, param: torch.Tensor) -> torch.dtype:
    """The dtype a layer holding ``param`` computes in (its own dtype unless precision is mixed)."""
    return precision.compute if precision.mixed else param.dtype


def reduce_dtype(precision: Precision, param: torch.Tensor) -> torch.dtype:
    """The dtype ``param``'s gradient is reduced in (its own dtype unless precision is mixed)."""
    return precision.reduce if precision.mixed else param.dtype
