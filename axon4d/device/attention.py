"""Attention with its log-sum-exp on each device's fused kernel: the kernels context parallelism
computes its parts with and merges (axon4d.nn.context; docs/context.md). Part of the device seam
(``axon4d.device``): the only other place in the library that names a device type.

q (b, hq, Lq, d), k and v (b, hkv, Lk, d) with hq = groups·hkv (grouped-query attention read from
the shapes; query heads kv-major: heads j·groups … (j+1)·groups−1 share key/value head j), no
dropout, scale 1/√d; ``causal`` needs Lq = Lk (the square's lower triangle). One function,
``kernel_for``, picks the kernel (``choose_kernel`` is its rule):

========== ======================================================== ===========================
kernel      where                                                    grouped-query heads
========== ======================================================== ===========================
"flash"     CUDA/ROCm, fp16/bf16, head_dim a multiple of 8 and ≤ 256  native (causal parts)
            on hardware torch's flash kernel runs on
            (``torch.backends.cuda.can_use_flash_attention``; off
            when the user disables flash SDPA)
"efficient" CUDA/ROCm otherwise (fp32 too), head_dim a multiple of 8  repeated (causal parts)
"host"      the host: torch's CPU flash kernel                        repeated (causal parts)
"math"      any other device or head_dim: fp32 matmuls                repeated (causal parts)
========== ======================================================== ===========================

Grouped-query heads never copy keys or values for an unmasked (``causal=False``) part, on any
kernel: its rows are independent, so the ``groups`` query heads sharing key/value head j attend as
one query sequence of groups·Lq rows, q (b, hkv·groups, Lq, d) read as (b, hkv, groups·Lq, d) —
a view when each head's Lq rows are contiguous and heads follow each other (axon4d.nn.context
lays q out so), else a copy of q alone — and dk, dv come out per key/value head, summed over the
group by the kernel's own reduction over rows. A causal part (Lq = Lk, the small diagonal square)
runs on flash's native grouped-query support, elsewhere with its keys and values repeated for the
group (Lk rows each: the size of q) and their gradients summed back.
"""

from __future__ import annotations

import torch

from axon4d.device import HOST

#: the memory-efficient kernel's log-sum-exp rows are padded to a multiple of this
_LSE_ALIGN = 32
#: the kernels (``choose_kernel``)
FLASH, EFFICIENT, HOST_KERNEL, MATH = "flash", "efficient", "host", "math"
#: kernels that take fewer key/value heads than query heads themselves
NATIVE_GQA = frozenset({FLASH})
#: the dtypes torch's flash kernel takes
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: the largest head_dim torch's flash kernel takes
_FLASH_MAX_HEAD_DIM = 256


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int, flash_supported: bool) -> str:
    """The kernel for attention on ``device_type`` in ``dtype`` at ``head_dim`` (module docstring's
    table); ``flash_supported``: whether torch reports its flash kernel usable for these tensors
    (hardware, build, the user's SDPA switches)."""
    if device_type == HOST.type:
        return HOST_KERNEL
    if device_type == "cuda" and head_dim % 8 == 0:
        if flash_supported and dtype in _FLASH_DTYPES and head_dim <= _FLASH_MAX_HEAD_DIM:
            return FLASH
        return EFFICIENT
    return MATH


def kernel_for(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str:
    """The kernel that runs attention of ``q`` against ``k`` (``choose_kernel``, asking torch about
    flash only on CUDA/ROCm)."""
    flash = q.device.type == "cuda" and q.dtype in _FLASH_DTYPES and _flash_supported(q, k, causal)
    return choose_kernel(q.device.type, q.dtype, q.shape[-1], flash)


def _flash_supported(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """torch's own check that its flash kernel takes these tensors (dtype, head_dim, GPU
    architecture, the ``torch.backends.cuda.enable_flash_sdp`` switch, grouped-query heads)."""
    params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, causal, q.shape[1] != k.shape[1])
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


def query_groups(q: torch.Tensor, k: torch.Tensor) -> int:
    """The query heads per key/value head, hq/hkv; a ValueError when hkv does not divide hq."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads and {k.shape[1]} key/value heads: each key/value head serves a whole "
            "group of query heads, so the query heads must be a multiple of the key/value heads"
        )
    return q.shape[1] // k.shape[1]


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, hkv·groups, L, …) → (b, hkv, groups·L, …): each group's heads as one longer sequence."""
    return t.unflatten(1, (-1, groups)).flatten(2, 3)


def _unfold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of ``_fold``: (b, hkv, groups·L, …) → (b, hkv·groups, L, …)."""
    return t.unflatten(2, (groups, -1)).flatten(1, 2)


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads (b, hkv, L, d) repeated for their query heads: (b, hkv·groups, L, d)."""
    return t.repeat_interleave(groups, dim=1)


def _sum_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat``: (b, hkv·groups, L, d) summed over each group → (b, hkv, L, d)."""
    return g.unflatten(1, (-1, groups)).sum(2)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ/√d) v, the rows' natural log-sum-exp of the scores): (b, hq, Lq, d) and
    (b, hq, Lq) fp32, on ``kernel_for``'s kernel; k and v may have fewer heads (module docstring)."""
    groups = query_groups(q, k)
    folded = groups > 1 and not causal  # the group's queries as one sequence: no key/value copies
    if folded:
        q = _fold(q, groups)
    kernel = kernel_for(q, k, causal)
    if groups > 1 and not folded and kernel not in NATIVE_GQA:  # a causal square: the size of q
        k, v = _repeat(k, groups), _repeat(v, groups)
    if kernel == FLASH:  # lse (b, h, Lq) fp32, natural log; k and v may have fewer heads
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    elif kernel == HOST_KERNEL:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    elif kernel == EFFICIENT:
        out, lse = _efficient_attention(q, k, v, causal)
        lse = lse[..., : q.shape[2]]  # drop the kernel's padding rows
    else:
        scores = _scores(q, k, causal)
        lse = scores.logsumexp(-1)
        out = (scores - lse.unsqueeze(-1)).exp().to(v.dtype) @ v
    return (_unfold(out, groups), _unfold(lse, groups)) if folded else (out, lse)


def attention_with_lse_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``attention_with_lse`` for the output gradient ``grad``; dk and dv have k's
    (fewer) heads, summed over each group. Given the ``out`` and ``lse`` of a larger attention that
    these keys are a part of (merged over every part), it returns exactly this part's share of that
    attention's gradients."""
    groups = query_groups(q, k)
    folded = groups > 1 and not causal  # as the forward: the group's queries as one sequence
    if folded:
        grad, q, out, lse = (_fold(t, groups) for t in (grad, q, out, lse))
    kernel = kernel_for(q, k, causal)
    repeated = groups > 1 and not folded and kernel not in NATIVE_GQA
    kk, vv = (_repeat(k, groups), _repeat(v, groups)) if repeated else (k, v)
    if kernel == FLASH:  # reads out and grad through their strides, lse as (b, h, Lq) contiguous
        seed = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: never read
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, kk, vv, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed
        )  # dense sequences: no cumulative lengths
    elif kernel == HOST_KERNEL:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, kk, vv, out, lse, 0.0, causal
        )
    elif kernel == EFFICIENT:
        rows = q.shape[2]
        padded = lse.new_zeros(*lse.shape[:-1], -(-rows // _LSE_ALIGN) * _LSE_ALIGN)  # the forward's layout
        padded[..., :rows] = lse
        dq, dk, dv = _efficient_attention_backward(grad, q, kk, vv, kernel_layout(out), padded[..., :rows], causal)
    else:  # fp32 matmuls, from the scores recomputed and the (merged) lse
        p = (_scores(q, kk, causal) - lse.unsqueeze(-1)).exp()  # (b, h, Lq, Lk) fp32
        g32, scale = grad.float(), q.shape[-1] ** -0.5
        ds = p * (g32 @ vv.float().transpose(-2, -1) - (g32 * out.float()).sum(-1, keepdim=True))
        dq = ((ds @ kk.float()) * scale).to(q.dtype)
        dk = ((ds.transpose(-2, -1) @ q.float()) * scale).to(k.dtype)
        dv = (p.transpose(-2, -1) @ g32).to(v.dtype)
    if repeated:
        dk, dv = _sum_groups(dk, groups), _sum_groups(dv, groups)
    return (_unfold(dq, groups) if folded else dq), dk, dv


def kernel_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` (b, h, L, d) with the memory layout of the memory-efficient kernel's own output:
    (b, L, h, d) contiguous, viewed as (b, h, L, d) — ``out`` itself when it has it, else a copy.

    The kernel's backward reads ``out`` (for delta = rowsum(dO ∘ O)) at a row stride of h·d
    whatever the tensor's strides say (``o_strideM()`` in PyTorch's mem-eff ``kernel_backward.h``;
    fp16 and bf16 compute delta in the kernel, fp32 in ATen from the strides). A merged or sliced
    output (b, h, L, d)-contiguous has row stride d: with more than one head the kernel would read
    other heads' rows — wrong dq and dk, and past the allocation for the last head."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory-efficient kernel's forward: out (b, h, Lq, d), lse (b, h, Lq rounded up to 32) fp32."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse


def _efficient_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The memory-efficient kernel's backward: (dq, dk, dv). ``out`` must be in ``kernel_layout``;
    ``lse`` is (b, h, Lq), a view whose rows are the forward's padded ones."""
    seed = torch.empty((), dtype=torch.long)  # no dropout: the random state is never read
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], causal
    )
    return dq, dk, dv


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q kᵀ/√d in fp32, the upper triangle −∞ when ``causal``."""
    s = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s
