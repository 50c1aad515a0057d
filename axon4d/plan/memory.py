"""Predicted memory per rank of one training step on one grid (docs/design.md §2, §5, §6).

Persistent: parameters (each layer's Z shard ⌈n_W/G_z⌉ = ``geometry.weight_shard_numel`` plus its
bias slice; norms and position embeddings split over x), gradients of the same size, and Adam
state (two fp32 moments, plus fp32 master weights when training in 16 bits).

Transient: the peak is found by walking the backward pass in order (``_backward_peak``): at its
start every activation saved under the recompute policy is live (plus the loss's temporaries);
then each layer's backward allocates its input gradient, the gathered weight block (E10, when
G_z > 1) and the dW block (computed into E11's zero-padded input, no copy), then issues E11: its
gradient shard and, over more than two ranks, the chunks the host's exchange receives
(axon4d.comm), held with the earlier layers' still-running reduce-scatters until the scheduler
waits on them; it frees what it had saved. The optimizer step adds its per-tensor temporaries.

Activations saved per block and rank (b tokens; ``block_saved``), as axon4d's blocks keep them
(measured with torch's memory tracker): each norm keeps three (b, H/G_x) tensors (its input or the
centred input, the normalised input, its output, which the next GEMM keeps), but LayerNorm with
G_x = 1, torch's fused kernel, two (its input and output: per-token statistics instead of x̂); attention keeps the
QKV output (as q, k, v), the rotated q and k (Llama), its output (b·H/G_y, which the output
projection keeps too) and the log-sum-exp (b·heads/G_y fp32); the MLP keeps the up output and the
activation output (SwiGLU: silu(gate) and the product). With context parallelism attention also
keeps the keys and values of its kv heads gathered over z for the whole sequences (b·G_z tokens;
docs/context.md); the rest is the same per token, and a rank holds b = B·S/(G_data·G_z) tokens
either way, so splitting a sequence over z lowers memory per rank like splitting the batch.
Recomputation (§5, axon4d.nn.recompute): "selective" drops the rotated q, k and the log-sum-exp (core attention re-runs from q, k, v);
"balanced" drops the norms' outputs and normalised inputs (a norm keeps its input, and LayerNorm
its centred input too) and the activation outputs, which the consuming GEMM re-makes in its
backward; "full" keeps only block inputs and rebuilds one block at a time. A workload without norms
(``norms=False``) describes the planner probe's blocks (axon4d.measure.probe): no norms, no rotary,
GELU.
"""

from __future__ import annotations

import dataclasses
import itertools

from axon4d.geometry import weight_shard_numel
from axon4d.plan.workload import OPTIMIZERS, Workload
from axon4d.policy import OverlapPolicy, check_recompute
from axon4d.shape import GridShape


def local_param_count(wl: Workload, shape: GridShape) -> int:
    """Parameter elements one rank holds: linear shards + bias slices + norms + position embedding."""
    m = wl.model
    n = 0
    for s in wl.linears():
        if s.embedding:  # (vocab/G_y, hidden/G_x), replicated over z and data
            n += (s.in_features // shape.y) * (s.out_features // shape.x)
            continue
        rows = s.local(shape)[1]
        n += s.count * (weight_shard_numel(s.in_features, s.out_features, shape, s.transpose) + (rows if s.bias else 0))
    if wl.norms:
        per_norm = (2 if m.arch == "gpt" else 1) * m.hidden // shape.x
        n += per_norm * (2 * m.n_layers + 1)
    if wl.embedding and m.arch == "gpt":
        n += m.seq_len * m.hidden // shape.x
    return n


@dataclasses.dataclass
class MemoryEstimate:
    """Predicted bytes per rank."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward, all blocks, at the start of backward
    buffers: float  # transient buffers at the peak (gathered weights, dW blocks, logits gradient)
    peak: float

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
    kept_per_norm = 1.0
    if real:
        if recompute in ("none", "selective"):  # torch's fused LayerNorm keeps no x̂
            kept_per_norm = 2.0 if wl.fused_norms(shape, recompute) else 3.0
        else:
            kept_per_norm = 1.0 if wl.model.arch == "llama" else 2.0
    rot = t["rot"] if real and recompute != "selective" else 0.0
    gated = real and wl.model.gated
    dropped_act = recompute == "balanced"
    return {
        "norm1": kept_per_norm * t["x0"],
        "attention": t["qkv"] + rot + t["att"] + t["kv_all"],
        "lse": 0.0 if recompute == "selective" else t["lse"],
        "norm2": kept_per_norm * t["x1"],
        "up": t["up"],
        "mid": t["act"] if gated and not dropped_act else 0.0,
        "act": 0.0 if dropped_act else t["act"],
    }


def block_activation_elements(wl: Workload, shape: GridShape, recompute: str = "none") -> tuple[float, float]:
    """(elements in the step's dtype, fp32 elements) one block saves for backward on one rank."""
    saved = block_saved(wl, shape, recompute)
    return sum(v for k, v in saved.items() if k != "lse"), saved["lse"]


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
) -> MemoryEstimate:
    """Predicted peak bytes per rank of one step of ``wl`` on ``shape`` (with ``wl.optimizer``'s states).

    ``staged_reduce_scatter``: whether a reduce-scatter over more than two ranks holds the chunks it
    receives, a buffer of its input's size, until waited on (the host's exchange under gloo; not
    NCCL: ``Machine.staged_reduce_scatter``)."""
    m, elem = wl.model, wl.element_size
    n_params = local_param_count(wl, shape)
    master = wl.dtype != "float32" if master_weights is None else master_weights
    params = grads = n_params * elem
    optimizer = n_params * (OPTIMIZERS[wl.optimizer] + (4 if master else 0))
    a16, a32 = block_activation_elements(wl, shape, recompute)
    acts = m.n_layers * (a16 * elem + a32 * 4)
    if overlap.oag_keep and shape.z > 1:  # every gathered block kept from forward to backward
        acts += (
            sum(
                s.count * weight_shard_numel(s.in_features, s.out_features, shape, s.transpose) * shape.z
                for s in wl.linears()
            )
            * elem
        )
    b = wl.local_tokens(shape)
    if wl.head:
        acts += b * (m.vocab_size // shape.y + m.hidden // shape.x) * elem  # logits, head input
    live_peak = _backward_peak(wl, shape, recompute, overlap, acts, staged_reduce_scatter)
    largest_shard = max(
        (s.in_features // shape.y) * (s.out_features // shape.x)
        if s.embedding
        else weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        for s in wl.linears()
    )
    # per-tensor temporaries of a non-foreach Adam; SGD updates in place
    optimizer_step = grads + (2 * largest_shard * 4 if wl.optimizer == "adam" else 0)
    peak = params + optimizer + max(live_peak, optimizer_step)
    return MemoryEstimate(params, grads, optimizer, acts, max(live_peak - acts, 0.0), peak)


def _backward_peak(
    wl: Workload, shape: GridShape, recompute: str, overlap: OverlapPolicy, acts: float, staged_reduce_scatter: bool
) -> float:
    """Largest live bytes (activations, gradients, buffers) during forward end and backward."""
    m, elem = wl.model, wl.element_size
    b = wl.local_tokens(shape)
    t = {k: v * elem for k, v in _block_tensors(wl, shape).items()}
    specs = {s.name: s for s in wl.linears()}
    live, peak = acts, acts

    def note(extra: float = 0.0) -> None:
        nonlocal peak
        peak = max(peak, live + extra)

    transient: dict[str, float] = {}
    order = ["head", "mlp_down", "mlp_up", "attn_out", "qkv"]  # backward order (blocks repeat)

    def block_bytes(name: str) -> float:
        s = specs.get(name)
        return (
            0.0 if s is None else weight_shard_numel(s.in_features, s.out_features, shape, s.transpose) * shape.z * elem
        )

    def blocks(first: list[str], repeated: list[str], n: int) -> float:
        """Bytes of the first ``n`` blocks of ``first`` followed by ``repeated`` over and over."""
        return sum(map(block_bytes, itertools.islice(itertools.chain(first, itertools.cycle(repeated)), n)))

    def prefetched(name: str) -> float:
        """OAG's prefetched blocks of the next ``oag_depth`` layers, alive during ``name``'s backward."""
        if not overlap.oag or shape.z == 1 or overlap.oag_keep:
            return 0.0
        return blocks(order[order.index(name) + 1 :], order[1:], overlap.oag_depth)  # blocks repeat

    # the newest reduce-scatters left running while a layer's backward runs: ORS leaves
    # ``ors_inflight``, ODP alone (an all-reduce over data) one
    inflight = overlap.ors_inflight if overlap.ors and shape.z > 1 else 1
    reduces = (overlap.ors and shape.z > 1) or (overlap.odp and shape.data > 1)
    # over more than two ranks the host's reduce-scatter receives every rank's chunk into a buffer
    # the input's size until it is waited on (axon4d.comm._ExchangedChunks) where the backend stages
    received = 1.0 if shape.z > 2 and staged_reduce_scatter else 0.0

    def reducing(name: str, first: bool) -> float:
        """Bytes the ``inflight`` newest reduce-scatters of layers whose backward ran before
        ``name``'s still hold (their gradient blocks, and the received chunks). In the first block
        after the head only the head's and this block's have run; in later blocks, the previous
        block's too."""
        if name == "head" or not reduces:
            return 0.0
        earlier = order[1 : order.index(name)][::-1]
        held = blocks(earlier + ["head"], [], inflight) if first else blocks(earlier, order[:0:-1], inflight)
        return held * (1 + received)

    issued: dict[str, float] = {}

    def linear_bwd(name: str, dx_elems: float) -> float:
        """Record one layer's backward transients; return the gradient bytes kept afterwards."""
        s = specs[name]
        shard = weight_shard_numel(s.in_features, s.out_features, shape, s.transpose)
        n_w = shard * shape.z
        gathered = n_w * elem if shape.z > 1 and not overlap.oag_keep else 0.0
        # the gathered block, dX, the dW block (computed into E11's padded input) and the prefetches
        transient[name] = gathered + dx_elems * elem + n_w * elem + prefetched(name)
        # once its own E11 is issued: the shard it fills and the chunks it receives
        issued[name] = (shard + received * n_w) * elem if shape.z > 1 else 0.0
        return (shard + (s.local(shape)[1] if s.bias else 0)) * elem

    def note_linear(name: str, first: bool = True, remade: float = 0.0) -> None:
        """``name``'s backward at its peak: its own reduce-scatter just issued, the earlier ones
        still running (the scheduler completes the older ones only after issuing the new one)."""
        note(transient[name] + issued[name] + reducing(name, first) + remade)

    def kept(name: str) -> float:
        """The weight block keep-for-backward held for ``name``: freed once its backward ran."""
        return block_bytes(name) if overlap.oag_keep and shape.z > 1 else 0.0

    if wl.head:
        logits = b * (m.vocab_size // shape.y) * 4
        # the loss's backward holds ~4 logit-sized fp32 temporaries at once (measured with the probe's
        # mean-square loss: the mean's expanded gradient, pow's self·2 and its product, the result)
        head_grad = linear_bwd("head", b * m.hidden // shape.x)
        # with G_z > 1 the head's forward-gathered block is still referenced then (measured on CPU/gloo)
        # (with keep-for-backward that block is the kept one, already counted in the activations)
        note(4 * logits + (block_bytes("head") if shape.z > 1 and not overlap.oag_keep else 0.0))
        note_linear("head")
        live += head_grad - b * (m.hidden // shape.x) * elem - kept("head")
        live -= logits
        live += b * (m.hidden // shape.x) * elem  # incoming gradient of the last block's output
    rebuilt = block_activation_elements(wl, shape, "none")
    balanced = recompute == "balanced"
    saved = {
        k: v * (4 if k == "lse" else elem)
        for k, v in block_saved(wl, shape, "none" if recompute == "full" else recompute).items()
    }
    mlp_down, mlp_up = linear_bwd("mlp_down", t["act"] / elem), linear_bwd("mlp_up", t["x1"] / elem)
    attn_out, qkv = linear_bwd("attn_out", t["att"] / elem), linear_bwd("qkv", t["x0"] / elem)

    def block(start: float, first: bool) -> float:
        """Walk one block's backward from ``start`` live bytes (``first``: the block right after
        the head); return the live bytes after it."""
        nonlocal live
        live = start
        if recompute == "full":  # rebuild this block's activations from its saved input
            live += rebuilt[0] * elem + rebuilt[1] * 4 - t["x0"]
        note()
        # dX (b, F/G_y), then the activation's backward, then MLP up; under balanced recomputation
        # each GEMM's backward first re-makes the input it did not keep (the activation, the norm output)
        note_linear("mlp_down", first, remade=t["act"] if balanced else 0.0)
        live += mlp_down + t["act"] - saved["act"] - kept("mlp_down")
        # the activation's backward: GELU's gradient, or SwiGLU's d(gate) and d(up) ((b, F/G_y)
        # each); balanced recomputation re-made the activation's output too
        note(t["act"] * ((2 if m.gated else 1) + (1 if balanced else 0)))
        note_linear("mlp_up", first, remade=t["x1"] if balanced else 0.0)
        # frees dX of MLP down, the up output, what the activation and the norm kept
        live += mlp_up - t["act"] - saved["mid"] - saved["up"] - saved["norm2"] - kept("mlp_up")
        note_linear("attn_out", first)  # then attention: dq, dk, dv and their assembled qkv gradient
        live += attn_out - kept("attn_out")
        note(t["att"] + 2 * t["qkv"])
        live -= saved["attention"] - t["qkv"] + saved["lse"]  # q, k, v are replaced by their gradient
        note_linear("qkv", first, remade=t["x0"] if balanced else 0.0)
        live += qkv - t["qkv"] - saved["norm1"] - kept("qkv")
        return live

    before_blocks = live
    after_one = block(before_blocks, True)
    # blocks are alike: the extremes are the ends
    block(before_blocks + (m.n_layers - 1) * (after_one - before_blocks), m.n_layers == 1)
    return peak
