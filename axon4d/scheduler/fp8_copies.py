"""Each FP8 layer's weight shard in e4m3, made once per optimizer step (docs/design.md §2 "FP8 GEMMs").

Under FP8 GEMMs (precision ``bf16-fp8``, ``axon4d.options.fp8_gemm``) a layer's weight enters its
GEMMs as an e4m3 block with one tensorwise scale. ``FP8Copies.fp8_shard`` makes this rank's part of
it from the fp32 master shard the first time a gather reads the weight in a step, or after it changed (``stamp``: its version and storage) and hands back the same copy until the
weight changes or the step's last backward ends (``forget_fp8_copies``, outside ``accumulating``) —
so a weight is quantised once per optimizer step, however many micro-batches, backward gathers and
recomputed forwards read it, and a write the stamp cannot see (a fused optimizer's kernel, a write
through ``.data``) is seen by the next step all the same.

The scale is one power of two for the whole block, shared by its z ranks: each rank takes the
power-of-two scale of its own shard's largest magnitude (``precision.fp8_scale``), the z ranks
all-gather those (4 bytes a rank, ``Term.FP8_SCALE``, once per weight and step) and keep the
largest. With one scale the all-gather of the shards' bytes over z (E10) *is* the block's e4m3
data: it feeds the GEMM as gathered, a view, with no pass over it. Each element is rounded once,
from the fp32 master. Making it reads the master twice — the amax, then one pass that casts (fused
on an accelerator: 9 bytes per element; the host's division and cast: 17) — and the copy costs one
byte per element of the shard during a step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from axon4d.comm.communicator import Communicator
from axon4d.layout.geometry import Term
from axon4d.options import fp8_gemm
from axon4d.options.precision import fp8_scale


def stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when ``weight``'s values may have: its version (an in-place write through the
    tensor or a ``detach()`` of it: ``torch.optim``'s for-loop and foreach steps, a load's ``copy_``,
    ZeRO's gather) and its storage (``.data =``). Writes through ``.data`` or a fused optimizer's
    kernel leave both as they were: the step's last backward drops every carried block and every
    e4m3 copy for them (``FP8Copies.forget_fp8_copies``)."""
    return weight._version, weight.data_ptr()


class FP8Copies:
    """The e4m3 copies of one grid's FP8 layers' weight shards (the module docstring)."""

    comm: Communicator

    def _init_fp8_copies(self) -> None:
        # weight -> (stamp, Quantised (n,) e4m3 shard with the block's scale); held weakly, by identity
        self._fp8_made: Any = WeakIdKeyDictionary()
        # the same copies by storage, with the weight they were made for held weakly: a weight's alias
        # (the saved tensor full recomputation hands back, detached: another object on the same storage)
        # finds its weight's copy while that weight lives
        self._fp8_by_storage: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int], fp8_gemm.Quantised]] = {}
        #: how many e4m3 copies were made (each one quantisation of a master shard): what tests count
        self.fp8_copies_made = 0

    def fp8_shard(self, weight: torch.Tensor) -> fp8_gemm.Quantised:
        """``weight``'s flat z shard (n,) in e4m3 with its block's power-of-two scale — made now if
        the weight changed since the last copy (one all-gather of 4 bytes over z when G_z > 1, which
        every z rank of the block reaches at the same point), else the copy already made."""
        now = stamp(weight)
        entry = self._made(weight)
        if entry is not None and entry[0] == now:
            return entry[1]
        flat = weight.detach().reshape(-1)  # (n,) the fp32 master shard
        scale = fp8_scale(fp8_gemm.amax(flat), pow2=True)  # () fp32, this shard's: one read of it
        if self.comm.shape.size("z") > 1:  # the block's: the largest of its shards' (powers of two)
            scale = self.comm.all_gather(scale.reshape(1), "z", tag=Term.FP8_SCALE).wait().amax()
        # (n,) e4m3: the fp32 quotients, exact (a power of two at or above the shard's own), rounded once
        made = fp8_gemm.Quantised(fp8_gemm.cast_weight(flat, scale), scale)
        self._fp8_made[weight] = (now, made)
        self._fp8_by_storage[weight.data_ptr()] = (weakref.ref(weight), now, made)
        self.fp8_copies_made += 1
        return made

    def _made(self, weight: torch.Tensor) -> tuple[tuple[int, int], fp8_gemm.Quantised] | None:
        """(stamp, copy) made last for ``weight``, or for the live weight it aliases (the same storage)."""
        entry = self._fp8_made.get(weight)
        if entry is not None:
            return entry
        alias = self._fp8_by_storage.get(weight.data_ptr())
        if alias is None or alias[0]() is None:
            return None
        return alias[1], alias[2]

    def fp8_shard_made(self, weight: torch.Tensor) -> fp8_gemm.Quantised:
        """The copy ``fp8_shard`` made last for ``weight`` (a gather of its bytes is read with its scale)."""
        entry = self._made(weight)
        if entry is None:
            raise RuntimeError(f"no e4m3 copy was made this step for a weight of shape {tuple(weight.shape)}")
        return entry[1]

    def forget_fp8_copies(self) -> None:
        """Drop every e4m3 copy: the next read makes them again (after a write the stamp cannot see)."""
        self._fp8_made = WeakIdKeyDictionary()
        self._fp8_by_storage = {}
