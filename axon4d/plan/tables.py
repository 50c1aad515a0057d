"""Measured tables a machine file holds (docs/design.md §6): GEMM throughput on a lattice of
shapes (``MatmulTable``) and the time of one collective over payloads (``CommCurve``).

Both are plain data with their interpolation; ``axon4d.plan.machine.Machine`` looks them up, and
``axon4d calibrate`` (axon4d.measure) writes them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(eq=False)
class MatmulTable:
    """Measured GEMM throughput (FLOP/s) on the lattice dims × dims × dims of (m, k, n): any
    ascending dims (``axon4d calibrate`` measures 16 … 4096 on a host, 16 … 16384 on an
    accelerator; a file records each table's own)."""

    dims: list[int]
    rates: np.ndarray  # (len(dims),)*3, FLOP/s

    def rate(self, m: float, k: float, n: float) -> float:
        """Throughput at (m, k, n): trilinear interpolation of log rate over log2 dims, clamped."""
        lg = np.log2(np.asarray(self.dims, dtype=float))
        idx, wts = [], []
        for v in (m, k, n):
            p = float(np.clip(math.log2(max(v, 1)), lg[0], lg[-1]))
            i = min(int(np.searchsorted(lg, p, side="right")) - 1, len(lg) - 2)
            idx.append(i)
            wts.append((p - lg[i]) / (lg[i + 1] - lg[i]))
        logr = np.log(self.rates)
        acc = 0.0
        for a in (0, 1):
            for b in (0, 1):
                for c in (0, 1):
                    w = (wts[0] if a else 1 - wts[0]) * (wts[1] if b else 1 - wts[1]) * (wts[2] if c else 1 - wts[2])
                    if w:
                        acc += w * logr[idx[0] + a, idx[1] + b, idx[2] + c]
        return float(math.exp(acc))

    def __eq__(self, other: object) -> bool:
        """The same lattice and the same rates (numpy arrays compare elementwise)."""
        if not isinstance(other, MatmulTable):
            return NotImplemented
        return self.dims == other.dims and bool(np.array_equal(self.rates, other.rates))

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq

    def to_json(self) -> dict[str, Any]:
        return {"dims": self.dims, "rates": self.rates.tolist()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MatmulTable:
        """A table as a machine file holds it; ``ValueError`` unless its dims are two or more
        ascending sizes and its rates a positive (len(dims),)*3 cube."""
        dims, rates = list(d["dims"]), np.asarray(d["rates"], dtype=float)
        if len(dims) < 2 or any(not (isinstance(v, int) and v >= 1) for v in dims) or dims != sorted(set(dims)):
            raise ValueError(
                f"machine file: a GEMM table's dims {dims} must be two or more whole numbers >= 1 in ascending "
                "order, e.g. [16, 64, 256, 1024, 4096]; calibrate again (axon4d calibrate)"
            )
        if rates.shape != (len(dims),) * 3 or not bool(np.all(np.isfinite(rates) & (rates > 0))):
            raise ValueError(
                f"machine file: a GEMM table on dims {dims} has rates of shape {rates.shape}; they must be "
                f"{(len(dims),) * 3} FLOP/s, all finite and above 0; calibrate again (axon4d calibrate)"
            )
        return cls(dims, rates)


@dataclasses.dataclass
class CommCurve:
    """Measured time of one collective (op over ``group`` ranks at ``stride``, ``world`` ranks busy)."""

    op: str
    group: int
    stride: int
    world: int
    payload: list[int]  # bytes, increasing
    seconds: list[float]

    def time(self, payload: float) -> float:
        """Piecewise-linear in payload (t = α + bytes/β per segment), extrapolated with the end segments."""
        xs, ys = self.payload, self.seconds
        i = min(max(bisect.bisect_right(xs, payload) - 1, 0), len(xs) - 2)
        slope = max((ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]), 0.0)
        return max(ys[i] + slope * (payload - xs[i]), 0.0) if payload >= xs[0] else ys[0]

    def alpha_beta(self) -> tuple[float, float]:
        """Least-squares α (s) and β (bytes/s of payload) over all points, for display."""
        a = np.vstack([np.ones(len(self.payload)), np.asarray(self.payload, float)]).T
        (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.asarray(self.seconds), rcond=None)
        return float(alpha), float(1.0 / inv_beta) if inv_beta > 0 else float("inf")
