"""A tiny job started by tests/test_launch.py under torchrun, mpiexec, srun (its environment) or plain python.

It joins the world through ``axon4d.init`` alone and, for each grid of ``argv[1]`` (x,y,z,d;...),
one after another in the same job (``shutdown()`` between them), runs one 3D Linear forward +
backward against torch.nn.Linear and prints one line per rank: the launcher, the grid and the
worst error.
"""

import os
import sys

import torch

import axon4d

for spec in sys.argv[1].split(";"):
    grid = axon4d.init(grid=tuple(int(v) for v in spec.split(",")), seed=3)
    dense = torch.nn.Linear(8, 12)
    x_full = torch.randn(4, 2, 8)
    layer = axon4d.Linear.from_dense(dense)
    x = axon4d.shard_input(x_full)
    y = layer(x)
    y.sum().backward()
    err = (axon4d.gather_output(y) - dense(x_full)).abs().max().item()
    line = f"LAUNCH {grid.launcher} world={grid.world_size} {grid} err={err:.1e}\n"
    os.write(1, line.encode())  # one write per line: ranks share stdout and must not interleave
    axon4d.shutdown()
