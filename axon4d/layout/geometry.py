"""The geometry of a 3D-parallel linear layer: its block shapes, z shards, and the collectives it
issues with their payloads (docs/design.md §2, §3, E8–E13); and what every collective moves.

This is the single source of truth for layer shapes and communication volume: the layers size
their blocks and buffers with ``weight_block_shape``/``weight_shard_numel`` and the planner prices
the ``Collective`` list returned by ``linear_collectives``; tests check that list against what
``axon4d.comm.communicator`` logged at run time.
Payload = the full tensor a collective produces (all-reduce: the buffer; all-gather: the
gathered result; reduce-scatter: the input). Axes of size 1 issue nothing and are omitted.

**What each collective moves** (``wire_dtype``, ``wire_element_size``): one function maps a
``Precision`` and a ``Term`` to the dtype on the wire — the compute dtype for activations and
weight gathers (E8–E10, the embedding lookup, context parallelism's keys and values and their
gradients), uint8 for E10 under FP8 gathers (``precision.gather_payload_bytes``), the reduction
dtype for every gradient reduction (E11–E13, the replicated parameters' gradients), fp32 for the
vocabulary-parallel loss's per-token statistics (a split norm's sums: ``norm_statistics_wire``,
LayerNorm's forward in fp64) and, for ZeRO's parameter
all-gather over data, the dtype the parameter is stored in (``zero_stored_dtype``). The runtime
casts to it before it issues the collective (``axon4d.scheduler``, ``axon4d.nn``, ``axon4d.zero``)
and the planner prices it (``linear_collectives(precision=...)``, ``axon4d.plan.workload``): one
answer for both. ZeRO's split of a flat tensor over data is ``data_part_numel``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import torch
import torch.nn.functional as F

from axon4d.grid.shape import GridAxis, GridShape
from axon4d.options.precision import Precision, gather_payload_bytes, gathers_fp8


class Op(str, enum.Enum):
    """The kinds of collective the library issues."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SHIFT = "shift"  # each rank sends to the next on an axis and receives from the previous (a ring step)


class Term(str, enum.Enum):
    """The one name of each collective with an equation or a fixed role: the tag it is issued and
    logged under (``Communicator``, the comm log, trace JSON), the ``term`` of the ``Collective``
    lists here and in ``axon4d.plan.workload``, and the key the planner prices it under. The value
    is what the log prints; E8–E13 are docs/design.md §3's collectives (E10f/E10b: E10's forward
    and backward gathers). One-off tags ("checkpoint", "log", …) stay free strings."""

    E8 = "E8"  # forward all-reduce of Y over the layer's input axis (x; y when transposed)
    E9 = "E9"  # backward all-reduce of dX over the output axis
    E10F = "E10f"  # all-gather over z of the weight block in forward (a recomputed forward's too)
    E10B = "E10b"  # the same gather in backward (not issued when the forward's block is kept)
    E11 = "E11"  # reduce-scatter over z of dW
    E12 = "E12"  # all-reduce over data of the dW shard
    E13 = "E13"  # all-reduce over batch of db
    CP_KV = "cp_kv"  # context parallelism: all-gather over z of the keys and values (docs/context.md)
    CP_KV_GRAD = "cp_kv.grad"  # the reduce-scatter over z of their gradients
    CP_KV_RING = "cp_kv.ring"  # ring context parallelism: one step's shift over z of a rank's keys and values
    CP_KV_RING_GRAD = "cp_kv.ring.grad"  # ... and of their gradients' accumulators in backward
    EMBEDDING = "embedding"  # the token embedding lookup's all-reduce over y
    EMBEDDING_GRAD = "embedding.grad"  # the token table's gradient all-reduce over batch
    POSITION_GRAD = "position.grad"  # the position table's gradient all-reduce over batch
    NORM_GRAD = "norm.grad"  # a norm weight's or bias' gradient all-reduce over batch
    NORM_STATS = "norm.stats"  # a split norm: all-reduce over x of the per-token sums [Σx, Σx²] (axon4d.nn.norm)
    NORM_STATS_GRAD = "norm.stats.grad"  # ... and in backward of the per-token sums its input gradient needs
    REPLICATED_GRAD = "replicated_grad"  # any other replicated parameter's gradient over batch
    FP8_SCALE = "fp8.scale"  # FP8 GEMMs: all-gather over z of the shards' scales, once per weight and step
    ZERO_GATHER = "zero.gather"  # ZeRO: the updated parameters' all-gather over data after the optimizer step
    CE_LSE = "ce.lse"  # the vocabulary-parallel loss: all-gather of the log-sum-exps over y
    CE_TARGET = "ce.target"  # ... and all-reduce of the target logits over y
    GATHER_BATCH = "gather_batch"  # axon4d.activations: whole batch from its shards (outside autograd)
    GATHER_FEATURES = "gather_features"  # whole features from their shards over an axis
    GATHER_SEQUENCE = "gather_sequence"  # whole sequences from their context-parallel chunks
    MOE_ROUTER = "moe.router"  # MoE: all-reduce over x of the router's partial logits (docs/moe.md, E14)
    MOE_ROUTER_GRAD = "moe.router.grad"  # ... backward: all-reduce over x of the gates' partial gradients
    #: MoE: the tokens per expert, gathered over the count group and summed over the total group (E15)
    MOE_COUNTS = "moe.counts"
    MOE_DISPATCH = "moe.dispatch"  # all-to-all of token rows to their experts' ranks (E16), and back in backward
    MOE_COMBINE = "moe.combine"  # all-to-all of the experts' outputs back to the tokens' ranks (E16)
    MOE_ROWS_Y = "moe.rows_y"  # all-gather over y of rows dispatched once per y group (E17)
    MOE_ROWS_Y_GRAD = "moe.rows_y.grad"  # ... and the reduce-scatter over y of their partial gradients
    MOE_EXPERT = "moe.expert"  # all-reduce of an expert GEMM's partial sums (over x after up, y after down)
    MOE_ROUTER_WEIGHT_GRAD = "moe.router_weight.grad"  # the router weight's gradient all-reduce over batch
    MOE_ROWS_X = "moe.rows_x"  # all-to-all over x moving rows from features to rows, where x does not split experts
    MOE_ROWS_X_GRAD = "moe.rows_x.grad"  # ... and its gradients' in backward
    MOE_EXPERT_WEIGHT_GRAD = "moe.expert_weight.grad"  # expert replicas' weight gradients (ZeRO-2: RS over data)
    # the tags the runtime logs for the rest of an MoE layer's collectives (named here so the planner
    # prices them under the same name): the all-to-alls' reverse exchanges in backward, and the
    # experts' up projection's all-reduce over x (``nn.functional.sum_partials``'s own tags)
    MOE_DISPATCH_GRAD = "moe.dispatch.grad"  # the dispatch's gradient: rows back to the tokens' ranks
    MOE_COMBINE_GRAD = "moe.combine.grad"  # the combine's gradient: output gradients to the experts' ranks
    MOE_EXPERT_UP = "sum_partials.x"  # all-reduce over x of the experts' up outputs (E18)
    MOE_EXPERT_UP_GRAD = "sum_partials.bwd.x"  # ... and of their gradients in backward
    DENSE = "dense"  # materialising a module's full parameters (``to_dense``)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a layer issues per step: what, over which axis, how many payload bytes."""

    op: Op
    axis: str
    payload_bytes: int
    phase: str  # "forward" | "backward"
    term: Term  # its name: the tag the comm log records it under, the planner's key


#: collectives of activations and of the weights a GEMM uses: they move the compute dtype
COMPUTE_TERMS = frozenset(
    {
        Term.E8,
        Term.E9,
        Term.E10F,
        Term.E10B,
        Term.EMBEDDING,
        Term.CP_KV,
        Term.CP_KV_GRAD,
        Term.CP_KV_RING,
        Term.CP_KV_RING_GRAD,
    }
)
#: gradient reductions: they move the reduction dtype (fp32 sums under ``bf16-fp32-reduce``)
GRADIENT_TERMS = frozenset(
    {
        Term.E11,
        Term.E12,
        Term.E13,
        Term.EMBEDDING_GRAD,
        Term.POSITION_GRAD,
        Term.NORM_GRAD,
        Term.REPLICATED_GRAD,
        Term.MOE_ROUTER_WEIGHT_GRAD,
        Term.MOE_EXPERT_WEIGHT_GRAD,
    }
)
#: what an MoE layer issues for its activations (docs/moe.md, E14–E18; its router weight's gradient apart)
MOE_LAYER_TERMS = frozenset(
    {
        Term.MOE_ROUTER,
        Term.MOE_ROUTER_GRAD,
        Term.MOE_COUNTS,
        Term.MOE_DISPATCH,
        Term.MOE_DISPATCH_GRAD,
        Term.MOE_COMBINE,
        Term.MOE_COMBINE_GRAD,
        Term.MOE_ROWS_Y,
        Term.MOE_ROWS_Y_GRAD,
        Term.MOE_EXPERT,
        Term.MOE_EXPERT_UP,
        Term.MOE_EXPERT_UP_GRAD,
        Term.MOE_ROWS_X,
        Term.MOE_ROWS_X_GRAD,
    }
)
#: per-token statistics of the vocabulary-parallel loss and FP8 GEMMs' weight scales: always fp32 (a split
#: norm's: ``norm_statistics_wire``)
STATISTIC_TERMS = frozenset({Term.CE_LSE, Term.CE_TARGET, Term.FP8_SCALE})


def norm_statistics_wire(term: Term, centred: bool) -> tuple[int, torch.dtype]:
    """(values per token, dtype) of a split norm's all-reduce over x (``axon4d.nn.norm``): in forward
    (``Term.NORM_STATS``) LayerNorm's (``centred``) sums [Σx, Σx²] in fp64 — formed about the rank's
    own mean so that E[x²] − E[x]² does not cancel — and RMSNorm's [Σx²] in fp32; in backward
    (``Term.NORM_STATS_GRAD``) [Σĝ, Σĝ·x̂] (RMSNorm: [Σĝ·x̂]) in fp32. The norm forms its sums in
    these dtypes; the planner prices them."""
    values = 2 if centred else 1
    if term == Term.NORM_STATS:
        return values, torch.float64 if centred else torch.float32
    if term == Term.NORM_STATS_GRAD:
        return values, torch.float32
    raise ValueError(
        f"{term.value!r} is not a split norm's all-reduce: use {Term.NORM_STATS.value!r} or its gradient's"
    )


def zero_stored_dtype(precision: Precision, param_dtype: torch.dtype, linear_weight: bool, g_data: int) -> torch.dtype:
    """The dtype a sharded optimizer (``axon4d.zero``) stores a parameter of ``param_dtype`` in:
    a 3D Linear layer's weight shard (``linear_weight``) in the compute dtype when training in
    mixed precision with G_data > 1 (its fp32 master split over data), every other parameter as it
    is. ZeRO's all-gather over data (``Term.ZERO_GATHER``) moves this dtype."""
    if linear_weight and precision.mixed and g_data > 1:
        return precision.compute
    return param_dtype


def wire_dtype(
    precision: Precision,
    term: Term,
    param_dtype: torch.dtype = torch.float32,
    *,
    g_z: int = 1,
    g_data: int = 1,
    linear_weight: bool = False,
) -> torch.dtype:
    """The dtype the collective ``term`` moves under ``precision``, for a layer or parameter whose
    parameters are stored in ``param_dtype`` (the library's: fp32 master weights; a bf16 model's
    own bf16): the dtype the runtime casts to before issuing it and the planner prices.

    - ``COMPUTE_TERMS``: the compute dtype under mixed precision, else ``param_dtype``; E10f/E10b
      over a z axis of ``g_z`` > 1 ranks under FP8 gathers: uint8 (e4m3 bytes and each rank's fp32
      scale, ``precision.fp8_pack``; the payload is ``precision.gather_payload_bytes``);
    - ``GRADIENT_TERMS``: the reduction dtype under mixed precision, else ``param_dtype``;
    - ``STATISTIC_TERMS`` (the loss's, FP8 weight scales): fp32; a split norm's sums: ``norm_statistics_wire``;
    - ``Term.ZERO_GATHER``: the stored dtype (``zero_stored_dtype``: ``linear_weight`` on a data
      axis of ``g_data`` ranks).

    Other terms (``DENSE``, the activation gathers outside autograd) move their tensor as it is:
    ValueError."""
    if term in (Term.E10F, Term.E10B) and gathers_fp8(precision, g_z):
        return torch.uint8
    if term in COMPUTE_TERMS:
        return precision.compute if precision.mixed else param_dtype
    if term in GRADIENT_TERMS:
        return precision.reduce if precision.mixed else param_dtype
    if term in STATISTIC_TERMS:
        return torch.float32
    if term == Term.ZERO_GATHER:
        return zero_stored_dtype(precision, param_dtype, linear_weight, g_data)
    raise ValueError(f"collective {term.value!r} moves its tensor in the tensor's own dtype: it has no wire dtype")


def wire_element_size(
    precision: Precision,
    term: Term,
    param_dtype: torch.dtype = torch.float32,
    *,
    g_data: int = 1,
    linear_weight: bool = False,
) -> int:
    """Bytes per element of the collective ``term`` under ``precision`` (``wire_dtype``'s size);
    E10 counts its compute dtype here — its FP8 payload, scales included, is
    ``precision.gather_payload_bytes``."""
    return wire_dtype(precision, term, param_dtype, g_data=g_data, linear_weight=linear_weight).itemsize


def data_part_numel(numel: int, parts: int) -> int:
    """Elements of each data rank's part of a flat tensor of ``numel`` split into ``parts`` parts
    by ZeRO (``axon4d.zero``): c = max(1, ⌈numel/parts⌉), the last parts shorter or empty. ZeRO-2's
    E12 reduce-scatters and ZeRO's all-gather over data move ``parts``·c elements."""
    return max(1, math.ceil(numel / parts))


def layer_axes(transpose: bool) -> tuple[GridAxis, GridAxis]:
    """(axis splitting input features, axis splitting output features) — §2."""
    return ("y", "x") if transpose else ("x", "y")


def weight_block_shape(in_features: int, out_features: int, shape: GridShape, transpose: bool) -> tuple[int, int]:
    """Shape (out/G_out, in/G_in) of the weight block a (x, y) position owns before Z sharding."""
    in_axis, out_axis = layer_axes(transpose)
    return out_features // shape.size(out_axis), in_features // shape.size(in_axis)


@functools.lru_cache(maxsize=65536)
def weight_shard_numel(in_features: int, out_features: int, shape: GridShape, transpose: bool) -> int:
    """Elements of this rank's flat Z shard: ⌈n_W / G_z⌉ with n_W = out·in/(G_x G_y) (padded;
    cached: the planner asks it of the same few layers millions of times)."""
    rows, cols = weight_block_shape(in_features, out_features, shape, transpose)
    return math.ceil(rows * cols / shape.z)


def z_padded_numel(numel: int, parts: int) -> int:
    """Elements of a flat block of ``numel`` padded to ``parts`` equal shards: ⌈numel/parts⌉·parts."""
    return math.ceil(numel / parts) * parts


def z_padded(flat_block: torch.Tensor, parts: int) -> torch.Tensor:
    """A flat weight block zero-padded to ``parts`` equal shards over z — the storage layout E10
    gathers and E11 reduce-scatters (a new tensor, even where nothing is padded)."""
    return F.pad(flat_block, (0, z_padded_numel(flat_block.numel(), parts) - flat_block.numel()))


def z_shard(flat_block: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Shard ``index`` of a flat weight block split into ``parts`` equal shards over z, the last
    zero-padded (``z_padded``)."""
    n = math.ceil(flat_block.numel() / parts)
    return z_padded(flat_block, parts)[index * n : (index + 1) * n]


def linear_collectives(
    in_features: int,
    out_features: int,
    tokens: int,
    shape: GridShape,
    *,
    transpose: bool = False,
    bias: bool = True,
    element_size: int = 4,
    grad_element_size: int | None = None,
    precision: Precision | None = None,
    zero: int = 0,
    cache_weight: bool = False,
    forward_chunks: int = 1,
    min_chunk_bytes: int = 0,
    chunk_rows: int = 1,
) -> list[Collective]:
    """Every collective one forward + backward of a 3D linear layer issues on one rank.

    ``tokens`` is this rank's token count b = B·S/(G_data·G_z). With ``precision`` (the grid's:
    fp32 master weights) each collective moves what ``wire_dtype`` says — E8, E9 and E10 the
    compute dtype, E10 under FP8 gathers ``gather_payload_bytes``, E11–E13 the reduction dtype —
    and ``element_size``/``grad_element_size`` are ignored; without it ``element_size`` is the
    bytes of the parameters and activations and ``grad_element_size`` those of the gradient
    reductions (E11, E12, E13; defaults to ``element_size``). ``zero`` is the ZeRO stage
    (``axon4d.zero``): at 2, E12 is a reduce-scatter over data of the shard zero-padded to G_data
    parts (``data_part_numel``). With ``cache_weight`` the forward all-gather's result is kept for
    backward and E10 is paid once (E10f, no E10b). ``forward_chunks``/``min_chunk_bytes``/
    ``chunk_rows`` are the overlap policy's token chunking of the forward all-reduce (E8; see
    ``forward_chunk_count``): the E8 payload is then issued as that many all-reduces of ``chunk_sizes`` rows each.
    """
    in_axis, out_axis = layer_axes(transpose)
    rows, cols = weight_block_shape(in_features, out_features, shape, transpose)
    shard = weight_shard_numel(in_features, out_features, shape, transpose)
    padded_block = shard * shape.z
    if precision is not None:
        element_size = wire_element_size(precision, Term.E8, precision.param)
        g_elem = wire_element_size(precision, Term.E11, precision.param)
        gathered = gather_payload_bytes(precision, shard, shape.z, precision.param)  # E10's bytes (0: G_z = 1)
    else:
        g_elem = element_size if grad_element_size is None else grad_element_size
        gathered = padded_block * element_size
    out: list[Collective] = []

    def add(op: Op, axis: str, elems: int, elem: int, phase: str, term: Term) -> None:
        if shape.size(axis) > 1:
            out.append(Collective(op, axis, elems * elem, phase, term))

    add(Op.ALL_GATHER, "z", gathered, 1, "forward", Term.E10F)
    k = forward_chunk_count(
        tokens, rows * element_size, forward_chunks, min_chunk_bytes, shape.size(in_axis), chunk_rows
    )
    for part in chunk_sizes(tokens, k, chunk_rows):
        add(Op.ALL_REDUCE, in_axis, part * rows, element_size, "forward", Term.E8)
    if not cache_weight:
        add(Op.ALL_GATHER, "z", gathered, 1, "backward", Term.E10B)
    add(Op.ALL_REDUCE, out_axis, tokens * cols, element_size, "backward", Term.E9)
    add(Op.REDUCE_SCATTER, "z", padded_block, g_elem, "backward", Term.E11)
    if zero == 2:  # ZeRO-2: each data rank receives the sum of its part (axon4d.scheduler.sharding.scatter_input)
        add(Op.REDUCE_SCATTER, "data", data_part_numel(shard, shape.data) * shape.data, g_elem, "backward", Term.E12)
    else:
        add(Op.ALL_REDUCE, "data", shard, g_elem, "backward", Term.E12)
    if bias:
        add(Op.ALL_REDUCE, "batch", rows, g_elem, "backward", Term.E13)
    return out


def forward_chunk_count(
    tokens: int, row_bytes: int, chunks: int, min_chunk_bytes: int, group: int, row_multiple: int = 1
) -> int:
    """How many token chunks the forward all-reduce (E8) of ``tokens`` rows of ``row_bytes`` is
    split into when ``chunks`` are asked for: never more than the rows (than the blocks of
    ``row_multiple`` rows), never so many that a chunk falls below ``min_chunk_bytes`` (small
    messages only pay latency for being split), and one when the all-reduce's ``group`` has a
    single rank (nothing to overlap: the GEMM stays whole)."""
    if group <= 1:
        return 1
    k = max(1, min(chunks, tokens // max(1, row_multiple)))
    if min_chunk_bytes > 0:
        k = max(1, min(k, tokens * row_bytes // min_chunk_bytes))
    return k


def chunk_sizes(tokens: int, chunks: int, row_multiple: int = 1) -> list[int]:
    """Rows of each of ``chunks`` token chunks: whole blocks of ``row_multiple`` rows spread evenly
    (the first get one block more), the rows left over added to the last chunk — so every chunk's
    GEMM but the last has a multiple of ``row_multiple`` rows (GPU GEMM tiles: 128)."""
    m = max(1, row_multiple)
    if m == 1:
        return _even(tokens, chunks)
    blocks = tokens // m
    if chunks <= 1 or blocks < chunks:  # too few whole blocks to split (forward_chunk_count never asks)
        return [tokens]
    sizes = [b * m for b in _even(blocks, chunks)]
    sizes[-1] += tokens - blocks * m
    return sizes


def _even(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` as evenly as possible, the first ``n % parts`` one larger."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
