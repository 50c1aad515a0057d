"""The training job on the GPU (``axon4d.train`` on the default device, NCCL): a tiny Llama trains,
saves and resumes bit for bit, and its checkpoints do not depend on the device that wrote them —
a GPU checkpoint exports the same weights on the host, and a host checkpoint resumes on the GPU on
the host's loss curve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from gpu_env import GRID_SPEC, WORLD

from axon4d import checkpoint
from axon4d import device as devices
from axon4d.train import TrainConfig, train

pytestmark = pytest.mark.gpu


def _cfg(out_dir, **kw) -> TrainConfig:
    base = dict(
        grid=GRID_SPEC,
        model="tiny",
        arch="llama",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        vocab_size=256,
        seq_len=32,
        batch_size=8,
        steps=3,
        warmup_steps=1,
        out_dir=str(out_dir),
        progress=False,
        peak_tflops=1.0,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_train_saves_and_resumes_bit_for_bit(shared_dir, deterministic):
    straight = train(_cfg(shared_dir / "a", save_every=2))
    assert straight["device"] == str(devices.default_device(int(os.environ.get("LOCAL_RANK", "0"))))
    assert all(torch.isfinite(torch.tensor(straight["losses"])))
    again = train(_cfg(shared_dir / "b"))
    assert again["losses"] == straight["losses"]  # the same seed gives the same run
    # interrupted after step 2: keep the step-2 checkpoint only, resume, run step 3 again
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(shared_dir / "a" / "checkpoints" / "step_3")
    if dist.is_initialized():
        dist.barrier()  # no rank looks for the newest checkpoint before it is gone
    resumed = train(_cfg(shared_dir / "a", save_every=2, resume="always"))
    assert resumed["losses"] == straight["losses"][2:]


def _host_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh process that sees no GPU (the host device, gloo)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(WORLD != 1, reason="the host side runs as one process: a world of one")
def test_checkpoints_move_between_gpu_and_host(tmp_path):
    # GPU → host: a checkpoint written on the GPU exports (loads) on the host to the same weights
    gpu_run = train(_cfg(tmp_path / "gpu", steps=2))
    gpu_file = checkpoint.export_dense(gpu_run["checkpoint"], str(tmp_path / "gpu.pt"))
    on_gpu = torch.load(gpu_file, weights_only=True)  # no map_location: the file holds host tensors
    assert all(devices.is_host(v.device) for v in on_gpu.values())
    run = _host_python(
        """
        import sys
        from axon4d import checkpoint
        checkpoint.export_dense(sys.argv[1], sys.argv[2])
        """,
        gpu_run["checkpoint"],
        str(tmp_path / "host.pt"),
    )
    assert run.returncode == 0, run.stderr
    on_host = torch.load(tmp_path / "host.pt", weights_only=True)
    assert on_host.keys() == on_gpu.keys()
    for k in on_gpu:
        assert torch.equal(on_host[k], on_gpu[k]), k

    # host → GPU: a run on the host saves at step 2 and goes on to step 3; resumed on the GPU from
    # its step-2 checkpoint, step 3 lands on the host's loss (up to the devices' rounding)
    host_dir = tmp_path / "host"
    cfg = json.dumps(vars(_cfg(host_dir, grid="1,1,1,1", save_every=2)))
    run = _host_python(
        """
        import json, sys
        from axon4d.train import TrainConfig, train
        summary = train(TrainConfig(**json.loads(sys.argv[1])))
        print(json.dumps({"losses": summary["losses"], "device": summary["device"]}))
        """,
        cfg,
    )
    assert run.returncode == 0, run.stderr
    host = json.loads(run.stdout.strip().splitlines()[-1])
    assert devices.is_host(torch.device(host["device"]))
    shutil.rmtree(host_dir / "checkpoints" / "step_3")
    # fp32 as on the host (TF32 off): the comparison is of the devices' rounding, not of TF32's
    resumed = train(_cfg(host_dir, grid="1,1,1,1", save_every=2, resume="always", tf32=False))
    if torch.cuda.is_available():
        assert resumed["device"] != host["device"]
    assert resumed["losses"] == pytest.approx(host["losses"][2:], rel=1e-4)
