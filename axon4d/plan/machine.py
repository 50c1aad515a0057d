"""A machine description: what one rank computes per second and what a collective costs (docs/design.md §6).

A ``Machine`` is loaded from JSON (``axon4d/plan/machines/*.json`` or a file written by
``axon4d calibrate``). It answers three questions for the cost model:

- ``matmul_time(form, m, k, n, dtype)``: seconds of one GEMM on one rank, from a table of
  throughput on a log2 lattice of (m, k, n) (``axon4d.plan.tables``; measured, or derived for the
  shipped GPU files), interpolated (trilinear in log space, clamped at the lattice edges); without
  a table, ``matmul_efficiency × peak``.
- ``comm_time(op, group, stride, payload, world)``: seconds of one collective on an axis whose
  ``group`` ranks sit ``stride`` apart (E1: x has stride 1, y stride G_x, …). Measured entries
  (op, group, stride, world) are interpolated piecewise linearly in the payload — in each size
  segment that is t = α + bytes/β. Otherwise an all-to-all is grouped point-to-point sends over
  the levels the group spans (on either device); on an accelerator the other collectives take the algorithm
  NCCL's tuner picks (ring, tree or PAT, the cheapest: ``axon4d.plan.collective_model``) with the
  per-step latency and bandwidth of the levels the group spans (``collective_algorithm``); on a
  host α·steps + traffic/β (ring traffic; steps = the fewer of ring and tree) of the first
  hierarchy level (e.g. "node", then "network") that contains the whole group.
- elementwise, attention and per-op costs for the work that is not a GEMM;
- ``interference_time(traffic, world)``: step time the ranks' compute loses to the collectives
  running beside it, per byte of ring traffic (measured by ``axon4d calibrate``: on a host whose
  ranks share CPU cores, moving bytes through gloo takes cycles from the GEMMs however well the
  collective overlaps them; 0 where nothing was given); on an accelerator whose file gives its SM
  count, ``overlap_slowdown`` instead: the share of the SMs NCCL's channels hold while a collective
  runs, charged on the time overlap hides (``axon4d.plan.cost``);
- ``step_scale_for(world)``: how the parts of a priced step compare with steps measured on this
  machine (``axon4d.plan.stepfit``; 1, 1, 1 without step calibration).
- memory that is not the job's (``axon4d.plan.device_memory``): ``usable_device_memory(communicators)``
  and ``fragmentation`` for the device, ``pinned_host_per_node`` for the node's host memory; an
  accelerator's file must give ``host_memory_per_node`` and ``host_reserve_per_node``.

Every figure in a shipped machine file carries its source in the file's "sources" field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np

from axon4d.plan import collective_model
from axon4d.plan.collective_model import Link
from axon4d.plan.device_memory import check_memory_fields
from axon4d.plan.tables import CommCurve, MatmulTable

MACHINE_DIR = os.path.join(os.path.dirname(__file__), "machines")
#: GEMM forms: forward X·Wᵀ ("nt"), input gradient dY·W ("nn"), weight gradient dYᵀ·X ("tn").
FORMS = ("nt", "nn", "tn")
#: values a machine keeps for ``Machine.remembered`` before it starts again (a search makes ~10⁴)
REMEMBERED = 1 << 18
#: the in-step scale (k_c, k_a, k_w, k_n) where no step was measured: each part of a step as the
#: tables price it, no per-collective cost (``Machine.step_scale_for``)
UNSCALED = (1.0, 1.0, 1.0, 0.0)
T = TypeVar("T")


@dataclasses.dataclass
class Level:
    """One level of the machine hierarchy: groups that fit in ``ranks`` consecutive ranks use it."""

    name: str
    ranks: int  # consecutive ranks sharing this level (0: unbounded, the network)
    alpha_s: float  # latency per ring step
    beta_Bps: float  # per-rank bandwidth (bytes/s) for ring traffic

    @property
    def link(self) -> Link:
        return Link(self.alpha_s, self.beta_Bps)


@dataclasses.dataclass
class Machine:
    """Everything the cost model needs to know about a cluster or this host."""

    name: str
    devices_per_node: int
    memory_per_device: float  # bytes
    peak_flops: dict[str, float]  # dtype name -> FLOP/s per device
    levels: list[Level]
    matmul_efficiency: float = 0.7  # share of peak a large GEMM reaches when there is no table
    # share of peak the fused attention kernel reaches, forward + backward, when there is no
    # attention table (0: ``matmul_efficiency``); at long sequences attention is most of a step
    attention_efficiency: float = 0.0
    matmul: dict[str, dict[str, dict[str, MatmulTable]]] = dataclasses.field(default_factory=dict)
    # dtype -> concurrency (ranks computing at once on a node, as str) -> form -> table
    comm: list[CommCurve] = dataclasses.field(default_factory=list)
    attention: dict[str, dict[str, list[list[float]]]] = dataclasses.field(default_factory=dict)
    # dtype -> concurrency -> rows [seq, head_dim, seconds per (sequence·head) fwd+bwd]
    attention_prefix: dict[str, dict[str, list[list[float]]]] = dataclasses.field(default_factory=dict)
    # dtype -> concurrency -> rows [keys, head_dim, seconds per (query·key) pair of unmasked fwd+bwd]
    elementwise_Bps: dict[str, float] = dataclasses.field(default_factory=lambda: {"1": 1e12})
    # concurrency -> bytes/s an elementwise op streams (read + write)
    elementwise_curve: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    # concurrency -> [[bytes streamed, bytes/s], ...] of an add at several sizes (calibrate): the rate
    # ``elementwise_time`` and ``activation_time`` take by size; none: ``elementwise_Bps`` at every size
    activation_s: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # concurrency -> [forward, backward] seconds per element of the MLP activation (GELU)
    adam_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # concurrency -> seconds per parameter element of one Adam step
    op_overhead_s: float = 5e-6  # fixed cost of one framework op (kernel launch / dispatch)
    overlap_efficiency: float = 0.9  # share of an overlapped collective that compute actually hides
    staged_reduce_scatter: bool = True
    # whether a reduce-scatter over more than two ranks holds a buffer of its input's size until
    # waited on (axon4d.comm.communicator's exchange under gloo; calibrate records the backend's answer);
    # false for NCCL/RCCL (their communicators' buffers are fixed); unknown (an older file): true,
    # the larger estimate
    accelerator: bool = False
    # whether the ranks compute on accelerators (GPUs): the forward chunking a policy that leaves it
    # to the device gets (``OverlapPolicy.chunking``); calibrate records the grid's device
    host_link_Bps: float = 0.0
    # bytes/s one device moves to or from host memory in each direction at once (PCIe, Infinity
    # Fabric): what activation offload's copies run at (0: unknown, offload is not priced). On a
    # host without accelerators the "copy" is a memory copy, priced by ``elementwise_time``
    host_memory_per_node: float = 0.0  # bytes of host memory in one node (0: unknown, offload not priced)
    host_reserve_per_node: float = 0.0  # bytes of it the OS, batch system and the job's processes keep
    cuda_context_bytes: float = 0.0  # device memory the CUDA context takes before any tensor
    device_workspace_bytes: float = 0.0  # cuBLAS / attention workspaces held through a step
    nccl_buffer_bytes: float = 0.0  # device memory of one NCCL communicator's connected buffers
    fragmentation: float = 0.0  # share of the peak the caching allocator loses (fits: peak·(1+f) ≤ usable)
    nccl_channels: int = 1  # channels NCCL runs a collective on (one CTA, i.e. one SM, each)
    comm_interference_s_per_byte: dict[str, float] = dataclasses.field(default_factory=dict)
    compute_units: int = 0  # an accelerator's SMs (CUs): with nccl_channels, ``overlap_slowdown``; 0: unknown
    # concurrency -> seconds of compute lost per byte of ring traffic (``ring_traffic``); none: 0
    step_scale: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # world size (str) -> [k_compute, k_activation_comm, k_weight_comm, seconds per collective] (stepfit)
    step_samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # the measured calibration steps the scales were fitted to (axon4d.plan.stepfit.Sample as dicts)
    fp8_gemm_speedup: list[list[float]] = dataclasses.field(default_factory=list)
    # rows [GEMM FLOPs, FP8 speed over bf16's]: with peak_flops["float8_e4m3fn"], FP8 GEMMs (axon4d.plan.fp8)
    host_sync_s: float | None = None  # seconds a loop of queued ops loses to one small read to the host
    # (E15's counts; calibrate's kernels part measures it): what an accelerator's MoE layer idles; None: unknown
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        # a field set (``axon4d.measure.merge`` builds a machine so) forgets what was priced on the old values
        self.__dict__.pop("_remembered", None)
        object.__setattr__(self, name, value)

    def remembered(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, made once per ``key`` on this machine and kept until one of its fields is set:
        a search prices the same collectives on it a million times."""
        memo = self.__dict__.setdefault("_remembered", {})
        if key not in memo:
            if len(memo) >= REMEMBERED:
                memo.clear()
            memo[key] = make()
        return memo[key]

    # -- lookups ----------------------------------------------------------------------------------
    @staticmethod
    def _nearest(table: dict[str, Any], concurrency: int) -> Any:
        keys = sorted(table, key=lambda k: (abs(int(k) - concurrency), -int(k)))
        return table[keys[0]]

    def concurrency(self, world: int) -> int:
        """Ranks of a ``world``-rank job computing at once on one node (they may share a host)."""
        return min(world, self.devices_per_node)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(
                f"machine {self.name!r} has no peak for dtype {dtype!r}; it knows {sorted(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    def matmul_time(self, form: str, m: int, k: int, n: int, dtype: str, world: int = 1) -> float:
        """Seconds of one (m×k)·(k×n) GEMM in ``form`` on one rank while ``world`` ranks run
        (remembered: ``remembered``)."""
        return self.remembered(
            ("matmul", form, m, k, n, dtype, world), lambda: self._matmul_time(form, m, k, n, dtype, world)
        )

    def _matmul_time(self, form: str, m: int, k: int, n: int, dtype: str, world: int) -> float:
        """``matmul_time``, made."""
        flops = 2.0 * m * k * n
        if flops == 0:
            return 0.0
        tables = self.matmul.get(dtype)
        if tables:
            rate = self._nearest(tables, self.concurrency(world))[form].rate(m, k, n)
        else:
            rate = self.matmul_efficiency * self.peak(dtype)
        return flops / rate + self.op_overhead_s

    def attention_rate(self, dtype: str) -> float:
        """FLOP/s of the fused attention kernel in ``dtype`` without a measured table:
        ``attention_efficiency`` (else ``matmul_efficiency``) of the peak."""
        return (self.attention_efficiency or self.matmul_efficiency) * self.peak(dtype)

    def attention_time(self, seq: int, head_dim: int, units: float, dtype: str, world: int = 1) -> float:
        """Seconds of causal attention forward + backward for ``units`` (sequence, head) pairs."""
        if units == 0:
            return 0.0
        table = self.attention.get(dtype)
        if table:
            rows = np.asarray(self._nearest(table, self.concurrency(world)), dtype=float)
            # log-log interpolation in sequence length at the nearest measured head_dim
            hd = rows[np.argmin(np.abs(np.log2(rows[:, 1]) - math.log2(head_dim))), 1]
            sel = rows[rows[:, 1] == hd]
            sel = sel[np.argsort(sel[:, 0])]
            per = float(np.exp(np.interp(math.log(seq), np.log(sel[:, 0]), np.log(sel[:, 2]))))
            if seq > sel[-1, 0]:  # beyond the table: quadratic growth
                per = float(sel[-1, 2]) * (seq / sel[-1, 0]) ** 2
            return units * per * head_dim / hd + 4 * self.op_overhead_s
        flops = units * 3.0 * 2.0 * seq * seq * head_dim  # fwd (2 GEMMs, causal half) + bwd 2×
        return flops / self.attention_rate(dtype) + 4 * self.op_overhead_s

    def prefix_attention_time(
        self, queries: int, keys: int, head_dim: int, units: float, dtype: str, world: int = 1
    ) -> float:
        """Seconds of unmasked attention forward + backward of ``queries`` queries against ``keys``
        keys for ``units`` (sequence, head) pairs: a context-parallel query chunk against the keys of
        the chunks before it (axon4d.nn.context). Without a measured table: the causal table's rate
        per pair (half a causal square's pairs are computed), else FLOPs at the matmul efficiency."""
        if units == 0 or queries == 0 or keys == 0:
            return 0.0
        pairs = units * queries * keys
        table = self.attention_prefix.get(dtype)
        if table:
            rows = np.asarray(self._nearest(table, self.concurrency(world)), dtype=float)
            hd = rows[np.argmin(np.abs(np.log2(rows[:, 1]) - math.log2(head_dim))), 1]
            sel = rows[rows[:, 1] == hd]
            sel = sel[np.argsort(sel[:, 0])]  # per-pair rate, log-log in keys, clamped at the ends
            per = float(np.exp(np.interp(math.log(keys), np.log(sel[:, 0]), np.log(sel[:, 2]))))
            return pairs * per * head_dim / hd + 4 * self.op_overhead_s
        if self.attention.get(dtype):
            square = max(queries, keys)
            return self.attention_time(square, head_dim, units, dtype, world) * pairs / (units * square * square / 2)
        flops = pairs * 3.0 * 4.0 * head_dim  # fwd: 2 GEMMs of 2·q·k·d FLOPs; bwd 2×
        return flops / self.attention_rate(dtype) + 4 * self.op_overhead_s

    def elementwise_time(self, nbytes: float, world: int = 1) -> float:
        """Seconds to stream ``nbytes`` (reads + writes) through elementwise ops on one rank: at the
        rate measured for ops of that size (``elementwise_curve``, log-linear between its sizes,
        flat beyond), else ``elementwise_Bps``."""
        return nbytes / self._stream_rate(nbytes, world)

    def _stream_rate(self, nbytes: float, world: int) -> float:
        """Bytes/s an elementwise op streaming ``nbytes`` reaches while ``world`` ranks run."""
        flat = float(self._nearest(self.elementwise_Bps, self.concurrency(world)))
        if not self.elementwise_curve:
            return flat
        rows = self._nearest(self.elementwise_curve, self.concurrency(world))
        sizes, rates = [math.log(r[0]) for r in rows], [math.log(r[1]) for r in rows]
        return float(math.exp(np.interp(math.log(max(nbytes, 1.0)), sizes, rates)))

    def _size_factor(self, nbytes: float, world: int) -> float:
        """How much slower than ``elementwise_Bps`` an op streaming ``nbytes`` runs (1 without a curve)."""
        return float(self._nearest(self.elementwise_Bps, self.concurrency(world))) / self._stream_rate(nbytes, world)

    def activation_time(self, elements: float, world: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds of the MLP activation over ``elements`` elements: the measured
        per-element cost, scaled by the elementwise rate at this size against the one it was
        measured with (``elementwise_curve``; fp32, an input read and an output written)."""
        if self.activation_s:
            f, b = self._nearest(self.activation_s, self.concurrency(world))
            k = self._size_factor(3 * 4 * elements, world)
            return elements * f * k, elements * b * k
        return self.elementwise_time(2 * 2 * elements, world), self.elementwise_time(3 * 2 * elements, world)

    def optimizer_time(self, params: float, world: int = 1, optimizer: str = "adam") -> float:
        """Seconds of one optimizer step over ``params`` local parameter elements: Adam (fp32 states;
        calibrated per element), or plain SGD, which streams p and g in and p out (fp32)."""
        if optimizer == "sgd":
            return self.elementwise_time(12 * params, world)
        if self.adam_s:
            return params * self._nearest(self.adam_s, self.concurrency(world))
        return self.elementwise_time(40 * params, world)  # p, g, m, v in; p, m, v out, fp32

    def host_copy_time(self, nbytes: float, world: int = 1) -> float:
        """Seconds to move ``nbytes`` between the device and host memory in one direction (activation
        offload): over the host link on an accelerator, a memory copy (read + write) on the host."""
        if not self.accelerator:
            return self.elementwise_time(2 * nbytes, world)
        if self.host_link_Bps <= 0:
            raise ValueError(
                f"machine {self.name!r} gives no host_link_Bps (device-to-host bandwidth): activation offload "
                "cannot be priced on it; add the field (bytes/s per device and direction) to its file"
            )
        return nbytes / self.host_link_Bps

    @property
    def can_offload(self) -> bool:
        """Whether activation offload can be priced here: a host (the copy is a memory copy) or an
        accelerator whose file gives its host link and a node's pinnable host memory."""
        return not self.accelerator or (self.host_link_Bps > 0 and self.pinned_host_per_node > 0)

    @property
    def pinned_host_per_node(self) -> float:
        """Bytes of one node's host memory the job's ranks may pin together (offloaded activations,
        the asynchronous checkpoint's snapshot: ``axon4d.plan.host_memory``): the node's memory less
        its reserve (0 where the file gives none)."""
        return max(self.host_memory_per_node - self.host_reserve_per_node, 0.0)

    def usable_device_memory(self, communicators: int) -> float:
        """Bytes of one device a rank's tensors may take: its memory less the CUDA context, the
        libraries' workspaces and ``communicators`` NCCL communicators' buffers
        (``axon4d.plan.device_memory.grid_communicators``); a step fits where its peak ·
        (1 + ``fragmentation``) is within it. A host's file gives none of these: all of it."""
        taken = self.cuda_context_bytes + self.device_workspace_bytes + communicators * self.nccl_buffer_bytes
        return self.memory_per_device - taken

    @property
    def overlap_slowdown(self) -> float:
        """The share of an accelerator's compute rate a collective running beside it takes: its NCCL
        kernel holds one SM per channel (``nccl_channels`` of ``compute_units``), so overlapped compute
        runs that much slower for the time overlap hides (``axon4d.plan.cost``); 0 where the file
        gives no SM count (then ``interference_time``'s per-byte κ, a host's measure, applies)."""
        if not self.accelerator or self.compute_units <= 0:
            return 0.0
        return min(self.nccl_channels / self.compute_units, 1.0)

    def interference_time(self, traffic_bytes: float, world: int = 1) -> float:
        """Seconds the compute of a rank loses to ``traffic_bytes`` of its collectives' ring traffic
        (``ring_traffic``) while ``world`` ranks run; 0 for a machine that did not measure it."""
        if not self.comm_interference_s_per_byte or traffic_bytes <= 0:
            return 0.0
        return traffic_bytes * self._nearest(self.comm_interference_s_per_byte, self.concurrency(world))

    def step_world(self, world: int) -> int | None:
        """The step-calibrated world size nearest ``world`` (whose weights ``step_scale_for`` applies); None if none."""
        if not self.step_scale:
            return None
        return int(self._nearest({k: k for k in self.step_scale}, world))

    def step_scale_for(self, world: int) -> tuple[float, float, float, float]:
        """(k_c, k_a, k_w, k_n) of the nearest world size that was step-calibrated; (1, 1, 1, 0) if none."""
        used = self.step_world(world)
        if used is None:
            return UNSCALED
        k_c, k_a, k_w, k_n = self.step_scale[str(used)]
        return (float(k_c), float(k_a), float(k_w), float(k_n))

    def level_of(self, group: int, stride: int) -> Level:
        """The innermost hierarchy level whose ``ranks`` consecutive ranks hold the whole group."""
        span = (group - 1) * stride + 1
        for level in self.levels:
            if level.ranks == 0 or span <= level.ranks:
                return level
        return self.levels[-1]

    def comm_time(self, op: str, group: int, stride: int, payload: float, world: int) -> float:
        """Seconds of one collective of ``payload`` bytes over ``group`` ranks ``stride`` apart (an
        all-to-all's: the bytes one rank sends, its own share included): a measured curve where
        there is one; an all-to-all as grouped point-to-point sends (``collective_model.all_to_all_time``);
        on an accelerator NCCL's choice of algorithm (``collective_algorithm``); on a host
        α·steps + ring traffic/β of the group's level."""
        if group <= 1:
            return 0.0
        curve = self._comm_curve(op, group, stride, world)
        if curve is not None:
            return curve.time(payload)
        if op == "all_to_all":  # no ring and no tuner's choice: neither model below prices it
            return collective_model.all_to_all_time(payload, *self._links(group, stride))
        if op == "shift":  # one ring step: a send and a receive per rank
            if self.accelerator:
                return collective_model.shift_time(payload, *self._links(group, stride))
            link = self.level_of(group, stride).link
            return link.alpha_s + payload / link.beta_Bps
        if self.accelerator:
            return self.collective_algorithm(op, group, stride, payload).seconds
        return collective_model.host_time(op, group, payload, self.level_of(group, stride).link)

    def collective_algorithm(self, op: str, group: int, stride: int, payload: float) -> collective_model.Priced:
        """The algorithm NCCL's tuner picks for the collective and its price (``axon4d.plan.
        collective_model``; all-reduce, all-gather, reduce-scatter: a ``ValueError`` for others)."""
        return collective_model.nccl_time(op, payload, *self._links(group, stride), self.nccl_channels)

    def _links(self, group: int, stride: int) -> tuple[collective_model.Span, Link, Link]:
        """The group's span and its links: the steps inside a node at the level holding one node's
        share of the group, the steps between nodes at the network level (the last)."""
        span = collective_model.span_of(group, stride, self.devices_per_node)
        intra = self.level_of(span.per_node, stride) if span.nodes > 1 else self.level_of(group, stride)
        return span, intra.link, (self.levels[-1] if span.nodes > 1 else intra).link

    def _comm_curve(self, op: str, group: int, stride: int, world: int) -> CommCurve | None:
        best, best_key = None, None
        for c in self.comm:
            if c.op != op or c.group != group:
                continue
            key = (c.stride != stride, abs(c.world - world), abs(c.stride - stride))
            if best_key is None or key < best_key:
                best, best_key = c, key
        return best

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["levels"] = [dataclasses.asdict(lv) for lv in self.levels]
        d["matmul"] = {
            dt: {c: {f: t.to_json() for f, t in forms.items()} for c, forms in per.items()}
            for dt, per in self.matmul.items()
        }
        d["comm"] = [dataclasses.asdict(c) for c in self.comm]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Machine:
        """A machine from its file's dict; ``ValueError`` for an unknown field or memory fields that
        cannot be used (``axon4d.plan.device_memory.check_memory_fields``)."""
        d = dict(d)
        d.pop("comment", None)
        check_memory_fields(d, str(d.get("name", "without a name")))
        d["levels"] = [Level(**lv) for lv in d["levels"]]
        d["matmul"] = {
            dt: {c: {f: MatmulTable.from_json(t) for f, t in forms.items()} for c, forms in per.items()}
            for dt, per in d.get("matmul", {}).items()
        }
        d["comm"] = [CommCurve(**c) for c in d.get("comm", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"machine file has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


def available() -> list[str]:
    """Names of the machine files shipped in axon4d/plan/machines."""
    return sorted(f[:-5] for f in os.listdir(MACHINE_DIR) if f.endswith(".json"))


def load(name_or_path: str | Machine) -> Machine:
    """A machine by shipped name (e.g. "perlmutter") or by JSON path."""
    if isinstance(name_or_path, Machine):
        return name_or_path
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(MACHINE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise ValueError(f"unknown machine {name_or_path!r}: not a file and not one of {available()}")
    with open(path) as f:
        return Machine.from_json(json.load(f))
