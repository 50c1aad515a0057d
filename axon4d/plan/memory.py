"""Predicted memory per rank of one training step on one grid (docs/design.md §2, §5, §6).

Persistent: parameters (each layer's Z shard ⌈n_W/G_z⌉ = ``geometry.weight_shard_numel`` plus its
bias slice; norms and position embeddings split over x), gradients of the same size, and Adam
state (two fp32 moments). Training in 16 bits the parameters and their gradients are the fp32
master weights (``param_bytes``), cast for the GEMMs. ZeRO shards the moments and, at stage 2,
the gradients; training in 16 bits with G_data > 1 it also stores the 3D Linear weights in 16 bits
and shards their fp32 masters (``sixteen_bit_weights``): 2 + 4/G_data bytes per weight element, and
their gradients reach the step as the masters' parts (the other parameters' masters are views).

Transient: the peak is found by walking the backward pass in order (``BackwardWalk``): at its
start every activation saved under the recompute policy is live, with the logits (in the step's
dtype) and what the final norm keeps; the loss's backward adds the logits' gradient (same dtype)
and at most two fp32 row chunks of ``CE_CHUNK_BYTES`` (axon4d.nn.loss; none for fp32 logits), the
final norm's backward its temporaries (``NORM_BACKWARD_TEMPORARIES``); then each layer's backward
allocates its input gradient, the gathered weight block (E10, when G_z > 1) and the dW block
(computed into E11's zero-padded input, no copy), then issues E11: its gradient shard and, over
more than two ranks, the chunks the host's exchange receives (axon4d.comm), held with the earlier
layers' still-running reduce-scatters until the scheduler waits on them; it frees what it had
saved. The optimizer step adds its per-tensor temporaries.

Activations saved per block and rank (b tokens; ``block_saved``), as axon4d's blocks keep them
(measured with torch's memory tracker): each norm keeps its input and the per-token fp32
statistics (b·2 for LayerNorm's mean and 1/std, b for RMSNorm's 1/rms), and its output, which the
next GEMM keeps — two (b, H/G_x) tensors where the norm is fused (axon4d's split norm, G_x > 1;
torch's LayerNorm kernel, G_x = 1), three for ``F.rms_norm``'s elementwise chain (RMSNorm with
G_x = 1: x̂ too); attention keeps the
QKV output (as q, k, v), the rotated q and k (Llama), its output (b·H/G_y, which the output
projection keeps too) and the log-sum-exp (b·heads/G_y fp32); the MLP keeps the up output and the
activation output (SwiGLU: silu(gate) and the product). With context parallelism attention also
keeps the keys and values of its kv heads gathered over z for the whole sequences (b·G_z tokens;
docs/context.md); the rest is the same per token, and a rank holds b = B·S/(G_data·G_z) tokens
either way, so splitting a sequence over z lowers memory per rank like splitting the batch.
Recomputation (§5, axon4d.nn.recompute): "selective" drops the rotated q, k and the log-sum-exp (core attention re-runs from q, k, v);
"balanced" drops the norms' outputs (a norm keeps its input and its statistics) and the
activation outputs, which the consuming GEMM re-makes in its backward; "full" keeps only block
inputs and rebuilds one block at a time. A workload without norms (``norms=False``) describes the
planner probe's blocks (axon4d.measure.probe): no norms, no rotary, GELU, and a mean-square loss
on the logits instead of the cross-entropy.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from axon4d.geometry import weight_shard_numel
from axon4d.overlap_policy import OverlapPolicy
from axon4d.plan.workload import OPTIMIZERS, Workload
from axon4d.recompute_mode import check_recompute
from axon4d.shape import GridShape


def param_bytes(wl: Workload, master_weights: bool | None = None) -> int:
    """Bytes of one parameter element, and of its gradient: 4 when training in 16 bits with fp32
    master weights (the library's parameters are those masters, ``axon4d.precision``; the default
    for a 16-bit ``wl``), else the workload's element size."""
    master = wl.dtype != "float32" if master_weights is None else master_weights
    return 4 if master else wl.element_size


def sixteen_bit_weights(wl: Workload, shape: GridShape, zero: int, master_weights: bool | None = None) -> list[int]:
    """Elements of each weight shard ZeRO stores in 16 bits with its fp32 master sharded over data
    (``axon4d.zero.sixteen_bit``: the 3D Linear weights, not the token table), training in 16 bits
    with fp32 masters, ``zero`` ≥ 1 and G_data > 1; else none."""
    if not zero or shape.data == 1 or param_bytes(wl, master_weights) == wl.element_size:
        return []
    return [
        weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        for s in wl.linears()
        if not s.embedding
        for _ in range(s.count)
    ]


def local_param_count(wl: Workload, shape: GridShape) -> int:
    """Parameter elements one rank holds: linear shards + bias slices + norms + position embedding."""
    return sum(local_param_tensors(wl, shape))


def local_param_tensors(wl: Workload, shape: GridShape) -> list[int]:
    """Elements of each parameter tensor one rank holds: per linear layer its weight shard and bias
    slice, the token table (vocab/G_y, hidden/G_x), each norm's weight (and bias) over x, the
    position table."""
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
    return out


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

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def block_saved(wl: Workload, shape: GridShape, recompute: str = "none") -> dict[str, float]:
    """Elements one block keeps for backward on one rank under ``recompute``, by the part of the
    backward that frees them: ``norm1`` (the attention's norm, or the QKV input), ``attention``
    (q, k, v, rotated q and k, output; with context parallelism also the keys and values gathered
    over z), ``lse`` (fp32), ``norm2`` (the MLP's norm, or the up
    input), ``up`` (the up output), ``mid`` (SwiGLU's silu(gate)) and ``act`` (the down input)."""
    check_recompute(recompute)
    t = _block_tensors(wl, shape)
    if recompute == "full":
        return {"norm1": t["x0"], "attention": 0.0, "lse": 0.0, "norm2": 0.0, "up": 0.0, "mid": 0.0, "act": 0.0}
    real = wl.norms  # axon4d's blocks; without norms, the probe's (no rotary, GELU)
    kept_per_norm, stats = 1.0, 0.0
    if real:
        # the norm's input, and its output, which the next GEMM keeps; the elementwise chain also
        # x̂; balanced recomputation keeps the input alone (the output is re-made from the statistics).
        # torch's norms (G_x = 1) widen the input first (``SplitFeatureNorm.whole``): training in 16
        # bits they keep an fp32 copy of it (and the chain an fp32 x̂), as ``final_norm_saved`` counts
        if recompute in ("none", "selective"):
            wide = 4 / wl.element_size  # an fp32 tensor, in elements of the step's dtype
            kept_per_norm = {"split": 2.0, "torch": wide + 1.0, "chain": 2 * wide + 1.0}[
                wl.norm_kernel(shape, recompute)
            ]
        # the per-token fp32 statistics, counted in elements of the step's dtype
        stats = wl.local_tokens(shape) * wl.norm_statistics() * 4 / wl.element_size
    rot = t["rot"] if real and recompute != "selective" else 0.0
    gated = real and wl.model.gated
    dropped_act = recompute == "balanced"
    return {
        "norm1": kept_per_norm * t["x0"] + stats,
        "attention": t["qkv"] + rot + t["att"] + t["kv_all"],
        "lse": 0.0 if recompute == "selective" else t["lse"],
        "norm2": kept_per_norm * t["x1"] + stats,
        "up": t["up"],
        "mid": t["act"] if gated and not dropped_act else 0.0,
        "act": 0.0 if dropped_act else t["act"],
    }


#: fp32 (b, hidden/G_x) temporaries a norm's backward holds at its peak, its input gradient included,
#: by ``Workload.norm_kernel`` (measured with torch's MemTracker: torch's fused LayerNorm makes only
#: dx; axon4d's split norm x̂, ĝ and one product; ``F.rms_norm``'s chain about four)
NORM_BACKWARD_TEMPORARIES = {"torch": 1, "split": 3, "chain": 4, "none": 0}


def final_norm_saved(wl: Workload, shape: GridShape) -> float:
    """Bytes the norm before the head keeps for backward beyond its output (the head's input, counted
    with the head): its input — in the step's dtype for the split norm, an fp32 copy for torch's
    norms (``whole`` widens it first), with x̂ too for ``F.rms_norm``'s chain — and the per-token
    fp32 statistics."""
    kind = wl.norm_kernel(shape)
    if kind == "none" or not wl.head:
        return 0.0
    b = wl.local_tokens(shape)
    u = b * (wl.model.hidden // shape.x)
    x = u * wl.element_size if kind == "split" else u * 4 * (2 if kind == "chain" else 1)
    return x + b * wl.norm_statistics() * 4


def block_activation_elements(wl: Workload, shape: GridShape, recompute: str = "none") -> tuple[float, float]:
    """(elements in the step's dtype, fp32 elements) one block saves for backward on one rank."""
    saved = block_saved(wl, shape, recompute)
    return sum(v for k, v in saved.items() if k != "lse"), saved["lse"]


def block_bytes(wl: Workload, shape: GridShape, recompute: str = "none") -> float:
    """Bytes one block keeps for backward on one rank under ``recompute`` (what offload moves)."""
    a16, a32 = block_activation_elements(wl, shape, recompute)
    return a16 * wl.element_size + a32 * 4


def _block_tensors(wl: Workload, shape: GridShape) -> dict[str, float]:
    """Elements of the tensors one block creates on one rank (b tokens)."""
    m = wl.model
    b = wl.local_tokens(shape)
    h_x, h_y = m.hidden // shape.x, m.hidden // shape.y
    qkv_y = (m.n_heads + 2 * m.kv_heads) * m.head_dim // shape.y
    up_y = (2 if m.gated else 1) * m.ffn // shape.y
    att = wl.attention
    return {
        "x0": b * h_x,
        "qkv": b * qkv_y if att else 0,
        "rot": b * (m.n_heads + m.kv_heads) * m.head_dim // shape.y if att and m.arch == "llama" else 0,
        "att": b * h_y,
        "lse": b * (m.n_heads // shape.y) if att else 0,
        # context parallelism: the whole sequences' keys and values of this rank's kv heads, gathered over z
        "kv_all": b * shape.z * 2 * (m.kv_heads // shape.y) * m.head_dim if att and wl.context_parallel else 0,
        "x1": b * h_x,
        "up": b * up_y,
        "act": b * (m.ffn // shape.y),
    }


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
) -> MemoryEstimate:
    """Predicted peak bytes per rank of one step of ``wl`` on ``shape`` (with ``wl.optimizer``'s states).

    ``staged_reduce_scatter``: whether a reduce-scatter over more than two ranks holds the chunks it
    receives, a buffer of its input's size, until waited on (the host's exchange under gloo; not
    NCCL: ``Machine.staged_reduce_scatter``). ``widened_gemms``: the dW GEMMs of 16-bit inputs into
    fp32 sums widen their inputs first (the host; an accelerator's GEMM writes fp32 itself).

    The step's options (``axon4d.plan.scenario``): with ``micro_batches`` k the activations are one
    micro-batch's (batch/k sequences), and under keep-for-backward the held backward passes keep the
    weight blocks they carry to the next micro-batch to their end (``BackwardWalk.released``); with ``zero`` ≥ 1 the optimizer state is that of ⌈N/G_data⌉
    elements of the rank's N, and with ``zero`` = 2 at k = 1 the gradients too (under
    accumulation the local sums of the whole shards are held to the last micro-batch, so the
    gradients stay whole; in the backward the shards stay whole until their reduce-scatters over
    data are waited at its end); with ``offload`` n the saved activations of the first n blocks leave the
    device — the backward starts with the other L − n blocks' and, from the last of those on, two are
    on the device at a time (the block running, the one fetched back ahead of it): max(L − n,
    min(L, 2)) blocks' worth — and take n blocks' worth of host memory (``MemoryEstimate.host``)."""
    m, elem = wl.model, wl.element_size
    if micro_batches > 1:
        wl = dataclasses.replace(wl, batch=wl.batch // micro_batches)
    n_params = local_param_count(wl, shape)
    owned = math.ceil(n_params / shape.data) if zero else n_params  # elements whose optimizer state is here
    # training in 16 bits, the parameters are the fp32 master weights (axon4d.precision: the layers
    # cast them for the GEMMs and E10) and their gradients are fp32; ZeRO's masters are views of them,
    # but those of the Linear weights it stores in 16 bits (G_data > 1), which are fp32 parts
    p_bytes = param_bytes(wl, master_weights)
    sixteen = sixteen_bit_weights(wl, shape, zero, master_weights)
    n_sixteen, master_parts = sum(sixteen), sum(math.ceil(n / shape.data) for n in sixteen)
    params = (n_params - n_sixteen) * p_bytes + n_sixteen * elem + master_parts * 4
    grads = (owned if zero == 2 and micro_batches == 1 else n_params) * p_bytes
    if sixteen and not (zero == 2 and micro_batches == 1):  # the 16-bit weights' gradients: the masters' parts
        grads = (n_params - n_sixteen) * p_bytes + master_parts * 4
    optimizer = owned * OPTIMIZERS[wl.optimizer]
    per_block = block_bytes(wl, shape, recompute)
    # offloaded: the first ``offload`` blocks (axon4d.offload), whose backward comes last: the backward
    # starts with the others' activations
    acts = (m.n_layers - offload) * per_block
    kept = 0.0
    if overlap.oag_keep and shape.z > 1:
        # every block gathered in forward kept for backward: the embedding gathers none, and under full
        # recomputation a block's layers keep theirs only from its re-run on (``BackwardWalk.rebuild``)
        kept = (
            sum(
                s.count * weight_shard_numel(s.in_features, s.out_features, shape, s.transpose) * shape.z
                for s in wl.linears()
                if not s.embedding and not (recompute == "full" and s.name in BACKWARD_ORDER[1:])
            )
            * elem
        )
    edge = 0.0
    b = wl.local_tokens(shape)
    if wl.head:
        edge += b * (m.vocab_size // shape.y + m.hidden // shape.x) * elem  # logits, head input
        edge += final_norm_saved(wl, shape)
    acts += kept + edge
    # under accumulation the earlier micro-batches' gradient sums are live through the whole backward
    # and each layer's new gradient is added into them; ZeRO-2 (k = 1) keeps 1/G_data of each
    held = n_params * p_bytes if micro_batches > 1 else 0.0
    # ZeRO-2: E12 is a reduce-scatter over data; ODP waits for every bucket at the end of the backward
    # (Scheduler.finish_gradients), so each shard stays whole until then, with the chunks a staged
    # reduce-scatter over more than two ranks receives; only the step after it holds the parts
    staged = 1.0 if zero == 2 and shape.data > 2 and staged_reduce_scatter else 0.0
    share = 0.0 if micro_batches > 1 else 1.0 + staged
    held *= 1.0 + staged
    carried = micro_batches > 1  # the held backward passes carry kept blocks over (``BackwardWalk.released``)
    cast = p_bytes != elem and not sixteen  # fp32 masters, cast per use (not the 16-bit weights ZeRO stores)
    # the walk of this step from a given start (live bytes, gradient share)
    walk = functools.partial(
        BackwardWalk,
        wl,
        shape,
        recompute,
        overlap,
        staged_reduce_scatter,
        grad_bytes=p_bytes,
        fp8_gather=fp8_gather,
        carried=carried,
        cast_weights=cast,
        widened_gemms=widened_gemms,
    )
    live_peak = walk(acts + held, share).run()
    if offload:
        # from the last block kept on the device on, two blocks are there at a time (the block running,
        # the one fetched back ahead of it), with the gradients of the blocks above and the head
        above = (m.n_layers - offload) / m.n_layers * n_params * p_bytes * share
        two = min(m.n_layers, 2) * per_block + kept
        live_peak = max(live_peak, walk(two + held + above, share).one_block())
    largest_shard = max(
        (s.in_features // shape.y) * (s.out_features // shape.x)
        if s.embedding
        else weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        for s in wl.linears()
    )
    gathers = 0.0
    if zero and shape.data > 1:
        # ZeRO's all-gathers of the updated parameters: two buckets at a time (one unpacked while the
        # next is in flight), each its parts sent and every rank's received (the grid's bucket_mb;
        # 0: one parameter per bucket, the largest bounding it)
        bucket = max(largest_shard * (elem if sixteen else p_bytes), overlap.bucket_mb * 2**20)
        gathers = 2 * bucket * (1 + 1 / shape.data)
        largest_shard = math.ceil(largest_shard / shape.data)
    # per-tensor temporaries of a non-foreach Adam; SGD updates in place
    optimizer_step = grads + gathers + (2 * largest_shard * 4 if wl.optimizer == "adam" else 0)
    peak = params + optimizer + max(live_peak, optimizer_step)
    return MemoryEstimate(params, grads, optimizer, acts, max(live_peak - acts, 0.0), peak, offload * per_block)


#: fp32 bytes of one row chunk of the vocabulary-parallel loss (``axon4d.nn.loss.CHUNK_BYTES``: the
#: planner may not import the layers; tests/test_plan.py checks the two agree)
CE_CHUNK_BYTES = 32 * 2**20

#: the linear layer kinds in the order their backward runs (the block's four repeat n_layers times)
BACKWARD_ORDER = ("head", "mlp_down", "mlp_up", "attn_out", "qkv")


class BackwardWalk:
    """Live bytes on one rank from the end of the forward through the backward pass, event by event
    as the scheduler allocates and frees them; ``peak`` is the most seen. ``run`` walks the loss and
    the head, the first block after it and the last block (blocks are alike: the extremes are the
    ends; the blocks between add what the first one left).

    What is live when (bytes on one rank; b tokens; a weight block is n_W = shard·G_z elements,
    ``block``): "+" stays live after the event, "−" is freed by it, "~" is live only while it runs.

    ===========================  ======================================================================
    event (method)               live
    ===========================  ======================================================================
    start                        + every saved activation, the logits, the head's input and what the
                                 final norm keeps (``acts``; ``final_norm_saved``)
    loss backward (``head``)     ~ the logits' gradient (their dtype) and ≤ 2 fp32 row chunks, the head's
                                 gathered block (the probe's mean-square loss: ~4 fp32 logit-sized
                                 temporaries); − the logits
    final norm's backward        ~ its temporaries, after the head's backward; − what it saved
    a layer's backward           ~ the block gathered over z (E10b, ``gathered``; none with keep)
    (``layer``)                  ~ dX and the dW block (computed into E11's padded input, ``dw``)
                                 ~ OAG's blocks of the next ``oag_depth`` layers (``prefetched``)
                                 ~ its own E11, issued: the shard and received chunks (``issued``)
                                 ~ the newest earlier E11s still running — ``ors_inflight`` under
                                 ORS, one under ODP alone — with their received chunks (``in_flight``)
                                 ~ the input balanced recomputation re-makes
    its E11 waited on (``done``) + its gradient shard and bias slice (``grad``); − the block kept for
                                 it (``kept``; not in a held backward that carries it, ``released``);
                                 − the saved tensors and gradient its backward consumed
    activation's, attention's    ~ their gradients (GELU: one (b, F/G_y), SwiGLU: two; attention: dq,
    backward (``note``)          dk, dv and the assembled qkv gradient)
    ``free``                     − saved tensors consumed
    ``rebuild`` (full)           + the block's activations, re-made from its saved input, and the
                                 blocks its re-run keeps (keep-for-backward)
    ===========================  ======================================================================

    In one block, in backward order: MLP down (its dX stays as the activation's incoming gradient;
    frees the saved activation output), the activation's backward, MLP up (frees that gradient, the
    up output, SwiGLU's silu(gate) and the norm's tensors), attention output, attention's backward
    (q, k, v, rotated q, k and the LSE replaced by the qkv gradient), QKV (frees that gradient and
    the first norm's tensors).
    """

    def __init__(
        self,
        wl: Workload,
        shape: GridShape,
        recompute: str,
        overlap: OverlapPolicy,
        staged_reduce_scatter: bool,
        acts: float,
        grad_share: float = 1.0,
        grad_bytes: int | None = None,
        fp8_gather: bool = False,
        carried: bool = False,
        cast_weights: bool = False,
        widened_gemms: bool = False,
    ) -> None:
        self.wl, self.shape, self.recompute, self.overlap = wl, shape, recompute, overlap
        self.carried = carried  # a held backward under accumulation: kept blocks stay for the next micro-batch
        # fp32 master weights cast to the 16-bit compute dtype at each use: with G_z = 1 there is no
        # gather, but a layer's block (and OAG's next ones) is still a cast copy of its weight
        self.cast = cast_weights
        self.grad_share = grad_share  # a layer's gradient bytes live after its backward, per gradient byte
        self.grad_bytes = wl.element_size if grad_bytes is None else grad_bytes  # per gradient element
        self.fp8 = fp8_gather and shape.z > 1  # a gathered block arrives as bytes, restored beside them
        self.elem = wl.element_size
        # the host's dW GEMM of 16-bit inputs into fp32 sums widens both first (axon4d.device.mm_widening)
        self.widened = widened_gemms and self.elem != self.grad_bytes
        self.specs = {s.name: s for s in wl.linears()}
        self.t = {k: v * self.elem for k, v in _block_tensors(wl, shape).items()}  # one block's tensors, bytes
        saved = block_saved(wl, shape, "none" if recompute == "full" else recompute)
        self.saved = {k: v * (4 if k == "lse" else self.elem) for k, v in saved.items()}  # what a block keeps
        self.rebuilt = block_activation_elements(wl, shape, "none")  # (16-bit, fp32) a rebuilt block keeps
        self.live = self.peak = acts
        z = shape.z
        self.keep = overlap.oag_keep and z > 1  # every block gathered in forward is kept for backward
        self.inflight = overlap.ors_inflight if overlap.ors and z > 1 else 1
        self.reduces = (overlap.ors and z > 1) or (overlap.odp and shape.data > 1)
        # over more than two ranks the host's reduce-scatter receives every rank's chunk into a buffer
        # the input's size until it is waited on (axon4d.comm._ExchangedChunks) where the backend stages
        self.received = 1.0 if z > 2 and staged_reduce_scatter else 0.0

    # -- sizes, bytes -----------------------------------------------------------------------------------
    def shard(self, name: str) -> int:
        """Elements of ``name``'s weight shard on this rank (⌈n_W/G_z⌉)."""
        s = self.specs[name]
        return weight_shard_numel(s.in_features, s.out_features, self.shape, s.transpose)

    def block(self, name: str) -> float:
        """``name``'s whole weight block, n_W (0 for a layer kind the step lacks)."""
        return 0.0 if name not in self.specs else self.shard(name) * self.shape.z * self.elem

    def blocks(self, first: list[str], repeated: list[str] | tuple[str, ...], n: int) -> float:
        """The first ``n`` blocks of ``first`` followed by ``repeated`` over and over."""
        return sum(map(self.block, itertools.islice(itertools.chain(first, itertools.cycle(repeated)), n)))

    def gathered(self, name: str) -> float:
        """The block gathered over z for ``name``'s backward (E10b; none with keep-for-backward)."""
        if self.overlap.oag_keep or (self.shape.z == 1 and not self.cast):
            return 0.0
        return self.block(name) * (1 + 1 / self.elem if self.fp8 else 1)

    def dw(self, name: str) -> float:
        """The dW block, computed straight into E11's zero-padded input, in the gradients' dtype
        (fp32 sums when training in 16 bits: ``grad_bytes``)."""
        return self.block(name) / self.elem * self.grad_bytes

    def prefetched(self, name: str) -> float:
        """OAG's prefetched blocks of the next ``oag_depth`` layers, alive during ``name``'s backward."""
        if not self.overlap.oag or self.overlap.oag_keep or (self.shape.z == 1 and not self.cast):
            return 0.0
        if self.shape.world_size == 1:  # one rank computes without the scheduler: nothing prefetched
            return 0.0
        after = list(BACKWARD_ORDER[BACKWARD_ORDER.index(name) + 1 :])
        return self.blocks(after, BACKWARD_ORDER[1:], self.overlap.oag_depth)  # blocks repeat

    def issued(self, name: str) -> float:
        """Once ``name``'s own E11 is issued: the shard it fills and the chunks it receives."""
        shard = self.shard(name)
        return (shard + self.received * shard * self.shape.z) * self.grad_bytes if self.shape.z > 1 else 0.0

    def in_flight(self, name: str, first: bool) -> float:
        """What the ``inflight`` newest reduce-scatters of layers whose backward ran before ``name``'s
        still hold (their gradient blocks, and the received chunks). In the first block after the
        head only the head's and this block's have run; in later blocks, the previous block's too."""
        if name == "head" or not self.reduces or self.shape.z == 1:
            # without z there is no E11: E12 reduces the gradient shard itself, counted by ``grad``
            return 0.0
        earlier = list(BACKWARD_ORDER[1 : BACKWARD_ORDER.index(name)][::-1])
        first_names, repeated = (earlier + ["head"], []) if first else (earlier, list(BACKWARD_ORDER[:0:-1]))
        blocks = self.blocks(first_names, repeated, self.inflight) / self.elem * self.grad_bytes  # gradient blocks
        return blocks * (1 + self.received)

    def grad(self, name: str) -> float:
        """The gradient ``name`` keeps once its E11 is waited on: its shard, and its bias's slice."""
        s = self.specs[name]
        bias = s.local(self.shape)[1] if s.bias else 0  # all-reduced over batch, never staged
        return (self.grad_share * self.shard(name) + min(self.grad_share, 1.0) * bias) * self.grad_bytes

    def widening(self, name: str) -> float:
        """The fp32 copies of dY and X the host's dW GEMM makes of 16-bit inputs (``widened``)."""
        if not self.widened:
            return 0.0
        in_l, out_l = self.specs[name].local(self.shape)
        return self.wl.local_tokens(self.shape) * (in_l + out_l) * 4

    def kept(self, name: str) -> float:
        """The weight block keep-for-backward held for ``name``: freed once its backward ran."""
        return self.block(name) if self.keep else 0.0

    def released(self, name: str) -> float:
        """The kept block ``name``'s backward frees: none in a held backward (``carried``) where the
        block is carried to the next micro-batch — every layer's but a block's under full
        recomputation, which its next forward gathers again (``axon4d.plan.layers.carried``)."""
        if self.carried and (name == "head" or self.recompute != "full"):
            return 0.0
        return self.kept(name)

    # -- events -----------------------------------------------------------------------------------------
    def note(self, extra: float = 0.0) -> None:
        """A moment at which ``extra`` bytes are live beside ``live``."""
        self.peak = max(self.peak, self.live + extra)

    def layer(self, name: str, dx: float, first: bool = True, remade: float = 0.0) -> None:
        """``name``'s backward at its peak (``dx``: its input gradient's bytes; ``remade``: the input
        balanced recomputation re-makes): its own reduce-scatter just issued, the earlier ones still
        running (the scheduler completes the older ones only after issuing the new one)."""
        held = self.gathered(name) + dx + self.dw(name) + self.prefetched(name) + self.widening(name)
        self.note(held + self.issued(name) + self.in_flight(name, first) + remade)

    def done(self, name: str, freed: float = 0.0, held: float = 0.0) -> None:
        """``name``'s backward over: its gradient kept, its kept block freed, ``freed`` bytes freed
        and ``held`` bytes (a gradient the next op consumes) still live."""
        self.live += self.grad(name) + held - freed - self.released(name)

    def free(self, nbytes: float) -> None:
        """Saved tensors a backward consumed, freed."""
        self.live -= nbytes

    def rebuild(self) -> None:
        """Full recomputation: this block's activations re-made from its saved input, with the blocks
        its re-run gathers and keeps for backward."""
        kept = sum(map(self.kept, BACKWARD_ORDER[1:]))
        self.live += self.rebuilt[0] * self.elem + self.rebuilt[1] * 4 - self.t["x0"] + kept

    # -- the walk ---------------------------------------------------------------------------------------
    def head(self) -> None:
        """The loss's backward, then the head's; the head's input is freed and its dX, the same size,
        is the incoming gradient of the last block's output."""
        m, shape, b = self.wl.model, self.shape, self.wl.local_tokens(self.shape)
        n_v = b * (m.vocab_size // shape.y)  # this rank's logits, (b, vocab/G_y)
        x_in = b * (m.hidden // shape.x) * self.elem
        # with G_z > 1 the head's forward-gathered block is still referenced during the loss's backward
        # (measured on CPU/gloo; with keep-for-backward it is the kept one, counted in the activations)
        if not self.wl.norms:
            # the probe's mean-square loss holds ~4 logit-sized fp32 temporaries at once (measured: the
            # mean's expanded gradient, pow's self·2 and its product, the result); they go with the logits
            self.note(4 * n_v * 4 + self.gathered("head"))
            self.layer("head", x_in)
            self.done("head", freed=x_in + n_v * 4, held=x_in)
            return
        # axon4d's vocabulary-parallel cross-entropy (axon4d.nn.loss): the logits' gradient in their
        # dtype, made one row chunk at a time through at most two fp32 chunks (none for fp32 logits,
        # computed in place); then the saved logits are freed and the gradient is the head's dY
        dlogits = n_v * self.elem
        chunks = 0 if self.wl.dtype == "float32" else 2 * min(n_v * 4, CE_CHUNK_BYTES)
        self.note(dlogits + chunks + self.gathered("head"))
        self.live += dlogits - n_v * self.elem
        self.layer("head", x_in)
        self.done("head", freed=x_in + dlogits, held=x_in)
        # the final norm's backward, its input gradient (the head's dX) live: its temporaries, then
        # what it saved is freed
        kind = self.wl.norm_kernel(shape)
        self.note(NORM_BACKWARD_TEMPORARIES[kind] * b * (m.hidden // shape.x) * 4)
        self.free(final_norm_saved(self.wl, shape))

    def block_backward(self, first: bool) -> None:
        """One block's backward (``first``: the block right after the head)."""
        t, s, balanced = self.t, self.saved, self.recompute == "balanced"
        if self.recompute == "full":
            self.rebuild()
        self.note()
        # dX (b, F/G_y), then the activation's backward, then MLP up; under balanced recomputation
        # each GEMM's backward first re-makes the input it did not keep (the activation, the norm output)
        self.layer("mlp_down", t["act"], first, remade=t["act"] if balanced else 0.0)
        self.done("mlp_down", freed=s["act"], held=t["act"])
        # the activation's backward: GELU's gradient, or SwiGLU's d(gate) and d(up) ((b, F/G_y)
        # each); under balanced recomputation SwiGLU's product needs silu(gate) re-made (GELU's
        # backward needs only its input, which the up projection's output is)
        gated = self.wl.model.gated
        self.note(t["act"] * ((2 if gated else 1) + (1 if balanced and gated else 0)))
        self.layer("mlp_up", t["x1"], first, remade=t["x1"] if balanced else 0.0)
        # frees dX of MLP down, the up output, what the activation and the norm kept
        self.done("mlp_up", freed=t["act"] + s["mid"] + s["up"] + s["norm2"])
        self.layer("attn_out", t["att"], first)  # then attention: dq, dk, dv and their assembled qkv gradient
        self.done("attn_out")
        self.note(t["att"] + 2 * t["qkv"])
        self.free(s["attention"] - t["qkv"] + s["lse"])  # q, k, v are replaced by their gradient
        self.layer("qkv", t["x0"], first, remade=t["x0"] if balanced else 0.0)
        self.done("qkv", freed=t["qkv"] + s["norm1"])

    def one_block(self) -> float:
        """The peak live bytes of one block's backward in the middle of the pass, from what is live now."""
        self.block_backward(first=False)
        return self.peak

    def run(self) -> float:
        """The peak live bytes of the step's backward."""
        if self.wl.head:
            self.head()
        start = self.live
        self.block_backward(first=True)
        n = self.wl.model.n_layers
        self.live = start + (n - 1) * (self.live - start)
        self.block_backward(first=n == 1)
        return self.peak
