"""The compute rates calibration measures on every rank at once (docs/design.md §6, §7).

- GEMM throughput of the three forms a linear layer runs (X·Wᵀ, dY·W, dYᵀ·X; ``FORMS``) on a
  lattice of (m, k, n), longer on an accelerator than on a host (``gemm_dims``), per dtype
  (``matmul_table``);
- causal attention forward + backward per (sequence, head) (``attention_rows``), and unmasked
  attention of a block of queries against a longer run of keys per (query, key) pair
  (``prefix_rows``: what a context-parallel rank computes against the keys of earlier chunks);
- elementwise streaming bandwidth, the MLP activation forward/backward per element and one Adam
  step per parameter (``elementwise``), the fixed cost of one framework op (``op_overhead``), and
  what one small read to the host costs a loop of queued ops (``host_sync``: an MoE layer's counts
  exchange, docs/design.md §10 E15).

These are the rates ``axon4d.plan.machine.Machine`` prices compute with; every rank computes at the
same time, so they include the contention of a real step (``axon4d.measure.timing``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from axon4d import device as devices
from axon4d.measure.timing import Timer
from axon4d.plan.tables import MatmulTable

#: the GEMM lattice on a host: every (m, k, n) of these is run. The large points matter: on a host
#: a 4096-wide GEMM runs well above the rate of a 1024-wide one, and a true-width layer's GEMMs are
#: larger still (the planner clamps beyond the lattice).
DIMS = [16, 64, 256, 1024, 4096]
#: the GEMM lattice on an accelerator (``gemm_dims``): the host's, up to the GEMMs of a true-width
#: 20B or 80B block (hidden 7168–12288, FFN slices and tokens per rank of thousands to 16384),
#: which the host's would price at its 4096 edge, and 2048, where an accelerator's rate still climbs
#: (an H200's bf16 rate at k = n = 4096: 544 TFLOP/s for m = 1024, 657 for m = 4096, both timed with
#: a synchronize after every call, which depressed them: docs/planner.md, Known limits). 8³ points
#: per form: seconds each on an
#: accelerator, where on a host the 5³ of ``DIMS`` already take minutes.
ACCELERATOR_DIMS = [16, 64, 256, 1024, 2048, 4096, 8192, 16384]
#: sequence lengths of the causal attention rows; the planner grows the last quadratically beyond
ATTENTION_SEQS = [64, 128, 256, 512, 1024, 2048, 4096]
#: head dimensions of the attention rows
HEAD_DIMS = [32, 64, 128]
#: key lengths of the unmasked prefix rows (queries: ``PREFIX_QUERIES`` or as many as keys)
PREFIX_KEYS = [256, 1024, 4096, 16384, 65536]
PREFIX_QUERIES = 512
#: how much larger an attention measurement is on an accelerator than on a host: one sequence's
#: head at a time leaves most of a GPU's multiprocessors idle (one head of 2048 tokens is 16 row
#: blocks for 132 of them), so its rows would price attention many times too slow
ACCELERATOR_WORK = 64
#: the most elements one of q, k, v may hold in an accelerator's attention measurement
ACCELERATOR_ELEMENTS = 1 << 28
#: the most (sequence, head) units at once: cuDNN's attention backward failed on an H200 at 65536
MAX_UNITS = 4096


def _units(timer: Timer, work: int, per_unit: int, elements_per_unit: int) -> int:
    """How many (sequence, head) units one attention measurement runs at once: ``work`` over
    ``per_unit`` on a host; on an accelerator ``ACCELERATOR_WORK`` times that, while one tensor
    (``elements_per_unit`` per unit) stays within ``ACCELERATOR_ELEMENTS``."""
    if not devices.is_accelerator(timer.device):
        return max(1, work // per_unit)
    return max(1, min(ACCELERATOR_WORK * work // per_unit, ACCELERATOR_ELEMENTS // elements_per_unit, MAX_UNITS))


def gemm_dims(device: torch.device) -> list[int]:
    """The GEMM lattice calibration measures on ``device``: ``ACCELERATOR_DIMS`` on an
    accelerator, ``DIMS`` on a host."""
    return list(ACCELERATOR_DIMS if devices.is_accelerator(device) else DIMS)


def matmul_table(timer: Timer, dtype: torch.dtype, form: str, dims: Sequence[int]) -> MatmulTable:
    """FLOP/s of GEMMs of ``form`` ("nt", "nn", "tn") at every lattice point of ``dims``."""
    rates = torch.zeros(len(dims), len(dims), len(dims), dtype=torch.float64)
    for (i, m), (j, k), (l, n) in itertools.product(enumerate(dims), repeat=3):
        a_shape, b_shape = {"nt": ((m, k), (n, k)), "nn": ((m, k), (k, n)), "tn": ((k, m), (k, n))}[form]
        a = torch.randn(a_shape, dtype=dtype, device=timer.device)
        b = torch.randn(b_shape, dtype=dtype, device=timer.device)
        op = {
            "nt": lambda: torch.matmul(a, b.t()),
            "nn": lambda: torch.matmul(a, b),
            "tn": lambda: torch.matmul(a.t(), b),
        }[form]
        rates[i, j, l] = 2.0 * m * k * n / timer.measure(op, budget_s=0.5)
    return MatmulTable(list(dims), rates.numpy())


def attention_rows(timer: Timer, dtype: torch.dtype, seqs: Sequence[int] = ATTENTION_SEQS) -> list[list[float]]:
    """Rows [sequence, head_dim, seconds per (sequence·head)] of causal attention forward + backward."""
    rows = []
    for seq, hd in itertools.product(seqs, HEAD_DIMS):
        units = _units(timer, 2**22, seq * seq, seq * hd)  # similar work per measurement
        q, k, v = (
            torch.randn(1, units, seq, hd, dtype=dtype, device=timer.device, requires_grad=True) for _ in range(3)
        )

        def fwd_bwd() -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        rows.append([seq, hd, timer.measure(fwd_bwd, budget_s=0.5) / units])
    return rows


def prefix_rows(timer: Timer, dtype: torch.dtype, keys_list: Sequence[int] = PREFIX_KEYS) -> list[list[float]]:
    """Rows [keys, head_dim, seconds per (query·key) pair] of unmasked attention forward + backward
    of a block of queries against ``keys`` keys — a context-parallel query chunk against the keys of
    the chunks before it (axon4d.nn.context), all of which it sees."""
    rows = []
    for keys, hd in itertools.product(keys_list, HEAD_DIMS):
        queries = min(PREFIX_QUERIES, keys)
        units = _units(timer, 2**24, queries * keys, keys * hd)  # similar work per measurement
        q = torch.randn(1, units, queries, hd, dtype=dtype, device=timer.device, requires_grad=True)
        k, v = (torch.randn(1, units, keys, hd, dtype=dtype, device=timer.device, requires_grad=True) for _ in range(2))

        def fwd_bwd() -> None:
            out = F.scaled_dot_product_attention(q, k, v)
            out.backward(torch.ones_like(out))

        rows.append([keys, hd, timer.measure(fwd_bwd, budget_s=0.5) / (units * queries * keys)])
    return rows


def elementwise(timer: Timer, dtype: torch.dtype) -> tuple[float, list[float], float]:
    """(bytes/s an elementwise op streams, [forward, backward] seconds per element of the MLP
    activation (GELU), seconds per parameter element of one AdamW step as the training job runs it:
    the implementation ``make_optimizer`` picks on this device, ``axon4d.device.adamw_kernel`` —
    fused on an accelerator, multi-tensor ("foreach") on the host)."""
    n = 1 << 22
    a, b = torch.randn(n, dtype=dtype, device=timer.device), torch.randn(n, dtype=dtype, device=timer.device)
    t_add = timer.measure(lambda: a + b)
    bps = 3 * n * a.element_size() / t_add
    x = torch.randn(n, dtype=dtype, device=timer.device, requires_grad=True)
    t_f = timer.measure(lambda: F.gelu(x))
    y = F.gelu(x)
    g = torch.ones_like(y)
    t_fb = timer.measure(lambda: torch.autograd.grad(F.gelu(x), x, g))
    p = torch.nn.Parameter(torch.randn(n, device=timer.device))
    p.grad = torch.randn(n, device=timer.device)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), **{devices.adamw_kernel(p.device): True})
    t_adam = timer.measure(opt.step)
    return bps, [t_f / n, max(t_fb - t_f, 0.0) / n], t_adam / n


#: elements of the fp32 adds ``elementwise_curve`` times: 4, 16 and 64 MiB per operand (the largest
#: above the C library's largest heap block, so its output is fresh memory, faulted in each time)
ELEMENTWISE_SIZES = (1 << 20, 1 << 22, 1 << 24)


def elementwise_curve(timer: Timer, sizes: Sequence[int] = ELEMENTWISE_SIZES) -> list[list[float]]:
    """[[bytes streamed, bytes/s], ...] of an fp32 add ``a + b`` (two reads and a fresh output) at
    each of ``sizes`` elements: how an elementwise op's rate changes with its size on this machine
    (caches, and on a host the page faults of outputs too large for the allocator to reuse)."""
    rows = []
    for n in sizes:
        a, b = torch.randn(n, device=timer.device), torch.randn(n, device=timer.device)
        streamed = 3 * n * a.element_size()

        def add(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
            return a + b

        rows.append([float(streamed), streamed / timer.measure(add)])
    return rows


def host_link(timer: Timer, nbytes: int = 1 << 28) -> dict[str, float]:
    """Bytes per second of a copy of ``nbytes`` between the device and page-locked host memory, each
    way (activation offload's copies, axon4d.memory.offload); on a host both are memory copies."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    host = devices.pinned_empty_like(dev)
    return {
        "device_to_host_Bps": nbytes / timer.measure(lambda: host.copy_(dev, non_blocking=True)),
        "host_to_device_Bps": nbytes / timer.measure(lambda: dev.copy_(host, non_blocking=True)),
    }


def op_overhead(timer: Timer) -> float:
    """Seconds of one tiny framework op on the timer's device (dispatch and launch, not work)."""
    one = torch.ones(1, device=timer.device)
    return timer.measure(lambda: torch.add(one, 1))


#: int64 values ``host_sync`` reads back: E15's G_ep·G_y·C·E counts of, e.g., 8 expert-parallel
#: ranks × 2 y shares × 64 experts
HOST_SYNC_VALUES = 1024


def host_sync(timer: Timer, values: int = HOST_SYNC_VALUES) -> float:
    """Seconds one read of a small tensor to the host adds to each iteration of a loop of queued
    ops — what an MoE layer's counts exchange (E15) costs besides its all-gather, where the host
    reads the gathered counts (a copy to host memory, as ``axon4d.nn.moe_routes`` makes) and the device's
    queue drains before the next op is queued: a loop that queues a small op on ``values`` int64
    elements and reads them to the host, less the same loop without the read; clamped at 0 (on a
    host, where an op is done when it returns, only the conversion to Python numbers and noise
    are left)."""
    counts = torch.zeros(values, dtype=torch.int64, device=timer.device)

    def queued() -> torch.Tensor:
        return counts.add_(1)

    def read() -> object:
        return counts.add_(1).to(devices.HOST).numpy()

    return max(timer.measure(read) - timer.measure(queued), 0.0)
