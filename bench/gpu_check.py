"""Everything one GPU can prove about the distributed code, in one command (``make gpu-check``).

NCCL needs one GPU per rank, so on a machine with one GPU several ranks share it through gloo, which
stages each collective through host memory ("staged"): the layers, the overlap scheduler, context
parallelism, recomputation, checkpoints and the training job then run on CUDA tensors, with every
collective, against the plain single-process model (``axon4d.measure.spawn.run_local``). What each
rank runs is in ``bench/gpu_cases.py``. The cases:

- ``exact``: a Llama (GQA) and a GPT, fp32, logits and every parameter gradient against
  ``DenseTransformer`` on the same device, on grids (1,2,1,1), (1,1,2,1), (2,1,1,1) and (1,2,2,1),
  with every overlap mechanism on and with all of them off;
- ``context``: context parallelism (G_z = 2) in bf16 compute with fp32 master weights and
  reductions against the fp32 dense model, several local heads and GQA, on torch's flash kernel
  (the case fails if another kernel ran, where the GPU has it), on the memory-efficient kernel and
  in fp32; each records the attention kernels that ran;
- ``recompute``: selective, balanced and full recomputation on (1,2,2,1), fp32, against dense;
- ``offload``: activation offload against the same model without it — fp32, every recompute mode,
  GPT and Llama, on (1,2,2,1) (and with context parallelism), every saved tensor but the weights
  moved; every copy back prefetched. Timed, alone: a Llama whose activations are GiBs with half its
  blocks offloaded, step time and peak device memory with and without (the case fails if the peak
  with offload is not below the peak without), again at the 7B's width, and the pinned copy rate;
- ``fp8``: ``bf16-fp8-gather`` against ``bf16-fp32-reduce`` on (1,1,2,1) and (1,2,2,1): loss and the
  whole gradient (Frobenius), E10's bytes halved;
- ``zero``: ZeRO-1 and ZeRO-2 against the unsharded AdamW after 5 clipped steps, fp32, on (1,1,1,2)
  and (1,2,1,2); in ``bf16-fp32-reduce`` on (1,1,1,2) after 1 step with the job's AdamW (fused on a
  GPU), the Linear weights stored in bf16 with sharded fp32 masters;
- ``micro``: two micro-batches with keep-for-backward on (1,2,2,1) in ``bf16-fp32-reduce``: blocks
  carried between the micro-batches and none after the step; peak memory against the planner's;
- ``checkpoint``: a save on (1,1,2,1) (G_z > 1) loaded on (1,2,1,1): the same weights;
- ``train``: the training job in ``bf16-fp32-reduce`` on (1,2,2,1) against the single-process run;
- ``hf``: ``train --hf`` of a saved Llama on (1,2,2,1), then ``axon4d export-hf`` as a command:
  transformers loads the trained weights bit for bit; the job's and the export's peak memory;
- ``sync``: a step of the training job (its fused AdamW and clipping) on the staged (1,2,2,1) grid
  with no host read and no synchronising call on the training thread before or after the step's
  one read of the loss and norm (``gpu_cases.no_host_sync``);
- ``moe``: one MoE layer (top-2 of 8 experts, a shared one) against ``DenseMoE`` on the same device
  on (1,1,2,1) and (1,2,2,1), fp32: the output and every gradient, one host read in the forward
  (the counts exchange) and none in the backward (``gpu_cases.moe_against_dense``); on an H200 it
  was exact (3.4e-7) and found two syncs more in the forward (``torch.bincount``, since replaced);
  again on (1,1,2,2) with experts over z (``ep=z,tp=x·y``), whose counts exchange issues its
  gather over z and its sum over z·data together and still reads the host once (on an H200: 3.9e-7);
- ``one rank``: one rank on NCCL (the production backend), fp32 exact against dense — a world of
  one runs no collective, which the record says; ``async save``: the job with background saves on
  one rank over NCCL, resumed from its step-2 checkpoint on the same losses;
- ``suite``: the GPU test suite (``pytest tests/gpu``);
- ``speed``: ``bench/gpu_block.py`` (the 20B-width block; its FP8 row and width sweep),
  ``bench/fp8_gemm_speed.py`` (FP8 GEMMs against bf16 by size) and ``bench/moe_block.py --gpu`` (a
  Mixtral-width MoE block), each alone, each saving its own JSON and line (``SPEED_BENCHES``); a
  bench fails only if it does not run.

Every multi-rank case fails unless each rank issued collectives (the distributed code ran, not a
short cut); each variant this machine cannot run is recorded as skipped with the reason — the NCCL
variant of every multi-rank case needs a GPU per rank; on the host, NCCL, the GPU suite and the
speed bench. Each tolerance (``TOLERANCES``) is ≈ 10× the worst error the H200 run measured, or an
a-priori bound where that is tighter, and the record says which.

    make gpu-check                              # python3 on PATH, which must have torch with CUDA; --jobs 6
    python bench/gpu_check.py --only context    # cases whose name starts with "context"
    python bench/gpu_check.py --on-host --only exact   # the same code on the host: checks the check
    python bench/gpu_check.py --digest          # the source digest of this tree (see below)

``--jobs N`` runs N cases side by side on the one GPU (each its own processes); the timed cases
run afterwards, alone. Without CUDA (and without ``--on-host``) it says so and exits 1. Saves
``bench/results/gpu_check_<gpu>.json``, rewritten after every case (every case: its grid,
transport, metrics, tolerance, verdict, seconds; the GPU, torch and CUDA versions, the date). The
code that ran: ``source_digest`` (SHA-256 of the library, benches, tests and build files, which a
copy without ``.git`` computes the same), ``head`` (the commit checked out, where ``.git`` is)
and ``commit`` — ``head`` when no tracked file differs from it, else None with the files that do
(``changed_files``): results of changed code belong to no commit. Commit the JSON in the commit
after ``head``, with no other change. The last line is
``gpu-check: <gpu>: N passed, M failed, K skipped (<file>)``; the exit code is 1 when a case failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_cases as run

from axon4d import device as devices
from axon4d.measure.spawn import run_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the H200 run the measured errors below come from
MEASURED_IN = "bench/results/gpu_check_nvidia_h200_cf1edc0.json"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """A case's bound on its error: ``bound`` on a GPU, ``host`` (if given) on the host; ``measured``:
    the worst error of the cases it bounds in the H200 run (``MEASURED_IN``; None: not run there yet);
    ``why``: how the bound was set."""

    bound: float
    measured: float | None
    why: str
    host: float | None = None

    def on(self, results: list[dict[str, Any]]) -> float:
        """The bound for ``results``: ``host`` where every rank ran on the host and one is given."""
        on_host = all(str(r.get("device", "cpu")).startswith("cpu") for r in results)
        return self.host if on_host and self.host is not None else self.bound


TOLERANCES = {
    "fp32": Tolerance(8e-6, 7.3e-7, "≈ 10× the worst relative loss or gradient error of an fp32 case (context fp32)"),
    "bf16": Tolerance(
        5e-2, 1.2e-2, "bf16 compute against the fp32 model: tests/test_precision.py's bound, 4× the measured (< 10×)"
    ),
    "fp8 loss": Tolerance(4e-3, 4.1e-4, "≈ 10× the measured relative loss difference from bf16 gathers"),
    "fp8 grad": Tolerance(2.0**-4, 2.07e-2, "e4m3's unit roundoff 2⁻⁴ (Frobenius), 3× the measured (< 10×)"),
    "zero fp32": Tolerance(1.2e-7, 1.16e-8, "≈ 10× the measured difference from unsharded AdamW (summation order)"),
    "zero bf16": Tolerance(1e-5, None, "not yet run on a GPU; 1400× the host's 7e-9 until it is"),
    "train": Tolerance(6e-4, 5.8e-5, "≈ 10× the measured relative loss difference from the single-process run"),
    "resume": Tolerance(1e-4, None, "not yet run on a GPU (bitwise on the host, required there)", host=0.0),
    "peak": Tolerance(0.10, None, "not yet run on a GPU; the planner's host bound (8%) + 2%", host=0.08),
}


def _bound(name: str, results: list[dict[str, Any]]) -> float:
    return TOLERANCES[name].on(results)


# -- verdicts: None when a case passed, else why not -----------------------------------------------
Verdict = Callable[[list[dict[str, Any]]], "str | None"]


def _within(key: str, tolerance: str) -> Verdict:
    def judge(results: list[dict[str, Any]]) -> str | None:
        worst, tol = max(r[key] for r in results), _bound(tolerance, results)
        return None if worst <= tol else f"{key} = {worst:.2e} > {tol:.1e} ({tolerance} tolerance)"

    return judge


def _exact(tolerance: str = "fp32") -> Verdict:
    grads, loss = _within("grad_rel", tolerance), _within("loss_rel", tolerance)
    return lambda results: grads(results) or loss(results)


def _context(tolerance: str, kernel: str) -> Verdict:
    """``_exact(tolerance)``, and on a GPU ``kernel`` ran the attention (``flash`` only where torch has
    it for this GPU: an older one runs the memory-efficient kernel, which is then what must have run)."""
    exact = _exact(tolerance)

    def judge(results: list[dict[str, Any]]) -> str | None:
        on_gpu = [r for r in results if str(r["device"]).startswith("cuda")]
        want = kernel
        if want == "flash" and on_gpu and torch.cuda.get_device_capability() < (8, 0):
            want = "efficient"  # torch's flash kernel needs sm80 or newer
        wrong = [r["kernels"] for r in on_gpu if r["kernels"] != [want]]
        return exact(results) or (f"attention ran on {wrong[0]}, not [{want!r}]" if wrong else None)

    return judge


def _offload_exact(results: list[dict[str, Any]]) -> str | None:
    """``_exact()``, something moved, and every copy back was prefetched."""
    why = _exact()(results)
    if why is None and not all(r["copies_out"] > 0 for r in results):
        why = "nothing was offloaded: the comparison proves nothing"
    late = max(r["late_fetches"] for r in results)
    return why or (f"{late} copies back were not prefetched" if late else None)


def _offload_saves(results: list[dict[str, Any]]) -> str | None:
    """The offloaded run moved bytes, prefetched them, and (where the device counts memory) peaked lower."""
    r = results[0]
    plain, offloaded = r["plain"], r["offloaded"]
    if not offloaded.get("offloaded_bytes"):
        return "nothing was offloaded"
    if offloaded["late_fetches"]:
        return f"{offloaded['late_fetches']} copies back per step were not prefetched"
    if plain["peak_bytes"] is not None and not offloaded["peak_bytes"] < plain["peak_bytes"]:
        return f"peak memory {offloaded['peak_bytes']} B with offload is not below {plain['peak_bytes']} B without"
    return None


def _fp8_close(results: list[dict[str, Any]]) -> str | None:
    """Loss and gradient within their tolerances of bf16 gathers, E10's bytes halved."""
    r = max(results, key=lambda r: r["grad_fro"])
    loss_tol, grad_tol = _bound("fp8 loss", results), _bound("fp8 grad", results)
    if r["loss_rel"] > loss_tol or r["grad_fro"] > grad_tol:
        return (
            f"loss_rel = {r['loss_rel']:.2e} (bound {loss_tol:.1e}), grad_fro = {r['grad_fro']:.2e} "
            f"(bound {grad_tol:.2e})"
        )
    if not 0 < r["e10_bytes"] <= r["e10_bytes_bf16"] / 2 + 1024:
        return f"E10 moved {r['e10_bytes']} B with fp8 gathers, {r['e10_bytes_bf16']} B with bf16"
    return None


def _zero_exact(results: list[dict[str, Any]]) -> str | None:
    """Masters within the ZeRO tolerance of unsharded AdamW; Linear weights stored in the compute
    dtype under mixed precision (fp32 otherwise); on a GPU, the job's AdamW fused where asked."""
    worst = max(max(r["zero1_rel"], r["zero2_rel"]) for r in results)
    sixteen = results[0]["precision"] != str(torch.float32)
    tolerance = "zero bf16" if sixteen else "zero fp32"
    tol = _bound(tolerance, results)
    if worst > tol:
        return f"masters differ from unsharded AdamW by {worst:.2e} > {tol:.1e} ({tolerance} tolerance)"
    want = [str(results[0]["precision"] if sixteen else torch.float32)]
    bad = [r for r in results if r["zero1_linear_dtypes"] != want or r["zero2_linear_dtypes"] != want]
    if bad:
        return f"Linear weights stored as {bad[0]['zero1_linear_dtypes']}, not {want}"
    return _kernel_kept(results)


def _kernel_kept(results: list[dict[str, Any]]) -> str | None:
    """Each ZeRO stage's steps ran the AdamW implementation the unsharded optimizer asked for the
    same ran (``gpu_cases.adamw_kernel_ran``: seen in the operations dispatched, not the keyword
    passed); where the job's AdamW was asked for on a GPU, the fused kernel."""
    for r in results:
        ran = {r["zero1_optimizer"], r["zero2_optimizer"]}
        if ran != {r["unsharded_optimizer"]}:
            return f"ZeRO's AdamW ran {sorted(ran)}, the unsharded AdamW {r['unsharded_optimizer']!r}"
        if str(r["device"]).startswith("cuda") and r["optimizer_asked"] != "default" and ran != {"fused"}:
            return f"AdamW ran {sorted(ran)} on a GPU, not the fused kernel"
    return None


def _micro_keep(results: list[dict[str, Any]]) -> str | None:
    """Blocks carried between the micro-batches, none after the step, the peak within the planner's
    tolerance."""
    r = results[0]
    if not all(c > 0 for r in results for c in r["carried_between"]):
        return f"no weight block was carried between micro-batches ({r['carried_between']}): keep did not run"
    after = max(r["carried_after"] for r in results)
    if after:
        return f"{after} layers still carry a weight block after the step"
    worst = max(results, key=lambda r: abs(r["peak_error"]))
    tol = _bound("peak", results)
    if abs(worst["peak_error"]) > tol:
        return f"the planner's peak is off by {100 * worst['peak_error']:+.1f}% (bound ±{100 * tol:.0f}%)"
    return None


def _same_weights(results: list[dict[str, Any]]) -> str | None:
    bad = [r for r in results if r["max_abs_diff"] != 0.0 or r["step"] != 1]
    return None if not bad else f"loaded weights differ by {bad[0]['max_abs_diff']:.2e} (step {bad[0]['step']})"


def _trains(results: list[dict[str, Any]]) -> str | None:
    losses, diff = results[0]["losses"], results[0]["max_rel_diff"]
    if not all(v == v and abs(v) != float("inf") for v in losses):
        return f"non-finite loss: {losses}"
    if not losses[-1] < losses[0]:
        return f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}"
    tol = _bound("train", results)
    return None if diff is not None and diff <= tol else f"max_rel_diff = {diff} > {tol:.1e} (train tolerance)"


def _resumes(results: list[dict[str, Any]]) -> str | None:
    """Both checkpoints written in the background, the resumed losses on the uninterrupted run's."""
    r = results[0]
    if not r["async_save"] or r["written"] != ["step_2", "step_4"]:
        return f"the background saves wrote {r['written']} (async: {r['async_save']}), not step_2 and step_4"
    tol = _bound("resume", results)
    if len(r["resumed"]) != len(r["losses"]) or r["loss_rel"] > tol:
        return f"resumed losses {r['resumed']} against {r['losses']} (bound {tol:.0e})"
    return None


def _round_trip(results: list[dict[str, Any]]) -> str | None:
    """The export command ran, transformers loaded every trained weight bit for bit."""
    r = results[0]
    if r["export_exit"] != 0:
        return f"axon4d export-hf exit {r['export_exit']}: {' '.join(r['export_tail'])}"
    if r["differ"] or r["unloaded"] or not r["weights"]:
        return f"exported weights differ: {r['differ'][:3]}, not trained: {r['unloaded'][:3]} ({r['weights']} compared)"
    if not all(v == v for v in r["losses"]):
        return f"non-finite loss: {r['losses']}"
    return None


def _no_sync(results: list[dict[str, Any]]) -> str | None:
    """No host read, no synchronising call on any rank; the step finite; the fused AdamW on a GPU."""
    for r in results:
        if r["reads"] or r["syncs"]:
            return "; ".join((r["reads"] + r["syncs"])[:3])
    if not all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in results):
        return "the watched step's loss is not finite"
    bad = [r for r in results if str(r["device"]).startswith("cuda") and r["optimizer"] != "fused"]
    return None if not bad else f"the job's AdamW ran {bad[0]['optimizer']!r} on a GPU, not fused"


def _moe(results: list[dict[str, Any]]) -> str | None:
    """``_exact()``, and the MoE layer read the device on the host once in its forward (its counts
    exchange) and never in its backward."""
    for r in results:
        if len(r["forward_reads"]) > 1 or len(r["forward_syncs"]) > 1 or r["backward"]:
            return "; ".join((r["forward_reads"] + r["forward_syncs"] + r["backward"])[:3])
        if not str(r["device"]).startswith("cuda") and r["host_tensor_reads"] < 1:
            return "the watch saw no read of the counts exchange: it proves nothing"
    return _exact()(results)


def _moved(results: list[dict[str, Any]]) -> str | None:
    """Every rank of a multi-rank case issued collectives (or, for the training job, moved bytes)."""
    idle = [i for i, r in enumerate(results) if not (r.get("collectives", 0) > 0 or r.get("comm_bytes", 0) > 0)]
    return None if not idle else f"rank {idle[0]} issued no collective: the distributed code did not run"


@dataclasses.dataclass
class Case:
    """One check: ``fn`` on every rank of a local world of ``world`` ranks on ``grid`` (None: ``fn``
    builds its own grids), returning metrics that ``verdict`` judges (None: passed, else why not);
    a case of several ranks also fails unless every rank issued collectives (``_moved``).
    ``tolerances``: the names in ``TOLERANCES`` its verdict applies (recorded with it);
    ``prepare``: run once in this process before the ranks start (e.g. a file they read)."""

    name: str
    world: int
    grid: tuple[int, int, int, int] | None
    fn: Callable[..., dict[str, Any]]
    args: tuple[Any, ...] = ()
    init_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    verdict: Verdict = lambda results: None
    tolerances: tuple[str, ...] = ()
    prepare: Callable[[], None] | None = None
    #: one rank on the production backend (NCCL) where there is a GPU (gloo on the host)
    production: bool = False
    #: a timing: runs alone, after every other case (``--jobs`` runs the others side by side)
    timed: bool = False

    def judge(self, results: list[dict[str, Any]]) -> str | None:
        """The case's verdict on every rank's metrics."""
        return (_moved(results) if self.world > 1 else None) or self.verdict(results)


GRIDS = [(1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 2, 1)]
BF16 = {"precision": "bf16-fp32-reduce"}


def _world(grid: tuple[int, ...]) -> int:
    return grid[0] * grid[1] * grid[2] * grid[3]


def _label(grid: tuple[int, ...]) -> str:
    return "x{}y{}z{}d{}".format(*grid)


def cases(scratch: str) -> list[Case]:
    """Every case of the module docstring, in order."""
    out = []
    for arch in run.MODELS:
        for grid in GRIDS:
            for overlap in (True, False):
                name = f"exact {arch} {_label(grid)} overlap-{'on' if overlap else 'off'}"
                kw = {"overlap": overlap}
                out.append(Case(name, _world(grid), grid, run.against_dense, (arch,), kw, _exact(), ("fp32",)))
    for grid in [(1, 1, 2, 1), (1, 2, 2, 1)]:
        name, world = f"context bf16 flash {_label(grid)}", _world(grid)
        verdict = _context("bf16", "flash")
        out.append(Case(name, world, grid, run.context_against_dense, (True,), BF16, verdict, ("bf16",)))
    grid = (1, 2, 2, 1)
    verdict = _context("bf16", "efficient")
    name = f"context bf16 efficient {_label(grid)}"
    out.append(Case(name, 4, grid, run.context_against_dense, (False,), BF16, verdict, ("bf16",)))
    verdict = _context("fp32", "efficient")
    out.append(
        Case(f"context fp32 {_label(grid)}", 4, grid, run.context_against_dense, (True,), {}, verdict, ("fp32",))
    )
    for mode in ("selective", "balanced", "full"):
        name = f"recompute {mode} {_label(grid)}"
        out.append(Case(name, 4, grid, run.against_dense, ("llama", mode), {}, _exact(), ("fp32",)))
    for context_parallel in (False, True):
        name = f"offload exact {_label(grid)}{' context' if context_parallel else ''}"
        args = (context_parallel,)
        out.append(Case(name, 4, grid, run.offload_against_plain, args, {}, _offload_exact, ("fp32",)))
    for grid in [(1, 1, 2, 1), (1, 2, 2, 1)]:
        name, fn = f"fp8 gather {_label(grid)}", run.fp8_against_bf16
        out.append(Case(name, _world(grid), None, fn, (grid,), {}, _fp8_close, ("fp8 loss", "fp8 grad")))
    for grid in [(1, 1, 1, 2), (1, 2, 1, 2)]:
        name = f"zero 1 and 2 {_label(grid)}"
        out.append(Case(name, _world(grid), grid, run.zero_against_unsharded, (), {}, _zero_exact, ("zero fp32",)))
    grid = (1, 1, 1, 2)
    name = f"zero bf16 job AdamW {_label(grid)}"
    out.append(Case(name, 2, grid, run.zero_against_unsharded, (1, True), BF16, _zero_exact, ("zero bf16",)))
    grid = (1, 2, 2, 1)
    name = f"micro keep {_label(grid)}"
    out.append(Case(name, 4, grid, run.micro_keep, (), {**BF16, "overlap": "all,keep"}, _micro_keep, ("peak",)))
    for label, wide in (("", False), (" wide", True)):
        name = f"offload speed{label} x1y1z1d1"
        out.append(Case(name, 1, (1, 1, 1, 1), run.offload_speed, (0.5, wide), BF16, _offload_saves, timed=True))
    ckpt = os.path.join(scratch, "checkpoint")
    out.append(Case("checkpoint z2 -> y2", 2, None, run.checkpoint_across_grids, (ckpt,), {}, _same_weights))
    job = os.path.join(scratch, "train")
    name = "train bf16-fp32-reduce x1y2z2d1"
    out.append(Case(name, 4, None, run.train_job, (job, "1,2,2,1"), {}, _trains, ("train",)))
    hf_path, hf_dir = os.path.join(scratch, "hf-llama"), os.path.join(scratch, "hf-run")
    prepare = lambda: run.save_hf_llama(hf_path)  # noqa: E731
    args = (hf_path, hf_dir, "1,2,2,1")
    out.append(
        Case("hf train then export x1y2z2d1", 4, None, run.hf_round_trip, args, {}, _round_trip, prepare=prepare)
    )
    out.append(Case(f"sync training step {_label(grid)}", 4, grid, run.no_host_sync, (), {}, _no_sync))
    for grid in [(1, 1, 2, 1), (1, 2, 2, 1)]:
        name = f"moe exact one read {_label(grid)}"
        out.append(Case(name, _world(grid), grid, run.moe_against_dense, (), {}, _moe, ("fp32",)))
    grid, layout = (1, 1, 2, 2), {"expert_layout": "ep=z,tp=x·y"}  # the counts gathered over z, summed over z·data
    name = f"moe exact one read ep=z {_label(grid)}"
    out.append(Case(name, _world(grid), grid, run.moe_against_dense, (), layout, _moe, ("fp32",)))
    one = (1, 1, 1, 1)
    name = "one rank exact llama x1y1z1d1"
    out.append(Case(name, 1, one, run.against_dense, ("llama",), {}, _exact(), ("fp32",), production=True))
    resume = os.path.join(scratch, "resume")
    name = "async save resume x1y1z1d1"
    out.append(Case(name, 1, None, run.async_resume, (resume,), {}, _resumes, ("resume",), production=True))
    return out


# -- running them ----------------------------------------------------------------------------------
def run_case(case: Case, transport: str, timeout: float) -> dict[str, Any]:
    """Run ``case`` over ``transport`` ("staged": gloo on one shared device, or the host; "nccl": one
    device per rank; "gloo": one rank on the host backend); its record: name, grid, transport,
    status, why, metrics, tolerances, seconds."""
    record: dict[str, Any] = {"name": case.name, "grid": case.grid, "world": case.world, "transport": transport}
    nccl = transport == "nccl"
    backend = devices.default_backend(devices.default_device(0)) if nccl else devices.default_backend(devices.HOST)
    start = time.perf_counter()
    try:
        if case.prepare is not None:
            case.prepare()
        results = run_local(
            case.world,
            case.fn,
            *case.args,
            grid=case.grid,
            init_kwargs=case.init_kwargs,
            backend=backend,
            device_per_rank=nccl,
            every_rank=True,
            timeout=timeout,
        )
        why = case.judge(results)
        record.update(status="passed" if why is None else "failed", why=why, metrics=results)
        record["tolerances"] = {
            t: {**dataclasses.asdict(TOLERANCES[t]), "applied": TOLERANCES[t].on(results)} for t in case.tolerances
        }
    except Exception as e:  # a rank died or hung: the case failed, the others still run
        record.update(status="failed", why=f"{type(e).__name__}: {e}", metrics=None)
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def skipped(name: str, transport: str, why: str) -> dict[str, Any]:
    """The record of a case this machine cannot run, with the reason."""
    return {"name": name, "transport": transport, "status": "skipped", "why": why}


def plan_runs(
    scratch: str, on_host: bool, gpus: int, chosen: Callable[[str], bool]
) -> tuple[list[tuple[Case, str]], list[dict[str, Any]]]:
    """The (case, transport) runs of the chosen cases on this machine, and the skipped records of
    those it cannot run: each case on the staged transport; a multi-rank case also on NCCL where
    there is a GPU per rank; a production case on NCCL (on the host, on gloo). Each transport's
    cases write under their own directory of ``scratch``."""
    runs: list[tuple[Case, str]] = []
    skips: list[dict[str, Any]] = []
    for case in cases(os.path.join(scratch, "staged")):
        if not chosen(case.name):
            continue
        if case.production:
            runs.append((case, "gloo" if on_host else "nccl"))
            continue
        runs.append((case, "staged"))
        if case.world >= 2 and on_host:
            skips.append(skipped(case.name, "nccl", "NCCL needs CUDA: the host has none"))
        elif case.world >= 2 and gpus < case.world:
            why = f"NCCL needs one GPU per rank: {case.world} ranks, {gpus} GPU{'s' if gpus != 1 else ''} here"
            skips.append(skipped(case.name, "nccl", why))
    for case in cases(os.path.join(scratch, "nccl")):
        if chosen(case.name) and not case.production and 2 <= case.world <= gpus and not on_host:
            runs.append((case, "nccl"))
    return runs, skips


#: the most lines of failure detail the suite's record keeps
FAILURE_LINES = 40


def run_suite(timeout: float, path: str = "tests/gpu") -> dict[str, Any]:
    """``pytest tests/gpu`` (or ``path``) in a subprocess: its counts, its output's last lines and,
    for each failing test, its one-line traceback (``--tb=line``: the file, the line and the
    assertion's message) and its summary line, so a GPU run says why a test failed, not only which."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "--tb=line", "-rfE"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "200"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = lines[-15:]
        failures = [ln for ln in lines if re.match(r"(FAILED|ERROR) |\S+\.py:\d+: ", ln)][:FAILURE_LINES]
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", "\n".join(tail[-1:]))}
        ok = proc.returncode == 0 and counts.get("passed", 0) > 0
        why = None if ok else f"pytest exit {proc.returncode}: {tail[-1] if tail else ''}"
    except subprocess.TimeoutExpired:
        tail, failures, counts, ok, why = [], [], {}, False, f"pytest ran past {timeout:.0f} s"
    return {
        "name": "suite tests/gpu",
        "transport": "default",
        "status": "passed" if ok else "failed",
        "why": why,
        "metrics": {"counts": counts, "tail": tail, "failures": failures},
        "seconds": round(time.perf_counter() - start, 2),
    }


#: the benches the ``speed`` cases run, each alone on the device after the others: (case name,
#: script and arguments under bench/, the prefix of its headline line, what it proves); each saves
#: its own JSON under bench/results/ and fails only if it does not run
SPEED_BENCHES = (
    (
        "speed 20B block",
        ["gpu_block.py", "--profile", "7168"],
        "gpu: ",
        "the 20B-width block against plain PyTorch, its FP8 row, sweep and profile",
    ),
    ("speed FP8 GEMMs", ["fp8_gemm_speed.py"], "fp8_gemm_speed: ", "FP8 GEMMs against bf16 by size"),
    (
        "speed MoE block",
        [
            "moe_block.py",
            "--gpu",
            "--hidden",
            "4096",
            "--ffn",
            "14336",
            "--experts",
            "8",
            "--topk",
            "2",
            "--tokens",
            "8192",
        ],
        "moe_block --gpu: ",
        "a Mixtral-width MoE block: tokens/s, MFU, grouped GEMM against the loop",
    ),
)


def run_speed(name: str, script: list[str], prefix: str, timeout: float) -> dict[str, Any]:
    """``bench/<script>`` in a subprocess: its headline (the last line starting with ``prefix``);
    for the 20B block also whether it met its target (step within 1.00× of the fair plain-PyTorch
    baseline's)."""
    start = time.perf_counter()
    cmd = [sys.executable, os.path.join(ROOT, "bench", script[0]), *script[1:]]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        line = next((t for t in reversed(tail) if t.startswith(prefix)), "")
        ok = proc.returncode == 0 and bool(line)
        why = line if ok else f"bench/{script[0]} exit {proc.returncode}: {tail[-1] if tail else ''}"
        metrics: dict[str, Any] = {"line": line, "tail": tail}
        if script[0] == "gpu_block.py":
            ratio = re.search(r"\(ratio ([0-9.]+)", line)
            ok = ok and ratio is not None
            metrics["within_1.00"] = ratio is not None and float(ratio.group(1)) <= 1.0
    except subprocess.TimeoutExpired:
        ok, why, metrics = False, f"bench/{script[0]} ran past {timeout:.0f} s", {}
    return {
        "name": name,
        "transport": "none",
        "status": "passed" if ok else "failed",
        "why": why,
        "metrics": metrics,
        "seconds": round(time.perf_counter() - start, 2),
    }


# -- which code ran --------------------------------------------------------------------------------
#: the files whose code a run depends on: the Python files under these directories (not results,
#: caches or hidden ones) and the build files
DIGESTED = ("axon4d", "bench", "tests")
BUILD_FILES = ("Makefile", "setup.cfg", "pyproject.toml")


def source_digest(root: str = ROOT) -> str:
    """SHA-256 over the sorted relative paths and contents of ``DIGESTED``'s Python files and
    ``BUILD_FILES`` under ``root``: the same for a git checkout and a copy without ``.git``, so a
    result names the code it ran. ``git worktree add`` of the recorded commit and ``--digest`` there
    shows whether a result belongs to it."""
    files = [f for f in BUILD_FILES if os.path.isfile(os.path.join(root, f))]
    for top in DIGESTED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d not in ("results", "__pycache__") and not d.startswith("."))
            files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    h = hashlib.sha256()
    for rel in sorted(f.replace(os.sep, "/") for f in files):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def _git(*args: str) -> str | None:
    """``git args`` in the repository's stdout, or None where there is no git checkout."""
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout if out.returncode == 0 else None


def code_that_ran() -> dict[str, Any]:
    """``source_digest``, ``head`` (the full commit checked out; None without ``.git``), the tracked
    files that differ from it, and ``commit``: ``head`` when none does, else None."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "-uno")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    head = head.strip() if head else None
    return {
        "source_digest": source_digest(),
        "head": head,
        "commit": head if head and status is not None and not changed else None,
        "changed_files": changed,
    }


def _device_name(on_host: bool) -> str:
    return "host" if on_host else torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", default="", help="run only the cases whose name starts with one of these (comma-separated)"
    )
    p.add_argument("--on-host", action="store_true", help="run on the host without CUDA (checks the check itself)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/gpu_check_<gpu>.json)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take before it counts as failed")
    p.add_argument(
        "--jobs", type=int, default=1, help="cases run side by side on the one device (timings still run alone, last)"
    )
    p.add_argument("--digest", action="store_true", help="print this tree's source digest and exit")
    args = p.parse_args(argv)
    if args.digest:
        print(source_digest())
        return 0
    if not (devices.accelerator_available() or args.on_host):
        print(
            "gpu-check: no CUDA device here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}): run it on a GPU machine, with a torch that has CUDA; "
            "--on-host runs the same cases on the host to check the check",
            file=sys.stderr,
        )
        return 1
    if args.on_host:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned ranks see no accelerator either
    gpus = 0 if args.on_host else torch.cuda.device_count()
    name = _device_name(args.on_host)
    prefixes = [s.strip() for s in args.only.split(",") if s.strip()]

    def chosen(case_name: str) -> bool:
        return not prefixes or any(case_name.startswith(s) for s in prefixes)

    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = args.out or os.path.join(ROOT, "bench", "results", f"gpu_check_{slug}.json")
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    code = code_that_ran()
    if code["commit"] is None:
        print(
            f"gpu-check: the code differs from a commit ({code['changed_files'] or 'no git checkout'}); "
            f"source digest {code['source_digest'][:12]} names it"
        )
    header = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
        **code,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": name,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tolerances_from": MEASURED_IN,
    }

    def counts() -> dict[str, int]:
        return {s: sum(1 for r in records if r["status"] == s) for s in ("passed", "failed", "skipped")}

    def record(r: dict[str, Any]) -> None:
        """Keep ``r``, print its line, and rewrite the JSON: a run cut short keeps what it finished."""
        with lock:
            records.append(r)
            print(
                f"{r['status']:>7}  {r['name']} [{r.get('transport', '-')}] {r.get('seconds', 0):.1f} s  {r.get('why') or ''}"
            )
            sys.stdout.flush()
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "w") as f:
                json.dump({**header, "counts": counts(), "cases": records}, f, indent=1, default=str)

    with tempfile.TemporaryDirectory(prefix="axon4d-gpu-check-") as scratch:
        runs, skips = plan_runs(scratch, args.on_host, gpus, chosen)
        for s in skips:
            record(s)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [
                pool.submit(lambda c=c, t=t: record(run_case(c, t, args.timeout))) for c, t in runs if not c.timed
            ]
            if chosen("suite"):
                if args.on_host:
                    record(skipped("suite tests/gpu", "default", "the GPU suite needs CUDA: the host has none"))
                else:
                    futures.append(pool.submit(lambda: record(run_suite(args.timeout * 4))))
            for f in futures:
                f.result()
        for c, t in runs:  # the timings, alone on the device
            if c.timed:
                record(run_case(c, t, args.timeout))
    for bench, script, prefix, _ in SPEED_BENCHES:  # the timings, alone on the device, last
        if not chosen(bench):
            continue
        if args.on_host:
            record(skipped(bench, "none", f"{bench[len('speed ') :]}: a GPU's speed; the host has none"))
        else:
            record(run_speed(bench, script, prefix, args.timeout))
    c = counts()
    print(
        f"gpu-check: {name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped ({os.path.relpath(out, ROOT)})"
    )
    return 1 if c["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
