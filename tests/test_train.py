"""Protects the training job: the gradient norm counts every element once however it is sharded
or replicated, a run is reproducible and resumes on the same loss curve, gradient accumulation
equals one big batch, every TrainConfig field is a documented command-line flag, and a run's
outputs hold what they promise: log.jsonl (a typed record per logged step), summary.json, the
loss-curve PNG and rank 0's progress line, with communication hidden as axon4d.comm.log defines it;
--recompute reaches the model and the records, and rank 0 warns at start-up when the compute dtype's
matmuls are far slower than fp32's."""

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import shutil
import types

import pytest
import torch

import axon4d
from axon4d import checkpoint, grads
from axon4d import device as devices
from axon4d.comm import log as commlog
from axon4d.config import ModelConfig
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.options.precision import Precision
from axon4d.options.recompute_mode import RECOMPUTE_MODES
from axon4d.train import TrainConfig, add_arguments, train
from axon4d.train.peak import SLOW_RATIO, check_compute_dtype

CFG = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama")


def _norms(grid, cfg):
    """(grad_norm, clip_grad_norm_'s norm, the dense model's norm in fp64 and by torch's
    clip_grad_norm_, the largest difference of the clipped gradients from the dense model's clipped
    by torch relative to the largest gradient, the norm after clipping, the clipping bound)."""
    torch.manual_seed(4)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1))
    model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    dense.loss(ids[:, :-1], ids[:, 1:]).backward()
    ref = torch.sqrt(sum(p.grad.double().square().sum() for p in dense.parameters())).item()
    norm = grads.grad_norm(model, grid)
    assert norm.shape == () and norm.dtype == torch.float32 and norm.device == grid.device
    bound = ref / 3  # clipping scales every gradient by about 1/3
    clipped = grads.clip_grad_norm_(model, bound, grid).item()
    torch_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), bound).item()
    got = dict(model.to_dense(grads=True).named_parameters())
    largest = max(float(p.grad.abs().max()) for p in dense.parameters())  # k_proj.bias's gradient is 0 but for rounding
    rel = max(float((got[n].grad - p.grad).abs().max()) for n, p in dense.named_parameters()) / largest
    return norm.item(), clipped, ref, torch_norm, rel, grads.grad_norm(model, grid).item(), bound


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(arch="gpt", n_kv_heads=None)], ids=["llama", "gpt"])
@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 1, 4)])
@pytest.mark.slow
def test_grad_norm_counts_each_element_once(pools, cfg, grid):
    """The fp32 foreach norm equals the dense model's (fp64 sums, and torch.nn.utils.clip_grad_norm_)
    on every rank, and clipping on the device scales the gradients as torch clips the dense model's."""
    for norm, clipped, ref, torch_norm, rel, after, bound in pools(8).run(grid, _norms, cfg):
        assert abs(norm - ref) / ref < 2e-6 and abs(norm - torch_norm) / torch_norm < 2e-6
        assert clipped == norm  # the norm before clipping
        assert rel < 1e-5 and after == pytest.approx(bound, rel=1e-5)


def _run(cfg_dict):
    summary = train(TrainConfig(**cfg_dict))
    return summary["losses"]


def _run_captured(cfg_dict):
    """Train; return the summary and what this rank printed to stdout and stderr (the progress bar)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        summary = train(TrainConfig(**cfg_dict))
    return summary, out.getvalue(), err.getvalue()


def _untimed(cfg_dict):
    """Train with ``AXON4D_COMM_TIMING=0`` (the collectives untimed); the summary and stdout."""
    os.environ["AXON4D_COMM_TIMING"] = "0"
    try:
        return _run_captured(cfg_dict)[:2]
    finally:
        del os.environ["AXON4D_COMM_TIMING"]


def test_with_the_collectives_untimed_the_job_trains_and_says_so(pools, tmp_path):
    """``AXON4D_COMM_TIMING=0`` (axon4d.comm.log): the job trains the same losses, reports each
    step's bytes and says the share hidden was not timed, instead of failing on the times."""
    cfg = _base(tmp_path / "timed", grid="1,2,1,1", steps=2)
    timed = pools(2).run(None, _run, cfg)[0]
    summary, printed = pools(2).run(None, _untimed, {**cfg, "out_dir": str(tmp_path / "untimed")})[0]
    assert summary["losses"] == timed and summary["hidden_pct"] is None
    assert summary["comm_bytes_per_step"]["y"] > 0 and "communication hidden  not timed" in printed
    assert all(r["hidden_pct"] is None and r["comm_bytes"]["y"] > 0 for r in _log(tmp_path / "untimed"))


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


RECORD_TYPES = {
    "step": int,
    "loss": float,
    "lr": float,
    "grad_norm": float,
    "step_s": float,
    "tokens_per_s": float,
    "mfu": float,
    "comm_bytes": dict,
    "comm_s": float,
    "blocked_s": float,
    "hidden_pct": float,
    "rss_bytes": int,
    "threads": int,
}
SUMMARY_KEYS = {
    "grid",
    "device",
    "recompute",
    "steps",
    "final_loss",
    "median_step_s",
    "median_tokens_per_s",
    "median_mfu",
    "comm_bytes_per_step",
    "hidden_pct",
    "checkpoint",
    "async_save",
    "save_blocked_s",
    "single_process_losses",
    "max_rel_diff",
    "nonfinite_skipped",
    "peak_tflops",
    "peak_source",
    "precision",
    "tf32",
    "optimizer",
    "zero",
}
PROGRESS = re.compile(r"loss (\d+\.\d{4}) \| ([\d,]+) tok/s \| MFU (\d+\.\d)% \| hidden (\d+)%")


def _check_log(records, cfg_dict, log_every, losses):
    """One typed record per logged step, steps increasing, finite losses equal to the run's, MFU
    against the peak of 8 ranks at --peak-tflops 1."""
    cfg = TrainConfig(**cfg_dict)
    steps, mcfg = cfg.steps, cfg.model_config()
    tokens_per_step = cfg.batch_size * cfg.micro_batches * mcfg.seq_len
    assert [r["step"] for r in records] == list(range(log_every, steps + 1, log_every))
    assert [r["loss"] for r in records] == losses[log_every - 1 :: log_every]
    for r in records:
        assert {k: type(v) for k, v in r.items()} == RECORD_TYPES, r
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and math.isfinite(r["grad_norm"]) and r["lr"] > 0
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(tokens_per_step / r["step_s"])
        assert 0 < r["mfu"] <= 1 and r["mfu"] == pytest.approx(mcfg.flops_per_token() * r["tokens_per_s"] / 8e12)
        assert {"x", "y", "z"} <= set(r["comm_bytes"]) and all(
            isinstance(b, int) and b > 0 for b in r["comm_bytes"].values()
        )
        assert 0 <= r["blocked_s"] <= r["comm_s"] + 1e-9  # blocked time lies inside communication time
        assert r["rss_bytes"] > 2**20 and r["threads"] >= 1
        assert r["hidden_pct"] == pytest.approx(commlog.hidden_pct(r["comm_s"], r["blocked_s"]), abs=1e-9)


def _base(tmp, **kw):
    cfg = dict(
        grid="2,2,2,1",
        model="tiny",
        layers=1,
        hidden=32,
        heads=4,
        kv_heads=2,
        vocab_size=64,
        seq_len=8,
        batch_size=8,
        steps=4,
        warmup_steps=2,
        out_dir=str(tmp),
        progress=False,
        peak_tflops=1.0,
    )
    cfg.update(kw)
    return cfg


@pytest.mark.slow
def test_resume_of_an_interrupted_run_matches_exactly(pools, tmp_path):
    straight = pools(8).run(None, _run, _base(tmp_path / "a", steps=6, save_every=3))[0]
    assert straight == pools(8).run(None, _run, _base(tmp_path / "b", steps=6))[0]  # same seed, same run
    # simulate an interruption after step 3: keep only the step-3 checkpoint, then resume
    ckpts = tmp_path / "a" / "checkpoints"
    shutil.rmtree(ckpts / "step_6")
    resumed = pools(8).run(None, _run, _base(tmp_path / "a", steps=6, save_every=3, resume="always"))[0]
    assert resumed == straight[3:]
    # the resumed run keeps the log up to its checkpoint's step and writes on: each step once
    log = _log(tmp_path / "a")
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in log] == straight[:3] + resumed
    meta = checkpoint.read_meta(str(ckpts / "step_6"))
    assert meta["train_config"]["recompute"] == "none" and meta["step"] == 6
    # on another grid (and with another transport layout): the same curve within 1e-5
    shutil.rmtree(ckpts / "step_6")
    other = pools(8).run(None, _run, _base(tmp_path / "a", grid="1,2,1,4", steps=6, save_every=3, resume="always"))[0]
    assert max(abs(a - b) / b for a, b in zip(other, straight[3:])) < 1e-5
    # a fresh run refuses the directory; resuming at or past --steps, or with another model, is refused
    for kw, says in (
        ({}, "holds checkpoints of another run"),
        ({"resume": "always", "steps": 6}, "already at its last step"),
        ({"resume": "always", "steps": 5}, "already past its last step"),
        ({"resume": "always", "hidden": 64}, "differs in 'hidden'"),
        ({"resume": "always", "lr": 1.0}, "differs in 'lr'"),
    ):
        errors = pools(8).run(None, _refused, _base(tmp_path / "a", **{"steps": 8, **kw}))
        assert all(says in e for e in errors), (kw, errors)
    # --overwrite starts afresh and deletes the old checkpoints
    fresh = pools(8).run(None, _run, _base(tmp_path / "a", steps=2, overwrite=True))[0]
    assert fresh == straight[:2] and checkpoint.list_checkpoints(str(ckpts)) == [str(ckpts / "step_2")]


@pytest.mark.slow
def test_context_parallel_training_follows_the_same_loss_curve(pools, tmp_path):
    """--context-parallel splits each sequence's tokens head–tail over z instead of whole sequences:
    the same batches, so the same losses (fp32, within 1e-5), with the K/V all-gather in the log."""
    plain = pools(8).run(None, _run, _base(tmp_path / "a"))[0]
    split = pools(8).run(None, _run, _base(tmp_path / "b", context_parallel=True, save_every=2))[0]
    assert max(abs(a - b) / b for a, b in zip(split, plain)) < 1e-5
    # resuming a context-parallel run without it (or the other way round) continues the same curve
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_4")
    resumed = pools(8).run(None, _run, _base(tmp_path / "b", resume="always"))[0]
    assert max(abs(a - b) / b for a, b in zip(resumed, plain[2:])) < 1e-5
    # a sequence that does not split is refused on every rank: S = 8 cannot be cut into 2·G_z = 16 chunks
    errors = pools(8).run(None, _refused, _base(tmp_path / "c", grid="1,1,8,1", batch_size=8, context_parallel=True))
    assert all("multiple of 16" in e for e in errors), errors


def _refused(cfg_dict):
    with pytest.raises(ValueError) as e:
        train(TrainConfig(**cfg_dict))
    return str(e.value)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(pools, tmp_path):
    # the big-batch run also shows its progress bar and compares with one process: its outputs are checked below
    big_cfg = _base(tmp_path / "a", batch_size=16, progress=True, compare_single=True)
    ranks = pools(8).run(None, _run_captured, big_cfg)
    summary, stdout, stderr = ranks[0]
    big = summary["losses"]
    # recomputation changes no gradient: the accumulating run recomputes whole blocks
    acc_cfg = _base(tmp_path / "b", batch_size=8, micro_batches=2, log_every=2, recompute="full")
    acc = pools(8).run(None, _run, acc_cfg)[0]
    assert max(abs(a - b) / b for a, b in zip(acc, big)) < 1e-5
    with open(tmp_path / "b" / "summary.json") as f:
        assert json.load(f)["recompute"] == "full"
    assert checkpoint.read_meta(str(tmp_path / "b" / "checkpoints" / "step_4"))["train_config"]["recompute"] == "full"
    _check_outputs(tmp_path / "a", big_cfg, big, stdout, stderr)
    assert all(out == "" and err == "" for _, out, err in ranks[1:])  # only rank 0 prints
    _check_log(_log(tmp_path / "b"), acc_cfg, 2, acc)
    assert not (tmp_path / "b" / "loss.png").exists()


def _check_outputs(out_dir, cfg_dict, losses, stdout, stderr):
    """log.jsonl, summary.json, loss.png and rank 0's printout of a run with --compare-single."""
    records = _log(out_dir)
    _check_log(records, cfg_dict, 1, losses)
    steps = cfg_dict["steps"]
    with open(out_dir / "summary.json") as f:
        s = json.load(f)
    assert set(s) == SUMMARY_KEYS
    assert s["grid"] == "(x=2, y=2, z=2, data=1)" and s["steps"] == steps and s["final_loss"] == losses[-1]
    assert s["device"] == str(devices.default_device()) and s["recompute"] == "none"
    # --precision auto on the host: fp32, no TF32, AdamW's multi-tensor implementation; the banner says so too
    assert (s["precision"], s["tf32"], s["optimizer"]) == ("fp32", False, "foreach")
    assert "precision fp32; fp32 matmuls fp32; AdamW foreach" in stdout and re.search(r"\noptimizer +foreach\n", stdout)
    assert (s["peak_tflops"], s["peak_source"]) == (8.0, "--peak-tflops")  # 1 TFLOP/s on each of 8 ranks
    steady = records[1:]  # the first step pays for warm-up
    median = lambda key: sorted(r[key] for r in steady)[len(steady) // 2]  # noqa: E731
    assert s["median_step_s"] == median("step_s") and s["median_tokens_per_s"] == median("tokens_per_s")
    assert s["median_mfu"] == median("mfu") and 0 < s["median_mfu"] <= 1
    assert s["comm_bytes_per_step"] == pytest.approx(
        {a: sum(r["comm_bytes"][a] for r in steady) / len(steady) for a in steady[0]["comm_bytes"]}
    )
    comm_s, blocked_s = sum(r["comm_s"] for r in steady), sum(r["blocked_s"] for r in steady)
    assert s["hidden_pct"] == pytest.approx(commlog.hidden_pct(comm_s, blocked_s), abs=1e-9)
    assert s["checkpoint"] == str(out_dir / "checkpoints" / f"step_{steps}")
    assert os.path.exists(os.path.join(s["checkpoint"], "meta.json"))
    assert len(s["single_process_losses"]) == steps and s["max_rel_diff"] < 1e-5
    png = (out_dir / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    # the progress bar shows every step's loss, tokens/s, MFU and hidden communication
    shown = set(PROGRESS.findall(stderr))
    for r in records:
        assert (
            f"{r['loss']:.4f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['mfu']:.1f}",
            f"{r['hidden_pct']:.0f}",
        ) in shown, r
    assert "peak 8.000 TFLOP/s over 8 ranks" in stdout and "run summary" in stdout
    assert f"communication hidden  {s['hidden_pct']:.0f}%" in stdout
    assert f"max relative loss difference over {steps} steps" in stdout


def test_every_config_field_is_a_documented_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text
    args = parser.parse_args(["--grid", "2,1,2,2", "--steps", "7", "--no-progress", "--lr", "0.5"])
    assert args.grid == "2,1,2,2" and args.steps == 7 and args.progress is False and args.lr == 0.5
    assert "Peak learning rate" in text
    assert parser.parse_args([]).recompute == "none"
    assert parser.parse_args([]).precision == "auto" and "(default: auto)" in text  # bf16-fp32-reduce on GPUs
    assert parser.parse_args([]).tf32 is True and parser.parse_args(["--no-tf32"]).tf32 is False
    for mode in RECOMPUTE_MODES:
        assert parser.parse_args(["--recompute", mode]).recompute == mode
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["--recompute", "most"])  # argparse lists the modes


def test_unknown_recompute_mode_is_rejected():
    with pytest.raises(ValueError, match="recompute='most' is not a recomputation mode; choose one of none"):
        train(TrainConfig(recompute="most"))


def _fake_grid(rank=0, precision="bf16"):
    return types.SimpleNamespace(rank=rank, device=devices.HOST, precision=Precision.parse(precision))


def test_slow_compute_dtype_warns_on_rank_0():
    seconds = {torch.bfloat16: 0.6, torch.float32: 0.01}  # bf16 60x slower, as on a CPU without AVX-512 BF16

    def timer(device, dtype):
        assert device == devices.HOST
        return seconds[dtype]

    out = io.StringIO()
    msg = check_compute_dtype(_fake_grid(), timer=timer, out=out)
    assert out.getvalue() == msg + "\n"
    assert "bfloat16 matmuls are 60x slower than fp32" in msg and "--precision fp32" in msg
    # both speeds, in GFLOP/s of the 512 x 512 matmul: 2·512³ / 0.6 s and / 0.01 s
    assert "0.447 GFLOP/s in bfloat16 against 26.8 GFLOP/s in fp32" in msg

    seconds[torch.bfloat16] = 0.01 * SLOW_RATIO  # just slow enough to be let through
    out = io.StringIO()
    assert check_compute_dtype(_fake_grid(), timer=timer, out=out) is None and out.getvalue() == ""

    def never(device, dtype):
        raise AssertionError("measured where nothing is to be checked")

    assert check_compute_dtype(_fake_grid(rank=1), timer=never) is None  # only rank 0 measures and warns
    assert check_compute_dtype(_fake_grid(precision="fp32"), timer=never) is None  # fp32: nothing to compare
    assert devices.matmul_seconds(devices.HOST, torch.float32, n=64, budget_s=0.01) > 0  # the real timer runs


def test_unknown_precision_is_rejected():
    with pytest.raises(
        ValueError,
        match="precision 'fp8' is not supported; use one of fp32, bf16, bf16-fp32-reduce, bf16-fp8-gather, bf16-fp8, auto",
    ):
        train(TrainConfig(precision="fp8"))
