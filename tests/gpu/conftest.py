"""The GPU suite: tests marked ``gpu``, skipped where torch sees no CUDA device.

    pytest tests/gpu                    # one GPU: every test on a world of one, grid (1, 1, 1, 1)
    AXON4D_TEST_GRID=2,1,1,1 AXON4D_TEST_DIR=/shared/tmp torchrun --nproc-per-node 2 -m pytest tests/gpu -q
                                        # several GPUs of a node: every rank runs the suite on that grid
    AXON4D_GPU_TESTS_ON_HOST=1 pytest tests/gpu     # the same tests on the host (checks the tests themselves)

On a machine without CUDA, ``make test`` collects these tests and reports them as skipped. Every
test builds its grid with ``axon4d.init``, so the device (``grid.device``: ``cuda:<local rank>``)
and the backend (NCCL) are the library's defaults, as in a real job.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gpu_env import GRID, ON_HOST

import axon4d

# cuBLAS is deterministic with a fixed workspace (set before the first handle): the resume test
# compares losses bit for bit
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this directory ``gpu``; skip them all when there is no CUDA device."""
    skip = pytest.mark.skip(reason="GPU test: torch.cuda.is_available() is False on this machine")
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not (torch.cuda.is_available() or ON_HOST):
            item.add_marker(skip)


@pytest.fixture
def grid():
    """The grid of ``AXON4D_TEST_GRID`` (a world of one by default) on the default device."""
    g = axon4d.init(grid=GRID, seed=0)
    try:
        yield g
    finally:
        axon4d.shutdown()


@pytest.fixture
def deterministic():
    """Deterministic kernels for the test (flash-attention backward, scatter-adds), then as before."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def shared_dir(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A directory every rank sees: ``tmp_path`` in a world of one; under torchrun a fresh
    ``$AXON4D_TEST_DIR/<test>`` (default build/gpu-tests), emptied by rank 0 before any rank uses it."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return tmp_path
    path = Path(os.environ.get("AXON4D_TEST_DIR", "build/gpu-tests")) / request.node.name
    axon4d.init(grid=GRID)  # the job's default process group exists from here on
    axon4d.shutdown()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path
