"""Protects the reference models' size table and meta-device construction: any size in the table
builds as one rank of a 512–1024-rank grid in one process (torch's fake process group) without
allocating, holding exactly the per-rank share the 4D layout prescribes."""

import math
import os
import subprocess
import sys

import pytest

from axon4d.config import SIZES, ModelConfig, get_config

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize(
    "name,billions", [("5B", 5), ("10B", 10), ("20B", 20), ("40B", 40), ("80B", 80), ("320B", 320), ("640B", 640)]
)
def test_size_table_matches_its_names(name, billions):
    assert abs(SIZES[name].n_params() / 1e9 - billions) / billions < 0.07  # the names are rounded (10B is 10.6B)


def expected_per_rank(cfg: ModelConfig, gx: int, gy: int, gz: int) -> int:
    """Parameters one rank holds: Linear weights split over x, y and z; the rest as the layout says."""
    total = 0
    for _, fan_in, fan_out, transpose, bias in cfg.linear_shapes():
        total += math.ceil(fan_in * fan_out / (gx * gy) / gz)
        total += fan_out // (gx if transpose else gy) if bias else 0
    norms = 2 * (cfg.hidden // gx) * (2 if cfg.arch == "gpt" else 1)
    total = cfg.n_layers * (total + norms)
    total += cfg.vocab_size * cfg.hidden // (gx * gy)  # embedding: vocab over y, hidden over x
    total += cfg.seq_len * cfg.hidden // gx if cfg.arch == "gpt" else 0
    total += (cfg.hidden // gx) * (2 if cfg.arch == "gpt" else 1)  # final norm
    total += math.ceil(cfg.vocab_size * cfg.hidden / (gx * gy) / gz)  # LM head
    return total


LARGE = [
    ("20B", "gpt", (8, 8, 16, 1)),
    ("20B", "llama", (4, 8, 8, 2)),
    ("80B", "gpt", (8, 8, 8, 2)),
    ("80B", "llama", (8, 4, 16, 2)),
]


@pytest.fixture(scope="module")
def built_on_meta() -> dict[tuple[str, str, str], int]:
    """Each of LARGE built as rank 7 of its fake grid, all in one fresh process: (size, arch, grid) ->
    its parameter count."""
    args = [a for size, arch, grid in LARGE for a in (size, arch, ",".join(map(str, grid)), "7")]
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "meta_check.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("PARAMS")]
    return {(size, arch, grid): int(n) for _, size, arch, grid, n in lines}


@pytest.mark.slow
@pytest.mark.parametrize("size,arch,grid", LARGE)
def test_large_models_build_on_meta_as_one_rank_of_a_fake_grid(built_on_meta, size, arch, grid):
    got = built_on_meta[(size, arch, ",".join(map(str, grid)))]
    assert got == expected_per_rank(get_config(size, arch=arch), *grid[:3])
