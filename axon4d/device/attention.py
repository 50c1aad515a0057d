"""Attention with its log-sum-exp on each device's fused kernel: the kernels context parallelism
computes its parts with and merges (axon4d.nn.context; docs/context.md). Part of the device seam
(``axon4d.device``): the only other place in the library that names a device type.

q (b, h, Lq, d), k and v (b, h, Lk, d), the same heads (expand grouped-query heads first), no
dropout, scale 1/√d; ``causal`` needs Lq = Lk (the square's lower triangle). The host runs torch's
CPU flash kernel; CUDA/ROCm the memory-efficient kernel (every float dtype, fp32 included), with the
attention output handed to its backward in the layout it reads (``kernel_layout``); another device,
or a head_dim that kernel cannot take, plain matmuls.
"""

from __future__ import annotations

import torch

from axon4d.device import is_host

#: the memory-efficient kernel's log-sum-exp rows are padded to a multiple of this
_LSE_ALIGN = 32


def _fused_lse_kernel(q: torch.Tensor) -> str | None:
    """ "host", "cuda" or None (plain matmuls) for attention on ``q``'s device and head_dim."""
    if is_host(q.device):
        return "host"
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:
        return "cuda"
    return None


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ/√d) v, the rows' log-sum-exp of the scores): (b, h, Lq, d) and (b, h, Lq) fp32."""
    kernel = _fused_lse_kernel(q)
    if kernel == "host":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    if kernel == "cuda":
        out, lse = _efficient_attention(q, k, v, causal)
        return out, lse[..., : q.shape[2]]  # drop the kernel's padding rows
    scores = _scores(q, k, causal)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp().to(v.dtype) @ v, lse


def attention_with_lse_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``attention_with_lse`` for the output gradient ``grad``. Given the ``out`` and
    ``lse`` of a larger attention that these keys are a part of (merged over every part), it returns
    exactly this part's share of that attention's gradients."""
    kernel = _fused_lse_kernel(q)
    if kernel == "host":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal
        )
        return dq, dk, dv
    if kernel == "cuda":
        rows = q.shape[2]
        padded = lse.new_zeros(*lse.shape[:-1], -(-rows // _LSE_ALIGN) * _LSE_ALIGN)  # the forward's layout
        padded[..., :rows] = lse
        return _efficient_attention_backward(grad, q, k, v, kernel_layout(out), padded[..., :rows], causal)
    scale = q.shape[-1] ** -0.5
    p = (_scores(q, k, causal) - lse.unsqueeze(-1)).exp()  # (b, h, Lq, Lk) fp32
    g32 = grad.float()
    dv = p.transpose(-2, -1) @ g32
    ds = p * (g32 @ v.float().transpose(-2, -1) - (g32 * out.float()).sum(-1, keepdim=True))
    dq = (ds @ k.float()) * scale
    dk = (ds.transpose(-2, -1) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
