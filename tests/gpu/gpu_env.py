"""What the GPU suite runs on, from the environment (see conftest.py): the grid every test builds,
and whether to run on the host for want of a GPU."""

from __future__ import annotations

import os

#: run the suite on the host (AXON4D_GPU_TESTS_ON_HOST=1): checks the tests, not a GPU.
ON_HOST = os.environ.get("AXON4D_GPU_TESTS_ON_HOST", "0") == "1"
#: the grid, "x,y,z,data" (AXON4D_TEST_GRID; a world of one by default).
GRID_SPEC = os.environ.get("AXON4D_TEST_GRID", "1,1,1,1")
GRID = tuple(int(v) for v in GRID_SPEC.split(","))
WORLD = GRID[0] * GRID[1] * GRID[2] * GRID[3]
