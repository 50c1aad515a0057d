"""What every rank of a ``make gpu-check`` case runs (bench/gpu_check.py holds the cases, their
verdicts and the runner). Each function runs on every rank of a local world — ``fn(grid, *args)``,
``grid`` None where the function builds its own grids — and returns the metrics its case's verdict
judges; every multi-rank function reports the collectives it issued (``collectives``), so that a
case whose distributed code took a short cut fails.

``HostReads`` finds reads of an accelerator tensor's value on the host made on the calling thread
(``.item()``, ``.tolist()``, ``bool(t)``, ``torch.equal`` …), each of which waits for the device's
queued work; on CUDA torch's sync debug mode adds every synchronising call the training thread
makes (``no_host_sync``). On the host neither can find anything (host tensors are read for free,
and host-only paths do), so the host run of that case checks the rest of the check.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import axon4d
from axon4d import activations, checkpoint, grads
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.measure import kernels
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
FLOOR = 1e-3  # gradients that vanish in theory are compared on this scale


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
    from axon4d.options.recompute_mode import RECOMPUTE_MODES

    grad_rel = loss_rel = 0.0
    bitwise, moved, late = True, 0, 0
    grid.comm.log.clear()
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
        "collectives": len(grid.comm.log.records),
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
    collectives = len(grid.comm.log.records)
    axon4d.shutdown()
    grid = axon4d.init(grid=(1, 2, 1, 1))
    model = Transformer(cfg, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = checkpoint.load(directory, model, grid, opt)
    loaded = {k: devices.to_host(v) for k, v in model.to_dense().state_dict().items()}
    collectives += len(grid.comm.log.records)
    axon4d.shutdown()
    diff = max(float((saved[k] - loaded[k]).abs().max()) for k in saved)
    return {"step": int(meta["step"]), "max_abs_diff": diff, "tensors": len(saved), "collectives": collectives}


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
    moved = sum(summary["comm_bytes_per_step"].values())  # the job's log is per step: its bytes
    return {"losses": losses, "max_rel_diff": summary.get("max_rel_diff"), "comm_bytes": moved}


#: what hands a tensor's value to the host: each waits for an accelerator's queued work (``.cpu()``
#: and ``.to()`` count only from an accelerator's tensor)
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.equal,
    torch.allclose,
}


class HostReads(TorchFunctionMode):
    """Records every read of a tensor's value on the host made on this thread while it is active
    (``_READS``, and ``.cpu()``/``.to()`` of an accelerator's tensor to the host), each as
    ``"item at axon4d/grads.py:120 in grad_norm"`` (the innermost frame outside torch): ``reads``
    those of an accelerator's tensors, each of which waits for the device; ``host_reads`` those of
    the host's tensors, which wait for nothing (host-only paths read them: token-id checks, the
    host's AdamW step counts) and are only counted."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.host_reads = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _READS or func in (torch.Tensor.cpu, torch.Tensor.to):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            on_device = any(devices.is_accelerator(t.device) for t in tensors)
            if on_device and (func in _READS or _to_host(func, args, kwargs)):
                self.reads.append(f"{getattr(func, '__name__', func)} at {_where()}")
                # the synchronising calls this read makes (a copy to the host, and the waits torch
                # adds to it) are the read's, not further syncs: kept out of ``_watched``'s list
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return func(*args, **kwargs)
            elif func in _READS:
                self.host_reads += 1
        return func(*args, **kwargs)


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` (``Tensor.cpu`` or ``Tensor.to``) copies to the host."""
    if func is torch.Tensor.cpu:
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _where() -> str:
    """The innermost frame of the caller's stack outside torch and this file."""
    here, stdlib_warnings = os.path.abspath(__file__), os.path.abspath(warnings.__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    skipped = (here, stdlib_warnings)  # a warning's own frames (a sync's report) are not its cause
    stack = [f for f in traceback.extract_stack() if f.filename not in skipped and not f.filename.startswith(torch_dir)]
    frame = stack[-1]
    return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno} in {frame.name}"


def _watched(device: torch.device, fn: Any) -> tuple[Any, list[str], list[str], int]:
    """``fn()`` under ``HostReads`` and, on CUDA, torch's sync debug mode ("warn": each synchronising
    call of this thread — and of autograd's device threads, whose warnings the backward replays
    here — is a warning; a collective transport's own threads, which stage gloo's copies, are not
    this thread). Returns (the result, the reads of an accelerator's tensors, the synchronising
    calls, the count of reads of host tensors)."""
    cuda = device.type == "cuda"
    mode = HostReads()
    syncs: list[str] = []

    def shown(message: Any, *_: Any, **__: Any) -> None:  # runs where the warning is raised: its stack is the call's
        if _sync_warning(str(message)):
            syncs.append(f"{str(message).split(' (Triggered')[0]} at {_where()}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = shown
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                result = fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return result, mode.reads, syncs, mode.host_reads


def _sync_warning(message: str) -> bool:
    """Whether a warning caught under the sync debug mode reports a synchronising call — not the
    notice torch 2.11 gives as the mode is set ("Synchronization debug mode is a prototype feature")."""
    return "synchroniz" in message.lower() and not message.startswith("Synchronization debug mode")


def no_host_sync(grid: Any) -> dict[str, Any]:
    """A step of the training job (``axon4d.train.loop._step``'s parts: the micro-batch's forward and
    backward, the loss's all-reduce, clipping by the global norm, the job's AdamW — fused on an
    accelerator, stepped before the read with the non-finite flag on the device — and zero_grad)
    watched by ``_watched``: no host read and no synchronising call besides the step's one intended
    read of the loss and the norm. That read itself
    (``loop._read_step``) is not watched. Returns the reads and syncs found, the optimizer's kernel,
    the loss and the collectives of the watched step."""
    from axon4d.train import loop, optim

    cfg = MODELS["llama"]
    job = TrainConfig(model="tiny")  # the job's defaults: clipping at 1.0, AdamW's betas and decay
    torch.manual_seed(0)
    model = Transformer(cfg, grid=grid)
    opt = optim.make_optimizer(model, job, grid)
    ids = _batch(cfg, grid.device, sequences=8)

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        loss = accumulate(model, (ids,), grid)
        return loop._batch_sum(loss, grid), optim.clip(model, job, grid)

    def update(loss_sum: torch.Tensor, norm: torch.Tensor) -> None:
        # the job's step (optim.step) without its read: a fused AdamW skips a non-finite step on the
        # device, queued before the read; the host's kernel is stepped after it
        optim.step(opt, loss_sum, norm, lambda: True)
        opt.zero_grad(set_to_none=True)

    update(*forward_backward())  # first: allocations, kernel choices, optimizer state
    devices.synchronize(grid.device)
    grid.comm.log.clear()
    (loss_sum, norm), reads, syncs, host_reads = _watched(grid.device, forward_backward)
    collectives = len(grid.comm.log.records)
    on_device = optim.skips_on_device(opt)
    if not on_device:
        loss, norm_value = loop._read_step(loss_sum, norm, grid)  # the step's one read, before the step
    _, more_reads, more_syncs, more_host_reads = _watched(grid.device, lambda: update(loss_sum, norm))
    if on_device:
        loss, norm_value = loop._read_step(loss_sum, norm, grid)  # the step's one read, after it is queued
    return {
        "device": str(grid.device),
        "reads": reads + more_reads,
        "syncs": syncs + more_syncs,
        "host_tensor_reads": host_reads + more_host_reads,
        "optimizer": optim.optimizer_kernel(opt),
        "loss": loss,
        "grad_norm": norm_value,
        "collectives": collectives,
    }


def async_resume(_: Any, directory: str) -> dict[str, Any]:
    """The training job on one rank with checkpoints written in the background (``--async-save``,
    every 2 of 4 steps), then resumed from its step-2 checkpoint as if it had died before publishing
    step 4: the resumed steps' losses against the uninterrupted run's. World of one (the rank
    deletes the checkpoint itself)."""
    base = dict(
        grid="1,1,1,1",
        model="tiny",
        steps=4,
        batch_size=4,
        warmup_steps=1,
        save_every=2,
        async_save=True,
        out_dir=directory,
        progress=False,
    )
    straight = train(TrainConfig(**base, overwrite=True))
    ckpts = os.path.join(directory, "checkpoints")
    written = [os.path.basename(c) for c in checkpoint.list_checkpoints(ckpts)]
    shutil.rmtree(os.path.join(ckpts, "step_4"))
    resumed = train(TrainConfig(**base, resume="always"))
    after = [float(v) for v in straight["losses"]][2:]
    got = [float(v) for v in resumed["losses"]]
    worst = max((abs(a - b) / abs(b) for a, b in zip(got, after)), default=float("inf"))
    return {
        "written": written,
        "async_save": straight["async_save"],
        "losses": after,
        "resumed": got,
        "bitwise": got == after,
        "loss_rel": worst if len(got) == len(after) else float("inf"),
    }


#: the model of the micro-batch case: on a GPU one whose activations are far above the libraries'
#: workspaces, on the host the small one
MICRO = {
    "accelerator": MODELS["llama"].replace(
        n_layers=4, hidden=1024, n_heads=8, n_kv_heads=2, ffn_hidden=2816, vocab_size=32000, seq_len=1024
    ),
    "host": MODELS["llama"],
}


def micro_keep(grid: Any, micro_batches: int = 2, sequences: int = 8) -> dict[str, Any]:
    """``micro_batches`` micro-batches in the grid's precision with OAG's keep-for-backward on (the
    weight blocks a held backward gathered are carried to the next micro-batch's forward,
    ``Scheduler.carry_block``): how many layers carry a block between micro-batches and after the
    step (none: the step's last backward drops them), and the step's peak memory per rank
    (``axon4d.measure.probe.peak_bytes``, maximum over ranks; less the libraries' workspace
    allocated at the first matmul on an accelerator) against the planner's (``plan.memory``)."""
    from axon4d.measure.probe import peak_bytes
    from axon4d.options.precision import NAMED
    from axon4d.plan.memory import memory
    from axon4d.plan.workload import Workload
    from axon4d.train.batches import accumulate_one

    on_device = devices.is_accelerator(grid.device)
    cfg = MICRO["accelerator" if on_device else "host"]
    before = devices.memory_allocated(grid.device) or 0
    probe = torch.ones(16, 16, device=grid.device)
    torch.mm(probe, probe)  # the first matmul allocates the BLAS workspace, held by the process
    del probe
    workspace = max(0, (devices.memory_allocated(grid.device) or 0) - before)
    torch.manual_seed(0)
    model = Transformer(cfg, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{devices.adamw_kernel(grid.device): True})
    ids = _batch(cfg, grid.device, sequences * micro_batches)
    batches = ids.chunk(micro_batches)
    carried: list[int] = []

    def step(next_pass: Any = lambda: None) -> None:
        opt.zero_grad(set_to_none=True)
        carried.clear()
        for i, batch in enumerate(batches):
            if i:
                next_pass()
            accumulate_one(model, batch, grid, last=i == len(batches) - 1, parts=len(batches))
            carried.append(grid.scheduler.carried_blocks)
        opt.step()

    step(), step()
    grid.comm.log.clear()
    step()
    collectives = len(grid.comm.log.records)
    measured = peak_bytes(grid, model, opt, step, passes=True) - workspace
    preset = next(name for name, p in NAMED.items() if p == grid.precision)
    wl = Workload(cfg, sequences * micro_batches, precision=preset)
    predicted = memory(
        wl, grid.shape, "none", grid.scheduler.policy, micro_batches=micro_batches, widened_gemms=not on_device
    ).peak
    return {
        "device": str(grid.device),
        "model": f"{cfg.arch} {cfg.n_layers}x{cfg.hidden}, {micro_batches}x{sequences}x{cfg.seq_len} tokens",
        "carried_between": carried[:-1],
        "carried_after": carried[-1],
        "workspace_bytes": workspace,
        "measured_peak": measured,
        "predicted_peak": predicted,
        "peak_error": (predicted - measured) / measured,
        "collectives": collectives,
    }


#: the Hugging Face model of the round-trip case: a Llama of 2 layers, width 64, grouped-query
#: attention, random weights (seed 0), saved with ``save_pretrained``
HF_SEQ = 16


def save_hf_llama(directory: str) -> None:
    """Save the round-trip case's Llama to ``directory`` (in the parent, before its ranks start)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(directory)


def hf_round_trip(_: Any, hf_path: str, directory: str, grid: str) -> dict[str, Any]:
    """``axon4d train --hf`` on ``grid`` (4 steps, saved at the end), the trained weights read back
    on the grid from the checkpoint, and on rank 0 ``axon4d export-hf`` run as its command in a
    subprocess and the exported model loaded by transformers' ``from_pretrained``: whether every
    weight it loads is the trained one, bit for bit. Peak memory: the job's device peak per rank
    (None on the host) and the export command's peak resident memory."""
    from axon4d.train import hf

    warnings.simplefilter("ignore")  # auto_parallelize's notes
    cfg = TrainConfig(
        hf=hf_path,
        grid=grid,
        seq_len=HF_SEQ,
        batch_size=4,
        steps=4,
        warmup_steps=1,
        out_dir=os.path.join(directory, "run"),
        overwrite=True,
        progress=False,
    )
    summary = train(cfg)
    ckpt = os.path.join(cfg.out_dir, "checkpoints", "step_4")
    g = axon4d.init(grid=tuple(int(v) for v in grid.split(",")))
    device = g.device
    train_peak = devices.peak_memory_allocated(device)
    model = hf.build(hf_path, hf.model_config(hf_path, HF_SEQ), g)
    checkpoint.load(ckpt, model, g, check_model=False)
    trained = {k: devices.to_host(v.detach()) for k, v in model.to_dense().module.state_dict().items()}
    moved = sum(summary["comm_bytes_per_step"].values())
    rank = g.rank
    axon4d.shutdown()
    out: dict[str, Any] = {"device": str(device), "losses": summary["losses"], "comm_bytes": moved}
    out["train_peak_device_bytes"] = train_peak
    if rank != 0:
        return out
    exported = os.path.join(directory, "exported")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "axon4d.cli", "export-hf", ckpt, exported, "--overwrite"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out["export_exit"] = proc.returncode
    out["export_tail"] = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    out["export_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if proc.returncode == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
        common = sorted(k for k in loaded if k in trained)
        out["weights"] = len(common)
        out["unloaded"] = sorted(k for k in loaded if k not in trained)
        out["differ"] = [k for k in common if not torch.equal(loaded[k], trained[k].float())]
    return out


def _flat_run(cfg: ModelConfig, grid: Any, ids: torch.Tensor) -> tuple[float, torch.Tensor, int, int]:
    """One forward and backward of ``Transformer(cfg)`` (seed 0): the mean loss over the batch, the
    whole model's flat gradient, the bytes E10 moved and the collectives of the step."""
    torch.manual_seed(0)
    model = Transformer.from_dense(DenseTransformer(cfg, device=grid.device))
    grid.comm.log.clear()
    loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
    loss.backward()
    e10 = sum(r.payload_bytes for r in grid.comm.log.records if str(r.tag).startswith("E10"))
    collectives = len(grid.comm.log.records)
    mean = grid.comm.all_reduce(loss.detach().float().reshape(1).clone(), "batch", tag="check").wait()
    flat = torch.cat([p.grad.reshape(-1) for p in model.to_dense(grads=True).parameters()])
    return float(mean) / grid.size("batch"), devices.to_host(flat).double(), e10, collectives


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
    (ref_loss, ref, ref_e10, _), (loss, got, e10, collectives) = out["bf16-fp32-reduce"], out["bf16-fp8-gather"]
    return {
        "device": device,
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "grad_fro": float((got - ref).norm() / ref.norm()),
        "e10_bytes": e10,
        "e10_bytes_bf16": ref_e10,
        "collectives": collectives,
    }


class _Dispatched(TorchDispatchMode):
    """The names of the aten operations run on this thread while it is active (``"_fused_adamw_"``,
    ``"_foreach_addcdiv_"``, ``"addcdiv_"`` …)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def adamw_kernel_ran(ops: set[str]) -> str:
    """Which of ``torch.optim.AdamW``'s implementations a step ran, from the aten operations it
    dispatched (``_Dispatched``): "fused" (``_fused_adamw_``), "foreach" (``_foreach_addcdiv_``),
    "for-loop" (``addcdiv_``, one parameter at a time), or "none" (no update ran)."""
    if any(op.startswith("_fused_adam") for op in ops):
        return "fused"
    if "_foreach_addcdiv_" in ops:
        return "foreach"
    return "for-loop" if "addcdiv_" in ops else "none"


def zero_against_unsharded(grid: Any, steps: int = 5, job_kernel: bool = False) -> dict[str, Any]:
    """ZeRO-1 and ZeRO-2 (axon4d.zero) against the unsharded AdamW, in the grid's precision,
    ``steps`` clipped steps of the GPT side by side: for each stage the relative difference of this
    rank's master parts from the unsharded parameters over the whole model (the parameters
    themselves in fp32, where the masters are views of them), the dtypes of the Linear weights and
    the collectives issued. ``job_kernel``: AdamW is asked for the implementation the training job
    picks for the device (``axon4d.device.adamw_kernel``: fused on an accelerator), else torch's
    default (``optimizer_asked``); what each optimizer's steps ran, seen in the operations they
    dispatched (``adamw_kernel_ran``): ``unsharded_optimizer``, ``zero1_optimizer``, ``zero2_optimizer``."""
    _highest_precision()
    cfg = MODELS["gpt"]
    kernel = {devices.adamw_kernel(grid.device): True} if job_kernel else {}
    seen = {stage: _Dispatched() for stage in (0, 1, 2)}
    runs = {}
    grid.comm.log.clear()
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = Transformer(cfg, grid=grid)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5, **kernel)
        runs[stage] = (model, opt if stage == 0 else shard_optimizer(opt, model, grid, stage=stage))
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
        for stage, (model, opt) in runs.items():
            accumulate(model, (ids,), grid)
            grads.clip_grad_norm_(model, 0.05, grid)
            with seen[stage]:
                opt.step()
            opt.zero_grad(set_to_none=True)
    ran = {stage: adamw_kernel_ran(mode.ops) for stage, mode in seen.items()}
    out: dict[str, Any] = {
        "device": str(grid.device),
        "precision": str(grid.precision.compute),
        "optimizer_asked": next(iter(kernel), "default"),
        "unsharded_optimizer": ran[0],
        "zero1_optimizer": ran[1],
        "zero2_optimizer": ran[2],
        "collectives": len(grid.comm.log.records),
    }
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


def moe_against_dense(grid: Any) -> dict[str, Any]:
    """One MoE layer (``axon4d.nn.moe.MoE``: top-2 of 8 experts, a shared expert) against ``DenseMoE``
    with the same weights on the same device, fp32, on inputs whose top-k has a margin: the largest
    relative error of the output and of every gradient, and its forward and backward watched by
    ``_watched`` — the layer's one intended host read is its counts exchange (docs/moe.md, E15),
    none in the backward."""
    from axon4d.nn.moe import MoE
    from axon4d.nn.moe_dense import DenseMoE

    _highest_precision()
    cfg = ModelConfig(
        n_layers=1, hidden=64, n_heads=4, vocab_size=64, seq_len=16, arch="llama",
        n_experts=8, experts_per_token=2, expert_ffn=32, shared_experts=1, moe_aux_coef=0.05,
    )  # fmt: skip
    torch.manual_seed(5)
    dense = DenseMoE(cfg)
    tokens = 8 * cfg.seq_len
    q, _ = torch.linalg.qr(torch.randn(cfg.hidden, cfg.n_experts))  # router rows orthonormal: logits = levels
    with torch.no_grad():
        dense.router.weight.copy_(q.t())
    levels = torch.arange(cfg.n_experts, dtype=torch.float32) * 0.6 - 1.5
    rows = [q @ levels[torch.randperm(cfg.n_experts)] + 0.01 * torch.randn(cfg.hidden) for _ in range(tokens)]
    x_full = devices.to_device(torch.stack(rows).view(8, cfg.seq_len, cfg.hidden), grid.device)
    dense = dense.to(grid.device)
    layer = MoE(cfg, grid=grid).load_dense_(dense)
    v = devices.to_device(torch.randn(cfg.hidden), grid.device)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    grid.comm.log.clear()
    y, f_reads, f_syncs, f_host = _watched(grid.device, lambda: layer(x))
    loss = (y * axon4d.shard_features(v, "x")).sum() / (y.shape[0] * y.shape[1]) + layer.aux_loss
    _, b_reads, b_syncs, b_host = _watched(grid.device, loss.backward)
    collectives = len(grid.comm.log.records)
    xr = x_full.clone().requires_grad_()
    ref = (dense(xr) * v).sum() / tokens + dense.aux_loss
    ref.backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    out = rel(axon4d.gather_batch(axon4d.gather_features(y, "x")), dense(x_full))
    got = dict(layer.to_dense(grads=True).named_parameters())
    grad = max(rel(got[n].grad, p.grad) for n, p in dense.named_parameters() if p.grad is not None)
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch")
    return {
        "device": str(grid.device),
        "loss_rel": out,
        "grad_rel": max(grad, rel(dx, xr.grad)),
        "forward_reads": f_reads,
        "forward_syncs": f_syncs,
        "backward": b_reads + b_syncs,
        "host_tensor_reads": f_host + b_host,  # on the host: the counts exchange, seen by the watch
        "collectives": collectives,
    }
