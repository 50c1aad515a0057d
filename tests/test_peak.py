"""Protects MFU's denominator (axon4d.train.peak): on an accelerator it knows, a rank's peak is the
published dense figure for the compute dtype (TF32's for fp32 when torch may use TF32), never a small
launch-bound matmul that would make MFU read above 100%; an unknown accelerator is measured with a
matmul large enough to reach its peak; ``--peak-tflops`` overrides both; the host is measured."""

import types

import pytest
import torch

from axon4d import device as devices
from axon4d.train import peak


@pytest.mark.parametrize(
    "name,dtype,tf32,expected",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.0),
        ("NVIDIA H100 NVL", torch.float32, False, 60.0),
        ("NVIDIA H200", torch.bfloat16, False, 989.4),
        ("NVIDIA GH200 480GB", torch.bfloat16, False, 989.4),
        ("NVIDIA A100-SXM4-40GB", torch.float32, True, 156.0),
        ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
        ("AMD Instinct MI250X", torch.bfloat16, False, 191.5),
        ("AMD Instinct MI300X", torch.bfloat16, False, 1307.4),
    ],
)
def test_known_accelerators_take_their_published_dense_peak(name, dtype, tf32, expected):
    tflops, source = peak.known_peak(name, dtype, tf32)
    assert tflops == expected and "datasheet" in source


def test_an_unknown_accelerator_is_not_in_the_table():
    assert peak.known_peak("Some Future GPU", torch.bfloat16, False) is None


@pytest.fixture
def on_accelerator(monkeypatch):
    """A grid-like object on an accelerator called ``name``; matmul timings recorded, not run."""
    measured = []

    def make(name):
        monkeypatch.setattr(devices, "device_name", lambda device: name)
        monkeypatch.setattr(peak, "measure_peak_tflops", lambda grid, dtype, n: measured.append(n) or 123.0)
        return types.SimpleNamespace(device=torch.device("cuda", 0))

    return make, measured


def test_an_accelerator_s_peak_comes_from_the_table_or_a_large_matmul(on_accelerator):
    make, measured = on_accelerator
    tflops, source = peak.rank_peak_tflops(make("NVIDIA H100 80GB HBM3"), torch.bfloat16)
    assert (tflops, measured) == (989.4, []) and source.startswith("H100 bfloat16")
    tflops, source = peak.rank_peak_tflops(make("Some Future GPU"), torch.bfloat16)
    assert tflops == 123.0 and measured == [peak.ACCELERATOR_PROBE_N] and source.startswith("measured (8192x8192")
    assert peak.rank_peak_tflops(make("NVIDIA A100-SXM4-80GB"), torch.bfloat16, given=200.0) == (200.0, "--peak-tflops")


def test_fp32_counts_tf32_s_peak_only_when_torch_may_use_it(on_accelerator):
    make, _ = on_accelerator
    grid = make("NVIDIA A100-SXM4-80GB")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak.rank_peak_tflops(grid, torch.float32)[0] == 19.5
        torch.set_float32_matmul_precision("high")
        assert peak.rank_peak_tflops(grid, torch.float32)[0] == 156.0
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_host_is_measured_with_a_small_matmul(monkeypatch):
    sizes = []
    monkeypatch.setattr(peak, "measure_peak_tflops", lambda grid, dtype, n: sizes.append(n) or 0.5)
    host = types.SimpleNamespace(device=devices.HOST)
    assert peak.rank_peak_tflops(host, torch.float32) == (0.5, "measured (512x512 matmul)")
    assert sizes == [peak.HOST_PROBE_N]
