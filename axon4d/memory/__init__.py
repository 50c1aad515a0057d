"""Where a step's bytes live beyond the device's own tensors (docs/design.md §5).

    host_pool      page-locked host buffers carved from few allocations, taken and given back
    host_snapshot  host copies of many tensors in one page-locked allocation (async checkpoints)
    offload        activation offload: which blocks, the saved-tensor hooks, the side stream
    peakmem        the peak bytes of torch tensors over one training step, the largest over ranks

This package's ``__init__`` imports nothing: each module sits in its own layer of the contract in
``setup.cfg``; import them by their full names.
"""
