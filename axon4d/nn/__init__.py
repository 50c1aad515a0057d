"""Parallel modules built on the 4D grid."""

from axon4d.nn.linear import Linear

__all__ = ["Linear"]
