"""Parallel modules built on the 4D grid (docs/design.md §2)."""

from axon4d.nn.linear import Linear

__all__ = ["Linear"]
