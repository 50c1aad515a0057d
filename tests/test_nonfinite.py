"""Non-finite steps of the training job (docs/reliability.md): detected on every rank with one
decision, skipped (the weights do not change) and logged with the first parameter whose gradient
is non-finite, ended after --max-nonfinite in a row or at once with --on-nonfinite stop, never
saved into a checkpoint."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from axon4d import checkpoint
from axon4d.models.transformer import Transformer
from axon4d.train import TrainConfig, train


def _cfg(tmp, **kw):
    cfg = dict(
        grid="1,2,1,2",
        model="tiny",
        layers=1,
        hidden=32,
        heads=4,
        vocab_size=64,
        seq_len=8,
        batch_size=8,
        steps=6,
        warmup_steps=1,
        out_dir=str(tmp),
        progress=False,
        peak_tflops=1.0,
        save_every=3,
    )
    cfg.update(kw)
    return cfg


def _with_nan_steps(cfg_dict, nan_steps, rank_only=None):
    """Train with the logits multiplied by NaN at the steps ``nan_steps`` (counted from 1) — on every
    rank, or on rank ``rank_only`` alone; return (summary or the exception's text, this rank's number)."""
    import torch.distributed as dist

    forward = Transformer.forward
    calls = {"n": 0}

    def planted(self, ids, documents=None):
        calls["n"] += 1
        out = forward(self, ids, documents)
        if calls["n"] in nan_steps and (rank_only is None or dist.get_rank() == rank_only):
            return out * float("nan")
        return out

    Transformer.forward = planted
    try:
        return train(TrainConfig(**cfg_dict)), dist.get_rank()
    except FloatingPointError as e:
        return str(e), dist.get_rank()
    finally:
        Transformer.forward = forward


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _weights_equal(grid, path, a, b):
    """Whether the checkpoints of steps ``a`` and ``b`` hold the same weights (this rank's shards)."""
    cfg = TrainConfig(**_cfg(path)).model_config()
    models = []
    for step in (a, b):
        models.append(Transformer(cfg, grid=grid))
        checkpoint.load(str(path / "checkpoints" / f"step_{step}"), models[-1], grid)
    return all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(pools, tmp_path):
    out = pools(4).run(None, _with_nan_steps, _cfg(tmp_path / "nan", save_every=1), (3,), 2)
    summaries = [s for s, _ in out]
    assert all(isinstance(s, dict) for s in summaries), summaries
    assert {s["nonfinite_skipped"] for s in summaries} == {1}  # one decision, on every rank
    log = _log(tmp_path / "nan")
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert log[2]["skipped"] is True and not math.isfinite(log[2]["loss"])
    assert log[2]["nonfinite_param"] == "tok_emb.weight"  # the first parameter (in order) hit by the NaN
    assert all("skipped" not in r for i, r in enumerate(log) if i != 2)
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(log) if i != 2)
    # the weights did not move at step 3, and did at the steps around it
    assert all(pools(4).run((1, 2, 1, 2), _weights_equal, tmp_path / "nan", 2, 3))
    assert not any(pools(4).run((1, 2, 1, 2), _weights_equal, tmp_path / "nan", 3, 4))
    assert checkpoint.read_meta(str(tmp_path / "nan" / "checkpoints" / "step_3"))["nonfinite_skipped"] == 1
    # a resumed run counts the steps skipped before it: two more finite steps, still one skipped
    cfg = _cfg(tmp_path / "nan", save_every=1, steps=8, resume="always")
    resumed = [s for s, _ in pools(4).run(None, _with_nan_steps, cfg, ())]
    assert {s["nonfinite_skipped"] for s in resumed} == {1}, resumed
    assert checkpoint.read_meta(str(tmp_path / "nan" / "checkpoints" / "step_8"))["nonfinite_skipped"] == 1


def _checkpoint_is_finite(grid, path):
    cfg = TrainConfig(**_cfg(path)).model_config()
    model = Transformer(cfg, grid=grid)
    checkpoint.load(str(path / "checkpoints" / "step_6"), model, grid)
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.slow
def test_nan_steps_are_never_saved(pools, tmp_path):
    pools(4).run(None, _with_nan_steps, _cfg(tmp_path, save_every=1), (2, 4, 6))
    assert [r["step"] for r in _log(tmp_path) if r.get("skipped")] == [2, 4, 6]
    assert all(pools(4).run((1, 2, 1, 2), _checkpoint_is_finite, tmp_path))


@pytest.mark.slow
def test_too_many_in_a_row_end_the_run_on_every_rank(pools, tmp_path):
    out = pools(4).run(None, _with_nan_steps, _cfg(tmp_path, max_nonfinite=2), (2, 3))
    for message, rank in out:
        assert isinstance(message, str), (rank, message)
        assert "2 non-finite steps in a row (--max-nonfinite 2)" in message and "step 3:" in message


@pytest.mark.slow
def test_stop_ends_the_run_at_the_first(pools, tmp_path):
    out = pools(4).run(None, _with_nan_steps, _cfg(tmp_path, on_nonfinite="stop"), (2,))
    for message, _ in out:
        assert isinstance(message, str) and "step 2:" in message and "--on-nonfinite stop" in message
    assert not os.path.exists(tmp_path / "checkpoints" / "step_6")


@pytest.mark.slow
def test_a_huge_learning_rate_is_stopped_not_trained_to_the_end(pools, tmp_path):
    out = pools(4).run(None, _with_nan_steps, _cfg(tmp_path, lr=1e6, min_lr=1e6, steps=12), ())
    for result, rank in out:  # the gradients overflow within a few steps; three in a row end the run
        assert isinstance(result, str) and "3 non-finite steps in a row" in result, (rank, result)
    assert not os.path.exists(tmp_path / "checkpoints" / "step_12")


@pytest.mark.parametrize("value", ["sometimes", ""])
def test_on_nonfinite_takes_skip_or_stop(value):
    import argparse

    from axon4d.train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--on-nonfinite", value])
