"""Builds a reference model on the meta device as one rank of a large fake grid (tests/test_models.py).

Usage: python meta_check.py SIZE ARCH x,y,z,data RANK — prints the per-rank parameter count.
"""

import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

size, arch, grid_arg, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
grid = tuple(int(s) for s in grid_arg.split(","))
world = grid[0] * grid[1] * grid[2] * grid[3]
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

import axon4d  # noqa: E402
from axon4d.models import get_config  # noqa: E402
from axon4d.models.transformer import Transformer  # noqa: E402

axon4d.init(grid=grid)
model = Transformer(get_config(size, arch=arch), device="meta")
assert all(p.is_meta for p in model.parameters())
print("PARAMS", sum(p.numel() for p in model.parameters()))
