"""Protects ``bench/gpu_block.py`` (``make gpu-check``'s ``speed`` case), which times on a GPU: its
plain-PyTorch baseline with fused QKV is the reference ``DenseBlock`` itself (outputs and gradients
in fp32), and on the host (``--on-host``) the script runs both rows, prints its two lines in their
documented form and writes their medians, pair ratios and spread. The GPU itself is never needed."""

import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from axon4d.config import ModelConfig
from axon4d.nn.block import DenseBlock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_block.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

import gpu_block  # noqa: E402  (bench/ is not a package)

GPT = ModelConfig(n_layers=1, hidden=32, n_heads=4, vocab_size=64, seq_len=8, arch="gpt")
LLAMA = ModelConfig(
    n_layers=1, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
)
FP32_TOL = 1e-5


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_the_fused_qkv_baseline_is_the_dense_block(cfg):
    # one nn.Linear of the stacked q, k, v weights: the same outputs and gradients in fp32, GQA and
    # rotary embeddings included, and the same weights (the other modules are the dense block's own)
    torch.manual_seed(0)
    dense = DenseBlock(cfg)
    fused = gpu_block.FusedQKVBlock(dense)
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    xd, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, yf = dense(xd), fused(xf)
    v = torch.randn(cfg.hidden)
    (yd * v).sum().backward()
    dqkv = torch.cat([p.weight.grad for p in (dense.attn.q_proj, dense.attn.k_proj, dense.attn.v_proj)])
    (yf * v).sum().backward()

    def rel(a, ref):
        return float((a - ref).detach().abs().max() / ref.detach().abs().max())

    assert rel(yf, yd) <= FP32_TOL and rel(xf.grad, xd.grad) <= FP32_TOL
    assert rel(fused.qkv.weight.grad, dqkv) <= FP32_TOL
    assert fused.mlp is dense.mlp and fused.o_proj is dense.attn.o_proj


def test_the_spread_of_pairs_is_their_quartiles():
    assert gpu_block.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == {"min": 1.0, "q1": 2.0, "median": 3.0, "q3": 4.0, "max": 5.0}
    assert gpu_block.spread([2.0]) == dict.fromkeys(("min", "q1", "median", "q3", "max"), 2.0)


def _check_row(row, pairs):
    samples = row["samples_s"]
    assert row["agreement"] <= gpu_block.AGREEMENT and len(samples["axon4d"]) == len(samples["torch"]) == pairs
    assert row["median_s"] == {k: statistics.median(s) for k, s in samples.items()}
    assert row["ratio"] == row["median_s"]["axon4d"] / row["median_s"]["torch"]
    assert row["pair_ratios"] == [a / t for a, t in zip(samples["axon4d"], samples["torch"])]
    spread = row["pair_spread"]
    assert spread["min"] == min(row["pair_ratios"]) and spread["max"] == max(row["pair_ratios"])
    assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]


@pytest.mark.slow
def test_the_block_speed_bench_runs_on_the_host_and_prints_its_line(tmp_path):
    """bench/gpu_block.py, which make gpu-check runs on a GPU, checked at a small width on the host."""
    out = tmp_path / "gpu_block.json"
    args = ["--on-host", "--hidden", "64", "--heads", "4", "--tokens", "32", "--pairs", "2", "--warmup", "1"]
    args += ["--sweep", "32,64", "--head-dim", "16", "--sweep-pairs", "2"]  # the FP8 sweep, two small widths
    args += ["--profile", "32"]
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args, "--out", str(out)],
        env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pure, last = proc.stdout.strip().splitlines()[-2:]
    number, pairs = r"[0-9.]+", r"pair ratios ([0-9.]+)-([0-9.]+)"
    assert re.fullmatch(
        rf"gpu pure bf16: step {number} ms, plain PyTorch \(unfused QKV, bf16 weights\) {number} ms "
        rf"\(ratio {number}\), {pairs}",
        pure,
    ), pure
    headline = re.fullmatch(
        rf"gpu: width 64, 1 rank, bf16 over fp32 weights: step {number} ms, plain PyTorch \(fused QKV, autocast\) "
        rf"{number} ms \(ratio ({number})\), {pairs}, MFU {number}%",
        last,
    )
    assert headline, last
    saved = json.loads(out.read_text())
    assert saved["precision"] == "bf16-fp32-reduce" and saved["pure_bf16"]["precision"] == "bf16"
    for row in (saved, saved["pure_bf16"]):
        _check_row(row, 2)
    # the headline's ratio as make gpu-check reads it ("(ratio R)"), and the pairs' range
    assert re.search(r"\(ratio ([0-9.]+)\)", last).group(1) == headline.group(1) == f"{saved['ratio']:.3f}"
    spread = saved["pair_spread"]
    assert headline.group(2, 3) == (f"{spread['min']:.3f}", f"{spread['max']:.3f}")
    assert saved["mfu"] > 0
    # the FP8 row (the host has FP8 GEMMs, emulated) and the sweep: per width every layer kind's
    # measured saving beside the planner's, and the width from which each says FP8 wins
    lines = proc.stdout.splitlines()
    assert saved["fp8"]["precision"] == "bf16-fp8" and saved["fp8_speedup"] > 0
    assert saved["fp8_speedup"] == saved["median_s"]["axon4d"] / saved["fp8"]["median_s"]["axon4d"]
    assert [r["hidden"] for r in saved["fp8_sweep"]] == [32, 64]
    kinds = ("qkv", "attn_out", "mlp_up", "mlp_down")
    for r in saved["fp8_sweep"]:
        assert set(r["samples_s"]) == {"bf16", "fp8", *kinds} and all(len(v) == 2 for v in r["samples_s"].values())
        assert set(r["kinds"]) == set(kinds) and all(k["fits"] for k in r["kinds"].values())
        for k in kinds:
            saved_ms = [1e3 * (b - f) for b, f in zip(r["samples_s"]["bf16"], r["samples_s"][k])]
            assert r["kinds"][k]["measured_saving_ms"] == pytest.approx(statistics.median(saved_ms))
            assert r["kinds"][k]["planned_saving_ms"] is not None and not r["kinds"][k]["planner_fp8"]  # the host
    assert set(saved["fp8_first_win"]) == set(kinds)
    assert sum(line.startswith("fp8 sweep width ") for line in lines) == 2
    assert any(line.startswith("gpu fp8: bf16-fp8 step ") and "(fused casts: False)" in line for line in lines)
    assert any(line.startswith("gpu fp8 sweep: FP8 wins from width (measured / planner): qkv ") for line in lines)
    # the profile of the all-FP8 step: its ops by host time (the host has no device timeline)
    prof = saved["fp8_profile"]
    assert prof["width"] == 32 and prof["host_us_per_step"] > 0 and prof["by_host"] and len(prof["by_host"]) <= 20
    assert any("scaled_mm" in r["name"] for r in prof["by_host"]), prof["by_host"]
    assert any(line.startswith("gpu fp8 profile width 32: device ") for line in lines)
