"""The activation recomputation modes (docs/design.md §5) as one type: ``Recompute``.

A mode says what a transformer block keeps for its backward and what it runs again instead
(axon4d.nn.recompute); the planner prices the same modes (axon4d.plan.recompute). ``Recompute`` is
a str enum, so a member equals its value (``Recompute.FULL == "full"``) and prints as it: callers
may pass either, and ``check_recompute`` turns a name into a member.
"""

from __future__ import annotations

from enum import Enum


class Recompute(str, Enum):
    """Activation recomputation per block, from the most memory kept to the least."""

    NONE = "none"
    """Every activation the backward needs is kept."""
    SELECTIVE = "selective"
    """Core attention is re-run from q, k, v."""
    BALANCED = "balanced"
    """Norms and the MLP activation are re-run inside the backward of the GEMM that consumes them; no
    GEMM and no collective runs twice."""
    FULL = "full"
    """Only the block input is kept; the block's forward runs again in its backward."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: activation recomputation modes (docs/design.md §5), from the most memory kept to the least: what
#: ``Transformer(cfg, recompute=...)``, ``axon4d train --recompute`` and ``axon4d plan --recompute`` take.
RECOMPUTE_MODES = tuple(mode.value for mode in Recompute)


def check_recompute(mode: str) -> Recompute:
    """``mode`` as a ``Recompute`` if it names a recomputation mode; ``ValueError`` naming the modes
    otherwise."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} is not a recomputation mode; choose one of {', '.join(RECOMPUTE_MODES)}")
    return Recompute(mode)
