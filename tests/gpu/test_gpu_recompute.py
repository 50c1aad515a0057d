"""Activation recomputation on the GPU (``Transformer(cfg, recompute=mode)``, axon4d.nn.recompute):
every mode gives the gradients of ``none``, and the allocator's peak over a training step falls
from mode to mode: none ≥ selective ≥ balanced ≥ full."""

from __future__ import annotations

import gc
import inspect
import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import axon4d
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.options.recompute_mode import RECOMPUTE_MODES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "recompute" not in inspect.signature(Transformer.__init__).parameters,
        reason="Transformer(cfg, recompute=mode) does not exist yet: axon4d.nn.recompute is not wired into the model",
    ),
]

SMALL = ModelConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256, seq_len=32, arch="llama")
# activations dominate: 4 blocks of (8 × 512 tokens) × 256 features, a small vocabulary
WIDE = ModelConfig(n_layers=4, hidden=256, n_heads=4, vocab_size=256, seq_len=512, arch="llama")


def _batch(cfg: ModelConfig, grid, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    rows = devices.to_device(axon4d.shard_batch(ids, grid), grid.device)
    return rows[:, :-1], rows[:, 1:]


def _model(cfg: ModelConfig, grid, mode: str, dense: DenseTransformer) -> Transformer:
    return Transformer(cfg, grid=grid, recompute=mode).load_dense_(dense)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_every_mode_gives_the_gradients_of_none(grid, deterministic, arch):
    cfg = SMALL.replace(arch=arch, n_kv_heads=None if arch == "gpt" else 2)
    torch.manual_seed(0)
    dense = DenseTransformer(cfg, device=grid.device)
    ids, targets = _batch(cfg, grid, 8)
    grads, losses = {}, {}
    for mode in RECOMPUTE_MODES:
        model = _model(cfg, grid, mode, dense)
        loss = model.loss(ids, targets)
        loss.backward()
        losses[mode] = loss.detach()
        grads[mode] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        assert all(g.device == grid.device for g in grads[mode].values())
    for mode in RECOMPUTE_MODES[1:]:
        torch.testing.assert_close(losses[mode], losses["none"], rtol=1e-6, atol=0, msg=f"loss of {mode}")
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")


def _step_peak(model: Transformer, ids: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak bytes of torch tensors on the grid's device over a forward and backward, above what
    was alive before it."""
    device = model.grid.device
    if devices.is_host(device):  # no allocator peak on the host: torch's MemTracker
        tracker = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tracker.track_external(model)
        with tracker:
            model.loss(ids, targets).backward()
        return int(tracker.get_tracker_snapshot("peak")[device]["Total"])
    devices.synchronize(device)
    devices.reset_peak_memory(device)
    before = devices.memory_allocated(device)
    model.loss(ids, targets).backward()
    devices.synchronize(device)
    peak = devices.peak_memory_allocated(device)
    assert peak is not None and before is not None
    return peak - before


def test_peak_memory_falls_from_mode_to_mode(grid):
    torch.manual_seed(0)
    dense = DenseTransformer(WIDE, device=grid.device)
    ids, targets = _batch(WIDE, grid, 8 * grid.size("batch"))
    peaks = {}
    for mode in RECOMPUTE_MODES:
        model = _model(WIDE, grid, mode, dense)
        model.loss(ids, targets).backward()  # warm-up: kernels chosen, workspaces allocated
        model.zero_grad(set_to_none=True)
        peaks[mode] = _step_peak(model, ids, targets)
        del model
        gc.collect()
    mib = {m: round(p / 2**20, 1) for m, p in peaks.items()}
    for more, less in zip(RECOMPUTE_MODES, RECOMPUTE_MODES[1:]):
        assert peaks[more] >= peaks[less], f"peak of {more} below {less}: {mib} MiB"
    assert peaks["none"] > peaks["full"], f"full recomputation saved nothing: {mib} MiB"
