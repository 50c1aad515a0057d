"""The cost of axon4d's machinery where there is nothing to communicate (issue 18, item 4).

On a grid of one rank (``axon4d.init(grid=(1, 1, 1, 1))`` in this one process, no launcher)
``axon4d.Linear(in, out)`` must cost no more than ``torch.nn.Linear(in, out)``: the scheduler,
the comm log and the hooks must do nothing measurable when every axis has one rank.

For every size (in, out) = (n, n), n in ``--sizes``, and every token count T in ``--tokens``,
both layers hold the same fp32 weights and bias. One step is forward + backward on T tokens: an
input (T, in) that requires its gradient, loss = (y·v).sum() for a fixed v of (out,), backward,
then every gradient set to None. Before timing, the outputs and the input, weight and bias
gradients of the two layers are compared (they must agree to fp32 rounding; whether they are
bitwise equal is recorded). Then the two layers' steps are timed interleaved (axon4d, torch,
axon4d, torch, …) after ``--warmup`` steps each, with enough repetitions for each layer to run at
least ``--min-seconds`` (and at least ``--min-reps`` steps); a point's time is the median of its
steps, and its ratio is axon4d / torch. Compute runs on ``torch.set_num_threads(--threads)``
threads (default: every core this process may run on).

    python bench/overhead.py                    # 4 sizes × 3 token counts, ~0.3 s per layer and point
    python bench/overhead.py --quick            # 2 small points, a few steps (what the test runs)
    python bench/overhead.py --sizes 1024 --tokens 4096 --min-seconds 2

Saves ``bench/results/overhead.json`` (``--quick``: only with ``--out``): the result header
(bench/common.py: command, commit, host, date), the arguments, the date, the host (CPU model,
AVX-512, cores, load average), torch's version and threads, and every point's samples, medians and
ratio. Prints a table of the points; the last line is
``overhead: worst = R× at (IN×OUT, T tokens), median = M×`` (M: the median of the points' ratios).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import axon4d  # noqa: E402
from axon4d import device as devices  # noqa: E402

#: --quick: two small points, five timed steps per layer and point
QUICK = {"sizes": "512,1024", "tokens": "256", "min_seconds": 0.0, "min_reps": 5, "warmup": 1}


def make_step(layer: nn.Module, x: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
    """One training step of ``layer`` on ``x``: forward, loss (y·v).sum(), backward, gradients to None."""

    def step() -> None:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        (layer(x) * v).sum().backward()

    return step


def check_equal(ref: nn.Linear, layer: axon4d.Linear, x: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Max abs difference of output, input gradient, weight and bias gradients (axon4d vs torch)
    relative to the torch tensor's largest entry; raises if any exceeds fp32 rounding."""
    got: dict[str, list[torch.Tensor]] = {}
    for name, mod in (("axon4d", layer), ("torch", ref)):
        xi = x.detach().clone().requires_grad_()
        y = mod(xi)
        (y * v).sum().backward()
        assert mod.bias is not None and mod.weight.grad is not None and mod.bias.grad is not None
        got[name] = [y.detach(), xi.grad, mod.weight.grad.view(ref.out_features, ref.in_features), mod.bias.grad]
        mod.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"bitwise_equal": True}
    for what, a, b in zip(("output", "input_grad", "weight_grad", "bias_grad"), got["axon4d"], got["torch"]):
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
        out[what] = err
        out["bitwise_equal"] &= bool(torch.equal(a, b))
        if err > 1e-5:
            raise RuntimeError(f"axon4d.Linear differs from torch.nn.Linear in {what}: relative error {err:.2e} > 1e-5")
    return out


def time_point(n_in: int, n_out: int, tokens: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Interleaved step times of axon4d.Linear and torch.nn.Linear on one (in, out, tokens) point."""
    gen = torch.Generator().manual_seed(n_in * 7 + tokens)
    ref = nn.Linear(n_in, n_out, device=device)
    layer = axon4d.Linear.from_dense(ref)
    x = devices.to_device(torch.randn(tokens, n_in, generator=gen), device).requires_grad_()
    v = devices.to_device(torch.randn(n_out, generator=gen), device)
    agreement = check_equal(ref, layer, x, v)
    steps = {"axon4d": make_step(layer, x, v), "torch": make_step(ref, x, v)}

    def timed(step: Callable[[], None]) -> float:
        devices.synchronize(device)
        start = time.perf_counter()
        step()
        devices.synchronize(device)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        for step in steps.values():
            step()
    probe = timed(steps["torch"])  # how many steps make --min-seconds
    reps = max(args.min_reps, math.ceil(args.min_seconds / probe))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            samples[name].append(timed(step))
    medians = {name: common.median(s) for name, s in samples.items()}
    return {
        "in": n_in,
        "out": n_out,
        "tokens": tokens,
        "reps": reps,
        "agreement": agreement,
        "samples_s": samples,
        "median_s": medians,
        "ratio": medians["axon4d"] / medians["torch"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,1024,2048,4096", help="n of the square layers n×n, comma-separated")
    p.add_argument("--tokens", default="256,1024,4096", help="token counts, comma-separated")
    p.add_argument("--min-seconds", type=float, default=0.3, help="time each layer at least this long per point")
    p.add_argument("--min-reps", type=int, default=5, help="at least this many timed steps per layer and point")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per layer and point")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="2 small points, 5 steps each (for the test)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/overhead.json; --quick: none)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    out = args.out or (None if args.quick else os.path.join(ROOT, "bench", "results", "overhead.json"))
    torch.set_num_threads(args.threads)

    grid = axon4d.init(grid=(1, 1, 1, 1), seed=0)
    head = common.header()
    host = dict(head["host"])  # CPU model, AVX-512, cores, load average, torch and Python versions
    host["loadavg_start"] = host.pop("loadavg")
    print(
        f"host: {host['cpu_model']}, AVX-512 {'yes' if host['has_avx512'] else 'no'}, "
        f"{host['cores_available']} cores available, load {host['loadavg_start'][0]:.2f}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {grid.device}",
        flush=True,
    )
    print(f"{'in×out':>11} {'tokens':>6} {'torch ms':>9} {'axon4d ms':>9} {'ratio':>6} {'reps':>5}", flush=True)
    points = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            for tokens in (int(t) for t in args.tokens.split(",")):
                pt = time_point(n, n, tokens, args, grid.device)
                points.append(pt)
                med = pt["median_s"]
                print(
                    f"{f'{n}×{n}':>11} {tokens:>6} {med['torch'] * 1e3:9.3f} {med['axon4d'] * 1e3:9.3f} "
                    f"{pt['ratio']:6.3f} {pt['reps']:5d}",
                    flush=True,
                )
    finally:
        axon4d.shutdown()
    worst = max(points, key=lambda pt: pt["ratio"])
    median = common.median(pt["ratio"] for pt in points)
    host["loadavg_end"] = os.getloadavg()
    if out is not None:
        result = {
            "args": vars(args),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": host,
            "threads": torch.get_num_threads(),
            "device": str(grid.device),
            "points": points,
            "summary": {"worst_ratio": worst["ratio"], "median_ratio": median},
        }
        print(f"saved {common.save(out, result, head)}")
    print(
        f"overhead: worst = {worst['ratio']:.3f}× at ({worst['in']}×{worst['out']}, {worst['tokens']} tokens), "
        f"median = {median:.3f}×"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
