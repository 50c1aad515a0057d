"""Activation offload (docs/design.md §5): the tensors chosen blocks save for backward go to host
memory during the forward and come back ahead of their backward.

Which blocks: ``offload_blocks(spec, n_layers)`` — a fraction f of the blocks (the first
⌊f·L + ½⌋, whose backward comes last, so their copies have the longest time to go and come back),
or a list of block indices; ``parse_offload`` reads the command line's form ("0.5", "0,1,2").

How (``Offloader``): each chosen block's forward runs under ``torch.autograd.graph.saved_tensors_hooks``.
The storage under a saved tensor is copied whole into a host buffer (``axon4d.memory.host_pool.HostPool``: a
view of few large allocations, page-locked on an accelerator, kept from one step to the next) on a side stream that first waits for the compute stream; the device
memory is handed to the allocator with ``keep_until_done``, so it is released when the copy is done
and not before, and autograd keeps only the host copy and where the tensor lies in it. Whole storages
move so that a view comes back with its strides and offset — the backward kernels see the layout
they would have seen, and the results are bit-identical — and views of one storage (q, k, v of the
QKV output) move once. When block i+1's backward starts (a hook on
its output's gradient), block i's tensors are copied back on the side stream — prefetch one block
ahead — and a consumer's unpack makes the compute stream wait for that copy's event. On the host
the same code runs with no streams: the copy out is a staging copy into a separate host tensor and
the copy back another, so results are bit-identical and testable on CPU.

Left alone (autograd keeps them as they are): storages under ``MIN_BYTES`` (64 KiB: per-token
statistics, log-sum-exps — a copy would cost more in launches than it saves); parameters
and buffers, and views of their storage (weights that a Linear's autograd saves: they stay on the
device anyway); tensors on another device than the block's; tensors not in torch's strided layout.
The gathered weight blocks of OAG keep-for-backward (docs/design.md §4), and the compute-dtype copy
of its weight a Linear on one rank keeps for its dX under mixed precision (axon4d.nn.local_linear),
are held on the Linear's autograd context, not saved, so they are never offloaded: they are
parameter-derived, a prefetch of them would duplicate E10b's purpose (or the cast's), and they are
freed as each layer's backward ends.
A storage saved several times in one block (the norm's input kept by the norm and by a
recomputation) is copied once, unless it was written in between.

Recomputation (axon4d.nn.recompute) composes: under ``full`` only the block input is saved
(checkpoint's own hooks take the rest), so that is what moves, with the rows an MoE layer's
dispatches delivered, which it keeps for its re-run through ``pack`` (axon4d.nn.moe); under ``selective`` q, k, v and the
rest; under ``balanced`` the recipes' inputs go through the same hooks (``pack``/``unpack``, which
recompute.py's own hooks call for what they do not turn into recipes).

Counters (``Offloader.stats``): host bytes held now, their peak, per block; the bytes copied back
and held on the device now and their peak (at most the block being computed plus the prefetched
one); what was skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from axon4d import device as devices
from axon4d.memory.host_pool import HostPool

#: saved tensors smaller than this stay where they are
MIN_BYTES = 64 << 10

#: what ``Transformer(offload=)`` takes: None, a fraction in [0, 1], or block indices
OffloadSpec = float | Sequence[int] | None

_EXAMPLES = "e.g. 0.5 (the first half of the blocks), 1.0 (all), [0, 1, 2] (blocks 0–2) or None (no offload)"


def parse_offload(text: str) -> OffloadSpec:
    """The command line's ``--offload`` as ``offload_blocks`` takes it: "" or "none" → None; a
    number with a decimal point ("0.5", "1.0") → a fraction; whole numbers separated by commas
    ("3", "0,1,2") → block indices. Raises ``ValueError`` naming the text and what works."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return None
    hint = (
        f"--offload {text!r}: give a fraction of the blocks with a decimal point (0.5, 1.0), "
        "block indices separated by commas (0,1,2), or none"
    )
    if "." in text or "e" in text.lower():
        try:
            return float(text)
        except ValueError:
            raise ValueError(hint) from None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(hint) from None


def offload_blocks(spec: OffloadSpec, n_layers: int, hint: str = _EXAMPLES) -> tuple[int, ...]:
    """The indices, ascending, of the blocks whose saved tensors are offloaded, of ``n_layers``:
    none for None; for a fraction f in [0, 1] the first ⌊f·n_layers + ½⌋ blocks; a sequence of
    indices as given (each in [0, n_layers), no repeats). Raises ``ValueError``/``TypeError`` naming
    the value, the rule and what works (``hint``: the examples that end the message)."""
    if spec is None:
        return ()
    if isinstance(spec, bool) or isinstance(spec, int):
        raise TypeError(
            f"offload={spec!r}: an int is ambiguous; give a float fraction ({float(spec)!r}) "
            f"or a list of block indices ([{spec}]); {hint}"
        )
    if isinstance(spec, float):
        if not (math.isfinite(spec) and 0.0 <= spec <= 1.0):
            raise ValueError(f"offload fraction {spec}: must be within [0, 1]; {hint}")
        return tuple(range(math.floor(spec * n_layers + 0.5)))
    if isinstance(spec, str) or not isinstance(spec, Iterable):
        raise TypeError(f"offload={spec!r} ({type(spec).__name__}): {hint}")
    blocks = list(spec)
    bad = [b for b in blocks if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n_layers]
    if bad:
        raise ValueError(
            f"offload blocks {blocks}: {bad[0]!r} is not a block index; the model has {n_layers} blocks, "
            f"indices 0…{n_layers - 1}; {hint}"
        )
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"offload blocks {blocks}: an index appears twice; give each block once")
    return tuple(sorted(blocks))


@dataclasses.dataclass
class OffloadStats:
    """What an ``Offloader`` holds and has moved (bytes)."""

    host_bytes: int = 0
    """host copies held now (device memory they freed)"""
    peak_host_bytes: int = 0
    """the most held at once since ``reset_peaks``"""
    pinned_bytes: int = 0
    """host memory the pools of those copies hold now (``axon4d.memory.host_pool.HostPool.footprint``,
    page-locked on an accelerator): kept from one step to the next, after the first step one
    allocation of Σ the copies' bytes, each rounded up to ``axon4d.device.pinned.ALIGN``"""
    peak_pinned_bytes: int = 0
    """the most ``pinned_bytes`` at once since ``reset_peaks`` (what the planner's host budget prices)"""
    block_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    """host copies held now, by block"""
    peak_block_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    """the most each block held at once since ``reset_peaks`` (what one block moves out)"""
    resident_bytes: int = 0
    """copied back and held on the device now"""
    peak_resident_bytes: int = 0
    """the most copied back and held at once since ``reset_peaks``"""
    copies_out: int = 0
    copies_in: int = 0
    late_fetches: int = 0
    """copies back issued only when backward asked for the tensor (not prefetched: the compute waited)"""
    skipped: dict[str, int] = dataclasses.field(default_factory=lambda: {"small": 0, "parameter": 0, "other": 0})
    """saved tensors left alone, by reason: under MIN_BYTES, parameters or buffers, another device or layout"""
    small_bytes: int = 0
    """bytes of the saved tensors left alone for being under MIN_BYTES (counted at each save)"""


class _Saved:
    """The memory (a storage) of one or more saved tensors, offloaded: its bytes on the host, and
    on the device again once fetched back. Whole storages move, so a view comes back with its
    strides and offset, bit for bit the layout the backward kernels saw without offload, and views
    of one storage (q, k and v of the QKV output) move once."""

    __slots__ = ("__weakref__", "_copy", "_owner", "_ready", "block", "buffer_id", "device", "host", "nbytes")

    def __init__(self, owner: Offloader, t: torch.Tensor, block: int):
        self._owner, self.block, self.device = owner, block, t.device
        data = _bytes_of(t)  # (storage bytes,) uint8
        self.nbytes = data.numel()
        self._copy: torch.Tensor | None = None
        self._ready: devices.Event = None
        self.buffer_id, self.host = owner.pool(t.device).take(self.nbytes)  # (storage bytes,) uint8, host
        owner._moved(self, out=True)
        stream = owner.stream(t.device)
        devices.wait_stream(stream, devices.current_stream(t.device))  # t is made on the compute stream
        with devices.on_stream(stream):
            self.host.copy_(data, non_blocking=stream is not None)
        devices.keep_until_done(data, stream)  # the memory is released once the copy is done

    def fetch(self) -> None:
        """Issue the copy back (on the side stream), unless issued already."""
        if self._copy is not None:
            return
        stream = self._owner.stream(self.device)
        with devices.on_stream(stream):  # after the copy out: the same stream
            copy = torch.empty_like(self.host, device=self.device)
            copy.copy_(self.host, non_blocking=stream is not None)
        self._copy, self._ready = copy, devices.record_event(stream)
        self._owner._moved(self, out=False)

    def get(self) -> torch.Tensor:
        """The storage's bytes on the device, for the compute stream (which waits for the copy back)."""
        if self._copy is None:
            self._owner._stats.late_fetches += 1
            self.fetch()
        assert self._copy is not None
        compute = devices.current_stream(self.device)
        devices.wait_event(self._ready, compute)
        devices.keep_until_done(self._copy, compute)  # made on the side stream, read on this one
        return self._copy

    def __del__(self) -> None:
        self._owner._released(self, fetched=self._copy is not None)


class _View:
    """One saved tensor: where it lies in an offloaded storage (dtype, offset, sizes, strides)."""

    __slots__ = ("dtype", "offset", "saved", "size", "stride")

    def __init__(self, saved: _Saved, t: torch.Tensor):
        self.saved, self.dtype, self.offset, self.size, self.stride = (
            saved,
            t.dtype,
            t.storage_offset(),
            t.size(),
            t.stride(),
        )

    def get(self) -> torch.Tensor:
        data = self.saved.get()
        return torch.empty(0, dtype=self.dtype, device=data.device).set_(
            data.untyped_storage(), self.offset, self.size, self.stride
        )


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _Group:
    """One forward of one offloaded block: what it saved, and what it leaves alone."""

    def __init__(self, owner: Offloader, index: int, module: nn.Module):
        self.owner, self.index = owner, index
        tensors = list(itertools.chain(module.parameters(), module.buffers()))
        self.keep = {p.untyped_storage().data_ptr() for p in tensors if p.layout == torch.strided}
        self.device = tensors[0].device if tensors else None
        self.saved: list[weakref.ref[_Saved]] = []
        # storage address → (the tensors packed from it, as weak references; its version; its copy)
        self.seen: dict[int, tuple[list[weakref.ref[torch.Tensor]], int, _Saved]] = {}

    def pack(self, t: torch.Tensor) -> Any:
        stats = self.owner._stats
        if t.layout != torch.strided or t.device != self.device:
            stats.skipped["other"] += 1
            return t
        storage = t.untyped_storage()
        if isinstance(t, nn.Parameter) or storage.data_ptr() in self.keep:
            stats.skipped["parameter"] += 1
            return t
        if storage.nbytes() < self.owner.min_bytes:
            stats.skipped["small"] += 1
            stats.small_bytes += t.numel() * t.element_size()
            return t
        hit = self.seen.get(storage.data_ptr())
        # the same memory packed before, still alive (so not reused) and not written since
        if hit is not None and hit[1] == t._version and any(ref() is not None for ref in hit[0]):
            hit[0].append(weakref.ref(t))
            return _View(hit[2], t)
        saved = _Saved(self.owner, t, self.index)
        self.seen[storage.data_ptr()] = ([weakref.ref(t)], t._version, saved)
        self.saved.append(weakref.ref(saved))
        return _View(saved, t)

    def fetch(self) -> None:
        for ref in self.saved:
            saved = ref()
            if saved is not None:
                saved.fetch()


_scopes = threading.local()  # .stack: the groups whose forward runs now, innermost last


def pack(t: torch.Tensor) -> Any:
    """``t`` packed by the offloaded block whose forward runs now on this thread, else ``t`` (for
    saved-tensor hooks nested inside an offloaded block: axon4d.nn.recompute's)."""
    stack = getattr(_scopes, "stack", None)
    return stack[-1].pack(t) if stack else t


def unpack(saved: Any) -> Any:
    """What ``pack`` (or the offloader's own hook) returned, as the tensor again, on its device."""
    return saved.get() if isinstance(saved, _View) else saved


class Offloader:
    """Offloads what the blocks ``blocks`` (indices) save for backward (module docstring).

    ``forward(i, block, x)`` runs block i; call it for every block of the model in forward order
    (the blocks not offloaded too: block i+1's backward is when block i is fetched back)."""

    def __init__(self, blocks: Iterable[int], min_bytes: int = MIN_BYTES):
        self.blocks = frozenset(blocks)
        self.min_bytes = min_bytes
        self._streams: dict[torch.device, devices.Stream] = {}
        self._pools: dict[torch.device, HostPool] = {}
        self._stats = OffloadStats()
        self._groups: dict[int, _Group] = {}  # this forward pass's, by block
        self._last = -1

    def stream(self, device: torch.device) -> devices.Stream:
        """The side stream of ``device`` the copies run on (None on the host)."""
        if device not in self._streams:
            self._streams[device] = devices.side_stream(device)
        return self._streams[device]

    def pool(self, device: torch.device) -> HostPool:
        """The host buffers of ``device``'s copies (all of them copied on ``stream(device)``)."""
        if device not in self._pools:
            self._pools[device] = HostPool(device)
        return self._pools[device]

    def forward(self, index: int, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``block(x)`` (block ``index``, an ``nn.Module``), its saved tensors offloaded when it is
        one of ``blocks``; the output's gradient hook fetches this block and block ``index − 1``."""
        if index <= self._last:  # a new forward pass
            self._groups = {}
        self._last = index
        group = None
        if index in self.blocks and torch.is_grad_enabled():
            assert isinstance(block, nn.Module)
            group = self._groups[index] = _Group(self, index, block)
            stack = _scopes.__dict__.setdefault("stack", [])
            stack.append(group)
            try:
                with torch.autograd.graph.saved_tensors_hooks(group.pack, unpack):
                    y = block(x)
            finally:
                stack.pop()
                group.seen.clear()  # no strong references beyond the forward: autograd owns the copies
        else:
            y = block(x)
        due = [g for g in (group, self._groups.get(index - 1)) if g is not None]
        if due and isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(_fetcher(due))
        return y

    def stats(self) -> OffloadStats:
        """A copy of the counters."""
        s = self._stats
        return dataclasses.replace(
            s, block_bytes=dict(s.block_bytes), peak_block_bytes=dict(s.peak_block_bytes), skipped=dict(s.skipped)
        )

    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is held now; zero the copy and skip counts."""
        s = self._stats
        s.peak_host_bytes, s.peak_resident_bytes = s.host_bytes, s.resident_bytes
        s.peak_pinned_bytes = s.pinned_bytes
        s.peak_block_bytes = dict(s.block_bytes)
        s.copies_out = s.copies_in = s.late_fetches = s.small_bytes = 0
        s.skipped = {k: 0 for k in s.skipped}

    def _moved(self, saved: _Saved, out: bool) -> None:
        s = self._stats
        if out:
            s.copies_out += 1
            s.host_bytes += saved.nbytes
            s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
            s.pinned_bytes = sum(pool.footprint() for pool in self._pools.values())
            s.peak_pinned_bytes = max(s.peak_pinned_bytes, s.pinned_bytes)
            now = s.block_bytes[saved.block] = s.block_bytes.get(saved.block, 0) + saved.nbytes
            s.peak_block_bytes[saved.block] = max(s.peak_block_bytes.get(saved.block, 0), now)
        else:
            s.copies_in += 1
            s.resident_bytes += saved.nbytes
            s.peak_resident_bytes = max(s.peak_resident_bytes, s.resident_bytes)

    def _released(self, saved: _Saved, fetched: bool) -> None:
        s = self._stats
        s.host_bytes -= saved.nbytes
        self._pools[saved.device].give(saved.buffer_id)
        s.block_bytes[saved.block] -= saved.nbytes
        if fetched:
            s.resident_bytes -= saved.nbytes


def _fetcher(groups: list[_Group]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that issues the copies back of ``groups`` (and changes no gradient)."""

    def hook(grad: torch.Tensor) -> None:
        for group in groups:
            group.fetch()

    return hook
