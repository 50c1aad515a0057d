"""How tensors lie on the grid: a layer's shapes and collectives, a rank's piece of a global tensor,
drawing that piece alone, and every parameter's layout.

    geometry      layer shapes, z shards, the collectives of a layer (E8–E13), their wire dtypes
    rectangles    where a rank's piece lies in a global tensor, as rectangles; fused rows
    tiled_init    a rank's piece initialised tile by tile from a seed; swapping parameters in
    param_layout  how each parameter of a model lies on the grid (``ParamLayout``)

This package's ``__init__`` imports nothing: geometry, rectangles and tiled_init are plain data,
param_layout reads the built modules; import them by their full names.
"""
