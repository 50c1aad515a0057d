"""The one seam between axon4d and the hardware: devices, backends and dtypes.

Nothing else in the library names ``cuda`` or ``cpu``. On a GPU node every rank uses
``cuda:<local_rank>`` and NCCL; on a CPU-only machine every rank uses the CPU and gloo. Both
can be overridden (``axon4d.init(device=..., backend=...)``). Host memory is ``HOST``: what
leaves a device for a file or a host-only library goes through ``to_host``/``staging_copy``, and
what a job makes on the host (token ids from a data loader) reaches its device by ``to_device``.
``matmul_seconds`` times one square matmul, synchronising the device, for the start-up probes;
``reset_peak_memory``/``peak_memory_allocated``/``memory_allocated`` read an accelerator's allocator.
``mm_widening`` is a GEMM that keeps its fp32 sums; ``axon4d.device.clock.Clock`` times work where it
runs (an accelerator's timing events). Attention on each device's fused kernel is ``axon4d.device.attention``.
Copies beside the compute (activation offload, ``axon4d.memory.offload``) use ``side_stream``/``on_stream``/
``current_stream``/``wait_stream``, ``record_event``/``wait_event`` and ``keep_until_done``: streams
and events on an accelerator, nothing on the host, where every copy is done when it returns; their
host buffers are carved from few page-locked allocations (``axon4d.device.pinned``), and
``pinned_empty_like`` is one page-locked buffer from torch's caching host allocator.

What an accelerator run gets by default (the training job asks for each; docs/training.md, "The
defaults a GPU user gets"): ``allow_tf32`` (fp32 matmuls on TF32 tensor cores), the process
environment of ``axon4d.device.environment`` (the allocator's expandable segments, one hardware
queue so collectives start before the GEMMs issued after them, host memory in huge pages),
``adamw_kernel`` (torch's fused AdamW; the multi-tensor one on the host), and seeded
initialisation drawn on the device in large tiles (``draw_device``, ``init_tile_bytes``).
``is_accelerator`` is the one test of "an accelerator" those decisions use.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

#: dtypes a layer may hold its parameters (and compute) in. Not fp16: its 5-bit exponent makes small
#: gradients underflow to zero without loss scaling, which axon4d does not do (``check_dtype``).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
#: the dtypes by the names configurations, machine files and the command line use; the one such
#: map in the library (element sizes come from it: ``DTYPES[name].itemsize``).
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


HOST = torch.device("cpu")


def accelerator_available() -> bool:
    """True when a CUDA (or ROCm, which torch exposes as cuda) device is present."""
    return torch.cuda.is_available()


def is_accelerator(device: torch.device) -> bool:
    """True when ``device`` is an accelerator (CUDA, or ROCm, which torch exposes as cuda); False
    for host memory and the meta device."""
    return device.type == "cuda"


def allow_tf32(device: torch.device, allow: bool = True) -> bool:
    """Let fp32 matmuls on accelerator ``device`` use TF32 tensor cores (10-bit mantissa inputs,
    fp32 sums: some 7x the fp32 rate on an H100's datasheet) by
    ``torch.set_float32_matmul_precision("high")`` — or, with ``allow=False``, keep them in full
    fp32 ("highest"). That is the setting torch 2.11 and 2.13 both take; 2.13's per-backend
    ``fp32_precision`` flags follow it, and a process that set those flags itself in a way the
    setting cannot express (torch then refuses to read it back) is left as it is. A precision
    below TF32 the process chose ("medium") is kept when TF32 is allowed. Nothing is set for the
    host (where "high" would also let oneDNN lower CPU matmuls' precision). Returns whether fp32
    matmuls on ``device`` may use TF32 now (``fp32_matmul_uses_tf32``)."""
    if not is_accelerator(device):
        return False
    try:
        chosen = torch.get_float32_matmul_precision()
    except RuntimeError:  # the two APIs were mixed: the process chose, leave them
        return fp32_matmul_uses_tf32(device)
    if not allow:
        torch.set_float32_matmul_precision("highest")
    elif chosen == "highest":
        torch.set_float32_matmul_precision("high")
    return fp32_matmul_uses_tf32(device)


def fp32_matmul_uses_tf32(device: torch.device) -> bool:
    """Whether torch may run fp32 matmuls on ``device`` in TF32 (False on the host)."""
    if not is_accelerator(device):
        return False
    try:
        return torch.get_float32_matmul_precision() != "highest"  # as axon4d.train.peak reads it
    except RuntimeError:  # the per-backend flags were set (torch 2.9 and later): read cuBLAS's
        return getattr(torch.backends.cuda.matmul, "fp32_precision", "") == "tf32"


def adamw_kernel(device: torch.device) -> str:
    """Which of ``torch.optim.AdamW``'s implementations to use for parameters on ``device``:
    "fused" (one kernel per parameter group and dtype) on an accelerator, "foreach" (one
    multi-tensor op per update term instead of one op per parameter) on the host."""
    return "fused" if is_accelerator(device) else "foreach"


def draw_device(device: torch.device) -> torch.device:
    """Where seeded random values for a tensor on ``device`` are drawn: on the accelerator itself
    (its own generator), else in host memory (the host's generator; also for the meta device)."""
    return device if is_accelerator(device) else HOST


#: bytes of scratch a seeded initialisation tile may take (``axon4d.layout.tiled_init``): small on the
#: host (whose values are fixed by it), large on an accelerator, where each tile is a kernel launch
INIT_TILE_BYTES = {"host": 64 << 10, "accelerator": 16 << 20}


def init_tile_bytes(device: torch.device) -> int:
    """The scratch bytes of one seeded initialisation tile for a tensor on ``device``."""
    return INIT_TILE_BYTES["accelerator" if is_accelerator(device) else "host"]


#: the variables by which a process is shown a subset of the node's accelerators (CUDA, ROCm)
_VISIBLE_DEVICES_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def default_device(local_rank: int = 0) -> torch.device:
    """The device a rank computes on: accelerator ``local_rank`` of those this process sees when
    there are any, else the host. A process shown a single accelerator computes on it whatever its
    local rank (``srun --gpus-per-task=1``, ``--gpu-bind`` or a per-rank ``CUDA_VISIBLE_DEVICES``
    give each rank its own; NCCL refuses two ranks of one device itself, naming both). A process
    shown several: one per local rank, and a ``local_rank`` at or past their number raises
    ``RuntimeError`` (ranks sharing a device run at a fraction of its speed and may run out of its
    memory) instead of silently sharing one."""
    if not accelerator_available():
        return HOST
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise RuntimeError(_oversubscribed(local_rank, count))
    return torch.device("cuda", local_rank)


def rank_device(device: torch.device | None, local_rank: int) -> torch.device:
    """The device a rank of local rank ``local_rank`` computes on, given the one the user named:
    ``default_device(local_rank)`` when none is named or an accelerator is named without an index
    ("cuda": this rank's own, not whichever is current); a ``RuntimeError`` when one is named and
    this process sees none; else ``device`` as named."""
    if device is not None and (not is_accelerator(device) or device.index is not None):
        return device
    if device is not None and not accelerator_available():
        raise RuntimeError(
            f"device={str(device)!r} was asked for, but this process sees no accelerator "
            "(torch.cuda.is_available() is False): leave device unset to compute on the host"
        )
    return default_device(local_rank)


def _oversubscribed(local_rank: int, count: int) -> str:
    """The error for a local rank with no accelerator of its own: what was seen and what would work."""
    visible = ", ".join(f"{v}={os.environ[v]!r}" for v in _VISIBLE_DEVICES_VARS if v in os.environ)
    return (
        f"local rank {local_rank} needs accelerator {local_rank}, but this process sees {count} "
        f"({visible or 'no *_VISIBLE_DEVICES set'}): at least {local_rank + 1} ranks on this node "
        f"would share {count} device(s). Start at most {count} rank(s) per node (torchrun "
        f"--nproc-per-node, srun --ntasks-per-node, mpirun --map-by ppr:{count}:node), or show "
        "each rank its own device (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank); or "
        "pass axon4d.init(device=...) yourself"
    )


def process_group_device(device: torch.device | None) -> torch.device | None:
    """The ``device_id`` for ``init_process_group``: ``device`` (with its index; the current
    device's if it has none) when it is an accelerator, so the backend binds this process to it and
    makes its communicator at once (subgroups are then split from it); None on the host."""
    if device is None or is_host(device) or device.type == "meta":
        return None
    if device.index is None:
        return torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def accelerator_kind() -> str:
    """The accelerator family torch drives as ``cuda``: "rocm" on a ROCm build, "cuda" otherwise
    (the name MPI libraries give the device memory they can read)."""
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def device_name(device: torch.device) -> str:
    """The product name of ``device`` (e.g. "NVIDIA H100 80GB HBM3"); "host" for host memory."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "host" if is_host(device) else device.type


def is_host(device: torch.device) -> bool:
    """True when ``device`` is host memory."""
    return device.type == HOST.type


def rng_state(device: torch.device | None = None) -> dict[str, list[int]]:
    """This process's random generator states as JSON data: the host's (key "host") and, for an
    accelerator ``device``, its own (key ``device.type``); ``restore_rng`` puts them back."""
    state = {"host": torch.get_rng_state().tolist()}
    if device is not None and not is_host(device) and device.type != "meta":
        state[device.type] = torch.get_device_module(device.type).get_rng_state(device).tolist()
    return state


def restore_rng(state: dict[str, list[int]], device: torch.device | None = None) -> None:
    """Set the generators ``rng_state`` recorded (the ``device`` one only when ``state`` has it)."""
    torch.set_rng_state(torch.tensor(state["host"], dtype=torch.uint8))
    if device is not None and not is_host(device) and device.type in state:
        torch.get_device_module(device.type).set_rng_state(torch.tensor(state[device.type], dtype=torch.uint8), device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself when it is there already, else a copy that does not block the
    host (host → accelerator copies queue on the current stream, so later kernels see the data)."""
    return t.to(device, non_blocking=not is_host(device))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` (detached) in host memory, e.g. for ``torch.save`` files any machine can read."""
    return t.detach().to(HOST)


def staging_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device tensor ``t`` for a library that reads only host memory (MPI without
    device support); pinned, so the copies in and out run at full speed. Blocks until it holds
    ``t``'s values."""
    host = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=t.device.type == "cuda")
    host.copy_(t.detach())
    return host


#: a stream or an event of an accelerator; None on the host, where work is done when it is issued
Stream = Any
Event = Any


def side_stream(device: torch.device) -> Stream:
    """A new stream on accelerator ``device`` for copies that run beside the compute (activation
    offload); None on the host."""
    return torch.cuda.Stream(device) if is_accelerator(device) else None


def current_stream(device: torch.device) -> Stream:
    """The stream work on ``device`` is issued to now (the compute stream); None on the host."""
    return torch.cuda.current_stream(device) if is_accelerator(device) else None


def on_stream(stream: Stream) -> contextlib.AbstractContextManager[Any]:
    """A context in which work is issued to ``stream`` (a no-op for None, the host)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_stream(stream: Stream, other: Stream) -> None:
    """Work issued to ``stream`` from now on starts after what ``other`` holds now (no-op on the host)."""
    if stream is not None and other is not None:
        stream.wait_stream(other)


def record_event(stream: Stream) -> Event:
    """An event marking the point ``stream`` has reached in its queue (None on the host: done)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(event: Event, stream: Stream) -> None:
    """Work issued to ``stream`` from now on starts after ``event`` (no host wait; no-op on the host)."""
    if event is not None and stream is not None:
        stream.wait_event(event)


def keep_until_done(t: torch.Tensor, stream: Stream) -> None:
    """Tell the accelerator's allocator that ``stream`` uses ``t``: its memory is not given to other
    work until what ``stream`` holds now is done, even when ``t`` is freed before (``record_stream``;
    no-op on the host)."""
    if stream is not None and is_accelerator(t.device):
        t.record_stream(stream)


def pinned_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor of ``t``'s shape, dtype and strides (dense ones; else contiguous):
    page-locked when ``t`` is on an accelerator, so copies to and from it run asynchronously at the
    link's full speed; a plain host tensor otherwise."""
    return torch.empty_like(t, device=HOST, pin_memory=is_accelerator(t.device))


def default_backend(device: torch.device) -> str:
    """The torch.distributed backend that fits ``device``: NCCL for accelerators, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def mesh_device_type(device: torch.device) -> str:
    """The ``device_type`` string DeviceMesh wants for ``device``."""
    return device.type


def bind(device: torch.device) -> None:
    """Make ``device`` the current device of this process (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return ``dtype`` if axon4d layers can hold parameters in it; raise ``ValueError`` otherwise."""
    if dtype == torch.float16:
        raise ValueError(
            "dtype torch.float16 is not supported for parameters: fp16 gradients underflow without dynamic loss "
            "scaling, which axon4d does not do. Use torch.bfloat16 (the same bytes with fp32's range; e.g. "
            "model.to(torch.bfloat16) before parallelizing it) or fp32 master weights with "
            "precision='bf16-fp32-reduce'"
        )
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported for parameters; use one of {names}")
    return dtype


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (accelerators run asynchronously; the host does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize_compute(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s compute stream only: collectives on their own
    streams (NCCL's) may still run — an all-gather left in flight into the next step goes on."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for ``peak_memory_allocated`` (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_cached_memory(device: torch.device) -> None:
    """Return the caching allocator's unused blocks on ``device`` to the driver (a no-op on the
    host): what a torn-down model held is then free for the next one, whatever its block sizes."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_allocated(device: torch.device) -> int | None:
    """Peak bytes of torch tensors on ``device`` since ``reset_peak_memory``, from the caching
    allocator; None on the host, which keeps no such count (use torch's ``MemTracker`` there)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def memory_allocated(device: torch.device) -> int | None:
    """Bytes of torch tensors alive on ``device`` now, from the caching allocator; None on the host."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def matmul_seconds(
    device: torch.device, dtype: torch.dtype, n: int = 512, budget_s: float = 0.1, repeats: int = 8
) -> float:
    """Seconds one (n × n) @ (n × n) matmul in ``dtype`` takes on ``device``: after a warm-up
    call, one timed call sets how many more fit in ``budget_s`` (1 to ``repeats``), and those run
    back to back between two device synchronisations, so a dtype with slow kernels costs about
    three calls and a fast one a fraction of ``budget_s``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: library handles, kernel selection
    synchronize(device)
    start = time.perf_counter()
    torch.matmul(a, b)
    synchronize(device)
    one = time.perf_counter() - start
    count = max(1, min(repeats, int(budget_s / max(one, 1e-9))))
    start = time.perf_counter()
    for _ in range(count):
        torch.matmul(a, b)
    synchronize(device)
    return (time.perf_counter() - start) / count


#: whether a device type's GEMM takes ``out_dtype`` (learned at the first call; see ``mm_widening``)
_MM_OUT_DTYPE: dict[str, bool] = {}


def mm_widening(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b for 2-D ``a`` (n, k), ``b`` (k, m) with the product written in ``dtype``, wider than
    theirs (fp32 for bf16/fp16 inputs): the GEMM's fp32 sums are kept instead of being rounded to
    the inputs' dtype. On CUDA one GEMM writes ``dtype`` (``torch.mm(..., out_dtype=)``); where that
    is missing (the host, an older torch) the inputs are widened first — the same sums, since a
    product of two bf16 or fp16 values is exact in fp32. Into ``out`` (n, m) when given."""
    if a.dtype == dtype and b.dtype == dtype:
        return torch.mm(a, b, out=out)
    kind = a.device.type
    if kind == "cuda" and _MM_OUT_DTYPE.get(kind, True):
        try:
            return torch.mm(a, b, out_dtype=dtype) if out is None else torch.mm(a, b, out_dtype=dtype, out=out)
        except (RuntimeError, TypeError):  # this torch's GEMM cannot write another dtype
            _MM_OUT_DTYPE[kind] = False
    return torch.mm(a.to(dtype), b.to(dtype), out=out)
