"""FP8 GEMMs in the planner (precision ``bf16-fp8``, docs/design.md §2 "FP8 GEMMs" and §6).

A machine has FP8 GEMMs when its file gives an FP8 peak (``peak_flops["float8_e4m3fn"]``) and how
an FP8 GEMM's speed compares with bf16's by size (``fp8_gemm_speedup``: rows [GEMM FLOPs, speed-up],
interpolated in log FLOPs, held at the ends); without them (A100, MI250X) a ``bf16-fp8`` workload
is refused (``check``). Per layer and grid the planner prices both ways (``layer_choice``):

- bf16: the three GEMMs at the machine's bf16 rate (``Machine.matmul_time``);
- FP8: each GEMM at its bf16 time divided by the speed-up at its size, plus the casts the runtime
  makes, pass by pass (``cast_passes``, counted against the code by a test): X and dY quantised
  once each (amax, an fp32 quotient, the cast: fused on an accelerator, eager on the host), their
  transposed layouts for dW copied from those bytes, Ŵᵀ laid out for dX, and the weight's e4m3
  copy from the fp32 master shard (``weight_copy_bytes``), made once per optimizer step and spread
  over the step's micro-batches (``axon4d.scheduler.fp8_copies``), on a grid of one rank in every
  forward (``weight_copies_per_run``) — its scale's all-gather over z is
  4 bytes a rank, not priced.

and runs the layer in FP8 where its local block is a multiple of 16 in both dims and FP8 is the
cheaper (``kind_choices``: one choice per layer kind, as the runtime makes it); the LM head and the embedding stay in bf16, as in the runtime.
"""

from __future__ import annotations

import math
from typing import Any

from axon4d.device.fp8 import ALIGN
from axon4d.layout.geometry import Collective, Op, Term, weight_block_shape
from axon4d.options.precision import SCALE_BYTES
from axon4d.plan.blocks import layer_kind
from axon4d.plan.machine import Machine
from axon4d.plan.workload import LinearSpec

#: a ``axon4d.plan.scenario.Scenario`` (which imports this module: not imported here)
Scenario = Any

#: the peak_flops key of FP8 (e4m3) tensor cores
DTYPE = "float8_e4m3fn"
#: the preset whose Linear GEMMs may run in FP8
PRESET = "bf16-fp8"
#: layers the runtime keeps in bf16 under FP8 GEMMs (axon4d.models.transformer)
BF16_LAYERS = ("head", "embedding")


def available(machine: Machine) -> bool:
    """Whether ``machine`` has FP8 tensor cores: its file gives an FP8 peak and speed-ups by size."""
    return machine.peak_flops.get(DTYPE, 0.0) > 0 and bool(machine.fp8_gemm_speedup)


def check(machine: Machine, preset: str) -> None:
    """Refuse (ValueError) a ``bf16-fp8`` workload on a machine without FP8 tensor cores."""
    if preset == PRESET and not available(machine):
        raise ValueError(
            f"precision {PRESET} runs the Linear GEMMs in FP8, but machine {machine.name!r} has no FP8 tensor cores "
            f"(its file gives no peak_flops[{DTYPE!r}] and fp8_gemm_speedup); use bf16-fp8-gather or "
            "bf16-fp32-reduce, or a machine with FP8 (h100, h800)"
        )


def speedup(machine: Machine, flops: float) -> float:
    """FP8 GEMM speed over bf16's at ``flops`` (2·m·k·n): ``fp8_gemm_speedup`` interpolated in log FLOPs."""
    rows = sorted(machine.fp8_gemm_speedup)
    if flops <= rows[0][0]:
        return rows[0][1]
    for (f0, s0), (f1, s1) in zip(rows, rows[1:]):
        if flops <= f1:
            t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return s0 + t * (s1 - s0)
    return rows[-1][1]


def gemm_seconds(machine: Machine, form: str, m: int, k: int, n: int, dtype: str, world: int) -> float:
    """Seconds of one FP8 GEMM (m×k)·(k×n): the bf16 GEMM's work time over ``speedup``, plus one op."""
    work = machine.matmul_time(form, m, k, n, dtype, world) - machine.op_overhead_s
    return work / speedup(machine, 2.0 * m * k * n) + machine.op_overhead_s


def quantise_passes(rows: int, cols: int, elem: int, fused: bool = False) -> tuple[int, int]:
    """(bytes, kernels) of ``fp8_gemm.quantise`` of a (rows, cols) tensor of ``elem``-byte elements
    with its own scale, row-major and unpadded. Eager (the host's path, and the fallback): the amax
    reads it, the division reads it and writes fp32, the cast reads that and writes e4m3 —
    2·elem + 9 bytes per element — and two kernels on the scale itself, five in all. ``fused`` (an
    accelerator's path, ``axon4d.device.fp8_fused``): the amax reads it, one pass reads it again and
    writes e4m3 — 2·elem + 1 bytes per element — in two kernels (inductor's Triton reduction, then
    the scale and the cast)."""
    if fused:
        return rows * cols * (2 * elem + 1), 2
    return rows * cols * (2 * elem + 9), 5


def transposed_passes(rows: int, cols: int, fused: bool = False) -> tuple[int, int]:
    """(bytes, kernels) of ``fp8_gemm.transposed`` of a (rows, cols) e4m3 tensor, rows padded to 16:
    one read and one write per element, and the padding's zeros. ``fused`` (an accelerator:
    ``fp8_fused.transpose_padded``) one tiled kernel; eager an empty tensor, the strided copy and a
    fill where there is padding."""
    padded = -(-rows // ALIGN) * ALIGN
    return 2 * rows * cols + (padded - rows) * cols, 1 if fused else 2 + (padded != rows)


def cast_passes(spec: LinearSpec, sc: Scenario) -> tuple[int, int]:
    """``layer_cast_passes`` of ``spec``'s local block on one rank of ``sc``."""
    in_l, out_l = spec.local(sc.shape)
    return layer_cast_passes(in_l, out_l, sc.tokens, sc.element_size, spec.input_grad, sc.machine.accelerator)


def layer_cast_passes(
    in_l: int, out_l: int, b: int, elem: int, input_grad: bool = True, fused: bool = False
) -> tuple[int, int]:
    """(bytes, kernels) of one run's FP8 casts of a layer whose local block is (out_l, in_l), on b
    tokens of ``elem``-byte activations, as ``axon4d.nn.linear`` makes them after the step's weight
    copy: X and dY quantised once each (``quantise_passes``: ``fused`` on an accelerator, where the
    runtime's default is the fused cast, eager on the host), both laid out transposed for dW from
    those bytes (``transposed_passes``, fused likewise), and — with ``input_grad`` — Ŵᵀ laid out for
    dX (the same transposition of the (out_l, in_l) block, a multiple of 16: no padding).
    ``tests/test_fp8_gemm.py`` counts the code's passes against these."""
    parts = [
        quantise_passes(b, in_l, elem, fused),
        quantise_passes(b, out_l, elem, fused),
        transposed_passes(b, in_l, fused),
        transposed_passes(b, out_l, fused),
    ]
    if input_grad:
        parts.append(transposed_passes(out_l, in_l, fused))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def weight_copy_passes(elements: int, fused: bool = False) -> int:
    """Bytes of the e4m3 copy of an fp32 master shard of ``elements`` (``axon4d.scheduler.fp8_copies``):
    the amax reads it (4 per element), then ``fused`` (an accelerator: ``fp8_gemm.cast_weight``'s
    one pass) reads it and writes a byte — 9 per element; eager (the host) the division reads it
    and writes fp32 and the cast reads that and writes a byte — 17."""
    return elements * (9 if fused else 17)


def weight_copy_bytes(spec: LinearSpec, sc: Scenario) -> int:
    """Bytes of the weight's e4m3 copy, made once per optimizer step from the fp32 master shard on
    one rank of ``sc`` (``weight_copy_passes``: fused on an accelerator)."""
    in_l, out_l = spec.local(sc.shape)
    return weight_copy_passes(-(-(in_l * out_l) // sc.shape.z), sc.machine.accelerator)


def weight_copies_per_run(sc: Scenario) -> float:
    """How many e4m3 copies of a weight one run (one micro-batch's forward and backward) makes: on a
    grid of one rank each forward makes its own (``axon4d.nn.local_linear``), elsewhere one per
    step serves every micro-batch (``axon4d.scheduler.fp8_copies``)."""
    return 1.0 if sc.world == 1 else 1.0 / sc.micro_batches


def cast_seconds(spec: LinearSpec, sc: Scenario) -> float:
    """Seconds of one run's FP8 casts on one rank (``cast_passes``, and the weight's copies:
    ``weight_copies_per_run``), elementwise at the machine's rate."""
    casts, kernels = cast_passes(spec, sc)
    streamed = casts + weight_copy_bytes(spec, sc) * weight_copies_per_run(sc)
    return sc.machine.elementwise_time(streamed, sc.world) + kernels * sc.machine.op_overhead_s


def fits(spec: LinearSpec, sc: Scenario) -> bool:
    """Whether ``spec`` can run FP8 on ``sc``'s grid: not a bf16 layer, its block a multiple of 16."""
    if spec.embedding or spec.name in BF16_LAYERS:
        return False
    rows, cols = weight_block_shape(spec.in_features, spec.out_features, sc.shape, spec.transpose)
    return rows % ALIGN == 0 and cols % ALIGN == 0


def runs_fp8_at_all(spec: LinearSpec, sc: Scenario) -> bool:
    """Whether ``spec`` may run FP8 on ``sc`` at all: the preset is ``bf16-fp8`` and it ``fits``."""
    return sc.workload.preset == PRESET and fits(spec, sc)


def layer_choice(spec: LinearSpec, sc: Scenario) -> tuple[bool, float, float]:
    """(FP8?, bf16 seconds, FP8 seconds) of one run of ``spec``'s three GEMMs on one rank of ``sc``:
    FP8 where the preset is ``bf16-fp8``, the layer fits (``fits``) and FP8 with its casts is the
    cheaper; FP8 seconds are inf where it cannot run."""
    m, world, dt, b = sc.machine, sc.world, sc.workload.dtype, sc.tokens
    in_l, out_l = spec.local(sc.shape)
    gemms = [("nt", b, in_l, out_l), ("tn", out_l, b, in_l)] + ([("nn", b, out_l, in_l)] if spec.input_grad else [])
    bf16 = sum(m.matmul_time(f, mm, k, n, dt, world) for f, mm, k, n in gemms)
    if not runs_fp8_at_all(spec, sc):
        return False, bf16, math.inf
    fp8 = sum(gemm_seconds(m, f, mm, k, n, dt, world) for f, mm, k, n in gemms) + cast_seconds(spec, sc)
    decided = dict(sc.workload.decided_kinds)  # its kind decided with the other blocks' layers
    return decided.get(layer_kind(spec.name), fp8 < bf16), bf16, fp8


def kind_choices(sc: Scenario, specs: list[LinearSpec] | None = None) -> dict[str, tuple[bool, float, float]]:
    """(FP8?, bf16 seconds, FP8 seconds) of each layer kind (``workload.layer_kind``) of ``specs``
    (None: the workload's layers) on one rank of ``sc``, its layers' runs summed: the runtime makes
    one choice per kind (``--bf16-layers``), so a mixed model's dense blocks' MLP and its MoE blocks'
    shared experts run FP8 together, where every one of them can and FP8 is cheaper over them all
    (``layer_choice`` of each alone otherwise)."""
    sums: dict[str, tuple[float, float]] = {}  # kind -> (bf16, FP8) seconds of all its layers' runs
    for s in sc.workload.linears() if specs is None else specs:
        _, bf16_s, fp8_s = layer_choice(s, sc)  # FP8 seconds inf where the layer cannot run FP8
        b, f = sums.get(layer_kind(s.name), (0.0, 0.0))
        sums[layer_kind(s.name)] = (b + s.count * bf16_s, f + s.count * fp8_s)
    decided = dict(sc.workload.decided_kinds)
    return {k: (decided.get(k, f < b), b, f) for k, (b, f) in sums.items()}


def scale_gathers(sc: Scenario) -> list[Collective]:
    """The all-gathers over z of the FP8 layers' shards' scales, once per weight and step
    (``axon4d.scheduler.fp8_copies``: each z rank's 4-byte power-of-two scale, the largest kept, so
    that the gathered e4m3 block feeds the GEMM as it is): one per run of each layer kind that runs
    FP8 (``layer_choice`` on one micro-batch, as the step is priced), in the forward where the step
    first gathers it; none without FP8 GEMMs or with G_z = 1."""
    if sc.workload.preset != PRESET or sc.shape.z == 1:
        return []
    micro = sc.micro()
    gather = Collective(Op.ALL_GATHER, "z", SCALE_BYTES * sc.shape.z, "forward", Term.FP8_SCALE)
    return [gather for s in micro.linears if not s.embedding and layer_choice(s, micro)[0] for _ in range(s.count)]


def table(sc: Scenario) -> str:
    """Which layers of ``sc``'s workload run FP8 on its grid, and why: one line per layer with its
    local block, its GEMMs' priced seconds per run in bf16 and in FP8 (casts included)."""
    lines = [f"{'layer':<12} {'block (out_l, in_l)':>20} {'bf16 ms':>9} {'fp8 ms':>9}  runs"]
    kinds = kind_choices(sc)
    for spec in sc.workload.linears():
        if spec.embedding:
            continue
        alone, bf16_s, fp8_s = layer_choice(spec, sc)
        fp8 = kinds[layer_kind(spec.name)][0]
        block = weight_block_shape(spec.in_features, spec.out_features, sc.shape, spec.transpose)
        if fp8 != alone:  # a mixed model's kind, decided over its blocks of both kinds
            why = f"{'fp8' if fp8 else 'bf16'} (as the other blocks' {layer_kind(spec.name)}: one choice per kind)"
        elif fp8:
            why = "fp8"
        elif spec.name in BF16_LAYERS:
            why = "bf16 (kept in bf16)"
        elif not fits(spec, sc):
            why = f"bf16 (block not a multiple of {ALIGN})"
        else:
            why = "bf16 (fp8 slower here)"
        fp8_ms = f"{1e3 * fp8_s:9.3f}" if math.isfinite(fp8_s) else f"{'-':>9}"
        lines.append(f"{spec.name:<12} {str(block):>20} {1e3 * bf16_s:9.3f} {fp8_ms}  {why}")
    return "\n".join(lines)
