"""A correction file: how one job's measured steps compared with the planner's prices, applied on
top of a machine file (docs/planner.md#trying-the-top-plans).

``axon4d train --grid auto --try N`` times each plan it tries (``axon4d.train.trial``). ``fit``
finds two non-negative factors, ``compute`` on the priced compute (k_c's part of the step) and
``communication`` on the rest (the exposed collectives and the per-collective cost), that minimise
the squared relative error of

    measured step ≈ compute · priced compute + communication · priced communication

over the measured plans; with one plan, or plans whose mixes of the two cannot tell them apart,
one factor on both. ``apply`` multiplies the machine's in-step scale for the job's world size by
them (``Machine.step_scale``: k_c by ``compute``; k_a, k_w and k_n by ``communication``), so
``axon4d plan --machine M --correction C`` prices every plan as the trial measured; the machine
file itself is not changed. A correction describes the job it was measured on (its model, batch
and world size): other jobs on the same machine take it as a hint at most.

The file is a small JSON object::

    {"kind": "axon4d-correction", "machine": "host", "world": 8, "compute": 1.21,
     "communication": 0.87, "trials": [{"grid": [1, 1, 1, 8], "options": "recompute none",
     "predicted_compute_s": 0.012, "predicted_comm_s": 0.004, "measured_s": 0.019}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from axon4d.plan.machine import Machine

KIND = "axon4d-correction"
#: what ``apply`` appends to the machine's name
SUFFIX = " (corrected)"
#: the least condition a two-factor fit may have (the measured plans' mixes tell compute and
#: communication apart); below it one factor is fitted to both
MIN_RANK_RATIO = 0.05


@dataclasses.dataclass
class Correction:
    """Factors on the priced compute and communication of steps on ``world`` ranks of ``machine``."""

    machine: str
    world: int
    compute: float
    communication: float
    trials: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what they were fitted to

    def to_json(self) -> dict[str, Any]:
        return {"kind": KIND, **dataclasses.asdict(self)}


def fit(machine: str, world: int, trials: list[dict[str, Any]]) -> Correction:
    """The factors (module docstring) fitted to ``trials``: dicts with ``predicted_compute_s``,
    ``predicted_comm_s`` and ``measured_s`` (all positive but the communication, which may be 0).
    ``ValueError`` when there is none."""
    if not trials:
        raise ValueError("a correction needs at least one measured plan")
    c = np.array([t["predicted_compute_s"] for t in trials], dtype=np.float64)
    m = np.array([t["predicted_comm_s"] for t in trials], dtype=np.float64)
    y = np.array([t["measured_s"] for t in trials], dtype=np.float64)
    a = np.stack([c / y, m / y], axis=1)  # relative error: each row divided by its measured step
    if len(trials) >= 2:
        sv = np.linalg.svd(a, compute_uv=False)
        if sv[-1] > MIN_RANK_RATIO * sv[0]:
            (kc, km), *_ = np.linalg.lstsq(a, np.ones(len(trials)), rcond=None)
            if kc > 0 and km >= 0:
                return Correction(machine, world, float(kc), float(km), trials)
    r = (c + m) / y
    k = float(r.sum() / (r * r).sum())  # argmin Σ (k·r − 1)²
    return Correction(machine, world, k, k, trials)


def write(path: str, corr: Correction) -> None:
    """Write ``corr`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(corr.to_json(), f, indent=1)


def load(path: str) -> Correction:
    """The correction in the file ``path``; ``ValueError`` naming the file and what is wrong when it
    is not one (not JSON, another kind, a factor that is not a positive finite number)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"correction file {path!r} cannot be read as JSON ({e}); give a correction.json written by "
            "`axon4d train --grid auto --try N`"
        ) from e
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise ValueError(
            f'correction file {path!r} is not a correction (its "kind" is not {KIND!r}); give a correction.json '
            "written by `axon4d train --grid auto --try N` (a machine file goes to --machine)"
        )
    for key in ("compute", "communication"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"correction file {path!r}: {key} = {value!r} must be a positive finite number")
    world = raw.get("world")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"correction file {path!r}: world = {world!r} must be a whole number of ranks ≥ 1")
    return Correction(
        str(raw.get("machine", "")), world, float(raw["compute"]), float(raw["communication"]), raw.get("trials", [])
    )


def compose(corr: Correction, prior: Correction) -> Correction:
    """``corr``, fitted to prices that ``prior`` had already corrected, as factors on the machine's
    own prices: the products of both."""
    compute, communication = corr.compute * prior.compute, corr.communication * prior.communication
    return dataclasses.replace(corr, compute=compute, communication=communication)


def apply(machine: Machine, corr: Correction) -> Machine:
    """A copy of ``machine`` whose in-step scale for ``corr.world`` ranks (the nearest calibrated
    one's, or (1, 1, 1, 0)) is multiplied by the correction's factors; ``machine`` is unchanged."""
    k_c, k_a, k_w, k_n = machine.step_scale_for(corr.world)
    scale = dict(machine.step_scale)
    b = corr.communication
    scale[str(corr.world)] = [k_c * corr.compute, k_a * b, k_w * b, k_n * b]
    return dataclasses.replace(machine, name=f"{machine.name}{SUFFIX}", step_scale=scale)
