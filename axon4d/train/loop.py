"""The training loop on the 4D grid: ``train(cfg)`` and the command's ``main(args)``.

``train`` builds the grid (``axon4d.grid.runtime.init``; under ``--grid auto`` the grid of the plan
the planner answers the run's one request with, ``planned`` and ``trial``), the model
(``axon4d.models.transformer.Transformer``) on it and the optimizer, resumes from the newest
checkpoint if asked (``--resume always``, or ``auto``: when there is one), and runs the steps:
this step's micro-batches (``batches``) → gradient clipping and AdamW on the schedule (``optim``)
→ the step record, with the communication the grid's ``CommLog`` saw during the step
(``report``). Rank 0 shows the progress bar and writes the log; checkpoints
(``saves``, ``axon4d.checkpoint``) are saved every ``save_every`` steps and at the end, and a resumed run
continues on the same loss curve: a job that a launcher restarts after a failure (``--resume
auto`` under ``torchrun --max-restarts`` or ``sbatch --requeue``) runs the steps after its last
checkpoint again, on the same data and random state, and logs each step once. With
``--async-save`` the checkpoints are written in the background while training goes on
(``checkpoint.AsyncSaver`` through ``saves.saver``; the summary reports the seconds each save blocked training). With
``--compare-single`` rank 0 afterwards trains the same model in one process (``reference``). With
``--hf`` the model is a saved Hugging Face causal LM, parallelized and loaded by slices (``hf``),
trained by the same loop.

Everything the job computes lives on the grid's device (``grid.device``: a GPU under NCCL, the
host under gloo or MPI): the model, each rank's rows of a batch, the loss and its all-reduce, the
gradient norm, the peak probe. A step reads the device on the host once, for its loss and
gradient norm together (``STEP_READ``), after clipping on the device — and, with a fused AdamW,
after the step itself is queued, a non-finite step skipped on the device (``optim.step``); step
times are taken after synchronising that device's compute stream (ZeRO's all-gathers over data
may still run: they finish under the next step's forward and are counted in its time). At
start-up rank 0 warns when the compute dtype's matmuls are much slower than fp32's (``peak``).

The defaults a GPU user gets (docs/training.md#gpu-defaults), all chosen through
``axon4d.device``: ``--precision auto`` resolved by whether there is an accelerator, TF32 for fp32
matmuls, the allocator's expandable segments, fused AdamW; the banner and summary.json say what was
chosen (``precision``, ``tf32``, ``optimizer``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from typing import Any

import torch
from tqdm import tqdm

from axon4d import checkpoint, grads, trials
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.device import environment
from axon4d.grid import launch, runtime
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import GridShape
from axon4d.memory.offload import parse_offload
from axon4d.models.transformer import Transformer
from axon4d.options.precision import AUTO, NAMED
from axon4d.options.precision import resolve as resolve_precision
from axon4d.options.recompute_mode import check_recompute
from axon4d.plan.job import plan_job
from axon4d.reliability import watchdog
from axon4d.train import hf, optim, planned, reference, report, saves, trial
from axon4d.train.batches import accumulate, make_data, step_batches
from axon4d.train.config import TrainConfig, from_args
from axon4d.train.fp8_log import count_underflow, gemm_line, gemm_precisions, underflow_record
from axon4d.train.moe_log import moe_record
from axon4d.train.optim import clip, describe_optimizer, make_optimizer, set_lr
from axon4d.train.outdir import check_out_dir, finished
from axon4d.train.peak import check_compute_dtype, mfu, world_peak_tflops

#: the models the loop trains: axon4d's own, or a saved Hugging Face one (--hf)
Model = Transformer | hf.HFCausalLM


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training job described by ``cfg`` on the grid; return the run summary (all ranks).

    Everything that can be refused is refused before the first collective, on every rank alike:
    the flags, the model, the output directory (writable by every rank; holding another run's
    checkpoints only with --resume or --overwrite), and a checkpoint to resume (its model and
    training settings, and a step below --steps; under --resume auto a checkpoint at --steps is a
    finished run, whose summary is returned without building anything). The run itself is watched
    (axon4d.reliability.watchdog): an error on one rank is printed and announced, and the other ranks end
    within ``cfg.timeout`` seconds (``cfg.startup_timeout`` until the first step is done), naming
    it."""
    environment.use_expandable_segments()  # before the accelerator is initialised; only where there is one
    environment.use_overlap_connections()  # likewise: collectives start in issue order beside the GEMMs
    overlap: Any = "auto"  # the knobs the planner tunes for the grid (axon4d.init's default)
    tried: list[dict[str, Any]] = []  # with --try, the plans tried and how each measured
    if cfg.grid == "auto":  # one request to the planner, one plan back, applied (every rank alike)
        job = plan_job(planned.request(cfg, devices.accelerator_available(), trial.plans_wanted(cfg)))
        best, tried = trial.choose(cfg, job, _resolve_precision, _model, _step)  # --try: the fastest measured
        cfg, overlap = planned.apply(cfg, job, best), best.overlap
    # a bad name fails here, on every rank, before any communication; the resolved name is the
    # run's from here on: the checkpoints, a resume's check and the reference run see it
    cfg = dataclasses.replace(cfg, precision=_resolve_precision(cfg))
    check_recompute(cfg.recompute)  # likewise
    mcfg = cfg.model_config()
    resume_from = check_out_dir(cfg, mcfg)
    if resume_from is not None and checkpoint.read_meta(resume_from)["step"] == cfg.steps:
        return finished(cfg, resume_from)  # --resume auto relaunched after the run's last save
    grid_spec = cfg.grid_spec()
    _check_expert_layout(cfg, mcfg, grid_spec)
    layout = cfg.expert_layout or None  # None: the grid's default
    grid = runtime.init(
        grid=grid_spec,
        seed=cfg.seed,
        precision=cfg.precision_spec(),
        comm=cfg.comm,
        overlap=overlap,
        plan={
            "model": mcfg,
            "batch": cfg.batch_size,
            "machine": cfg.machine or None,
            "dtype": "float32" if cfg.precision == "fp32" else "bfloat16",
            "recompute": cfg.recompute,
            **({"expert_layout": layout} if layout else {}),  # the overlap knobs priced with it
        },
        timeout_s=cfg.startup_timeout,
        expert_layout=layout,
    )
    try:
        with (
            watchdog.guard(grid.rank, grid.world_size, cfg.timeout, cfg.startup_timeout, abort=grid.comm.abort) as dog,
            saves.saver(grid, cfg) as saver,
        ):
            return _train_on(grid, cfg, mcfg, resume_from, dog, saver, tried)
    finally:
        runtime.shutdown()


def _check_expert_layout(cfg: TrainConfig, mcfg: ModelConfig, grid_spec: str | tuple[int, ...]) -> None:
    """Refuse (``ValueError``, every rank alike, before any process group exists) an axon4d MoE
    model's expert layout — ``--expert-layout``'s, else the default — that does not fit the grid:
    the rule it breaks and the layouts that fit (``ExpertLayout.check``). A Hugging Face model's
    blocks are checked by ``auto_parallelize``, before any collective too."""
    if not mcfg.moe or cfg.hf or isinstance(grid_spec, str):
        return
    shape = GridShape.parse(grid_spec, launch.detect().world_size)
    width = mcfg.expert_width
    try:
        ExpertLayout.parse(cfg.expert_layout or None).check(
            shape, mcfg.n_experts, width, mcfg.shared_experts * width, mcfg.hidden
        )
    except ValueError as e:
        given = f"--expert-layout {cfg.expert_layout}" if cfg.expert_layout else "the default expert layout"
        raise ValueError(f"{given} on grid {shape.as_tuple()} (x, y, z, data): {e}") from None


def _resolve_precision(cfg: TrainConfig) -> str:
    """The precision ``cfg.precision`` names for this run: a name of ``axon4d.options.precision.NAMED`` as
    it is; ``auto`` under --resume the precision of the checkpoint it resumes (the run goes on as it
    began, on any device), else by the device the grid will have (``axon4d.init``'s default: an
    accelerator when there is one, ``axon4d.device.accelerator_available``)."""
    if cfg.precision == AUTO and cfg.resume != "never":
        found = checkpoint.latest(os.path.join(cfg.out_dir, "checkpoints"))
        saved = checkpoint.read_meta(found).get("train_config", {}).get("precision") if found else None
        if saved in NAMED:
            return str(saved)
    return resolve_precision(cfg.precision, devices.accelerator_available())


def main(args: argparse.Namespace) -> int:
    """Train with the config of the parsed flags (``config.add_arguments``)."""
    train(from_args(args))
    return 0


def build_model(
    mcfg: ModelConfig,
    grid: Grid,
    recompute="none",
    context_parallel: bool | str = False,
    offload="",
    bf16="",
    context_parallel_axes="z",
):
    """The run's ``Transformer`` on ``grid`` with activation recomputation ``recompute`` (axon4d.nn.recompute),
    with ``context_parallel`` each sequence's tokens split over z (docs/context.md), the blocks
    ``offload`` names (--offload's text: a fraction or indices; axon4d.memory.offload) offloading what they
    save for backward to host memory, and under FP8 GEMMs the layer kinds ``bf16`` names in bf16;
    ``context_parallel_axes``: z, or z,data (hierarchical)."""
    offloaded = parse_offload(offload)
    model = Transformer(
        mcfg,
        grid=grid,
        recompute=recompute,
        context_parallel=context_parallel,
        context_parallel_axes=context_parallel_axes,
        offload=offloaded,
    )
    model.keep_in_bf16({k.strip() for k in bf16.split(",") if k.strip()})
    return model


def _model(cfg: TrainConfig, mcfg: ModelConfig, grid: Grid) -> Model:
    """The run's model on ``grid``: the saved Hugging Face model --hf names (``hf.build``), else
    axon4d's ``Transformer`` (``build_model``)."""
    if cfg.hf:
        return hf.build(cfg.hf, mcfg, grid, cfg.recompute, cfg.context_parallel_option())
    return build_model(
        mcfg,
        grid,
        cfg.recompute,
        cfg.context_parallel_option(),
        cfg.offload,
        cfg.bf16_layers,
        cfg.context_parallel_axes,
    )


def _nonfinite(
    grid: Grid, cfg: TrainConfig, step: int, loss: float, norm: float, first: str | None, in_a_row: int
) -> dict[str, Any]:
    """A step whose loss or gradient norm is not finite (every rank decided alike; ``first``: the
    first parameter whose gradient is not): say so, and end the run under --on-nonfinite stop or
    after --max-nonfinite such steps in a row; return the fields it adds to the step's record."""
    where = f"first non-finite gradient: {first}" if first else "every gradient is finite"
    message = f"step {step}: loss {loss}, gradient norm {norm} ({where})"
    if cfg.on_nonfinite == "stop":
        raise FloatingPointError(f"{message}; stopping (--on-nonfinite stop). Lower --lr or check the data")
    if in_a_row >= cfg.max_nonfinite:
        raise FloatingPointError(
            f"{message}; {in_a_row} non-finite steps in a row (--max-nonfinite {cfg.max_nonfinite}): stopping. "
            "Lower --lr or check the data"
        )
    if grid.rank == 0:
        tqdm.write(f"axon4d: {message}; step skipped, weights unchanged")
    return {"skipped": True, "nonfinite_param": first}


# Under NCCL a collective's wait() only makes the device's stream wait: the host blocks where it
# reads a result or synchronises the device, so those are the waits the watchdog times — for as
# long as the device runs the step the host queued: their deadline follows the measured step time
# (``watchdog.step_waiting``; the job reports each step's seconds, ``Watchdog.step_took``).
#: the wait the one host read of a step's loss and gradient norm is marked as (axon4d.reliability.watchdog)
STEP_READ = (
    "the host read of the step's loss and gradient norm (the step's queued device work, the loss's "
    "all-reduce over batch and the norm's over world)"
)


def _batch_sum(value: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The sum over the batch axis of a per-rank scalar (each rank's loss is over its own tokens):
    a (1,) fp32 tensor on the grid's device, not read on the host."""
    local = devices.to_device(value.detach().float().reshape(1).clone(), grid.device)
    return grid.comm.all_reduce(local, "batch", tag="log").wait()


def _read_step(loss_sum: torch.Tensor, norm: torch.Tensor, grid: Grid) -> tuple[float, float]:
    """(mean loss over the batch axis, gradient norm) of a step from their device tensors, read on
    the host together: the step's one host read, a marked wait (under NCCL it waits for the
    backward, the clipping and both all-reduces)."""
    both = torch.cat([loss_sum.reshape(1).float(), norm.reshape(1).float()])  # (2,) on the device
    with watchdog.step_waiting(STEP_READ):
        total, norm_value = both.tolist()
    return total / grid.size("batch"), norm_value


def _first_nonfinite(model: Model, grid: Grid) -> str | None:
    """``grads.first_nonfinite_grad``, its host read marked as a wait (only on a non-finite step)."""
    with watchdog.step_waiting("the host read of the non-finite gradients' flags (their all-reduce over world)"):
        return grads.first_nonfinite_grad(model, grid)


def _synchronize(grid: Grid, step: int) -> None:
    """Wait for the device's queued work of ``step`` (counted from 1), marked as a wait."""
    with watchdog.step_waiting(f"the device synchronize at the end of step {step} (the step's queued compute)"):
        devices.synchronize_compute(grid.device)


def _progress(cfg: TrainConfig, start: int, rank0: bool) -> tqdm:
    """The progress bar. Every step is drawn (tqdm's defaults skip redraws less than 0.1 s apart):
    a step is the unit the user watches, and its loss, tokens/s, MFU and hidden share must not go
    unseen; the width follows the terminal (none in a log file), where a fixed one cut long runs'
    lines short."""
    return tqdm(
        total=cfg.steps,
        initial=start,
        disable=not (rank0 and cfg.progress),
        dynamic_ncols=True,
        desc="train",
        mininterval=0,
        miniters=1,
    )


def _step(
    model: Model, opt: torch.optim.Optimizer, data: Any, grid: Grid, cfg: TrainConfig, step: int, peak: float
) -> tuple[dict[str, Any], bool, str | None]:
    """Train step ``step`` (counted from 0): its record, whether its loss and gradient norm were
    finite (else the weights are left unchanged) and, if not, the first parameter whose gradient is
    not finite (None when every gradient is)."""
    mcfg = model.cfg
    grid.comm.log.clear()
    t0 = time.perf_counter()
    lr = set_lr(opt, step, cfg)
    fp8_counted = grid.precision.gemm is not None and (step + 1) % cfg.log_every == 0  # a logged step
    if fp8_counted:
        count_underflow(model, True)
    loss = accumulate(
        model, step_batches(data, step, cfg), grid, eos=cfg.packed_documents if cfg.packed_documents >= 0 else None
    )
    loss_sum = _batch_sum(loss, grid)
    # clipped on the device (a non-finite norm leaves the gradients as they are); then one host
    # read of the loss and the norm, the same on every rank: one decision
    norm_t = clip(model, cfg, grid)
    read: list[float] = []

    def host_read() -> bool:
        read.extend(_read_step(loss_sum, norm_t, grid))
        return math.isfinite(read[0]) and math.isfinite(read[1])

    finite = optim.step(opt, loss_sum, norm_t, host_read)  # skipped, on the device or the host, if not finite
    mean_loss, norm = read
    first_bad = None if finite else _first_nonfinite(model, grid)
    opt.zero_grad(set_to_none=True)  # a skipped step's gradients are dropped with the rest
    _synchronize(grid, step + 1)  # an accelerator runs the step asynchronously
    dt = time.perf_counter() - t0
    comm = grid.comm.log.summary()  # this step's collectives (with the loss's all-reduce)
    tps = cfg.batch_size * cfg.micro_batches * mcfg.seq_len / dt
    rec = report.step_record(step + 1, mean_loss, lr, norm, dt, tps, mfu(mcfg.flops_per_token(), tps, peak), comm)
    if mcfg.moe:  # after the step's timing: tokens per expert, balance
        rec["moe"] = moe_record(model, grid)
    if fp8_counted:  # after the step's timing: dY's entries flushed to zero, per layer kind
        rec["fp8_underflow"] = underflow_record(model, grid)
    return rec, finite, first_bad


def _train_on(
    grid: Grid,
    cfg: TrainConfig,
    mcfg: ModelConfig,
    resume_from: str | None,
    dog: watchdog.Watchdog | None,
    saver: checkpoint.AsyncSaver | None = None,
    tried: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The run on a built grid: resume, train, checkpoint (in the background with ``saver``), report
    (with the plans ``tried`` under --try); the summary plus every step's loss."""
    rank0 = grid.rank == 0
    tf32 = devices.allow_tf32(grid.device, cfg.tf32)  # fp32 matmuls on TF32 tensor cores (an accelerator only)
    model = _model(cfg, mcfg, grid)
    initial_dense = model.to_dense() if cfg.compare_single else None
    opt = make_optimizer(model, cfg, grid)  # --zero 1|2: sharded over data (axon4d.zero)
    data = make_data(cfg, mcfg, grid)
    ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
    start, skipped = saves.resume(cfg, resume_from, model, grid, opt, ckpt_dir)  # skipped: non-finite steps so far
    check_compute_dtype(grid)
    peak_total, peak_source = world_peak_tflops(grid, cfg.peak_tflops)  # after allow_tf32: fp32 at TF32's peak
    chosen: dict[str, Any] = {
        "precision": cfg.precision,
        "tf32": tf32,
        "optimizer": describe_optimizer(opt),
        "zero": cfg.zero,
    }
    if grid.precision.gemm is not None:  # FP8 GEMMs: the gradients' float8 format, each layer kind's GEMMs
        chosen["fp8_gradients"] = cfg.fp8_gradients
        chosen["gemm_precision"] = gemm_precisions(model)
    if rank0 and tried:
        print(trials.table(tried))
    if rank0:
        print(report.banner(grid, cfg.model, mcfg, peak_total, start, cfg.recompute, peak_source, chosen))
        if "gemm_precision" in chosen:
            print(gemm_line(chosen["gemm_precision"]))
    log = report.LogFile(cfg.out_dir, cfg.log_every, enabled=rank0, start=start)
    bar = _progress(cfg, start, rank0)
    records: list[dict[str, Any]] = []
    losses: list[float] = []
    in_a_row = 0
    blocked: list[float] = []  # seconds each checkpoint save stopped training
    for step in range(start, cfg.steps):
        rec, finite, first_bad = _step(model, opt, data, grid, cfg, step, peak_total)
        if not finite:
            skipped, in_a_row = skipped + 1, in_a_row + 1
            rec.update(_nonfinite(grid, cfg, step + 1, rec["loss"], rec["grad_norm"], first_bad, in_a_row))
        else:
            losses.append(rec["loss"])
            in_a_row = 0
        records.append(rec)
        log.write(rec)
        bar.set_postfix_str(report.progress_line(rec), refresh=False)
        bar.update()
        if dog is not None:  # a step's host reads may wait a multiple of the recent steps' median
            dog.step_took(rec["step_s"])
        if dog is not None and step == start:
            dog.steady(grid.groups.values())  # start-up is over: waits and the groups get --timeout
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            blocked.append(saves.save(cfg, ckpt_dir, model, grid, opt, step + 1, skipped, saver))
    bar.close()
    blocked.append(saves.save(cfg, ckpt_dir, model, grid, opt, cfg.steps, skipped, saver))
    final = os.path.join(ckpt_dir, f"step_{cfg.steps}")
    summary = report.summarize(
        [r for r in records if not r.get("skipped")], cfg.steps, grid, final, recompute=cfg.recompute
    )
    summary["nonfinite_skipped"] = skipped
    counted = [r["fp8_underflow"] for r in records if r.get("fp8_underflow")]
    if counted:  # the last logged step's: dY's entries the gradients' float8 flushed, per layer kind
        summary["fp8_underflow"] = counted[-1]
    if mcfg.moe:  # where its experts ran: the grid's layout, which its layers take
        summary["expert_layout"] = str(grid.expert_layout)
    summary.update(report.save_summary(blocked, cfg.async_save))
    summary.update(chosen)
    summary["peak_tflops"], summary["peak_source"] = peak_total, peak_source  # MFU's denominator
    if tried:
        summary["trials"] = tried
    log.close()
    if rank0:
        print(report.format_summary(summary) + (f"\n\n{trials.table(tried)}" if tried else ""))
        report.write_summary(cfg.out_dir, summary)
    if initial_dense is not None and rank0 and start == 0:
        reference.compare(initial_dense, cfg, mcfg, losses, summary)
    summary["losses"] = losses
    return summary
