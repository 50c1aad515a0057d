"""Reduce-scatter on gloo as one exchange of chunks (E5/E11 on the host): gloo's own reduce-scatter
sends the whole tensor, as an all-reduce does, and works on a staged copy of it; an all-to-all of
chunks sends each rank only the chunk it keeps. Part of the communication layer (``axon4d.comm.communicator``'s
``TorchTransport`` issues these; with ``axon4d.comm.mpi`` the only modules that call collectives)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from axon4d import device as devices


def index_under_gloo(group: dist.ProcessGroup) -> int | None:
    """This rank's index in ``group`` when it is two or more ranks under gloo (the host backend),
    else None. gloo's reduce-scatter sends the whole tensor, as an all-reduce does, and works on a
    staged copy of it; an exchange of chunks (``ExchangedHalves``, ``ExchangedChunks``) sends
    each rank only the chunk it keeps."""
    host_backend = devices.default_backend(devices.HOST)  # gloo
    return group.rank() if group.size() >= 2 and host_backend in str(dist.get_backend(group)) else None


class ExchangedHalves:
    """Reduce-scatter over a pair of ranks as one exchange (E5/E11 on gloo): each rank sends the
    half the other keeps and receives the other's copy of its own half into ``out``, then adds its
    own. It moves n/2 bytes each way, where gloo's reduce-scatter moves n like an all-reduce, and
    needs no buffer beyond ``out``. The sum is the same on both ranks (two terms commute)."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, index: int, group: dist.ProcessGroup):
        halves = inp.chunk(2)  # (n/2, ...) each: half i is rank i's result
        splits = [0, 0]
        splits[1 - index] = out.shape[0]  # send to and receive from the other rank only
        self._own: torch.Tensor | None = halves[index]
        self._out = out
        self._work = dist.all_to_all_single(
            out, halves[1 - index], output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=True
        )

    def wait(self) -> bool:
        self._work.wait()
        if self._own is not None:
            self._out.add_(self._own)
            self._own = None
        return True

    def get_future(self) -> Any:
        return self._work.get_future()


class ExchangedChunks:
    """Reduce-scatter over G > 2 ranks as one all-to-all (E5/E11 on gloo): rank j receives every
    rank's chunk j — (G, n/G, ...) in rank order — and sums them into ``out`` on ``wait``. It sends
    (G−1)/G of the input, where gloo's reduce-scatter sends all of it; the received chunks take a
    buffer the input's size until then, as gloo's own staged copy does. The sum runs in rank
    order, whatever order the chunks arrive in."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup):
        self._chunks: torch.Tensor | None = torch.empty_like(inp)  # (G·n/G, ...): chunk i from rank i
        self._out = out
        self._parts = group.size()
        self._work = dist.all_to_all_single(self._chunks, inp, group=group, async_op=True)

    def wait(self) -> bool:
        self._work.wait()
        if self._chunks is not None:
            torch.sum(self._chunks.view(self._parts, *self._out.shape), dim=0, out=self._out)
            self._chunks = None  # the buffer goes as soon as the sum is made
        return True

    def get_future(self) -> Any:
        return self._work.get_future()
