"""Protects checkpoints written in the background (``checkpoint.AsyncSaver``, ``--async-save``): an
async save writes what a blocking save of the same moment writes, although training changes the
weights while it is written; a run with --async-save and its resume follow the blocking run's
losses; a second save waits for the one in flight; a write that fails leaves the previous
checkpoint the newest and loadable and is the same error on every rank at the next save; the
switch and the saver's arguments are checked."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
from test_train import _base
from torch.distributed.checkpoint import FileSystemWriter

from axon4d import checkpoint
from axon4d.config import ModelConfig
from axon4d.files import ckptfiles
from axon4d.models.transformer import Transformer
from axon4d.train import TrainConfig, train

CFG = ModelConfig(n_layers=1, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8)


def _model(seed: int = 1):
    """A small model on the current grid and its AdamW after one step (both moments exist)."""
    torch.manual_seed(seed)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0.5)
    return model, opt


def _step(model, opt, grad: float) -> None:
    for p in model.parameters():  # a made-up gradient: the weights and moments change
        p.grad = torch.full_like(p, grad)
    opt.step()


def _state(model, opt) -> list[torch.Tensor]:
    """This rank's parameters, moments and step counts, in order."""
    out = []
    for p in model.parameters():
        st = opt.state[p]
        out += [p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(), torch.as_tensor(st["step"])]
    return out


def _held_writes(gate: threading.Event):
    """Make every DCP write of this process wait for ``gate`` first; returns the undo."""
    real = checkpoint.writer.Writer.write_data

    def held(self, *a, **k):
        gate.wait(30)
        return real(self, *a, **k)

    checkpoint.writer.Writer.write_data = held
    return lambda: setattr(checkpoint.writer.Writer, "write_data", real)


def _saved_alike(grid, out):
    """Save the same moment blocking and in the background, training one more step before the
    background write may begin; load both into fresh models. Whether this rank's loaded states
    are the same, and what the saver said was in flight."""
    model, opt = _model()
    extra = {"note": "same"}
    checkpoint.save(os.path.join(out, "sync"), model, grid, opt, step=1, extra=extra)
    gate = threading.Event()
    undo = _held_writes(gate)
    try:
        with checkpoint.AsyncSaver(grid) as saver:
            saver.save(os.path.join(out, "async"), model, opt, step=1, extra=extra)
            in_flight = saver.in_flight
            _step(model, opt, -0.25)  # training goes on: the write must not see this step
            gate.set()
    finally:
        undo()
    loaded = []
    for name in ("sync", "async"):
        fresh, fresh_opt = _model(seed=2)
        checkpoint.load(os.path.join(out, name), fresh, grid, fresh_opt)
        loaded.append(_state(fresh, fresh_opt))
    return all(torch.equal(a, b) for a, b in zip(*loaded)), in_flight == os.path.join(out, "async")


def test_an_async_save_writes_what_a_blocking_save_writes(pools, tmp_path):
    out = str(tmp_path)
    assert pools(4).run((1, 2, 2, 1), _saved_alike, out) == [(True, True)] * 4
    sync, bg = (checkpoint.read_meta(os.path.join(out, n)) for n in ("sync", "async"))
    assert {k: v for k, v in sync.items() if k != "files"} == {k: v for k, v in bg.items() if k != "files"}
    shards = sorted(n for n in sync["files"] if n != ckptfiles.DCP_INDEX)
    assert len(shards) > 4 and shards == sorted(n for n in bg["files"] if n != ckptfiles.DCP_INDEX)
    assert all(sync["files"][n] == bg["files"][n] for n in shards)  # the same bytes in every shard
    assert sorted(os.listdir(out)) == ["async", "sync"]


def _run(cfg_dict):
    summary = train(TrainConfig(**cfg_dict))
    return summary["losses"], summary["async_save"], summary["save_blocked_s"]


def _cfg(out, **kw):
    return _base(out, grid="1,2,2,1", save_every=2, **kw)  # test_train's small run, on four ranks


def test_training_with_async_saves_resumes_on_the_same_losses(pools, tmp_path):
    blocking, was_async, blocked = pools(4).run(None, _run, _cfg(tmp_path / "a"))[0]
    assert not was_async and len(blocked) == 2
    background, was_async, blocked = pools(4).run(None, _run, _cfg(tmp_path / "b", async_save=True))[0]
    assert background == blocking and was_async and len(blocked) == 2 and all(b >= 0 for b in blocked)
    ckpts = tmp_path / "b" / "checkpoints"
    assert checkpoint.list_checkpoints(str(ckpts)) == [str(ckpts / "step_2"), str(ckpts / "step_4")]
    assert checkpoint.latest(str(ckpts)) == str(ckpts / "step_4")
    # resume from the step-2 checkpoint written in the background, saving blocking now (a resumable change)
    shutil.rmtree(ckpts / "step_4")  # as if the run had died before publishing step 4
    resumed = pools(4).run(None, _run, _cfg(tmp_path / "b", resume="always"))[0][0]
    assert resumed == blocking[2:]


def _second_save_waits(grid, out):
    """Hold the first background write until a moment after the second save began; what the
    second save saw when it returned: whether the first write had been let go, and what was
    published. (The delay only gives a second save that did not wait the time to return first.)"""
    model, opt = _model()
    gate = threading.Event()
    undo = _held_writes(gate)
    try:
        with checkpoint.AsyncSaver(grid) as saver:
            saver.save(os.path.join(out, "step_1"), model, opt, step=1)
            first_done = os.path.exists(os.path.join(out, "step_1"))
            threading.Timer(0.5, gate.set).start()
            saver.save(os.path.join(out, "step_2"), model, opt, step=2)
            released = gate.is_set()
            published = checkpoint.list_checkpoints(out)
    finally:
        gate.set()
        undo()
    return first_done, released, published


def test_a_second_save_waits_for_the_one_in_flight(pools, tmp_path):
    out = str(tmp_path)
    for first_done, released, published in pools(2).run((2, 1, 1, 1), _second_save_waits, out):
        assert not first_done and released and published == [os.path.join(out, "step_1")]
    assert checkpoint.list_checkpoints(out) == [os.path.join(out, f"step_{s}") for s in (1, 2)]


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as e:
        return (type(e).__name__, str(e))


def _failed_write(grid, out):
    """Save step_2, then step_4 whose write fails on rank 1 in the background; the outcomes of the
    next save (which raises step_4's error), of loading the newest checkpoint, and of saving again."""
    model, opt = _model()
    real = FileSystemWriter.write_data

    def broken(self, *a, **k):
        raise OSError("the shard could not be written")

    with checkpoint.AsyncSaver(grid) as saver:
        saver.save(os.path.join(out, "step_2"), model, opt, step=2)
        saver.wait()  # step_2 published: its write must not meet the broken writer
        FileSystemWriter.write_data = broken if grid.rank == 1 else real
        try:
            started = _outcome(lambda: saver.save(os.path.join(out, "step_4"), model, opt, step=4))
            failed = _outcome(lambda: saver.save(os.path.join(out, "step_6"), model, opt, step=6))
        finally:
            FileSystemWriter.write_data = real
        left = sorted(os.listdir(out))
        newest = checkpoint.latest(out)
        fresh, fresh_opt = _model(seed=3)
        loaded = _outcome(lambda: checkpoint.load(newest, fresh, grid, fresh_opt)["step"])
        again = _outcome(lambda: saver.save(os.path.join(out, "step_6"), model, opt, step=6))
    return started, failed, left, loaded, again


def test_a_failed_background_write_is_raised_everywhere_and_keeps_the_previous_checkpoint(pools, tmp_path):
    out = str(tmp_path)
    ranks = pools(2).run((2, 1, 1, 1), _failed_write, out)
    for started, failed, left, loaded, again in ranks:
        assert started == ("ok", None)  # the failure happens in the background
        assert failed == ranks[0][1] and failed[0] == "OSError", failed  # the same error on every rank
        assert "could not be written" in failed[1] and "rank 1 of 2" in failed[1] and "step_4" in failed[1]
        assert left == [".step_4.partial", "latest", "step_2"]  # nothing of step_4 published, nor step_6 begun
        assert loaded == ("ok", 2) and again == ("ok", None)
    assert sorted(os.listdir(out)) == ["latest", "step_2", "step_6"]  # step_4's leftovers removed
    assert checkpoint.latest(out) == os.path.join(out, "step_6")


def _abandoned(grid, out):
    """An error inside the saver's block while a save is in flight: the block ends at once,
    publishing nothing; the checkpoints complete afterwards."""
    model, opt = _model()
    with pytest.raises(RuntimeError, match="training failed"):
        with checkpoint.AsyncSaver(grid) as saver:
            saver.save(os.path.join(out, "step_1"), model, opt, step=1)
            raise RuntimeError("training failed")
    return checkpoint.list_checkpoints(out)


def test_an_error_with_a_save_in_flight_publishes_nothing_and_does_not_wait(pools, tmp_path):
    assert pools(2).run((2, 1, 1, 1), _abandoned, str(tmp_path)) == [[], []]


def _bad_timeout(grid):
    with pytest.raises(ValueError, match="timeout_s 0 must be a number of seconds above 0"):
        checkpoint.AsyncSaver(grid, timeout_s=0)
    return True


def test_the_switch_and_the_saver_are_checked(pools, tmp_path):
    with pytest.raises(TypeError, match=r"--async-save 'yes' \(str\) must be True or False"):
        TrainConfig(async_save="yes")
    assert TrainConfig(async_save=True).async_save
    assert "async_save" in checkpoint.RESUMABLE_CHANGES  # a run may resume with or without it
    assert pools(1).run((1, 1, 1, 1), _bad_timeout) == [True]
