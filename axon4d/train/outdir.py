"""The output directory a training run may use, and the checkpoint it resumes (``axon4d train``).

``check_out_dir`` refuses, on every rank before any collective, a directory the run cannot use —
not writable, holding another run's checkpoints without --resume or --overwrite, or a checkpoint
this run cannot continue (another model, other training settings than ``RESUMABLE_CHANGES``, a
step at or past --steps) — and returns the checkpoint to resume; ``finished`` is the summary of a
run a relaunch found complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from axon4d import checkpoint
from axon4d.config import ModelConfig
from axon4d.grid import launch
from axon4d.train.config import TrainConfig

#: training settings a resume may change besides the checkpoint module's: TF32 changes how fp32
#: matmuls round, as the device or the transport do, not what the run computes; offload changes
#: where saved activations wait for their backward, not what is computed (bit-identical); --zero
#: where the optimizer's state lives (its checkpoints load with or without it, on any data size);
#: --hf is checked as the directory it names (``checkpoint.HF_PATH``), however the path is written;
#: --expert-layout where an MoE model's experts run (its checkpoints are layout-independent)
RESUMABLE_CHANGES = checkpoint.RESUMABLE_CHANGES | {
    "expert_layout",
    "tf32",
    "offload",
    "zero",
    "pin",
    "hf",
    "try_plans",
    "try_steps",
    "try_rounds",
    "retry",
}


def check_out_dir(cfg: TrainConfig, mcfg: ModelConfig) -> str | None:
    """Refuse an output directory this run cannot use, on every rank before any collective; return
    the checkpoint to resume from (None: start at step 0).

    By ``cfg.resume``: ``never`` refuses checkpoints (unless --overwrite); ``always`` needs one;
    ``auto`` takes the newest when there is one, and a checkpoint of another run (another model or
    training settings) only with --overwrite, which starts afresh. The checkpoint must match the run
    and lie below --steps; under ``auto`` one at --steps is returned (the run is complete)."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        probe = os.path.join(cfg.out_dir, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"--out-dir {cfg.out_dir!r} cannot be written by this rank ({e.strerror or e}); "
            "give a directory every rank can create and write"
        ) from e
    ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
    found = checkpoint.latest(ckpt_dir)
    if found is None:
        if cfg.resume == "always":
            raise ValueError(
                f"--resume always: {ckpt_dir!r} holds no complete checkpoint to continue from; give the --out-dir "
                "of the run to continue, or --resume auto to start afresh when there is none"
            )
        return None
    meta = checkpoint.read_meta(found)
    if cfg.resume == "never":
        if cfg.overwrite:
            return None
        raise ValueError(
            f"--out-dir {cfg.out_dir!r} holds checkpoints of another run (newest: {found}, step {meta['step']}); "
            "pass --resume to continue it, --overwrite to delete them and start afresh, or another --out-dir"
        )
    check_hf_path(cfg, meta, found)
    try:
        checkpoint.check_compatible(meta, mcfg, dataclasses.asdict(cfg), RESUMABLE_CHANGES)
    except ValueError as e:
        if cfg.resume == "auto" and cfg.overwrite:
            return None  # another run's: --overwrite deletes them (axon4d.train.loop) and this run starts afresh
        if cfg.resume == "auto":
            raise ValueError(
                f"--resume auto found another run's checkpoint, {found}: {e}, or pass --overwrite to delete its "
                "checkpoints and start afresh"
            ) from e
        raise
    if int(meta["step"]) == cfg.steps and cfg.resume == "auto":
        return found  # the run is complete (train returns its summary)
    if int(meta["step"]) >= cfg.steps:
        raise ValueError(
            f"--resume from {found} at step {meta['step']} with --steps {cfg.steps}: the run is already "
            f"{'past' if int(meta['step']) > cfg.steps else 'at'} its last step; give --steps above {meta['step']} "
            "to train further"
        )
    return found


def check_hf_path(cfg: TrainConfig, meta: dict[str, Any], found: str) -> None:
    """Refuse to resume checkpoint ``found`` (meta.json ``meta``) of another model than --hf names:
    another Hugging Face directory, one of axon4d's own models, or the other way round."""
    saved = meta.get(checkpoint.HF_PATH)
    here = os.path.realpath(cfg.hf) if cfg.hf else None
    if saved == here or (saved and here and os.path.realpath(saved) == here):
        return
    was = f"fine-tunes the Hugging Face model in {saved!r}" if saved else "trains one of axon4d's own models"
    now = f"--hf {cfg.hf!r}" if cfg.hf else "no --hf"
    hint = f"--hf {saved}" if saved else "without --hf"
    raise ValueError(
        f"--resume from {found}: that run {was}, this one has {now}; resume {hint}, or use another --out-dir"
    )


def finished(cfg: TrainConfig, final: str) -> dict[str, Any]:
    """The run of ``cfg`` whose checkpoint ``final`` is at its last step (relaunched with --resume
    auto after its last save): say so, train nothing, and return its summary.json (without one, as
    when it was ended before writing it, the step and checkpoint) with no losses of this launch."""
    if launch.detect().rank == 0:
        print(f"axon4d: {final} is at --steps {cfg.steps}: the run is complete, nothing to train (--resume auto)")
    try:
        with open(os.path.join(cfg.out_dir, "summary.json")) as f:
            summary = dict(json.load(f))
    except (OSError, ValueError):
        summary = {"steps": cfg.steps, "checkpoint": final}
    summary["losses"] = []
    return summary
