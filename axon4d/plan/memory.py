"""Predicted memory per rank of one training step on one grid (docs/design.md §2, §5, §6).

Persistent: the parameters, gradients and optimizer state a rank holds the whole step
(``axon4d.plan.persistent``). Transient: the peak of the backward pass
(``axon4d.plan.backward_walk.BackwardWalk``), from the activations every block saved
(``axon4d.plan.saved``), the weights kept from forward to backward, ZeRO's gathers and the optimizer
step's temporaries.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from axon4d.device import DTYPES
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Term, weight_shard_numel, wire_element_size
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.backward_walk import BACKWARD_ORDER, BackwardWalk, walk_kinds
from axon4d.plan.blocks import layer_kind
from axon4d.plan.persistent import (
    Persistent,
    adam_step_temporaries,
    block_param_elements,
    embedding_elements,
    persistent,
)
from axon4d.plan.saved import block_bytes, final_norm_saved
from axon4d.plan.workload import Workload


@dataclasses.dataclass
class MemoryEstimate:
    """Predicted bytes per rank."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward, all blocks, at the start of backward
    buffers: float  # transient buffers at the peak (gathered weights, dW blocks, logits gradient)
    peak: float
    host: float = 0.0  # offloaded activations held in host memory (``offload`` blocks)
    pinned: float = 0.0  # host memory one rank's buffers take (offload, snapshot; ``plan.host_memory``)
    pinned_node: float = 0.0  # ... and all the ranks of one node together
    reserved: float = 0.0  # device memory taken before the first tensor (context, workspaces, NCCL buffers)

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def kept_weights(wl: Workload, shape: GridShape, recompute: str, overlap: OverlapPolicy, cast: bool) -> float:
    """Bytes of the weight blocks kept from the forward to the backward: every block gathered in
    forward under keep-for-backward (G_z > 1), and on one rank every weight's cast copy (``cast``:
    fp32 masters cast per use, axon4d.nn.local_linear); the embedding has none, and under full
    recomputation a block's layers keep theirs only from its re-run on (``BackwardWalk.rebuild``)."""
    if not ((overlap.oag_keep and shape.z > 1) or (cast and shape.world_size == 1)):
        return 0.0
    return (
        sum(
            s.count * weight_shard_numel(s.in_features, s.out_features, shape, s.transpose) * shape.z
            for s in wl.linears()
            if not s.embedding and not (recompute == "full" and layer_kind(s.name) in BACKWARD_ORDER[1:])
        )
        * wl.element_size
    )


def edge_activations(wl: Workload, shape: GridShape) -> float:
    """Bytes the head keeps for backward: the logits and the head's input, and what the final norm
    keeps beyond its output (``final_norm_saved``); none without a head."""
    if not wl.head:
        return 0.0
    m, b = wl.model, wl.local_tokens(shape)
    return b * (m.vocab_size // shape.y + m.hidden // shape.x) * wl.element_size + final_norm_saved(wl, shape)


def held_gradients(
    state: Persistent, shape: GridShape, zero: int, micro_batches: int, staged_reduce_scatter: bool
) -> tuple[float, float]:
    """(gradient bytes live through the whole backward, bytes each layer's gradient adds per byte of
    it). Under accumulation the earlier micro-batches' gradient sums are live throughout and each
    layer's new gradient is added into them (share 0). At one micro-batch each layer's gradient is
    new (share 1); under ZeRO-2, E12 is a reduce-scatter over data and ODP waits for every bucket
    at the end of the backward (Scheduler.finish_gradients), so each shard stays whole until then,
    with the chunks a staged reduce-scatter over more than two ranks receives (share 2, and the
    held sums twice); only the step after it holds the parts."""
    staged = 1.0 if zero == 2 and shape.data > 2 and staged_reduce_scatter else 0.0
    held = state.n_params * state.p_bytes * (1.0 + staged) if micro_batches > 1 else 0.0
    return held, 0.0 if micro_batches > 1 else 1.0 + staged


def offload_peak(
    added: float,
    wl: Workload,
    shape: GridShape,
    state: Persistent,
    per_block: float,
    weights: float,
    held: float,
    share: float,
) -> float:
    """The peak live bytes of the backward's last two blocks when blocks are offloaded
    (axon4d.memory.offload): from the last block kept on the device on, two blocks are there at a
    time — the block running and the one fetched back ahead of it — while the gradients grow block
    by block, so that stretch peaks in the last two blocks (where it starts, the walk of the whole
    pass, ``BackwardWalk.run``, holds more). Block 1's backward starts with its saved tensors and
    block 0's, fetched back when it started, beside the gradient coming down the residual stream
    (b · H/G_x: the head's dX, which ``run`` holds from the head on) and the gradients of every
    parameter whose backward ran — all but the two blocks' and the embedding's; block 0's then
    starts with its own tensors alone and block 1's gradients too. ``added``: the most bytes those
    two blocks' backward adds to where it starts, each layer's gradient adding ``share`` of its
    bytes (``_last_blocks_added``)."""
    m = wl.model
    blocks = min(m.n_layers, 2)
    residual = wl.local_tokens(shape) * (m.hidden // shape.x) * wl.element_size if wl.head else 0.0
    done = state.n_params - blocks * block_param_elements(wl, shape) - embedding_elements(wl, shape)
    start = blocks * per_block + weights + held + residual + done * state.p_bytes * share
    return start + added


def zero_gathers(
    wl: Workload, shape: GridShape, zero: int, overlap: OverlapPolicy, accelerator: bool, state: Persistent
) -> tuple[float, float, int]:
    """(bytes of ZeRO's parameter all-gathers at the optimizer step, bytes of the one left in flight
    into the next forward, elements of the largest weight part the step updates). The all-gathers of
    the updated parameters run two buckets at a time (one unpacked while the next is in flight), each
    its parts sent and every rank's received. A bucket closes once it holds the policy's bucket_bytes
    on the device, so it holds less than that plus its last tensor (0: one tensor per bucket, the
    largest bounding it), and never more than them all. The job leaves the last bucket's gather in
    flight into the next forward (axon4d.zero.gathers): its buffers live beside the forward's saved
    activations until the last layers, the head's (the last parameters), run; the backward that
    follows starts from all of them. Without ZeRO over data: none, and the largest weight shard."""
    largest_shard = max(
        (s.in_features // shape.y) * (s.out_features // shape.x)
        if s.embedding
        else weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        for s in wl.linears()
    )
    if not (zero and shape.data > 1):
        return 0.0, 0.0, largest_shard
    largest = largest_shard * (wl.element_size if state.sixteen else state.p_bytes)
    bucket = min(largest + overlap.bucket_bytes(accelerator), max(state.params, largest))
    return 2 * bucket * (1 + 1 / shape.data), bucket * (1 + 1 / shape.data), math.ceil(largest_shard / shape.data)


@dataclasses.dataclass(frozen=True)
class _WalkOptions:
    """What ``memory``'s walks of one step share beside their kind, start and gradient share."""

    shape: GridShape
    recompute: str
    overlap: OverlapPolicy
    staged_reduce_scatter: bool
    grad_bytes: int  # per gradient element
    wire_bytes: int  # per element of a dW block and of its E11
    fp8_gather: bool
    carried: bool  # the held backward passes carry kept blocks over (``BackwardWalk.released``)
    cast: bool
    widened: bool

    def walk(self, kind: Workload, start: float, share: float) -> BackwardWalk:
        """The walk of the step's blocks of ``kind``'s kind from ``start`` live bytes, each layer's
        gradient adding ``share`` of its bytes."""
        return BackwardWalk(
            kind,
            self.shape,
            self.recompute,
            self.overlap,
            self.staged_reduce_scatter,
            start,
            share,
            grad_bytes=self.grad_bytes,
            wire_bytes=self.wire_bytes,
            fp8_gather=self.fp8_gather,
            carried=self.carried,
            cast_weights=self.cast,
            widened_gemms=self.widened,
        )


@functools.lru_cache(maxsize=16384)
def _walk_added(kinds: tuple[tuple[Workload, int], ...], share: float, options: _WalkOptions) -> float:
    """The most bytes the step's backward adds to what is live as it starts: ``walk_kinds`` of the
    walk of each of ``kinds`` (in the order the backward reaches them, with their block counts)
    from zero live bytes, each layer's gradient adding ``share`` of its bytes. Made once per
    arguments: the step options that leave them alone (offload, ZeRO stage) share it."""
    return walk_kinds([(options.walk(kind, 0.0, share), count) for kind, count in kinds])


@functools.lru_cache(maxsize=16384)
def _last_blocks_added(kind: Workload, share: float, options: _WalkOptions) -> float:
    """The most bytes the backward's last two blocks of ``kind`` add to what is live as the first
    of them starts (``BackwardWalk.last_blocks`` from zero live bytes; the first is the block right
    after the head where the model has at most two), each layer's gradient adding ``share`` of its
    bytes. Made once per arguments: as in ``_walk_added``, the peak from any start is that start
    plus this, and the offload levels, ZeRO stages and starts share it."""
    return options.walk(kind, 0.0, share).last_blocks(first=kind.model.n_layers <= 2)


def memory(
    wl: Workload,
    shape: GridShape,
    recompute: str = "none",
    overlap: OverlapPolicy = OverlapPolicy(),
    master_weights: bool | None = None,
    staged_reduce_scatter: bool = True,
    *,
    micro_batches: int = 1,
    zero: int = 0,
    offload: int = 0,
    fp8_gather: bool = False,
    widened_gemms: bool = False,
    accelerator: bool = False,
) -> MemoryEstimate:
    """Predicted peak bytes per rank of one step of ``wl`` on ``shape`` (with ``wl.optimizer``'s states).

    ``staged_reduce_scatter``: whether a reduce-scatter over more than two ranks holds the chunks it
    receives, a buffer of its input's size, until waited on (the host's exchange under gloo; not
    NCCL: ``Machine.staged_reduce_scatter``). ``widened_gemms``: the dW GEMMs of 16-bit inputs into
    fp32 sums widen their inputs first (the host; an accelerator's GEMM writes fp32 itself).
    ``accelerator``: the ranks compute on accelerators, whose bucket size a policy that leaves it
    unset takes (``OverlapPolicy.bucket_bytes``).

    The step's options (``axon4d.plan.scenario``): with ``micro_batches`` k the activations are one
    micro-batch's (batch/k sequences), and under keep-for-backward the held backward passes keep the
    weight blocks they carry to the next micro-batch to their end (``BackwardWalk.released``); on one
    rank under mixed precision each Linear keeps its weight's 16-bit copy from its forward to its
    backward (axon4d.nn.local_linear: one cast per step); with ``zero`` ≥ 1 the optimizer state is that of ⌈N/G_data⌉
    elements of the rank's N, and with ``zero`` = 2 at k = 1 the gradients too (under
    accumulation the local sums of the whole shards are held to the last micro-batch, so the
    gradients stay whole; in the backward the shards stay whole until their reduce-scatters over
    data are waited at its end); with ``offload`` n the saved activations of the first n blocks leave the
    device — the backward starts with the other L − n blocks' and, from the last of those on, two are
    on the device at a time (the block running, the one fetched back ahead of it): max(L − n,
    min(L, 2)) blocks' worth — and take n blocks' worth of host memory (``MemoryEstimate.host``)."""
    if micro_batches > 1:
        wl = dataclasses.replace(wl, batch=wl.batch // micro_batches)
    state = persistent(wl, shape, zero, micro_batches, master_weights)
    # each block kind (``Workload.kinds``: dense blocks before MoE blocks, or one kind), its blocks and
    # the bytes one of them keeps for backward; the first ``offload`` blocks are the first kind's first
    kinds = [(kind, round(share * wl.model.n_layers)) for kind, share in wl.kinds()]
    per_kind = [block_bytes(kind, shape, recompute) for kind, _ in kinds]
    per_block = per_kind[0]  # the first blocks': those offload moves first (and fetches back last)
    cast = state.p_bytes != wl.element_size and not state.sixteen  # fp32 masters, cast per use
    weights = kept_weights(wl, shape, recompute, overlap, cast)
    # the backward starts with the activations of the blocks not offloaded (axon4d.memory.offload: the
    # first ``offload``, whose backward comes last)
    blocks = host = 0.0
    left = offload
    for (_, count), saved in zip(kinds, per_kind):
        moved = min(left, count)
        blocks += (count - moved) * saved
        host += moved * saved
        left -= moved
    acts = blocks + weights + edge_activations(wl, shape)
    held, share = held_gradients(state, shape, zero, micro_batches, staged_reduce_scatter)
    wire_dtype = torch.float32 if state.p_bytes == 4 else DTYPES[wl.dtype]

    options = _WalkOptions(
        shape,
        recompute,
        overlap,
        staged_reduce_scatter,
        state.p_bytes,
        wire_element_size(wl.dtypes, Term.E11, wire_dtype),
        fp8_gather,
        micro_batches > 1,
        cast,
        widened_gemms,
    )

    # the backward reaches a mixed model's MoE blocks (the last ones) first; every event of the walk
    # moves the live bytes by its own, so its peak is where it starts plus what it adds (``_walk_added``)
    walked = tuple((kind, count) for kind, count in reversed(kinds))
    live_peak = acts + held + _walk_added(walked, share, options)
    if offload:  # the backward's last two blocks: the first kind's (a mixed model's dense blocks)
        first = kinds[0][0]
        added = _last_blocks_added(first, share, options)
        live_peak = max(live_peak, offload_peak(added, first, shape, state, per_block, weights, held, share))
    gathers, deferred, largest_part = zero_gathers(wl, shape, zero, overlap, accelerator, state)
    # per-tensor temporaries of a non-foreach Adam (``adam_step_temporaries``; under ZeRO over data
    # the largest part's two); SGD updates in place
    temporaries = 2 * largest_part if zero and shape.data > 1 else adam_step_temporaries(wl, shape)
    optimizer_step = state.grads + gathers + (temporaries * 4 if wl.optimizer == "adam" else 0)
    peak = state.params + state.optimizer + max(live_peak, acts + deferred, optimizer_step)
    buffers = max(live_peak - acts, 0.0)
    return MemoryEstimate(state.params, state.grads, state.optimizer, acts, buffers, peak, host)
