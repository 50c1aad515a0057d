"""The round trip of a saved Hugging Face MoE model through ``axon4d train --hf`` and ``axon4d
export-hf``, one home for tests/test_hf_moe.py, test_hf_moe_families.py and test_hf_deepseek.py.

``round_trip`` fine-tunes the saved model on a grid of 4 ranks with the one-process comparison on,
exports the job's last checkpoint and checks what every family must hold: the job equals the
one-process run, its first loss is transformers' own, ``from_pretrained`` of the export holds
exactly the trained weights (every name, bit for bit) and computes the trained model's logits. It
returns what a family's own checks read (which weights were tuned, which kept).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch

#: the saved models' vocabulary and the jobs' sequence length
VOCAB, SEQ = 320, 16
TOL = 1e-5


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in float64."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def train_then_load(cfg_dict: dict[str, Any], grid: tuple[int, int, int, int]) -> dict[str, Any]:
    """On every rank of the bare world: ``axon4d train`` of ``cfg_dict`` (its losses, the
    one-process run's, their largest relative difference), then, on ``grid``, the dense Hugging
    Face model of ``cfg_dict["hf"]`` with the weights of the job's last checkpoint (``trained``:
    its state dict under transformers' names)."""
    import os

    import axon4d
    from axon4d import checkpoint
    from axon4d.train import TrainConfig, hf, train

    warnings.simplefilter("ignore")
    summary = train(TrainConfig(**cfg_dict))
    got = {k: summary.get(k) for k in ("losses", "single_process_losses", "max_rel_diff")}
    path, seq = cfg_dict["hf"], cfg_dict["seq_len"]
    ckpt = os.path.join(cfg_dict["out_dir"], "checkpoints", f"step_{cfg_dict['steps']}")
    g = axon4d.init(grid=grid)
    try:
        model = hf.build(path, hf.model_config(path, seq), g)
        checkpoint.load(ckpt, model, g, check_model=False)
        got["trained"] = {k: v.detach().clone() for k, v in model.to_dense().module.state_dict().items()}
    finally:
        axon4d.shutdown()
    return got


@dataclasses.dataclass
class RoundTrip:
    """What ``round_trip`` leaves for a family's own checks."""

    original: Any  #: transformers' model as saved
    exported: Any  #: ``from_pretrained`` of the export
    trained: dict[str, torch.Tensor]  #: the job's weights under transformers' names


def round_trip(pools: Any, tmp_path: Any, path: str, grid: str, steps: int) -> RoundTrip:
    """``axon4d train --hf path`` on ``grid`` (4 ranks; batch 4 in 2 micro-batches, ``steps`` steps)
    with ``--compare-single``, then ``axon4d export-hf`` of its last checkpoint; asserts the
    checks of the module docstring."""
    from transformers import AutoModelForCausalLM

    from axon4d.data.tokens import SyntheticTokens
    from axon4d.export.from_checkpoint import export_checkpoint

    job = dict(
        hf=path,
        grid=grid,
        seq_len=SEQ,
        batch_size=4,
        micro_batches=2,
        steps=steps,
        warmup_steps=1,
        lr=1e-2,
        out_dir=str(tmp_path / "run"),
        progress=False,
        peak_tflops=1.0,
        compare_single=True,
    )
    shape = tuple(int(g) for g in grid.split(","))
    got = pools(4).run(None, train_then_load, job, shape)[0]
    assert got["max_rel_diff"] < 1e-5 and len(got["single_process_losses"]) == steps
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    first = SyntheticTokens(VOCAB, SEQ, seed=0).batch(0, 8)
    with torch.no_grad():
        assert got["losses"][0] == pytest.approx(original(input_ids=first, labels=first).loss.item(), rel=1e-6)
    ckpt = str(tmp_path / "run" / "checkpoints" / f"step_{steps}")
    export_checkpoint(ckpt, str(tmp_path / "exported"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32).eval()
    trained = got["trained"]
    state = exported.state_dict()
    assert set(state) == set(trained)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    # the exported model computes what the trained one does
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(trained)
    with torch.no_grad():
        assert rel_err(exported(input_ids=first).logits, model(input_ids=first).logits) <= TOL
    return RoundTrip(original, exported, trained)
