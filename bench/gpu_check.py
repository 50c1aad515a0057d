"""Everything one GPU can prove about the distributed code, in one command (``make gpu-check``).

NCCL needs one GPU per rank, so on a machine with one GPU several ranks share it through gloo, which
stages each collective through host memory: the layers, the overlap scheduler, context parallelism,
recomputation and checkpoints then run on CUDA tensors, with every collective, against the plain
single-process model (``axon4d.measure.spawn.run_local``). The cases:

- ``exact``: a Llama (GQA) and a GPT, fp32, logits and every parameter gradient against
  ``DenseTransformer`` on the same device (≤ 1e-4 relative), on grids (1,2,1,1), (1,1,2,1),
  (2,1,1,1) and (1,2,2,1), with every overlap mechanism on and with all of them off;
- ``context``: context parallelism (G_z = 2) in bf16 compute with fp32 master weights and
  reductions against the fp32 dense model (≤ 5e-2), several local heads and GQA — the cases whose
  CUDA kernel contracts a CPU run cannot check: on torch's flash kernel (where the GPU has it: the
  case fails if another kernel ran), on the memory-efficient kernel (flash SDPA switched off), and
  in fp32 (the memory-efficient kernel, ≤ 1e-4); each records the attention kernels that ran;
- ``recompute``: selective, balanced and full recomputation on (1,2,2,1), fp32, against dense;
- ``offload``: activation offload (``Transformer(offload=)``, axon4d/offload.py) against the same
  model without it — fp32, every recompute mode, GPT and Llama, on (1,2,2,1) (and with context
  parallelism), every saved tensor but the weights moved (size threshold 0): loss and gradients
  within 1e-4 (bitwise is recorded; CUDA kernels need not be deterministic), every copy back
  prefetched; and on one rank a Llama with activations large enough to matter (8 blocks of width
  1024, 16384 tokens, bf16-fp32-reduce; a small one on the host) with half its blocks offloaded:
  median step time and peak device memory (``torch.cuda.max_memory_allocated``) with and without,
  and the bytes moved — the case fails if the peak with offload is not below the peak without —
  again at the 7B's width (4 blocks of 4096), and the pinned copy rate each way at a block's size;
- ``fp8``: ``bf16-fp8-gather`` against ``bf16-fp32-reduce`` on (1,1,2,1) and (1,2,2,1): loss within
  1e-2, the whole gradient within e4m3's unit roundoff 2⁻⁴ (Frobenius), E10's bytes halved;
- ``zero``: ZeRO-1 and ZeRO-2 against the unsharded AdamW after 5 clipped steps, fp32, on (1,1,1,2)
  and (1,2,1,2): the parameters within 1e-5; and in ``bf16-fp32-reduce`` on (1,1,1,2), where ZeRO
  stores the Linear weights in bf16 with sharded fp32 masters, after 1 step: the masters within
  1e-5 of the unsharded fp32 parameters and every Linear weight bf16 (one step: the clipping
  norm's other summation order moves it by an ulp, and the steps after it amplify that through
  the bf16 weights that round the other way);
- ``checkpoint``: a save on (1,1,2,1) (G_z > 1) loaded on (1,2,1,1): the same weights;
- ``train``: the training job in ``bf16-fp32-reduce`` on (1,2,2,1) for a few steps, against the
  single-process run of the same model (``--compare-single``);
- ``nccl``: one rank on NCCL (the production backend), fp32 exact against dense;
- ``sync``: a training step (forward, backward, optimizer step) under
  ``torch.cuda.set_sync_debug_mode("error")``: no host synchronisation on the hot path;
- ``suite``: the GPU test suite (``pytest tests/gpu``);
- ``speed``: ``bench/gpu_block.py`` — one block of the 20B width on one GPU in bf16, axon4d's step
  against plain PyTorch's, and its MFU (its own JSON, ``bench/results/gpu_block_<gpu>.json``, and
  its line ``gpu: 20B width 7168, 1 rank, bf16: …``); it fails only if the bench does not run, and
  records whether the step is within 1.05× of plain PyTorch's (issue 30's target).

With two or more GPUs the multi-rank cases also run on NCCL, one GPU per rank.

    make gpu-check                              # python3 on PATH, which must have torch with CUDA; --jobs 6
    python bench/gpu_check.py --only context    # cases whose name starts with "context"
    python bench/gpu_check.py --on-host --only exact   # the same code on the host: checks the check

``--jobs N`` runs N cases side by side on the one GPU (each its own processes); the timed cases
(offload speed, speed) run afterwards, alone. Without CUDA (and without ``--on-host``) it says so
and exits 1. Saves ``bench/results/gpu_check_<gpu>.json``, rewritten after every case (every
case: its grid, transport, metrics, verdict, seconds; the GPU, torch and CUDA versions, the commit
and whether tracked files differed from it, the date). The last line is
``gpu-check: <gpu>: N passed, M failed, K skipped (<file>)``; the exit code is 1 when a case failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import axon4d
from axon4d import activations, checkpoint, grads
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.measure import kernels
from axon4d.measure.spawn import run_local
from axon4d.measure.timing import Timer
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.train.batches import accumulate
from axon4d.train.config import TrainConfig
from axon4d.train.loop import train
from axon4d.zero import shard_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: head_dim 16: a multiple of 8, so CUDA runs attention in its fused kernels
MODELS = {
    "llama": ModelConfig(
        n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128, seq_len=16, arch="llama"
    ),
    "gpt": ModelConfig(n_layers=2, hidden=64, n_heads=4, vocab_size=128, seq_len=16, arch="gpt"),
}
FP32_TOL = 1e-4  # fp32 on a GPU: other summation orders than the dense model's
BF16_TOL = 5e-2  # bf16 compute against the fp32 model (tests/test_precision.py's bound)
TRAIN_TOL = 5e-2  # bf16 training job against the single-process run, relative loss difference
FP8_TOL = 2.0**-4  # bf16-fp8-gather against bf16-fp32-reduce: e4m3's unit roundoff (tests/test_fp8.py)
ZERO_TOL = 1e-5  # ZeRO against unsharded AdamW, fp32: summation order only (CPU: 1e-6)
ZERO_BF16_TOL = 1e-5  # the same in bf16-fp32-reduce after 1 step (CPU: 7e-9; see the module docstring)
FLOOR = 1e-3  # gradients that vanish in theory are compared on this scale


@dataclasses.dataclass
class Case:
    """One check: ``fn`` on every rank of a local world of ``world`` ranks on ``grid`` (None: ``fn``
    builds its own grids), returning metrics that ``verdict`` judges (None: passed, else why not)."""

    name: str
    world: int
    grid: tuple[int, int, int, int] | None
    fn: Callable[..., dict[str, Any]]
    args: tuple[Any, ...] = ()
    init_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    verdict: Callable[[list[dict[str, Any]]], str | None] = lambda results: None
    needs_cuda: bool = False
    #: a timing: runs alone, after every other case (``--jobs`` runs the others side by side)
    timed: bool = False


# -- what every rank runs --------------------------------------------------------------------------
def _highest_precision() -> None:
    """fp32 matmuls in full fp32 (no TF32): the exactness cases compare to fp32 rounding."""
    torch.set_float32_matmul_precision("highest")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(FLOOR))


def _batch(cfg: ModelConfig, device: torch.device, sequences: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (sequences, cfg.seq_len + 1), generator=gen)
    return devices.to_device(ids, device)


def against_dense(grid: Any, arch: str, recompute: str = "none", context_parallel: bool = False) -> dict[str, Any]:
    """Loss and every parameter gradient of ``Transformer`` against ``DenseTransformer`` (fp32,
    same device, same batch); the model computes in the grid's precision."""
    _highest_precision()
    cfg = MODELS[arch]
    torch.manual_seed(0)
    dense = DenseTransformer(cfg, device=grid.device)
    model = Transformer.from_dense(dense, recompute=recompute, context_parallel=context_parallel)
    ids = _batch(cfg, grid.device)
    shard = activations.shard_sequence if context_parallel else axon4d.shard_batch
    grid.comm.log.clear()
    loss = model.loss(shard(ids[:, :-1]), shard(ids[:, 1:]))
    loss.backward()
    step_collectives = len(grid.comm.log.records)  # the forward's and backward's, before to_dense gathers
    ref_loss = dense.loss(ids[:, :-1], ids[:, 1:])
    ref_loss.backward()
    got = model.to_dense(grads=True)
    ref = dict(dense.named_parameters())
    errors = {name: _rel(p.grad, ref[name].grad) for name, p in got.named_parameters()}
    worst = max(errors, key=errors.__getitem__)
    total = grid.comm.all_reduce(loss.detach().float().reshape(1).clone(), "batch", tag="check").wait()
    return {
        "device": str(grid.device),
        "loss_rel": abs(float(total) / grid.size("batch") - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
        "grad_rel": errors[worst],
        "worst_param": worst,
        "collectives": step_collectives,
    }


def context_against_dense(grid: Any, flash: bool) -> dict[str, Any]:
    """``against_dense`` for the Llama (GQA) under context parallelism, with torch's flash SDPA
    switched on or off for this process, adding the attention kernels that ran
    (``axon4d.device.attention.kernel_for``'s choices)."""
    from axon4d.device import attention as kernels

    choose, ran = kernels.kernel_for, set()

    def recording(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str:
        kernel = choose(q, k, causal)
        ran.add(kernel)
        return kernel

    flash_before = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(flash)
    kernels.kernel_for = recording
    try:
        result = against_dense(grid, "llama", "none", True)
    finally:
        kernels.kernel_for = choose
        torch.backends.cuda.enable_flash_sdp(flash_before)
    return {**result, "kernels": sorted(ran)}


def _offload_steps(
    grid: Any, arch: str, mode: str, context_parallel: bool, offload: Any
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], Any]:
    """Two SGD steps of ``MODELS[arch]``: losses, gradients, the offloader's counters (None without)."""
    cfg = MODELS[arch]
    torch.manual_seed(0)
    dense = DenseTransformer(cfg, device=grid.device)
    model = Transformer.from_dense(dense, recompute=mode, context_parallel=context_parallel, offload=offload)
    if model.offloader is not None:
        model.offloader.min_bytes = 0  # every saved tensor but the weights goes to the host and back
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    shard = activations.shard_sequence if context_parallel else axon4d.shard_batch
    ids = _batch(cfg, grid.device)
    losses, grads = [], []
    for _ in range(2):
        opt.zero_grad()
        loss = model.loss(shard(ids[:, :-1]), shard(ids[:, 1:]))
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, model.offloader.stats() if model.offloader is not None else None


def offload_against_plain(grid: Any, context_parallel: bool) -> dict[str, Any]:
    """Every arch and recompute mode with all blocks offloaded against the same model without
    offload: the worst relative loss and gradient differences, whether all were bitwise equal, the
    storages moved and the copies back that were not prefetched."""
    _highest_precision()
    from axon4d.recompute_mode import RECOMPUTE_MODES

    grad_rel = loss_rel = 0.0
    bitwise, moved, late = True, 0, 0
    for arch in MODELS:
        for mode in RECOMPUTE_MODES:
            ref_losses, ref_grads, _ = _offload_steps(grid, arch, mode, context_parallel, None)
            losses, grads, stats = _offload_steps(grid, arch, mode, context_parallel, 1.0)
            loss_rel = max([loss_rel] + [_rel(a, b) for a, b in zip(losses, ref_losses)])
            grad_rel = max([grad_rel] + [_rel(g[n], r[n]) for g, r in zip(grads, ref_grads) for n in r])
            bitwise = bitwise and all(torch.equal(g[n], r[n]) for g, r in zip(grads, ref_grads) for n in r)
            moved, late = moved + stats.copies_out, late + stats.late_fetches
    return {
        "device": str(grid.device),
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
        "bitwise": bitwise,
        "copies_out": moved,
        "late_fetches": late,
    }


#: the step-time model of the offload case: on a GPU one whose saved activations are GiBs, on the
#: host a tiny one (it only checks the check)
OFFLOAD_SPEED = {
    "accelerator": (
        ModelConfig(
            n_layers=8,
            hidden=1024,
            n_heads=8,
            n_kv_heads=2,
            ffn_hidden=2816,
            vocab_size=32000,
            seq_len=2048,
            arch="llama",
        ),
        8,
    ),
    "host": (MODELS["llama"].replace(n_layers=4, hidden=128, ffn_hidden=256, seq_len=64), 8),
}
#: a width where a block's compute is long against its activations' copies (the 7B's)
OFFLOAD_WIDE = {
    "accelerator": (
        OFFLOAD_SPEED["accelerator"][0].replace(n_layers=4, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=11008),
        4,
    ),
    "host": OFFLOAD_SPEED["host"],
}


def offload_speed(grid: Any, fraction: float, wide: bool = False, steps: int = 5) -> dict[str, Any]:
    """Median step time (SGD; after two warm-up steps) and peak device memory of one training step
    with and without ``fraction`` of the blocks offloaded, and what the offloader moved
    (``OFFLOAD_SPEED``'s model, or with ``wide`` ``OFFLOAD_WIDE``'s)."""
    table = OFFLOAD_WIDE if wide else OFFLOAD_SPEED
    cfg, sequences = table["accelerator" if devices.is_accelerator(grid.device) else "host"]
    ids = _batch(cfg, grid.device, sequences)
    x, y = axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])

    def measure(offload: float | None) -> dict[str, Any]:
        torch.manual_seed(0)
        model = Transformer(cfg, offload=offload)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model.loss(x, y).backward()
            opt.step()

        step(), step()
        devices.synchronize(grid.device)
        devices.reset_peak_memory(grid.device)
        if model.offloader is not None:
            model.offloader.reset_peaks()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            devices.synchronize(grid.device)
            times.append(time.perf_counter() - start)
        out: dict[str, Any] = {
            "step_s": sorted(times)[len(times) // 2],
            "peak_bytes": devices.peak_memory_allocated(grid.device),
        }
        if model.offloader is not None:
            stats = model.offloader.stats()
            out.update(
                offloaded_bytes=stats.peak_host_bytes,
                block_bytes=stats.peak_block_bytes,
                resident_peak_bytes=stats.peak_resident_bytes,
                late_fetches=stats.late_fetches // steps,
            )
        return out

    plain = measure(None)
    offloaded = measure(fraction)
    nbytes = max(offloaded.get("block_bytes", {}).values(), default=1 << 20)
    return {
        "device": str(grid.device),
        "model": f"{cfg.arch} {cfg.n_layers}x{cfg.hidden}, {sequences}x{cfg.seq_len} tokens",
        "offload": fraction,
        "plain": plain,
        "offloaded": offloaded,
        "step_ratio": offloaded["step_s"] / plain["step_s"],
        # the copy rate each way at one block's size (axon4d.measure.kernels.host_link)
        "host_link": {
            **kernels.host_link(Timer(grid, reps=5), nbytes),
            "bytes": nbytes,
        },
    }


def checkpoint_across_grids(_: Any, directory: str) -> dict[str, Any]:
    """Train a step on (1,1,2,1), save, load on (1,2,1,1): the weights must be the same."""
    _highest_precision()
    cfg = MODELS["llama"]
    grid = axon4d.init(grid=(1, 1, 2, 1), seed=0)
    model = Transformer(cfg, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _batch(cfg, grid.device)
    model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    opt.step()
    checkpoint.save(directory, model, grid, opt, step=1, overwrite=True)
    saved = {k: devices.to_host(v) for k, v in model.to_dense().state_dict().items()}
    axon4d.shutdown()
    grid = axon4d.init(grid=(1, 2, 1, 1))
    model = Transformer(cfg, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = checkpoint.load(directory, model, grid, opt)
    loaded = {k: devices.to_host(v) for k, v in model.to_dense().state_dict().items()}
    axon4d.shutdown()
    diff = max(float((saved[k] - loaded[k]).abs().max()) for k in saved)
    return {"step": int(meta["step"]), "max_abs_diff": diff, "tensors": len(saved)}


def train_job(_: Any, directory: str, grid: str) -> dict[str, Any]:
    """The training job in bf16-fp32-reduce, compared with the single-process run on rank 0."""
    cfg = TrainConfig(
        grid=grid,
        model="tiny",
        steps=8,
        batch_size=8,
        warmup_steps=2,
        precision="bf16-fp32-reduce",
        out_dir=directory,
        overwrite=True,
        compare_single=True,
        progress=False,
    )
    summary = train(cfg)
    losses = [float(v) for v in summary["losses"]]
    return {"losses": losses, "max_rel_diff": summary.get("max_rel_diff")}


def no_host_sync(grid: Any) -> dict[str, Any]:
    """A training step (forward, backward, AdamW) with CUDA's sync debug mode on "error"; the
    loss is not read (that read is the step's one intended synchronisation)."""
    cfg = MODELS["llama"]
    torch.manual_seed(0)
    model = Transformer(cfg, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _batch(cfg, grid.device)
    x, y = axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])

    def step() -> None:
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # first: allocations, kernel choices, optimizer state
    devices.synchronize(grid.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        error = None
    except RuntimeError:
        error = traceback.format_exc(limit=12)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"error": error}


def _flat_run(cfg: ModelConfig, grid: Any, ids: torch.Tensor) -> tuple[float, torch.Tensor, int]:
    """One forward and backward of ``Transformer(cfg)`` (seed 0): the mean loss over the batch, the
    whole model's flat gradient and the bytes E10 moved."""
    torch.manual_seed(0)
    model = Transformer.from_dense(DenseTransformer(cfg, device=grid.device))
    grid.comm.log.clear()
    loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
    loss.backward()
    e10 = sum(r.payload_bytes for r in grid.comm.log.records if str(r.tag).startswith("E10"))
    mean = grid.comm.all_reduce(loss.detach().float().reshape(1).clone(), "batch", tag="check").wait()
    flat = torch.cat([p.grad.reshape(-1) for p in model.to_dense(grads=True).parameters()])
    return float(mean) / grid.size("batch"), devices.to_host(flat).double(), e10


def fp8_against_bf16(_: Any, grid: tuple[int, int, int, int]) -> dict[str, Any]:
    """The Llama on ``grid`` with ``bf16-fp8-gather`` against ``bf16-fp32-reduce`` (E10 in e4m3
    with a per-shard scale, docs/design.md §3): relative loss difference, the whole gradient's
    relative Frobenius difference, and the E10 bytes of each."""
    cfg = MODELS["llama"]
    out: dict[str, Any] = {}
    for name in ("bf16-fp32-reduce", "bf16-fp8-gather"):
        g = axon4d.init(grid=grid, precision=name, seed=0)
        out[name] = _flat_run(cfg, g, _batch(cfg, g.device))
        device = str(g.device)
        axon4d.shutdown()
    (ref_loss, ref, ref_e10), (loss, got, e10) = out["bf16-fp32-reduce"], out["bf16-fp8-gather"]
    return {
        "device": device,
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "grad_fro": float((got - ref).norm() / ref.norm()),
        "e10_bytes": e10,
        "e10_bytes_bf16": ref_e10,
    }


def zero_against_unsharded(grid: Any, steps: int = 5) -> dict[str, Any]:
    """ZeRO-1 and ZeRO-2 (axon4d.zero) against the unsharded AdamW, in the grid's precision,
    ``steps`` clipped steps of the GPT side by side: for each stage the relative difference of this
    rank's master parts from the unsharded parameters over the whole model (the parameters
    themselves in fp32, where the masters are views of them), and the dtypes of the Linear weights."""
    _highest_precision()
    cfg = MODELS["gpt"]
    runs = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = Transformer(cfg, grid=grid)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
        runs[stage] = (model, opt if stage == 0 else shard_optimizer(opt, model, grid, stage=stage))
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
        for model, opt in runs.values():
            accumulate(model, (ids,), grid)
            grads.clip_grad_norm_(model, 0.05, grid)
            opt.step()
            opt.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"device": str(grid.device), "precision": str(grid.precision.compute)}
    with torch.no_grad():
        ref = [p.double().reshape(-1) for p in runs[0][0].parameters()]
        for stage in (1, 2):
            model, opt = runs[stage]
            diff = norm = 0.0
            for p, r in zip(model.parameters(), ref):
                start, master = opt.owned(p)
                part = r[start : start + master.numel()]
                diff += float((master.double() - part).square().sum())
                norm += float(part.square().sum())
            out[f"zero{stage}_rel"] = (diff / norm) ** 0.5
            out[f"zero{stage}_linear_dtypes"] = sorted(
                {str(m.weight.dtype) for m in model.modules() if isinstance(m, axon4d.Linear)}
            )
            opt.release()
    return out


# -- verdicts --------------------------------------------------------------------------------------
def _within(key: str, tol: float) -> Callable[[list[dict[str, Any]]], str | None]:
    def judge(results: list[dict[str, Any]]) -> str | None:
        worst = max(r[key] for r in results)
        return None if worst <= tol else f"{key} = {worst:.2e} > {tol:.0e}"

    return judge


def _exact(tol: float) -> Callable[[list[dict[str, Any]]], str | None]:
    grads, loss = _within("grad_rel", tol), _within("loss_rel", tol)
    return lambda results: grads(results) or loss(results)


def _context(tol: float, kernel: str) -> Callable[[list[dict[str, Any]]], str | None]:
    """``_exact(tol)``, and on a GPU ``kernel`` ran the attention (``flash`` only where torch has it
    for this GPU: an older one runs the memory-efficient kernel, which is then what must have run)."""
    exact = _exact(tol)

    def judge(results: list[dict[str, Any]]) -> str | None:
        on_gpu = [r for r in results if str(r["device"]).startswith("cuda")]
        want = kernel
        if want == "flash" and on_gpu and torch.cuda.get_device_capability() < (8, 0):
            want = "efficient"  # torch's flash kernel needs sm80 or newer
        wrong = [r["kernels"] for r in on_gpu if r["kernels"] != [want]]
        return exact(results) or (f"attention ran on {wrong[0]}, not [{want!r}]" if wrong else None)

    return judge


def _offload_exact(results: list[dict[str, Any]]) -> str | None:
    """``_exact(FP32_TOL)``, something moved, and every copy back was prefetched."""
    why = _exact(FP32_TOL)(results)
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
    """Within e4m3 rounding of the bf16 gathers (tests/test_fp8.py's bound), half E10's bytes."""
    r = max(results, key=lambda r: r["grad_fro"])
    if r["loss_rel"] > 1e-2 or r["grad_fro"] > FP8_TOL:
        return f"loss_rel = {r['loss_rel']:.2e} (bound 1e-2), grad_fro = {r['grad_fro']:.2e} (bound {FP8_TOL:.2e})"
    if not 0 < r["e10_bytes"] <= r["e10_bytes_bf16"] / 2 + 1024:
        return f"E10 moved {r['e10_bytes']} B with fp8 gathers, {r['e10_bytes_bf16']} B with bf16"
    return None


def _zero_exact(results: list[dict[str, Any]]) -> str | None:
    worst = max(max(r["zero1_rel"], r["zero2_rel"]) for r in results)
    sixteen = results[0]["precision"] != str(torch.float32)
    tol = ZERO_BF16_TOL if sixteen else ZERO_TOL
    if worst > tol:
        return f"masters differ from unsharded AdamW by {worst:.2e} > {tol:.0e}"
    want = [str(results[0]["precision"] if sixteen else torch.float32)]
    bad = [r for r in results if r["zero1_linear_dtypes"] != want or r["zero2_linear_dtypes"] != want]
    return None if not bad else f"Linear weights stored as {bad[0]['zero1_linear_dtypes']}, not {want}"


def _same_weights(results: list[dict[str, Any]]) -> str | None:
    bad = [r for r in results if r["max_abs_diff"] != 0.0 or r["step"] != 1]
    return None if not bad else f"loaded weights differ by {bad[0]['max_abs_diff']:.2e} (step {bad[0]['step']})"


def _trains(results: list[dict[str, Any]]) -> str | None:
    losses, diff = results[0]["losses"], results[0]["max_rel_diff"]
    if not all(v == v and abs(v) != float("inf") for v in losses):
        return f"non-finite loss: {losses}"
    if not losses[-1] < losses[0]:
        return f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}"
    return None if diff is not None and diff <= TRAIN_TOL else f"max_rel_diff = {diff} > {TRAIN_TOL}"


def _no_error(results: list[dict[str, Any]]) -> str | None:
    errors = [r["error"] for r in results if r.get("error")]
    return errors[0] if errors else None


# -- the cases -------------------------------------------------------------------------------------
GRIDS = [(1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 2, 1)]


def _world(grid: tuple[int, ...]) -> int:
    return grid[0] * grid[1] * grid[2] * grid[3]


def _label(grid: tuple[int, ...]) -> str:
    return "x{}y{}z{}d{}".format(*grid)


def cases(scratch: str) -> list[Case]:
    """Every case of the module docstring, in order."""
    out = []
    for arch in MODELS:
        for grid in GRIDS:
            for overlap in (True, False):
                name = f"exact {arch} {_label(grid)} overlap-{'on' if overlap else 'off'}"
                kw = {"overlap": overlap}
                out.append(Case(name, _world(grid), grid, against_dense, (arch,), kw, _exact(FP32_TOL)))
    bf16 = {"precision": "bf16-fp32-reduce"}
    for grid in [(1, 1, 2, 1), (1, 2, 2, 1)]:
        name, world = f"context bf16 flash {_label(grid)}", _world(grid)
        out.append(Case(name, world, grid, context_against_dense, (True,), bf16, _context(BF16_TOL, "flash")))
    grid = (1, 2, 2, 1)
    name = f"context bf16 efficient {_label(grid)}"
    out.append(Case(name, 4, grid, context_against_dense, (False,), bf16, _context(BF16_TOL, "efficient")))
    name = f"context fp32 {_label(grid)}"
    out.append(Case(name, 4, grid, context_against_dense, (True,), {}, _context(FP32_TOL, "efficient")))
    for mode in ("selective", "balanced", "full"):
        grid = (1, 2, 2, 1)
        out.append(
            Case(f"recompute {mode} {_label(grid)}", 4, grid, against_dense, ("llama", mode), {}, _exact(FP32_TOL))
        )
    for grid, context_parallel in [((1, 2, 2, 1), False), ((1, 2, 2, 1), True)]:
        name = f"offload exact {_label(grid)}{' context' if context_parallel else ''}"
        out.append(Case(name, 4, grid, offload_against_plain, (context_parallel,), {}, _offload_exact))
    for grid in [(1, 1, 2, 1), (1, 2, 2, 1)]:
        out.append(Case(f"fp8 gather {_label(grid)}", _world(grid), None, fp8_against_bf16, (grid,), {}, _fp8_close))
    for grid in [(1, 1, 1, 2), (1, 2, 1, 2)]:
        out.append(
            Case(f"zero 1 and 2 {_label(grid)}", _world(grid), grid, zero_against_unsharded, (), {}, _zero_exact)
        )
    grid, bf16 = (1, 1, 1, 2), {"precision": "bf16-fp32-reduce"}
    out.append(Case(f"zero bf16 {_label(grid)}", 2, grid, zero_against_unsharded, (1,), bf16, _zero_exact))
    speed = {"precision": "bf16-fp32-reduce"}
    for label, wide in (("", False), (" wide", True)):
        name = f"offload speed{label} x1y1z1d1"
        out.append(Case(name, 1, (1, 1, 1, 1), offload_speed, (0.5, wide), speed, _offload_saves, timed=True))
    ckpt = os.path.join(scratch, "checkpoint")
    out.append(Case("checkpoint z2 -> y2", 2, None, checkpoint_across_grids, (ckpt,), {}, _same_weights))
    job = os.path.join(scratch, "train")
    out.append(Case("train bf16-fp32-reduce x1y2z2d1", 4, None, train_job, (job, "1,2,2,1"), {}, _trains))
    return out


def single_gpu_cases() -> list[Case]:
    """The cases of one rank on the production backend."""
    exact = _exact(FP32_TOL)
    return [
        Case("nccl exact llama x1y1z1d1", 1, (1, 1, 1, 1), against_dense, ("llama",), {}, exact, needs_cuda=True),
        Case("sync training step x1y1z1d1", 1, (1, 1, 1, 1), no_host_sync, (), {}, _no_error, needs_cuda=True),
    ]


# -- running them ----------------------------------------------------------------------------------
def run_case(case: Case, transport: str, timeout: float) -> dict[str, Any]:
    """Run ``case`` over ``transport`` ("staged": gloo on one shared device; "nccl": one device per
    rank); its record: name, grid, transport, status, why, metrics, seconds."""
    record: dict[str, Any] = {"name": case.name, "grid": case.grid, "world": case.world, "transport": transport}
    nccl = transport == "nccl"
    backend = devices.default_backend(devices.default_device(0)) if nccl else devices.default_backend(devices.HOST)
    start = time.perf_counter()
    try:
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
        why = case.verdict(results)
        record.update(status="passed" if why is None else "failed", why=why, metrics=results)
    except Exception as e:  # a rank died or hung: the case failed, the others still run
        record.update(status="failed", why=f"{type(e).__name__}: {e}", metrics=None)
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def run_suite(timeout: float) -> dict[str, Any]:
    """``pytest tests/gpu`` in a subprocess; its counts."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", "\n".join(tail[-1:]))}
        ok = proc.returncode == 0 and counts.get("passed", 0) > 0
        why = None if ok else f"pytest exit {proc.returncode}: {tail[-1] if tail else ''}"
    except subprocess.TimeoutExpired:
        tail, counts, ok, why = [], {}, False, f"pytest ran past {timeout:.0f} s"
    return {
        "name": "suite tests/gpu",
        "transport": "default",
        "status": "passed" if ok else "failed",
        "why": why,
        "metrics": {"counts": counts, "tail": tail},
        "seconds": round(time.perf_counter() - start, 2),
    }


def run_speed(timeout: float) -> dict[str, Any]:
    """``bench/gpu_block.py`` in a subprocess: its headline and whether it met the 1.05× target."""
    start = time.perf_counter()
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu_block.py")]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-10:]
        line = next((t for t in reversed(tail) if t.startswith("gpu: ")), "")
        ratio = re.search(r"\(ratio ([0-9.]+)\)", line)
        ok = proc.returncode == 0 and ratio is not None
        why = None if ok else f"bench/gpu_block.py exit {proc.returncode}: {tail[-1] if tail else ''}"
        metrics = {"line": line, "within_1.05": ratio is not None and float(ratio.group(1)) <= 1.05, "tail": tail}
    except subprocess.TimeoutExpired:
        ok, why, metrics = False, f"bench/gpu_block.py ran past {timeout:.0f} s", {}
    return {
        "name": "speed 20B block",
        "transport": "none",
        "status": "passed" if ok else "failed",
        "why": why,
        "metrics": metrics,
        "seconds": round(time.perf_counter() - start, 2),
    }


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _tracked_changes() -> bool | None:
    """Whether tracked files differ from the commit (None: not a git checkout)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except OSError:
        return None


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
    args = p.parse_args(argv)
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
    header = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "commit": _git_commit(),
        "tracked_files_changed": _tracked_changes(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": name,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
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

    def one(case: Case, transport: str) -> None:
        if case.needs_cuda and args.on_host:
            record({"name": case.name, "transport": transport, "status": "skipped", "why": "needs CUDA"})
        else:
            record(run_case(case, transport, args.timeout))

    with tempfile.TemporaryDirectory(prefix="axon4d-gpu-check-") as scratch:
        runs = [(c, "staged") for c in cases(scratch)]
        runs += [(c, "nccl") for c in cases(scratch) if 2 <= c.world <= gpus]
        runs += [(c, "nccl" if c.needs_cuda else "staged") for c in single_gpu_cases()]
        runs = [(c, t) for c, t in runs if chosen(c.name)]
        side_by_side = [(c, t) for c, t in runs if not c.timed]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(one, c, t) for c, t in side_by_side]
            if chosen("suite"):
                if args.on_host:
                    record({"name": "suite tests/gpu", "status": "skipped", "why": "needs CUDA"})
                else:
                    futures.append(pool.submit(lambda: record(run_suite(args.timeout * 4))))
            for f in futures:
                f.result()
        for c, t in runs:  # the timings, alone on the device
            if c.timed:
                one(c, t)
    if chosen("speed"):
        if args.on_host:
            record({"name": "speed 20B block", "status": "skipped", "why": "needs CUDA"})
        else:
            r = run_speed(args.timeout)
            r["why"] = r.get("why") or r["metrics"].get("line", "")
            record(r)
    c = counts()
    print(
        f"gpu-check: {name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped ({os.path.relpath(out, ROOT)})"
    )
    return 1 if c["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
