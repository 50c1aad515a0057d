"""The process environment an accelerator run wants, set before torch initialises what reads it:
the allocator's expandable segments (``use_expandable_segments``), one hardware queue so
collectives start in issue order beside the GEMMs (``use_overlap_connections``), and host memory
in huge pages (``use_huge_pages``). Each ``*_env`` function says what it would set for a given
environment (pure, tested on the host); each ``use_*`` sets it in this process. Importing axon4d
changes no environment variable: the training job calls these (docs/training.md, "The defaults a
GPU user gets").
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from axon4d import device as devices

#: the environment variable by which torch's host allocator uses transparent huge pages
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> bool:
    """Ask torch's host allocator for transparent huge pages (module docstring) by setting
    ``THP_MEM_ALLOC_ENABLE=1`` in this process's environment, unless the environment already says
    (``THP_MEM_ALLOC_ENABLE=0`` turns it off). Nothing calls it on import: a program opts in, as
    the training job's entry does. torch reads the setting at its first host allocation, so this
    takes effect only when called before the process makes any tensor (importing axon4d makes
    none); a process that made tensors already sets the variable in its environment instead.
    Returns whether huge pages were asked for."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    return os.environ[HUGE_PAGES_ENV] == "1"


#: host memory: where data loaders make batches and where files and host-only libraries read from.
#: the allocator settings an accelerator run gets unless the user gives their own (``expandable_segments_env``)
EXPANDABLE_SEGMENTS = "expandable_segments:True"
#: the variable the training job sets, and every variable by which a user configures torch's
#: accelerator allocator (the newer generic name, and ROCm's): any of them set means "leave it"
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_ALLOC_CONF_VARS = (ALLOC_CONF_ENV, "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def expandable_segments_env(environ: Mapping[str, str], accelerator: bool) -> dict[str, str]:
    """The environment variables to set so torch's accelerator allocator grows its segments in
    place (``expandable_segments:True``: blocks of changing sizes — activations, gathered weights —
    reuse mapped memory instead of fragmenting it into cached segments of fixed sizes): {} on the
    host, and {} when ``environ`` already configures the allocator (``PYTORCH_CUDA_ALLOC_CONF``,
    ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_HIP_ALLOC_CONF``, whatever it says); else
    ``{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}``."""
    if not accelerator or any(v in environ for v in _ALLOC_CONF_VARS):
        return {}
    return {ALLOC_CONF_ENV: EXPANDABLE_SEGMENTS}


def use_expandable_segments() -> dict[str, str]:
    """Set ``expandable_segments_env``'s variables in this process's environment when it has an
    accelerator (the training job calls it before it builds the grid). torch reads the allocator's
    settings when it first initialises the accelerator, so nothing is set once that has happened
    (a program that already made accelerator tensors sets the variable itself, before it starts).
    Returns what was set."""
    if torch.cuda.is_initialized():
        return {}
    updates = expandable_segments_env(os.environ, devices.accelerator_available())
    os.environ.update(updates)
    return updates


#: how many hardware work queues CUDA spreads one process's streams over (default 8)
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def overlap_connections_env(environ: Mapping[str, str], accelerator: bool) -> dict[str, str]:
    """The environment the overlap scheduler wants on an accelerator: ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
    one hardware queue, so kernels start in the order the host issued them — a collective issued
    before a GEMM (E8's chunk i before chunk i+1's GEMM, an OAG prefetch before the layer's GEMM)
    gets its few SMs first instead of queueing behind a GEMM that fills the device, and overlaps
    it (docs/design.md §4). {} on the host and where ``environ`` already sets the variable."""
    if not accelerator or MAX_CONNECTIONS_ENV in environ:
        return {}
    return {MAX_CONNECTIONS_ENV: "1"}


def use_overlap_connections() -> dict[str, str]:
    """Set ``overlap_connections_env``'s variable in this process's environment when it has an
    accelerator and CUDA has not made its context yet (the variable is read then: the training job
    calls this before it builds the grid; a program that already made accelerator tensors sets it
    itself, before it starts). Returns what was set."""
    if torch.cuda.is_initialized():
        return {}
    updates = overlap_connections_env(os.environ, devices.accelerator_available())
    os.environ.update(updates)
    return updates
