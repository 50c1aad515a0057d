"""The environment variables by which launchers tell a process its rank, world size and local rank.

One home for their names: ``axon4d.grid.launch`` reads them to join the world (with each launcher's
other variables: rendezvous, SLURM steps and node lists), and ``axon4d.reliability.errors`` to name the rank in
a message (``env_rank``), before or without any process group.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class RankVars(NamedTuple):
    """One launcher's variables for this process's rank and the world size."""

    rank: str
    size: str


#: torchrun's (and ``python -m torch.distributed.run``'s), and its rank on the node
TORCHRUN = RankVars("RANK", "WORLD_SIZE")
TORCHRUN_LOCAL = "LOCAL_RANK"
#: MPI launchers': Open MPI, MPICH and Intel MPI (Hydra's PMI), PMIx, MVAPICH2; and the ranks on
#: the node of those that set one (Open MPI, Hydra, MVAPICH2)
MPI = (
    RankVars("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    RankVars("PMI_RANK", "PMI_SIZE"),
    RankVars("PMIX_RANK", "PMIX_SIZE"),
    RankVars("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
MPI_LOCAL = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
#: srun's, for the tasks of a job (an sbatch script's own process has them too: ``axon4d.grid.launch``),
#: and its rank on the node
SLURM = RankVars("SLURM_PROCID", "SLURM_NTASKS")
SLURM_LOCAL = "SLURM_LOCALID"
#: the number of ranks on this node, where a launcher says it (torchrun, Open MPI, Hydra, MVAPICH2)
LOCAL_SIZES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")
#: the number of nodes of a SLURM job
SLURM_NODES = "SLURM_NNODES"


def env_rank() -> int | None:
    """This process's rank in a job of several (torchrun, mpirun, srun: the first launcher whose
    world size is above 1 and whose rank is a whole number), else None."""
    for launcher in (TORCHRUN, *MPI, SLURM):
        try:
            if int(os.environ.get(launcher.size, "1")) > 1:
                return int(os.environ[launcher.rank])
        except (KeyError, ValueError):
            continue
    return None
