"""What one block keeps for backward on one rank, by recomputation mode (docs/design.md §2, §5).

Activations saved per block and rank (b tokens; ``block_saved``), as axon4d's blocks keep them
(measured with torch's memory tracker): each norm keeps its input and the per-token fp32
statistics (b·2 for LayerNorm's mean and 1/std, b for RMSNorm's 1/rms), and its output, which the
next GEMM keeps — two (b, H/G_x) tensors where the norm is fused (axon4d's split norm, G_x > 1;
torch's LayerNorm kernel, G_x = 1), three for ``F.rms_norm``'s elementwise chain (RMSNorm with
G_x = 1: x̂ too); attention keeps the
QKV output (as q, k, v), the rotated q and k (Llama), its output (b·H/G_y, which the output
projection keeps too) and the log-sum-exp (b·heads/G_y fp32); the MLP keeps the up output and the
activation output (SwiGLU: silu(gate) and the product); an MoE block's MLP is its shared experts'
(none without them) and its MoE layer keeps ``axon4d.plan.moe_memory.saved`` ("moe"). With context parallelism attention also
keeps the keys and values of its kv heads gathered over z for the whole sequences (b·G_z tokens;
docs/context.md) — in the ring mode only a packed copy of its own (b tokens: O(chunk), not
O(sequence)); the rest is the same per token, and a rank holds b = B·S/(G_data·G_z) tokens
either way, so splitting a sequence over z lowers memory per rank like splitting the batch.
Recomputation (§5, axon4d.nn.recompute): "selective" drops the rotated q, k and the log-sum-exp (core attention re-runs from q, k, v);
"balanced" drops the norms' outputs (a norm keeps its input and its statistics) and the
activation outputs, which the consuming GEMM re-makes in its backward; "full" keeps only block
inputs — and an MoE layer's dispatched rows, which its re-run adopts instead of exchanging them
again (``moe_memory.kept_rows``) — and rebuilds one block at a time. A workload without norms (``norms=False``) describes the
planner probe's blocks (axon4d.measure.probe): no norms, no rotary, GELU, and a mean-square loss
on the logits instead of the cross-entropy.
"""

from __future__ import annotations

import functools

from axon4d.grid.shape import GridShape
from axon4d.options.recompute_mode import check_recompute
from axon4d.plan.blocks import mlp_width
from axon4d.plan.moe_memory import kept_rows
from axon4d.plan.moe_memory import saved as moe_saved
from axon4d.plan.workload import Workload


def saved_tensors(wl: Workload, shape: GridShape, recompute: str = "none") -> dict[str, list[tuple[float, int]]]:
    """The tensors one block keeps for backward on one rank under ``recompute``, as (elements, bytes
    per element) each, by the part of the backward that frees them (``block_saved``'s parts). Each
    is one storage, as activation offload moves them: q, k and v are views of the QKV output's,
    SwiGLU's gate and up of the up projection's."""
    check_recompute(recompute)
    t = block_tensors(wl, shape)
    elem = wl.element_size
    keys = ("attention", "lse", "norm2", "up", "mid", "act", "moe")
    empty: dict[str, list[tuple[float, int]]] = {k: [] for k in keys}
    if recompute == "full":  # the block's input, and its MoE layer's dispatched rows (``kept_rows``)
        m = wl.model
        kept = kept_rows(m, wl.local_tokens(shape), shape, elem, wl.imbalance, wl.expert_layout) if m.moe else (0, 0)
        return {"norm1": [(t["x0"], elem)], **empty, "moe": [kept] if kept[0] else []}
    real = wl.norms  # axon4d's blocks; without norms, the probe's (no rotary, GELU)

    def norm(x: float) -> list[tuple[float, int]]:
        """One norm's tensors: without recomputation the input and the output, which the next GEMM
        keeps — torch's norms (G_x = 1) widen the input first (``SplitFeatureNorm.whole``), so
        they keep an fp32 copy of it instead (the elementwise chain an fp32 x̂ too); balanced
        recomputation keeps the input alone (the output is re-made from the statistics); and the
        per-token fp32 statistics. The probe's blocks (no norms): the GEMM's input."""
        if not real:
            return [(x, elem)]
        kernel = wl.norm_kernel(shape, recompute)
        if recompute == "balanced":
            kept = [(x, elem)]
        else:
            kept = {"split": [(x, elem)], "torch": [(x, 4)], "chain": [(x, 4), (x, 4)]}[kernel] + [(x, elem)]
        return kept + [(wl.local_tokens(shape) * wl.norm_statistics(), 4)]

    rotated = real and wl.model.arch == "llama" and recompute != "selective" and wl.attention
    m = wl.model
    q_rot = t["rot"] * m.n_heads / (m.n_heads + m.kv_heads) if rotated else 0.0
    gated = real and m.gated
    dropped_act = recompute == "balanced"
    parts = {
        "norm1": norm(t["x0"]),
        "attention": [(t["qkv"], elem), (q_rot, elem), (t["rot"] - q_rot if rotated else 0.0, elem)]
        + [(t["att"], elem), (t["kv_all"], elem)],
        "lse": [] if recompute == "selective" else [(t["lse"], 4)],
        "norm2": norm(t["x1"]),
        "up": [(t["up"], elem)],
        "mid": [(t["act"], elem)] if gated and not dropped_act else [],
        "act": [] if dropped_act or not t["act"] else [(t["act"], elem)],
        "moe": moe_saved(m, wl.local_tokens(shape), shape, elem, wl.dtype != "float32", wl.imbalance, wl.expert_layout)
        if m.moe
        else [],
    }
    return {k: [(n, b) for n, b in v if n > 0] for k, v in parts.items()}


def block_saved(wl: Workload, shape: GridShape, recompute: str = "none") -> dict[str, float]:
    """Elements one block keeps for backward on one rank under ``recompute``, in the step's dtype
    (the log-sum-exp's in fp32), by the part of the backward that frees them: ``norm1`` (the
    attention's norm, or the QKV input), ``attention`` (q, k, v, rotated q and k, output; with
    context parallelism also the keys and values gathered over z), ``lse`` (fp32), ``norm2`` (the
    MLP's norm, or the up input), ``up`` (the up output), ``mid`` (SwiGLU's silu(gate)) and ``act``
    (the down input): ``saved_tensors`` summed, fp32 tensors counted in the step's elements."""
    return dict(_block_saved(wl, shape, recompute))


@functools.lru_cache(maxsize=4096)
def _block_saved(wl: Workload, shape: GridShape, recompute: str) -> tuple[tuple[str, float], ...]:
    """``block_saved``'s items, made once per (workload, grid, mode): a search asks them of each a
    hundred times."""
    elem = wl.element_size
    return tuple(
        (k, sum(n * (1 if k == "lse" else b / elem) for n, b in tensors))
        for k, tensors in saved_tensors(wl, shape, recompute).items()
    )


def block_storages(wl: Workload, shape: GridShape, recompute: str = "none") -> list[float]:
    """Bytes of each storage one block keeps for backward on one rank under ``recompute``
    (``saved_tensors``): what activation offload copies, one host buffer each. They sum to
    ``block_bytes``."""
    return [n * b for tensors in saved_tensors(wl, shape, recompute).values() for n, b in tensors]


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


def block_tensors(wl: Workload, shape: GridShape) -> dict[str, float]:
    """Elements of the tensors one block creates on one rank (b tokens)."""
    return dict(_block_tensors(wl, shape))


@functools.lru_cache(maxsize=4096)
def _block_tensors(wl: Workload, shape: GridShape) -> tuple[tuple[str, float], ...]:
    """``block_tensors``'s items, made once per (workload, grid)."""
    return tuple(_made_block_tensors(wl, shape).items())


def _made_block_tensors(wl: Workload, shape: GridShape) -> dict[str, float]:
    """``block_tensors``, made."""
    m = wl.model
    b = wl.local_tokens(shape)
    h_x, h_y = m.hidden // shape.x, m.hidden // shape.y
    qkv_y = (m.n_heads + 2 * m.kv_heads) * m.head_dim // shape.y
    up_y = (2 if m.gated else 1) * mlp_width(m) // shape.y
    att = wl.attention
    kv_own = wl.context_kv_elements(shape) if att else 0
    return {
        "x0": b * h_x,
        "qkv": b * qkv_y if att else 0,
        "rot": b * (m.n_heads + m.kv_heads) * m.head_dim // shape.y if att and m.arch == "llama" else 0,
        "att": b * h_y,
        "lse": b * (m.n_heads // shape.y) if att else 0,
        # context parallelism: the keys and values of this rank's kv heads attention keeps — the whole
        # sequences' gathered over z ("all-gather"), or the ring's packed copy of its own ("ring")
        "kv_all": kv_own * (1 if wl.context_mode == "ring" else wl.context_group(shape)),
        # what attention's backward holds besides: the gradients of the gathered keys and values
        # ("all-gather"), or the ring's arriving keys and values, the step's gradients and the
        # accumulator arriving ("ring": three of its own)
        "kv_grad": kv_own * (3 if wl.context_mode == "ring" else wl.context_group(shape)),
        "x1": b * h_x,
        "up": b * up_y,
        "act": b * (mlp_width(m) // shape.y),
    }
