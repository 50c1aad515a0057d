"""What a run asks of each step, as plain data (no process group): numeric precision and the FP8
GEMMs it implies, the overlap policy, activation recomputation.

    precision       dtypes of master weights, compute and gradient reductions (``resolve``)
    fp8_gemm        the 3D Linear's FP8 GEMMs (§2): tensorwise quantisation, scaled GEMMs, reference
    overlap_policy  the overlap policy (§4): ``OverlapPolicy``, ``MECHANISMS``, ``AUTO``
    recompute_mode  the recomputation modes (§5): ``Recompute``, ``check_recompute``

This package's ``__init__`` imports nothing; import the modules by their full names.
"""
