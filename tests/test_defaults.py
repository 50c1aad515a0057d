"""Protects the defaults a GPU user gets (docs/training.md, "The defaults a GPU user gets"):
--precision auto (bf16-fp32-reduce on an accelerator, fp32 on the host), TF32 for fp32 matmuls on
an accelerator only, the allocator's expandable segments unless the user configured it, AdamW
fused on an accelerator and foreach on the host, a gradient norm and clipping that never read the
device on the host (one host read per training step, with the loss), and seeded initialisation
drawn where the tensor lives in that device's tiles, with the host's values unchanged.

There is no accelerator here: the choices are tested as functions of a device argument (no CUDA
tensor is made), the host's behaviour end to end."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from test_nonfinite import _cfg  # its small run, here on two ranks

from axon4d import checkpoint, grads
from axon4d import device as devices
from axon4d.config import ModelConfig
from axon4d.device import environment
from axon4d.layout import tiled_init
from axon4d.materialize import init_dense_
from axon4d.models.transformer import DenseTransformer
from axon4d.options import precision
from axon4d.reliability import watchdog
from axon4d.train import TrainConfig, loop, outdir, train
from axon4d.train.loop import STEP_READ
from axon4d.train.optim import make_optimizer, optimizer_kernel

GPU = torch.device("cuda", 0)  # a device argument only: nothing is allocated on it


def test_auto_precision_is_bf16_with_fp32_reductions_on_an_accelerator_and_fp32_on_the_host():
    assert precision.resolve("auto", accelerator=True) == "bf16-fp32-reduce"
    assert precision.resolve("auto", accelerator=False) == "fp32"
    for name in precision.NAMED:  # an explicit name is kept on either
        assert precision.resolve(name, accelerator=True) == name == precision.resolve(name, accelerator=False)
    with pytest.raises(
        ValueError,
        match="precision 'fp16' is not supported; use one of fp32, bf16, bf16-fp32-reduce, bf16-fp8-gather, bf16-fp8, auto",
    ):
        precision.resolve("fp16", accelerator=True)
    assert TrainConfig().precision == "auto"
    with pytest.raises(ValueError, match="use one of fp32, .*, auto"):
        TrainConfig(precision="half")


def test_expandable_segments_are_asked_for_on_accelerators_unless_the_user_configured_the_allocator():
    want = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert environment.expandable_segments_env({}, accelerator=True) == want
    assert environment.expandable_segments_env({"PATH": "/bin"}, accelerator=True) == want
    assert environment.expandable_segments_env({}, accelerator=False) == {}  # the host: nothing
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        for value in ("max_split_size_mb:128", "expandable_segments:False", ""):
            assert environment.expandable_segments_env({var: value}, accelerator=True) == {}, (var, value)


def test_a_host_job_sets_no_allocator_variable(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(devices, "accelerator_available", lambda: False)
    assert environment.use_expandable_segments() == {} and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setattr(devices, "accelerator_available", lambda: True)  # as on a GPU node, before CUDA starts
    assert environment.use_expandable_segments() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert environment.use_expandable_segments() == {}
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"  # the user's, untouched


# TF32 is a process-wide setting (and torch refuses to read it back once its two APIs are mixed),
# so it is exercised in a fresh interpreter, not in the test process.
_TF32_SCRIPT = """
import torch
from axon4d import device as devices
from axon4d.train import peak
gpu, host = torch.device("cuda", 0), devices.HOST
assert devices.allow_tf32(host) is False and torch.get_float32_matmul_precision() == "highest"
assert devices.fp32_matmul_uses_tf32(host) is False
assert devices.allow_tf32(gpu) is True and torch.get_float32_matmul_precision() == "high"
assert devices.fp32_matmul_uses_tf32(gpu) and devices.fp32_matmul_uses_tf32(host) is False
# axon4d.train.peak counts fp32 at TF32's peak exactly when TF32 is on
assert peak.known_peak("NVIDIA H100 80GB HBM3", torch.float32, devices.fp32_matmul_uses_tf32(gpu))[0] == 494.7
torch.set_float32_matmul_precision("medium")  # the process chose: kept
assert devices.allow_tf32(gpu) is True and torch.get_float32_matmul_precision() == "medium"
assert devices.allow_tf32(gpu, allow=False) is False and torch.get_float32_matmul_precision() == "highest"
assert devices.allow_tf32(gpu) is True and devices.allow_tf32(gpu, allow=False) is False  # --no-tf32
assert devices.allow_tf32(host, allow=False) is False and devices.allow_tf32(host) is False
if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch 2.9+: per-backend flags the setting cannot express
    torch.backends.cudnn.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert devices.allow_tf32(gpu, allow=False) is True and torch.backends.cuda.matmul.fp32_precision == "tf32"
print("ok")
"""


@pytest.mark.slow
def test_tf32_is_allowed_on_accelerators_only_and_a_users_choice_is_kept():
    out = subprocess.run([sys.executable, "-c", _TF32_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_adamw_is_fused_on_accelerators_and_foreach_on_the_host():
    assert devices.adamw_kernel(GPU) == "fused" and devices.adamw_kernel(torch.device("cuda")) == "fused"
    assert devices.adamw_kernel(devices.HOST) == "foreach" and devices.adamw_kernel(torch.device("meta")) == "foreach"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = make_optimizer(model, TrainConfig())
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"] and optimizer_kernel(opt) == "foreach"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


class _OneRank:
    """A grid of one rank: every size 1, an all-reduce that returns its input."""

    device = devices.HOST

    def size(self, axis: str) -> int:
        return 1

    comm = types.SimpleNamespace(all_reduce=lambda t, axis, tag=None: types.SimpleNamespace(wait=lambda: t))


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4), torch.nn.LayerNorm(4))
    model(torch.randn(5, 8)).square().sum().backward()
    return model


@contextlib.contextmanager
def _no_host_reads() -> Iterator[None]:
    """Within it, any read of a tensor's value on the host fails the test."""

    def read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor was read on the host")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__bool__"):
            patch.setattr(torch.Tensor, name, read)
        yield


def _clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    with _no_host_reads():
        return grads.clip_grad_norm_(model, max_norm, _OneRank())


def test_clipping_matches_torch_and_never_reads_the_device():
    ours, ref = _model_with_grads(), _model_with_grads()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm = _clip(ours, 0.5)
    assert norm.shape == () and norm.dtype == torch.float32
    assert torch.allclose(norm, ref_norm, rtol=1e-6, atol=0)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9)


def test_a_norm_within_the_bound_changes_no_bit_and_a_non_finite_one_leaves_the_gradients():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    _clip(model, 1e9)  # the scale is exactly 1
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    for bad in (float("nan"), float("inf")):
        model = _model_with_grads()
        next(model.parameters()).grad[0, 0] = bad
        before = [p.grad.clone() for p in model.parameters()]
        norm = _clip(model, 0.5)
        assert not torch.isfinite(norm)
        assert all(_same(p.grad, b) for p, b in zip(model.parameters(), before))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_the_norm_counts_each_element_once_by_its_replication_in_fp32():
    """A bf16 gradient is summed in fp32; a replicated parameter's squares are divided by its
    copies (here faked: one axis of size 4 replicates every parameter of a plain module)."""
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 16), "b": torch.nn.Linear(16, 4).to(torch.bfloat16)})
    model["a"](torch.randn(5, 8)).square().sum().backward()
    model["b"](torch.randn(5, 16, dtype=torch.bfloat16)).square().sum().backward()
    ref = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
    grid = _OneRank()
    assert torch.allclose(grads.grad_norm(model, grid).double(), ref, rtol=1e-6)
    four = types.SimpleNamespace(size=lambda axis: 4 if axis == "x" else 1, comm=grid.comm)
    assert torch.allclose(grads.grad_norm(model, four).double(), ref / 2, rtol=1e-6)  # sqrt(sum / 4)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def test_host_initialisation_keeps_its_values():
    """The host draws exactly what it drew before initialisation moved to the device (the hashes
    were taken from the release before): checkpoints and seeded runs stay valid."""
    out = torch.empty(300, 700)
    tiled_init.fill_(out, tiled_init.Init.uniform(0.5), 7, "w", (1000, 1400), 100, 650)
    assert _sha(out) == "a69d357cf81335da"
    out = torch.empty(37, 50, dtype=torch.bfloat16)
    tiled_init.fill_(out, tiled_init.Init.normal(1.0), 3, "e", (64, 50), 20, 0)
    assert _sha(out) == "b5d71b1f7e5783f9"
    cfg = ModelConfig(
        n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
    )
    dense = init_dense_(DenseTransformer(cfg, device="meta").to_empty(device=devices.HOST), 5)
    assert _sha(torch.cat([p.detach().reshape(-1) for p in dense.parameters()])) == "73516928e1f43336"


def test_tiles_are_drawn_where_the_tensor_lives_in_that_devices_tiling():
    assert tiled_init.tiling_for(devices.HOST) == tiled_init.TILING == tiled_init.Tiling(16384, 512)
    assert tiled_init.tiling_for(torch.device("meta")) == tiled_init.TILING
    big = tiled_init.tiling_for(GPU)
    assert big == tiled_init.Tiling(devices.init_tile_bytes(GPU) // 4, 2048) and big.elements == 4 << 20
    assert big.tile_shape((12288, 12288)) == (2048, 2048) and big.tile_shape((100, 50)) == (83886, 50)
    assert devices.draw_device(GPU) == GPU and devices.draw_device(torch.device("cuda", 3)).index == 3
    assert devices.draw_device(devices.HOST) == devices.HOST == devices.draw_device(torch.device("meta"))


def test_fill_draws_with_a_generator_on_the_tensors_device(monkeypatch):
    """The device is taken from the tensor filled: its generator and its tiling (a fake budget of
    1 KiB of host tiles changes the values, the explicit TILING does not)."""
    made: list[torch.device] = []
    real = torch.Generator

    def generator(device: str | torch.device = "cpu") -> torch.Generator:
        made.append(torch.device(device))
        return real(device=device)

    out = torch.empty(40, 30)
    ref = tiled_init.fill_(out.clone(), tiled_init.Init.normal(1.0), 1, "t", (40, 30), 0, 0)
    monkeypatch.setattr(tiled_init.torch, "Generator", generator)
    tiled_init.fill_(out, tiled_init.Init.normal(1.0), 1, "t", (40, 30), 0, 0)
    assert torch.equal(out, ref) and made and set(made) == {devices.HOST}
    monkeypatch.setattr(devices, "init_tile_bytes", lambda device: 1 << 10)  # 256 elements a tile
    assert not torch.equal(tiled_init.fill_(out.clone(), tiled_init.Init.normal(1.0), 1, "t", (40, 30), 0, 0), ref)
    explicit = tiled_init.fill_(out.clone(), tiled_init.Init.normal(1.0), 1, "t", (40, 30), 0, 0, tiled_init.TILING)
    assert torch.equal(explicit, ref)


def _count_waits(cfg_dict: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """Train; return the summary and the labels of the marked waits of the steps."""
    labels: list[str] = []
    real, real_step = watchdog.waiting, watchdog.step_waiting

    def waiting(what: str, deadline_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        labels.append(what)
        return real(what, deadline_s)

    def step_waiting(what: str) -> contextlib.AbstractContextManager[None]:  # a step's host reads
        labels.append(what)
        return real_step(what)

    watchdog.waiting, watchdog.step_waiting = waiting, step_waiting  # type: ignore[assignment]
    try:
        summary = train(TrainConfig(**cfg_dict))  # type: ignore[arg-type]
    finally:
        watchdog.waiting, watchdog.step_waiting = real, real_step  # type: ignore[assignment]
    return summary, labels


@pytest.mark.slow
def test_a_host_training_step_reads_the_device_once_and_the_run_records_its_defaults(pools, tmp_path, monkeypatch):
    """Each step reads its loss and gradient norm in one marked host read (STEP_READ); --precision
    auto on the host trains in fp32 with AdamW foreach, and summary.json and the checkpoint say so;
    resumed with auto on a GPU node, the run keeps its checkpoint's fp32."""
    cfg = _cfg(tmp_path, grid="1,1,1,2", steps=3, batch_size=4)
    for summary, labels in pools(2).run(None, _count_waits, cfg):
        assert labels.count(STEP_READ) == 3
        assert not [w for w in labels if ("loss" in w or "gradient norm" in w) and w != STEP_READ], labels
        assert (summary["precision"], summary["tf32"], summary["optimizer"]) == ("fp32", False, "foreach")
    meta = checkpoint.read_meta(str(tmp_path / "checkpoints" / "step_3"))
    assert meta["train_config"]["precision"] == "fp32"  # the resolved name: a resume compares it
    monkeypatch.setattr(devices, "accelerator_available", lambda: True)
    assert loop._resolve_precision(TrainConfig(**{**cfg, "resume": "always"})) == "fp32"
    assert loop._resolve_precision(TrainConfig(**{**cfg, "resume": "always", "precision": "bf16"})) == "bf16"
    assert loop._resolve_precision(TrainConfig(**{**cfg, "overwrite": True})) == "bf16-fp32-reduce"
    assert "tf32" in outdir.RESUMABLE_CHANGES  # --no-tf32 may be given to a resumed run


def test_calibration_times_the_adamw_the_job_runs(monkeypatch):
    """``axon4d calibrate``'s optimizer rate is a step of the AdamW ``make_optimizer`` builds on the
    device (``adamw_kernel``: foreach on the host), not another implementation's."""
    from axon4d.measure import kernels

    made = []

    class Recorded(torch.optim.AdamW):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            made.append(self)

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    timer = types.SimpleNamespace(device=devices.HOST, measure=lambda fn, **kw: (fn(), 1.0)[1])
    kernels.elementwise(timer, torch.float32)
    assert len(made) == 1 and optimizer_kernel(made[0]) == devices.adamw_kernel(devices.HOST) == "foreach"
