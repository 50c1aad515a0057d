"""Collectives on private copies, so that torch's MemTracker sees the program's memory alone
(tests/test_offload.py, tests/test_plan_memory_options.py).

gloo runs a collective on a worker thread, which holds the tensors it was given (its ``Work``) until
it is done with them: after the waiting thread has been woken, and — when it holds the last
reference to a tensor whose Python object exists, as every tensor made in Python does — only
once it has taken the GIL to free it, which the program's thread keeps while it computes until its
next blocking wait (or the 5 ms switch interval). So a collective's input or output that the
program has already dropped is freed from the worker thread at a moment the scheduler picks, and
MemTracker's live bytes at a given point of a step vary between runs by the last collectives'
tensors: the loss's log-sum-exps (2–6 KiB), a block's all-reduced output (256 KiB), the previous
step's embedding gradient (64 KiB), which gloo can still hold when ``zero_grad`` drops it.

``private_collectives()`` runs every collective the communication layer issues
(``axon4d.comm.communicator``'s all-reduce, all-gather, reduce-scatter and all-to-all, which
``axon4d.comm.gloo_exchange`` uses too) on copies made outside the tracker's sight
(``_disable_current_modes``): gloo holds only those, the copy back into the caller's tensor is made
when the caller waits, and every tensor the tracker counts is referenced by the program's own
thread alone, so it is freed exactly where the program drops it. The copies cost memory the
tracker does not count (as it never counted gloo's own buffers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from axon4d.comm import communicator


class _Copied:
    """A collective issued on private copies: ``wait`` copies the results into the caller's tensors."""

    def __init__(self, work: Any, results: list[tuple[torch.Tensor, torch.Tensor]]):
        self._work, self._results = work, results

    def wait(self) -> bool:
        self._work.wait()
        with _disable_current_modes():
            for mine, private in self._results:
                mine.copy_(private)
        self._results = []  # the caller's tensors: no longer referenced here
        return True

    def get_future(self) -> Any:
        return self._work.get_future()


def _on_copies(collective: Callable[..., Any], in_place: bool) -> Callable[..., Any]:
    """``collective(output, input, ...)`` (or, ``in_place``, ``collective(tensor, ...)``) run on
    private copies of its tensors."""

    def issue(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        with _disable_current_modes():
            if in_place:
                mine, rest = args[0], args[1:]
                private = mine.clone()
                work = collective(private, *rest, async_op=True, **kwargs)
            else:
                mine, inp, rest = args[0], args[1], args[2:]
                private = torch.empty_like(mine)
                work = collective(private, inp.clone(), *rest, async_op=True, **kwargs)
        copied = _Copied(work, [(mine, private)])
        if async_op:
            return copied
        copied.wait()
        return None

    return issue


@contextlib.contextmanager
def private_collectives() -> Iterator[None]:
    """Within: the communication layer's collectives run on private copies (module docstring)."""
    saved = (dist.all_reduce, dist.all_to_all_single, communicator._ALL_GATHER, communicator._REDUCE_SCATTER)
    dist.all_reduce = _on_copies(saved[0], in_place=True)  # type: ignore[assignment]
    dist.all_to_all_single = _on_copies(saved[1], in_place=False)  # type: ignore[assignment]
    communicator._ALL_GATHER = _on_copies(saved[2], in_place=False)
    communicator._REDUCE_SCATTER = _on_copies(saved[3], in_place=False)
    try:
        yield
    finally:
        dist.all_reduce, dist.all_to_all_single, communicator._ALL_GATHER, communicator._REDUCE_SCATTER = saved
