"""The 4D grid and starting up (docs/design.md §1): from the launcher's environment to a grid of
process groups.

    launch_env  the launchers' rank, world-size and local-rank variables
    launch      rank and world size from torchrun, MPI, SLURM or a lone process; ports
    counts      the one check of a whole-number field and of attention's head counts
    shape       ``GridShape``, axis names (``Axis``), rank coordinates (E1), factorisations
    rules       the divisibility rules a grid must satisfy, checked by layers, evaluated by the planner
    mesh        ``Grid``: DeviceMesh groups per axis, coordinates, its communicator and scheduler
    runtime     ``init()``, ``get_grid()``, ``shutdown()``

This package's ``__init__`` imports nothing: its modules span the layers of ``setup.cfg``'s
contract, from plain data (launch_env … rules) to the grid (mesh) and the runtime above the
planner; import them by their full names (``axon4d.init`` and ``axon4d.Grid`` are the public ones).
"""
