"""Protects restarting the training job after a failure (docs/reliability.md#restart-on-failure):
``--resume auto`` starts afresh in an empty --out-dir and continues from the newest checkpoint when
there is one, so one command serves the first launch and every relaunch; a finished run relaunched
trains nothing; another run's checkpoints are refused (or deleted with --overwrite). Under
``torchrun --max-restarts 1`` a job one of whose ranks is SIGKILLed mid-run (tests/fault_check.py,
at a set step) restarts, runs the steps after its last checkpoint again, and ends with every step
in log.jsonl exactly once, on the loss curve of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from axon4d import checkpoint
from axon4d.train import TrainConfig, add_arguments, train

BIN = os.path.dirname(sys.executable)
#: a tiny Llama on 2 ranks (y = 2), as flags; the runs of one test differ only in the keys they add
JOB = dict(
    grid="1,2,1,1",
    model="tiny",
    layers=1,
    hidden=32,
    heads=4,
    kv_heads=2,
    vocab_size=64,
    seq_len=8,
    batch_size=4,
    warmup_steps=2,
    progress=False,
    peak_tflops=1.0,
)


def _job(out_dir, **kw) -> dict:
    return {**JOB, "out_dir": str(out_dir), **kw}


def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train(cfg: dict) -> tuple[list[float], str]:
    """(this launch's losses, what it printed) of the run ``cfg`` (every rank)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train(TrainConfig(**cfg))["losses"]
    return losses, out.getvalue()


def _refused(cfg: dict) -> str:
    with pytest.raises(ValueError) as e:
        train(TrainConfig(**cfg))
    return str(e.value)


def test_resume_flag_alone_means_always_and_takes_a_mode():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).resume == "never"
    assert p.parse_args(["--resume"]).resume == "always"
    assert p.parse_args(["--resume", "--steps", "3"]).resume == "always"
    assert p.parse_args(["--resume", "auto"]).resume == "auto"
    assert p.parse_args(["--resume=never"]).resume == "never"
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        p.parse_args(["--resume", "sometimes"])  # argparse names the choices
    with pytest.raises(ValueError, match="--resume 'sometimes': choose one of never, always, auto"):
        TrainConfig(resume="sometimes")


def test_resume_auto_starts_afresh_without_checkpoints_and_continues_with_them(pools, tmp_path):
    run, straight_dir = tmp_path / "run", tmp_path / "straight"
    straight, _ = pools(2).run(None, _train, _job(straight_dir, steps=4))[0]
    # the first launch: no checkpoint, so a fresh run (as without --resume)
    first, _ = pools(2).run(None, _train, _job(run, steps=4, save_every=2, resume="auto"))[0]
    assert first == straight
    # a relaunch after the step-2 save (the step-4 one never made): steps 3 and 4 again, logged once
    shutil.rmtree(run / "checkpoints" / "step_4")
    again, printed = pools(2).run(None, _train, _job(run, steps=4, save_every=2, resume="auto"))[0]
    assert again == straight[2:] and "resumed at step 2" in printed
    assert [(r["step"], r["loss"]) for r in _log(run)] == list(zip(range(1, 5), straight))
    # killed between publishing step 4 and pointing latest at it: resumed at step 2, step 4 replaced
    (run / "checkpoints" / "latest").write_text("step_2\n")
    again, printed = pools(2).run(None, _train, _job(run, steps=4, save_every=2, resume="auto"))[0]
    assert again == straight[2:] and "resumed at step 2" in printed
    assert [(r["step"], r["loss"]) for r in _log(run)] == list(zip(range(1, 5), straight))
    # a relaunch of the finished run trains nothing and leaves its outputs as they are
    before = (run / "log.jsonl").read_text(), (run / "summary.json").read_text()
    done, printed = pools(2).run(None, _train, _job(run, steps=4, save_every=2, resume="auto"))[0]
    assert done == [] and "the run is complete, nothing to train" in printed
    assert ((run / "log.jsonl").read_text(), (run / "summary.json").read_text()) == before
    # another run's checkpoints: refused, naming the field and --overwrite; with it, a fresh run
    other = _job(run, steps=2, resume="auto", hidden=64)
    for says in pools(2).run(None, _refused, other):
        assert "--resume auto found another run's checkpoint" in says and "differs in 'hidden'" in says, says
        assert "--overwrite" in says, says
    pools(2).run(None, _train, {**other, "overwrite": True})
    ckpts = str(run / "checkpoints")
    assert checkpoint.list_checkpoints(ckpts) == [os.path.join(ckpts, "step_2")]
    assert checkpoint.read_meta(os.path.join(ckpts, "step_2"))["model_config"]["hidden"] == 64
    assert [r["step"] for r in _log(run)] == [1, 2]
    # --resume always (--resume alone) needs a checkpoint
    for says in pools(2).run(None, _refused, _job(tmp_path / "empty", steps=2, resume="always")):
        assert "holds no complete checkpoint" in says and "--resume auto" in says, says


# -- a rank killed under torchrun --max-restarts ---------------------------------------------------

STEPS, SAVE_EVERY, KILLED_AT = 12, 4, 7
#: a launch that outlives this is broken (a fault-free run of these flags takes ~10 s here)
BOUND_S = 180
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_check.py")


def _flags(out_dir) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in JOB.items() if k != "progress"]
    return flags + ["--no-progress", f"--steps={STEPS}", f"--save-every={SAVE_EVERY}", f"--out-dir={out_dir}"]


def _torchrun(out_dir, fault: str = "none") -> subprocess.Popen:
    """``torchrun --max-restarts 1`` of the job with --resume auto on 2 ranks, rank 1 with ``fault``
    at step KILLED_AT of the first launch (tests/fault_check.py); output to out_dir/../<name>.out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--monitor-interval=0.1"]
    cmd += [FAULTS, fault, "1", str(KILLED_AT), "--resume", "auto", *_flags(out_dir)]
    out = open(f"{out_dir}.out", "w")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_restarts_and_no_step_is_lost_or_repeated(tmp_path):
    """Rank 1 SIGKILLs itself in the forward of step 7, three steps past the step-4 checkpoint: by
    then rank 0 has logged step 5 at least (rank 1 finished step 6, whose collectives rank 0 joined
    only after logging step 5). The agent stops rank 0 and starts both again, which resume at step
    4, run steps 5 on again and end with every step in log.jsonl exactly once, on the loss curve of
    an uninterrupted launch of the same command."""
    run = tmp_path / "killed"
    assert _wait(_torchrun(run, fault="kill")) == 0, (tmp_path / "killed.out").read_text()
    printed = (tmp_path / "killed.out").read_text()
    assert f"FAULT-CHECK rank=1 killed in the forward of step {KILLED_AT}" in printed, printed
    assert re.findall(r"resumed at step (\d+)", printed) == [str(SAVE_EVERY)], printed  # one restart, from step 4
    log = _log(run)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))  # every step exactly once
    straight = _torchrun(tmp_path / "straight")
    assert _wait(straight) == 0, (tmp_path / "straight.out").read_text()
    assert [r["loss"] for r in _log(tmp_path / "straight")] == [r["loss"] for r in log]
