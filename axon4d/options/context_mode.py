"""Context parallelism's modes (docs/context.md) as one answer for the runtime and the planner.

Under context parallelism each sequence's tokens are split head–tail over z; attention then needs
the keys and values of earlier positions held by other z-ranks. They reach a rank in one of two
ways: "all-gather" (``axon4d.nn.context``: every rank's gathered at once, K/V memory per rank
growing with the whole sequence, the fastest when it fits) or "ring" (``axon4d.nn.context_ring``:
passed around z one rank's at a time while attention computes, K/V memory O(chunk)). The planner
prices both (``axon4d.plan.workload.Workload.context_collectives``) and chooses by memory and time.

The sequence is split over z, or over z and data together (hierarchical, ``CONTEXT_AXES``: the
``batch`` axis) when z alone is too short for it.
"""

from __future__ import annotations

from axon4d.grid.shape import Axis

#: the ways keys and values reach the ranks that need them, the default first
MODES = ("all-gather", "ring")


def context_mode(context_parallel: bool | str | None) -> str | None:
    """The mode a ``context_parallel`` option names: None (off: False, None, ""), "all-gather" (True
    or "all-gather") or "ring"; anything else is a ``ValueError`` naming the choices."""
    if context_parallel is None or context_parallel is False or context_parallel == "":
        return None
    if context_parallel is True:
        return MODES[0]
    if context_parallel in MODES:
        return str(context_parallel)
    raise ValueError(
        f"context_parallel={context_parallel!r}: choose False (whole sequences per rank), True or "
        f"'all-gather' (keys and values all-gathered over z) or 'ring' (passed around z, O(chunk) memory)"
    )


#: the axes context parallelism splits a sequence over: z (sequences over data), or z and data
#: together (hierarchical: the ``batch`` axis, coordinate d·G_z + z; every data rank holds parts of
#: every sequence)
CONTEXT_AXES: dict[str, Axis] = {"z": "z", "z,data": "batch"}


def context_axis(axes: str) -> Axis:
    """The grid axis a ``context_parallel_axes`` option names: "z" → z, "z,data" (or "data,z",
    "z·data") → batch; anything else is a ``ValueError`` naming the choices."""
    names = ",".join(sorted(a.strip() for a in str(axes).replace("·", ",").split(","))) if axes else ""
    key = "z,data" if names == "data,z" else names
    if key not in CONTEXT_AXES:
        raise ValueError(
            f"context_parallel_axes={axes!r}: context parallelism splits each sequence over 'z' (sequences over "
            "data) or 'z,data' (over z and data together, for sequences too long for z alone)"
        )
    return CONTEXT_AXES[key]
