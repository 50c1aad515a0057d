"""The communication layer (docs/design.md §9, L1–L2): the only modules that call collectives.

    communicator   ``Communicator``: every collective, asynchronous, on an axis of the grid;
                   the host (gloo) groups checkpoints coordinate on (``host_group``)
    handle         an issued collective: its timed, watched wait (``Handle``), a transport's ``Work``
    log            the communication log: records, communication and blocked time, hidden time (§4)
    transport      torch.distributed or MPI: named, or probed under mpirun
    mpi            the MPI transport (mpi4py's non-blocking collectives on per-axis communicators)
    gloo_exchange  reduce-scatter on gloo as one exchange of chunks
    host_mesh      what a gloo group of every rank needs from its host: sockets, the interface

This package's ``__init__`` imports nothing: each module sits in its own layer of the contract in
``setup.cfg``; import them by their full names.
"""
