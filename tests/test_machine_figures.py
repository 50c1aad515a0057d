"""No silent zeros in a machine file (axon4d.plan.device_memory): an accelerator's file missing a
figure the fit test needs, or giving one without a source, is refused naming the field and how to
get it; a host's needs only its memory; ``axon4d calibrate`` records the figures with their sources
(axon4d.measure.memory_figures), so a calibrated file loads."""

from __future__ import annotations

import json
import os

import pytest

from axon4d.measure import calibrate, memory_figures
from axon4d.plan.device_memory import FIT_FIELDS
from axon4d.plan.machine import Machine, available, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_file(**changes) -> dict:
    d = load("h100").to_json()
    d.update(changes)
    return d


def test_every_shipped_file_gives_each_figure_with_a_source():
    for name in available():
        m = load(name)
        assert m.accelerator and all(getattr(m, f) >= 0 for f in FIT_FIELDS)


@pytest.mark.parametrize("field", list(FIT_FIELDS))
def test_an_accelerator_file_without_a_figure_is_refused_naming_it(field):
    d = _gpu_file()
    del d[field]
    with pytest.raises(ValueError, match=rf"gives no {field}\b.*axon4d calibrate --out FILE"):
        Machine.from_json(d)


def test_a_figure_without_a_source_is_refused():
    d = _gpu_file()
    d["sources"] = {k: v for k, v in d["sources"].items() if "nccl_buffer_bytes" not in k}
    with pytest.raises(ValueError, match=r"gives nccl_buffer_bytes = \S+ without a source .*axon4d calibrate"):
        Machine.from_json(d)


def test_a_host_file_needs_only_its_memory():
    host = json.load(open(os.path.join(ROOT, "bench", "results", "planner_machine_local.json")))
    assert Machine.from_json(host).usable_device_memory(4) == host["memory_per_device"]
    del host["memory_per_device"]
    with pytest.raises(ValueError, match="gives no memory_per_device .*axon4d calibrate"):
        Machine.from_json(host)


def _kernels_only(grid):
    return calibrate.measure_world(grid, ["float32"], reps=1, log=lambda s: None, parts=["kernels"])


def test_a_host_calibration_records_every_figure_with_its_source(pools, tmp_path):
    result = pools(1).run((1, 1, 1, 1), _kernels_only)[0]
    machine = calibrate.merge(None, result, "test-host", 2**30)
    path = str(tmp_path / "host.json")
    machine.save(path)
    d = json.load(open(path))
    assert all(f in d for f in FIT_FIELDS if not f.startswith("host_"))
    assert d["cuda_context_bytes"] == d["device_workspace_bytes"] == d["nccl_buffer_bytes"] == 0
    sources = " ".join(f"{k}: {v}" for k, v in d["sources"].items())
    assert "0 by definition on a host" in sources and "fragmentation: a stated assumption" in sources
    assert "memory_per_device: given to `axon4d calibrate`" in sources
    assert load(path).usable_device_memory(1) == 2**30


def test_an_accelerator_calibration_is_accepted_with_its_figures_and_refused_without(tmp_path):
    """What ``memory_figures.accelerator`` returns (its shape, here without a device) makes a file
    that loads; NCCL's buffers are its defaults over the machine's channels, said to be assumed."""
    result = {"world": 1, "accelerator": True, "elementwise_Bps": 3e12, "activation_s": [1e-12, 2e-12]}
    result |= {"adam_s": 5e-11, "op_overhead_s": 1e-5, "host_link_Bps": 5.5e10, "step_samples": []}
    figures = {"memory_per_device": 80e9, "cuda_context_bytes": 5e8, "device_workspace_bytes": 3e7}
    figures["fragmentation"] = 0.02
    sources = {f: "measured by `axon4d calibrate` on this device" for f in figures}
    calibrated = calibrate.merge(None, {**result, "device_memory": {"figures": figures, "sources": sources}}, "g", 1)
    path = str(tmp_path / "gpu.json")
    calibrated.save(path)
    m = load(path)
    assert m.memory_per_device == 80e9 and m.cuda_context_bytes == 5e8 and m.fragmentation == 0.02
    assert m.nccl_buffer_bytes == memory_figures.nccl_buffers(m.nccl_channels)[0] == 2 * (524288 + 4915200 + 4 * 2**20)
    assert m.sources["nccl_buffer_bytes"].startswith("a stated assumption, not measured")
    calibrate.merge(None, result, "g", 1).save(path)  # an accelerator's calibration that recorded none of them
    with pytest.raises(ValueError, match="without a source"):
        load(path)
