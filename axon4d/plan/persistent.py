"""What one rank holds through the whole step: its parameters, their gradients and the optimizer
state (docs/design.md §2, §6), as the planner counts them.

Each layer's Z shard ⌈n_W/G_z⌉ (``geometry.weight_shard_numel``) plus its bias slice; norms and
position embeddings split over x; an MoE layer's router and this rank's experts
(``axon4d.plan.moe_memory``). Training in 16 bits the parameters and their gradients are the fp32
master weights (``param_bytes``), cast for the GEMMs. ZeRO shards the Adam moments and, at stage 2,
the gradients; training in 16 bits with G_data > 1 it also stores the 3D Linear weights in 16 bits
and shards their fp32 masters (``sixteen_bit_weights``): 2 + 4/G_data bytes per weight element, and
their gradients reach the step as the masters' parts (the other parameters' masters are views).
``persistent`` sums them; ``axon4d.plan.memory`` adds what a step holds for a while.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import weight_shard_numel
from axon4d.plan import moe_memory
from axon4d.plan.blocks import kind_shapes
from axon4d.plan.workload import OPTIMIZERS, Workload


def param_bytes(wl: Workload, master_weights: bool | None = None) -> int:
    """Bytes of one parameter element, and of its gradient: 4 when training in 16 bits with fp32
    master weights (the library's parameters are those masters, ``axon4d.options.precision``; the default
    for a 16-bit ``wl``), else the workload's element size."""
    master = wl.dtype != "float32" if master_weights is None else master_weights
    return 4 if master else wl.element_size


def sixteen_bit_weights(wl: Workload, shape: GridShape, zero: int, master_weights: bool | None = None) -> list[int]:
    """Elements of each weight shard ZeRO stores in 16 bits with its fp32 master sharded over data
    (``axon4d.zero.sixteen_bit``: the 3D Linear weights, not the token table, and an MoE model's
    expert weights where its expert layout replicates them over data), training in 16 bits with
    fp32 masters, ``zero`` ≥ 1 and G_data > 1; else none."""
    if not zero or shape.data == 1 or param_bytes(wl, master_weights) == wl.element_size:
        return []
    out = [
        weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        for s in wl.linears()
        if not s.embedding
        for _ in range(s.count)
    ]
    if wl.model.moe and not moe_memory.experts_whole_under_zero(wl.expert_layout):  # expert replicas over data
        out += moe_memory.param_tensors(wl.model, shape, wl.expert_layout)[1:3] * wl.model.moe_layers
    return out


def local_param_count(wl: Workload, shape: GridShape) -> int:
    """Parameter elements one rank holds: linear shards + bias slices + norms + position embedding."""
    return sum(local_param_tensors(wl, shape))


def local_param_tensors(wl: Workload, shape: GridShape, experts: bool = True) -> list[int]:
    """Elements of each parameter tensor one rank holds: per linear layer its weight shard and bias
    slice, the token table (vocab/G_y, hidden/G_x), each norm's weight (and bias) over x, the
    position table; an MoE layer's router weight and (``experts``) this rank's experts' weights."""
    m = wl.model
    out: list[int] = []
    for s in wl.linears():
        if s.embedding:  # (vocab/G_y, hidden/G_x), replicated over z and data
            out.append((s.in_features // shape.y) * (s.out_features // shape.x))
            continue
        shard = weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        out += [shard] * s.count + ([s.local(shape)[1]] * s.count if s.bias else [])
    if wl.norms:
        out += [m.hidden // shape.x] * ((2 if m.arch == "gpt" else 1) * (2 * m.n_layers + 1))
    if wl.embedding and m.arch == "gpt":
        out.append(m.seq_len * m.hidden // shape.x)
    if experts:  # MoE: each layer's router weight and this rank's experts (plan.moe_memory)
        out += moe_memory.param_tensors(m, shape, wl.expert_layout)
    elif m.moe:  # the router weights alone
        out += [moe_memory.layer_tensors(m, shape, wl.expert_layout)[0]] * m.moe_layers
    return out


def step_order_tensors(wl: Workload, shape: GridShape) -> list[int]:
    """Elements of each parameter tensor one rank holds, in the order the model registers them and
    the optimizer steps them: the token and position tables; per block its norms' weights (and
    biases), then each linear layer's weight shard and bias slice in forward order — in an MoE block
    the MoE layer's router, its experts' up and down (``moe_memory.layer_tensors``) and then its
    shared experts' up and down; the final norm's and the head's last (``local_param_tensors``'
    tensors, ordered)."""
    m = wl.model
    specs = {s.name: s for s in wl.linears()}
    norm = [m.hidden // shape.x] * (2 if m.arch == "gpt" else 1) if wl.norms else []

    def linear(name: str) -> list[int]:
        s = specs[name]
        shard = weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        return [shard] + ([s.local(shape)[1]] if s.bias else [])

    out: list[int] = []
    if wl.embedding:
        s = specs["embedding"]
        out.append((s.in_features // shape.y) * (s.out_features // shape.x))
        if m.arch == "gpt":
            out.append(m.seq_len * m.hidden // shape.x)
    for kind, count, shapes in kind_shapes(m):
        names = [name for name, *_ in shapes]
        block = norm * 2
        for name in names:
            if kind.moe and name == "mlp_up":  # the MoE layer: router, experts, then its shared experts
                block += list(moe_memory.layer_tensors(m, shape, wl.expert_layout))
            block += linear(name)
        if kind.moe and "mlp_up" not in names:
            block += list(moe_memory.layer_tensors(m, shape, wl.expert_layout))
        out += block * count
    out += norm
    if wl.head:
        out += linear("head")
    return out


def adam_step_temporaries(wl: Workload, shape: GridShape) -> int:
    """Elements of the temporaries a non-foreach Adam step holds at its peak, without ZeRO: stepping
    tensor i it makes sqrt(v_i) and its quotient by the bias correction (the denominator), n_i each,
    while the previous tensor's denominator, n_(i-1), is still bound to the loop's ``denom`` (torch's
    ``_single_tensor_adam``): max over i of n_(i-1) + 2·n_i in the order the optimizer steps the
    tensors (``step_order_tensors``) — an MoE layer's experts' up then down, each the rank's largest
    tensor where y splits the experts, hold three of it."""
    sizes = step_order_tensors(wl, shape)
    return max(prev + 2 * cur for prev, cur in zip([0, *sizes], sizes))


def optimizer_elements(wl: Workload, shape: GridShape, zero: int) -> int:
    """Parameter elements whose optimizer state lives on this rank: all of its own, or with ZeRO
    ⌈N/G_data⌉ of them — but the MoE experts' weights where their layout holds no replicas over
    data, which ZeRO leaves whole on the one rank that holds them (a data rank's part of an expert
    weight is all of it, docs/moe.md)."""
    n = local_param_count(wl, shape)
    if not zero:
        return n
    whole = moe_memory.experts_whole_under_zero(wl.expert_layout)
    experts = moe_memory.expert_elements(wl.model, shape, wl.expert_layout) if whole else 0
    return math.ceil((n - experts) / shape.data) + experts


@dataclasses.dataclass(frozen=True)
class Persistent:
    """What one rank holds the whole step (bytes), and the sizes behind it."""

    params: float
    grads: float
    optimizer: float
    n_params: int
    """parameter elements on the rank (``local_param_count``)"""
    p_bytes: int
    """bytes of one parameter element and of its gradient (``param_bytes``)"""
    sixteen: tuple[int, ...]
    """the weight shards ZeRO stores in 16 bits (``sixteen_bit_weights``)"""


def persistent(
    wl: Workload, shape: GridShape, zero: int, micro_batches: int, master_weights: bool | None = None
) -> Persistent:
    """Parameters, gradients and optimizer state of one rank (module docstring). Training in 16 bits
    the parameters are the fp32 master weights (axon4d.options.precision: the layers cast them for
    the GEMMs and E10) and their gradients are fp32; ZeRO's masters are views of them, but those of
    the Linear weights it stores in 16 bits (G_data > 1), which are fp32 parts. With ``zero`` ≥ 1 the
    optimizer state is that of ⌈N/G_data⌉ elements, and at ``zero`` = 2 with one micro-batch the
    gradients too (under accumulation the local sums of the whole shards are held to the last one).
    Made once per arguments (a search asks for each a hundred times; the result is frozen)."""
    return _persistent(wl, shape, zero, micro_batches, master_weights)


@functools.lru_cache(maxsize=4096)
def _persistent(
    wl: Workload, shape: GridShape, zero: int, micro_batches: int, master_weights: bool | None
) -> Persistent:
    """``persistent``, made."""
    elem = wl.element_size
    n_params = local_param_count(wl, shape)
    owned = optimizer_elements(wl, shape, zero)  # elements whose optimizer state is here
    p_bytes = param_bytes(wl, master_weights)
    sixteen = sixteen_bit_weights(wl, shape, zero, master_weights)
    n_sixteen, master_parts = sum(sixteen), sum(math.ceil(n / shape.data) for n in sixteen)
    params = (n_params - n_sixteen) * p_bytes + n_sixteen * elem + master_parts * 4
    grads = (owned if zero == 2 and micro_batches == 1 else n_params) * p_bytes
    if sixteen and not (zero == 2 and micro_batches == 1):  # the 16-bit weights' gradients: the masters' parts
        grads = (n_params - n_sixteen) * p_bytes + master_parts * 4
    return Persistent(params, grads, owned * OPTIMIZERS[wl.optimizer], n_params, p_bytes, tuple(sixteen))


def block_param_elements(wl: Workload, shape: GridShape) -> int:
    """Parameter elements of one block on one rank: its linear layers' weight shards and bias
    slices, its norms' weights (and biases) over x, an MoE layer's router and this rank's experts."""
    m = wl.model
    linears = sum(
        weight_shard_numel(s.in_features, s.out_features, shape, s.transpose) + (s.local(shape)[1] if s.bias else 0)
        for s in wl.linears()
        if not s.embedding and s.name != "head"
    )
    norms = (2 if m.arch == "gpt" else 1) * 2 * (m.hidden // shape.x) if wl.norms else 0
    return linears + norms + (sum(moe_memory.layer_tensors(m, shape, wl.expert_layout)) if m.moe else 0)


def embedding_elements(wl: Workload, shape: GridShape) -> int:
    """Elements of the embedding's tables on one rank (the token table, GPT's position table), whose
    gradients are the backward's last."""
    if not wl.embedding:
        return 0
    m = wl.model
    return (m.vocab_size // shape.y + (m.seq_len if m.arch == "gpt" else 0)) * (m.hidden // shape.x)
