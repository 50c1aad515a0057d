"""axon4d: transformer training with 4D hybrid parallelism (a 3D-parallel matmul plus data parallelism).

Start with ``axon4d.init(grid=(x, y, z, data))``, replace ``torch.nn.Linear`` with
``axon4d.Linear``, and move tensors in and out of the grid's layouts with ``shard_input`` /
``gather_output``. ``shard_optimizer`` shards an optimizer's state over the data axis (ZeRO-1/2).
``try_plans`` builds the planner's best few plans for your model in turn, times a few steps of each
and returns the fastest measured (docs/planner.md#trying-the-top-plans).
docs/design.md explains the algorithm; docs/ the user guide.

Importing axon4d changes no environment variable and reads no file; host memory in huge pages is
an explicit call (``axon4d.device.environment.use_huge_pages``), which the training job's entry makes.
"""

from axon4d import overlap, stepstats, trace
from axon4d.activations import gather_batch, gather_features, gather_output, shard_batch, shard_features, shard_input
from axon4d.grid.mesh import Grid
from axon4d.grid.runtime import get_grid, init, shutdown
from axon4d.grid.shape import GridShape, factorizations
from axon4d.nn import Linear
from axon4d.parallelize import auto_parallelize, to_dense
from axon4d.trials import Trial, Tried, try_plans
from axon4d.zero import ShardedOptimizer, shard_optimizer

__version__ = "0.1.0"

__all__ = [
    "Grid",
    "GridShape",
    "Linear",
    "ShardedOptimizer",
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
    "shard_optimizer",
    "shutdown",
    "stepstats",
    "to_dense",
    "trace",
    "Trial",
    "Tried",
    "try_plans",
]
