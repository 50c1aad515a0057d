"""Protects how commands end on bad input (axon4d.reliability.errors): one message naming what to change and
exit code 2 — no traceback unless ``--debug`` — for ``axon4d`` subcommands and ``python -m
axon4d.train``, including a refusal raised inside a running job (a checkpoint that does not match);
a rank's refusal that the watchdog already printed is not printed again; other errors keep their
traceback."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys

import pytest

from axon4d.reliability import errors, watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv: str, module: str = "axon4d.cli", cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop(errors.DEBUG_ENV, None)
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


@pytest.mark.slow
def test_a_bad_flag_value_ends_the_command_with_one_line_and_exit_code_2():
    proc = _run("plan", "--model", "80B", "--gpus", "1024", "--batch", "2048", "--zero", "5")
    assert proc.returncode == errors.EXIT_REFUSED
    assert proc.stderr.strip().splitlines() == [
        "axon4d plan: error: zero = 5: use auto or one of (0, 1, 2) (--zero)"
    ], proc.stderr


def test_debug_shows_the_refusals_traceback(monkeypatch, capsys):
    from axon4d import cli

    monkeypatch.setenv(errors.DEBUG_ENV, "0")  # --debug sets it to 1; restored (unset) afterwards
    code = cli.main(["plan", "--model", "80B", "--gpus", "1024", "--batch", "2048", "--zero", "5", "--debug"])
    assert code == errors.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: zero = 5" in err


def _train(cfg: dict) -> None:
    from axon4d.train import TrainConfig, train

    train(TrainConfig(**cfg))


@pytest.mark.slow
def test_the_training_entry_refuses_a_resume_into_another_model_with_its_message(pools, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    pools(1).run(None, _train, dict(model="tiny", steps=2, batch_size=2, out_dir=out, progress=False))
    job = ["--model", "tiny", "--steps", "2", "--batch-size", "2", "--out-dir", out, "--no-progress"]
    resumed = _run(*job, "--steps", "3", "--resume", "--hidden", "96", module="axon4d.train")
    assert resumed.returncode == errors.EXIT_REFUSED, resumed.stderr
    lines = resumed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("axon4d train: error: ") and "hidden" in lines[0], resumed.stderr
    # a flag refused before the job starts: the same entry, run here (it sets only what monkeypatch restores)
    monkeypatch.setattr(sys, "argv", ["axon4d.train", "--steps", "0"])
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the entry would set it (restored afterwards)
    monkeypatch.setenv(errors.DEBUG_ENV, "0")
    with pytest.raises(SystemExit) as bad:
        runpy.run_module("axon4d.train", run_name="__main__")
    assert bad.value.code == errors.EXIT_REFUSED
    assert capsys.readouterr().err.strip() == (
        "axon4d train: error: --steps 0: must be at least 1; the optimizer steps of the whole run, e.g. --steps 100"
    )


def test_a_refusal_the_watchdog_reported_is_not_printed_again_and_faults_keep_their_traceback():
    err = io.StringIO()
    refusal = ValueError("--data tokens.u16 holds token 70000, above the vocabulary of 32000")
    with contextlib.redirect_stderr(err):
        watchdog.report(refusal, rank=3)  # a rank of a running job: printed with its rank

        def fail() -> int:
            raise refusal

        code = errors.run(fail, "axon4d train")
    assert code == errors.EXIT_REFUSED
    assert err.getvalue().splitlines() == [f"axon4d: rank 3: error: {refusal}"]
    with pytest.raises(RuntimeError, match="a bug"), contextlib.redirect_stderr(io.StringIO()):
        errors.run(lambda: (_ for _ in ()).throw(RuntimeError("a bug")), "axon4d train")
    fault = io.StringIO()
    with contextlib.redirect_stderr(fault):
        try:
            raise RuntimeError("a bug")
        except RuntimeError as e:
            watchdog.report(e, rank=1)
    assert fault.getvalue().startswith("axon4d: rank 1 failed:\nTraceback")


def test_debug_is_taken_from_anywhere_on_the_line(monkeypatch):
    monkeypatch.setenv(errors.DEBUG_ENV, "0")  # restored (unset) after the test
    assert errors.take_debug_flag(["train", "--steps", "3"]) == ["train", "--steps", "3"]
    assert not errors.debugging()
    assert errors.take_debug_flag(["train", "--debug", "--steps", "3"]) == ["train", "--steps", "3"]
    assert errors.debugging()
    try:
        raise ValueError("bad")
    except ValueError as e:
        text = errors.format_error(e, "axon4d plan")
    assert text.startswith("axon4d plan failed:\nTraceback") and text.endswith("ValueError: bad")
