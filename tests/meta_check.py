"""Builds reference models on the meta device, each as one rank of a large fake grid (tests/test_models.py).

Usage: python meta_check.py SIZE ARCH x,y,z,data RANK [SIZE ARCH x,y,z,data RANK ...] — prints
``PARAMS SIZE ARCH x,y,z,data <per-rank parameter count>`` for each.
"""

import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import axon4d
from axon4d.models import get_config
from axon4d.models.transformer import Transformer

args = sys.argv[1:]
for i in range(0, len(args), 4):
    size, arch, grid_arg, rank = args[i], args[i + 1], args[i + 2], int(args[i + 3])
    grid = tuple(int(s) for s in grid_arg.split(","))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=grid[0] * grid[1] * grid[2] * grid[3])
    axon4d.init(grid=grid)
    model = Transformer(get_config(size, arch=arch), device="meta")
    assert all(p.is_meta for p in model.parameters())
    print("PARAMS", size, arch, grid_arg, sum(p.numel() for p in model.parameters()))
    del model
    axon4d.shutdown()
    dist.destroy_process_group()
