"""Memory per rank of one training step at a long sequence, in both context-parallel modes
(docs/context.md, "Memory"): does the ring keep a rank's memory at its share of the activations?

A small Llama with grouped-query attention (``--layers``, ``--hidden``, ``--heads`` query and
``--kv-heads`` key/value heads, vocabulary 256) takes one step — forward, backward, Adam — on one
sequence of ``--seq`` tokens (default 131072) on ``--grid`` (default (1,1,8,1): the tokens split
head–tail over G_z = 8 ranks), once with the keys and values all-gathered over z and once passed
around z (``context_parallel="ring"``). Each rank's peak is torch's memory tracker's over the step
(``axon4d.measure.probe.peak_bytes``, the largest over ranks); a rank's own state is its
parameters, their gradients and Adam's two states (4 × its parameter bytes).

The yardstick is the unsplit model's activations: what autograd keeps for backward after the
forward of the whole sequence in one process (``DenseTransformer``, the same weights), counted by
storage through ``torch.autograd.graph.saved_tensors_hooks`` (each storage once). The target of
issue 56: peak per rank ≤ 1.3 × (those activations / G_z) + the rank's own state.

    python bench/context_memory.py                   # 128K tokens on (1,1,8,1)
    python bench/context_memory.py --seq 16384       # quicker

Memory only: the numbers do not depend on the host's load. Saves
``bench/results/context_memory.json`` (with the result header of bench/common.py); the last line is
``context memory: seq = S on G_z = G, ring R GiB, all-gather A GiB per rank; bound B GiB (1.3 × activations/G_z + state)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402

from axon4d.config import ModelConfig  # noqa: E402
from axon4d.measure.spawn import run_local  # noqa: E402

#: the bound's factor on the unsplit model's activations per z-rank (issue 56)
FACTOR = 1.3


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        n_layers=args.layers,
        hidden=args.hidden,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=256,
        seq_len=args.seq,
        arch="llama",
        name="context-memory-bench",
    )


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))


def _split_step(grid: Any, cfg: ModelConfig, mode: str) -> dict[str, int]:
    """On every rank: one step of the sequence split over z in ``mode``; its peak and its own state."""
    from axon4d import activations
    from axon4d.measure.probe import peak_bytes
    from axon4d.models.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg, grid=grid, context_parallel=mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    ids = _ids(cfg)
    inputs, targets = activations.shard_sequence(ids[:, :-1], grid), activations.shard_sequence(ids[:, 1:], grid)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model.loss(inputs, targets).backward()
        opt.step()

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": peak_bytes(grid, model, opt, step), "state": 4 * params}


def unsplit_activations(cfg: ModelConfig) -> int:
    """Bytes autograd keeps for backward after the forward of the whole sequence in one process:
    every saved tensor's storage, each once."""
    from axon4d.models.transformer import DenseTransformer

    torch.manual_seed(0)
    model = DenseTransformer(cfg)
    ids = _ids(cfg)
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # weights are the model's state, not activations
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    del loss
    return sum(seen.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=131072, help="tokens in the sequence")
    p.add_argument("--grid", default="1,1,8,1", help="the split grid x,y,z,data (z > 1)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "context_memory.json"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    head = common.header()
    grid = tuple(int(v) for v in args.grid.split(","))
    g_z = grid[2]
    cfg = model_config(args)
    started = time.perf_counter()
    acts = unsplit_activations(cfg)
    print(f"unsplit activations at {args.seq} tokens: {acts / 2**30:.3f} GiB", flush=True)
    modes: dict[str, Any] = {}
    for mode in ("ring", "all-gather"):
        ranks = run_local(
            grid[0] * grid[1] * grid[2] * grid[3],
            _split_step,
            cfg,
            mode,
            grid=grid,
            every_rank=True,
            timeout=7200,
        )
        peak, state = max(r["peak"] for r in ranks), max(r["state"] for r in ranks)
        bound = FACTOR * acts / g_z + state
        modes[mode] = {"peak_bytes": peak, "state_bytes": state, "bound_bytes": bound, "within": peak <= bound}
        modes[mode]["peak_over_share"] = (peak - state) / (acts / g_z)
        print(
            f"{mode:>10}: peak per rank {peak / 2**30:.3f} GiB (state {state / 2**20:.1f} MiB; "
            f"{modes[mode]['peak_over_share']:.2f} × activations/G_z beyond it); bound {bound / 2**30:.3f} GiB",
            flush=True,
        )
    result = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unsplit_activation_bytes": acts,
        "g_z": g_z,
        "factor": FACTOR,
        "modes": modes,
        "seconds": time.perf_counter() - started,
    }
    common.save(args.out, result, head)
    print(f"saved {args.out}")
    bound = modes["ring"]["bound_bytes"]
    print(
        f"context memory: seq = {args.seq} on G_z = {g_z}, ring {modes['ring']['peak_bytes'] / 2**30:.3f} GiB, "
        f"all-gather {modes['all-gather']['peak_bytes'] / 2**30:.3f} GiB per rank; bound {bound / 2**30:.3f} GiB "
        f"({FACTOR} × activations/G_z + state)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
