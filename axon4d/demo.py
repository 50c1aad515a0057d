"""The MLP demo: train an MLP built from axon4d.Linear on the 4D grid and show that its loss curve
is the curve of the same MLP trained in one process with plain torch.nn.Linear.

    torchrun --nproc-per-node 8 -m axon4d.demo --grid 2,2,2,1

Every rank trains its shard of the MLP (normal and transposed layers alternate, so activations
never need redistributing, docs/design.md §2) on a synthetic regression task. Afterwards rank 0 trains
the plain MLP from the same initial weights on the same batches in this one process, prints both
curves side by side, and writes ``loss.png`` and ``result.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from tqdm import tqdm

from axon4d import activations
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.nn import Linear


def build_dense(width: int, hidden: int, depth: int) -> nn.Sequential:
    """The reference MLP: ``depth`` blocks of Linear(width→hidden), GELU, Linear(hidden→width)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def parallelize(dense: nn.Sequential, grid: Grid) -> nn.Sequential:
    """The same MLP with each Linear replaced by its 3D shard: up-projections normal, down transposed."""
    out: list[nn.Module] = []
    normal = True
    for m in dense:
        if isinstance(m, nn.Linear):
            out.append(Linear.from_dense(m, transpose=not normal, grid=grid))
            normal = not normal
        else:
            out.append(m)
    return nn.Sequential(*out)


def batches(steps: int, batch: int, width: int, seed: int):
    """Deterministic (input, target) batches of a fixed random teacher function, on every rank."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(width, width, generator=gen) / width**0.5
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen)
        yield x, torch.tanh(x @ teacher) + 0.1 * x


def train_parallel(model: nn.Module, args: argparse.Namespace, grid: Grid) -> list[float]:
    """Train the sharded MLP; return the global mean-squared error of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    out_axis: Axis = "x"  # the last layer is transposed: its output features are split over x
    losses = []
    bar = tqdm(total=args.steps, desc="4D grid", disable=grid.rank != 0, ncols=90)
    for x_full, t_full in batches(args.steps, args.batch, args.width, args.seed):
        x = activations.shard_input(x_full, grid=grid)
        t = activations.shard_features(activations.shard_batch(t_full, grid), out_axis, grid)
        y = model(x)
        # each rank: its feature block's share of the mean over its own tokens (DDP convention)
        loss = (y - t).square().sum() / (y.shape[0] * args.width)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = grid.comm.all_reduce(loss.detach().reshape(1).clone(), out_axis).wait()
        total = grid.comm.all_reduce(total, "batch").wait() / grid.size("batch")
        losses.append(float(total))
        bar.set_postfix(loss=f"{losses[-1]:.5f}")
        bar.update()
    bar.close()
    return losses


def train_reference(model: nn.Module, args: argparse.Namespace) -> list[float]:
    """Train the plain MLP in this one process on the same batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for x, t in batches(args.steps, args.batch, args.width, args.seed):
        loss = (model(x) - t).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def plot(path: str, ours: list[float], ref: list[float], grid: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ref, label="1 process, torch.nn.Linear", linewidth=3, alpha=0.5)
    ax.plot(ours, label=f"axon4d on grid {grid}", linewidth=1, linestyle="--")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean squared error")
    ax.set_title("MLP: 4D-parallel vs single-process loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", default="2,2,2,1", help="x,y,z,data sizes (one may be -1)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch (split over data × z)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="build/demo")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    grid = runtime.init(grid=tuple(int(s) for s in args.grid.split(",")), seed=args.seed)
    dense = build_dense(args.width, args.hidden, args.depth)  # same weights on every rank (same seed)
    initial = {k: v.clone() for k, v in dense.state_dict().items()}
    model = parallelize(dense, grid)
    if grid.rank == 0:
        print(grid)
    grid.comm.log.clear()
    start = time.perf_counter()
    ours = train_parallel(model, args, grid)
    elapsed = time.perf_counter() - start
    summary = grid.comm.log.summary()
    line = grid.comm.log.format_summary()
    rank = grid.rank
    runtime.shutdown()
    if rank != 0:
        return 0

    dense.load_state_dict(initial)
    ref = train_reference(dense, args)
    diffs = [abs(a - b) / b for a, b in zip(ours, ref)]
    print(f"\n{'step':>6} {'axon4d':>12} {'1 process':>12} {'rel diff':>10}")
    for s in sorted({0, 1, 9, 49, 99, 199, args.steps - 1} & set(range(args.steps))):
        print(f"{s + 1:>6} {ours[s]:>12.6f} {ref[s]:>12.6f} {diffs[s]:>10.1e}")
    print(f"\nmax relative difference over {args.steps} steps: {max(diffs):.1e}")
    print(f"rank 0 communication over the run: {line}")
    print(f"{args.steps} steps on grid {args.grid} in {elapsed:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    plot(os.path.join(args.out, "loss.png"), ours, ref, args.grid)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(
            {
                "grid": args.grid,
                "args": vars(args),
                "axon4d": ours,
                "reference": ref,
                "max_rel_diff": max(diffs),
                "comm": summary,
                "seconds": elapsed,
            },
            f,
            indent=1,
        )
    print(f"loss curves: {os.path.join(args.out, 'loss.png')}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
