"""axon4d: transformer training with 4D hybrid parallelism (a 3D-parallel matmul plus data parallelism).

Start with ``axon4d.init(grid=(x, y, z, data))``, replace ``torch.nn.Linear`` with
``axon4d.Linear``, and move tensors in and out of the grid's layouts with ``shard_input`` /
``gather_output``. docs/design.md explains the algorithm; docs/ the user guide.
"""

from axon4d import device as _device

_device.use_huge_pages()  # before any tensor exists (axon4d.device)

from axon4d import overlap, stepstats, trace  # noqa: E402
from axon4d.grid import Grid  # noqa: E402
from axon4d.layout import gather_batch, gather_features, gather_output, shard_batch, shard_features, shard_input  # noqa: E402
from axon4d.nn import Linear  # noqa: E402
from axon4d.parallelize import auto_parallelize, to_dense  # noqa: E402
from axon4d.runtime import get_grid, init, shutdown  # noqa: E402
from axon4d.shape import GridShape, factorizations  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Grid",
    "GridShape",
    "Linear",
    "auto_parallelize",
    "factorizations",
    "gather_batch",
    "gather_features",
    "gather_output",
    "get_grid",
    "init",
    "overlap",
    "shard_batch",
    "shard_features",
    "shard_input",
    "shutdown",
    "stepstats",
    "to_dense",
    "trace",
]
