"""Step calibration: fit how whole measured steps of a model compare with the priced parts (docs/design.md §6).

``axon4d calibrate`` times every GEMM, elementwise op and collective on its own, with every rank
busy with the same kind of work. A training step runs them together, with the layers' Python and
autograd between them and the overlap scheduler moving collectives under compute, and the sum of
the priced parts is off in a way that depends on the machine and on the model. With
``axon4d calibrate --step-model SPEC``:

- ``axon4d.measure.steps.measure`` runs training steps of that model
  (``axon4d.measure.probe.ProbeModel``: the model's blocks of ``axon4d.Linear``, attention, head
  and Adam; the library's default overlap policy) on a few grids of the current world,
  ``calibration_grids``: one per parallel axis that divides the world alone (data, z, x, y), so
  that each kind of collective dominates one step, and up to three grids over several axes;
- ``fit`` finds, per world size, the non-negative weights (k_c, k_a, k_w, k_n) that minimise the
  squared relative error of

      measured step ≈ k_c · compute + k_a · exposed activation all-reduces
                      + k_w · exposed weight/gradient collectives + k_n · collectives issued

  over those steps (the parts are ``cost.TimeEstimate.parts`` from the machine's tables, and
  ``TimeEstimate.collectives``, the count the communication log records); ``cost.step_time``
  applies the weights of the nearest calibrated world size to every grid. k_n is a fixed cost
  per collective that the isolated collective timings (a tight loop of one collective) do not
  see. What it consists of is not measured separately; plausibly issuing and waiting on the
  collective inside a layer and, on a shared host, waking the threads that carry it.

The weights describe the calibrated model on this machine. They carry over to models of similar
shape, not to models of very different size: a step of a smaller model is dominated by fixed
per-op costs that these weights do not describe (docs/planner.md shows both). Without step
calibration (the shipped cluster files) the weights are (1, 1, 1, 0).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from axon4d.config import ModelConfig
from axon4d.grid.shape import GridShape
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.cost import step_time
from axon4d.plan.machine import UNSCALED, Machine
from axon4d.plan.workload import Workload, unmixed_precision

#: grids over several axes ``calibration_grids`` adds to the single-axis ones
MIXED = 3
#: calibration steps a world needs for the four weights
MIN_GRIDS = 4
#: ``parse_model`` keys → ModelConfig fields
_SPEC_KEYS = {
    "layers": "n_layers",
    "hidden": "hidden",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn": "ffn_hidden",
    "vocab": "vocab_size",
    "seq": "seq_len",
}
_SPEC_KEY_OF = {name: key for key, name in _SPEC_KEYS.items()}  # ModelConfig field → its spec key


@dataclasses.dataclass
class Sample:
    """One measured calibration step: the grid, the model, and the median step time over rounds."""

    grid: list[int]
    measured_s: float
    model: dict[str, Any]
    batch: int
    dtype: str
    rounds_s: list[float]

    @classmethod
    def of(cls, grid: Sequence[int], wl: Workload, rounds_s: Sequence[float]) -> Sample:
        """The steps of ``wl`` timed on ``grid`` in ``rounds_s``, kept as their median."""
        return cls(list(grid), statistics.median(rounds_s), model_fields(wl.model), wl.batch, wl.dtype, list(rounds_s))

    @property
    def world(self) -> int:
        return GridShape(*self.grid).world_size

    def matches(self, wl: Workload) -> bool:
        """Whether this step was of ``wl``'s model and batch."""
        return self.fields() == model_fields(wl.model) and self.batch == wl.batch and self.dtype == wl.dtype

    def config(self) -> ModelConfig:
        return ModelConfig(name="stepfit", **self.model)

    def fields(self) -> dict[str, Any]:
        """The stored model as ``model_fields`` gives it (files written before it resolved defaults too)."""
        return model_fields(self.config())

    def spec(self) -> str:
        """The model and batch in ``parse_model``'s form, e.g. "layers=2,hidden=512,…,batch=8,dtype=float32"."""
        fields = self.fields()
        return ",".join(
            [
                *(f"{key}={fields[name]}" for key, name in _SPEC_KEYS.items()),
                f"batch={self.batch}",
                f"dtype={self.dtype}",
            ]
        )

    def workload(self) -> Workload:
        return Workload(
            self.config(),
            self.batch,
            self.dtype,
            embedding=False,
            norms=False,
            precision=unmixed_precision(self.dtype),
        )


def model_fields(cfg: ModelConfig) -> dict[str, Any]:
    """A model's configuration as a ``Sample`` stores it: every field but the label, with the FFN
    width and KV heads resolved (so a default and its explicit value compare equal)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "name"}
    return {**fields, "ffn_hidden": cfg.ffn, "n_kv_heads": cfg.kv_heads}


def samples_for(machine: Machine, world: int) -> tuple[int | None, list[Sample]]:
    """(the step-calibrated world size whose weights ``world`` ranks get — ``Machine.step_world`` —,
    the steps they were fitted to); (None, []) without step calibration."""
    used = machine.step_world(world)
    return used, [s for s in (Sample(**d) for d in machine.step_samples) if s.world == used]


def caveat(machine: Machine, wl: Workload, world: int, overlap: Any = None, recompute: str = "none") -> str | None:
    """Why ``machine``'s in-step scale may not describe a step of ``wl`` on ``world`` ranks, or None.

    The weights describe the steps they were fitted to (module docstring): those of the
    calibrated world size ``Machine.step_scale_for`` applies. The planned step is like them when
    its model and dtype are the calibrated ones, each rank gets as many sequences, and the overlap
    policy and recomputation are those ``measure`` ran (the library's default policy, none)."""
    used, mine = samples_for(machine, world)
    if used is None or not mine:
        return None
    ref, fields = mine[0], model_fields(wl.model)
    differs = []
    if not any(s.fields() == fields for s in mine):
        theirs = ref.fields()
        differs.append(
            "model ("
            + ", ".join(
                f"{_SPEC_KEY_OF.get(k, k)} {v} here, {theirs[k]} there" for k, v in fields.items() if theirs[k] != v
            )
            + ")"
        )
    if wl.dtype != ref.dtype:
        differs.append(f"dtype ({wl.dtype} here, {ref.dtype} there)")
    if wl.batch * used != ref.batch * world:
        differs.append(f"sequences per rank ({wl.batch / world:g} here, {ref.batch / used:g} there)")
    if OverlapPolicy.parse(overlap) != OverlapPolicy():
        differs.append("overlap policy (not the default)")
    if recompute != "none":
        differs.append(f"recomputation ({recompute} here, none there)")
    if not differs:
        return None
    return (
        f"the in-step scale of machine {machine.name!r} was fitted to steps on {used} ranks that differ in "
        f"{'; '.join(differs)}; its weights may not carry over (docs/planner.md). To fit them to this job, "
        f"run `axon4d calibrate --step-model SPEC` with its model"
    )


def describe(scale: Sequence[float]) -> str:
    """One line for the weights (k_c, k_a, k_w, k_n)."""
    k_c, k_a, k_w, k_n = scale
    return (
        f"compute ×{k_c:.2f}, activation all-reduces ×{k_a:.2f}, weight/gradient collectives ×{k_w:.2f}, "
        f"{k_n * 1e3:.2f} ms per collective"
    )


def parse_model(spec: str, name: str = "stepfit") -> Workload:
    """The workload of ``spec`` = "layers=2,hidden=512,heads=8,vocab=2048,seq=128,batch=8[,ffn=…][,kv_heads=…]
    [,dtype=float32]" (ffn: ModelConfig's default), as ``ProbeModel`` runs it (no embedding, no norms)."""
    fields: dict[str, object] = {}
    batch, dtype = None, "float32"
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or (key not in _SPEC_KEYS and key not in ("batch", "dtype")):
            raise ValueError(
                f"step model {spec!r}: {item!r} is not key=value with a key of "
                f"{sorted(_SPEC_KEYS) + ['batch', 'dtype']}"
            )
        if key == "dtype":
            dtype = value
            continue
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"step model {spec!r}: {key}={value!r} must be a positive integer")
        if key == "batch":
            batch = int(value)
        else:
            fields[_SPEC_KEYS[key]] = int(value)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if _SPEC_KEYS[k] not in fields]
    if missing or batch is None:
        raise ValueError(
            f"step model {spec!r} lacks {missing + ([] if batch else ['batch'])}; "
            "e.g. layers=2,hidden=512,heads=8,vocab=2048,seq=128,batch=8"
        )
    # the probe's parameters are ``dtype`` itself on a grid without mixed precision: its gradients reduce in it
    return Workload(
        ModelConfig(name=name, **fields),  # type: ignore[arg-type]
        batch,
        dtype,
        embedding=False,
        norms=False,
        precision=unmixed_precision(dtype),
    )


def calibration_grids(world: int, wl: Workload) -> list[tuple[int, int, int, int]]:
    """The grids ``measure`` runs on ``world`` ranks: every single-axis grid (data, z, x, y) the
    workload allows, then up to ``MIXED`` valid grids over several axes, chosen one at a time to
    put the most group sizes on axes no grid so far has had them on (a collective's cost in a
    step depends on its group size, and the weights are fitted over all of them: on 8 ranks
    that adds groups of 4 on x and y, whose latency the single-axis grids, at 8, do not show).
    Ties go to the grid over the most axes, then the most balanced, model axes before data."""
    pure = [(1, 1, 1, world), (1, 1, world, 1), (world, 1, 1, 1), (1, world, 1, 1)]
    out = [g for g in pure if world > 1 and not wl.grid_problems(GridShape(*g))]
    mixed = [
        cast("tuple[int, int, int, int]", g)  # product(..., repeat=4) yields 4-tuples; its stub says tuple[int, ...]
        for g in itertools.product(range(1, world + 1), repeat=4)
        if int(np.prod(g)) == world and sum(v > 1 for v in g) >= 2 and not wl.grid_problems(GridShape(*g))
    ]

    def placements(g: tuple[int, ...]) -> set[tuple[int, int]]:  # (axis, group size) below the world
        return {(axis, size) for axis, size in enumerate(g) if 1 < size < world}

    seen: set[tuple[int, int]] = set()
    for _ in range(MIXED):
        left = [g for g in mixed if g not in out]
        if not left:
            break
        best = min(left, key=lambda g: (-len(placements(g) - seen), -sum(v > 1 for v in g), max(g), g[3], g[2]))
        out.append(best)
        seen |= placements(best)
    return out


def check_grids(world: int, wl: Workload) -> None:
    """Raise ValueError unless ``wl`` fits at least ``MIN_GRIDS`` calibration grids of ``world`` ranks."""
    grids = calibration_grids(world, wl)
    if world > 1 and len(grids) < MIN_GRIDS:
        raise ValueError(
            f"step model fits only the grids {grids} of {world} ranks; the fit needs {MIN_GRIDS} "
            f"(make heads and batch divisible by {world}, and the features by it)"
        )


def fit(terms: np.ndarray, measured: np.ndarray) -> tuple[float, float, float, float]:
    """Non-negative (k_c, k_a, k_w, k_n) minimising Σ ((terms · k − measured) / measured)².

    ``terms`` (n, 4): the unscaled (compute, activation, weight) seconds and the collectives of
    each step; a term that is zero in every step keeps its ``UNSCALED`` weight (nothing measured
    says otherwise)."""
    a = terms / measured[:, None]
    b = np.ones(len(measured))
    seen = [j for j in range(4) if np.any(terms[:, j] > 0)]
    active = list(seen)
    while True:  # least squares on the active terms; drop a term whose weight comes out negative
        k = np.zeros(4)
        if active:
            k[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [j for j in active if k[j] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda j: k[j]))
    for j in range(4):
        if j not in seen:
            k[j] = UNSCALED[j]
    return (float(k[0]), float(k[1]), float(k[2]), float(k[3]))


def store(machine: Machine, worlds: set[int], samples: list[dict[str, Any]], source: str) -> dict[str, list[float]]:
    """Replace ``machine``'s calibration steps of the world sizes ``worlds`` with ``samples``
    (``Sample``s as dicts) and refit its in-step scale (``refit``); where a scale came out,
    ``source`` says in the machine's sources where the steps were timed. Returns the scale."""
    machine.step_samples = [s for s in machine.step_samples if Sample(**s).world not in worlds] + samples
    scale = refit(machine)
    if scale:
        machine.sources["step_scale"] = source
    return scale


def refit(machine: Machine) -> dict[str, list[float]]:
    """Fit ``machine.step_scale`` from ``machine.step_samples`` (per world size) with the machine's
    current tables; returns and stores it. A world needs ``MIN_GRIDS`` samples."""
    samples = [Sample(**s) for s in machine.step_samples]
    scale: dict[str, list[float]] = {}
    for world in sorted({s.world for s in samples}):
        mine = [s for s in samples if s.world == world]
        if len(mine) < MIN_GRIDS:
            continue
        estimates = [step_time(s.workload(), GridShape(*s.grid), machine) for s in mine]
        terms = np.array([[*t.parts, t.collectives] for t in estimates])
        scale[str(world)] = list(fit(terms, np.array([s.measured_s for s in mine])))
    machine.step_scale = scale
    return scale
