"""The transformer the planner is validated against, built from ``axon4d.Linear`` (docs/design.md §2).

``ProbeModel`` runs exactly the work ``Workload`` prices: per block QKV (normal) → causal
attention on this rank's heads (split over y) → attention output (transposed) + residual → MLP up
(normal) → GELU → MLP down (transposed) + residual — in a Mixture-of-Experts workload the MLP's
place is taken by the MoE layer (``axon4d.nn.moe.MoE``: router, expert all-to-alls, grouped expert
GEMMs, shared experts) + residual, its auxiliary loss added to the loss —; then the vocab-parallel
head (normal, logits split over y) and a mean-square loss on the logits, its parameters in the workload's dtype on a
grid without mixed precision (precision "fp32" or "bf16", ``unmixed_precision``). It has no norms and no embedding (its
input is a random activation that requires grad, as an embedding's output would), so the
benchmark needs nothing beyond the 3D linear layer. ``measure_step`` times steps;
``measure_peak`` measures the peak of torch allocations.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from axon4d import device as devices
from axon4d.grid.mesh import Grid
from axon4d.memory.peakmem import peak_bytes
from axon4d.nn import Linear
from axon4d.nn.moe import MoE, aux_loss
from axon4d.plan.workload import Workload, unmixed_precision
from axon4d.zero import shard_optimizer


class ProbeModel(nn.Module):
    """This rank's part of ``wl``'s blocks and head on ``grid`` (no norms, no embedding)."""

    def __init__(self, wl: Workload, grid: Grid):
        super().__init__()
        if wl.embedding or wl.norms:
            raise ValueError(
                "ProbeModel has no embedding and no norms: use Workload(..., embedding=False, norms=False)"
            )
        runs = unmixed_precision(wl.dtype)  # its parameters are wl.dtype itself, reduced in it
        if grid.precision.mixed or wl.preset != runs:
            raise ValueError(
                f"ProbeModel holds {wl.dtype} parameters on a grid without mixed precision, so its collectives move "
                f"what precision {runs!r} says; give Workload(..., precision={runs!r}) (not {wl.preset!r}) and a grid "
                "without mixed precision (axon4d.init's default)"
            )
        problems = wl.grid_problems(grid.shape)
        if problems:
            raise ValueError(f"grid {grid.shape} does not fit the workload: {'; '.join(problems)}")
        self.wl, self.grid = wl, grid
        dtype = devices.DTYPES[wl.dtype]
        m = wl.model
        self.blocks = nn.ModuleList()
        for _ in range(m.n_layers):
            layers: dict[str, nn.Module] = {
                name: Linear(i, o, bias=b, transpose=t, grid=grid, dtype=dtype)
                for name, i, o, t, b in m.linear_shapes()
                if not (m.moe and name.startswith("mlp"))  # an MoE block's MLP is the MoE layer
            }
            if m.moe:
                layers["moe"] = MoE(m, grid=grid, dtype=dtype)
            self.blocks.append(nn.ModuleDict(layers))
        self.head = Linear(m.hidden, m.vocab_size, bias=False, grid=grid, dtype=dtype) if wl.head else None

    def input(self) -> torch.Tensor:
        """A random activation (b, hidden/G_x) standing in for the embedding output."""
        b = self.wl.local_tokens(self.grid.shape)
        dtype = devices.DTYPES[self.wl.dtype]
        return torch.randn(
            b, self.wl.model.hidden // self.grid.size("x"), dtype=dtype, device=self.grid.device, requires_grad=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, g = self.wl.model, self.grid
        seqs = x.shape[0] // m.seq_len
        heads = m.n_heads // g.size("y")
        for block in self.blocks:
            blk = cast(nn.ModuleDict, block)  # every block is the ModuleDict built in __init__
            qkv = blk["qkv"](x)  # (b, 3·H/G_y)
            qkv = qkv.view(seqs, m.seq_len, 3, heads, m.head_dim).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (seqs, heads, S, hd)
            att = att.transpose(1, 2).reshape(x.shape[0], heads * m.head_dim)  # (b, H/G_y)
            x = x + blk["attn_out"](att)  # (b, H/G_x)
            if m.moe:
                x = x + blk["moe"](x)  # (b, H/G_x)
            else:
                x = x + blk["mlp_down"](F.gelu(blk["mlp_up"](x)))
        out = x if self.head is None else self.head(x)  # logits (b, vocab/G_y) with the head
        loss = out.float().square().mean()
        aux = aux_loss(self) if m.moe else None  # the MoE layers' balance and z-losses (this rank's share)
        return loss if aux is None else loss + aux


def train_step(model: ProbeModel, opt: torch.optim.Optimizer, micro_batches: int = 1) -> None:
    """One step: ``micro_batches`` forwards and backwards of ``model``'s input (a micro-batch each;
    all but the last hold their data-axis reductions, as the training job does), then the optimizer."""
    opt.zero_grad(set_to_none=True)
    for i in range(micro_batches):
        last = i == micro_batches - 1
        with contextlib.nullcontext() if last else model.grid.scheduler.accumulating():
            model(model.input()).backward()
    opt.step()


def measure_step(
    model: ProbeModel, steps: int = 4, warmup: int = 2, micro_batches: int = 1, zero: int = 0
) -> dict[str, Any]:
    """Seconds per training step, as a training run sees them.

    The ``steps`` steps run back to back, as in training (no barrier between them: ranks drift
    out of phase and one rank's computation fills another's wait, which is what sets throughput);
    one barrier before and one after. The step time is the slowest rank's span divided by
    ``steps``. ``steps_s`` lists this rank's own duration of each step, for the record;
    ``bytes_by_axis`` and ``collectives`` are what the communication log counted per step.
    ``micro_batches`` and ``zero``: the step accumulates that many passes of ``model`` (built for
    one micro-batch) and shards Adam over data at that ZeRO stage (``axon4d.shard_optimizer``).
    """
    grid = model.grid
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    if zero:  # the optimizer sharded over data (axon4d.zero)
        opt = shard_optimizer(opt, model, grid, stage=zero)
    for _ in range(warmup):
        train_step(model, opt, micro_batches)
    grid.comm.log.clear()
    grid.comm.barrier()
    marks = [time.perf_counter()]
    for _ in range(steps):
        train_step(model, opt, micro_batches)
        devices.synchronize(grid.device)
        marks.append(time.perf_counter())
    log_bytes = {a: v // steps for a, v in grid.comm.log.bytes_by_axis().items()}
    calls = len(grid.comm.log.records) // steps
    summary = grid.comm.log.summary()
    spans = grid.comm.all_gather(
        torch.tensor([marks[-1] - marks[0]], dtype=torch.float64, device=grid.device), "world"
    ).wait()
    grid.comm.log.clear()
    return {
        "step_s": float(spans.max()) / steps,
        "steps_s": [b - a for a, b in zip(marks, marks[1:])],
        "bytes_by_axis": log_bytes,
        "collectives": calls,
        "comm_s": summary["comm_s"] / steps,
        "blocked_s": summary["blocked_s"] / steps,
    }


def measure_peak(model: ProbeModel, warmup: int = 2) -> int:
    """Peak bytes of live torch allocations over one training step after ``warmup`` steps (so
    optimizer state exists), maximum over ranks.

    Measured with torch's ``MemTracker``: it follows every tensor torch allocates (parameters,
    gradients, optimizer state, activations, temporaries, collective buffers — including the input
    of a collective in flight, which its handle holds until waited on) and reports the maximum live
    total; host-side buffers of the communication library are not torch tensors and are not
    counted. The tracker keeps a reference to the model, and so to its grid: the grid's groups and
    their threads are released by ``Grid.destroy`` all the same (before that was so, timed steps
    after a tracked one ran slower; the benchmarks still measure memory last).
    """
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    for _ in range(warmup):
        train_step(model, opt)
    return peak_bytes(model.grid, model, opt, lambda: train_step(model, opt))
